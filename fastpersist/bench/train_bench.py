"""``fastpersist bench train``: what checkpointing costs a real training loop.

DLIO's checkpoint measurement on an actual loop: a small GPT-style model (token
and position embeddings, pre-norm transformer layers with a causal mask, a
language-model head; ``torch.nn`` only) trained with Adam on random tokens, on
CUDA when present, else CPU. Every ``every`` steps the loop checkpoints
``{"model", "optim", "step"}`` with one method:

* ``none``: no checkpoint (the baseline, in every round);
* ``torch.save``: blocking ``torch.save`` (no fsync, as torch does);
* ``fastpersist.save``: blocking, durable ``fastpersist.save``;
* ``async-snapshot``: ``fastpersist.save_async(mode="snapshot")``;
* ``async-lazy``: ``fastpersist.save_async(mode="lazy")`` with ``fastpersist.guard(optimizer)``.

The other asynchronous checkpointers a user would pick, same model, interval and figure:

* ``dcp.async_save``: ``torch.distributed.checkpoint.async_save`` in its default
  (thread) mode, no process group (``no_dist=True``), ``FileSystemWriter``;
  before each new save the previous one's future is awaited (DCP's documented
  use; the wait counts as time in the save call).
* ``dcp.async_save-process``: ``AsyncCheckpointerType.PROCESS`` (a checkpoint
  daemon process; it needs a process group: a 1-rank gloo group is created
  for it) with ``DefaultStager``: pinned-memory staging where CUDA is
  available, else shared-memory staging (torch's ``StagingOptions`` pinned
  memory and async staging require CUDA). Its daemon's start-up and one save
  happen before the rounds, untimed, like fastpersist's staging pool warm-up.
* ``lightning-async``: Lightning's ``AsyncCheckpointIO(TorchCheckpointIO())``
  (clones every tensor on the caller's thread, then ``torch.save`` in a
  one-thread executor); the drain is its ``teardown()``.

DeepSpeed's decoupled FastPersist engine is tried (:func:`deepspeed_decoupled_status`)
and reported as not run, with the reason, when it cannot run here.

Verification: at every checkpoint step, every run (the baseline included, so
the cost cancels in "lost vs baseline") takes a fingerprint of the state
(CRC-32 of every tensor's bytes, :func:`fastpersist.bench.state.fingerprint`);
its time is excluded from the step times but not from the run's total. After
the drain every checkpoint is loaded (DCP's through ``dcp_to_torch_save``,
which turns the optimizer's integer keys into strings: keys are compared as
strings) and compared with the fingerprint of its step. Peak host memory:
a sampler thread reads the resident set size of this process and its children
(the DCP daemon included) every few ms; the figure is the peak above the
run's start.

Rounds (``rounds``, ``--rounds``): each round runs every method once and the
``none`` baseline, in an order shuffled by a seeded generator (``seed``), so that
slow phases of a shared machine spread over the methods instead of hitting one.
Figures are medians over rounds.

Per step it records the wall time of the step including the checkpoint call (and,
for lazy, the guard's wait inside the next ``optimizer.step``, also recorded on
its own from ``Guard.waited_s``). Two "lost" figures per run:

* *vs baseline*: ``total - total of the same round's no-checkpoint run``. This is
  the honest one: it includes steps made slower by background work.
* *vs median step*: ``total - steps x median step time`` of the same run, plus the
  final drain (DLIO's definition). It does not see a uniform slowdown of every
  step, so it flatters background work that competes with the training.

The final drain (``wait_all``) counts as lost in both. Before the rounds, one
untimed ``save_async`` allocates the page-locked staging pool (its time is
reported: a job pays it once, at its first async save); after every run an
untimed ``sync()`` writes back what ``torch.save`` left dirty in the page cache,
so that it does not slow the next run. The last checkpoint of
every run is loaded and compared tensor by tensor with a copy of the state taken
at its step (not timed).

Training threads (``train_threads``, ``--train-threads N``): torch's intra-op
threads for every method's loop, the baseline included (default: torch's own
default, usually one per core). On a GPU the step occupies the GPU and one host
thread, so the host's other cores are free for the checkpoint's background work;
on a CPU-only machine ``N`` below the core count emulates that, leaving cores to
the background copies and writes; with every core training, background work can
only take cycles from the step.
"""

from __future__ import annotations

import copy
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import torch

import fastpersist
from fastpersist.bench import state as state_mod
from fastpersist.bench.progress import progress as make_progress
from fastpersist.bench.report import finish_plot, print_header, render_table
from fastpersist.bench.rss import PeakMemory
from fastpersist.bench.train_peers import (
    DcpAsyncSaver,
    Saver,
    TieredSaver,
    deepspeed_decoupled_status,
    make_saver,
    process_staging_options,
    stop_dcp_daemon,
    str_keys,
    unavailable,
)

METHODS = ("none", "torch.save", "fastpersist.save", "async-snapshot", "async-lazy", "dcp.async_save",
           "dcp.async_save-process", "lightning-async", "async-tiered")
#: the tiered mode of s3:// URLs (needs ``s3=``): its lost time against async-snapshot's (target <= 1.2x)
TIERED = "async-tiered"
#: fastpersist's own asynchronous methods (the target: lost time at most 0.5x the best peer's)
FASTPERSIST_ASYNC = ("async-snapshot", "async-lazy")
#: the other asynchronous checkpointers
ASYNC_PEERS = ("dcp.async_save", "dcp.async_save-process", "lightning-async")


class GPT(torch.nn.Module):
    """A small decoder-only transformer, torch.nn only."""

    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Embedding(seq, d_model)
        layer = torch.nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        x = self.blocks(x, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(x))


@dataclass
class TrainRun:
    method: str
    step_s: list[float]
    checkpoint_steps: list[int]
    call_s: list[float] = field(default_factory=list)  # time inside each save call
    guard_wait_s: list[float] = field(default_factory=list)  # async-lazy: the guard's wait in each step
    drain_s: float = 0.0
    total_s: float = 0.0
    lost_s: float = 0.0  # total - steps x median step
    verified: Optional[bool] = None
    error: Optional[str] = None
    round: int = 0
    train_threads: int = 0  # torch.get_num_threads() inside the training loop
    lost_vs_baseline_s: float = math.nan  # total - total of the same round's no-checkpoint run
    checkpoints_verified: int = 0  # checkpoints loaded back and equal to the state at their step
    peak_rss_bytes: int = 0  # peak resident memory (this process + children) above the run's start
    fingerprint_s: float = 0.0  # time of the reference fingerprints (in total, not in step times)
    durable_wait_s: float = math.nan  # async-tiered: after the drain, the wait until every upload was durable (untimed)

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_s) if self.step_s else math.nan


def _median(values: Sequence[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return statistics.median(vals) if vals else math.nan


@dataclass
class TrainBenchResult:
    device: str
    params: int
    checkpoint_bytes: int
    steps: int
    every: int
    directory: str
    runs: list[TrainRun]
    baseline_total_s: float = math.nan  # median total of the no-checkpoint runs
    rounds: int = 1
    train_threads: Optional[int] = None  # --train-threads (None: torch's default)
    train_threads_applied: int = 0  # torch.get_num_threads() in the loops
    seed: int = 0
    orders: list[list[str]] = field(default_factory=list)  # each round's method order
    #: Seconds of one untimed ``save_async`` before the rounds, which allocated the
    #: page-locked staging pool (NaN: no async method, no warm-up).
    pool_warmup_s: float = math.nan
    #: Seconds of the untimed start of DCP's checkpoint daemon and its first save (NaN: not run).
    dcp_process_warmup_s: float = math.nan
    notes: list[str] = field(default_factory=list)

    @property
    def methods(self) -> list[str]:
        seen: list[str] = []
        for r in self.runs:
            if r.method not in seen:
                seen.append(r.method)
        return [m for m in METHODS if m in seen]

    def runs_of(self, method: str, ok: bool = True) -> list[TrainRun]:
        return [r for r in self.runs if r.method == method and (not ok or r.error is None)]

    def run(self, method: str) -> Optional[TrainRun]:
        found = self.runs_of(method, ok=False)
        return found[-1] if found else None

    def lost_vs_baseline(self, r: TrainRun) -> float:
        return r.lost_vs_baseline_s

    def median_lost(self, method: str) -> float:
        """Median over rounds of "lost vs median step" (DLIO's figure, incl. the drain)."""
        return _median([r.lost_s for r in self.runs_of(method)])

    def median_lost_vs_baseline(self, method: str) -> float:
        """Median over rounds of ``total - the same round's no-checkpoint total``."""
        return _median([r.lost_vs_baseline_s for r in self.runs_of(method)])

    def _over_torch(self, value: float, ref: float) -> Optional[float]:
        if math.isnan(value) or math.isnan(ref) or ref <= 0:
            return None
        return value / ref

    def ratio(self, method: str) -> Optional[float]:
        """Median lost time (vs median step) of ``method`` over that of blocking torch.save."""
        return self._over_torch(self.median_lost(method), self.median_lost("torch.save"))

    def ratio_vs_baseline(self, method: str) -> Optional[float]:
        """Median lost time vs the round's baseline of ``method`` over that of torch.save."""
        return self._over_torch(self.median_lost_vs_baseline(method), self.median_lost_vs_baseline("torch.save"))

    def summary(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for m in self.methods:
            rs = self.runs_of(m)
            checked = [r.verified for r in self.runs_of(m, ok=False) if r.verified is not None]
            out[m] = {
                "runs": len(rs),
                "errors": len(self.runs_of(m, ok=False)) - len(rs),
                "median_step_s": _median([r.median_step_s for r in rs]),
                "median_total_s": _median([r.total_s for r in rs]),
                "median_call_s": _median([sum(r.call_s) for r in rs]),
                "median_guard_wait_s": _median([sum(r.guard_wait_s) for r in rs]),
                "median_drain_s": _median([r.drain_s for r in rs]),
                "median_lost_s": self.median_lost(m),
                "median_lost_vs_baseline_s": self.median_lost_vs_baseline(m),
                "ratio_vs_torch_save": self.ratio(m) if m not in ("none", "torch.save") else None,
                "ratio_vs_torch_save_vs_baseline": self.ratio_vs_baseline(m) if m not in ("none", "torch.save") else None,
                "verified": f"{sum(1 for v in checked if v)}/{len(checked)}" if checked else None,
                "checkpoints_verified": sum(r.checkpoints_verified for r in self.runs_of(m, ok=False)),
                "checkpoints": sum(len(r.checkpoint_steps) for r in self.runs_of(m, ok=False)) if m != "none" else 0,
                "median_peak_rss_mib": _median([r.peak_rss_bytes / 2**20 for r in rs]),
                "median_durable_wait_s": _median([r.durable_wait_s for r in rs if not math.isnan(r.durable_wait_s)]),
            }
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for r, rd in zip(self.runs, d["runs"]):
            rd["median_step_s"] = r.median_step_s
        d["summary"] = self.summary()
        others = [m for m in self.methods if m not in ("none", "torch.save")]
        d["ratios_vs_torch_save"] = {m: self.ratio(m) for m in others}
        d["ratios_vs_torch_save_vs_baseline"] = {m: self.ratio_vs_baseline(m) for m in others}
        d["vs_best_async_peer"] = self.vs_best_peer()
        d["tiered_vs_async_snapshot"] = self.tiered_ratio()
        return d

    def tiered_ratio(self) -> Optional[float]:
        """Median lost time vs baseline of ``async-tiered`` over ``async-snapshot``'s (target <= 1.2)."""
        return self._over_torch(self.median_lost_vs_baseline(TIERED), self.median_lost_vs_baseline("async-snapshot"))

    def best_peer(self) -> tuple[Optional[str], float]:
        """The asynchronous peer with the least median lost time vs baseline (every checkpoint verified)."""
        best: tuple[Optional[str], float] = (None, math.nan)
        for m in ASYNC_PEERS:
            if not self.runs_of(m) or any(r.verified is not True for r in self.runs_of(m, ok=False)):
                continue
            lost = self.median_lost_vs_baseline(m)
            if not math.isnan(lost) and (best[0] is None or lost < best[1]):
                best = (m, lost)
        return best

    def vs_best_peer(self) -> dict[str, Optional[float]]:
        """Median lost time vs baseline of fastpersist's async methods over the best peer's (target <= 0.5)."""
        name, lost = self.best_peer()
        out: dict[str, Optional[float]] = {"best_peer": name}  # type: ignore[dict-item]
        for m in FASTPERSIST_ASYNC:
            mine = self.median_lost_vs_baseline(m)
            out[m] = None if name is None or math.isnan(mine) or lost <= 0 else mine / lost
        return out


def _state_bytes(state: Any) -> int:
    n = 0
    stack = [state]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            n += o.numel() * o.element_size()
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return n


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _one_run(method: str, directory: str, *, steps: int, every: int, device: str, dims: dict[str, int],
             batch: int, bar: Any, s3: Optional[str] = None) -> tuple[TrainRun, int, int]:
    torch.manual_seed(0)
    model = GPT(**dims).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    guard = fastpersist.guard(opt) if method == "async-lazy" else None
    gen = torch.Generator().manual_seed(1)
    ckpt_steps = [i for i in range(steps) if (i + 1) % every == 0 and i + 1 < steps]
    run = TrainRun(method, [], ckpt_steps, train_threads=torch.get_num_threads())
    expected: dict[str, Any] = {}  # path -> fingerprint of the state at its step
    nbytes = 0
    saver: Optional[Saver] = None
    memory: Optional[PeakMemory] = None
    try:
        saver = make_saver(method, s3, os.path.join(directory, "train-tier"))
        memory = PeakMemory()
        t_start = time.perf_counter()
        for i in range(steps):
            waited = guard.waited_s if guard is not None else 0.0
            t0 = time.perf_counter()
            idx = torch.randint(0, dims["vocab"], (batch, dims["seq"]), generator=gen).to(device)
            logits = model(idx[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if device == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if guard is not None:
                run.guard_wait_s.append(guard.waited_s - waited)
            if i in ckpt_steps:
                state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": i + 1}
                # The reference for verification, in every run (the baseline too: same cost, so it
                # cancels in "lost vs baseline"); kept out of the step times.
                tp = time.perf_counter()
                reference = str_keys(state_mod.fingerprint(state))
                nbytes = _state_bytes(state)
                run.fingerprint_s += time.perf_counter() - tp
                if saver is not None:
                    path = os.path.join(directory, f"train-{method.replace('.', '_')}-{i + 1}"
                                        + ("" if saver.directory else ".pt"))
                    expected[path] = reference
                    tc = time.perf_counter()
                    saver.save(state, path)
                    call = time.perf_counter() - tc
                    run.call_s.append(call)
                    dt += call
                del state
            run.step_s.append(dt)
            if bar is not None:
                bar.update(1)
        td = time.perf_counter()
        if saver is not None:
            saver.drain()
        run.drain_s = time.perf_counter() - td
        run.total_s = time.perf_counter() - t_start
        if isinstance(saver, TieredSaver):
            tw = time.perf_counter()
            saver.wait_durable()
            run.durable_wait_s = time.perf_counter() - tw
        run.peak_rss_bytes = memory.stop()
        memory = None
        run.lost_s = sum(run.step_s) - steps * run.median_step_s + run.drain_s
        if saver is not None and expected:
            ok = 0
            for path, ref in expected.items():
                problems = state_mod.compare_states(ref, str_keys(state_mod.fingerprint(saver.load(path))))
                ok += not problems
            run.checkpoints_verified = ok
            run.verified = ok == len(expected)
    except Exception as e:  # noqa: BLE001 - reported in the table
        run.error = f"{type(e).__name__}: {e}"
    finally:
        if memory is not None:
            memory.stop()
        if saver is not None:
            saver.close()
        if guard is not None:
            guard.remove()
        for name in os.listdir(directory):
            if name.startswith("train-"):
                _remove(os.path.join(directory, name))
    params = sum(p.numel() for p in model.parameters())
    return run, params, nbytes


def _remove(path: str) -> None:
    import shutil

    try:
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except OSError:
        pass


def _warm_pool(directory: str, *, device: str, dims: dict[str, int], batch: int) -> float:
    """One untimed ``save_async`` of the benchmark's state before the rounds: it
    allocates the page-locked staging pool that later async saves reuse. A training
    job pays this once, at its first async save (fresh memory: about 1 GB/s on the VMs
    measured); counted in the rounds it would land on whichever async run came first."""
    torch.manual_seed(0)
    model = GPT(**dims).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    idx = torch.randint(0, dims["vocab"], (batch, dims["seq"])).to(device)
    logits = model(idx[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1)).backward()
    opt.step()
    path = os.path.join(directory, "train-warmup.pt")
    t0 = time.perf_counter()
    fastpersist.save_async({"model": model.state_dict(), "optim": opt.state_dict(), "step": 0}, path).wait()
    took = time.perf_counter() - t0
    os.unlink(path)
    return took


def _settle_disk() -> None:
    """Write back every dirty page before the next run (untimed): ``torch.save`` leaves
    its checkpoints in the page cache, and their write-back must not slow the next
    method's run. (What a method's own write-back costs during its run stays in it.)"""
    os.sync()


def round_order(methods: Sequence[str], seed: int, rnd: int) -> list[str]:
    """Round ``rnd``'s method order: ``methods`` plus the ``none`` baseline, shuffled
    with a generator seeded by ``(seed, rnd)`` (the same order for the same seed)."""
    import random

    order = [m for m in METHODS if m in methods or m == "none"]
    random.Random(seed * 1_000_003 + rnd).shuffle(order)
    return order


def run_train_bench(
    directory: str,
    *,
    steps: int = 30,
    every: int = 5,
    layers: int = 4,
    d_model: int = 384,
    heads: int = 6,
    vocab: int = 8192,
    seq: int = 128,
    batch: int = 8,
    methods: Sequence[str] = METHODS,
    device: Optional[str] = None,
    progress: bool = True,
    rounds: int = 1,
    train_threads: Optional[int] = None,
    seed: int = 0,
    s3: Optional[str] = None,
) -> TrainBenchResult:
    """Train once per method per round and measure.

    Each of ``rounds`` rounds runs every method of ``methods`` once, plus the ``none``
    baseline (always), in a shuffled order seeded by ``seed``; a method's "lost vs
    baseline" is its total minus the same round's baseline total. ``train_threads``
    sets torch's intra-op threads (``torch.set_num_threads``) for every method's
    training loop, the baseline included (None: torch's default, left as it is);
    the previous value is restored on return. ``s3`` (``s3://bucket/prefix``): where
    ``async-tiered`` uploads its checkpoints (it saves them first to ``directory``);
    without it that method is not run. Its objects are deleted after each run.
    """
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, not {rounds}")
    if train_threads is not None and train_threads < 1:
        raise ValueError(f"train_threads must be >= 1, not {train_threads}")
    notes: list[str] = []
    for m in list(methods):
        why = unavailable(m) or (None if m != TIERED or s3 else "needs --s3 s3://bucket/prefix")
        if why:
            notes.append(f"{m}: not run ({why})")
            methods = [x for x in methods if x != m]
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dims = dict(vocab=vocab, d_model=d_model, layers=layers, heads=heads, seq=seq + 1)
    orders = [round_order(methods, seed, r) for r in range(rounds)]
    runs: list[TrainRun] = []
    params = nbytes = 0
    before = torch.get_num_threads()
    bar = make_progress(steps * sum(len(o) for o in orders), progress, f"round 1/{rounds} {orders[0][0]}",
                        unit="step")
    made_group = False
    dcp_warm = math.nan
    try:
        if train_threads is not None:
            torch.set_num_threads(train_threads)
        applied = torch.get_num_threads()
        warm = math.nan
        if any(m.startswith("async") for o in orders for m in o):
            warm = _warm_pool(directory, device=dev, dims=dims, batch=batch)
        if "dcp.async_save-process" in methods:
            made_group = _ensure_process_group(directory)
            dcp_warm = _warm_dcp_process(directory, device=dev, dims=dims, batch=batch)
            opts = process_staging_options()
            notes.append("dcp.async_save-process: AsyncCheckpointerType.PROCESS, DefaultStager with "
                         + ("pinned-memory staging" if opts.use_pinned_memory else
                            "shared-memory staging (torch's pinned-memory and async staging need CUDA, absent here)")
                         + (", in a 1-rank gloo process group made for it" if made_group else ""))
        for rnd, order in enumerate(orders):
            mine: list[TrainRun] = []
            for m in order:
                bar.set_description(f"round {rnd + 1}/{rounds} {m}")
                r, params, nb = _one_run(m, directory, steps=steps, every=every, device=dev, dims=dims, batch=batch,
                                         bar=bar, s3=s3)
                r.round = rnd
                _settle_disk()
                nbytes = nb or nbytes
                mine.append(r)
            base = [r for r in mine if r.method == "none" and r.error is None]
            for r in mine:
                if base and r.error is None:
                    r.lost_vs_baseline_s = r.total_s - base[0].total_s
            runs.extend(mine)
    finally:
        bar.close()
        torch.set_num_threads(before)
        if "dcp.async_save-process" in methods:
            stop_dcp_daemon()
        if made_group:
            import torch.distributed as dist

            dist.destroy_process_group()
    why = deepspeed_decoupled_status()
    notes.append(f"DeepSpeed's decoupled FastPersist engine: not measured: {why}")
    base_totals = [r.total_s for r in runs if r.method == "none" and r.error is None]
    return TrainBenchResult(dev, params, nbytes, steps, every, directory, runs, _median(base_totals),
                            rounds=rounds, train_threads=train_threads, train_threads_applied=applied, seed=seed,
                            orders=orders, pool_warmup_s=warm, dcp_process_warmup_s=dcp_warm, notes=notes)


def _ensure_process_group(directory: str) -> bool:
    """A 1-rank gloo process group for DCP's process mode; True when this call created it."""
    import tempfile

    import torch.distributed as dist

    if dist.is_initialized():
        return False
    fd, store = tempfile.mkstemp(prefix=".fastpersist-bench-pg-", dir=directory)
    os.close(fd)
    os.unlink(store)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    return True


def _warm_dcp_process(directory: str, *, device: str, dims: dict[str, int], batch: int) -> float:
    """Start DCP's checkpoint daemon with one untimed ``async_save`` (PROCESS) of the benchmark's state."""
    torch.manual_seed(0)
    model = GPT(**dims).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    path = os.path.join(directory, "train-dcp-warmup")
    saver = DcpAsyncSaver(process=True)
    t0 = time.perf_counter()
    try:
        saver.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 0}, path)
        saver.drain()
    finally:
        saver.close()
        _remove(path)
    return time.perf_counter() - t0


def _ratio_text(v: Optional[float]) -> str:
    return "" if v is None else f" ({v:.2f}x)"


def print_train_report(result: TrainBenchResult, out: Any = None) -> None:
    threads = (f"{result.train_threads_applied} (--train-threads)" if result.train_threads is not None
               else f"{result.train_threads_applied} (torch's default)")
    print_header([
        f"Training  : GPT-style, {result.params / 1e6:.1f}M params, Adam, on {result.device}; "
        f"intra-op threads: {threads}",
        f"Checkpoint: {result.checkpoint_bytes / 2**20:.0f} MiB (model + optimizer) every {result.every} steps, "
        f"{result.steps} steps per run, in {result.directory}",
        f"Rounds    : {result.rounds} (each: every method once + the no-checkpoint baseline, shuffled, seed "
        f"{result.seed}); figures are medians over rounds",
        "Lost      : vs baseline = total - the same round's no-checkpoint total; "
        "vs median = total - steps x median step of the same run, incl. final drain; (ratio to torch.save)",
    ] + ([] if math.isnan(result.pool_warmup_s) else [
        f"Warm-up   : one untimed save_async before the rounds allocated the page-locked staging pool in "
        f"{result.pool_warmup_s:.2f} s (a job pays this once, at its first async save); every run ends with "
        "an untimed sync() so that no method's write-back lands in the next run",
    ]), out)
    rows = []
    for m, d in result.summary().items():
        lost_b = d["median_lost_vs_baseline_s"]
        rows.append([
            m,
            f"{d['runs']}" + (f" ({d['errors']} failed)" if d["errors"] else ""),
            f"{d['median_step_s']:.3f}",
            f"{d['median_total_s']:.2f}",
            f"{d['median_call_s']:.2f}",
            f"{d['median_drain_s']:.2f}",
            "-" if m == "none" else f"{lost_b:+.2f}",
            "-" if d["ratio_vs_torch_save_vs_baseline"] is None else f"{d['ratio_vs_torch_save_vs_baseline']:.2f}x",
            f"{d['median_lost_s']:.2f}",
            f"{d['median_peak_rss_mib']:.0f}",
            f"{d['checkpoints_verified']}/{d['checkpoints']}" if m != "none" else "-",
        ])
    render_table("Training time lost to checkpointing (medians over rounds)",
                 ["method", "runs", "step s", "total s", "calls s", "drain s", "lost s", "vs torch", "lost/med s",
                  "peak MiB", "ckpts ok"], rows, out, width=130)
    print("Columns   : step s = median step incl. the save call; calls s = time inside save calls; lost s = total - "
          "the same round's no-checkpoint total (vs torch = its ratio to torch.save's); lost/med s = total - "
          "steps x median step, incl. drain (DLIO's)", file=out)
    vs = result.vs_best_peer()
    if vs["best_peer"] is not None:
        name, lost = result.best_peer()
        parts = [f"{m} {v:.2f}x" for m in FASTPERSIST_ASYNC if (v := vs.get(m)) is not None]
        print(f"vs peers  : best async peer {name} lost {lost:+.2f} s; fastpersist's lost time over it: "
              f"{', '.join(parts) if parts else '-'} (target <= 0.50x)", file=out)
    if result.runs_of(TIERED):
        ratio = result.tiered_ratio()
        print(f"Tiered    : async-tiered (save to s3:// through the local directory) lost "
              f"{result.median_lost_vs_baseline(TIERED):+.2f} s, async-snapshot {result.median_lost_vs_baseline('async-snapshot'):+.2f} s"
              + (f": {ratio:.2f}x (target <= 1.20x)" if ratio is not None else "")
              + f"; after training, the uploads needed {result.summary()[TIERED]['median_durable_wait_s']:.2f} s more to "
              "be durable (untimed); ckpts ok = each object read back from the store byte for byte equal to its "
              "local copy and to the state", file=out)
    print("Memory    : peak MiB = peak resident memory of this process and its children (DCP's daemon) above "
          "the run's start; ckpts ok = checkpoints read back equal to the state at their step", file=out)
    if not math.isnan(result.dcp_process_warmup_s):
        print(f"DCP warm  : DCP's checkpoint daemon started with one untimed save before the rounds "
              f"({result.dcp_process_warmup_s:.2f} s)", file=out)
    for note in result.notes:
        print(f"Note      : {note}", file=out)
    if result.rounds > 1 or any(r.error for r in result.runs):
        rows = []
        for r in result.runs:
            rows.append([
                str(r.round + 1), r.method, f"{r.median_step_s:.3f}", f"{r.total_s:.2f}", f"{sum(r.call_s):.2f}",
                f"{sum(r.guard_wait_s):.2f}" if r.guard_wait_s else "-",
                "-" if r.method == "none" or math.isnan(r.lost_vs_baseline_s) else f"{r.lost_vs_baseline_s:+.2f}",
                f"{r.lost_s:.2f}",
                {None: "-", True: "ok", False: "MISMATCH"}[r.verified] if r.error is None else r.error[:40],
            ])
        render_table("Every run", ["round", "method", "median step s", "total s", "in save calls s", "guard waits s",
                                   "lost vs baseline s", "lost vs median s", "bytes"], rows, out, width=130)


def plot_train(result: TrainBenchResult, path: str) -> None:
    """Step time over steps per method, checkpoint steps marked (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    seen = set()
    for r in result.runs:
        if r.method in seen or not r.step_s:  # each method's first run
            continue
        seen.add(r.method)
        line, = ax.plot(range(1, len(r.step_s) + 1), r.step_s, label=f"{r.method} (lost {r.lost_s:.2f} s)", linewidth=1.2)
        ax.scatter([s + 1 for s in r.checkpoint_steps], [r.step_s[s] for s in r.checkpoint_steps],
                   color=line.get_color(), marker="v", s=28)
    for s in (result.runs[0].checkpoint_steps if result.runs else []):
        ax.axvline(s + 1, color="grey", alpha=0.2, linewidth=0.8)
    ax.set_xlabel("step (checkpoints marked)")
    ax.set_ylabel("step time incl. checkpoint call (s)")
    ax.set_title(f"Step time, {result.checkpoint_bytes / 2**20:.0f} MiB checkpoint every {result.every} steps on {result.device}")
    finish_plot(fig, ax, path)
