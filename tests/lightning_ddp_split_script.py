"""Run by tests/test_lightning_ddp_split.py (and re-launched by Lightning for rank 1): a
2-process CPU/gloo DDP fit with the ddp_fastpersist strategy whose ranks' checkpoints
differ (issue 23 case 5).

MODE "unsynced": a metric logged without sync_dist and monitored by ModelCheckpoint,
so the callback state differs between ranks (the bulk tensors do not).
MODE "buffers": also a buffer that differs per rank (broadcast_buffers=False), so the
bulk tensors differ too.

Writes OUT/rank<r>.json (counts, ddp_fastpersist warnings) and OUT/state-rank<r>.pt (the
checkpoint dict the rank handed to the strategy for the last save, with torch.save)."""

import copy
import json
import os
import sys
import warnings

import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

out, mode = sys.argv[1], sys.argv[2]


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        self.register_buffer("rank_buf", torch.zeros(4))

    def on_train_start(self) -> None:
        if mode == "buffers":  # after DDP's initial broadcast; broadcast_buffers=False keeps it per rank
            self.rank_buf.fill_(float(self.global_rank) + 1.0)

    def training_step(self, batch, _i):
        (x,) = batch
        loss = self.net(x).pow(2).mean()
        self.log("rank_metric", float(self.global_rank * 100 + self.global_step), sync_dist=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Record(Callback):
    """Keeps the checkpoint dict of the last save (after every callback put its state in)."""

    def on_save_checkpoint(self, trainer, module, checkpoint) -> None:
        self.last = copy.deepcopy(checkpoint)


def loader():
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=8)


if __name__ == "__main__":
    from fastpersist.integrations.lightning import FastPersistDDPStrategy

    ck = ModelCheckpoint(dirpath=os.path.join(out, "ck"), save_top_k=2, save_last=True, every_n_train_steps=2,
                         monitor="rank_metric", mode="max")
    rec = Record()
    strategy = FastPersistDDPStrategy(broadcast_buffers=False) if mode == "buffers" else "ddp_fastpersist"
    t = pl.Trainer(max_steps=4, accelerator="cpu", devices=2, strategy=strategy, callbacks=[rec, ck], logger=False,
                   enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(Model(), loader())
    rank = t.global_rank
    torch.save(rec.last, os.path.join(out, f"state-rank{rank}.pt"))
    mine = [str(w.message) for w in caught if "ddp_fastpersist" in str(w.message)]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"counts": dict(t.strategy.checkpoint_io.counts), "warnings": mine,
                   "async": t.strategy.checkpoint_io.async_save}, f)
