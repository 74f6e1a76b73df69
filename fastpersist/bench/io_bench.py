"""Raw I/O benchmark (like DeepSpeed's ``ds_io``): one large file, every engine setting.

For each configuration (engine x block size x queue depth x threads x O_DIRECT x
staged reads)
one ``size``-byte file is written from a pinned host tensor through
:class:`fastpersist.io.IOHandle` (the write includes the file's ``fsync``), its
pages are dropped from the page cache (``posix_fadvise DONTNEED``), and it is
read back into a second pinned tensor (a cold read). The first read of each
configuration is compared byte for byte with what was written. fio's
O_DIRECT ceiling on the same directory and byte count is measured in the same
run, with a buffered sequential read (see :mod:`fastpersist.bench.fio`); the read
ceiling is the higher of the two.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from fastpersist.bench import fio as fio_mod
from fastpersist.bench.fsutil import drop_page_cache, fsync_dir, remove_path
from fastpersist.machine import MachineInfo, collect_machine_info
from fastpersist.bench.progress import progress
from fastpersist.units import gbps, median, ratio
from fastpersist.config import get_default
from fastpersist.io import IOHandle, pinned_empty

COLD_READ_NOTE = (
    "cold reads: after each write the file is fsync'ed and dropped from the page cache with "
    "posix_fadvise(POSIX_FADV_DONTNEED) (no root needed)"
)


@dataclass(frozen=True)
class IOConfig:
    """One point of the sweep."""

    engine: str
    block_size: int
    queue_depth: int
    threads: int
    direct: bool
    stage_reads: bool = False  #: reads through the staging ring, copied out (``Config.read_staging``)


@dataclass
class IORunResult:
    """Timings of one configuration over ``repeat`` runs."""

    config: IOConfig
    nbytes: int
    write_s: list[float] = field(default_factory=list)
    read_s: list[float] = field(default_factory=list)
    engine_used: Optional[str] = None
    verified: Optional[bool] = None
    error: Optional[str] = None

    @property
    def write_gbps(self) -> list[float]:
        """GB/s of each write."""
        return [gbps(self.nbytes, s) for s in self.write_s]

    @property
    def read_gbps(self) -> list[float]:
        """GB/s of each cold read."""
        return [gbps(self.nbytes, s) for s in self.read_s]

    @property
    def write_median_gbps(self) -> Optional[float]:
        """Median write GB/s."""
        return median(self.write_gbps)

    @property
    def read_median_gbps(self) -> Optional[float]:
        """Median read GB/s."""
        return median(self.read_gbps)


@dataclass
class IOBenchResult:
    """Everything :func:`run_io_bench` measured."""

    machine: MachineInfo
    size: int
    repeat: int
    runs: list[IORunResult]
    fio: Optional[fio_mod.FioCeiling]
    notes: list[str] = field(default_factory=list)

    def best(self) -> tuple[Optional[IORunResult], Optional[IORunResult]]:
        """The configurations with the best median write and best median read."""
        ok = [r for r in self.runs if r.error is None and r.write_s]
        w = max(ok, key=lambda r: r.write_median_gbps or 0.0, default=None)
        rd = max(ok, key=lambda r: r.read_median_gbps or 0.0, default=None)
        return w, rd

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form, with per-run GB/s, medians and ratios to fio."""
        fio_w = self.fio.write_gbps if self.fio else None
        fio_r = self.fio.read_gbps if self.fio else None
        runs = []
        for r in self.runs:
            runs.append({
                **asdict(r.config),
                "engine_used": r.engine_used,
                "bytes": r.nbytes,
                "write_seconds": r.write_s,
                "read_seconds": r.read_s,
                "write_gbps": r.write_gbps,
                "read_gbps": r.read_gbps,
                "write_median_gbps": r.write_median_gbps,
                "read_median_gbps": r.read_median_gbps,
                "write_vs_fio": ratio(r.write_median_gbps, fio_w),
                "read_vs_fio": ratio(r.read_median_gbps, fio_r),
                "read_vs_read_ceiling": ratio(r.read_median_gbps, self.fio.read_ceiling_gbps if self.fio else None),
                "verified": r.verified,
                "error": r.error,
            })
        return {
            "benchmark": "io",
            "machine": self.machine.to_dict(),
            "size_bytes": self.size,
            "repeat": self.repeat,
            "runs": runs,
            "fio": self.fio.to_dict() if self.fio else None,
            "notes": list(self.notes),
        }


def io_configs(
    engines: Sequence[str],
    block_sizes: Sequence[int],
    queue_depths: Sequence[int],
    threads: Sequence[int],
    direct_modes: Sequence[bool],
    stage_modes: Sequence[bool] = (False,),
) -> list[IOConfig]:
    """Cartesian product of the settings, in a stable order."""
    return [
        IOConfig(engine=e, block_size=bs, queue_depth=qd, threads=t, direct=d, stage_reads=s)
        for e, d, bs, qd, t, s in itertools.product(
            engines, direct_modes, block_sizes, queue_depths, threads, stage_modes
        )
    ]


def fill_pattern(buf: torch.Tensor, seed: int) -> None:
    """Incompressible bytes (a filesystem that compresses or dedups must not flatter us)."""
    gen = torch.Generator().manual_seed(seed)
    words = buf.numel() // 8
    if words:
        buf[: words * 8].view(torch.int64).random_(generator=gen)
    tail = buf.numel() - words * 8
    if tail:
        buf[words * 8 :].random_(0, 256, generator=gen)


def _one_config(
    cfg: IOConfig,
    path: str,
    src: torch.Tensor,
    dst: torch.Tensor,
    repeat: int,
    on_step: Callable[[], None],
) -> IORunResult:
    result = IORunResult(config=cfg, nbytes=src.numel())
    try:
        handle = IOHandle(
            engine=cfg.engine,
            block_size=cfg.block_size,
            queue_depth=cfg.queue_depth,
            threads=cfg.threads,
            direct=cfg.direct,
            stage_reads=cfg.stage_reads,
        )
        directory = os.path.dirname(path)
        for i in range(repeat):
            remove_path(path)
            t0 = time.perf_counter()
            handle.pwrite(src, path, fsync=True)
            result.write_s.append(time.perf_counter() - t0)
            fsync_dir(directory)
            drop_page_cache(path)
            if i == 0:
                dst.zero_()
            t0 = time.perf_counter()
            handle.pread(dst, path)
            result.read_s.append(time.perf_counter() - t0)
            result.engine_used = handle.last_engine
            if i == 0:
                result.verified = bool(torch.equal(src, dst))
                if not result.verified:
                    result.error = "data read back differs from data written"
            on_step()
    except (OSError, EOFError, ValueError, RuntimeError, ImportError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        remove_path(path)
    return result


def run_io_bench(
    directory: str,
    *,
    size: int = 1 << 30,
    engines: Sequence[str] = ("aio", "psync"),
    block_sizes: Sequence[int] = (1 << 20, 8 << 20),
    queue_depths: Sequence[int] = (4, 8, 16),
    threads: Sequence[int] = (1, 2),
    direct_modes: Sequence[bool] = (True,),
    stage_modes: Optional[Sequence[bool]] = None,
    repeat: int = 3,
    fio: bool = True,
    fio_block_sizes: Sequence[int] = fio_mod.DEFAULT_BLOCK_SIZES,
    fio_iodepths: Sequence[int] = fio_mod.DEFAULT_IODEPTHS,
    progress: bool = True,
    seed: int = 0,
) -> IOBenchResult:
    """Measure write and cold-read GB/s of every configuration (see module docstring).

    A configuration that fails (e.g. an engine this machine lacks) is recorded
    with its error and the sweep goes on. ``fio=False`` skips the fio ceiling.
    ``stage_modes``: whether reads are staged (each value a sweep axis); ``None``:
    what loads do here (:meth:`fastpersist.Config.stages_reads` of the default
    configuration). Files are created in ``directory`` and removed afterwards.
    """
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    if repeat <= 0:
        raise ValueError(f"repeat must be positive, got {repeat}")
    machine = collect_machine_info(directory)
    if stage_modes is None:
        stage_modes = (get_default().stages_reads(),)
    configs = io_configs(engines, block_sizes, queue_depths, threads, direct_modes, stage_modes)
    if not configs:
        raise ValueError("no configuration to run (empty engine/block size/queue depth/thread list)")

    notes = [COLD_READ_NOTE, "write time includes fsync of the file; GB/s are decimal (1e9 bytes/s)"]
    n_fio = fio_mod.fio_sweep_count(size, fio_block_sizes, fio_iodepths) + 9 if fio and fio_mod.fio_executable() else 0
    bar = _progress(len(configs) * repeat + n_fio, progress)
    path = os.path.join(os.path.abspath(directory), f".fastpersist-bench-io-{os.getpid()}.dat")
    try:
        src = pinned_empty(size)
        dst = pinned_empty(size)
        fill_pattern(src, seed)
        runs = []
        for cfg in configs:
            bar.set_description(
                f"{cfg.engine} bs={cfg.block_size >> 10}K qd={cfg.queue_depth} t={cfg.threads} "
                f"{'direct' if cfg.direct else 'buffered'}{' staged' if cfg.stage_reads else ''}"
            )
            before = bar.n
            run = _one_config(cfg, path, src, dst, repeat, lambda: bar.update(1))
            bar.update(repeat - (bar.n - before))  # a failed config still advances the bar
            runs.append(run)
        ceiling = None
        if fio:
            bar.set_description("fio ceiling")
            ceiling = fio_mod.fio_ceiling(
                directory, size, block_sizes=fio_block_sizes, iodepths=fio_iodepths,
                direct=bool(machine.direct_io), on_run=lambda _r: bar.update(1),
            )
            if ceiling.error:
                notes.append(f"fio: {ceiling.error}")
    finally:
        bar.close()
    return IOBenchResult(machine=machine, size=size, repeat=repeat, runs=runs, fio=ceiling, notes=notes)


def _progress(total: int, enabled: bool) -> Any:
    """A labelled tqdm bar on a terminal, plain lines elsewhere (:mod:`fastpersist.bench.progress`)."""
    return progress(total, enabled, "preparing the buffers")
