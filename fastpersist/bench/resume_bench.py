"""``fastpersist bench resume``: what a user waits for when a job restarts from its checkpoint.

Three restores, each method in a fresh process with the checkpoint evicted from the
page cache first (``posix_fadvise DONTNEED``), interleaved round by round:

* ``lightning``: ``Trainer.fit(model, ckpt_path=...)`` of a LightningModule (a stack of
  ``Linear(width, width)`` layers, plain SGD, so the checkpoint is about ``--size``
  bytes) from the interpreter's start to the start of the first training step after
  the restore: with fastpersist's ``FastPersistCheckpointIO`` (the file it wrote) and
  with Lightning's stock ``TorchCheckpointIO`` (the file it wrote). Also reported:
  the part from the ``fit`` call to that step (imports and model construction taken
  out).
* ``load_model``: ``fastpersist.load_model(model, f)`` against safetensors'
  ``load_model(model, f)``, both of one ``.safetensors`` file written by safetensors'
  ``save_model`` (what a user already has), into a model built on the CPU first (the
  build is not timed).
* ``load_state_dict``: ``fastpersist.load_state_dict(model, f)`` against
  ``model.load_state_dict(torch.load(f, weights_only=True))``, both of one file written
  by ``torch.save``.

Every restored tensor is compared with the saved values in the first round (a
method that restores wrong values fails the benchmark). Times are medians over
``--repeat`` rounds; ``x stock`` is the stock method's time over fastpersist's.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from fastpersist.bench import report
from fastpersist.bench.fsutil import drop_page_cache_all
from fastpersist.bench.machine import collect_machine_info
from fastpersist.bench.report import print_header, render_table
from fastpersist.bench.units import format_bytes

SCENARIOS = ("lightning", "load_model", "load_state_dict")
#: per scenario: (fastpersist's method, the stock method)
METHODS = {
    "lightning": ("FastPersistCheckpointIO", "TorchCheckpointIO"),
    "load_model": ("fastpersist.load_model", "safetensors load_model"),
    "load_state_dict": ("fastpersist.load_state_dict", "torch.load + load_state_dict"),
}
WIDTH = 4096  # 64 MiB of fp32 per layer

# One child per (scenario, method, round). argv: request JSON. It prints one JSON line.
_CHILD = r'''
import time
T0 = time.time()
import json, os, sys
req = json.loads(sys.argv[1])
import torch
from torch import nn

def build(layers, width):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])

def expect(layers, width):
    return build(layers, width).state_dict()

def check(got, want):
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    if bad or set(got) != set(want):
        raise SystemExit(f"restored values differ: {bad[:5]} keys {sorted(set(got) ^ set(want))[:5]}")

scenario, method, path = req["scenario"], req["method"], req["path"]
layers, width = req["layers"], req["width"]
out = {}
if scenario == "lightning":
    import lightning as L
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = build(layers, width)
        def training_step(self, batch, i):
            if req["mode"] == "resume":
                print(json.dumps({"t_start": T0, "t_fit": T_FIT, "t_step": time.time(),
                                  "step": self.trainer.global_step}), flush=True)
                if req.get("check"):
                    want = {"net." + k: v for k, v in expect(layers, width).items()}
                    check(self.state_dict(), want)
                os._exit(0)
            return self.net(batch).square().mean()
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)  # lr 0: the saved values stay the built ones
        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.ones(8, width), batch_size=4)

    if method == "FastPersistCheckpointIO":
        from fastpersist.integrations.lightning import FastPersistCheckpointIO
        io = FastPersistCheckpointIO()
    else:
        io = TorchCheckpointIO()
    kw = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, plugins=[io], num_sanity_val_steps=0)
    model = Module()
    if req["mode"] == "write":
        trainer = L.Trainer(max_steps=1, **kw)
        trainer.fit(model)
        trainer.save_checkpoint(path)
    else:
        trainer = L.Trainer(max_steps=2, **kw)
        T_FIT = time.time()
        trainer.fit(model, ckpt_path=path)
        raise SystemExit("the first step after the restore never ran")
elif scenario == "load_model":
    import safetensors.torch as st
    model = build(layers, width) if req["mode"] == "write" else nn.Sequential(
        *[nn.Linear(width, width, bias=False) for _ in range(layers)])
    if req["mode"] == "write":
        st.save_model(model, path)
    else:
        t = time.time()
        if method == "fastpersist.load_model":
            import fastpersist
            fastpersist.load_model(model, path)
        else:
            st.load_model(model, path)
        out["seconds"] = time.time() - t
        if req.get("check"):
            check(model.state_dict(), expect(layers, width))
        print(json.dumps(out), flush=True)
else:
    if req["mode"] == "write":
        torch.save(build(layers, width).state_dict(), path)
    else:
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
        t = time.time()
        if method == "fastpersist.load_state_dict":
            import fastpersist
            fastpersist.load_state_dict(model, path)
        else:
            model.load_state_dict(torch.load(path, weights_only=True))
        out["seconds"] = time.time() - t
        if req.get("check"):
            check(model.state_dict(), expect(layers, width))
        print(json.dumps(out), flush=True)
'''


@dataclass
class Row:
    """One scenario's figures: seconds per round for fastpersist's and the stock method."""

    scenario: str
    fastpersist: list[float] = field(default_factory=list)
    stock: list[float] = field(default_factory=list)
    #: lightning only: from the ``fit`` call to the first step, per round
    fastpersist_fit: list[float] = field(default_factory=list)
    stock_fit: list[float] = field(default_factory=list)

    def speedup(self) -> Optional[float]:
        """Stock's median time over fastpersist's (> 1: fastpersist restores faster)."""
        if not self.fastpersist or not self.stock:
            return None
        return statistics.median(self.stock) / statistics.median(self.fastpersist)


@dataclass
class ResumeResult:
    """The benchmark's result (``--json`` writes it)."""

    directory: str
    size: int
    layers: int
    repeat: int
    machine: dict[str, Any]
    rows: list[Row]


def _child(req: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("FASTPERSIST_PATCH_TORCH_SAVE", None)  # the stock methods must be stock
    t = time.time()
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(req)], env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or (req["mode"] != "write" and not lines):
        raise RuntimeError(f"bench resume: {req['scenario']} / {req['method']} ({req['mode']}) failed with status "
                           f"{proc.returncode}:\n{proc.stderr[-3000:]}")
    got = json.loads(lines[-1]) if lines else {}
    got["spawned"] = t
    return got


def run_resume_bench(directory: str, size: int, repeat: int = 3, scenarios: tuple[str, ...] = SCENARIOS,
                     keep: bool = False, progress: bool = True) -> ResumeResult:
    """Write each scenario's checkpoints into a scratch folder under ``directory``, then time
    the restores (see the module's docstring)."""
    layers = max(1, size // (WIDTH * WIDTH * 4))
    work = tempfile.mkdtemp(prefix="fp-bench-resume-", dir=directory)
    rows = {s: Row(s) for s in scenarios}
    paths: dict[tuple[str, str], str] = {}
    try:
        for s in scenarios:
            for m in METHODS[s]:
                if s == "lightning":
                    path = os.path.join(work, f"{s}-{'fp' if m == METHODS[s][0] else 'stock'}.ckpt")
                else:
                    path = os.path.join(work, f"{s}.{'safetensors' if s == 'load_model' else 'pt'}")
                paths[(s, m)] = path
                if not os.path.exists(path):
                    _child({"scenario": s, "method": m, "path": path, "mode": "write",
                            "layers": layers, "width": WIDTH})
        for r in range(repeat):
            for s in scenarios:
                order = METHODS[s] if r % 2 == 0 else METHODS[s][::-1]
                for m in order:
                    drop_page_cache_all([paths[(s, m)]])
                    got = _child({"scenario": s, "method": m, "path": paths[(s, m)], "mode": "resume",
                                  "layers": layers, "width": WIDTH, "check": r == 0})
                    fp = m == METHODS[s][0]
                    row = rows[s]
                    if s == "lightning":
                        (row.fastpersist if fp else row.stock).append(got["t_step"] - got["spawned"])
                        (row.fastpersist_fit if fp else row.stock_fit).append(got["t_step"] - got["t_fit"])
                    else:
                        (row.fastpersist if fp else row.stock).append(got["seconds"])
                    if progress:
                        print(f"  round {r + 1}/{repeat} {s:16s} {m:30s} "
                              f"{(row.fastpersist if fp else row.stock)[-1]:7.2f} s", file=sys.stderr, flush=True)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    return ResumeResult(directory, layers * WIDTH * WIDTH * 4, layers, repeat, collect_machine_info(directory),
                        list(rows.values()))


def print_resume_report(result: ResumeResult) -> None:
    """The table: median seconds of each method and the speed-up over stock."""
    print_header([f"Checkpoint : {format_bytes(result.size)} ({result.layers} x Linear({WIDTH}, {WIDTH}), fp32), "
                  f"{result.repeat} rounds, cold page cache, fresh processes"])

    def med(xs: list[float]) -> str:
        return f"{statistics.median(xs):.2f}" if xs else "-"

    rows = []
    for row in result.rows:
        fp_name, stock_name = METHODS[row.scenario]
        sp = row.speedup()
        rows.append([row.scenario, f"{fp_name} / {stock_name}", med(row.fastpersist), med(row.stock),
                     f"{sp:.2f}x" if sp else "-"])
        if row.fastpersist_fit:
            fit_sp = statistics.median(row.stock_fit) / statistics.median(row.fastpersist_fit)
            rows.append(["  fit() to 1st step", "", med(row.fastpersist_fit), med(row.stock_fit), f"{fit_sp:.2f}x"])
    render_table("Resume: seconds until training goes on (medians)",
                 ["scenario", "fastpersist / stock", "fastpersist s", "stock s", "x stock"], rows)


def add_cli(bsub: Any, debug: Any, add_outputs: Any, size: Any, positive: Any) -> None:
    """Register ``fastpersist bench resume`` on the ``bench`` subparsers."""
    p = bsub.add_parser("resume", parents=[debug],
                        help="time to resume training: Lightning fit(ckpt_path=...), load_model, load_state_dict, "
                        "fastpersist vs stock",
                        description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--dir", required=True, help="directory on the disk to measure (checkpoints go there)")
    p.add_argument("--size", type=size, default=1 << 30, help="checkpoint bytes (default: 1GiB; multiples of 64MiB)")
    p.add_argument("--repeat", type=positive, default=3, help="rounds (default: 3)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"subset of {','.join(SCENARIOS)}")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    p.add_argument("--json", metavar="FILE", help="write results as JSON to FILE ('-': standard output)")
    p.add_argument("--no-progress", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_bench_resume)


def cmd_bench_resume(args: Any) -> int:
    """``fastpersist bench resume``."""
    scenarios = tuple(s.strip() for s in args.scenarios.split(",") if s.strip())
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad:
        raise ValueError(f"--scenarios: unknown {bad}; choose from {','.join(SCENARIOS)}")
    os.makedirs(args.dir, exist_ok=True)
    result = run_resume_bench(args.dir, args.size, args.repeat, scenarios, keep=args.keep,
                              progress=not args.no_progress)
    print_resume_report(result)
    if args.json:
        report.write_json(asdict(result), args.json)
    return 0
