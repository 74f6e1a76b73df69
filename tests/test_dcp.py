"""fastpersist.dcp: the torch.distributed.checkpoint storage layer.

Multi-rank tests run ranks as forked processes on gloo (CPU), with DTensor
sharded state on a CPU device mesh; resharding (2 ranks -> 1 and 4) is DCP's.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import traceback
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import fastpersist
from fastpersist import _compat, _native
from fastpersist.dcp import FastPersistReader, FastPersistWriter
from fastpersist.errors import ChecksumError

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

ROWS, COLS = 8, 6


def full_w() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def full_b() -> torch.Tensor:
    return (torch.arange(ROWS * 4, dtype=torch.float32) / 7).to(torch.bfloat16).reshape(ROWS, 4)


def expected_full() -> dict[str, Any]:
    """What a 1-rank load of the 2-rank checkpoint returns."""
    return {
        "w": full_w(),
        "b": full_b(),
        "rep": torch.ones(5, dtype=torch.float64) * 3,
        "step": 7,
        "rank0_only": torch.full((3,), 10.0),
        "rank1_only": torch.full((3,), 11.0),
    }


# --------------------------------------------------------------------------- multi-process harness


def _child(rank: int, world: int, store: str, fn: Callable[..., None], args: tuple, errfile: str) -> None:
    code = 0
    try:
        warnings.simplefilter("ignore")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent
        with open(f"{errfile}.{rank}", "w") as f:
            f.write(traceback.format_exc())
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    os._exit(code)


def run_ranks(tmp: str, world: int, fn: Callable[..., None], *args: Any, timeout: float = 60) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` forked processes joined by a gloo group."""
    ctx = mp.get_context("fork")
    store = os.path.join(tmp, f"store-{os.getpid()}-{len(os.listdir(tmp))}")
    errfile = os.path.join(tmp, "rank-error")
    procs = [ctx.Process(target=_child, args=(r, world, store, fn, args, errfile)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    errors = []
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            errors.append(f"rank {r} hung")
        elif p.exitcode:
            try:
                with open(f"{errfile}.{r}") as f:
                    errors.append(f"rank {r}:\n{f.read()}")
            except FileNotFoundError:
                errors.append(f"rank {r} exited with {p.exitcode}")
    assert not errors, "\n".join(errors)


def _mesh(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def sharded_state(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(world)
    return {
        "w": distribute_tensor(full_w(), mesh, [Shard(0)]),
        "b": distribute_tensor(full_b(), mesh, [Shard(0)]),
        "rep": torch.ones(5, dtype=torch.float64) * 3,
        "step": 7,
        f"rank{rank}_only": torch.full((3,), 10.0 + rank),
    }


def _save_2(rank: int, world: int, path: str, bad: str) -> None:
    dcp.save(sharded_state(rank, world), storage_writer=FastPersistWriter(path, thread_count=2))
    # A write fault on rank 1 only: every rank raises, and no .metadata appears.
    if rank == 1:
        _native.set_fault("write", 1, "EIO")
    try:
        dcp.save(sharded_state(rank, world), storage_writer=FastPersistWriter(bad))
    except CheckpointException:  # every rank: DCP gathers the failure (a BaseException)
        pass
    else:
        raise AssertionError(f"rank {rank}: the save with a fault on rank 1 did not raise")
    finally:
        _native.clear_faults()


def _load_4(rank: int, world: int, path: str) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(world)
    state = {
        "w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(1)]),  # other dim: a real reshard
        "b": distribute_tensor(torch.zeros(ROWS, 4, dtype=torch.bfloat16), mesh, [Shard(0)]),
        "rep": torch.zeros(5, dtype=torch.float64),
        "step": 0,
    }
    dcp.load(state, storage_reader=FastPersistReader(path))
    assert torch.equal(state["w"].full_tensor(), full_w())
    assert torch.equal(state["b"].full_tensor(), full_b())
    assert torch.equal(state["rep"], torch.ones(5, dtype=torch.float64) * 3)
    assert state["step"] == 7


def _async_2(rank: int, world: int, path: str) -> None:
    state = sharded_state(rank, world)
    fut = dcp.async_save(state, storage_writer=FastPersistWriter(path))
    result = fut.result() if hasattr(fut, "result") else fut.upload_completion.result()
    del result
    fresh = sharded_state(rank, world)
    fresh["w"] = fresh["w"] * 0
    dcp.load(fresh, storage_reader=FastPersistReader(path))
    assert torch.equal(fresh["w"].full_tensor(), full_w())


@pytest.fixture(scope="module")
def two_rank_ckpt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tmp = str(tmp_path_factory.mktemp("dcp2"))
    path, bad = os.path.join(tmp, "ckpt"), os.path.join(tmp, "bad")
    run_ranks(tmp, 2, _save_2, path, bad)
    return {"tmp": tmp, "path": path, "bad": bad}


def empty_like_full() -> dict[str, Any]:
    return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in expected_full().items()}


def assert_equal_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


# --------------------------------------------------------------------------- multi-rank


def test_two_ranks_save_reload_one_rank(two_rank_ckpt: dict[str, str]) -> None:
    path = two_rank_ckpt["path"]
    names = sorted(os.listdir(path))
    assert ".metadata" in names and "__0_0.distcp" in names and "__1_0.distcp" in names
    assert not [n for n in names if ".fp-tmp-" in n]
    state = empty_like_full()
    dcp.load(state, storage_reader=FastPersistReader(path), no_dist=True)
    assert_equal_state(state, expected_full())


def test_two_ranks_reload_four_ranks(two_rank_ckpt: dict[str, str]) -> None:
    run_ranks(two_rank_ckpt["tmp"], 4, _load_4, two_rank_ckpt["path"])


def test_fault_on_one_rank_leaves_no_metadata(two_rank_ckpt: dict[str, str]) -> None:
    bad = two_rank_ckpt["bad"]
    names = os.listdir(bad) if os.path.isdir(bad) else []
    assert ".metadata" not in names
    assert not [n for n in names if ".fp-tmp-" in n], names
    assert not fastpersist.verify(bad).ok if os.path.isdir(bad) else True


def test_verify_two_rank_checkpoint(two_rank_ckpt: dict[str, str]) -> None:
    res = fastpersist.verify(two_rank_ckpt["path"])
    assert res.ok and res.status == "ok" and res.format == "dcp", res
    assert res.records == 8 and res.bytes > 0  # w, b: 2 chunks each; rep, step, 2 rank-only


def test_items_aligned_and_crcs_match(two_rank_ckpt: dict[str, str]) -> None:
    import zlib

    path = two_rank_ckpt["path"]
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    for index, info in md.storage_data.items():
        with open(os.path.join(path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        assert zlib.crc32(raw) == _compat.dcp_storage_crc(info), index
        if index.offset is not None and raw[:4] == b"PK\x03\x04":  # a tensor item: its storage is aligned
            name_len, extra_len = int.from_bytes(raw[26:28], "little"), int.from_bytes(raw[28:30], "little")
            assert (info.offset + 30 + name_len + extra_len) % 4096 == 0, index


STOCK_LOAD = textwrap.dedent(
    """
    import pickle, sys, warnings
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed.checkpoint as dcp
    path, want_file = sys.argv[1], sys.argv[2]
    with open(want_file, "rb") as f:
        want = pickle.load(f)
    state = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in want.items()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    for k, v in want.items():
        same = torch.equal(state[k], v) if isinstance(v, torch.Tensor) else state[k] == v
        assert same, k
    assert not [m for m in sys.modules if m.startswith("fastpersist")], "fastpersist was imported"
    print("STOCK-OK")
    """
)


def test_stock_reader_without_fastpersist(two_rank_ckpt: dict[str, str], tmp_path: Any) -> None:
    want_file = tmp_path / "want.pkl"
    with open(want_file, "wb") as f:
        pickle.dump(expected_full(), f)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTPERSIST_")}
    env["PYTHONNOUSERSITE"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", STOCK_LOAD, two_rank_ckpt["path"], str(want_file)],
        capture_output=True, text=True, timeout=120, env=env, cwd=str(tmp_path),
    )
    assert out.returncode == 0 and "STOCK-OK" in out.stdout, out.stderr[-3000:]


def test_async_save_two_ranks(tmp_path: Any) -> None:
    path = str(tmp_path / "async")
    run_ranks(str(tmp_path), 2, _async_2, path)
    assert fastpersist.verify(path).ok


# --------------------------------------------------------------------------- one process


def local_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(33, 17, generator=g),
        "i": torch.arange(5000, dtype=torch.int64),
        "h": torch.randn(4, 4, generator=g).to(torch.float16),
        "flag": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5),
        "view": torch.arange(100.0)[10:30],  # a view: saved with its own minimal storage, as stock does
        "meta": {"lr": 0.1, "name": "run", "steps": [1, 2, 3]},
    }


def zeros_of(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        elif isinstance(v, dict):
            out[k] = {kk: None for kk in v}
        else:
            out[k] = None
    return out


def check_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


@pytest.mark.parametrize("kwargs", [{}, {"thread_count": 3}, {"single_file_per_rank": False}, {"sync_files": False}])
def test_round_trip_one_process(tmp_path: Any, kwargs: dict) -> None:
    state = local_state()
    dcp.save(state, storage_writer=FastPersistWriter(tmp_path / "c", **kwargs), no_dist=True)
    for reader in (FastPersistReader(tmp_path / "c"), dcp.FileSystemReader(tmp_path / "c")):
        got = zeros_of(state)
        dcp.load(got, storage_reader=reader, no_dist=True)
        check_same(got, state)
    assert fastpersist.verify(tmp_path / "c").ok


def test_reader_loads_stock_checkpoint(tmp_path: Any) -> None:
    state = local_state()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "s", thread_count=2), no_dist=True)
    got = zeros_of(state)
    dcp.load(got, storage_reader=FastPersistReader(tmp_path / "s"), no_dist=True)
    check_same(got, state)
    res = fastpersist.verify(tmp_path / "s")
    assert res.status == "unchecked" and not res.ok and res.bytes == 0


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_corrupt_byte_raises_checksum_error(tmp_path: Any) -> None:
    state = local_state()
    path = tmp_path / "c"
    dcp.save(state, storage_writer=FastPersistWriter(path), no_dist=True)
    md = FastPersistReader(path).read_metadata()
    (index, info), = [(k, v) for k, v in md.storage_data.items() if k.fqn == "i"]
    _flip(os.path.join(path, info.relative_path), info.offset + info.length // 2)
    res = fastpersist.verify(path)
    assert res.status == "corrupt" and not res.ok
    assert any("i@" in p for p in res.problems), res.problems
    with pytest.raises((Exception, CheckpointException)) as exc:
        dcp.load(zeros_of(state), storage_reader=FastPersistReader(path), no_dist=True)
    err: BaseException = exc.value
    if not isinstance(err, ChecksumError):  # DCP wraps rank failures in CheckpointException
        failures = getattr(err, "failures", {})
        err = next(iter(failures.values()))
        err = err[0] if isinstance(err, tuple) else err  # (exception, traceback)
    assert isinstance(err, ChecksumError), repr(exc.value)
    assert "i@" in str(err) and info.relative_path in str(err)


def test_write_fault_leaves_no_metadata(tmp_path: Any) -> None:
    path = tmp_path / "f"
    _native.set_fault("write", 1, "EIO")
    with pytest.raises((Exception, CheckpointException)) as exc:
        dcp.save(local_state(), storage_writer=FastPersistWriter(path), no_dist=True)
    _native.clear_faults()
    assert "Input/output error" in str(exc.value) or "EIO" in repr(exc.value) or "errno 5" in str(exc.value).lower()
    names = os.listdir(path)
    assert ".metadata" not in names and not [n for n in names if ".fp-tmp-" in n], names


def test_overwrite_replaces_checkpoint(tmp_path: Any) -> None:
    path = tmp_path / "o"
    old = local_state()
    dcp.save(old, storage_writer=FastPersistWriter(path), no_dist=True)
    new = {k: (v + 1 if isinstance(v, torch.Tensor) and v.dtype != torch.bool else v) for k, v in old.items()}
    dcp.save(new, storage_writer=FastPersistWriter(path), no_dist=True)
    got = zeros_of(new)
    dcp.load(got, storage_reader=FastPersistReader(path), no_dist=True)
    check_same(got, new)
    with pytest.raises((Exception, CheckpointException), match="already exists"):
        dcp.save(new, storage_writer=FastPersistWriter(path, overwrite=False), no_dist=True)
    # A failed overwrite leaves no .metadata: no stale index over new bytes.
    _native.set_fault("write", 1, "EIO")
    with pytest.raises((Exception, CheckpointException)):
        dcp.save(old, storage_writer=FastPersistWriter(path), no_dist=True)
    _native.clear_faults()
    assert ".metadata" not in os.listdir(path)


def test_verify_rejects_non_checkpoint_dirs(tmp_path: Any) -> None:
    (tmp_path / "empty").mkdir()
    assert fastpersist.verify(tmp_path / "empty").status == "corrupt"
    bad = tmp_path / "evil"
    bad.mkdir()
    with open(bad / ".metadata", "wb") as f:
        pickle.dump(shutil.rmtree, f)  # a pickle that names a function: refused, never called
    res = fastpersist.verify(bad)
    assert res.status == "corrupt" and "not DCP checkpoint metadata" in res.problems[0]


def test_compat_probe_ok() -> None:
    assert _compat.ok("dcp_storage_layer"), _compat.status("dcp_storage_layer").reason
