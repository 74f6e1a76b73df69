"""The disk's ceiling as fio measures it: sequential O_DIRECT libaio write and read.

fio is the reference every storage vendor quotes; running it on the same
directory, with the same byte count, in the same benchmark run, turns our
GB/s into a fraction of what the hardware can do. The ceiling is the best of a
small sweep of block sizes and queue depths (``--output-format=json``).
"""

from __future__ import annotations

import json
import os
import statistics
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

DEFAULT_BLOCK_SIZES = (1 << 20, 8 << 20)
DEFAULT_IODEPTHS = (8, 32)


class FioError(RuntimeError):
    """fio failed or printed something that is not its JSON report."""


@dataclass
class FioRun:
    """One fio job: ``rw`` is ``"write"`` or ``"read"``; ``gbps`` in decimal GB/s."""

    rw: str
    block_size: int
    iodepth: int
    nbytes: int
    gbps: float
    direct: bool


@dataclass
class FioCeiling:
    """Best sequential write and read rate of a fio sweep (``None`` when fio could not run)."""

    write_gbps: Optional[float] = None
    read_gbps: Optional[float] = None
    best_write: Optional[FioRun] = None
    best_read: Optional[FioRun] = None
    runs: list[FioRun] = field(default_factory=list)
    #: GB/s of every run of the best configuration (the ceiling is their median)
    write_repeats: list[float] = field(default_factory=list)
    read_repeats: list[float] = field(default_factory=list)
    error: Optional[str] = None
    command: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form."""
        return asdict(self)


def fio_executable() -> Optional[str]:
    """Path of ``fio`` on ``PATH``, or ``None``."""
    return shutil.which("fio")


def _parse_fio_json(stdout: str) -> dict[str, Any]:
    # fio may print notes ("fio: ...") before the JSON document.
    start = stdout.find("{")
    if start < 0:
        raise FioError(f"fio printed no JSON report: {stdout.strip()[:500]!r}")
    try:
        return json.loads(stdout[start:])
    except json.JSONDecodeError as exc:
        raise FioError(f"cannot parse fio's JSON report: {exc}") from exc


def run_fio(
    filename: str,
    rw: str,
    size: int,
    block_size: int,
    iodepth: int,
    *,
    direct: bool = True,
    ioengine: str = "libaio",
    timeout: Optional[float] = None,
) -> FioRun:
    """Run one sequential fio job on ``filename`` and return its bandwidth.

    ``rw="write"`` ends with an fsync of the file (``--end_fsync=1``); ``size`` is
    rounded down to a multiple of ``block_size``. Raises :class:`FioError` when
    fio is missing, fails, or its report cannot be read.
    """
    if rw not in ("write", "read"):
        raise ValueError(f"rw must be 'write' or 'read', got {rw!r}")
    exe = fio_executable()
    if exe is None:
        raise FioError("fio is not on PATH (install it, e.g. `apt-get install fio`)")
    nbytes = size // block_size * block_size
    if nbytes <= 0:
        raise ValueError(f"size {size} is smaller than the block size {block_size}")
    cmd = [
        exe,
        f"--name=fastpersist-{rw}",
        f"--filename={filename}",
        f"--rw={rw}",
        f"--bs={block_size}",
        f"--iodepth={iodepth}",
        f"--size={nbytes}",
        f"--ioengine={ioengine}",
        f"--direct={1 if direct else 0}",
        "--numjobs=1",
        "--invalidate=1",
        "--output-format=json",
    ]
    if rw == "write":
        cmd.append("--end_fsync=1")
    if timeout is None:
        timeout = 120 + nbytes / 20e6  # 20 MB/s floor: a stuck job is an error, a slow disk is not
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise FioError(f"fio {rw} on {filename!r} did not finish within {timeout:.0f} s") from None
    if proc.returncode != 0:
        msg = (proc.stderr.strip() or proc.stdout.strip())[-800:]
        raise FioError(f"fio {rw} on {filename!r} failed (exit {proc.returncode}): {msg}")
    report = _parse_fio_json(proc.stdout)
    try:
        job = report["jobs"][0]
        if job.get("error"):
            raise FioError(f"fio {rw} on {filename!r} reported error {job['error']}")
        stats = job[rw]
        bw = float(stats["bw_bytes"])
        done = int(stats.get("io_bytes", nbytes))
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise FioError(f"unexpected fio report layout ({exc!r})") from exc
    if bw <= 0:
        raise FioError(f"fio {rw} on {filename!r} reported no bandwidth")
    return FioRun(rw=rw, block_size=block_size, iodepth=iodepth, nbytes=done, gbps=bw / 1e9, direct=direct)


def fio_ceiling(
    directory: str,
    size: int,
    *,
    block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES,
    iodepths: Sequence[int] = DEFAULT_IODEPTHS,
    direct: bool = True,
    on_run: Optional[Callable[[FioRun], None]] = None,
    repeat: int = 3,
) -> FioCeiling:
    """Sweep ``block_sizes`` x ``iodepths``, write then read a ``size``-byte file in ``directory``.

    The ceiling of each direction is the median of ``repeat`` runs of its best
    configuration (the same statistic the benchmarks report for fastpersist, so a
    lucky single fio run does not set the bar). Every write goes to a fresh file,
    as a checkpoint does. Returns the write and read ceilings. Never raises for fio problems: a
    missing fio or a failing job is reported in ``FioCeiling.error`` (runs that
    succeeded before it are kept). The file is removed afterwards.
    """
    result = FioCeiling(
        command=f"fio --ioengine=libaio --direct={1 if direct else 0} --rw=write|read "
        f"--bs={{{','.join(str(b) for b in block_sizes)}}} --iodepth={{{','.join(map(str, iodepths))}}} "
        f"--size={size} (best configuration of each, median of {repeat} runs; writes into a fresh file)"
    )
    if fio_executable() is None:
        result.error = "fio not found on PATH"
        return result
    filename = os.path.join(os.path.abspath(directory), f".fastpersist-fio-{os.getpid()}.dat")

    def one(rw: str, bs: int, depth: int) -> FioRun:
        if rw == "write":
            # Like a checkpoint: a new file each time, its blocks allocated by the
            # write, the previous file's blocks freed outside the timing.
            try:
                os.unlink(filename)
            except FileNotFoundError:
                pass
            os.sync()
        run = run_fio(filename, rw, size, bs, depth, direct=direct)
        result.runs.append(run)
        if on_run is not None:
            on_run(run)
        return run

    try:
        for bs in block_sizes:
            if size < bs:
                continue
            for depth in iodepths:
                for rw in ("write", "read"):
                    one(rw, bs, depth)
        if not result.runs:
            result.error = f"size {size} is smaller than every block size of the sweep"
        for rw, repeats in (("write", result.write_repeats), ("read", result.read_repeats)):
            sweep = [r for r in result.runs if r.rw == rw]
            if not sweep:
                continue
            best = max(sweep, key=lambda r: r.gbps)
            repeats.append(best.gbps)
            for _ in range(repeat - 1):
                if rw == "read":
                    one("write", best.block_size, best.iodepth)  # a file to read, written the same way
                repeats.append(one(rw, best.block_size, best.iodepth).gbps)
            if rw == "write":
                result.best_write, result.write_gbps = best, statistics.median(repeats)
            else:
                result.best_read, result.read_gbps = best, statistics.median(repeats)
    except (FioError, ValueError, OSError) as exc:
        result.error = str(exc)
    finally:
        try:
            os.unlink(filename)
        except OSError:  # never created (fio failed first), or the directory is unusable
            pass
    return result


def fio_runs_count(size: int, block_sizes: Sequence[int], iodepths: Sequence[int]) -> int:
    """Number of fio jobs :func:`fio_ceiling` will run (for progress bars), with ``repeat`` 3."""
    sweep = 2 * len(iodepths) * sum(1 for bs in block_sizes if size >= bs)
    return sweep + (6 if sweep else 0)  # 2 more writes, 2 more reads, 2 writes to read from
