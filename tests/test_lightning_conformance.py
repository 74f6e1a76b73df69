"""Lightning with fastpersist's CheckpointIO, where Lightning itself checks, lists, loads
and pickles (issue 23 cases 1-3; case 4 is in test_tmp_cleanup.py).

Async saves are held pending for about a second (``slow_finisher``) so that
Lightning's checks certainly run while a save is in flight: that is where the
adapter used to differ from stock (overwritten names, FileNotFoundError).
"""

from __future__ import annotations

import os
import pickle
import warnings

import pytest
import torch

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402

import fastpersist  # noqa: E402
from fastpersist.integrations import lightning as fpl  # noqa: E402


def _trainer(root, epochs: int, callbacks=(), plugins=None, **kw) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=root, max_epochs=epochs, callbacks=list(callbacks), plugins=plugins, accelerator="cpu",
        devices=1, limit_train_batches=2, limit_val_batches=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, **kw,
    )


def _versioned_run(tmp_path, plugins_factory) -> list[str]:
    for epochs in (2, 4):
        cb = ModelCheckpoint(dirpath=tmp_path / "ck", filename="model", monitor="step", mode="max", save_top_k=-1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _trainer(tmp_path, epochs, [cb], plugins_factory()).fit(BoringModel())
    return sorted(os.listdir(tmp_path / "ck"))


# ---- case 1: ModelCheckpoint's -vN version counter sees pending saves --------------------


def test_version_counter_never_reuses_a_name_with_a_save_in_flight(tmp_path, slow_finisher):
    stock = _versioned_run(tmp_path / "stock", lambda: None)
    ours = _versioned_run(tmp_path / "fp", lambda: [fpl.FastPersistCheckpointIO()])
    assert len(stock) == 6  # 2 + 4 epochs, every one under its own name
    assert ours == stock


# ---- case 2: pickling ------------------------------------------------------------------


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_trainer_with_the_adapter_pickles(package):
    mod = pytest.importorskip(package)
    ns = fpl.classes_for(package)
    for trainer in (
        mod.Trainer(plugins=[ns.FastPersistCheckpointIO()], logger=False, accelerator="cpu"),
        mod.Trainer(strategy="ddp_fastpersist_spawn", accelerator="cpu", devices=2, logger=False),
        mod.Trainer(strategy="ddp_spawn", accelerator="cpu", devices=2, logger=False,
                    plugins=[ns.FastPersistCheckpointIO()]),
    ):
        copy = pickle.loads(pickle.dumps(trainer))
        io = copy.strategy.checkpoint_io
        assert type(io) is ns.FastPersistCheckpointIO and io.pending == 0
    for cls in (ns.FastPersistCheckpointIO, ns.FastPersistDDPStrategy, ns.FastPersistFSDPStrategy):
        assert pickle.loads(pickle.dumps(cls)) is cls


def test_a_pickled_checkpoint_io_leaves_pending_saves_with_the_original(tmp_path, slow_finisher):
    io = fpl.FastPersistCheckpointIO()
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "a.ckpt")
    copy = pickle.loads(pickle.dumps(io))
    assert io.pending == 1 and copy.pending == 0
    io.finalize()
    assert torch.equal(copy.load_checkpoint(tmp_path / "a.ckpt")["w"], torch.ones(3))


class _Counting(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.resumed_from = -1

    def on_load_checkpoint(self, checkpoint) -> None:
        self.resumed_from = checkpoint["epoch"]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["plugin", "strategy"])
def test_ddp_spawn_saves_and_resumes(tmp_path, how):
    """A real ddp_spawn run (gloo, 2 processes on CPU) that saves, then resumes."""
    def make(epochs):
        kw = dict(default_root_dir=tmp_path, max_epochs=epochs, accelerator="cpu", devices=2,
                  limit_train_batches=2, limit_val_batches=1, logger=False, enable_progress_bar=False,
                  enable_model_summary=False,
                  callbacks=[ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True, save_top_k=-1)])
        if how == "plugin":
            return pl.Trainer(strategy="ddp_spawn", plugins=[fpl.FastPersistCheckpointIO()], **kw)
        return pl.Trainer(strategy="ddp_fastpersist_spawn", **kw)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = BoringModel()
        make(2).fit(model)
        last = fastpersist.load(tmp_path / "ck" / "last.ckpt", weights_only=False)
        steps = last["global_step"] // 2  # per epoch
        assert last["epoch"] == 1 and steps >= 1
        names = sorted(os.listdir(tmp_path / "ck"))
        assert names == [f"epoch=0-step={steps}.ckpt", f"epoch=1-step={2 * steps}.ckpt", "last.ckpt"], names
        # the weights the spawned workers trained reached the parent's model
        for k, v in last["state_dict"].items():
            assert torch.equal(model.state_dict()[k], v), k
        make(3).fit(BoringModel(), ckpt_path="last")
    # resumed at epoch 2: epochs 0 and 1 were not trained again (they would have left -v1 names)
    names = sorted(os.listdir(tmp_path / "ck"))
    assert names == [f"epoch=0-step={steps}.ckpt", f"epoch=1-step={2 * steps}.ckpt",
                     f"epoch=2-step={3 * steps}.ckpt", "last.ckpt"], names
    last = fastpersist.load(tmp_path / "ck" / "last.ckpt", weights_only=False)
    assert last["epoch"] == 2 and last["global_step"] == 3 * steps


# ---- case 3: another Trainer / load_from_checkpoint right after a save ------------------


def _saved_pending(tmp_path) -> str:
    trainer = _trainer(tmp_path, 1, plugins=[fpl.FastPersistCheckpointIO()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(BoringModel())
    path = str(tmp_path / "saved.ckpt")
    trainer.save_checkpoint(path)
    assert not os.path.exists(path)  # still in flight
    return path


@pytest.mark.parametrize("reader", ["stock", "fastpersist"])
def test_another_trainer_resumes_at_once(tmp_path, slow_finisher, reader):
    path = _saved_pending(tmp_path)
    plugins = [fpl.FastPersistCheckpointIO()] if reader == "fastpersist" else None
    other = _trainer(tmp_path / "other", 2, plugins=plugins)
    model = _Counting()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other.fit(model, ckpt_path=path)
    assert model.resumed_from == 1 and other.current_epoch == 2


def test_load_from_checkpoint_at_once(tmp_path, slow_finisher):
    path = _saved_pending(tmp_path)
    model = BoringModel.load_from_checkpoint(path)
    assert torch.equal(fastpersist.load(path, weights_only=False)["state_dict"]["layer.weight"],
                       model.layer.weight.detach())


def test_resume_last_and_hpc_see_pending_saves(tmp_path, slow_finisher):
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    trainer = _trainer(tmp_path, 1, plugins=[fpl.FastPersistCheckpointIO()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(BoringModel())
    trainer.save_checkpoint(str(tmp_path / "hpc_ckpt_1.ckpt"))
    assert _CheckpointConnector.hpc_save_path(str(tmp_path)).endswith("hpc_ckpt_2.ckpt")
    trainer.save_checkpoint(str(tmp_path / "hpc_ckpt_2.ckpt"))
    other = _trainer(tmp_path, 2)
    assert other._checkpoint_connector._hpc_resume_path.endswith("hpc_ckpt_2.ckpt")


def test_guards_are_reversible():
    from lightning.fabric.utilities import cloud_io
    from lightning.pytorch.core import saving

    assert getattr(ModelCheckpoint.file_exists, "_fastpersist_original", False)
    fpl.remove_lightning_guards()
    try:
        assert not getattr(ModelCheckpoint.file_exists, "_fastpersist_original", False)
        assert not hasattr(cloud_io._load, "_fastpersist_original") and saving.pl_load is cloud_io._load
    finally:
        fpl.install_lightning_guards("lightning.pytorch")
    assert getattr(ModelCheckpoint.file_exists, "_fastpersist_original", False)
    assert saving.pl_load is cloud_io._load and getattr(cloud_io._load, "_fastpersist_original", False)
