"""fastpersist.dcp on s3:// prefixes against the real S3 server (s3proxy), with 2 gloo ranks:
data objects byte-identical to a local FastPersistWriter's files, reads of exactly the
items' ranges, a failed save leaves no .metadata (the previous checkpoint loads) and no
multipart upload, the next save removes the failed one's objects."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fastpersist.dcp import FastPersistReader, FastPersistWriter

pytest.importorskip("boto3", reason="the s3 extra is not installed: pip install 'fastpersist[s3]'")
pytestmark = [pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="no gloo backend"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

from s3faultproxy import Fault  # noqa: E402
from s3fixtures import boto, bucket, fault_proxy, faulty, s3_env, s3_server  # noqa: E402,F401 (fixtures)
from test_dcp import assert_equal_state, empty_like_full, expected_full, sharded_state  # noqa: E402
from test_s3_collective import run_ranks  # noqa: E402

import fastpersist  # noqa: E402

CFG = fastpersist.Config(s3_part_size=5 << 20)


def big(rank: int, world: int, seed: int = 0) -> dict[str, Any]:
    """sharded_state plus a 2-part (8 MiB) sharded tensor."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from test_dcp import _mesh

    s = sharded_state(rank, world)
    g = torch.Generator().manual_seed(seed)
    s["big"] = distribute_tensor(torch.randn(2048, 2048, generator=g), _mesh(world), [Shard(0)])
    return s


def zeroed(s: dict[str, Any]) -> dict[str, Any]:
    return {k: (v * 0 if isinstance(v, torch.Tensor) else 0) for k, v in s.items()}


def check(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            a = got[k].full_tensor() if hasattr(got[k], "full_tensor") else got[k]
            b = v.full_tensor() if hasattr(v, "full_tensor") else v
            assert a.dtype == b.dtype and torch.equal(a, b), k
        else:
            assert got[k] == v, k


def sc_round_trip(rank: int, world: int, base: str, local: str) -> str:
    dcp.save(big(rank, world), storage_writer=FastPersistWriter(f"{base}/ckpt", thread_count=2, config=CFG))
    dcp.save(big(rank, world), storage_writer=FastPersistWriter(local, thread_count=2))
    fresh = zeroed(big(rank, world))
    dcp.load(fresh, storage_reader=FastPersistReader(f"{base}/ckpt", config=CFG))
    check(fresh, big(rank, world))
    fut = dcp.async_save(big(rank, world, 1), storage_writer=FastPersistWriter(f"{base}/async", config=CFG))
    (fut.result() if hasattr(fut, "result") else fut.upload_completion.result())
    fresh = zeroed(big(rank, world))
    dcp.load(fresh, storage_reader=FastPersistReader(f"{base}/async", config=CFG))
    check(fresh, big(rank, world, 1))
    return "ok"


def sc_failed_save(rank: int, world: int, base: str, flags: str) -> str:
    """A checkpoint, then a save whose rank 1 upload the store refuses (armed in the
    parent), then one that succeeds: the failed one never becomes visible."""
    w = lambda: FastPersistWriter(f"{base}/ckpt", config=CFG)  # noqa: E731
    dcp.save(sharded_state(rank, world), storage_writer=w())
    dist.barrier()
    if rank == 0:
        with open(os.path.join(flags, "saved"), "w"):
            pass
    wait_for(os.path.join(flags, "armed"))
    failed = sharded_state(rank, world)
    failed["step"] = 8
    try:
        dcp.save(failed, storage_writer=w())
        outcome = "no error"
    except CheckpointException as e:
        outcome = f"CheckpointException failures={sorted(e.failures)}"
    fresh = {"w": sharded_state(rank, world)["w"] * 0, "step": 0}
    dcp.load(fresh, storage_reader=FastPersistReader(f"{base}/ckpt", config=CFG))
    assert fresh["step"] == 7 and torch.equal(fresh["w"].full_tensor(), sharded_state(rank, world)["w"].full_tensor())
    dist.barrier()
    if rank == 0:
        with open(os.path.join(flags, "checked"), "w"):
            pass
    wait_for(os.path.join(flags, "disarmed"))
    later = sharded_state(rank, world)
    later["step"] = 9
    dcp.save(later, storage_writer=w())
    return outcome


def wait_for(path: str, timeout: float = 60.0) -> None:
    import time

    end = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.01)


def _keys(boto, bucket: str, prefix: str) -> list[str]:  # noqa: ANN001
    listed = boto.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"][len(prefix):] for o in listed)


def test_dcp_round_trip_matches_local_files(boto, bucket, tmp_path):  # noqa: ANN001
    """2 ranks save to s3:// and load back (and async_save); the data objects are the local
    writer's files byte for byte; one process reloads the 2-rank checkpoint unsharded."""
    local = tmp_path / "local"
    _ok = run_ranks(str(tmp_path), sc_round_trip, f"s3://{bucket}/run", str(local))
    assert _ok == ["ok", "ok"], _ok
    names = sorted(n for n in os.listdir(local) if n.endswith(".distcp"))
    assert names == ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp"]
    assert _keys(boto, bucket, "run/ckpt/") == [".metadata"] + names
    for n in names:
        blob = boto.get_object(Bucket=bucket, Key=f"run/ckpt/{n}")["Body"].read()
        assert blob == (local / n).read_bytes(), n
    state = empty_like_full()
    dcp.load(state, storage_reader=FastPersistReader(f"s3://{bucket}/run/ckpt", config=CFG), no_dist=True)
    assert_equal_state(state, expected_full())
    assert boto.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_dcp_failed_save_keeps_the_previous_checkpoint(boto, bucket, tmp_path, faulty):  # noqa: ANN001
    """The store refuses a part of the second save: every rank raises, no new .metadata, the
    previous checkpoint loads (on the ranks, and here unsharded), no multipart upload is
    left; the next save commits and removes the failed save's objects."""
    base = f"s3://{bucket}/r"
    import threading

    def arm() -> None:
        wait_for(str(tmp_path / "saved"))
        faulty.arm(Fault("403", method="PUT", query="partNumber=1", count=1))  # one rank's data object
        (tmp_path / "armed").touch()
        wait_for(str(tmp_path / "checked"))
        faulty.clear()
        (tmp_path / "disarmed").touch()

    # Only one rank's data object fails: the other's completes, and the next commit removes it.
    t = threading.Thread(target=arm)
    t.start()
    results = run_ranks(str(tmp_path), sc_failed_save, base, str(tmp_path))
    t.join(10)
    assert results[0] in ("CheckpointException failures=[0]", "CheckpointException failures=[1]"), results
    assert results[1] == results[0], results
    keys = _keys(boto, bucket, "r/ckpt/")
    assert ".metadata" in keys
    state = {"step": 0, "w": torch.zeros(8, 6)}
    faulty.clear()
    dcp.load(state, storage_reader=FastPersistReader(f"{base}/ckpt", config=CFG), no_dist=True)
    assert state["step"] == 9 and torch.equal(state["w"], expected_full()["w"])
    # data objects are read by ranged GETs of the items (never whole), .metadata whole
    gets = [(t, h) for (m, t), h in zip(faulty.requests, faulty.headers) if m == "GET" and ".distcp" in t]
    assert gets and all("range" in h for _t, h in gets), gets
    # only the last checkpoint's objects are left
    from fastpersist.formats.dcpmetadata import load_metadata_bytes

    md, _ = load_metadata_bytes(boto.get_object(Bucket=bucket, Key="r/ckpt/.metadata")["Body"].read(), "m")
    used = {i.relative_path for i in md.storage_data.values()}
    assert set(keys) == used | {".metadata"}, (keys, used)
    assert boto.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_dcp_s3_checks_and_refusals(boto, bucket):  # noqa: ANN001
    """One process: a damaged data object is a ChecksumError naming it; overwrite=False, the
    safetensors serialization and a missing checkpoint are refused with clear errors."""
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    from fastpersist.errors import ChecksumError

    url = f"s3://{bucket}/one"
    state = {"w": torch.arange(64, dtype=torch.float32), "step": 3}
    dcp.save(state, storage_writer=FastPersistWriter(url, config=CFG))
    assert _keys(boto, bucket, "one/") == [".metadata", "__0_0.distcp"]
    got = {"w": torch.zeros(64), "step": 0}
    dcp.load(got, storage_reader=FastPersistReader(url, config=CFG))
    assert torch.equal(got["w"], state["w"]) and got["step"] == 3

    with pytest.raises((CheckpointException, RuntimeError), match="overwrite"):
        dcp.save(state, storage_writer=FastPersistWriter(url, config=CFG, overwrite=False))
    with pytest.raises((CheckpointException, ValueError), match="object storage"):
        dcp.save(state, storage_writer=FastPersistWriter(f"{url}-st", config=CFG,
                                                         serialization_format=SerializationFormat.SAFETENSORS))
    with pytest.raises((CheckpointException, FileNotFoundError, AssertionError)):
        dcp.load(got, storage_reader=FastPersistReader(f"s3://{bucket}/none", config=CFG))

    blob = bytearray(boto.get_object(Bucket=bucket, Key="one/__0_0.distcp")["Body"].read())
    blob[-200] ^= 0x01  # inside the tensor item's zip trailer / payload
    boto.put_object(Bucket=bucket, Key="one/__0_0.distcp", Body=bytes(blob))
    with pytest.raises(CheckpointException) as e:
        dcp.load({"w": torch.zeros(64), "step": 0}, storage_reader=FastPersistReader(url, config=CFG))
    err = e.value.failures[0][0]
    assert isinstance(err, ChecksumError) and "__0_0.distcp" in str(err), err
