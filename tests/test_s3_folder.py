"""Folder checkpoints on object storage (fastpersist.s3folder) against the real s3proxy:
every file one object, the manifest written last is the commit, readers refuse a folder
without it or whose objects changed, failed saves leave no commit and no upload, and
the next save cleans their leftovers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("boto3", reason="the s3 extra is not installed: pip install 'fastpersist[s3]'")

from fastpersist import s3folder  # noqa: E402
from fastpersist.errors import ObjectStoreError  # noqa: E402

from s3faultproxy import Fault  # noqa: E402
from s3fixtures import boto, bucket, fault_proxy, faulty, s3_env, s3_server  # noqa: E402,F401 (fixtures)


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root


def _keys(boto, bucket: str) -> set[str]:  # noqa: ANN001
    # (s3proxy's filesystem backend lists its directories as keys ending in '/')
    return {o["Key"] for o in boto.list_objects_v2(Bucket=bucket).get("Contents", []) if not o["Key"].endswith("/")}


def test_round_trip_and_commit_last(boto, bucket, tmp_path):  # noqa: ANN001
    files = {"model.safetensors": os.urandom(6 << 20), "sub/random_states_0.pkl": b"rng", "empty": b""}
    url = f"s3://{bucket}/run/ckpt"
    manifest = s3folder.save(_tree(tmp_path / "a", files), url)
    assert set(manifest["files"]) == set(files)
    assert _keys(boto, bucket) == {f"run/ckpt/{k}" for k in files} | {"run/ckpt/" + s3folder.MANIFEST}
    s3folder.download(url, tmp_path / "b")
    for rel, data in files.items():
        assert (tmp_path / "b" / rel).read_bytes() == data
    # the objects are the files' exact bytes (stock readers see the same)
    body = boto.get_object(Bucket=bucket, Key="run/ckpt/model.safetensors")["Body"].read()
    assert body == files["model.safetensors"]


def test_uncommitted_and_changed_folders_are_refused(boto, bucket, tmp_path):  # noqa: ANN001
    url = f"s3://{bucket}/run/ckpt"
    boto.put_object(Bucket=bucket, Key="run/ckpt/model.bin", Body=b"half")
    with pytest.raises(s3folder.UncommittedFolderError, match="holds no committed checkpoint"):
        s3folder.download(url, tmp_path / "x")
    assert not s3folder.is_committed(url)
    s3folder.save(_tree(tmp_path / "a", {"model.bin": b"whole"}), url)
    boto.put_object(Bucket=bucket, Key="run/ckpt/model.bin", Body=b"other writer")
    with pytest.raises(s3folder.UncommittedFolderError, match="changed after its commit"):
        s3folder.download(url, tmp_path / "y")


def test_failed_save_leaves_no_commit_and_next_save_cleans(boto, bucket, faulty, tmp_path):  # noqa: ANN001
    prev = f"s3://{bucket}/run/step-1"
    s3folder.save(_tree(tmp_path / "p", {"a.bin": b"previous"}), prev)
    url = f"s3://{bucket}/run/step-2"
    files = {"a.bin": b"x" * 100, "b.bin": b"y" * 100, "c.bin": b"z" * 100}
    # the third file's upload refused for good: a clear error, no commit, no upload left
    faulty.arm(Fault("403", method="POST", query="uploads", nth=3, count=1))
    with pytest.raises(ObjectStoreError, match="c.bin"):
        s3folder.save(_tree(tmp_path / "n", files), url)
    faulty.clear()
    assert not s3folder.is_committed(url)
    assert boto.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    s3folder.download(prev, tmp_path / "prev")  # the previous checkpoint loads
    assert (tmp_path / "prev" / "a.bin").read_bytes() == b"previous"
    # a leftover of the failed save (a.bin, b.bin) and an incomplete upload of a killed one
    boto.create_multipart_upload(Bucket=bucket, Key="run/step-2/killed.bin")
    s3folder.save(_tree(tmp_path / "m", {"a.bin": b"new"}), url)
    assert _keys(boto, bucket) == {"run/step-1/a.bin", "run/step-1/" + s3folder.MANIFEST,
                                   "run/step-2/a.bin", "run/step-2/" + s3folder.MANIFEST}
    assert boto.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_resave_drops_stale_files_keeps_foreign_ones_and_delete(boto, bucket, tmp_path):  # noqa: ANN001
    url = f"s3://{bucket}/ckpt"
    s3folder.save(_tree(tmp_path / "a", {"model.bin": b"1", "optimizer_1.bin": b"1"}), url)
    boto.put_object(Bucket=bucket, Key="ckpt/config.json", Body=b"{}")  # the user's
    s3folder.save(_tree(tmp_path / "b", {"model.bin": b"2"}), url, owns=lambda rel: rel.endswith(".bin"))
    assert _keys(boto, bucket) == {"ckpt/model.bin", "ckpt/config.json", "ckpt/" + s3folder.MANIFEST}
    s3folder.delete(url)
    assert _keys(boto, bucket) == set()


def test_bad_folder_urls():
    with pytest.raises(ValueError, match="names a bucket"):
        s3folder.folder_url("s3://bucket-name/")
    assert s3folder.join("s3://bucket-name/a/", "b", "c.pt") == "s3://bucket-name/a/b/c.pt"
