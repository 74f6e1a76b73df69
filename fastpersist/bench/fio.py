"""The disk's ceiling as fio measures it: sequential O_DIRECT libaio write and read,
and a buffered sequential read (through the page cache, kernel readahead).

fio is the reference every storage vendor quotes; running it on the same
directory, with the same byte count, in the same benchmark run, turns our
GB/s into a fraction of what the hardware can do. One fio configuration is not
a ceiling (a virtual disk may reward two writers, or the page cache), so a
sweep tries several: O_DIRECT libaio over block sizes x queue depths, the
same with two jobs each writing half the file (``numjobs=2``), and a
buffered write ended by an fsync (``--direct=0 --ioengine=psync
--end_fsync=1``, whose time includes the fsync). The best configuration of
each direction is then repeated; the ceiling is the median of its runs
interleaved with the benchmark's own (``--output-format=json``). Every round also reads the file once through the
page cache (``--direct=0 --ioengine=psync --bs=1M``, cold: ``--invalidate=1``
drops it first): on some machines, virtual disks especially, buffered readers
beat O_DIRECT, so the *read ceiling* is the higher of the two medians
(:attr:`FioCeiling.read_ceiling_gbps`).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

from fastpersist.units import format_block

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
    #: parallel fio jobs, each writing/reading its own contiguous part of the file
    numjobs: int = 1
    ioengine: str = "libaio"

    def describe(self) -> str:
        """The configuration in fio's words, e.g. ``"libaio direct=1 bs=8M iodepth=8 numjobs=2"``."""
        text = f"{self.ioengine} direct={1 if self.direct else 0} bs={format_block(self.block_size)}"
        if self.ioengine != "psync":
            text += f" iodepth={self.iodepth}"
        if self.numjobs > 1:
            text += f" numjobs={self.numjobs}"
        if self.rw == "write":
            text += " end_fsync=1"
        return text


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
    numjobs: int = 1,
    timeout: Optional[float] = None,
) -> FioRun:
    """Run one sequential fio job on ``filename`` and return its bandwidth.

    ``rw="write"`` ends with an fsync of the file (``--end_fsync=1``; fio's time
    includes it); ``size`` is rounded down to a multiple of ``block_size``
    (of ``numjobs * block_size`` with several jobs: job ``i`` then takes the
    ``i``-th contiguous part, ``--offset_increment``, and the bandwidth is the
    group's, ``--group_reporting``). Raises :class:`FioError` when fio is
    missing, fails, or its report cannot be read.
    """
    if rw not in ("write", "read"):
        raise ValueError(f"rw must be 'write' or 'read', got {rw!r}")
    exe = fio_executable()
    if exe is None:
        raise FioError("fio is not on PATH (install it, e.g. `apt-get install fio`)")
    if numjobs < 1:
        raise ValueError(f"numjobs must be positive, got {numjobs}")
    per_job = size // numjobs // block_size * block_size
    nbytes = per_job * numjobs
    if nbytes <= 0:
        raise ValueError(f"size {size} is smaller than {numjobs} x the block size {block_size}")
    cmd = [
        exe,
        f"--name=fastpersist-{rw}",
        f"--filename={filename}",
        f"--rw={rw}",
        f"--bs={block_size}",
        f"--iodepth={iodepth}",
        f"--size={per_job}",
        f"--ioengine={ioengine}",
        f"--direct={1 if direct else 0}",
        f"--numjobs={numjobs}",
        "--invalidate=1",
        "--output-format=json",
    ]
    if numjobs > 1:
        cmd += [f"--offset_increment={per_job}", "--group_reporting"]
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
    return FioRun(rw=rw, block_size=block_size, iodepth=iodepth, nbytes=done, gbps=bw / 1e9, direct=direct,
                  numjobs=numjobs, ioengine=ioengine)


@dataclass(frozen=True)
class FioConfig:
    """One configuration of the sweep."""

    block_size: int
    iodepth: int
    direct: bool
    numjobs: int = 1
    ioengine: str = "libaio"


def sweep_configs(
    size: int, block_sizes: Sequence[int], iodepths: Sequence[int], direct: bool, extras: bool = True
) -> list[tuple[str, FioConfig]]:
    """The sweep's jobs in order, ``(rw, config)``: a write then a read for each block size x
    iodepth (O_DIRECT when ``direct``); with ``extras``, the largest fitting block size at
    the smallest iodepth with two jobs (write, read), then a buffered write (psync, 1 MiB,
    ended by fsync)."""
    jobs: list[tuple[str, FioConfig]] = []
    fitting = [bs for bs in block_sizes if size >= bs]
    for bs in fitting:
        for depth in iodepths:
            cfg = FioConfig(bs, depth, direct)
            jobs += [("write", cfg), ("read", cfg)]
    if extras and fitting:
        bs = max(fitting)
        if size >= 2 * bs:
            cfg = FioConfig(bs, min(iodepths), direct, numjobs=2)
            jobs += [("write", cfg), ("read", cfg)]
        jobs.append(("write", FioConfig(min(1 << 20, size // 4096 * 4096), 1, False, ioengine="psync")))
    return jobs


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
        extras: bool = True,
    ) -> None:
        self.size = size
        self.direct = direct
        self.block_sizes = tuple(block_sizes)
        self.iodepths = tuple(iodepths)
        self.on_run = on_run
        self.jobs = sweep_configs(size, self.block_sizes, self.iodepths, direct, extras)
        self.filename = os.path.join(os.path.abspath(directory), f".fastpersist-fio-{os.getpid()}.dat")
        extra = ""
        if extras:
            extra = ("; also numjobs=2 (each job half the file) at the largest bs and smallest iodepth, "
                     "and a buffered write: --ioengine=psync --direct=0 --bs=1M --end_fsync=1")
        self.result = FioCeiling(
            command=f"fio --ioengine=libaio --direct={1 if direct else 0} --rw=write|read "
            f"--bs={{{','.join(str(b) for b in self.block_sizes)}}} --iodepth={{{','.join(map(str, self.iodepths))}}} "
            f"--size={size} --end_fsync=1 (writes){extra} (the sweep picks each direction's best configuration; "
            "the ceiling is the median of the rounds run beside the methods; every write into a fresh file); "
            "each round also fio --ioengine=psync --direct=0 --bs=1M --rw=read (buffered, cold)"
        )
        if fio_executable() is None:
            self.result.error = "fio not found on PATH"

    @property
    def ok(self) -> bool:
        """Whether fio can still run (found, and no job failed so far)."""
        return self.result.error is None

    def _one(self, rw: str, cfg: FioConfig) -> FioRun:
        if rw == "write":
            self._remove()
            os.sync()  # the previous file's blocks freed outside the timing
        run = run_fio(self.filename, rw, self.size, cfg.block_size, cfg.iodepth, direct=cfg.direct,
                      ioengine=cfg.ioengine, numjobs=cfg.numjobs)
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
        """Run every configuration of :func:`sweep_configs` and keep the best of each direction."""

        def step() -> None:
            for rw, cfg in self.jobs:
                self._one(rw, cfg)
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
            w = self._one("write", _config_of(res.best_write))
            r = self._one("read", _config_of(res.best_read))
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
    extras: bool = True,
) -> FioCeiling:
    """Sweep ``block_sizes`` x ``iodepths`` in ``directory``, then ``repeat`` rounds back to back.

    The standalone form of :class:`FioProbe` (benchmarks that can interleave
    the rounds with what they measure use the class). Never raises for fio
    problems; the file is removed afterwards.
    """
    probe = FioProbe(directory, size, block_sizes=block_sizes, iodepths=iodepths, direct=direct, on_run=on_run,
                     extras=extras)
    try:
        probe.sweep()
        for _ in range(repeat):
            probe.round()
    finally:
        probe.close()
    return probe.result


def fio_sweep_count(size: int, block_sizes: Sequence[int], iodepths: Sequence[int], extras: bool = True) -> int:
    """Number of fio jobs :meth:`FioProbe.sweep` runs (for progress bars); each round adds 3."""
    return len(sweep_configs(size, block_sizes, iodepths, True, extras))


def _config_of(run: FioRun) -> FioConfig:
    return FioConfig(run.block_size, run.iodepth, run.direct, run.numjobs, run.ioengine)
