"""Checkpoint benchmark: durable save and cold load of a training state, against the peers.

Methods, each measured ``repeat`` times, interleaved (run ``i`` of every method
before run ``i + 1`` of any; each round in a fresh seeded random order), on the
same state and directory:

* ``fastpersist``: ``fastpersist.save`` / ``fastpersist.load`` (fsync on).
* ``torch``: ``torch.save`` into a file we opened, ``flush`` + ``os.fsync``;
  ``torch.load``.
* ``safetensors``: ``safetensors.torch.save_file`` + ``os.fsync``; ``load_file``.
  safetensors holds only tensors: the state is flattened to ``{dotted.key: tensor}``
  and its non-tensor leaves are skipped (listed in the notes).
* ``dcp``: ``torch.distributed.checkpoint.save`` / ``load`` with
  ``FileSystemWriter(sync_files=True)`` / ``FileSystemReader``, single process,
  no process group (``no_dist=True``); load fills a same-shaped template in place.
* ``fio``: the disk's O_DIRECT write/read ceiling for the same byte count. A
  sweep before the first run picks fio's best configuration; that
  configuration then takes its turn in every round of the rotation (a fresh
  write, then a read, then a buffered read of the same file), and the ceiling
  is the median of those rounds. The *read ceiling* is the higher of fio's
  O_DIRECT and buffered sequential read medians (``load_vs_read_ceiling``).

With ``load_into`` (``--load-into``), every round of ``fastpersist`` and ``torch``
also times a cold load *into an existing state of the same shapes* (allocated and
written once before the rounds, as a resumed job's model and optimizer are):
``fastpersist.load_state_dict(state, path)`` against ``torch.load(path)``
followed by ``copy_`` of every tensor into the state (what
``Module.load_state_dict`` does), on the file the same round saved.

A save is *durable*: its time includes the fsync of every file and of the
directory it created. A load is *cold*: every file of the method is dropped
from the page cache (``posix_fadvise DONTNEED``) first, and ends when every
tensor's bytes are in memory: ``safetensors.torch.load_file`` returns tensors
over a lazy ``mmap`` of the file, so its load also reads one byte of every 4 KiB
page of its tensors (what using them would fault in); the other loaders return
tensors already in memory. GB/s count the state's tensor bytes (identical for
all methods), in decimal GB.
"""

from __future__ import annotations

import os
import random
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from fastpersist.bench import fio as fio_mod
from fastpersist.bench import state as state_mod
from fastpersist.bench.fsutil import drop_page_cache_all, fsync_dir, fsync_path, remove_path, total_size
from fastpersist.bench.machine import MachineInfo, collect_machine_info
from fastpersist.bench.units import gbps, median, ratio

PEERS = ("torch", "safetensors", "dcp", "fio")
COLD_LOAD_NOTE = (
    "cold loads: every file is fsync'ed and dropped from the page cache with "
    "posix_fadvise(POSIX_FADV_DONTNEED) before each load (no root needed)"
)
DURABLE_NOTE = "durable saves: time includes fsync of every file written and of its directory"
LAZY_NOTE = (
    "safetensors: load_file returns tensors over a lazy mmap; its load time includes reading one byte "
    "of every 4 KiB page of its tensors (what using them faults in), so every load ends with the bytes in memory"
)
INTO_NOTE = (
    "load-into: a cold load into an existing state of the same shapes (allocated and written once before the "
    "rounds): fastpersist.load_state_dict(state, path) vs torch.load(path) + copy_ of every tensor into the state "
    "(what Module.load_state_dict does); same file, same round as the method's own load"
)


class Method:
    """A way to save and load a state: a name, a target path, ``save`` and ``load``."""

    name = ""
    target_name = ""

    def save(self, obj: Any, target: str) -> None:
        """Write ``obj`` to ``target`` durably (file data fsync'ed; the caller fsyncs the directory)."""
        raise NotImplementedError

    def load(self, target: str, reference: Any) -> Any:
        """Read back what :meth:`save` wrote; ``reference`` is the original (for shapes only)."""
        raise NotImplementedError

    #: whether :meth:`load_into` is offered
    loads_into = False

    def load_into(self, target: str, state: Any) -> None:
        """Read what :meth:`save` wrote into the tensors of ``state`` (same structure and shapes)."""
        raise NotImplementedError


class FastPersistMethod(Method):
    """``fastpersist.save`` / ``fastpersist.load`` with the environment's config and fsync on."""

    name = "fastpersist"
    target_name = "fastpersist.pt"

    def __init__(self, config: Any = None) -> None:
        import fastpersist
        from fastpersist import config as config_mod

        self._fp = fastpersist
        self.config = (config if config is not None else config_mod.get_default()).replace(fsync=True)

    def save(self, obj: Any, target: str) -> None:
        self._fp.save(obj, target, config=self.config)

    def load(self, target: str, reference: Any) -> Any:
        return self._fp.load(target, map_location="cpu", weights_only=True, config=self.config)

    loads_into = True

    def load_into(self, target: str, state: Any) -> None:
        self._fp.load_state_dict(state, target, config=self.config)


class TorchMethod(Method):
    """``torch.save`` to a file we open (then ``flush`` + ``fsync``); ``torch.load``."""

    name = "torch"
    target_name = "torch.pt"

    def save(self, obj: Any, target: str) -> None:
        with open(target, "wb") as f:
            torch.serialization.save(obj, f)
            f.flush()
            os.fsync(f.fileno())

    def load(self, target: str, reference: Any) -> Any:
        return torch.serialization.load(target, map_location="cpu", weights_only=True)

    loads_into = True

    def load_into(self, target: str, state: Any) -> None:
        state_mod.copy_into(state, torch.serialization.load(target, map_location="cpu", weights_only=True))


class SafetensorsMethod(Method):
    """``safetensors.torch.save_file`` (+ ``fsync``) / ``load_file`` of the flattened tensors."""

    name = "safetensors"
    target_name = "model.safetensors"

    def __init__(self) -> None:
        import safetensors.torch  # imported here: module import time is not the save's

        self._st = safetensors.torch

    def save(self, obj: Any, target: str) -> None:
        flat, _skipped = state_mod.flatten_tensors(obj)
        self._st.save_file(flat, target)
        fsync_path(target)

    def load(self, target: str, reference: Any) -> Any:
        out = self._st.load_file(target, device="cpu")
        state_mod.touch_pages(out)  # lazy mmap: the bytes are read when first used
        return out


class DcpMethod(Method):
    """``torch.distributed.checkpoint`` with ``FileSystemWriter(sync_files=True)``, no process group."""

    name = "dcp"
    target_name = "dcp"

    def __init__(self) -> None:
        import torch.distributed.checkpoint as dcp  # imported here: module import time is not the save's

        self._dcp = dcp

    def save(self, obj: Any, target: str) -> None:
        writer = self._dcp.FileSystemWriter(target, sync_files=True)
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            self._dcp.save(obj, storage_writer=writer, no_dist=True)
        fsync_dir(target)  # the files are fsync'ed by sync_files; their directory entries are not

    def load(self, target: str, reference: Any) -> Any:
        template = state_mod.empty_like_state(reference)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self._dcp.load(template, storage_reader=self._dcp.FileSystemReader(target), no_dist=True)
        return template


@dataclass
class MethodResult:
    """Timings of one method over the runs; ``error`` set if it could not run."""

    name: str
    nbytes: int
    save_s: list[float] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)
    #: cold loads into an existing state (``load_into``)
    into_s: list[float] = field(default_factory=list)
    file_bytes: Optional[int] = None
    error: Optional[str] = None

    @property
    def into_gbps(self) -> list[float]:
        """GB/s of each cold load into an existing state."""
        return [gbps(self.nbytes, s) for s in self.into_s]

    @property
    def into_median_gbps(self) -> Optional[float]:
        """Median load-into GB/s."""
        return median(self.into_gbps)

    @property
    def save_gbps(self) -> list[float]:
        """GB/s of each durable save."""
        return [gbps(self.nbytes, s) for s in self.save_s]

    @property
    def load_gbps(self) -> list[float]:
        """GB/s of each cold load."""
        return [gbps(self.nbytes, s) for s in self.load_s]

    @property
    def save_median_gbps(self) -> Optional[float]:
        """Median save GB/s."""
        return median(self.save_gbps)

    @property
    def load_median_gbps(self) -> Optional[float]:
        """Median load GB/s."""
        return median(self.load_gbps)


@dataclass
class SaveBenchResult:
    """Everything :func:`run_save_bench` measured."""

    machine: MachineInfo
    workload: dict[str, Any]
    repeat: int
    methods: list[MethodResult]
    fio: Optional[fio_mod.FioCeiling]
    verification: dict[str, Any]
    engine: str
    notes: list[str] = field(default_factory=list)
    #: the order the steps ran in, one list per round (``"fio"`` for fio's round)
    order: list[list[str]] = field(default_factory=list)

    def method(self, name: str) -> Optional[MethodResult]:
        """The result of method ``name``, or ``None``."""
        return next((m for m in self.methods if m.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form: per-run GB/s, medians, ratios vs torch.save and vs fio."""
        torch_res = self.method("torch")
        t_save = torch_res.save_median_gbps if torch_res else None
        t_load = torch_res.load_median_gbps if torch_res else None
        fio_w = self.fio.write_gbps if self.fio else None
        fio_r = self.fio.read_gbps if self.fio else None
        ceiling = self.fio.read_ceiling_gbps if self.fio else None
        t_into = torch_res.into_median_gbps if torch_res else None
        methods = []
        for m in self.methods:
            methods.append({
                "name": m.name,
                "bytes": m.nbytes,
                "file_bytes": m.file_bytes,
                "save_seconds": m.save_s,
                "load_seconds": m.load_s,
                "save_gbps": m.save_gbps,
                "load_gbps": m.load_gbps,
                "save_median_gbps": m.save_median_gbps,
                "load_median_gbps": m.load_median_gbps,
                "save_vs_torch": ratio(m.save_median_gbps, t_save),
                "load_vs_torch": ratio(m.load_median_gbps, t_load),
                "save_vs_fio": ratio(m.save_median_gbps, fio_w),
                "load_vs_fio": ratio(m.load_median_gbps, fio_r),
                "load_vs_read_ceiling": ratio(m.load_median_gbps, ceiling),
                "into_seconds": m.into_s,
                "into_gbps": m.into_gbps,
                "into_median_gbps": m.into_median_gbps,
                "into_vs_torch": ratio(m.into_median_gbps, t_into),
                "error": m.error,
            })
        return {
            "benchmark": "save",
            "machine": self.machine.to_dict(),
            "engine": self.engine,
            "workload": dict(self.workload),
            "repeat": self.repeat,
            "methods": methods,
            "fio": self.fio.to_dict() if self.fio else None,
            "read_ceiling_gbps": ceiling,
            "verification": dict(self.verification),
            "notes": list(self.notes),
            "order": [list(r) for r in self.order],
        }


def _make_methods(
    peers: Sequence[str], include_fastpersist: bool, config: Any
) -> tuple[list[Method], list[MethodResult]]:
    """Instantiate the methods; one that cannot be set up becomes a failed result."""
    factories: list[tuple[str, Callable[[], Method]]] = []
    if include_fastpersist:
        factories.append(("fastpersist", lambda: FastPersistMethod(config)))
    table: dict[str, Callable[[], Method]] = {"torch": TorchMethod, "safetensors": SafetensorsMethod, "dcp": DcpMethod}
    for peer in peers:
        if peer in table:
            factories.append((peer, table[peer]))
    methods, failed = [], []
    for name, make in factories:
        try:
            methods.append(make())
        except ImportError as exc:
            failed.append(MethodResult(name=name, nbytes=0, error=f"not available: {exc}"))
    return methods, failed


def describe_engine(config: Any = None) -> str:
    """The engine fastpersist will use here, e.g. ``"auto -> aio (available: aio, psync)"``."""
    try:
        from fastpersist import config as config_mod
        from fastpersist.io import available_engines

        cfg = config if config is not None else config_mod.get_default()
        avail = available_engines()
    except ImportError as exc:
        return f"unavailable ({exc})"
    settings = (
        f"(available: {', '.join(avail)}), chunk {cfg.chunk_size >> 10} KiB, queue depth {cfg.queue_depth} "
        f"(reads {cfg.read_queue_depth}, {_staging_text(cfg)}), threads {cfg.threads}, "
        f"direct {'on' if cfg.direct else 'off'}"
    )
    if cfg.engine == "auto":
        return f"auto -> psync {settings}"
    return f"{cfg.engine} {settings}"


def _staging_text(cfg: Any) -> str:
    mode = "staged" if cfg.stages_reads() else "zero-copy"
    return f"{mode}, read_staging {cfg.read_staging}" if cfg.read_staging == "auto" else mode


def build_workload(size: int, small_tensors: Optional[int], seed: int) -> tuple[Any, dict[str, Any]]:
    """The state to checkpoint and its description (kind, tensor bytes, tensor count, shape)."""
    if small_tensors:
        obj = state_mod.build_small_tensors(small_tensors, seed=seed)
        info: dict[str, Any] = {"kind": "small-tensors", "small_tensors": small_tensors}
    else:
        obj = state_mod.build_training_state(size, seed=seed)
        shape = state_mod.gpt_shape_for_bytes(size)
        info = {"kind": "gpt-training-state", "requested_bytes": size, "model": shape.to_dict()}
    flat, skipped = state_mod.flatten_tensors(obj)
    info.update({
        "tensor_bytes": state_mod.tensor_bytes(obj),
        "tensors": len(flat),
        "non_tensor_leaves": len(skipped),
        "dtypes": sorted({str(t.dtype).replace("torch.", "") for t in flat.values()}),
    })
    return obj, info


def run_save_bench(
    directory: str,
    *,
    size: int = 2 << 30,
    small_tensors: Optional[int] = None,
    peers: Sequence[str] = PEERS,
    repeat: int = 3,
    keep: bool = False,
    include_fastpersist: bool = True,
    config: Any = None,
    progress: bool = True,
    seed: int = 0,
    fio_block_sizes: Sequence[int] = fio_mod.DEFAULT_BLOCK_SIZES,
    fio_iodepths: Sequence[int] = fio_mod.DEFAULT_IODEPTHS,
    load_into: bool = False,
) -> SaveBenchResult:
    """Run the checkpoint benchmark in ``directory`` (see module docstring) and return its results.

    ``peers`` is any subset of :data:`PEERS`. ``include_fastpersist=False``
    measures the peers alone. Files go to a fresh subdirectory of ``directory``,
    removed at the end unless ``keep``. A method that fails is recorded with
    its error and the others go on.
    """
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(PEERS)}")
    if repeat <= 0:
        raise ValueError(f"repeat must be positive, got {repeat}")
    if small_tensors is None and size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    machine = collect_machine_info(directory)
    workdir = os.path.join(os.path.abspath(directory), f"fastpersist-bench-{os.getpid()}")
    os.makedirs(workdir, exist_ok=True)
    fsync_dir(os.path.dirname(workdir))

    obj, workload = build_workload(size, small_tensors, seed)
    nbytes = workload["tensor_bytes"]
    methods, results = _make_methods(peers, include_fastpersist, config)
    by_name = {m.name: MethodResult(name=m.name, nbytes=nbytes) for m in methods}
    notes = [DURABLE_NOTE, COLD_LOAD_NOTE, "GB/s = state tensor bytes / seconds, decimal (1e9 bytes/s)"]
    if "safetensors" in by_name and workload["non_tensor_leaves"]:
        notes.append(
            f"safetensors: {workload['non_tensor_leaves']} non-tensor leaves (counters, scheduler, "
            "Python RNG state, ...) skipped; it stores tensors only"
        )
    if "dcp" in by_name:
        notes.append("dcp: single process, no process group (no_dist=True), FileSystemWriter(sync_files=True)")
    if "safetensors" in by_name:
        notes.append(LAZY_NOTE)
    into_state = None
    if load_into:
        notes.append(INTO_NOTE)
        into_state = state_mod.empty_like_state(obj)
        for _, t in state_mod.iter_tensors(into_state):
            t.zero_()  # resident, as a live model's tensors are
    verification: dict[str, Any] = {"checked": False}
    order: list[list[str]] = []
    probe: Optional[fio_mod.FioProbe] = None
    if "fio" in peers:
        probe = fio_mod.FioProbe(
            workdir, nbytes, block_sizes=fio_block_sizes, iodepths=fio_iodepths,
            direct=bool(machine.direct_io), on_run=lambda _r: bar.update(1),
        )
    n_fio = fio_mod.fio_sweep_count(nbytes, fio_block_sizes, fio_iodepths) + 3 * repeat if probe and probe.ok else 0
    bar = _progress(repeat * len(methods) + n_fio, progress)
    try:
        if probe is not None:
            bar.set_description("fio sweep")
            probe.sweep()
        shuffler = random.Random(seed)
        for run in range(repeat):
            # A fresh order each round (seeded): on a shared disk a step's speed depends on
            # what ran just before it, so no method (fio included) always follows the same one.
            steps: list[Optional[Method]] = [*methods, None] if probe is not None else list(methods)
            shuffler.shuffle(steps)
            order.append([m.name if m is not None else "fio" for m in steps])
            for method in steps:
                if method is None:
                    bar.set_description(f"fio run {run + 1}/{repeat}")
                    probe.round()  # type: ignore[union-attr]
                    continue
                res = by_name[method.name]
                if res.error is None:
                    bar.set_description(f"{method.name} run {run + 1}/{repeat}")
                    _measure(method, obj, workdir, res, verify=(method.name == "fastpersist" and run == 0),
                             verification=verification, keep=keep and run == repeat - 1,
                             into_state=into_state if method.loads_into else None)
                bar.update(1)
        if probe is not None and probe.result.error:
            notes.append(f"fio: {probe.result.error}")
    finally:
        bar.close()
        if probe is not None:
            probe.close()
        if not keep:
            remove_path(workdir)
    if keep:
        notes.append(f"files kept in {workdir}")
    return SaveBenchResult(
        machine=machine,
        workload=workload,
        repeat=repeat,
        methods=list(by_name.values()) + results,
        fio=probe.result if probe is not None else None,
        verification=verification,
        engine=describe_engine(config) if include_fastpersist else "not measured",
        notes=notes,
        order=order,
    )


def _measure(
    method: Method,
    obj: Any,
    workdir: str,
    res: MethodResult,
    *,
    verify: bool,
    verification: dict[str, Any],
    keep: bool,
    into_state: Any = None,
) -> None:
    """One durable save and one cold load of ``method`` (and a cold load into
    ``into_state`` when given); errors go into ``res.error``."""
    target = os.path.join(workdir, method.target_name)
    remove_path(target)
    os.sync()  # let the filesystem finish freeing the previous run's blocks outside the timing
    try:
        t0 = time.perf_counter()
        method.save(obj, target)
        fsync_dir(workdir)
        res.save_s.append(time.perf_counter() - t0)
        res.file_bytes = total_size(target)
        drop_page_cache_all([target])
        t0 = time.perf_counter()
        loaded = method.load(target, obj)
        res.load_s.append(time.perf_counter() - t0)
        if verify:
            problems = state_mod.compare_states(obj, loaded)
            verification.update({
                "checked": True,
                "method": method.name,
                "ok": not problems,
                "tensors_compared": state_mod.count_tensors(obj),
                "problems": problems,
            })
        del loaded
        if into_state is not None:
            drop_page_cache_all([target])
            t0 = time.perf_counter()
            method.load_into(target, into_state)
            res.into_s.append(time.perf_counter() - t0)
            if verify:
                problems = state_mod.compare_states(obj, into_state)
                verification["into_ok"] = not problems
                verification["into_problems"] = problems
    except Exception as exc:  # noqa: BLE001 - any failure of a peer is a result, not a crash
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        if not keep:
            remove_path(target)


def _progress(total: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, unit="run", leave=False, dynamic_ncols=True)
