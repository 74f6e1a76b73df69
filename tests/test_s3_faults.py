"""Faults between fastpersist and a real S3 server (s3proxy behind tests/s3faultproxy.py):
retried where S3 practice says (500, 503 SlowDown, connection reset), a named error
otherwise; after every fault the previous checkpoint loads, no partial object is under
the key, and no multipart upload is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Iterator

import pytest
import torch

import fastpersist
from fastpersist.errors import ObjectStoreError

pytest.importorskip("boto3", reason="the s3 extra is not installed: pip install 'fastpersist[s3]'")

from s3faultproxy import Fault  # noqa: E402
from s3fixtures import boto, bucket, fault_proxy, faulty, s3_env, s3_server  # noqa: E402,F401 (fixtures)

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _small_parts() -> Iterator[None]:
    with fastpersist.config.override(s3_part_size=5 << 20, s3_threads=2):
        yield


def _state(seed: int, mib: int = 12) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MiB // 4, generator=g), "seed": seed}


def _clean(boto, bucket: str, key: str, previous: dict) -> None:  # noqa: ANN001
    """The previous checkpoint is what loads; no upload is left."""
    got = fastpersist.load(f"s3://{bucket}/{key}")
    assert got["seed"] == previous["seed"] and torch.equal(got["w"], previous["w"])
    assert boto.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


@pytest.mark.parametrize("action,method,query", [
    ("503", "PUT", "partNumber="),      # SlowDown on a part
    ("500", "PUT", "partNumber="),      # InternalError on a part
    ("reset", "PUT", "partNumber="),    # the connection dies during a part
    ("503", "POST", "uploads"),         # SlowDown on CreateMultipartUpload
    ("500", "POST", "uploadId="),       # InternalError on CompleteMultipartUpload
])
def test_transient_faults_are_retried(boto, bucket, faulty, action, method, query):  # noqa: ANN001
    key = "t.pt"
    state = _state(1)
    faulty.arm(Fault(action, method=method, query=query, nth=2 if query == "partNumber=" else 1, count=2))
    fastpersist.save(state, f"s3://{bucket}/{key}")
    assert faulty.faults[0].fired == 2  # the fault happened, twice, and the save went on
    faulty.clear()
    _clean(boto, bucket, key, state)


@pytest.mark.parametrize("action,method,query", [("503", "GET", None), ("reset", "GET", None), ("500", "HEAD", None)])
def test_transient_faults_on_loads_are_retried(boto, bucket, faulty, action, method, query):  # noqa: ANN001
    state = _state(2)
    fastpersist.save(state, f"s3://{bucket}/g.pt")
    faulty.arm(Fault(action, method=method, query=query, count=2))
    got = fastpersist.load(f"s3://{bucket}/g.pt")
    assert faulty.faults[0].fired == 2
    assert torch.equal(got["w"], state["w"])
    assert fastpersist.verify(f"s3://{bucket}/g.pt").ok


def test_refused_part_fails_named_and_keeps_previous(boto, bucket, faulty):  # noqa: ANN001
    previous = _state(3)
    fastpersist.save(previous, f"s3://{bucket}/r.pt")
    faulty.arm(Fault("403", method="PUT", query="partNumber=", nth=2, count=0))
    with pytest.raises(ObjectStoreError) as e:
        fastpersist.save(_state(4), f"s3://{bucket}/r.pt")
    assert e.value.operation == "UploadPart" and e.value.code == "AccessDenied"
    assert e.value.url == f"s3://{bucket}/r.pt" and "previous object" in str(e.value)
    assert any(m == "DELETE" and "uploadId=" in t for m, t in faulty.requests)  # AbortMultipartUpload was sent
    faulty.clear()
    _clean(boto, bucket, "r.pt", previous)


def test_slowdown_that_never_ends_gives_up_named(boto, bucket, faulty, monkeypatch):  # noqa: ANN001
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
    previous = _state(5)
    fastpersist.save(previous, f"s3://{bucket}/s.pt")
    faulty.arm(Fault("503", method="PUT", query="partNumber=", count=0))
    with pytest.raises(ObjectStoreError) as e:
        fastpersist.save(_state(6), f"s3://{bucket}/s.pt")
    assert e.value.code == "SlowDown" and "retries" in str(e.value)
    assert faulty.faults[0].fired >= 3
    faulty.clear()
    _clean(boto, bucket, "s.pt", previous)


def test_first_save_that_fails_leaves_no_object(boto, bucket, faulty):  # noqa: ANN001
    faulty.arm(Fault("403", method="POST", query="uploadId=", count=0))  # CompleteMultipartUpload refused
    with pytest.raises(ObjectStoreError) as e:
        fastpersist.save(_state(7), f"s3://{bucket}/new.pt")
    assert e.value.operation == "CompleteMultipartUpload"
    faulty.clear()
    assert boto.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0
    assert boto.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_missing_bucket(s3_env):  # noqa: ANN001
    with pytest.raises(FileNotFoundError) as e:
        fastpersist.save(_state(8, 1), "s3://no-such-bucket-fp/x.pt")
    assert isinstance(e.value, ObjectStoreError) and e.value.code == "NoSuchBucket"
    assert "bucket" in str(e.value) and "s3://no-such-bucket-fp/x.pt" in str(e.value)
    with pytest.raises(FileNotFoundError):
        fastpersist.load("s3://no-such-bucket-fp/x.pt")


def test_bad_credentials(boto, bucket, s3_env, monkeypatch):  # noqa: ANN001
    previous = _state(9, 1)
    fastpersist.save(previous, f"s3://{bucket}/c.pt")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    with pytest.raises(ObjectStoreError) as e:
        fastpersist.save(_state(10, 1), f"s3://{bucket}/c.pt")
    assert e.value.operation == "CreateMultipartUpload" and "credentials" in str(e.value)
    with pytest.raises(ObjectStoreError, match="credentials"):
        fastpersist.load(f"s3://{bucket}/c.pt")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_env.secret_key)
    _clean(boto, bucket, "c.pt", previous)


def test_keys_rewritten_in_the_credentials_file_are_used_by_the_next_request(boto, bucket, s3_env, monkeypatch,
                                                                              tmp_path):  # noqa: ANN001
    """Static keys that expire, rotated by rewriting the credentials file (a sidecar
    refreshing a session token): the client made with the old keys is not kept."""
    creds = tmp_path / "credentials"
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))

    def write(secret: str) -> None:
        tmp = tmp_path / "credentials.new"
        tmp.write_text(f"[default]\naws_access_key_id = {s3_env.access_key}\naws_secret_access_key = {secret}\n")
        os.replace(tmp, creds)  # as a refresher does: the file is never seen half written

    write("expired-secret")
    with pytest.raises(ObjectStoreError, match="credentials"):
        fastpersist.save(_state(12, 1), f"s3://{bucket}/rot.pt")
    write(s3_env.secret_key)
    state = _state(13, 1)
    fastpersist.save(state, f"s3://{bucket}/rot.pt")
    got = fastpersist.load(f"s3://{bucket}/rot.pt")
    assert torch.equal(got["w"], state["w"])
    write("expired-again")
    with pytest.raises(ObjectStoreError, match="credentials"):
        fastpersist.load(f"s3://{bucket}/rot.pt")


_KILLED_SAVE = """
import sys, torch, fastpersist
g = torch.Generator().manual_seed(11)
fastpersist.save({"w": torch.randn(40 * (1 << 20) // 4, generator=g), "seed": 11}, sys.argv[1])
print("saved", flush=True)
"""


def test_killed_save_leaves_no_object_and_next_save_cleans_its_upload(boto, bucket, faulty):  # noqa: ANN001
    previous = _state(12, 1)
    fastpersist.save(previous, f"s3://{bucket}/k.pt")
    env = dict(os.environ, FASTPERSIST_S3_THREADS="1", FASTPERSIST_S3_PART_SIZE="5M")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, f"s3://{bucket}/k.pt"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while sum(1 for m, t in list(faulty.requests) if m == "PUT" and "partNumber=" in t) < 2:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the child never uploaded two parts"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    faulty.clear()
    got = fastpersist.load(f"s3://{bucket}/k.pt")
    assert got["seed"] == 12  # the previous checkpoint, whole
    orphans = boto.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert [u["Key"] for u in orphans] == ["k.pt"]  # a kill leaves its upload: S3 cannot know
    newer = _state(13, 1)
    fastpersist.save(newer, f"s3://{bucket}/k.pt")  # the next save to the key aborts it
    _clean(boto, bucket, "k.pt", newer)


def test_parts_carry_content_md5_and_unsigned_payloads(boto, bucket, faulty, tmp_path, monkeypatch):  # noqa: ANN001
    """Against an endpoint: every part has a Content-MD5 and no SHA-256 payload signature,
    unless the profile's s3 section asks for payload signing."""
    import base64
    import hashlib

    fastpersist.save(_state(14), f"s3://{bucket}/md5.pt")
    parts = [(t, h) for (m, t), h in zip(faulty.requests, faulty.headers) if m == "PUT" and "partNumber=" in t]
    assert len(parts) == 3  # 12 MiB in parts of 5 MiB
    blob = boto.get_object(Bucket=bucket, Key="md5.pt")["Body"].read()
    first = base64.b64encode(hashlib.md5(blob[:5 << 20]).digest()).decode()  # noqa: S324
    assert {h["content-md5"] for t, h in parts if "partNumber=1&" in t + "&"} == {first}
    assert all(h["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD" for _t, h in parts)
    (tmp_path / "config").write_text("[default]\ns3 =\n    payload_signing_enabled = true\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    faulty.clear()
    fastpersist.save(_state(15), f"s3://{bucket}/md5.pt")
    parts = [h for (m, t), h in zip(faulty.requests, faulty.headers) if m == "PUT" and "partNumber=" in t]
    assert parts and all(len(h["x-amz-content-sha256"]) == 64 for h in parts)  # a SHA-256, as the profile says


def test_stalled_requests_time_out_and_are_retried(boto, bucket, faulty):  # noqa: ANN001
    state = _state(16)
    with fastpersist.config.override(s3_timeout=1.0):
        faulty.arm(Fault("stall", method="PUT", query="partNumber=", nth=2, count=1))
        fastpersist.save(state, f"s3://{bucket}/stall.pt")  # the stalled part times out after 1 s, then retried
        assert faulty.faults[0].fired == 1
        faulty.arm(Fault("stall", method="GET", count=1))
        assert torch.equal(fastpersist.load(f"s3://{bucket}/stall.pt")["w"], state["w"])
        assert faulty.faults[0].fired == 1
    faulty.clear()
    _clean(boto, bucket, "stall.pt", state)


def test_a_store_that_stays_stalled_fails_named(boto, bucket, faulty, monkeypatch):  # noqa: ANN001
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    previous = _state(17, 1)
    fastpersist.save(previous, f"s3://{bucket}/hang.pt")
    with fastpersist.config.override(s3_timeout=1.0):
        faulty.arm(Fault("stall", method="PUT", query="partNumber=", count=0))
        with pytest.raises(ObjectStoreError) as e:
            fastpersist.save(_state(18), f"s3://{bucket}/hang.pt")
    assert e.value.operation == "UploadPart" and "Timeout" in e.value.code, e.value.code
    faulty.clear()
    _clean(boto, bucket, "hang.pt", previous)


def test_interrupted_save_aborts_its_upload(boto, bucket, faulty):  # noqa: ANN001
    """Ctrl-C while a part is in flight: the KeyboardInterrupt propagates, the upload is
    aborted, the previous object stays."""
    previous = _state(19, 1)
    fastpersist.save(previous, f"s3://{bucket}/int.pt")
    faulty.stall_s = 3.0
    try:
        with fastpersist.config.override(s3_timeout=10.0):
            # SIGINT to this process when the second part's request reaches the server
            faulty.arm(Fault("stall", method="PUT", query="partNumber=", nth=2, count=1,
                             hook=lambda: os.kill(os.getpid(), signal.SIGINT)))
            with pytest.raises(KeyboardInterrupt):
                fastpersist.save(_state(20), f"s3://{bucket}/int.pt")
    finally:
        faulty.stall_s = 30.0
    assert faulty.faults[0].fired == 1
    assert any(m == "DELETE" and "uploadId=" in t for m, t in faulty.requests), faulty.requests
    faulty.clear()
    _clean(boto, bucket, "int.pt", previous)
