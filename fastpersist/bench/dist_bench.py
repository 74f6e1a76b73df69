"""Multi-rank benchmark (``fastpersist bench dist --ranks N``): N gloo ranks on this machine.

The ranks are spawned with ``torch.multiprocessing`` (CPU, gloo, one process group)
and run every method in lockstep, interleaved (run ``i`` of every method before
run ``i + 1`` of any; each round in a fresh seeded random order, the same on every
rank). A step's time is rank 0's wall time from a barrier before it to a barrier
after it, so it includes the slowest rank.

Replicated state (every rank holds the same GPT-style training state):

* ``fastpersist group``: ``fastpersist.save(state, path, group=WORLD)``: one file,
  one aligned slice per rank. Load: ``fastpersist.load(path, group=WORLD)`` with
  ``dist_load="slices"`` (each rank reads a slice, the slices are broadcast).
* ``fastpersist rank 0``: rank 0 alone runs ``fastpersist.save``. Load: every rank
  runs ``fastpersist.load`` on the whole file (what ``dist_load="whole"`` does).
* ``torch rank 0``: rank 0 alone runs ``torch.save`` (+ flush, fsync); every rank
  ``torch.load``\\ s the file: what a DDP job does without fastpersist.

Sharded state (each rank holds 1/N of the state's tensors under keys of its own,
so DCP writes every rank's part; the total is the same bytes):

* ``dcp FileSystemWriter``: ``dcp.save`` / ``dcp.load`` with stock
  ``FileSystemWriter(sync_files=True, thread_count=T)`` / ``FileSystemReader``.
* ``dcp FastPersistWriter``: the same with ``fastpersist.dcp.FastPersistWriter`` /
  ``FastPersistReader`` (same ``thread_count``; fastpersist's ``Config.threads``
  set to the same T). Skipped when ``fastpersist.dcp`` is not importable.

Replicated state through DCP (with DCP on): every rank calls ``dcp.save`` with the
whole replicated state; DCP's planner deduplicates the replicated tensors across
ranks, so each tensor is written once, by one rank: DCP's own split of the writing.

* ``dcp replicated FileSystemWriter`` / ``dcp replicated FastPersistWriter``:
  ``dcp.save(state)`` on every rank with each writer (same ``thread_count``);
  load: ``dcp.load`` of the whole state on every rank.

Per-rank bandwidth (``rank_bandwidth``, ``--rank-bandwidth B``): every rank
runs in a block-I/O cgroup of its own with a write and a read limit of ``B``
bytes/s on the target's device (:mod:`fastpersist.bench.cgroup`; root, cgroup
v1 blkio or v2 io), as if each rank were a node with its own disk or link.
The report then sets every figure beside ``N x B``, the aggregate the ranks
could reach. Use a target far faster than ``N x B`` (the RAM-backed disk of
``shared/tools/ramdisk.sh``) so that the limit alone sets the bandwidth.

Saves are durable (files and directories fsync'ed); loads are cold (rank 0 drops
every file of the method from the page cache with ``posix_fadvise`` first). GB/s
count the state's tensor bytes once (not once per rank), in decimal GB.
"""

from __future__ import annotations

import gc
import os
import pickle
import random
import socket
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TextIO

import torch

import fastpersist
from fastpersist import config as config_mod
from fastpersist.bench import cgroup, report
from fastpersist.bench import state as state_mod
from fastpersist.bench.cgroup import BandwidthGroup
from fastpersist.bench.fsutil import drop_page_cache_all, fsync_dir, remove_path, total_size
from fastpersist.machine import MachineInfo, collect_machine_info
from fastpersist.bench.save_bench import build_workload
from fastpersist.units import format_bytes, gbps, median, ratio
from fastpersist.collectiveload import last_load_phases
from fastpersist.collectivesave import last_save_phases
from fastpersist.io import libc_handle

REPLICATED = ("fastpersist group", "fastpersist rank 0", "torch rank 0")
#: the replicated state through DCP (its planner deduplicates it across ranks)
DCP_REPLICATED = ("dcp replicated FileSystemWriter", "dcp replicated FastPersistWriter")
SHARDED = ("dcp FileSystemWriter", "dcp FastPersistWriter")


@dataclass
class DistMethodResult:
    """Timings of one method over the runs; ``error`` set if it failed."""

    name: str
    kind: str  #: "replicated" or "sharded"
    nbytes: int
    save_s: list[float] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)
    file_bytes: Optional[int] = None
    error: Optional[str] = None

    @property
    def save_median_gbps(self) -> Optional[float]:
        return median([gbps(self.nbytes, s) for s in self.save_s])

    @property
    def load_median_gbps(self) -> Optional[float]:
        return median([gbps(self.nbytes, s) for s in self.load_s])


@dataclass
class DistBenchResult:
    """Everything :func:`run_dist_bench` measured."""

    machine: MachineInfo
    ranks: int
    threads: int
    workload: dict[str, Any]
    repeat: int
    methods: list[DistMethodResult]
    verification: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    order: list[list[str]] = field(default_factory=list)
    #: per timed group save, per rank: ``(step, local s, exchange s)`` (``collectivesave.last_save_phases``)
    group_phases: list[Any] = field(default_factory=list)
    #: per timed group load, per rank: ``(step, local s, exchange s)`` (``collectiveload.last_load_phases``)
    group_load_phases: list[Any] = field(default_factory=list)
    #: each rank's write and read limit in bytes/s (its own cgroup), or None
    rank_bandwidth: Optional[int] = None
    #: the cgroup setup: controller, device, and what the limit files said
    bandwidth_setup: dict[str, Any] = field(default_factory=dict)

    @property
    def aggregate_limit_gbps(self) -> Optional[float]:
        """``ranks x rank_bandwidth`` in GB/s (None without limits)."""
        return self.ranks * self.rank_bandwidth / 1e9 if self.rank_bandwidth else None

    def group_phase_medians(self, load: bool = False) -> list[dict[str, Any]]:
        """Per rank, per step: median seconds of local work before the step and of its exchange
        (of the group's saves, or with ``load`` of its loads)."""
        out = []
        for r in range(self.ranks):
            steps: dict[str, tuple[list[float], list[float]]] = {}
            for run in (self.group_load_phases if load else self.group_phases):
                for step, local, wait in (run[r] if r < len(run) and run[r] else []):
                    a, b = steps.setdefault(step, ([], []))
                    a.append(local)
                    b.append(wait)
            out.append({step: {"local_s": median(a), "exchange_s": median(b)} for step, (a, b) in steps.items()})
        return out

    def method(self, name: str) -> Optional[DistMethodResult]:
        return next((m for m in self.methods if m.name == name), None)

    def _reference(self, m: DistMethodResult) -> Optional[DistMethodResult]:
        if m.name in DCP_REPLICATED:
            return self.method("dcp replicated FileSystemWriter")
        return self.method("torch rank 0" if m.kind == "replicated" else "dcp FileSystemWriter")

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form: per-run seconds and GB/s, medians, ratios to the stock peer
        (``torch rank 0`` for replicated state, ``dcp FileSystemWriter`` for sharded state)."""
        methods = []
        for m in self.methods:
            ref = self._reference(m)
            methods.append({
                "name": m.name,
                "kind": m.kind,
                "bytes": m.nbytes,
                "file_bytes": m.file_bytes,
                "save_seconds": m.save_s,
                "load_seconds": m.load_s,
                "save_gbps": [gbps(m.nbytes, s) for s in m.save_s],
                "load_gbps": [gbps(m.nbytes, s) for s in m.load_s],
                "save_median_gbps": m.save_median_gbps,
                "load_median_gbps": m.load_median_gbps,
                "reference": ref.name if ref else None,
                "save_vs_reference": ratio(m.save_median_gbps, ref.save_median_gbps if ref else None),
                "load_vs_reference": ratio(m.load_median_gbps, ref.load_median_gbps if ref else None),
                "save_vs_aggregate_limit": ratio(m.save_median_gbps, self.aggregate_limit_gbps),
                "load_vs_aggregate_limit": ratio(m.load_median_gbps, self.aggregate_limit_gbps),
                "error": m.error,
            })
        one = self.method("fastpersist rank 0")
        group = self.method("fastpersist group")
        dcp_rep = self.method("dcp replicated FileSystemWriter")
        return {
            "rank_bandwidth": self.rank_bandwidth,
            "aggregate_limit_gbps": self.aggregate_limit_gbps,
            "bandwidth_setup": dict(self.bandwidth_setup),
            "group_save_vs_dcp_replicated": ratio(group.save_median_gbps if group else None,
                                                  dcp_rep.save_median_gbps if dcp_rep else None),
            "group_load_vs_dcp_replicated": ratio(group.load_median_gbps if group else None,
                                                  dcp_rep.load_median_gbps if dcp_rep else None),
            "benchmark": "dist",
            "machine": self.machine.to_dict(),
            "ranks": self.ranks,
            "threads": self.threads,
            "workload": dict(self.workload),
            "repeat": self.repeat,
            "methods": methods,
            "group_save_vs_one_rank": ratio(group.save_median_gbps if group else None,
                                            one.save_median_gbps if one else None),
            "group_load_vs_every_rank_whole": ratio(group.load_median_gbps if group else None,
                                                    one.load_median_gbps if one else None),
            "verification": dict(self.verification),
            "notes": list(self.notes),
            "order": [list(r) for r in self.order],
            "group_save_phases": [[[list(p) for p in rk] if rk else [] for rk in run] for run in self.group_phases],
            "group_save_phase_medians": self.group_phase_medians(),
            "group_load_phases": [[[list(p) for p in rk] if rk else [] for rk in run] for run in self.group_load_phases],
            "group_load_phase_medians": self.group_phase_medians(load=True),
        }


# --------------------------------------------------------------------------- the ranks


class _Methods:
    """Save/load of each method, run on every rank."""

    def __init__(self, rank: int, ranks: int, obj: Any, shard: dict, threads: int, config: Any) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.fp = fastpersist
        self.rank = rank
        self.ranks = ranks
        self.obj = obj
        self.shard = shard
        self.threads = threads
        self.cfg = config
        try:
            import fastpersist.dcp as fpdcp
        except ImportError:
            fpdcp = None
        self.fpdcp = fpdcp if fpdcp is not None and hasattr(fpdcp, "FastPersistWriter") else None

    def available(self, name: str) -> Optional[str]:
        if name in ("dcp FastPersistWriter", "dcp replicated FastPersistWriter") and self.fpdcp is None:
            return "fastpersist.dcp is not available in this installation"
        return None

    def target(self, workdir: str, name: str) -> str:
        return os.path.join(workdir, {
            "fastpersist group": "group.pt", "fastpersist rank 0": "one.pt", "torch rank 0": "torch.pt",
            "dcp FileSystemWriter": "dcp-stock", "dcp FastPersistWriter": "dcp-fastpersist",
            "dcp replicated FileSystemWriter": "dcp-replicated-stock",
            "dcp replicated FastPersistWriter": "dcp-replicated-fastpersist"}[name])

    def save(self, name: str, target: str) -> None:
        wg = self.dist.group.WORLD
        if name == "fastpersist group":
            self.fp.save(self.obj, target, group=wg, config=self.cfg)
        elif name == "fastpersist rank 0":
            if self.rank == 0:
                self.fp.save(self.obj, target, config=self.cfg)
        elif name == "torch rank 0":
            if self.rank == 0:
                with open(target, "wb") as f:
                    torch.save(self.obj, f)
                    f.flush()
                    os.fsync(f.fileno())
                fsync_dir(os.path.dirname(target))
        else:
            import torch.distributed.checkpoint as dcp

            stock = name.endswith("FileSystemWriter")
            if stock:
                writer = dcp.FileSystemWriter(target, sync_files=True, thread_count=self.threads)
            else:
                writer = self.fpdcp.FastPersistWriter(target, config=self.cfg, thread_count=self.threads)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save(self.obj if name in DCP_REPLICATED else self.shard, storage_writer=writer)
            if self.rank == 0 and stock:
                fsync_dir(target)  # sync_files fsyncs the files, not their directory entries

    def load(self, name: str, target: str) -> Any:
        wg = self.dist.group.WORLD
        if name == "fastpersist group":
            return self.fp.load(target, map_location="cpu", weights_only=True, group=wg,
                                config=self.cfg.replace(dist_load="slices"))
        if name == "fastpersist rank 0":  # load: the collective load's default for gloo (dist_load "auto": whole)
            return self.fp.load(target, map_location="cpu", weights_only=True, group=wg, config=self.cfg)
        if name == "torch rank 0":
            return torch.load(target, map_location="cpu", weights_only=True)
        import torch.distributed.checkpoint as dcp

        template = state_mod.empty_like_state(self.obj if name in DCP_REPLICATED else self.shard)
        reader = dcp.FileSystemReader(target) if name.endswith("FileSystemWriter") else \
            self.fpdcp.FastPersistReader(target, config=self.cfg)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(template, storage_reader=reader)
        return template


def _shard(obj: Any, rank: int, ranks: int) -> dict:
    """Rank ``rank``'s share of the state's tensors, under keys no other rank has."""
    flat, _skipped = state_mod.flatten_tensors(obj)
    return {f"rank{rank}.{k}": t for i, (k, t) in enumerate(sorted(flat.items())) if i % ranks == rank}


def _worker(rank: int, ranks: int, port: int, workdir: str, opts: dict, out: str) -> None:
    import torch.distributed as dist

    limit = None
    try:
        if opts.get("rank_bandwidth"):
            limit = BandwidthGroup(workdir, opts["rank_bandwidth"], name=f"fastpersist-bench-dist-{os.getppid()}-rank{rank}")
            limit.create()
            limit.join()
            if rank == 0:
                with open(f"{out}.bandwidth", "wb") as f:
                    pickle.dump({"controller": f"cgroup v{limit.controller.version} ({limit.controller.root})",
                                 "device": limit.device, "limits": limit.limits()}, f)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
        torch.set_num_threads(1)
        result = _run_rank(rank, ranks, workdir, opts)
        if rank == 0:
            with open(out, "wb") as f:
                pickle.dump(result, f)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        with open(f"{out}.error-{rank}", "w", encoding="utf-8") as f:
            f.write(traceback.format_exc())
        sys.stderr.flush()
        if limit is not None:
            limit.close()
        os._exit(1)
    finally:
        if limit is not None:
            limit.close()  # moves this process back to the root group and removes its group


def _run_rank(rank: int, ranks: int, workdir: str, opts: dict) -> dict:
    import torch.distributed as dist

    cfg = config_mod.get_default().replace(fsync=True, threads=opts["threads"])
    obj, workload = build_workload(opts["size"], None, opts["seed"])
    shard = _shard(obj, rank, ranks)
    methods = _Methods(rank, ranks, obj, shard, opts["threads"], cfg)
    names = list(REPLICATED) + (list(DCP_REPLICATED) + list(SHARDED) if opts["dcp"] else [])
    res = {n: {"save": [], "load": [], "file_bytes": None, "error": methods.available(n)} for n in names}
    log = _progress_printer(rank == 0 and opts["progress"])

    def barrier() -> None:
        dist.barrier()

    def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
        barrier()
        t0 = time.perf_counter()
        value = fn()
        barrier()
        return time.perf_counter() - t0, value

    # Untimed check first: the group file equals the 1-rank file, and the group load equals the state.
    verification: dict[str, Any] = {}
    group_t, one_t = methods.target(workdir, "fastpersist group"), methods.target(workdir, "fastpersist rank 0")
    methods.save("fastpersist group", group_t)
    methods.save("fastpersist rank 0", one_t)
    barrier()
    if rank == 0:
        import filecmp

        verification["group_file_identical_to_one_rank"] = filecmp.cmp(group_t, one_t, shallow=False)
    loaded = methods.load("fastpersist group", group_t)
    problems = state_mod.compare_states(obj, loaded)
    del loaded
    all_problems: list[Any] = [None] * ranks
    dist.all_gather_object(all_problems, problems)
    verification["group_load_equals_state_on_every_rank"] = not any(all_problems)
    verification["problems"] = [p for ps in all_problems for p in ps][:10]
    barrier()
    if rank == 0:
        remove_path(group_t)
        remove_path(one_t)

    shuffler = random.Random(opts["seed"])
    order: list[list[str]] = []
    phases: list[Any] = []  # per timed group save: every rank's last_save_phases()
    load_phases: list[Any] = []  # per timed group load: every rank's last_load_phases()
    for run in range(opts["repeat"]):
        steps = list(names)
        shuffler.shuffle(steps)
        order.append(steps)
        for name in steps:
            r = res[name]
            if r["error"] is not None:
                continue
            log(f"round {run + 1}/{opts['repeat']}: {name}")
            target = methods.target(workdir, name)
            if rank == 0:
                remove_path(target)
                os.sync()
            try:
                status: Optional[str] = None
                try:
                    save_s, _ = timed(lambda: methods.save(name, target))
                except Exception as exc:  # noqa: BLE001
                    status, save_s = f"{type(exc).__name__}: {exc}", 0.0
                statuses: list[Any] = [None] * ranks
                dist.all_gather_object(statuses, status)
                if any(statuses):
                    r["error"] = next(s for s in statuses if s)
                    continue
                if name == "fastpersist group":
                    per_rank: list[Any] = [None] * ranks
                    dist.all_gather_object(per_rank, last_save_phases())
                    phases.append(per_rank)
                if rank == 0:
                    r["file_bytes"] = total_size(target)
                    drop_page_cache_all([target])
                _release_heap()
                try:
                    load_s, loaded = timed(lambda: methods.load(name, target))
                    del loaded
                except Exception as exc:  # noqa: BLE001
                    status, load_s = f"{type(exc).__name__}: {exc}", 0.0
                dist.all_gather_object(statuses, status)
                if any(statuses):
                    r["error"] = next(s for s in statuses if s)
                    continue
                if name == "fastpersist group":
                    per_rank = [None] * ranks
                    dist.all_gather_object(per_rank, last_load_phases())
                    load_phases.append(per_rank)
                r["save"].append(save_s)
                r["load"].append(load_s)
            finally:
                barrier()
                if rank == 0 and not (opts["keep"] and run == opts["repeat"] - 1):
                    remove_path(target)
    return {"workload": workload, "results": res, "verification": verification, "order": order,
            "group_phases": phases, "group_load_phases": load_phases}


def _release_heap() -> None:
    """Hand the memory the C heap keeps from earlier rounds' freed tensors back to the
    kernel (glibc ``malloc_trim``), so that every timed load fills memory the rank never
    used, as a resumed job does. Without it ``torch.load``, whose storages come from
    malloc, reused last round's already-faulted memory, while fastpersist's read buffers
    are fresh mappings every time (the bias that made ``bench save`` load in fresh
    processes, docs/benchmarks.md "bench save")."""
    gc.collect()
    libc = libc_handle()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:  # glibc; other C libraries keep no such cache to trim
        trim(0)


def _progress_printer(enabled: bool) -> Callable[[str], None]:
    def log(msg: str) -> None:
        if enabled:
            print(f"  {msg}", file=sys.stderr, flush=True)

    return log


# --------------------------------------------------------------------------- the parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_dist_bench(
    directory: str,
    *,
    ranks: int = 2,
    size: int = 1 << 30,
    repeat: int = 3,
    threads: Optional[int] = None,
    dcp: bool = True,
    keep: bool = False,
    progress: bool = True,
    seed: int = 0,
    rank_bandwidth: Optional[int] = None,
) -> DistBenchResult:
    """Spawn ``ranks`` gloo processes, run the benchmark in ``directory`` and return its results
    (see the module docstring). ``rank_bandwidth``: each rank's write and read limit in bytes/s, in
    a cgroup of its own (:mod:`fastpersist.bench.cgroup`; ``RuntimeError`` when it cannot be set).
    Raises ``RuntimeError`` with a rank's traceback if a rank crashed."""
    import torch.multiprocessing as mp

    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, not {ranks}")
    if repeat < 1:
        raise ValueError(f"repeat must be positive, not {repeat}")
    threads = threads or config_mod.get_default().threads
    if rank_bandwidth is not None:
        if rank_bandwidth <= 0:
            raise ValueError(f"rank_bandwidth must be positive, not {rank_bandwidth}")
        why = cgroup.unavailable_reason()
        if why:
            raise RuntimeError(f"--rank-bandwidth: cannot limit each rank's bandwidth here: {why}")
        cgroup.device_of(directory)  # a ValueError naming the directory when it is on no block device
    machine = collect_machine_info(directory)
    workdir = os.path.join(os.path.abspath(directory), f"fastpersist-bench-dist-{os.getpid()}")
    os.makedirs(workdir, exist_ok=True)
    out = os.path.join(workdir, ".result.pkl")
    opts = {"size": size, "repeat": repeat, "threads": threads, "dcp": dcp, "keep": keep, "progress": progress,
            "seed": seed, "rank_bandwidth": rank_bandwidth}
    setup: dict[str, Any] = {}
    try:
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, ranks, port, workdir, opts, out)) for r in range(ranks)]
        for p in procs:
            p.start()
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):  # a rank crashed: the others would wait forever
                time.sleep(1.0)
                for p in procs:
                    if p.is_alive():
                        p.kill()
            time.sleep(0.2)
        for p in procs:
            p.join()
        errors = []
        for r in range(ranks):
            path = f"{out}.error-{r}"
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    errors.append(f"rank {r}:\n{f.read()}")
        if errors or not os.path.exists(out):
            codes = [p.exitcode for p in procs]
            raise RuntimeError("bench dist: a rank failed (exit codes " + str(codes) + ")\n" + "\n".join(errors))
        with open(out, "rb") as f:
            data = pickle.load(f)
        if os.path.exists(f"{out}.bandwidth"):
            with open(f"{out}.bandwidth", "rb") as f:
                setup = pickle.load(f)
    finally:
        remove_path(out)
        remove_path(f"{out}.bandwidth")
        if not keep:
            remove_path(workdir)
    workload = data["workload"]
    nbytes = workload["tensor_bytes"]
    methods = []
    for name, r in data["results"].items():
        kind = "replicated" if name in REPLICATED or name in DCP_REPLICATED else "sharded"
        methods.append(DistMethodResult(name, kind, nbytes, r["save"], r["load"], r["file_bytes"], r["error"]))
    notes = [
        "durable saves: time includes fsync of every file written and of its directory",
        "cold loads: rank 0 drops every file of the method from the page cache (posix_fadvise DONTNEED) first; "
        "every rank first returns its freed heap memory to the kernel (malloc_trim), so no loader reuses the "
        "previous round's memory",
        "GB/s = the state's tensor bytes (counted once, not per rank) / seconds of the slowest rank, decimal",
        f"all ranks on this machine, gloo over loopback, torch.set_num_threads(1) per rank, fastpersist threads "
        f"{threads} per rank, DCP thread_count {threads}",
        "replicated loads: every rank ends with the whole state; fastpersist rank 0's load is the collective "
        "load's default for gloo, fastpersist.load(path, group=WORLD): every rank reads the whole file, through "
        "the page cache when ranks share a host (dist_load 'auto' = 'whole', read_mode 'auto')",
    ]
    if dcp:
        notes.append("sharded: each rank saves 1/N of the state's tensors under keys of its own (plain tensors, "
                     "no DTensor); DCP plans and writes one file per rank")
    if keep:
        notes.append(f"files of the last round kept in {workdir}")
    notes.append("group save phases (JSON group_save_phases): per rank, the local seconds before each exchange "
                 "(plan, probe, crc, write, commit) and the seconds spent in it (waiting for the slowest rank)")
    if dcp:
        notes.append("dcp replicated: every rank passes the whole replicated state to dcp.save; DCP's planner "
                     "deduplicates it, so each tensor is written once, by one rank")
    if rank_bandwidth:
        notes.append(f"per-rank bandwidth: every rank in its own cgroup ({setup.get('controller', '?')}), write and "
                     f"read limited to {rank_bandwidth / 1e6:.0f} MB/s on device {setup.get('device', '?')}; the "
                     "limit holds O_DIRECT writes, reads, and buffered writes written back by fsync in the rank "
                     "(cgroup v1 leaves the flusher threads' background write-back unlimited: check with "
                     "fastpersist.bench.cgroup.check_limit)")
    return DistBenchResult(machine, ranks, threads, workload, repeat, methods, data["verification"], notes,
                           data["order"], data.get("group_phases", []), data.get("group_load_phases", []),
                           rank_bandwidth=rank_bandwidth, bandwidth_setup=setup)


# --------------------------------------------------------------------------- report


def print_dist_report(result: DistBenchResult, out: Optional[TextIO] = None) -> None:
    """Machine header, workload, the two tables, verification and notes."""
    out = out if out is not None else sys.stdout
    report.print_header(result.machine.summary_lines() + [f"Ranks      : {result.ranks} (gloo, this machine)"] + (
        [f"Bandwidth  : each rank limited to {result.rank_bandwidth / 1e6:.0f} MB/s write and read in its own cgroup "
         f"(device {result.bandwidth_setup.get('device', '?')}); N x B = {result.aggregate_limit_gbps:.3f} GB/s"]
        if result.rank_bandwidth else []), out)
    w = result.workload
    m = w["model"]
    print(f"Workload   : GPT training state: hidden {m['hidden']}, {m['layers']} layers, "
          f"{m['params'] / 1e6:.1f}M params; {w['tensors']} tensors, {format_bytes(w['tensor_bytes'])} of tensor data",
          file=out)
    print(f"Runs       : {result.repeat} per method (interleaved)", file=out)
    print(file=out)
    d = result.to_dict()
    headers = ["method", "save GB/s (runs)", "save median", "vs ref", "load GB/s (runs)", "load median", "vs ref",
               "file size"]
    for kind, title in (("replicated", "Replicated state (every rank holds it; ref: torch rank 0, or for dcp "
                                       "replicated: its FileSystemWriter)"),
                        ("sharded", "Sharded state through DCP (ref: dcp FileSystemWriter)")):
        rows = []
        for x in d["methods"]:
            if x["kind"] != kind:
                continue
            if x["error"] and not x["save_seconds"]:
                rows.append([x["name"], "-", "-", "-", "-", "-", "-", "failed/skipped"])
                continue
            rows.append([
                x["name"], " ".join(f"{v:.2f}" for v in x["save_gbps"]), _num(x["save_median_gbps"]),
                _ratio(x["save_vs_reference"]), " ".join(f"{v:.2f}" for v in x["load_gbps"]),
                _num(x["load_median_gbps"]), _ratio(x["load_vs_reference"]),
                format_bytes(x["file_bytes"]) if x["file_bytes"] is not None else "-",
            ])
        if rows:
            report.render_table(title, headers, rows, out)
    if result.rank_bandwidth:
        for x in d["methods"]:
            if x["save_median_gbps"]:
                print(f"vs N x B   : {x['name']}: save {_ratio(x['save_vs_aggregate_limit'])}, "
                      f"load {_ratio(x['load_vs_aggregate_limit'])}", file=out)
    if d.get("group_save_vs_dcp_replicated") is not None:
        print(f"Group vs DCP (replicated, FileSystemWriter): save {_ratio(d['group_save_vs_dcp_replicated'])}, "
              f"load {_ratio(d['group_load_vs_dcp_replicated'])}", file=out)
    print(f"Group save vs 1-rank fastpersist.save: {_ratio(d['group_save_vs_one_rank'])}; "
          f"group load (slices) vs every rank reading the whole file: {_ratio(d['group_load_vs_every_rank_whole'])}",
          file=out)
    for what, load in (("", False), ("load ", True)):
        for r, steps in enumerate(result.group_phase_medians(load=load)):
            if steps:
                parts = " ".join(f"{k} {_num2(x['local_s'])}+{_num2(x['exchange_s'])}" for k, x in steps.items())
                print(f"Group {what}phases rank {r} (median s, local+exchange): {parts}", file=out)
    v = result.verification
    print(f"Verified   : group file byte-identical to the 1-rank file: "
          f"{v.get('group_file_identical_to_one_rank')}; group load equals the state on every rank: "
          f"{v.get('group_load_equals_state_on_every_rank')}", file=out)
    for p in v.get("problems", []):
        print(f"  - {p}", file=out)
    for x in result.methods:
        if x.error:
            print(f"Error      : {x.name}: {x.error}", file=out)
    for note in result.notes:
        print(f"Note       : {note}", file=out)


def _num(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def _num2(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def _ratio(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


def plot_dist(result: DistBenchResult, path: str) -> None:
    """Bar chart of median save and load GB/s per method (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in result.methods if m.save_s]
    names = [m.name.replace(" ", "\n", 1) for m in methods]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 * len(names) + 3), 4.5))
    xs = list(range(len(names)))
    width = 0.38
    ax.bar([x - width / 2 for x in xs], [m.save_median_gbps or 0.0 for m in methods], width,
           label="durable save (median)", color="#3b75af")
    ax.bar([x + width / 2 for x in xs], [m.load_median_gbps or 0.0 for m in methods], width,
           label="cold load (median)", color="#ef8636")
    ax.set_xticks(xs)
    ax.set_xticklabels(names, fontsize=8)
    ax.set_ylabel("GB/s")
    ax.set_title(f"{result.ranks} ranks, {format_bytes(result.workload['tensor_bytes'])} "
                 f"({result.machine.filesystem} on {result.machine.block_device or result.machine.mount_source})")
    report.finish_plot(fig, ax, path)
