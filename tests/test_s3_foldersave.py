"""fastpersist.s3foldersave: a folder checkpoint two real gloo ranks save to the real s3proxy
together (each rank its own files, a file both ranks hold uploaded once, one commit by the
leader, an object written beside it after the commit), loaded back through a local copy; a rank whose write fails and a rank
whose uploads are refused (403 through the fault proxy) make every rank raise, and the
checkpoint committed before still loads, with no object or multipart upload of the failed
saves left."""

from __future__ import annotations

import errno
import os

import pytest

pytest.importorskip("boto3", reason="the s3 extra is not installed: pip install 'fastpersist[s3]'")

from fastpersist import s3folder, s3foldersave  # noqa: E402

from s3faultproxy import Fault  # noqa: E402
from test_collectivedir import _tree  # noqa: E402 (tests/ is on sys.path)
from s3fixtures import boto, bucket, fault_proxy, s3_env, s3_server  # noqa: E402,F401 (fixtures)


def _writer(rank: int, data: bytes, fail: bool = False):  # noqa: ANN202
    def write(local: str) -> None:
        os.makedirs(os.path.join(local, "sub"), exist_ok=True)
        with open(os.path.join(local, "sub" if rank else "", f"rank_{rank}.bin"), "wb") as f:
            f.write(data + str(rank).encode())
        with open(os.path.join(local, "replica.bin"), "wb") as f:  # every rank holds it: uploaded once
            f.write(data * (6 << 20))
        if fail:
            raise OSError(errno.ENOSPC, "injected", local)

    return write


def _save(rank: int, url: str, data: bytes, *, fail: bool = False) -> str:
    """One collective save by this rank: "ok", or the error it raised."""
    from fastpersist.collectivedir import WorldExchange

    def after_commit(local: str) -> None:  # an object beside the folder, written last
        s3folder.put_small(url + "-latest", data, config=None)

    try:
        got = s3foldersave.save_collective(url, _writer(rank, data, fail), exchange=WorldExchange(),
                                           rank=rank, after_commit=after_commit, kept="KEPT")
        return "ok" if got == url else f"returned {got}"
    except (OSError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"


def _loaded(url: str) -> dict:
    with s3foldersave.local_copy(url) as local:
        return _tree(local)


def _body(rank: int, world: int, d: str, url: str, proxy: str) -> dict:
    out: dict = {"first": _save(rank, url, b"A")}
    out["first_tree"] = _loaded(url)
    out["write_fails"] = _save(rank, url, b"B", fail=rank == 1)
    out["after_write_fails"] = _loaded(url)
    real = os.environ["AWS_ENDPOINT_URL"]
    if rank == 1:
        os.environ["AWS_ENDPOINT_URL"] = proxy  # rank 1's parts are refused (403)
    out["upload_fails"] = _save(rank, url, b"C")
    os.environ["AWS_ENDPOINT_URL"] = real
    out["after_upload_fails"] = _loaded(url)
    return out


def test_two_ranks_save_and_failures_keep_the_previous_checkpoint(boto, bucket, fault_proxy, tmp_path):  # noqa: ANN001
    from test_distributed import gloo_rank, rank_results, spawn_ranks  # tests/ is on sys.path (rootdir conftest)

    url = f"s3://{bucket}/run/ckpt"
    fault_proxy.clear()
    fault_proxy.arm(Fault("403", method="PUT", query="partNumber=", count=0))  # only rank 1 goes through it
    d = str(tmp_path)
    try:
        assert spawn_ranks(2, gloo_rank, (d, _body, url, fault_proxy.endpoint), 300) == [0, 0]
    finally:
        fault_proxy.clear()
    r0, r1 = rank_results(d, 2)
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    committed = {"rank_0.bin": b"A0", os.path.join("sub", "rank_1.bin"): b"A1", "replica.bin": b"A" * (6 << 20)}
    assert r0["first"] == r1["first"] == "ok"
    assert r0["first_tree"] == r1["first_tree"] == committed  # both ranks' files, one commit
    # a write that fails on rank 1: its own error there, rank 1 named on rank 0; nothing uploaded
    assert r1["write_fails"].startswith("OSError") and "injected" in r1["write_fails"], r1["write_fails"]
    assert r0["write_fails"].startswith("RuntimeError") and "another rank: rank(s) [1]" in r0["write_fails"]
    assert f"{url} is untouched" in r0["write_fails"], r0["write_fails"]
    # rank 1's uploads refused: the same on every rank, after the uploads began
    assert "AccessDenied" in r1["upload_fails"] or "403" in r1["upload_fails"], r1["upload_fails"]
    assert r0["upload_fails"].startswith("RuntimeError") and "another rank: rank(s) [1]" in r0["upload_fails"]
    assert r0["upload_fails"].endswith("KEPT"), r0["upload_fails"]
    for r in (r0, r1):
        assert r["after_write_fails"] == r["after_upload_fails"] == committed
    # no commit happened after the first: the object beside it is the first save's
    assert boto.get_object(Bucket=bucket, Key="run/ckpt-latest")["Body"].read() == b"A"
    # the failed saves left no object (the leader deleted its generation) and no multipart upload
    manifest = s3folder.read_manifest(url)
    keys = {o["Key"] for o in boto.list_objects_v2(Bucket=bucket, Prefix="run/ckpt/").get("Contents", [])
            if not o["Key"].endswith("/")}
    assert keys == {f"run/ckpt/{e['key']}" for e in manifest["files"].values()} | {f"run/ckpt/{s3folder.MANIFEST}"}
    assert boto.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_local_copy_refuses_an_uncommitted_folder(boto, bucket):  # noqa: ANN001
    boto.put_object(Bucket=bucket, Key="run/half/model.bin", Body=b"partial")
    with pytest.raises(s3folder.UncommittedFolderError, match="run/half"):
        with s3foldersave.local_copy(f"s3://{bucket}/run/half"):
            pass


def test_ownership_by_top_level_name_and_urls_of_a_local_copy(tmp_path):
    owns = s3foldersave.by_top_level(lambda name: name in ("model.safetensors", "pytorch_model_fsdp_0"))
    assert owns("model.safetensors") and owns("pytorch_model_fsdp_0/__0_0.distcp")
    assert not owns("config.json") and not owns("sub/model.safetensors")
    local = str(tmp_path / "run")
    assert s3foldersave.url_of("s3://bucket/run", local, os.path.join(local, "step1", "mp_rank_00_model_states.pt")) \
        == "s3://bucket/run/step1/mp_rank_00_model_states.pt"
    assert s3foldersave.url_of("s3://bucket/run", local, None) is None
