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
  no process group (``no_dist=True``); load fills a same-shaped template in place
  (its tensors allocated, not written, before the timing).
* ``fio``: the disk's write/read ceilings for the same byte count. A sweep
  before the first run picks fio's best configuration of each direction among
  several (:mod:`fastpersist.bench.fio`: O_DIRECT block sizes x queue depths,
  two jobs, a buffered write ended by fsync); that configuration then takes
  its turn in every round of the rotation (a fresh write, then a read, then a
  buffered read of the same file), and fio's figure is the median of those
  rounds. With it, the raw engine (:class:`~fastpersist.bench.ceiling.EngineProbe`:
  ``fastpersist.io`` writing one page-locked buffer of the same size) takes
  its own turn each round. The *write ceiling* is the higher of fio's and the
  raw engine's write medians (``save_vs_write_ceiling``); the *read ceiling*
  the higher of fio's O_DIRECT and buffered sequential read medians
  (``load_vs_read_ceiling``).

With ``load_into`` (``--load-into``), every round of ``fastpersist`` and ``torch``
also times a cold load *into an existing state of the same shapes* (allocated and
zero-filled before the timing, as a resumed job's model and optimizer are):
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

Where the loads run (``load_process``, ``--load-process``): ``"fresh"`` (the
default) times every cold load and load-into in a new Python process, as a
resumed training job loads (:func:`load_in_fresh_process`): the child imports
the method's library, reads the state's shapes from a skeleton file written
once per run (meta tensors, :func:`~fastpersist.bench.state.skeleton`), builds
the load-into target (zero-filled, resident) or dcp's template, drops the file
from the page cache, and times the load call alone; interpreter start and
imports are outside the timing. Its memory is memory the process never used,
which on a VM can cost a host fault per page at first touch. ``"same"`` times
the loads in the benchmark's own process, round after round, where allocators
reuse memory the previous round freed (already backed). Verification (the
first fastpersist load, and its load-into) compares CRC-32s of every tensor's
bytes (:func:`~fastpersist.bench.state.fingerprint`) computed by the child with
the original's; in ``"same"`` mode it compares the tensors themselves.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

import fastpersist
from fastpersist import config as config_mod
from fastpersist import readpolicy
from fastpersist.bench import ceiling as ceiling_mod
from fastpersist.bench import fio as fio_mod
from fastpersist.bench import state as state_mod
from fastpersist.bench.fsutil import drop_page_cache_all, fsync_dir, fsync_path, remove_path, total_size
from fastpersist.machine import MachineInfo, collect_machine_info
from fastpersist.bench.progress import progress as make_progress
from fastpersist.units import gbps, median, ratio
from fastpersist.config import Config
from fastpersist.io import available_engines

PEERS = ("torch", "safetensors", "dcp", "fio")
#: where the timed cold loads run: a new Python process each (default), or the benchmark's own process
LOAD_PROCESSES = ("fresh", "same")
FRESH_NOTE = (
    "loads in fresh processes (--load-process fresh): every timed cold load (and load-into) ran in a new Python "
    "process started for it, as a resumed training job loads: imports, the state's shapes, the load-into target "
    "(zero-filled) and dcp's template (allocated, not written) were ready before the clock started; the file was then dropped from the "
    "page cache and only the load call was timed, filling memory the process had never used"
)
SAME_NOTE = (
    "loads in the benchmark's process (--load-process same): every load ran in one long-lived process, round "
    "after round, where allocators hand back memory the previous round freed (already backed by the host), "
    "which a resumed job's first load does not get"
)
COLD_LOAD_NOTE = (
    "cold loads: every file of the run's directory (every method's, not only the one loaded) is fsync'ed "
    "and dropped from the page cache with posix_fadvise(POSIX_FADV_DONTNEED) before each load (no root "
    "needed), so that no method's load starts with the pages of its own buffered save just freed for it"
)
DURABLE_NOTE = "durable saves: time includes fsync of every file written and of its directory"
LAZY_NOTE = (
    "safetensors: load_file returns tensors over a lazy mmap; its load time includes reading one byte "
    "of every 4 KiB page of its tensors (what using them faults in), so every load ends with the bytes in memory"
)
INTO_NOTE = (
    "load-into: a cold load into an existing state of the same shapes (allocated and zero-filled before the clock "
    "starts: once before the rounds in the benchmark's process, or in each fresh process): fastpersist.load_state_dict(state, path) vs torch.load(path) + copy_ of every tensor into the state "
    "(what Module.load_state_dict does); same file, same round as the method's own load"
)


class Method:
    """A way to save and load a state: a name, a target path, ``save`` and ``load``."""

    name = ""
    target_name = ""

    def save(self, obj: Any, target: str) -> None:
        """Write ``obj`` to ``target`` durably (file data fsync'ed; the caller fsyncs the directory)."""
        raise NotImplementedError

    def prepare_load(self, reference: Any) -> Any:
        """What :meth:`load` needs ready before the clock starts (``None`` for most methods)."""
        return None

    def load(self, target: str, reference: Any, prepared: Any = None) -> Any:
        """Read back what :meth:`save` wrote; ``reference`` is the original or its
        :func:`~fastpersist.bench.state.skeleton` (for shapes only), ``prepared`` what
        :meth:`prepare_load` returned (made here when ``None``)."""
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
        self._fp = fastpersist
        self.config = (config if config is not None else config_mod.get_default()).replace(fsync=True)

    def save(self, obj: Any, target: str) -> None:
        self._fp.save(obj, target, config=self.config)

    def load(self, target: str, reference: Any, prepared: Any = None) -> Any:
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

    def load(self, target: str, reference: Any, prepared: Any = None) -> Any:
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

    def load(self, target: str, reference: Any, prepared: Any = None) -> Any:
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

    def prepare_load(self, reference: Any) -> Any:
        """The template ``dcp.load`` fills: CPU tensors of the reference's shapes, allocated, not written."""
        return state_mod.empty_like_state(reference, device="cpu")

    def load(self, target: str, reference: Any, prepared: Any = None) -> Any:
        template = prepared if prepared is not None else self.prepare_load(reference)
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
    #: where the timed loads ran: ``"fresh"`` (a new process each) or ``"same"`` (:data:`LOAD_PROCESSES`)
    load_process: str = "same"
    #: the raw engine's durable writes of one pinned buffer (part of the write ceiling)
    engine_ceiling: Optional[ceiling_mod.EngineCeiling] = None

    @property
    def write_ceiling(self) -> tuple[Optional[float], str]:
        """The higher of fio's and the raw engine's write medians, and its source (``"fio"``/``"engine"``)."""
        return ceiling_mod.write_ceiling(self.fio, self.engine_ceiling)

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
        w_ceiling, w_source = self.write_ceiling
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
                "save_vs_write_ceiling": ratio(m.save_median_gbps, w_ceiling),
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
            "load_process": self.load_process,
            "methods": methods,
            "fio": self.fio.to_dict() if self.fio else None,
            "engine_ceiling": self.engine_ceiling.to_dict() if self.engine_ceiling else None,
            "write_ceiling_gbps": w_ceiling,
            "write_ceiling_source": w_source or None,
            "read_ceiling_gbps": ceiling,
            "verification": dict(self.verification),
            "notes": list(self.notes),
            "order": [list(r) for r in self.order],
        }


def make_method(name: str, config: Any = None) -> Method:
    """The :class:`Method` called ``name`` (``fastpersist`` with ``config``, or a peer).

    Raises ``ImportError`` when its library is not installed, ``ValueError`` for an unknown name.
    """
    if name == "fastpersist":
        return FastPersistMethod(config)
    table: dict[str, Callable[[], Method]] = {"torch": TorchMethod, "safetensors": SafetensorsMethod, "dcp": DcpMethod}
    if name not in table:
        raise ValueError(f"no save/load method called {name!r}")
    return table[name]()


def _make_methods(
    peers: Sequence[str], include_fastpersist: bool, config: Any
) -> tuple[list[Method], list[MethodResult]]:
    """Instantiate the methods; one that cannot be set up becomes a failed result."""
    names = (["fastpersist"] if include_fastpersist else []) + [p for p in peers if p != "fio"]
    methods, failed = [], []
    for name in names:
        try:
            methods.append(make_method(name, config))
        except ImportError as exc:
            failed.append(MethodResult(name=name, nbytes=0, error=f"not available: {exc}"))
    return methods, failed


# ---- where the cold loads run ------------------------------------------------------

#: ``(seconds, problems)``: a timed load and, when verified, the differences from the original.
TimedLoad = tuple[float, Optional[list[str]]]


class SameProcessLoads:
    """``load_process="same"``: cold loads timed in the benchmark's own process, round after round."""

    #: how verification compares a loaded state with the original
    compared_by = "torch.equal each tensor; non-tensors =="

    def __init__(self, obj: Any, load_into: bool) -> None:
        self.obj = obj
        #: the load-into target: allocated and written once, before the rounds
        self.into_state = state_mod.zeros_like_state(obj) if load_into else None

    def load(self, method: Method, target: str, verify: bool) -> TimedLoad:
        """Drop ``target`` from the page cache, time ``method.load``; compare with the original if ``verify``."""
        prepared = method.prepare_load(self.obj)
        drop_page_cache_all([os.path.dirname(target)])
        t0 = time.perf_counter()
        loaded = method.load(target, self.obj, prepared)
        seconds = time.perf_counter() - t0
        return seconds, (state_mod.compare_states(self.obj, loaded) if verify else None)

    def load_into(self, method: Method, target: str, verify: bool) -> TimedLoad:
        """Drop ``target`` from the page cache, time ``method.load_into`` of the shared target state."""
        assert self.into_state is not None
        drop_page_cache_all([os.path.dirname(target)])
        t0 = time.perf_counter()
        method.load_into(target, self.into_state)
        seconds = time.perf_counter() - t0
        return seconds, (state_mod.compare_states(self.obj, self.into_state) if verify else None)

    def close(self) -> None:
        """Nothing to clean up."""


class FreshProcessLoads:
    """``load_process="fresh"``: every cold load in a new Python process (:func:`load_in_fresh_process`).

    Writes the state's :func:`~fastpersist.bench.state.skeleton` to ``workdir``
    once; the children read it for the shapes. Verification compares the
    child's :func:`~fastpersist.bench.state.fingerprint` of what it loaded with
    the original's.
    """

    #: how verification compares a loaded state with the original
    compared_by = "CRC-32 of each tensor's bytes, computed in the loading process; dtypes, shapes, non-tensors =="

    def __init__(self, obj: Any, workdir: str) -> None:
        self.obj = obj
        self.workdir = workdir
        self.skeleton_path = os.path.join(workdir, SKELETON_NAME)
        torch.save(state_mod.skeleton(obj), self.skeleton_path)
        self._expected: Any = None
        #: modules a child imported for the first time inside its timed call (should stay empty)
        self.imported_in_timing: set[str] = set()

    def expected(self) -> Any:
        """The original state's fingerprint (computed once)."""
        if self._expected is None:
            self._expected = state_mod.fingerprint(self.obj)
        return self._expected

    def load(self, method: Method, target: str, verify: bool) -> TimedLoad:
        """A cold ``method.load`` of ``target`` in a fresh process."""
        return self._run(method, "load", target, verify)

    def load_into(self, method: Method, target: str, verify: bool) -> TimedLoad:
        """A cold ``method.load_into`` of ``target`` into a fresh zero-filled state, in a fresh process."""
        return self._run(method, "into", target, verify)

    def _run(self, method: Method, op: str, target: str, verify: bool) -> TimedLoad:
        fp_path = os.path.join(self.workdir, f"{method.name}.{op}.fingerprint") if verify else None
        try:
            child = load_in_fresh_process(method.name, op, target, self.skeleton_path,
                                          config=getattr(method, "config", None), fingerprint_path=fp_path)
        finally:
            if fp_path is not None:
                remove_path(fp_path)
        self.imported_in_timing.update(child.imported)
        problems = state_mod.compare_states(self.expected(), child.fingerprint) if verify else None
        return child.seconds, problems

    def close(self) -> None:
        """Remove the skeleton file."""
        remove_path(self.skeleton_path)


SKELETON_NAME = "skeleton.pt"
_CHILD_MARK = "fastpersist-bench-load-result: "
# ``python -c`` puts the working directory first on sys.path: run from a checkout of
# fastpersist after a non-editable install (README's first command), the child would
# import the source tree, which has no built ``_native``. So the child puts the
# directory of the fastpersist this process runs (argv[1]) before everything else.
_CHILD_CODE = (
    "import sys\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "from fastpersist.bench.save_bench import load_child_main\n"
    "sys.exit(load_child_main(sys.argv[2:]))\n"
)


@dataclass
class FreshLoad:
    """What a :func:`load_in_fresh_process` child reported."""

    #: seconds of the load call alone
    seconds: float
    #: modules first imported inside the timed call
    imported: list[str]
    #: :func:`~fastpersist.bench.state.fingerprint` of what it loaded, when asked for
    fingerprint: Any = None


def load_in_fresh_process(
    method: str,
    op: str,
    target: str,
    skeleton_path: str,
    *,
    config: Any = None,
    fingerprint_path: Optional[str] = None,
) -> FreshLoad:
    """Time one cold load of ``target`` by ``method`` in a new Python process.

    The child (``sys.executable -c``, this environment, this ``fastpersist``
    first on its path) imports the method's library, reads the shapes from
    ``skeleton_path`` (:func:`~fastpersist.bench.state.skeleton`) and prepares
    what the call needs (``op="into"``: a zero-filled state of those shapes;
    dcp: its template), all untimed; then it drops ``target`` from the page
    cache and times the load call alone (``op="load"``: :meth:`Method.load`,
    ``"into"``: :meth:`Method.load_into`). ``config`` is fastpersist's
    :class:`~fastpersist.config.Config` (passed as JSON). With
    ``fingerprint_path`` the child writes the fingerprint of what it loaded
    there and it is returned.

    Raises ``RuntimeError`` (the child's last error line) when the child fails.
    """
    if op not in ("load", "into"):
        raise ValueError(f"op must be 'load' or 'into', got {op!r}")
    request = {
        "method": method, "op": op, "target": target, "skeleton": skeleton_path,
        "config": dataclasses.asdict(config) if config is not None else None,
        "fingerprint": fingerprint_path,
    }
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the fastpersist this process runs
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", _CHILD_CODE, root, json.dumps(request)], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_CHILD_MARK)]
    if proc.returncode != 0 or not lines:
        err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        raise RuntimeError(f"{method} {op} in a fresh process failed (exit {proc.returncode}): "
                           f"{err[-1] if err else 'no result reported'}")
    report = json.loads(lines[-1][len(_CHILD_MARK):])
    fp = None
    if fingerprint_path is not None:
        with open(fingerprint_path, "rb") as f:
            fp = pickle.load(f)
    return FreshLoad(seconds=float(report["seconds"]), imported=list(report["imported"]), fingerprint=fp)


def load_child_main(argv: Sequence[str]) -> int:
    """Entry point of a :func:`load_in_fresh_process` child: ``argv[0]`` is its JSON request.

    Prints one result line (seconds of the load call, modules imported during
    it) on standard output.
    """
    request = json.loads(argv[0])
    config = None
    if request["config"] is not None:
        config = Config(**request["config"])
    method = make_method(request["method"], config)
    target, op = request["target"], request["op"]
    reference = torch.load(request["skeleton"], map_location="meta", weights_only=True)
    if op == "into":
        if not method.loads_into:
            raise ValueError(f"{method.name} does not load into an existing state")
        result = state_mod.zeros_like_state(reference)
        prepared = None
    else:
        prepared = method.prepare_load(reference)
    before = set(sys.modules)
    # every method's file, not only this one: evicting only a file written through the page cache would
    # hand this load the pages just freed, which on a VM returning free memory to its host fill several
    # times faster than the memory an O_DIRECT-written file's load gets
    drop_page_cache_all([os.path.dirname(target)])
    t0 = time.perf_counter()
    if op == "into":
        method.load_into(target, result)
    else:
        result = method.load(target, reference, prepared)
    seconds = time.perf_counter() - t0
    imported = sorted(set(sys.modules) - before)
    if request["fingerprint"]:
        with open(request["fingerprint"], "wb") as f:
            pickle.dump(state_mod.fingerprint(result), f)
    print(_CHILD_MARK + json.dumps({"seconds": seconds, "imported": imported}), flush=True)
    return 0


def _read_depth_text(cfg: Any) -> str:
    if cfg.read_queue_depth is None:
        return f"by device: {readpolicy.SINGLE_QUEUE_DEPTH} on one hardware queue, else {cfg.read_depth()}"
    return str(cfg.read_queue_depth)


def describe_engine(config: Any = None) -> str:
    """The engine fastpersist will use here, e.g. ``"auto -> aio (available: aio, psync)"``."""
    try:
        cfg = config if config is not None else config_mod.get_default()
        avail = available_engines()
    except ImportError as exc:
        return f"unavailable ({exc})"
    settings = (
        f"(available: {', '.join(avail)}), chunk {cfg.chunk_size >> 10} KiB, queue depth {cfg.queue_depth} "
        f"(reads {_read_depth_text(cfg)}, {_staging_text(cfg)}), threads {cfg.threads}, "
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
    load_process: str = "fresh",
    engine_ceiling: bool = True,
) -> SaveBenchResult:
    """Run the checkpoint benchmark in ``directory`` (see module docstring) and return its results.

    ``peers`` is any subset of :data:`PEERS`. ``include_fastpersist=False``
    measures the peers alone. Files go to a fresh subdirectory of ``directory``,
    removed at the end unless ``keep``. A method that fails is recorded with
    its error and the others go on. ``load_process``: ``"fresh"`` times every
    cold load in a new Python process (:func:`load_in_fresh_process`, what a
    resumed job sees), ``"same"`` in this process. With ``"fio"`` among the
    peers and ``engine_ceiling``, the raw engine's write takes its turn too
    (:class:`~fastpersist.bench.ceiling.EngineProbe`).
    """
    if load_process not in LOAD_PROCESSES:
        raise ValueError(f"load_process must be one of {', '.join(LOAD_PROCESSES)}, got {load_process!r}")
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
    notes.append(FRESH_NOTE if load_process == "fresh" else SAME_NOTE)
    if load_into:
        notes.append(INTO_NOTE)
    loads: Union[SameProcessLoads, FreshProcessLoads] = (
        FreshProcessLoads(obj, workdir) if load_process == "fresh" else SameProcessLoads(obj, load_into)
    )
    verification: dict[str, Any] = {"checked": False}
    order: list[list[str]] = []
    probe: Optional[fio_mod.FioProbe] = None
    engine: Optional[ceiling_mod.EngineProbe] = None
    if "fio" in peers:
        probe = fio_mod.FioProbe(
            workdir, nbytes, block_sizes=fio_block_sizes, iodepths=fio_iodepths,
            direct=bool(machine.direct_io), on_run=lambda r: _fio_step(bar, r),
        )
        if engine_ceiling:
            engine = ceiling_mod.EngineProbe(workdir, nbytes, config)
    n_fio = fio_mod.fio_sweep_count(nbytes, fio_block_sizes, fio_iodepths) + 3 * repeat if probe and probe.ok else 0
    n_engine = repeat if engine is not None else 0
    bar = make_progress(repeat * len(methods) + n_fio + n_engine, progress,
                        "fio sweep" if probe is not None and probe.ok else f"{methods[0].name} run 1/{repeat}"
                        if methods else "starting")
    try:
        if probe is not None:
            bar.set_description("fio sweep")
            probe.sweep()
        shuffler = random.Random(seed)
        for run in range(repeat):
            # A fresh order each round (seeded): on a shared disk a step's speed depends on
            # what ran just before it, so no method (fio and the raw engine included) always
            # follows the same one.
            steps: list[Union[Method, str]] = list(methods)
            if probe is not None:
                steps.append("fio")
            if engine is not None:
                steps.append("engine")
            shuffler.shuffle(steps)
            order.append([m if isinstance(m, str) else m.name for m in steps])
            for method in steps:
                if method == "fio":
                    bar.set_description(f"fio round {run + 1}/{repeat}")
                    probe.round()  # type: ignore[union-attr]
                    continue
                if method == "engine":
                    bar.set_description(f"raw engine write {run + 1}/{repeat}")
                    engine.round()  # type: ignore[union-attr]
                    bar.update(1)
                    continue
                assert isinstance(method, Method)
                res = by_name[method.name]
                if res.error is None:
                    bar.set_description(f"{method.name} run {run + 1}/{repeat}")
                    _measure(method, obj, workdir, res, verify=(method.name == "fastpersist" and run == 0),
                             verification=verification, keep=keep and run == repeat - 1,
                             loads=loads, into=load_into and method.loads_into)
                bar.update(1)
        if probe is not None and probe.result.error:
            notes.append(f"fio: {probe.result.error}")
        if engine is not None and engine.result.error:
            notes.append(f"raw engine: {engine.result.error}")
        if isinstance(loads, FreshProcessLoads) and loads.imported_in_timing:
            notes.append("fresh loads: modules first imported inside a timed load call (their import is timed): "
                         + ", ".join(sorted(loads.imported_in_timing)))
    finally:
        bar.close()
        loads.close()
        if probe is not None:
            probe.close()
        if engine is not None:
            engine.close()
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
        load_process=load_process,
        engine_ceiling=engine.result if engine is not None else None,
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
    loads: Union[SameProcessLoads, FreshProcessLoads, None] = None,
    into: bool = False,
) -> None:
    """One durable save and one cold load of ``method`` (and a cold load into an
    existing state when ``into``), the loads timed by ``loads`` (default: in this
    process); errors go into ``res.error``."""
    if loads is None:
        loads = SameProcessLoads(obj, into)
    target = os.path.join(workdir, method.target_name)
    remove_path(target)
    os.sync()  # let the filesystem finish freeing the previous run's blocks outside the timing
    try:
        t0 = time.perf_counter()
        method.save(obj, target)
        fsync_dir(workdir)
        res.save_s.append(time.perf_counter() - t0)
        res.file_bytes = total_size(target)
        seconds, problems = loads.load(method, target, verify)
        res.load_s.append(seconds)
        if problems is not None:
            verification.update({
                "checked": True,
                "method": method.name,
                "compared_by": loads.compared_by,
                "ok": not problems,
                "tensors_compared": state_mod.count_tensors(obj),
                "problems": problems,
            })
        if into:
            seconds, problems = loads.load_into(method, target, verify)
            res.into_s.append(seconds)
            if problems is not None:
                verification["into_ok"] = not problems
                verification["into_problems"] = problems
    except Exception as exc:  # noqa: BLE001 - any failure of a peer is a result, not a crash
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        if not keep:
            remove_path(target)


def _fio_step(bar: Any, run: fio_mod.FioRun) -> None:
    """Name the fio job that just finished (its configuration), then count it."""
    desc = getattr(bar, "desc", "") or ""
    bar.set_description(f"{desc.split(':')[0]}: {run.rw} {run.describe()}")
    bar.update(1)
    bar.set_description(desc.split(":")[0])
