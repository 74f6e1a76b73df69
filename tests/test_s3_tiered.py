"""The tiered mode of ``s3://`` URLs (``s3_local_dir``) against a real S3 server (s3proxy
behind tests/s3faultproxy.py): saves land in the local directory, a background drain
uploads them, ``wait_durable`` says when the object is in the store, and the store's
copy is bit-exact; loads read the local copy when the journal vouches for it; a drain
that fails keeps the local copy and leaves no upload; a drain killed with its process
resumes at the next start; a full local disk fails the save and keeps the previous
checkpoint; retention never deletes what is not durable elsewhere."""

from __future__ import annotations

import errno
import io
import os
import signal
import subprocess
import sys
import time
from typing import Iterator

import pytest
import torch

import fastpersist
from fastpersist import s3journal, s3tier
from fastpersist.errors import ObjectStoreError
from fastpersist.s3url import parse
from fastpersist.testing import inject_fault

pytest.importorskip("boto3", reason="the s3 extra is not installed: pip install 'fastpersist[s3]'")

from s3faultproxy import Fault  # noqa: E402
from s3fixtures import boto, bucket, fault_proxy, faulty, s3_env, s3_server  # noqa: E402,F401 (fixtures)

MiB = 1 << 20


@pytest.fixture
def tier(tmp_path, s3_env) -> Iterator[str]:  # noqa: ANN001
    """The tiered mode on, in a fresh local directory; 5 MiB parts, 2 threads."""
    root = str(tmp_path / "tier")
    with fastpersist.config.override(s3_local_dir=root, s3_part_size=5 << 20, s3_threads=2):
        yield root
    fastpersist.wait_durable(timeout=120)


def _state(seed: int, mib: int = 12) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MiB // 4, generator=g), "seed": seed}


def _same(a: dict, b: dict) -> bool:
    return a["seed"] == b["seed"] and torch.equal(a["w"], b["w"])


def _remote_bytes(boto, bucket: str, key: str) -> bytes:  # noqa: ANN001
    return boto.get_object(Bucket=bucket, Key=key)["Body"].read()


def _local(root: str, bucket: str, key: str) -> str:
    return os.path.join(root, bucket, key)


def _entry(root: str, bucket: str, key: str) -> dict:
    e = s3journal.read(root, parse(f"s3://{bucket}/{key}"))
    assert e is not None
    return e


def _no_uploads(boto, bucket: str) -> None:  # noqa: ANN001
    assert boto.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def _gets(proxy, key: str) -> int:  # noqa: ANN001
    return sum(1 for m, t in list(proxy.requests) if m == "GET" and key in t)


def test_save_async_lands_locally_then_drains_bit_exact(boto, bucket, tier, faulty):  # noqa: ANN001
    state = _state(1)
    url = f"s3://{bucket}/run/a.pt"
    fut = fastpersist.save_async(state, url)
    assert fut.wait(60)  # the local copy is committed
    local = _local(tier, bucket, "run/a.pt")
    assert _same(torch.load(local, weights_only=True), state)
    assert fut.wait_durable(120) and fut.durable()
    with open(local, "rb") as f:
        assert _remote_bytes(boto, bucket, "run/a.pt") == f.read()  # the store holds the local file's bytes
    e = _entry(tier, bucket, "run/a.pt")
    assert e["durable"] and not e["pending"] and e["error"] is None
    _no_uploads(boto, bucket)
    faulty.requests.clear()
    assert _same(fastpersist.load(url), state)  # from the local copy: no GET of the object
    assert _gets(faulty, "run/a.pt") == 0
    result = fastpersist.verify(url)
    assert result.ok and result.path == url and any(local in n for n in result.notes)
    os.unlink(local)
    assert _same(fastpersist.load(url), state)  # no local copy: the object
    assert _gets(faulty, "run/a.pt") > 0


def test_blocking_save_safetensors_and_load_state_dict(boto, bucket, tier):  # noqa: ANN001
    url = f"s3://{bucket}/m.safetensors"
    tensors = {"a": torch.arange(3 * MiB, dtype=torch.float32), "b": torch.ones(7)}
    fastpersist.save_file(tensors, url, {"k": "v"})
    assert fastpersist.wait_durable(url, timeout=120)
    got = fastpersist.load_file(url)
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], tensors[k]) for k in tensors)
    with open(_local(tier, bucket, "m.safetensors"), "rb") as f:
        assert _remote_bytes(boto, bucket, "m.safetensors") == f.read()
    model = torch.nn.Linear(64, 32)
    fastpersist.save(model.state_dict(), f"s3://{bucket}/lin.pt")
    other = torch.nn.Linear(64, 32)
    fastpersist.load_state_dict(other, f"s3://{bucket}/lin.pt")  # the local copy (pending or durable)
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)
    assert fastpersist.wait_durable(timeout=120)
    with fastpersist.config.override(s3_local_dir=None):  # direct mode: the object itself
        third = torch.nn.Linear(64, 32)
        fastpersist.load_state_dict(third, f"s3://{bucket}/lin.pt")
        assert torch.equal(third.weight, model.weight)


def test_a_changed_local_copy_is_not_used(boto, bucket, tier):  # noqa: ANN001
    url = f"s3://{bucket}/c.pt"
    state = _state(2, 1)
    fastpersist.save(state, url)
    assert fastpersist.wait_durable(url, timeout=120)
    local = _local(tier, bucket, "c.pt")
    with open(local, "r+b") as f:  # written in place: another version than the journal's
        f.seek(os.path.getsize(local) // 2)
        f.write(b"\x00" * 64)
    assert _same(fastpersist.load(url), state)  # the object, not the damaged copy
    assert fastpersist.verify(url).ok


def test_keys_that_are_no_plain_path_are_refused(bucket, tier):  # noqa: ANN001
    for key in ("a/../b.pt", "a//b.pt", "./c.pt"):
        with pytest.raises(ValueError, match="plain relative path"):
            fastpersist.save({"x": 1}, f"s3://{bucket}/{key}")


def test_drain_retries_503_and_resets(boto, bucket, tier, faulty):  # noqa: ANN001
    state = _state(3)
    faulty.arm(Fault("503", method="PUT", query="partNumber=", nth=1, count=1),
               Fault("reset", method="PUT", query="partNumber=", nth=3, count=1))
    fut = fastpersist.save_async(state, f"s3://{bucket}/r.pt")
    assert fut.wait_durable(120)
    assert [f.fired for f in faulty.faults] == [1, 1]
    with open(_local(tier, bucket, "r.pt"), "rb") as f:
        assert _remote_bytes(boto, bucket, "r.pt") == f.read()
    _no_uploads(boto, bucket)


def test_refused_part_fails_the_drain_named_keeps_the_local_copy_and_drain_retries(boto, bucket, tier, faulty):  # noqa: ANN001,E501
    url = f"s3://{bucket}/x.pt"
    v1, v2 = _state(4, 1), _state(5)
    fastpersist.save(v1, url)
    assert fastpersist.wait_durable(url, timeout=120)
    faulty.arm(Fault("403", method="PUT", query="partNumber=", nth=2, count=0))
    fut = fastpersist.save_async(v2, url)
    with pytest.raises(ObjectStoreError) as info:
        fut.wait_durable(120)
    assert info.value.operation == "UploadPart" and info.value.code == "AccessDenied" and info.value.url == url
    assert fut.wait(0) and not fut.durable()  # the local save itself succeeded
    faulty.clear()
    _no_uploads(boto, bucket)  # the drain's upload was aborted
    with fastpersist.config.override(s3_local_dir=None):
        assert _same(fastpersist.load(url), v1)  # the store still holds the previous checkpoint
    e = _entry(tier, bucket, "x.pt")
    assert e["pending"] and "AccessDenied" in e["error"]
    assert _same(fastpersist.load(url), v2)  # the newest save, from the local copy
    # `fastpersist drain` (another process: the lock is free) drains it again
    env = dict(os.environ, FASTPERSIST_S3_LOCAL_DIR=tier, FASTPERSIST_S3_PART_SIZE="5M")
    r = subprocess.run([sys.executable, "-m", "fastpersist", "drain"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "durable" in r.stdout and url in r.stdout
    with fastpersist.config.override(s3_local_dir=None):
        assert _same(fastpersist.load(url), v2)
    e = _entry(tier, bucket, "x.pt")
    assert not e["pending"] and e["durable"] and e["error"] is None


_KILLED_DRAIN = """
import sys, torch, fastpersist
g = torch.Generator().manual_seed(7)
fut = fastpersist.save_async({"w": torch.randn(20 * (1 << 20) // 4, generator=g), "seed": 7}, sys.argv[1])
fut.wait()
print("local", flush=True)
fut.wait_durable()
print("durable", flush=True)
"""


def test_drain_killed_mid_upload_resumes_at_the_next_start(boto, bucket, faulty, tmp_path):  # noqa: ANN001
    root = str(tmp_path / "tier")
    url = f"s3://{bucket}/k.pt"
    env = dict(os.environ, FASTPERSIST_S3_LOCAL_DIR=root, FASTPERSIST_S3_THREADS="1", FASTPERSIST_S3_PART_SIZE="5M")
    stalled = Fault("stall", method="PUT", query="partNumber=", nth=3, count=1)
    faulty.stall_s = 5.0
    faulty.arm(stalled)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_DRAIN, url], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not stalled.fired:  # two parts stored, the third in flight
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the child's drain never reached its third part"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    faulty.clear()
    e = _entry(root, bucket, "k.pt")
    assert e["pending"] and e["durable"] is None  # nothing marked durable
    keys = [o["Key"] for o in boto.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert "k.pt" not in keys, keys  # no object under the key
    assert [u["Key"] for u in boto.list_multipart_uploads(Bucket=bucket).get("Uploads", [])] == ["k.pt"]
    with fastpersist.config.override(s3_local_dir=root, s3_part_size=5 << 20, s3_threads=2):
        got = fastpersist.load(url)  # the next start: the local copy, and the drain resumed
        assert got["seed"] == 7
        assert fastpersist.wait_durable(timeout=120)
    with open(os.path.join(root, bucket, "k.pt"), "rb") as f:
        assert _remote_bytes(boto, bucket, "k.pt") == f.read()
    _no_uploads(boto, bucket)  # the killed drain's upload was aborted
    e = _entry(root, bucket, "k.pt")
    assert e["durable"] and not e["pending"]


_EXIT_WAITS = """
import sys, torch, fastpersist
state = {"w": torch.ones(3 * (1 << 20)), "seed": 1}
fastpersist.save_async(state, sys.argv[1] + "/direct.pt", config=fastpersist.Config(s3_local_dir=None))
fut = fastpersist.save_async(state, sys.argv[1] + "/e.pt")  # tiered (FASTPERSIST_S3_LOCAL_DIR)
fut.wait()  # async saves run in call order: the direct upload is done, the drain starts now
print("durable at exit:", fut.durable(), flush=True)
"""


def test_exit_waits_for_the_drain_and_the_direct_upload(boto, bucket, faulty, tmp_path):  # noqa: ANN001
    """A direct-mode async upload, then a tiered save whose drain is still running when the
    interpreter exits (a part of each upload stalls past the 1 s timeout and is retried): the
    exit waits for the drain (the uploads' thread pools refuse new work once the shutdown has
    begun, so the wait comes before that); both objects are complete, no upload is left."""
    root = str(tmp_path / "tier")
    faulty.stall_s = 3.0
    # One stall for each upload: the direct upload's first part PUT and the drain's.
    faulty.arm(Fault("stall", method="PUT", query="partNumber=", path="/e.pt"),
               Fault("stall", method="PUT", query="partNumber=", path="/direct.pt"))
    env = dict(os.environ, FASTPERSIST_S3_PART_SIZE="5M", FASTPERSIST_S3_LOCAL_DIR=root, FASTPERSIST_S3_TIMEOUT="1")
    r = subprocess.run([sys.executable, "-c", _EXIT_WAITS, f"s3://{bucket}"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "durable at exit: False" in r.stdout
    assert "waiting for 1 drain(s)" in r.stderr
    parts = [t.split("?")[0] for m, t in faulty.requests if m == "PUT" and "partNumber=" in t]
    # each upload had a part PUT stalled and sent again: the direct one's part, the drain's 3 parts
    assert parts.count(f"/{bucket}/direct.pt") >= 2 and parts.count(f"/{bucket}/e.pt") >= 4, parts
    with open(os.path.join(root, bucket, "e.pt"), "rb") as f:
        assert _remote_bytes(boto, bucket, "e.pt") == f.read()
    direct = torch.load(io.BytesIO(_remote_bytes(boto, bucket, "direct.pt")), weights_only=True)
    assert torch.equal(direct["w"], torch.ones(3 * MiB))
    assert not os.path.exists(os.path.join(root, bucket, "direct.pt"))
    _no_uploads(boto, bucket)


@pytest.mark.parametrize("how", ["save", "save_async"])
def test_full_local_disk_fails_the_save_and_keeps_the_previous(boto, bucket, tier, how):  # noqa: ANN001
    url = f"s3://{bucket}/f.pt"
    v1 = _state(8, 1)
    fastpersist.save(v1, url)
    assert fastpersist.wait_durable(url, timeout=120)
    with inject_fault("write", 1, "ENOSPC"), pytest.raises(OSError) as info:
        if how == "save":
            fastpersist.save(_state(9, 1), url)
        else:
            fastpersist.save_async(_state(9, 1), url).wait_durable(120)
    assert info.value.errno == errno.ENOSPC
    if how == "save":
        assert url in str(info.value) and "nothing was queued" in str(info.value)
    assert _same(fastpersist.load(url), v1)  # the previous checkpoint, from the local copy
    with fastpersist.config.override(s3_local_dir=None):
        assert _same(fastpersist.load(url), v1)  # and in the store
    assert not _entry(tier, bucket, "f.pt")["pending"]
    _no_uploads(boto, bucket)


def test_retention_keeps_the_newest_and_never_the_only_durable_copy(boto, bucket, tmp_path, s3_env, faulty):  # noqa: ANN001,E501
    root = str(tmp_path / "tier")
    boto.put_object(Bucket=bucket, Key="run/theirs.pt", Body=b"not the tier's")
    states = {i: _state(20 + i, 1) for i in range(1, 6)}
    with fastpersist.config.override(s3_local_dir=root, s3_keep_local=1, s3_keep_remote=3):
        for i in (1, 2):
            fastpersist.save(states[i], f"s3://{bucket}/run/ck-{i}.pt")
            assert fastpersist.wait_durable(timeout=120)
        faulty.arm(Fault("403", method="PUT", query="partNumber=", count=0))
        fastpersist.save(states[3], f"s3://{bucket}/run/ck-3.pt")
        with pytest.raises(ObjectStoreError):
            fastpersist.wait_durable(timeout=120)
        faulty.clear()
        for i in (4, 5):
            fastpersist.save(states[i], f"s3://{bucket}/run/ck-{i}.pt")
            assert fastpersist.wait_durable(timeout=120)
        local = sorted(os.listdir(os.path.join(root, bucket, "run")))
        # ck-5 is the newest; ck-3 never reached the store: its local copy is the only one and stays
        assert local == ["ck-3.pt", "ck-5.pt"]
        keys = sorted(o["Key"] for o in boto.list_objects_v2(Bucket=bucket, Prefix="run/").get("Contents", []))
        assert keys == ["run/ck-2.pt", "run/ck-4.pt", "run/ck-5.pt", "run/theirs.pt"]  # the newest 3 of the tier's
        for i in (2, 3, 4, 5):
            assert _same(fastpersist.load(f"s3://{bucket}/run/ck-{i}.pt"), states[i])
        with pytest.raises(FileNotFoundError):
            fastpersist.load(f"s3://{bucket}/run/ck-1.pt")
    _no_uploads(boto, bucket)


def test_config_keys():
    assert fastpersist.Config.from_env(environ={"FASTPERSIST_S3_LOCAL_DIR": "/x/y", "FASTPERSIST_S3_KEEP_LOCAL": "2",
                                                "FASTPERSIST_S3_KEEP_REMOTE": "5"}).s3_local_dir == "/x/y"
    with pytest.raises(ValueError, match="FASTPERSIST_S3_KEEP_LOCAL"):
        fastpersist.Config.from_env(environ={"FASTPERSIST_S3_KEEP_LOCAL": "-1"})
    with pytest.raises(TypeError):
        fastpersist.Config(s3_local_dir=3)  # type: ignore[arg-type]
    assert not s3tier.enabled(fastpersist.Config())


def test_bench_train_tiered_reads_every_object_back(boto, bucket, s3_env, tmp_path):  # noqa: ANN001
    from fastpersist.bench.train_bench import TIERED, run_train_bench

    tiny = dict(steps=6, every=2, layers=1, d_model=32, heads=2, vocab=64, seq=8, batch=2, progress=False)
    res = run_train_bench(str(tmp_path), methods=[TIERED], s3=f"s3://{bucket}/b", **tiny)
    [run] = res.runs_of(TIERED, ok=False)
    assert run.error is None and run.verified is True
    assert run.checkpoints_verified == len(run.checkpoint_steps) == 2  # each object equal to its local copy
    assert run.durable_wait_s >= 0
    assert boto.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0  # its objects removed
    _no_uploads(boto, bucket)
    res = run_train_bench(str(tmp_path), methods=[TIERED], **tiny)  # no s3 prefix: not run, and said why
    assert not res.runs_of(TIERED, ok=False) and any("needs --s3" in n for n in res.notes)
