"""DeepSpeed with fastpersist: one call after ``deepspeed.initialize``, nothing else changes.

Trains a small MLP on CPU with DeepSpeed (ZeRO stage 1 by default, gloo, one
process; under the ``deepspeed``/``torchrun`` launchers it runs on every rank), with
``fastpersist.integrations.deepspeed.enable(engine)``: ``save_checkpoint`` writes
DeepSpeed's own files through fastpersist and ``latest`` names the checkpoint only
once every rank's files are durable. Resumes with ``load_checkpoint`` in a fresh
engine and checks the weights, then times ``save_checkpoint`` of the same trained
state in the same run:

- DeepSpeed's own ``TorchCheckpointEngine``, plus an fsync of every file and
  directory of the checkpoint (stock DeepSpeed fsyncs nothing),
- fastpersist's ``FastPersistCheckpointEngine`` (durable when it returns),
- fastpersist's engine with ``decoupled=True``: the time training is blocked (the
  writes finish in the background and DeepSpeed commits at the next step).

Without code: ``FASTPERSIST_DEEPSPEED=1 deepspeed train.py`` enables every engine, and
a top-level ``"fastpersist": true`` in the DeepSpeed config enables the engines built
from that config, once fastpersist's start-up hook is installed with the package.

    python examples/deepspeed_fastpersist.py                 # tiny, seconds
    python examples/deepspeed_fastpersist.py --hidden 2048   # bigger checkpoints
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # this example trains on CPU
if "RANK" not in os.environ:  # one process unless a launcher set these
    import socket

    with socket.socket() as _s:
        _s.bind(("127.0.0.1", 0))
        _port = str(_s.getsockname()[1])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=_port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")

import torch  # noqa: E402
import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402

from fastpersist.commit import fsync_dir, fsync_path  # noqa: E402
from fastpersist.integrations import deepspeed as fp_deepspeed  # noqa: E402


def build(hidden: int, stage: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 8))
    config = {"train_batch_size": 32 * dist.get_world_size(), "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train(engine, steps: int) -> float:
    g = torch.Generator().manual_seed(engine.global_steps * 1000 + dist.get_rank())
    loss = torch.zeros(())
    for _ in range(steps):
        x, y = torch.randn(32, 64, generator=g), torch.randn(32, 8, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    return float(loss.detach())


def weights(engine) -> dict:
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def fsync_tree(directory: str) -> None:
    for root, _dirs, files in os.walk(directory, topdown=False):
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_dir(root)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256, help="MLP width (checkpoint ~ 16 * hidden^2 bytes)")
    p.add_argument("--stage", type=int, default=1, choices=[0, 1, 2, 3], help="ZeRO stage")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3, help="timed saves per variant")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory, removed)")
    args = p.parse_args(argv)
    deepspeed.init_distributed(dist_backend="gloo")
    root = args.dir or tempfile.mkdtemp(prefix="fastpersist-deepspeed-")
    if dist.get_world_size() > 1:  # every rank writes into the same directory
        holder = [root]
        dist.broadcast_object_list(holder, src=0)
        root = holder[0]
    rank0 = dist.get_rank() == 0
    try:
        # 1. Train and checkpoint through fastpersist.
        engine = build(args.hidden, args.stage)
        fp_deepspeed.enable(engine)
        ckpt = os.path.join(root, "run")
        for _ in range(2):
            loss = train(engine, args.steps // 2 or 1)
            engine.save_checkpoint(ckpt)
        want = weights(engine)
        tag = open(os.path.join(ckpt, "latest")).read()
        if rank0:
            print(f"trained {engine.global_steps} steps with ZeRO-{args.stage} (loss {loss:.4f}); "
                  f"latest = {tag}: {sorted(os.listdir(os.path.join(ckpt, tag)))}")

        # 2. Resume in a fresh engine.
        engine2 = build(args.hidden, args.stage)
        fp_deepspeed.enable(engine2)
        engine2.load_checkpoint(ckpt)
        got = weights(engine2)
        assert all(torch.equal(want[k], got[k]) for k in want), "resumed weights differ"
        loss2 = train(engine2, 2)
        if rank0:
            print(f"resumed from {tag}: weights equal; 2 more steps, loss {loss2:.4f}")

        # 3. Time save_checkpoint: stock engine (+ fsync), fastpersist, fastpersist decoupled.
        stock_engine = deepspeed.runtime.checkpoint_engine.TorchCheckpointEngine(None)
        fp_engine = fp_deepspeed.FastPersistCheckpointEngine(None)
        dec_engine = fp_deepspeed.FastPersistCheckpointEngine(None, decoupled=True)
        times: dict = {"stock": [], "fastpersist": [], "decoupled": []}
        size = 0
        for i in range(args.repeats):
            for variant, ce in (("stock", stock_engine), ("fastpersist", fp_engine), ("decoupled", dec_engine)):
                engine2.checkpoint_engine = ce
                out = os.path.join(root, f"{variant}_{i}")
                dist.barrier()
                t0 = time.perf_counter()
                engine2.save_checkpoint(out, tag="t")
                if variant == "stock":
                    fsync_tree(out)
                    dist.barrier()
                times[variant].append(time.perf_counter() - t0)
                if variant == "decoupled":
                    engine2._commit_decoupled_checkpoint()  # what DeepSpeed does at the next step
                size = sum(os.path.getsize(os.path.join(out, "t", f)) for f in os.listdir(os.path.join(out, "t")))
                dist.barrier()
                if rank0:
                    shutil.rmtree(out)
        if rank0:
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"save_checkpoint of {size / 2**20:.1f} MiB, median of {args.repeats}:")
            print(f"  stock TorchCheckpointEngine + fsync : {med['stock'] * 1e3:8.1f} ms")
            print(f"  FastPersistCheckpointEngine         : {med['fastpersist'] * 1e3:8.1f} ms"
                  f"  ({med['stock'] / med['fastpersist']:.2f}x)")
            print(f"  decoupled: training blocked         : {med['decoupled'] * 1e3:8.1f} ms")
        engine.destroy()
        engine2.destroy()
    finally:
        dist.barrier()
        if args.dir is None and rank0:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
