"""``fastpersist bench train``: what checkpointing costs a real training loop.

DLIO's checkpoint measurement on an actual loop: a small GPT-style model (token
and position embeddings, pre-norm transformer layers with a causal mask, a
language-model head; ``torch.nn`` only) trained with Adam on random tokens, on
CUDA when present, else CPU. Every ``every`` steps the loop checkpoints
``{"model", "optim", "step"}`` with one method:

* ``none``: no checkpoint (the baseline, run first and last);
* ``torch.save``: blocking ``torch.save`` (no fsync, as torch does);
* ``fastpersist.save``: blocking, durable ``fastpersist.save``;
* ``async-snapshot``: ``fastpersist.save_async(mode="snapshot")``;
* ``async-lazy``: ``fastpersist.save_async(mode="lazy")`` with ``fastpersist.guard(optimizer)``.

Per step it records the wall time of the step including the checkpoint call (and,
for lazy, the guard's wait inside the next ``optimizer.step``). *Lost* time is
``total - steps x median step time`` of the same run (each run is its own
baseline, which keeps other load on the machine out of the comparison; the
checkpoint steps are a minority, so the median is a step without checkpoint
cost); the difference of totals against the baseline runs is reported beside it.
The final drain (``wait_all``) counts as lost. The last checkpoint is loaded and
compared tensor by tensor with a copy of the state taken at its step.
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
    drain_s: float = 0.0
    total_s: float = 0.0
    lost_s: float = 0.0  # total - steps x median step
    verified: Optional[bool] = None
    error: Optional[str] = None

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_s) if self.step_s else math.nan


@dataclass
class TrainBenchResult:
    device: str
    params: int
    checkpoint_bytes: int
    steps: int
    every: int
    directory: str
    runs: list[TrainRun]
    baseline_total_s: float = math.nan

    def run(self, method: str) -> Optional[TrainRun]:
        found = [r for r in self.runs if r.method == method]
        return found[-1] if found else None

    def lost_vs_baseline(self, r: TrainRun) -> float:
        return r.total_s - self.baseline_total_s

    def ratio(self, method: str) -> Optional[float]:
        """Lost time of ``method`` over that of blocking torch.save."""
        t, m = self.run("torch.save"), self.run(method)
        if t is None or m is None or t.lost_s <= 0:
            return None
        return m.lost_s / t.lost_s

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for r, rd in zip(self.runs, d["runs"]):
            rd["median_step_s"] = r.median_step_s
            rd["lost_vs_baseline_s"] = self.lost_vs_baseline(r)
        d["ratios_vs_torch_save"] = {m: self.ratio(m) for m in METHODS if m not in ("none", "torch.save")}
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
    run = TrainRun(method, [], ckpt_steps)
    expected: Any = None
    path = ""
    nbytes = 0
    t_start = time.perf_counter()
    try:
        for i in range(steps):
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
) -> TrainBenchResult:
    """Train once per method (the ``none`` baseline first and last) and measure."""
    from tqdm.auto import tqdm

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dims = dict(vocab=vocab, d_model=d_model, layers=layers, heads=heads, seq=seq + 1)
    order = list(methods)
    if "none" in order:
        order.remove("none")
        order = ["none", *order, "none"]
    runs: list[TrainRun] = []
    params = nbytes = 0
    bar = tqdm(total=steps * len(order), disable=not progress, unit="step", leave=False, dynamic_ncols=True)
    try:
        for m in order:
            bar.set_description(m)
            r, params, nb = _one_run(m, directory, steps=steps, every=every, device=dev, dims=dims, batch=batch, bar=bar)
            nbytes = nb or nbytes
            runs.append(r)
    finally:
        bar.close()
    base = [r.total_s for r in runs if r.method == "none" and r.error is None]
    res = TrainBenchResult(dev, params, nbytes, steps, every, directory, runs,
                           statistics.mean(base) if base else math.nan)
    return res


def print_train_report(result: TrainBenchResult, out: Any = None) -> None:
    from fastpersist.bench.report import print_header, render_table

    print_header([
        f"Training  : GPT-style, {result.params / 1e6:.1f}M params, Adam, on {result.device}",
        f"Checkpoint: {result.checkpoint_bytes / 2**20:.0f} MiB (model + optimizer) every {result.every} steps, "
        f"{result.steps} steps per run, in {result.directory}",
        "Lost      : total - steps x median step (same run), incl. final drain; "
        "vs baseline: total - mean total of the no-checkpoint runs",
    ], out)
    rows = []
    for r in result.runs:
        ratio = result.ratio(r.method) if r.method not in ("none", "torch.save") else None
        rows.append([
            r.method,
            f"{r.median_step_s:.3f}",
            f"{r.total_s:.2f}",
            f"{sum(r.call_s):.2f}",
            f"{r.lost_s:.2f}",
            f"{result.lost_vs_baseline(r):+.2f}",
            "-" if ratio is None else f"{ratio:.2f}x",
            {None: "-", True: "ok", False: "MISMATCH"}[r.verified] if r.error is None else r.error[:40],
        ])
    render_table("Training time lost to checkpointing",
                 ["method", "median step s", "total s", "in save calls s", "lost s", "vs baseline s",
                  "lost / torch.save", "bytes"], rows, out)


def plot_train(result: TrainBenchResult, path: str) -> None:
    """Step time over steps per method, checkpoint steps marked (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastpersist.bench.report import _finish_plot

    fig, ax = plt.subplots(figsize=(9, 4.5))
    seen = set()
    for r in result.runs:
        if r.method in seen or not r.step_s:
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
