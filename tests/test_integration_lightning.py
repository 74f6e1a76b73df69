"""fastpersist.integrations.lightning with a real Lightning on CPU.

Proof that the bytes went through fastpersist, independent of the adapter's own
counters: every checkpoint file is a torch zip whose ``.storage_alignment`` record
says 4096 and whose payloads start at multiples of 4096 (``torch.save`` and
Lightning's ``_atomic_save`` write 64). Stock loading is checked in a subprocess
that never imports fastpersist (``FASTPERSIST_STARTUP=0`` keeps the start-up hook
out as well).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from fastpersist.integrations import lightning as fpl  # noqa: E402

HERE = Path(__file__).resolve().parent
HOOK_INSTALLED = importlib.util.find_spec("_fastpersist_startup") is not None
NO_FASTPERSIST_ENV = {**os.environ, "FASTPERSIST_STARTUP": "0", "FASTPERSIST_PATCH_TORCH_SAVE": "0"}


def payload_alignment(path: Path) -> tuple[bytes, list[int]]:
    """The ``.storage_alignment`` record and each tensor payload's offset modulo 4096."""
    with open(path, "rb") as f, zipfile.ZipFile(f) as z:
        record = next((z.read(n) for n in z.namelist() if n.endswith(".storage_alignment")), b"")
        mods = []
        for info in z.infolist():
            if "/data/" in info.filename and not info.filename.endswith("serialization_id"):
                f.seek(info.header_offset)
                local = f.read(30)
                n, e = struct.unpack("<HH", local[26:30])
                mods.append((info.header_offset + 30 + n + e) % 4096)
    return record, mods


def assert_written_by_fastpersist(path: Path) -> None:
    record, mods = payload_alignment(path)
    assert record == b"4096", (path, record)
    assert mods and set(mods) == {0}, (path, mods)


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def training_step(self, batch: Any, _i: int) -> torch.Tensor:
        (x,) = batch
        loss = self.net(x).pow(2).mean()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Record(Callback):
    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.step = trainer.global_step
        self.params = {k: v.detach().clone() for k, v in module.state_dict().items()}
        self.opt = copy.deepcopy(trainer.optimizers[0].state_dict())


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g)), batch_size=8)


def make_trainer(dirpath: Path, max_steps: int, io: Any, *callbacks: Callback, save_last: Any = True) -> pl.Trainer:
    ck = ModelCheckpoint(dirpath=dirpath, save_top_k=2, save_last=save_last, every_n_train_steps=2,
                         monitor="step", mode="max")
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, plugins=[io], callbacks=[ck, *callbacks],
                      logger=False, enable_progress_bar=False, enable_model_summary=False)


def assert_state_equal(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_state_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_state_equal(x, y)
    else:
        assert a == b


def stock_load(paths: list[Path]) -> dict[str, Any]:
    """torch.load each file in a process without fastpersist; returns what it checked."""
    code = f"""
import json, sys, torch
out = {{}}
for p in {[str(p) for p in paths]!r}:
    ck = torch.load(p, weights_only=False)
    out[p] = {{"global_step": ck["global_step"], "keys": sorted(ck)}}
assert not any(m == "fastpersist" or m.startswith("fastpersist.") for m in sys.modules)
print(json.dumps(out))
"""
    r = subprocess.run([sys.executable, "-c", code], env=NO_FASTPERSIST_ENV, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------


def test_plugin_fit_topk_last_and_resume(tmp_path: Path) -> None:
    """ModelCheckpoint(save_top_k=2, save_last=True, every_n_train_steps=2) through the
    plugin (asynchronous where fastpersist has save_async); resume from last.ckpt
    restores weights, optimizer state and global step."""
    ck_dir = tmp_path / "ck"
    async_save = None
    io = fpl.FastPersistCheckpointIO(async_save=async_save)
    make_trainer(ck_dir, 6, io).fit(Model(), loader())
    assert io.pending == 0
    assert sorted(os.listdir(ck_dir)) == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]
    kind = "save_async" if (async_save is None and fpl.HAS_ASYNC) else "save"
    assert io.counts[kind] == 6 and io.counts["torch"] == 0, io.counts  # 3 top-k + 3 last
    for f in ck_dir.iterdir():
        assert_written_by_fastpersist(f)
    shutil.copy(ck_dir / "last.ckpt", tmp_path / "source.ckpt")

    rec = Record()
    io2 = fpl.FastPersistCheckpointIO(async_save=async_save)
    t2 = make_trainer(ck_dir, 10, io2, rec)
    t2.fit(Model(), loader(), ckpt_path=str(ck_dir / "last.ckpt"))
    assert io2.counts["load"] == 1
    source = torch.load(tmp_path / "source.ckpt", weights_only=False)
    assert rec.step == source["global_step"] == 6
    assert_state_equal(rec.params, source["state_dict"])
    assert_state_equal(rec.opt, source["optimizer_states"][0])
    assert t2.global_step == 10
    assert sorted(os.listdir(ck_dir)) == ["epoch=0-step=8.ckpt", "epoch=1-step=10.ckpt", "last.ckpt"]

    checked = stock_load([ck_dir / "last.ckpt", tmp_path / "source.ckpt"])
    assert checked[str(ck_dir / "last.ckpt")]["global_step"] == 10
    assert "optimizer_states" in checked[str(tmp_path / "source.ckpt")]["keys"]


def test_plugin_sync_saves(tmp_path: Path) -> None:
    io = fpl.FastPersistCheckpointIO(async_save=False)
    make_trainer(tmp_path / "ck", 4, io).fit(Model(), loader())
    assert io.counts["save"] == 4 and io.counts["save_async"] == 0, io.counts
    assert sorted(os.listdir(tmp_path / "ck")) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    for f in (tmp_path / "ck").iterdir():
        assert_written_by_fastpersist(f)


@pytest.mark.skipif(not fpl.HAS_ASYNC, reason="this fastpersist has no save_async")
def test_link_and_removal_wait_for_pending_saves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """save_last="link": the symlink is made only when its target is complete; a
    checkpoint is removed only when no save is pending."""
    io = fpl.FastPersistCheckpointIO()
    seen: list[tuple[str, bool, int]] = []
    real_symlink, real_remove = os.symlink, io._fallback.remove_checkpoint

    def symlink(src: str, dst: str, *a: Any, **k: Any) -> None:
        target = os.path.join(os.path.dirname(dst), src)
        seen.append(("link", os.path.isfile(target), io.pending))
        real_symlink(src, dst, *a, **k)

    def remove(path: Any) -> None:
        seen.append(("remove", os.path.exists(path), io.pending))
        real_remove(path)

    monkeypatch.setattr(os, "symlink", symlink)
    monkeypatch.setattr(io._fallback, "remove_checkpoint", remove)
    make_trainer(tmp_path / "ck", 8, io, save_last="link").fit(Model(), loader())
    assert [s for s in seen if s[0] == "link"] and [s for s in seen if s[0] == "remove"], seen
    assert all(exists and pending == 0 for _what, exists, pending in seen), seen
    last = tmp_path / "ck" / "last.ckpt"
    assert last.is_symlink() and os.path.realpath(last) == str(tmp_path / "ck" / "epoch=0-step=8.ckpt")
    assert_written_by_fastpersist(last)


def test_non_local_paths_go_to_lightning(tmp_path: Path) -> None:
    io = fpl.FastPersistCheckpointIO()
    io.save_checkpoint({"w": torch.arange(4)}, "memory://fp-test/a.ckpt")
    assert torch.equal(io.load_checkpoint("memory://fp-test/a.ckpt")["w"], torch.arange(4))
    io.remove_checkpoint("memory://fp-test/a.ckpt")
    assert io.counts["torch"] == 2 and io.counts["save"] + io.counts["save_async"] == 0


def test_strategy_names_registered_on_import() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    for name in ("ddp_fastpersist", "ddp_fastpersist_spawn", "ddp_fastpersist_fork", "fsdp_fastpersist"):
        assert name in StrategyRegistry
    s = StrategyRegistry.get("ddp_fastpersist_spawn")
    assert isinstance(s, fpl.FastPersistDDPStrategy) and s._start_method == "spawn"
    assert isinstance(s.checkpoint_io, fpl.FastPersistCheckpointIO)
    assert isinstance(StrategyRegistry.get("fsdp_fastpersist"), fpl.FastPersistFSDPStrategy)
    assert fpl.classes_for("pytorch_lightning").FastPersistDDPStrategy.__mro__[1].__module__.startswith(
        "pytorch_lightning")


@pytest.mark.skipif(not HOOK_INSTALLED, reason="start-up hook not installed (source tree without pip install)")
def test_strategy_names_without_import() -> None:
    """The start-up hook registers the names when Lightning loads, without importing fastpersist."""
    code = ("import sys, lightning.pytorch.strategies as s; "
            "print(sorted(n for n in s.StrategyRegistry if 'fastpersist' in n), 'fastpersist' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["['ddp_fastpersist',", "'ddp_fastpersist_fork',", "'ddp_fastpersist_spawn',",
                                "'fsdp_fastpersist']", "False"]
    off = "import sys, _fastpersist_startup as s; print(s._watcher is None, 'lightning' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", off], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "FASTPERSIST_STARTUP": "0"})
    assert r.returncode == 0 and r.stdout.split() == ["True", "False"], (r.stdout, r.stderr[-2000:])


def test_ddp_fastpersist_two_processes(tmp_path: Path) -> None:
    """Trainer(strategy="ddp_fastpersist", devices=2) on CPU/gloo: both ranks write every
    checkpoint together, both read it together on resume; the resumed state equals
    last.ckpt as stock torch.load reads it in a process without fastpersist."""
    env = dict(os.environ)
    if not HOOK_INSTALLED:  # the script relies on the start-up hook for the name
        pytest.skip("start-up hook not installed (source tree without pip install)")
    r = subprocess.run([sys.executable, str(HERE / "lightning_ddp_script.py"), str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-5000:])
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for rank in ranks:
        assert rank["first"]["strategy"] == "FastPersistDDPStrategy"
        assert rank["first"]["imported_before_trainer"] is False
        if fpl.HAS_GROUP_SAVE:  # 3 top-k + 3 last in the first fit, split across both ranks
            assert rank["first"]["counts"]["save_group"] == 6, rank
            assert rank["second"]["counts"]["load_group"] == 1, rank
        assert rank["second"]["resumed_step"] == 6 and rank["second"]["final_step"] == 10
    ck_dir = tmp_path / "ck"
    assert sorted(os.listdir(ck_dir)) == ["epoch=0-step=8.ckpt", "epoch=1-step=10.ckpt", "last.ckpt"]
    for f in [*ck_dir.iterdir(), tmp_path / "resume-source.ckpt"]:
        assert_written_by_fastpersist(f)
    stock_load([tmp_path / "resume-source.ckpt", ck_dir / "last.ckpt"])
    source = torch.load(tmp_path / "resume-source.ckpt", weights_only=False)
    for i in range(2):
        restored = torch.load(tmp_path / f"restored-rank{i}.pt", weights_only=False)
        assert_state_equal(restored["params"], source["state_dict"])
        assert_state_equal(restored["opt"], source["optimizer_states"][0])
