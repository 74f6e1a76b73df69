"""Lightning with s3:// checkpoint folders through FastPersistCheckpointIO, against the
real s3proxy: real training loops on CPU, retention deleting objects, resumes from
``s3://`` (an explicit URL and ``ckpt_path="last"``), stock readers of the objects,
and a save that fails mid-upload (clear error, previous checkpoint loads, no partial
object, no multipart upload left). Lightning lists and checks s3 folders through
fsspec, which needs s3fs: these tests skip without it."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("boto3", reason="the s3 extra is not installed: pip install 'fastpersist[s3]'")
pytest.importorskip("s3fs", reason="Lightning's ModelCheckpoint needs s3fs (fsspec) for s3:// folders")

import fsspec  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

import fastpersist  # noqa: E402
from fastpersist.errors import ObjectStoreError  # noqa: E402
from fastpersist.integrations import lightning as fpl  # noqa: E402

from s3faultproxy import Fault  # noqa: E402
from s3fixtures import boto, bucket, fault_proxy, faulty, s3_env, s3_server  # noqa: E402,F401 (fixtures)


@pytest.fixture(autouse=True)
def _s3fs_on_this_server(s3_env, monkeypatch):  # noqa: ANN001, ANN202
    """s3fs (Lightning's listings, stock readers) on the test server: a fresh instance
    (fsspec caches them across tests, endpoint included), and botocore's checksums only
    where required, which stores such as s3proxy need (fastpersist's own client sets
    this itself; s3fs reads the standard variables)."""
    import s3fs

    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
    monkeypatch.setenv("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
    s3fs.S3FileSystem.clear_instance_cache()
    yield
    s3fs.S3FileSystem.clear_instance_cache()


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def training_step(self, batch: Any, _i: int) -> torch.Tensor:
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Start(Callback):
    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.step = trainer.global_step
        self.params = {k: v.detach().clone() for k, v in module.state_dict().items()}


def _data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 16, generator=g)), batch_size=4)


def _trainer(root: str, steps: int, io_: Any, **ckpt: Any) -> pl.Trainer:
    cb = ModelCheckpoint(every_n_train_steps=2, **ckpt)
    return pl.Trainer(default_root_dir=root, max_steps=steps, plugins=[io_], callbacks=[cb, Start()], logger=False,
                      accelerator="cpu", enable_progress_bar=False, enable_model_summary=False)


def _keys(boto, bucket: str) -> list[str]:  # noqa: ANN001
    return sorted(o["Key"] for o in boto.list_objects_v2(Bucket=bucket).get("Contents", [])
                  if not o["Key"].endswith("/"))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_fit_saves_retains_and_resumes_on_s3(boto, bucket, async_save):  # noqa: ANN001
    root = f"s3://{bucket}/run"
    io_ = fpl.FastPersistCheckpointIO(async_save=async_save)
    trainer = _trainer(root, 6, io_, save_top_k=1, save_last=True)
    model = Model()
    trainer.fit(model, _data())
    # retention deleted the older step objects; last.ckpt and the newest one remain
    assert _keys(boto, bucket) == ["run/checkpoints/epoch=0-step=6.ckpt", "run/checkpoints/last.ckpt"]
    assert io_.counts["save_async" if async_save else "save"] >= 3
    url = f"s3://{bucket}/run/checkpoints/epoch=0-step=6.ckpt"
    got = fastpersist.load(url)
    assert got["global_step"] == 6
    for k, v in model.state_dict().items():
        assert torch.equal(got["state_dict"][k], v)
    # the object is an ordinary torch file: torch.load of its bytes gives the same
    body = boto.get_object(Bucket=bucket, Key="run/checkpoints/epoch=0-step=6.ckpt")["Body"].read()
    stock = torch.load(io.BytesIO(body), weights_only=False)
    assert stock["global_step"] == 6 and torch.equal(stock["state_dict"]["net.0.weight"], model.net[0].weight)
    with fsspec.open(url, "rb") as f:  # and through fsspec/s3fs, as stock Lightning reads
        assert torch.load(f, weights_only=False)["global_step"] == 6
    # resume from the URL (to step 8), then from "last" (found by listing the s3 folder: step 8)
    for ckpt_path, steps, expect in ((url, 8, 6), ("last", 10, 8)):
        resumed = _trainer(root, steps, fpl.FastPersistCheckpointIO(async_save=async_save), save_top_k=1,
                           save_last=True)
        resumed.fit(Model(), _data(), ckpt_path=ckpt_path)
        start = next(c for c in resumed.callbacks if isinstance(c, Start))
        assert start.step == expect
        if ckpt_path == url:
            for k, v in got["state_dict"].items():
                assert torch.equal(start.params[k], v)
    assert fastpersist.load(f"s3://{bucket}/run/checkpoints/last.ckpt")["global_step"] == 10
    assert boto.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_failed_upload_mid_fit(boto, bucket, faulty, async_save):  # noqa: ANN001
    root = f"s3://{bucket}/run"
    with fastpersist.config.override(s3_part_size=5 << 20):
        model = Model()
        trainer = _trainer(root, 2, fpl.FastPersistCheckpointIO(async_save=False), save_top_k=-1)
        trainer.fit(model, _data())
        first = f"s3://{bucket}/run/checkpoints/epoch=0-step=2.ckpt"
        before = fastpersist.load(first)
        # every part of the next save is refused (403): the fit fails naming the object
        faulty.arm(Fault("403", method="PUT", query="partNumber=", count=0))
        trainer = _trainer(root, 4, fpl.FastPersistCheckpointIO(async_save=async_save), save_top_k=-1)
        with pytest.raises(ObjectStoreError, match=r"step=4\.ckpt.*UploadPart|UploadPart.*step=4\.ckpt"):
            trainer.fit(Model(), _data(), ckpt_path=first)
        faulty.clear()
    assert _keys(boto, bucket) == ["run/checkpoints/epoch=0-step=2.ckpt"]  # no partial object
    assert boto.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    after = fastpersist.load(first)
    assert after["global_step"] == before["global_step"] == 2
    for k, v in before["state_dict"].items():
        assert torch.equal(after["state_dict"][k], v)
