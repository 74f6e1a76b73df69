"""Collective saves and loads to s3:// URLs (fastpersist.s3collective) with real gloo ranks
against the real S3 server (s3proxy): one multipart upload whose parts come from every
rank, byte-identical to a local save; any rank's failure aborts it (no object, no
orphan upload, the previous object loads)."""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import traceback
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

import fastpersist
from fastpersist.distributed import DistributedCheckpointError, DistributedTimeoutError

pytest.importorskip("boto3", reason="the s3 extra is not installed: pip install 'fastpersist[s3]'")
pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="no gloo backend")

from conftest import assert_same_object  # noqa: E402
from s3faultproxy import Fault  # noqa: E402
from s3fixtures import boto, bucket, fault_proxy, faulty, s3_env, s3_server  # noqa: E402,F401 (fixtures)

PART = 5 << 20


def cfg() -> fastpersist.Config:
    return fastpersist.Config(dist_timeout=20.0, s3_part_size=PART, fsync=False)


def state(seed: int = 0) -> dict:
    """About 12 MiB: three 5 MiB parts, so rank 0 uploads part 1 and rank 1 parts 2-3."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(2_000_000, generator=g)
    return {"model": {"w": w, "view": w[5:1005].view(10, 100), "b": torch.randn(777, generator=g).bfloat16(),
                      "e": torch.empty(0, 2), "i": torch.arange(1_000_000, dtype=torch.int32) * (seed + 1)},
            "step": 100 + seed, "name": "run", "lr": [0.1, 0.01]}


def tensors(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(1_500_000, generator=g), "b": torch.arange(300, dtype=torch.int16),
            "c": torch.randn(3, 5, generator=g).half()}


def small() -> dict:
    return {"a": torch.arange(10, dtype=torch.float64), "b": [1, 2]}


# --------------------------------------------------------------------------- harness


def _child(rank: int, world: int, store: str, fn: Callable[..., Any], args: tuple, out: str) -> None:
    code = 0
    try:
        # One intra-op thread: a child forked after the parent's OpenMP pool ran would hang
        # in its first parallel op (the whole suite runs in one process before this).
        torch.set_num_threads(1)
        warnings.simplefilter("ignore")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        with open(f"{out}.{rank}", "w") as f:
            f.write(result if isinstance(result, str) else repr(result))
    except BaseException:  # noqa: BLE001 - reported to the parent
        with open(f"{out}.{rank}", "w") as f:
            f.write("ERROR\n" + traceback.format_exc())
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    os._exit(code)


def run_ranks(tmp: str, fn: Callable[..., Any], *args: Any, world: int = 2, timeout: float = 120) -> list[str]:
    """Run ``fn(rank, world, *args)`` in ``world`` forked processes joined by a gloo group;
    returns what each rank returned (repr) or its traceback (starting with ERROR), or
    ``exit N`` for a rank that left without a word."""
    ctx = mp.get_context("fork")
    n = len(os.listdir(tmp))
    store, out = os.path.join(tmp, f"store-{n}"), os.path.join(tmp, f"out-{n}")
    procs = [ctx.Process(target=_child, args=(r, world, store, fn, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = []
    for r, p in enumerate(procs):
        p.join(timeout)
        if p.is_alive():
            p.kill()
            results.append("hung")
            continue
        try:
            with open(f"{out}.{r}") as f:
                results.append(f.read())
        except FileNotFoundError:
            results.append(f"exit {p.exitcode}")
    return results


def _ok(results: list[str]) -> None:
    assert not any(r.startswith(("ERROR", "hung", "exit")) for r in results), "\n".join(results)


def _uploads(boto, bucket: str) -> list:  # noqa: ANN001
    return boto.list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def _object(boto, bucket: str, key: str) -> bytes:  # noqa: ANN001
    return boto.get_object(Bucket=bucket, Key=key)["Body"].read()


# --------------------------------------------------------------------------- scenarios (every rank)


def sc_round_trip(rank: int, world: int, base: str) -> Any:
    wg = dist.group.WORLD
    fastpersist.save(state(), f"{base}/ckpt.pt", group=wg, config=cfg())
    fastpersist.save(tensors(), f"{base}/m.safetensors", group=wg, config=cfg())
    fastpersist.save(small(), f"{base}/small.pt", group=wg, config=cfg())  # one part: rank 1 uploads none
    fut = fastpersist.save_async(state(1), f"{base}/async.pt", group=wg, config=cfg())
    fut.wait(60)
    assert_same_object(fastpersist.load(f"{base}/ckpt.pt", group=wg, config=cfg(), weights_only=True), state())
    assert_same_object(fastpersist.load(f"{base}/async.pt", group=wg, config=cfg()), state(1))
    got = fastpersist.load(f"{base}/m.safetensors", group=wg, config=cfg())
    assert_same_object(dict(sorted(got.items())), dict(sorted(tensors().items())))
    return "ok"


def sc_failures(rank: int, world: int, url: str) -> Any:
    """The previous checkpoint, then failing saves: the store refuses part 3 (rank 1's),
    and replicas that differ. Every rank reports what it raised."""
    wg = dist.group.WORLD
    fastpersist.save(state(), url, group=wg, config=cfg())
    out = []
    try:
        fastpersist.save(state(5), url, group=wg, config=cfg())
        out.append("no error")
    except DistributedCheckpointError as e:
        out.append(f"{type(e).__name__}: failures={sorted(e.failures)} {e}")
    dist.barrier()
    s = state(5)
    if rank == 1:
        s["model"]["i"][7] = -1
    try:
        fastpersist.save(s, url, group=wg, config=cfg())
        out.append("no error")
    except DistributedCheckpointError as e:
        out.append(f"{type(e).__name__}: {e}")
    return out


def sc_async_fault(rank: int, world: int, url: str) -> Any:
    """The background upload of a collective save_async fails on rank 1: both futures raise."""
    from fastpersist import s3collective

    if rank == 1:
        real = s3collective.GroupUpload.send_staged

        def failing(self: Any) -> None:
            raise OSError(5, "injected failure in rank 1's upload")

        s3collective.GroupUpload.send_staged = failing  # type: ignore[method-assign]
    fut = fastpersist.save_async(state(6), url, group=dist.group.WORLD, config=cfg())
    try:
        fut.wait(60)
    except DistributedCheckpointError as e:
        return f"{type(e).__name__}: failures={sorted(e.failures)}"
    finally:
        if rank == 1:
            s3collective.GroupUpload.send_staged = real  # type: ignore[method-assign]
    return "no error"


def sc_rank_dies(rank: int, world: int, url: str) -> Any:
    """Rank 1 is killed while uploading its parts: rank 0 names it and aborts the upload."""
    from fastpersist import s3collective

    if rank == 1:
        real = s3collective._stage_part

        def dying(plan: Any, crcs: Any, index: int, psize: int, handle: Any) -> Any:
            if index == 2:
                os._exit(17)  # SIGKILL-like: no cleanup, part 2 possibly in flight
            return real(plan, crcs, index, psize, handle)

        s3collective._stage_part = dying
    try:
        fastpersist.save(state(7), url, group=dist.group.WORLD, config=cfg().replace(dist_timeout=10.0))
    except DistributedTimeoutError as e:
        return f"{type(e).__name__}: missing={e.missing}"
    return "no error"


# --------------------------------------------------------------------------- tests


def test_collective_save_load_round_trip_and_bytes(boto, bucket, tmp_path):  # noqa: ANN001
    """One object from two ranks' parts: the bytes of a local save (torch and safetensors),
    three parts (one object of one part: rank 1 has none); save_async(group=) too;
    load(group=) gives the saved values on every rank."""
    _ok(run_ranks(str(tmp_path), sc_round_trip, f"s3://{bucket}/run"))
    saved = (("ckpt.pt", state()), ("m.safetensors", tensors()), ("async.pt", state(1)), ("small.pt", small()))
    for name, obj in saved:
        local = tmp_path / name
        fastpersist.save(obj, local, config=cfg())
        assert _object(boto, bucket, f"run/{name}") == local.read_bytes(), name
    assert boto.head_object(Bucket=bucket, Key="run/ckpt.pt")["ETag"].strip('"').endswith("-3")
    assert_same_object(torch.load(io.BytesIO(_object(boto, bucket, "run/ckpt.pt")), weights_only=True), state())
    assert _uploads(boto, bucket) == []


def test_failures_abort_the_upload_and_keep_the_previous_object(boto, bucket, tmp_path, faulty):  # noqa: ANN001
    """A part refused by the store, replicas that differ, a failed background upload and a
    rank killed mid-upload: every rank raises, no partial object, no multipart upload left,
    the previous object loads with its values."""
    url = f"s3://{bucket}/ckpt.pt"
    faulty.arm(Fault("403", method="PUT", query="partNumber=3", nth=2, count=0))  # not the previous save's
    results = run_ranks(str(tmp_path), sc_failures, url)
    _ok(results)
    refused, differ = zip(*(eval(r) for r in results))  # noqa: S307 - the ranks' own repr
    assert all(r.startswith("DistributedCheckpointError: failures=[1]") for r in refused), refused
    assert all("AccessDenied" in r for r in refused), refused
    assert any(m == "DELETE" and "uploadId=" in t for m, t in faulty.requests)  # AbortMultipartUpload
    assert all(r.startswith("ReplicasDifferError") and "['model']['i']" in r for r in differ), differ
    faulty.clear()
    before = _object(boto, bucket, "ckpt.pt")

    results = run_ranks(str(tmp_path), sc_async_fault, url)
    assert all(r.startswith("DistributedCheckpointError: failures=[1]") for r in results), results

    results = run_ranks(str(tmp_path), sc_rank_dies, url)
    assert results[0].startswith("DistributedTimeoutError: missing=[1]"), results
    assert results[1] == "exit 17", results

    assert _object(boto, bucket, "ckpt.pt") == before
    assert_same_object(fastpersist.load(url), state())
    assert [o["Key"] for o in boto.list_objects_v2(Bucket=bucket).get("Contents", [])] == ["ckpt.pt"]
    assert _uploads(boto, bucket) == []
