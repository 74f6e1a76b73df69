"""Accelerate with fastpersist: one call (or one environment variable), nothing else changes.

Trains a small MLP on CPU with an ``Accelerator`` whose ``save_state`` uses
``ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)``, with
``fastpersist.integrations.accelerate.enable(accelerator)``; resumes from the newest
checkpoint with ``load_state`` in a fresh model and checks the weights; then times
``save_state`` of the same trained state in the same run:

- Accelerate's own writers, plus an fsync of every file and directory of the
  checkpoint (stock Accelerate fsyncs nothing: without it the time is not durable),
- through fastpersist (durable on return; old checkpoints deleted only after that).

Without code: ``FASTPERSIST_ACCELERATE=1 accelerate launch train.py`` (Accelerate's
config file cannot carry the variable) enables every Accelerator, once fastpersist's
start-up hook is installed with the package.

    python examples/accelerate_fastpersist.py                 # tiny, seconds
    python examples/accelerate_fastpersist.py --hidden 2048   # bigger checkpoints
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

from fastpersist.commit import fsync_dir, fsync_path
from fastpersist.integrations import accelerate as fp_accelerate


def build(hidden: int, project_dir: str, total_limit: int = 2):
    torch.manual_seed(0)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=project_dir, automatic_checkpoint_naming=True, total_limit=total_limit))
    model = torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def train(acc, model, opt, sched, steps: int) -> float:
    g = torch.Generator().manual_seed(acc.step)
    loss = torch.zeros(())
    for _ in range(steps):
        x, y = torch.randn(32, 64, generator=g), torch.randn(32, 8, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        acc.step += 1
    return float(loss.detach())


def fsync_tree(directory: str) -> None:
    for root, _dirs, files in os.walk(directory, topdown=False):
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_dir(root)
    fsync_dir(os.path.dirname(os.path.abspath(directory)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256, help="MLP width (checkpoint ~ 12 * hidden^2 bytes)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3, help="timed saves per variant")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory, removed)")
    args = p.parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="fastpersist-accelerate-")
    os.makedirs(root, exist_ok=True)
    try:
        # 1. Train, checkpoint every few steps through fastpersist (total_limit=2).
        acc, model, opt, sched = build(args.hidden, os.path.join(root, "run"))
        fp_accelerate.enable(acc)
        for _ in range(3):
            loss = train(acc, model, opt, sched, args.steps // 3 or 1)
            where = acc.save_state()
        kept = sorted(os.listdir(os.path.join(root, "run", "checkpoints")))
        print(f"trained {acc.step} steps (loss {loss:.4f}); checkpoints kept: {kept}; newest {where}")
        want = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}

        # 2. Resume in a fresh Accelerator/model from the newest checkpoint.
        acc2, model2, opt2, sched2 = build(args.hidden, os.path.join(root, "run"))
        fp_accelerate.enable(acc2)
        acc2.load_state(where)
        got = acc2.unwrap_model(model2).state_dict()
        assert all(torch.equal(want[k], got[k]) for k in want), "resumed weights differ"
        loss2 = train(acc2, model2, opt2, sched2, 2)
        print(f"resumed from {os.path.basename(where)} at step {acc2.step - 2}: weights equal; 2 more steps, loss {loss2:.4f}")

        # 3. Time save_state, stock (+ fsync) vs fastpersist, interleaved, same state.
        size = sum(os.path.getsize(os.path.join(where, f)) for f in os.listdir(where))
        times: dict = {"stock": [], "fastpersist": []}
        for i in range(args.repeats):
            for variant in ("stock", "fastpersist"):
                out = os.path.join(root, f"{variant}_{i}")
                if variant == "stock":
                    fp_accelerate.disable(acc2)
                else:
                    fp_accelerate.enable(acc2)
                acc2.project_configuration.automatic_checkpoint_naming = False
                t0 = time.perf_counter()
                acc2.save_state(out)
                if variant == "stock":
                    fsync_tree(out)
                times[variant].append(time.perf_counter() - t0)
                shutil.rmtree(out)
        print(f"save_state of {size / 2**20:.1f} MiB ({len(os.listdir(where))} files), median of {args.repeats}:")
        stock, fast = statistics.median(times["stock"]), statistics.median(times["fastpersist"])
        print(f"  stock Accelerate + fsync : {stock * 1e3:8.1f} ms")
        print(f"  fastpersist              : {fast * 1e3:8.1f} ms  ({stock / fast:.2f}x)")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
