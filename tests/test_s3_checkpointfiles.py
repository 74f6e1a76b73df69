"""fastpersist.checkpointfiles and fastpersist.locations on s3://, against the real s3proxy:
objects saved, loaded and removed, and what s3fs (fsspec) sees of them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("boto3", reason="the s3 extra is not installed: pip install 'fastpersist[s3]'")
s3fs = pytest.importorskip("s3fs", reason="fsspec's view of s3:// folders needs s3fs")

from fastpersist.checkpointfiles import CheckpointFiles  # noqa: E402
from fastpersist.locations import forget_listings, list_s3  # noqa: E402

from s3fixtures import boto, bucket, s3_env, s3_server  # noqa: E402,F401 (fixtures)


@pytest.fixture(autouse=True)
def _s3fs_on_this_server(s3_env, monkeypatch):  # noqa: ANN001, ANN202
    """A fresh s3fs on the test server, with botocore's checksums only where required."""
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
    monkeypatch.setenv("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
    s3fs.S3FileSystem.clear_instance_cache()
    yield
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.parametrize("async_save", [False, True])
def test_objects_saved_listed_loaded_and_removed(bucket, async_save):  # noqa: ANN001
    import fsspec

    folder = f"s3://{bucket}/run"
    files = CheckpointFiles(async_save=async_save)
    files.save_file({"w": torch.arange(8), "step": 1}, f"{folder}/last.ckpt")
    files.finalize()
    fs = fsspec.filesystem("s3")
    assert fs.ls(folder, detail=False) == [f"{bucket}/run/last.ckpt"]  # s3fs now caches the listing
    for name in ("last-1.ckpt", "epoch=0.ckpt"):
        files.save_file({"w": torch.arange(8), "step": 2}, f"{folder}/{name}")
    files.finalize()  # its listings forgotten as each save settled
    assert sorted(fs.ls(folder, detail=False)) == [f"{bucket}/run/{n}" for n in ("epoch=0.ckpt", "last-1.ckpt",
                                                                                   "last.ckpt")]
    assert list_s3(folder, lambda name: name.startswith("last")) == {f"{folder}/last.ckpt", f"{folder}/last-1.ckpt"}
    assert list_s3(f"s3://{bucket}/nothing", lambda name: True) == set()
    got = files.load_file(f"{folder}/last-1.ckpt", weights_only=True)
    assert got["step"] == 2 and torch.equal(got["w"], torch.arange(8))
    assert files.remove_object(f"{folder}/last-1.ckpt") is True
    assert sorted(fs.ls(folder, detail=False)) == [f"{bucket}/run/epoch=0.ckpt", f"{bucket}/run/last.ckpt"]
    assert files.remove_object(f"{folder}/last-1.ckpt") is True  # none there: no error, as S3's DeleteObject
    with pytest.raises(FileNotFoundError):
        files.load_file(f"{folder}/last-1.ckpt")


def test_forget_listings_drops_what_s3fs_cached(bucket, boto):  # noqa: ANN001
    import fsspec

    folder = f"s3://{bucket}/run"
    fs = fsspec.filesystem("s3")
    boto.put_object(Bucket=bucket, Key="run/a.ckpt", Body=b"x")
    assert fs.ls(folder, detail=False) == [f"{bucket}/run/a.ckpt"]
    boto.put_object(Bucket=bucket, Key="run/b.ckpt", Body=b"x")  # behind s3fs's back
    assert fs.ls(folder, detail=False) == [f"{bucket}/run/a.ckpt"]  # the case is real: s3fs's cached listing
    forget_listings(f"{folder}/b.ckpt")
    assert sorted(fs.ls(folder, detail=False)) == [f"{bucket}/run/a.ckpt", f"{bucket}/run/b.ckpt"]
    assert fs.exists(f"{folder}/b.ckpt")
    forget_listings("/a/local/path")  # not an s3 URL: nothing to do
