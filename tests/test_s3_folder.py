"""Folder checkpoints on object storage (fastpersist.s3folder) against the real s3proxy:
every file one object of a fresh generation, the manifest written last is the commit,
readers refuse a folder without it or whose objects changed, a save into the folder of
a committed checkpoint that fails (a refused request, a process killed mid-upload)
leaves that checkpoint loadable, and the next save cleans the leftovers. Folders
committed by the first format (objects at ``FOLDER/RELPATH``) still load."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
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


def _manifest(boto, bucket: str, folder: str) -> dict:  # noqa: ANN001
    """The folder's commit object, read with plain boto3 (as a stock reader would)."""
    return json.loads(boto.get_object(Bucket=bucket, Key=f"{folder}/{s3folder.MANIFEST}")["Body"].read())


def _committed(boto, bucket: str, folder: str) -> set[str]:  # noqa: ANN001
    """The keys the folder's manifest names (its objects), and the manifest's own."""
    files = _manifest(boto, bucket, folder)["files"]
    return {f"{folder}/{e.get('key', rel)}" for rel, e in files.items()} | {f"{folder}/{s3folder.MANIFEST}"}


def _loads(url: str, dest: Path, files: dict[str, bytes]) -> None:
    """The committed folder ``url`` downloads to exactly ``files``, bit for bit."""
    s3folder.download(url, dest)
    got = {p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    assert got == files


def _no_uploads(boto, bucket: str) -> bool:  # noqa: ANN001
    return boto.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_round_trip_and_commit_last(boto, bucket, tmp_path):  # noqa: ANN001
    files = {"model.safetensors": os.urandom(6 << 20), "sub/random_states_0.pkl": b"rng", "empty": b""}
    url = f"s3://{bucket}/run/ckpt"
    manifest = s3folder.save(_tree(tmp_path / "a", files), url)
    assert set(manifest["files"]) == set(files)
    assert manifest == _manifest(boto, bucket, "run/ckpt")
    # every object the manifest names is there with its size and ETag, and nothing else
    assert _keys(boto, bucket) == _committed(boto, bucket, "run/ckpt")
    for rel, entry in manifest["files"].items():
        head = boto.head_object(Bucket=bucket, Key=f"run/ckpt/{entry['key']}")
        assert (head["ContentLength"], head["ETag"]) == (entry["size"], entry["etag"])
        assert entry["key"].endswith("/" + rel)
    _loads(url, tmp_path / "b", files)
    # the objects are the files' exact bytes (stock readers see the same, at the manifest's keys)
    key = "run/ckpt/" + manifest["files"]["model.safetensors"]["key"]
    assert boto.get_object(Bucket=bucket, Key=key)["Body"].read() == files["model.safetensors"]


def test_uncommitted_and_changed_folders_are_refused(boto, bucket, tmp_path):  # noqa: ANN001
    url = f"s3://{bucket}/run/ckpt"
    boto.put_object(Bucket=bucket, Key="run/ckpt/model.bin", Body=b"half")
    with pytest.raises(s3folder.UncommittedFolderError, match="holds no committed checkpoint"):
        s3folder.download(url, tmp_path / "x")
    assert not s3folder.is_committed(url)
    s3folder.save(_tree(tmp_path / "a", {"model.bin": b"whole"}), url)
    key = "run/ckpt/" + _manifest(boto, bucket, "run/ckpt")["files"]["model.bin"]["key"]
    boto.put_object(Bucket=bucket, Key=key, Body=b"other writer")
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
    _loads(prev, tmp_path / "prev", {"a.bin": b"previous"})  # the previous checkpoint loads
    # a leftover of the failed save (a.bin, b.bin) and an incomplete upload of a killed one
    boto.create_multipart_upload(Bucket=bucket, Key="run/step-2/.fastpersist-gen-0-dead/killed.bin")
    s3folder.save(_tree(tmp_path / "m", {"a.bin": b"new"}), url)
    assert _keys(boto, bucket) == _committed(boto, bucket, "run/step-1") | _committed(boto, bucket, "run/step-2")
    assert _no_uploads(boto, bucket)
    _loads(url, tmp_path / "new", {"a.bin": b"new"})


def test_failed_resave_keeps_previous_then_resave_replaces_it(boto, bucket, faulty, tmp_path):  # noqa: ANN001
    """A fixed folder URL saved again (Accelerate's output_dir, a reused DeepSpeed tag):
    until the new commit object is in, the previous checkpoint loads, bit for bit."""
    url = f"s3://{bucket}/run/ckpt"
    old = {"model.bin": os.urandom(1 << 20), "optimizer.bin": os.urandom(1000), "sub/rng.pkl": b"old rng"}
    s3folder.save(_tree(tmp_path / "old", old), url)
    old_keys = _committed(boto, bucket, "run/ckpt")
    new = {"model.bin": os.urandom(1 << 20), "sub/rng.pkl": b"new rng", "extra.bin": b"e" * 10}
    # the second file's upload refused for good, after the first one completed
    faulty.arm(Fault("403", method="PUT", query="partNumber=", nth=2, count=0))
    with pytest.raises(ObjectStoreError, match="UploadPart"):
        s3folder.save(_tree(tmp_path / "new", new), url)
    faulty.clear()
    assert s3folder.is_committed(url)
    _loads(url, tmp_path / "after-fail", old)
    assert old_keys <= _keys(boto, bucket)  # not one object of the previous checkpoint touched
    # the retry commits the new checkpoint and removes every object of the old one and of the failed save
    s3folder.save(_tree(tmp_path / "new", new), url)
    _loads(url, tmp_path / "after-retry", new)
    now = _committed(boto, bucket, "run/ckpt")
    assert _keys(boto, bucket) == now
    assert now & old_keys == {"run/ckpt/" + s3folder.MANIFEST}  # new objects, never the old ones overwritten
    assert _no_uploads(boto, bucket)


_KILLED_SAVE = """
import sys
from fastpersist import s3folder
s3folder.save(sys.argv[1], sys.argv[2])
raise SystemExit("the save was meant to be killed before it ended")
"""


def test_resave_killed_mid_upload_keeps_previous(boto, bucket, faulty, tmp_path):  # noqa: ANN001
    """A process SIGKILLed in the middle of a save into the folder of a committed
    checkpoint: that checkpoint still loads bit for bit; the next save commits and
    removes the dead save's objects and its incomplete multipart upload."""
    url = f"s3://{bucket}/run/ckpt"
    old = {"a.bin": os.urandom(300_000), "b.bin": os.urandom(200_000)}
    s3folder.save(_tree(tmp_path / "old", old), url)
    new = {"a.bin": os.urandom(300_000), "b.bin": os.urandom(200_000)}
    _tree(tmp_path / "new", new)
    in_upload = threading.Event()  # the dead save's second part is in flight: a.bin complete, b.bin begun
    faulty.arm(Fault("stall", method="PUT", query="partNumber=", nth=2, count=0, hook=in_upload.set))
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, str(tmp_path / "new"), url], env=dict(os.environ),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert in_upload.wait(240), "the save never reached its second part"
    finally:
        proc.send_signal(signal.SIGKILL)
        out = proc.communicate(timeout=60)[0]
    faulty.clear()
    assert proc.returncode == -signal.SIGKILL, out.decode(errors="replace")[-4000:]
    assert not _no_uploads(boto, bucket)  # killed mid-upload indeed
    _loads(url, tmp_path / "after-kill", old)
    s3folder.save(tmp_path / "new", url)
    _loads(url, tmp_path / "after-retry", new)
    assert _keys(boto, bucket) == _committed(boto, bucket, "run/ckpt")
    assert _no_uploads(boto, bucket)


def test_first_format_folders_load_and_resave_keeps_them(boto, bucket, faulty, tmp_path):  # noqa: ANN001
    """A folder committed by the first format (objects at FOLDER/RELPATH, a manifest of
    sizes and ETags) loads; a failed save into it keeps it loadable; a successful one
    replaces it and removes the objects its manifest named (the user's others stay)."""
    url = f"s3://{bucket}/ckpt"
    old = {"model.bin": os.urandom(5000), "sub/rng.pkl": b"rng"}
    entries = {}
    for rel, data in old.items():
        etag = boto.put_object(Bucket=bucket, Key=f"ckpt/{rel}", Body=data)["ETag"]
        entries[rel] = {"size": len(data), "etag": etag}
    manifest = {"format": "fastpersist-s3-folder", "version": 1, "files": entries}
    boto.put_object(Bucket=bucket, Key="ckpt/" + s3folder.MANIFEST, Body=json.dumps(manifest).encode())
    boto.put_object(Bucket=bucket, Key="ckpt/config.json", Body=b"{}")  # the user's, not committed
    _loads(url, tmp_path / "first", old)
    new = {"model.bin": os.urandom(5000), "sub/rng.pkl": b"rng 2"}
    faulty.arm(Fault("403", method="PUT", query="partNumber=", nth=2, count=0))
    with pytest.raises(ObjectStoreError, match="UploadPart"):
        s3folder.save(_tree(tmp_path / "new", new), url)
    faulty.clear()
    _loads(url, tmp_path / "after-fail", old)
    s3folder.save(tmp_path / "new", url, owns=lambda rel: rel.endswith((".bin", ".pkl")))
    _loads(url, tmp_path / "after-retry", new)
    assert _keys(boto, bucket) == _committed(boto, bucket, "ckpt") | {"ckpt/config.json"}


def test_resave_drops_stale_files_keeps_foreign_ones_and_delete(boto, bucket, tmp_path):  # noqa: ANN001
    url = f"s3://{bucket}/ckpt"
    s3folder.save(_tree(tmp_path / "a", {"model.bin": b"1", "optimizer_1.bin": b"1"}), url)
    boto.put_object(Bucket=bucket, Key="ckpt/config.json", Body=b"{}")  # the user's
    inner = f"s3://{bucket}/ckpt/best"  # another folder checkpoint inside this one
    s3folder.save(_tree(tmp_path / "c", {"model.bin": b"best"}), inner)
    s3folder.save(_tree(tmp_path / "b", {"model.bin": b"2"}), url, owns=lambda rel: rel.endswith(".bin"))
    assert _keys(boto, bucket) == (_committed(boto, bucket, "ckpt") | {"ckpt/config.json"}
                                   | _committed(boto, bucket, "ckpt/best"))
    _loads(url, tmp_path / "b2", {"model.bin": b"2"})
    _loads(inner, tmp_path / "c2", {"model.bin": b"best"})  # never touched by the outer folder's saves
    s3folder.save(tmp_path / "b", url)  # (without owns: still none of the other folder's objects)
    _loads(inner, tmp_path / "c3", {"model.bin": b"best"})
    s3folder.delete(url)
    assert _keys(boto, bucket) == set()


def test_bad_folder_urls():
    with pytest.raises(ValueError, match="names a bucket"):
        s3folder.folder_url("s3://bucket-name/")
    assert s3folder.join("s3://bucket-name/a/", "b", "c.pt") == "s3://bucket-name/a/b/c.pt"
