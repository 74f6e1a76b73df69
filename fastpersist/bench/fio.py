"""The disk's ceiling as fio measures it: sequential O_DIRECT libaio write and read,
and a buffered sequential read (through the page cache, kernel readahead).

fio is the reference every storage vendor quotes; running it on the same
directory, with the same byte count, in the same benchmark run, turns our
GB/s into a fraction of what the hardware can do. A small sweep of block sizes
and queue depths picks fio's best configuration; the ceiling is the median of
that configuration's runs interleaved with the benchmark's own
(``--output-format=json``). Every round also reads the file once through the
page cache (``--direct=0 --ioengine=psync --bs=1M``, cold: ``--invalidate=1``
drops it first): on some machines, virtual disks especially, buffered readers
beat O_DIRECT, so the *read ceiling* is the higher of the two medians
(:attr:`FioCeiling.read_ceiling_gbps`).
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
    """fio's sequential write and read ceilings (``None`` when fio could not run).

    ``best_write``/``best_read``: the sweep's best run of each direction (its
    configuration is the one repeated); ``write_repeats``/``read_repeats``: GB/s
    of the repeated rounds, whose median is the ceiling; ``runs``: every job.
    """

    write_gbps: Optional[float] = None
    read_gbps: Optional[float] = None
    best_write: Optional[FioRun] = None
    best_read: Optional[FioRun] = None
    runs: list[FioRun] = field(default_factory=list)
    #: GB/s of every round of the best configuration (the ceiling is their median)
    write_repeats: list[float] = field(default_factory=list)
    read_repeats: list[float] = field(default_factory=list)
    #: median GB/s of the rounds' buffered sequential reads (page cache, 1 MiB, psync)
    buffered_read_gbps: Optional[float] = None
    buffered_read_repeats: list[float] = field(default_factory=list)
    error: Optional[str] = None
    command: str = ""

    @property
    def read_ceiling_gbps(self) -> Optional[float]:
        """The higher of the O_DIRECT and the buffered read medians (None: neither measured)."""
        vals = [v for v in (self.read_gbps, self.buffered_read_gbps) if v]
        return max(vals) if vals else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form (with ``read_ceiling_gbps``)."""
        d = asdict(self)
        d["read_ceiling_gbps"] = self.read_ceiling_gbps
        return d


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


class FioProbe:
    """fio on one directory: a sweep that picks the best configuration of each
    direction, then *rounds* of one write and one read with those configurations.

    A benchmark runs one round per repeat *in its rotation* (beside the methods it
    compares), so a shared disk's slow and fast phases hit fio and the methods
    alike; the ceiling is the median of the rounds. The sweep's own runs do not
    count: the best of several noisy runs is biased upwards. Every write goes to
    a fresh file (the previous one deleted and synced outside the timing), as a
    checkpoint does; the read reads the file the round just wrote.

    Never raises for fio problems: a missing fio or a failing job sets
    ``result.error`` (runs that succeeded before it are kept) and later calls do
    nothing.
    """

    def __init__(
        self,
        directory: str,
        size: int,
        *,
        block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES,
        iodepths: Sequence[int] = DEFAULT_IODEPTHS,
        direct: bool = True,
        on_run: Optional[Callable[[FioRun], None]] = None,
    ) -> None:
        self.size = size
        self.direct = direct
        self.block_sizes = tuple(block_sizes)
        self.iodepths = tuple(iodepths)
        self.on_run = on_run
        self.filename = os.path.join(os.path.abspath(directory), f".fastpersist-fio-{os.getpid()}.dat")
        self.result = FioCeiling(
            command=f"fio --ioengine=libaio --direct={1 if direct else 0} --rw=write|read "
            f"--bs={{{','.join(str(b) for b in self.block_sizes)}}} --iodepth={{{','.join(map(str, self.iodepths))}}} "
            f"--size={size} (sweep picks each direction's best configuration; the ceiling is the median of "
            "the rounds run beside the methods; every write into a fresh file); each round also "
            "fio --ioengine=psync --direct=0 --bs=1M --rw=read (buffered, cold)"
        )
        if fio_executable() is None:
            self.result.error = "fio not found on PATH"

    @property
    def ok(self) -> bool:
        """Whether fio can still run (found, and no job failed so far)."""
        return self.result.error is None

    def _one(self, rw: str, bs: int, depth: int) -> FioRun:
        if rw == "write":
            self._remove()
            os.sync()  # the previous file's blocks freed outside the timing
        run = run_fio(self.filename, rw, self.size, bs, depth, direct=self.direct)
        self.result.runs.append(run)
        if self.on_run is not None:
            self.on_run(run)
        return run

    def _buffered_read(self) -> Optional[FioRun]:
        """One cold buffered sequential read of the round's file (not fatal if it fails)."""
        bs = min(1 << 20, self.size)
        try:
            run = run_fio(self.filename, "read", self.size, bs, 1, direct=False, ioengine="psync")
        except (FioError, ValueError, OSError):
            return None
        self.result.runs.append(run)
        if self.on_run is not None:
            self.on_run(run)
        return run

    def _remove(self) -> None:
        try:
            os.unlink(self.filename)
        except FileNotFoundError:
            pass

    def _guard(self, step: Callable[[], None]) -> None:
        if not self.ok:
            return
        try:
            step()
        except (FioError, ValueError, OSError) as exc:
            self.result.error = str(exc)

    def sweep(self) -> None:
        """Run every block size x iodepth (write, then read) and keep the best of each direction."""

        def step() -> None:
            for bs in self.block_sizes:
                if self.size < bs:
                    continue
                for depth in self.iodepths:
                    for rw in ("write", "read"):
                        self._one(rw, bs, depth)
            runs = self.result.runs
            if not runs:
                raise ValueError(f"size {self.size} is smaller than every block size of the sweep")
            self.result.best_write = max((r for r in runs if r.rw == "write"), key=lambda r: r.gbps)
            self.result.best_read = max((r for r in runs if r.rw == "read"), key=lambda r: r.gbps)
            self._remove()

        self._guard(step)

    def round(self) -> None:
        """One write (fresh file) and one read with the sweep's best configurations; updates the ceilings."""
        res = self.result
        if res.best_write is None or res.best_read is None:
            return

        def step() -> None:
            w = self._one("write", res.best_write.block_size, res.best_write.iodepth)
            r = self._one("read", res.best_read.block_size, res.best_read.iodepth)
            b = self._buffered_read()
            self._remove()
            res.write_repeats.append(w.gbps)
            res.read_repeats.append(r.gbps)
            res.write_gbps = statistics.median(res.write_repeats)
            res.read_gbps = statistics.median(res.read_repeats)
            if b is not None:
                res.buffered_read_repeats.append(b.gbps)
                res.buffered_read_gbps = statistics.median(res.buffered_read_repeats)

        self._guard(step)

    def close(self) -> None:
        """Remove fio's file (idempotent)."""
        try:
            self._remove()
        except OSError:  # never created (fio failed first), or the directory is unusable
            pass


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
    """Sweep ``block_sizes`` x ``iodepths`` in ``directory``, then ``repeat`` rounds back to back.

    The standalone form of :class:`FioProbe` (benchmarks that can interleave
    the rounds with what they measure use the class). Never raises for fio
    problems; the file is removed afterwards.
    """
    probe = FioProbe(directory, size, block_sizes=block_sizes, iodepths=iodepths, direct=direct, on_run=on_run)
    try:
        probe.sweep()
        for _ in range(repeat):
            probe.round()
    finally:
        probe.close()
    return probe.result


def fio_sweep_count(size: int, block_sizes: Sequence[int], iodepths: Sequence[int]) -> int:
    """Number of fio jobs :meth:`FioProbe.sweep` runs (for progress bars); each round adds 2."""
    return 2 * len(iodepths) * sum(1 for bs in block_sizes if size >= bs)
