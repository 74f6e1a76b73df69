"""Run by tests/test_integration_lightning.py (and re-launched by Lightning once per
extra rank): a 2-process CPU/gloo DDP fit with Trainer(strategy=STRATEGY), checkpoints
every 2 steps (save_top_k=2, save_last=True), then a second Trainer resumed from
last.ckpt. Does not import fastpersist: the strategy name must come from the start-up
hook. Writes out/<phase>-rank<r>.json with what it saw."""

import copy
import json
import os
import shutil
import sys

import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

out = sys.argv[1]
strategy = sys.argv[2] if len(sys.argv) > 2 else "ddp_fastpersist"


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def training_step(self, batch, _i):
        (x,) = batch
        loss = self.net(x).pow(2).mean()
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Record(Callback):
    """Records, at train start (after a resume has restored everything), the state."""

    def on_train_start(self, trainer, module) -> None:
        self.step = trainer.global_step
        self.params = {k: v.detach().clone() for k, v in module.state_dict().items()}
        self.opt = copy.deepcopy(trainer.optimizers[0].state_dict())


def loader():
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(128, 16, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=8)


def trainer(max_steps, record):
    ck = ModelCheckpoint(dirpath=os.path.join(out, "ck"), save_top_k=2, save_last=True, every_n_train_steps=2,
                         monitor="step", mode="max")
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=2, strategy=strategy, callbacks=[ck, record],
                      logger=False, enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=True)


def counts(t):
    io = t.strategy.checkpoint_io
    return dict(getattr(io, "counts", {}))


if __name__ == "__main__":
    before = "fastpersist.integrations.lightning" in sys.modules
    t1 = trainer(6, Record())
    t1.fit(Model(), loader())
    rank = t1.global_rank
    first = {"strategy": type(t1.strategy).__name__, "counts": counts(t1), "imported_before_trainer": before,
             "io": type(t1.strategy.checkpoint_io).__name__}
    if rank == 0:  # what the resume below starts from (last.ckpt is overwritten later)
        shutil.copy(os.path.join(out, "ck", "last.ckpt"), os.path.join(out, "resume-source.ckpt"))
    t1.strategy.barrier()
    rec = Record()
    t2 = trainer(10, rec)
    t2.fit(Model(), loader(), ckpt_path=os.path.join(out, "ck", "last.ckpt"))
    second = {"counts": counts(t2), "resumed_step": rec.step,
              "final_step": t2.global_step}
    torch.save({"params": rec.params, "opt": rec.opt}, os.path.join(out, f"restored-rank{rank}.pt.tmp"))
    os.replace(os.path.join(out, f"restored-rank{rank}.pt.tmp"), os.path.join(out, f"restored-rank{rank}.pt"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"first": first, "second": second}, f)
