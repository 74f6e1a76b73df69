"""``fastpersist bench save --device cuda`` and ``bench io --device cuda``: HBM <-> disk.

Both measure, in the same run, the two ceilings a GPU checkpoint cannot beat:
pinned host <-> device copy bandwidth (D2H and H2D, one copy of ``size`` bytes
between a page-locked host tensor and device memory, :func:`copy_ceilings`) and
fio's O_DIRECT disk bandwidth (:func:`fastpersist.bench.fio.fio_ceiling`).

``bench save --device cuda``: a state of CUDA tensors (``size`` bytes over a few
dozen tensors, fp32/bf16/fp16) saved durably with ``fastpersist.save`` (the GPU
path of :mod:`fastpersist.cudastage`) and with ``torch.save``, then loaded cold
(page cache dropped) with ``map_location="cuda"`` by ``fastpersist.load`` (the ring
of :mod:`fastpersist.cudaload`) and ``torch.load``; every load compared to the state.

``bench io --device cuda``: ``IOHandle.pwrite``/``pread`` of one CUDA tensor, for
each engine given (a non-cufile engine stages through pinned memory; ``cufile`` is
GPUDirect Storage, run only when :func:`fastpersist.io.cufile_status` says it is
available, else reported with the reason).

Figures are decimal GB/s, each run and the median. Raises ``RuntimeError`` when
there is no CUDA device.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence, TextIO

import torch

import fastpersist
from fastpersist.bench.fio import fio_ceiling
from fastpersist.bench.fsutil import drop_page_cache, fsync_path
from fastpersist.units import format_bytes, gbps, median
from fastpersist.io import IOHandle, cufile_status, gpu_path


def require_cuda(flag: str = "--device cuda") -> None:
    """Raise RuntimeError with a clear message when no CUDA device can be used."""
    if not torch.cuda.is_available():
        built = torch.version.cuda
        raise RuntimeError(
            f"{flag}: no CUDA device here (torch.cuda.is_available() is False; torch "
            + (f"built for CUDA {built}" if built else "is a CPU-only build") + "); run without --device cuda"
        )


@dataclass
class GpuFigures:
    """One measured quantity: GB/s of every run and their median."""

    name: str
    runs: list[float] = field(default_factory=list)
    error: Optional[str] = None

    @property
    def gbps(self) -> Optional[float]:
        return median(self.runs) if self.runs else None


@dataclass
class GpuBenchResult:
    """What ``bench save/io --device cuda`` measured (see the module docstring)."""

    kind: str
    size: int
    directory: str
    device: str
    gpu_path: dict[str, str]
    figures: list[GpuFigures] = field(default_factory=list)
    fio: Optional[dict[str, Any]] = None
    verified: Optional[bool] = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["medians"] = {f.name: f.gbps for f in self.figures}
        return d


def _sync() -> None:
    torch.cuda.synchronize()


def copy_ceilings(size: int, repeat: int) -> tuple[GpuFigures, GpuFigures]:
    """Pinned host <-> device bandwidth for one copy of ``size`` bytes (D2H, H2D)."""
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    d2h, h2d = GpuFigures("pinned D2H"), GpuFigures("pinned H2D")
    for _ in range(repeat):
        _sync()
        t = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        _sync()
        d2h.runs.append(gbps(size, time.perf_counter() - t))
        t = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        _sync()
        h2d.runs.append(gbps(size, time.perf_counter() - t))
    return d2h, h2d


def _fio(directory: str, size: int, use: bool) -> Optional[dict[str, Any]]:
    if not use:
        return None

    return fio_ceiling(directory, size, repeat=1).to_dict()


def cuda_state(size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """About ``size`` bytes of CUDA tensors in about 24 tensors, fp32, bf16 and fp16 in turn."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    per = max(4096, size // 24)
    state: dict[str, torch.Tensor] = {}
    left, i = size, 0
    while left > 0:
        dt = dtypes[i % 3]
        es = torch.empty(0, dtype=dt).element_size()
        elems = max(1, min(left, per) // es)
        state[f"layer{i}.weight"] = torch.randn(elems, generator=g, device="cuda").to(dt)
        left -= elems * es
        i += 1
    return state


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(b[k].is_cuda and torch.equal(a[k], b[k]) for k in a)


def run_gpu_save_bench(directory: str, *, size: int, repeat: int = 3, fio: bool = True) -> GpuBenchResult:
    """``bench save --device cuda`` (see the module docstring)."""
    require_cuda()
    state = cuda_state(size)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    res = GpuBenchResult("save", nbytes, directory, torch.cuda.get_device_name(0),
                         asdict(gpu_path(directory)))
    d2h, h2d = copy_ceilings(min(nbytes, 1 << 30), repeat)
    res.figures += [d2h, h2d]
    methods = {
        "fastpersist.save": lambda p: fastpersist.save(state, p),
        "torch.save": lambda p: _torch_save_durable(state, p),
    }
    loads = {
        "fastpersist.load": lambda p: fastpersist.load(p, map_location="cuda", weights_only=True),
        "torch.load": lambda p: torch.load(p, map_location="cuda", weights_only=True),
    }
    figs = {k: GpuFigures(k) for k in list(methods) + list(loads)}
    ok = True
    for _ in range(repeat):
        for (sname, save), (lname, load) in zip(methods.items(), loads.items()):
            path = os.path.join(directory, f"fp-gpu-bench-{sname}.pt")
            try:
                _sync()
                t = time.perf_counter()
                save(path)
                figs[sname].runs.append(gbps(nbytes, time.perf_counter() - t))
                drop_page_cache(path)
                _sync()
                t = time.perf_counter()
                out = load(path)
                _sync()
                figs[lname].runs.append(gbps(nbytes, time.perf_counter() - t))
                ok = ok and _equal(state, out)
                del out
            except Exception as e:  # noqa: BLE001 - reported beside the other figures
                figs[sname].error = figs[sname].error or f"{type(e).__name__}: {e}"
                ok = False
            finally:
                if os.path.exists(path):
                    os.remove(path)
    res.figures += list(figs.values())
    res.verified = ok
    res.fio = _fio(directory, max(nbytes, 256 << 20), fio)
    return res


def _torch_save_durable(state: Any, path: str) -> None:
    torch.save(state, path)
    fsync_path(path)


def run_gpu_io_bench(directory: str, *, size: int, engines: Sequence[str], repeat: int = 3,
                     fio: bool = True) -> GpuBenchResult:
    """``bench io --device cuda`` (see the module docstring)."""
    require_cuda()
    res = GpuBenchResult("io", size, directory, torch.cuda.get_device_name(0), asdict(gpu_path(directory)))
    d2h, h2d = copy_ceilings(size, repeat)
    res.figures += [d2h, h2d]
    src = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    path = os.path.join(directory, "fp-gpu-io-bench.bin")
    ok = True
    for engine in engines:
        w, r = GpuFigures(f"{engine} HBM->disk"), GpuFigures(f"{engine} disk->HBM")
        res.figures += [w, r]
        if engine == "cufile" and cufile_status() != "available":
            w.error = r.error = f"cuFile unavailable: {cufile_status()}"
            continue
        try:
            with IOHandle(engine=engine) as h:
                for _ in range(repeat):
                    _sync()
                    t = time.perf_counter()
                    h.sync_pwrite(src, path)
                    fsync_path(path)
                    w.runs.append(gbps(size, time.perf_counter() - t))
                    drop_page_cache(path)
                    dst.zero_()
                    _sync()
                    t = time.perf_counter()
                    h.sync_pread(dst, path)
                    _sync()
                    r.runs.append(gbps(size, time.perf_counter() - t))
                    ok = ok and torch.equal(src, dst)
        except OSError as e:
            w.error = r.error = f"{type(e).__name__}: {e}"
            # cuFile that refuses the file (ENOTSUP: no nvidia-fs, no compatibility mode) is an
            # engine this machine lacks, reported with its reason; any other error fails the run
            ok = ok and engine == "cufile" and e.errno == errno.ENOTSUP
        except Exception as e:  # noqa: BLE001 - reported beside the other figures
            w.error = r.error = f"{type(e).__name__}: {e}"
            ok = False
        finally:
            if os.path.exists(path):
                os.remove(path)
    res.verified = ok
    res.fio = _fio(directory, size, fio)
    return res


def print_gpu_report(res: GpuBenchResult, out: TextIO) -> None:
    """Plain-text report: the GPU path, each figure's median and runs, fio's ceilings."""
    print(f"GPU bench {res.kind}: {format_bytes(res.size)} on {res.device}, directory {res.directory}", file=out)
    print(f"GPU path   : save {res.gpu_path['save']} ({res.gpu_path['save_reason']}); "
          f"load {res.gpu_path['load']} ({res.gpu_path['load_reason']})", file=out)
    for f in res.figures:
        if f.error:
            print(f"  {f.name:<22} error: {f.error}", file=out)
        else:
            runs = ", ".join(f"{x:.2f}" for x in f.runs)
            print(f"  {f.name:<22} {f.gbps or 0:.2f} GB/s (runs: {runs})", file=out)
    if res.fio:
        print(f"  fio O_DIRECT write     {res.fio.get('write_gbps')} GB/s; read {res.fio.get('read_gbps')} GB/s"
              + (f" ({res.fio['error']})" if res.fio.get("error") else ""), file=out)
    print(f"Verified   : {res.verified}", file=out)
