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

METHODS = ("none", "torch.save", "fastpersist.save", "async-snapshot", "async-lazy")


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
            }
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for r, rd in zip(self.runs, d["runs"]):
            rd["median_step_s"] = r.median_step_s
        d["summary"] = self.summary()
        others = [m for m in METHODS if m not in ("none", "torch.save")]
        d["ratios_vs_torch_save"] = {m: self.ratio(m) for m in others}
        d["ratios_vs_torch_save_vs_baseline"] = {m: self.ratio_vs_baseline(m) for m in others}
        return d


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
             batch: int, bar: Any) -> tuple[TrainRun, int, int]:
    import fastpersist

    torch.manual_seed(0)
    model = GPT(**dims).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    guard = fastpersist.guard(opt) if method == "async-lazy" else None
    gen = torch.Generator().manual_seed(1)
    ckpt_steps = [i for i in range(steps) if (i + 1) % every == 0 and i + 1 < steps]
    last = ckpt_steps[-1] if ckpt_steps else None
    run = TrainRun(method, [], ckpt_steps, train_threads=torch.get_num_threads())
    expected: Any = None
    path = ""
    nbytes = 0
    t_start = time.perf_counter()
    try:
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
            if i in ckpt_steps and method != "none":
                state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": i + 1}
                paused = 0.0
                if i == last:  # the reference copy for verification: not timed
                    tp = time.perf_counter()
                    expected = copy.deepcopy({k: v for k, v in state.items()})
                    nbytes = _state_bytes(state)
                    paused = time.perf_counter() - tp
                path = os.path.join(directory, f"train-{method.replace('.', '_')}-{i + 1}.pt")
                tc = time.perf_counter()
                if method == "torch.save":
                    torch.save(state, path)
                elif method == "fastpersist.save":
                    fastpersist.save(state, path)
                elif method == "async-snapshot":
                    fastpersist.save_async(state, path, mode="snapshot")
                else:
                    fastpersist.save_async(state, path, mode="lazy")
                call = time.perf_counter() - tc
                run.call_s.append(call)
                dt += call
                t_start += paused
                del state
            run.step_s.append(dt)
            if bar is not None:
                bar.update(1)
        td = time.perf_counter()
        fastpersist.wait_all()
        run.drain_s = time.perf_counter() - td
        run.total_s = time.perf_counter() - t_start
        run.lost_s = sum(run.step_s) - steps * run.median_step_s + run.drain_s
        if expected is not None:
            run.verified = _equal(torch.load(path, map_location="cpu", weights_only=False), expected)
    except Exception as e:  # noqa: BLE001 - reported in the table
        run.error = f"{type(e).__name__}: {e}"
        try:
            fastpersist.wait_all()
        except Exception:  # noqa: BLE001 - already reported as this run's error
            pass
    finally:
        if guard is not None:
            guard.remove()
        for name in os.listdir(directory):
            if name.startswith("train-"):
                try:
                    os.unlink(os.path.join(directory, name))
                except OSError:
                    pass
    params = sum(p.numel() for p in model.parameters())
    return run, params, nbytes


def _warm_pool(directory: str, *, device: str, dims: dict[str, int], batch: int) -> float:
    """One untimed ``save_async`` of the benchmark's state before the rounds: it
    allocates the page-locked staging pool that later async saves reuse. A training
    job pays this once, at its first async save (fresh memory: about 1 GB/s on the VMs
    measured); counted in the rounds it would land on whichever async run came first."""
    import fastpersist

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
) -> TrainBenchResult:
    """Train once per method per round and measure.

    Each of ``rounds`` rounds runs every method of ``methods`` once, plus the ``none``
    baseline (always), in a shuffled order seeded by ``seed``; a method's "lost vs
    baseline" is its total minus the same round's baseline total. ``train_threads``
    sets torch's intra-op threads (``torch.set_num_threads``) for every method's
    training loop, the baseline included (None: torch's default, left as it is);
    the previous value is restored on return.
    """
    from tqdm.auto import tqdm

    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, not {rounds}")
    if train_threads is not None and train_threads < 1:
        raise ValueError(f"train_threads must be >= 1, not {train_threads}")
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dims = dict(vocab=vocab, d_model=d_model, layers=layers, heads=heads, seq=seq + 1)
    orders = [round_order(methods, seed, r) for r in range(rounds)]
    runs: list[TrainRun] = []
    params = nbytes = 0
    before = torch.get_num_threads()
    bar = tqdm(total=steps * sum(len(o) for o in orders), disable=not progress, unit="step", leave=False,
               dynamic_ncols=True)
    try:
        if train_threads is not None:
            torch.set_num_threads(train_threads)
        applied = torch.get_num_threads()
        warm = math.nan
        if any(m.startswith("async") for o in orders for m in o):
            warm = _warm_pool(directory, device=dev, dims=dims, batch=batch)
        for rnd, order in enumerate(orders):
            mine: list[TrainRun] = []
            for m in order:
                bar.set_description(f"round {rnd + 1}/{rounds} {m}")
                r, params, nb = _one_run(m, directory, steps=steps, every=every, device=dev, dims=dims, batch=batch,
                                         bar=bar)
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
    base_totals = [r.total_s for r in runs if r.method == "none" and r.error is None]
    return TrainBenchResult(dev, params, nbytes, steps, every, directory, runs, _median(base_totals),
                            rounds=rounds, train_threads=train_threads, train_threads_applied=applied, seed=seed,
                            orders=orders, pool_warmup_s=warm)


def _ratio_text(v: Optional[float]) -> str:
    return "" if v is None else f" ({v:.2f}x)"


def print_train_report(result: TrainBenchResult, out: Any = None) -> None:
    from fastpersist.bench.report import print_header, render_table

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
            f"{d['median_guard_wait_s']:.2f}" if m == "async-lazy" else "-",
            f"{d['median_drain_s']:.2f}",
            "-" if m == "none" else f"{lost_b:+.2f}{_ratio_text(d['ratio_vs_torch_save_vs_baseline'])}",
            f"{d['median_lost_s']:.2f}{_ratio_text(d['ratio_vs_torch_save'])}",
            d["verified"] or "-",
        ])
    render_table("Training time lost to checkpointing (medians over rounds)",
                 ["method", "runs", "median step s", "total s", "in save calls s", "guard waits s", "drain s",
                  "lost vs baseline s", "lost vs median s", "bytes ok"], rows, out)
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
                                   "lost vs baseline s", "lost vs median s", "bytes"], rows, out)


def plot_train(result: TrainBenchResult, path: str) -> None:
    """Step time over steps per method, checkpoint steps marked (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastpersist.bench.report import _finish_plot

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
    _finish_plot(fig, ax, path)
