"""Lightning with fastpersist: one plugin (or one strategy name) and nothing else changes.

Trains a small LightningModule on CPU with
``Trainer(plugins=[FastPersistCheckpointIO()])`` and
``ModelCheckpoint(save_top_k=2, save_last=True, every_n_train_steps=...)``, resumes
from ``last.ckpt`` in a new Trainer, then times ``trainer.save_checkpoint`` of the
same model in the same run through:

- Lightning's stock ``TorchCheckpointIO``, plus an fsync of the file and its
  directory (stock Lightning does not fsync: without it the time is not durable),
- ``FastPersistCheckpointIO(async_save=False)`` (durable on return),
- ``FastPersistCheckpointIO()`` with background saves: the time training is blocked,
  and the time until the file is durable (``finalize()``).

The multi-process variant is ``Trainer(strategy="ddp_fastpersist", devices=N)``, which
needs no import at all once fastpersist is installed.

    python examples/lightning_fastpersist.py                 # tiny, seconds
    python examples/lightning_fastpersist.py --hidden 2048   # bigger checkpoints
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import lightning.pytorch as pl
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from fastpersist.integrations.lightning import FastPersistCheckpointIO


class MLP(pl.LightningModule):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
            torch.nn.Linear(hidden, 8),
        )

    def training_step(self, batch, _i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(256, 64, generator=g), torch.randn(256, 8, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=16)


def trainer(directory: str, max_steps: int, every: int) -> pl.Trainer:
    return pl.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[FastPersistCheckpointIO()],  # <- the one line
        callbacks=[ModelCheckpoint(dirpath=directory, save_top_k=2, save_last=True, every_n_train_steps=every,
                                   monitor="step", mode="max")],
    )


def fsync_file_and_dir(path: str) -> None:
    for p, flags in ((path, os.O_RDONLY), (os.path.dirname(path), os.O_RDONLY)):
        fd = os.open(p, flags)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def time_saves(t: pl.Trainer, directory: str, repeats: int) -> dict[str, list[float]]:
    """Per-save times of the same model, the variants interleaved."""
    variants = {
        "stock TorchCheckpointIO + fsync": TorchCheckpointIO(),
        "FastPersistCheckpointIO(async_save=False)": FastPersistCheckpointIO(async_save=False),
        "FastPersistCheckpointIO() blocking": FastPersistCheckpointIO(),
    }
    out: dict[str, list[float]] = {name: [] for name in variants}
    out["FastPersistCheckpointIO() until durable"] = []
    original = t.strategy.checkpoint_io
    try:
        for i in range(repeats):
            for name, io in variants.items():
                t.strategy.checkpoint_io = io
                path = os.path.join(directory, f"bench-{i % 2}.ckpt")
                t0 = time.perf_counter()
                t.save_checkpoint(path, weights_only=False)
                if isinstance(io, TorchCheckpointIO):
                    fsync_file_and_dir(path)
                out[name].append(time.perf_counter() - t0)
                if isinstance(io, FastPersistCheckpointIO) and io.async_save:
                    io.finalize()
                    out["FastPersistCheckpointIO() until durable"].append(time.perf_counter() - t0)
    finally:
        t.strategy.checkpoint_io = original
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the scratch directory goes (default: system temp)")
    args = p.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        ck_dir = os.path.join(tmp, "checkpoints")
        t1 = trainer(ck_dir, args.steps, args.every)
        t1.fit(MLP(args.hidden), data())
        print("checkpoints:", sorted(os.listdir(ck_dir)))

        t2 = trainer(ck_dir, args.steps + args.every, args.every)
        t2.fit(MLP(args.hidden), data(), ckpt_path=os.path.join(ck_dir, "last.ckpt"))
        print(f"resumed from last.ckpt at step {args.steps}, now at step {t2.global_step}")

        size = os.path.getsize(os.path.join(ck_dir, "last.ckpt"))
        times = time_saves(t2, tmp, args.repeats)
    print(f"checkpoint {size / 2**20:.1f} MiB; median of {args.repeats} saves of the same model, same run:")
    for name, ts in times.items():
        print(f"  {name:44s} {statistics.median(ts) * 1e3:9.1f} ms")
    ok = t2.global_step == args.steps + args.every
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
