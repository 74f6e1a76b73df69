"""Run by tests/test_integration_lightning_fsdp.py (and re-launched by Lightning once
per extra rank): a 2-process CPU/gloo FSDP fit with Trainer(strategy="fsdp_fastpersist")
(sharded checkpoints, a DCP directory per checkpoint), ModelCheckpoint every 2 steps
(save_top_k=2, save_last=True), then a second Trainer resumed from last.ckpt. Does not
import fastpersist when the start-up hook registers the strategy name. Writes
out/rank<r>.json and out/restored-rank<r>.pt (the full state seen at the resumed
train start)."""

import copy
import importlib.util
import json
import os
import shutil
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

out = sys.argv[1]
if importlib.util.find_spec("_fastpersist_startup") is None:  # no hook: register the names by import
    import fastpersist.integrations.lightning  # noqa: F401


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def training_step(self, batch, _i):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def full_params(trainer):
    """The unsharded model state, on every rank."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = trainer.strategy.model
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=False)):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def snapshot(trainer):
    # The optimizer state as this rank holds it (its shards). (FSDP.optim_state_dict's full
    # gather is not used: on CPU/gloo it returned exp_avg_sq in place of exp_avg here.)
    return {"step": trainer.global_step, "params": full_params(trainer),
            "opt": copy.deepcopy(trainer.optimizers[0].state_dict())}


class Record(Callback):
    """The state at the end of a fit and at the start of one (after a resume restored it)."""

    def on_train_start(self, trainer, module) -> None:
        self.start = snapshot(trainer)

    def on_train_end(self, trainer, module) -> None:
        self.end = snapshot(trainer)


def loader():
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(128, 16, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=8)


def trainer(max_steps, record):
    ck = ModelCheckpoint(dirpath=os.path.join(out, "ck"), save_top_k=2, save_last=True, every_n_train_steps=2,
                         monitor="step", mode="max")
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=2, strategy="fsdp_fastpersist",
                      callbacks=[ck, record], logger=False, enable_progress_bar=False, enable_model_summary=False)


if __name__ == "__main__":
    before = "fastpersist.integrations.lightning" in sys.modules
    rec1 = Record()
    t1 = trainer(6, rec1)
    t1.fit(Model(), loader())
    rank = t1.global_rank
    first = {"strategy": type(t1.strategy).__name__, "state_dict_type": t1.strategy._state_dict_type,
             "dcp_saves": t1.strategy.dcp_saves, "imported_before_trainer": before,
             "process_group_backend": t1.strategy._process_group_backend}
    t1.strategy.barrier()
    if rank == 0:  # what the resume below starts from (last.ckpt is overwritten later)
        shutil.copytree(os.path.join(out, "ck", "last.ckpt"), os.path.join(out, "resume-source"))
    t1.strategy.barrier()
    rec2 = Record()
    t2 = trainer(10, rec2)
    t2.fit(Model(), loader(), ckpt_path=os.path.join(out, "ck", "last.ckpt"))
    second = {"dcp_saves": t2.strategy.dcp_saves, "resumed_step": rec2.start["step"], "final_step": t2.global_step}
    tmp = os.path.join(out, f"restored-rank{rank}.pt.tmp")
    torch.save({"saved": rec1.end, "restored": rec2.start}, tmp)
    os.replace(tmp, os.path.join(out, f"restored-rank{rank}.pt"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"first": first, "second": second}, f)
    # Both ranks' results are written; leave without interpreter finalization: gloo's worker
    # thread can drop the last reference to a tensor while the interpreter finalizes, which
    # aborts the process ("terminate called without an active exception", torch's, not
    # fastpersist's: docs/reliability.md, issue 24 case 5). Seen once in CI here.
    t2.strategy.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
