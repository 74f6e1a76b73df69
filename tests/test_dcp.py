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
from subprocs import flip_byte  # tests/ is on sys.path

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


def test_corrupt_byte_raises_checksum_error(tmp_path: Any) -> None:
    state = local_state()
    path = tmp_path / "c"
    dcp.save(state, storage_writer=FastPersistWriter(path), no_dist=True)
    md = FastPersistReader(path).read_metadata()
    (index, info), = [(k, v) for k, v in md.storage_data.items() if k.fqn == "i"]
    flip_byte(os.path.join(path, info.relative_path), info.offset + info.length // 2)
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


# --------------------------------------------------------------------------- overwriting a checkpoint

FOREIGN = ("notes.txt", "__0_0.distcp.bak", "model.distcp", "__x_0.distcp")


def flat_state(v: float, n: int = 3000) -> dict[str, Any]:
    """A state DCP does not flatten (tensors and an int), so that stock loads compare it key by key."""
    return {
        "a": torch.full((n,), v, dtype=torch.float32),
        "i": torch.arange(n, dtype=torch.int64) + int(v),
        "h": torch.full((7, 5), v, dtype=torch.float16),
        "step": int(v),
    }


def load_flat(path: Any, reader: Any) -> dict[str, Any]:
    got = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in flat_state(0).items()}
    dcp.load(got, storage_reader=reader(path), no_dist=True)
    return got


def stock_load_in_fresh_process(path: Any, want: dict[str, Any], tmp: Any) -> None:
    """DCP's FileSystemReader, in a process that never imports fastpersist, loads ``want``."""
    want_file = os.path.join(str(tmp), f"want-{len(os.listdir(str(tmp)))}.pkl")
    with open(want_file, "wb") as f:
        pickle.dump(want, f)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTPERSIST_")}
    env["PYTHONNOUSERSITE"] = "1"
    out = subprocess.run([sys.executable, "-c", STOCK_LOAD, str(path), want_file], capture_output=True, text=True,
                         timeout=120, env=env, cwd=str(tmp))
    assert out.returncode == 0 and "STOCK-OK" in out.stdout, out.stderr[-3000:]


def assert_loads(path: Any, want: dict[str, Any]) -> None:
    """``want`` loads exactly with FastPersistReader and stock FileSystemReader, and verifies."""
    for reader in (FastPersistReader, dcp.FileSystemReader):
        assert_equal_state(load_flat(path, reader), want)
    res = fastpersist.verify(path)
    assert res.ok and res.status == "ok", res


def referenced(path: Any, metadata: str = ".metadata") -> set[str]:
    with open(os.path.join(path, metadata), "rb") as f:
        md = pickle.load(f)
    return {info.relative_path for info in md.storage_data.values()}


def metadata_name(use_collectives: bool) -> str:
    return ".metadata" if use_collectives else "__0.metadata"


def save_flat(state: dict[str, Any], path: Any, use_collectives: bool = True, **kw: Any) -> None:
    dcp.save(state, storage_writer=FastPersistWriter(path, **kw), no_dist=True, use_collectives=use_collectives)


def load_rank_local(path: Any, reader: Any) -> dict[str, Any]:
    """DCP's load reads ``__RANK.metadata`` when the directory has no ``.metadata``."""
    assert not os.path.exists(os.path.join(path, ".metadata"))
    return load_flat(path, reader)


class _FailingPlanner(dcp.DefaultSavePlanner):
    """Raises from ``resolve_data`` at the ``nth`` item: an exception in the middle of write_data."""

    def __init__(self, nth: int) -> None:
        super().__init__()
        self.nth, self.calls = nth, 0

    def resolve_data(self, write_item: Any) -> Any:
        self.calls += 1
        if self.calls == self.nth:
            raise RuntimeError("planner failed mid-write")
        return super().resolve_data(write_item)


@pytest.mark.parametrize("use_collectives", [True, False])
def test_failed_overwrite_keeps_previous_checkpoint(tmp_path: Any, monkeypatch: Any, use_collectives: bool) -> None:
    """A save into a directory holding checkpoint A that fails at any step before its
    .metadata is published leaves A loadable, exactly, by both readers."""
    path = tmp_path / "latest"
    A = flat_state(1.0)
    save_flat(A, path, use_collectives)
    md = metadata_name(use_collectives)
    files_a = referenced(path, md)
    before = {n: (path / n).read_bytes() for n in files_a | {md}}

    def check_a() -> None:
        for reader in (FastPersistReader, dcp.FileSystemReader):
            got = load_flat(path, reader) if use_collectives else load_rank_local(path, reader)
            assert_equal_state(got, A)
        assert {n: (path / n).read_bytes() for n in files_a | {md}} == before  # not a byte of A touched
        if use_collectives:
            res = fastpersist.verify(path)
            assert res.ok and res.status == "ok", res  # leftovers of the failed saves: not read, not a problem
        assert not [n for n in os.listdir(path) if ".fp-tmp-" in n or n.endswith(".tmp")], os.listdir(path)

    # 1. an I/O error (EIO) on the first data write
    _native.set_fault("write", 1, "EIO")
    try:
        with pytest.raises((Exception, CheckpointException)):
            save_flat(flat_state(2.0), path, use_collectives)
    finally:
        _native.clear_faults()
    check_a()
    # 2. a full disk on a later write of a many-file save
    _native.set_fault("write", 3, "ENOSPC")
    try:
        with pytest.raises((Exception, CheckpointException)):
            save_flat(flat_state(3.0), path, use_collectives, single_file_per_rank=False)
    finally:
        _native.clear_faults()
    check_a()
    # 3. an exception from the planner in the middle of write_data
    with pytest.raises((Exception, CheckpointException), match="planner failed mid-write"):
        dcp.save(flat_state(4.0), storage_writer=FastPersistWriter(path, single_file_per_rank=False),
                 planner=_FailingPlanner(3), no_dist=True, use_collectives=use_collectives)
    check_a()
    # 4. after every data file is written and durable: publishing .metadata fails
    real_replace = os.replace

    def no_space(src: Any, dst: Any, *a: Any, **k: Any) -> None:
        if os.path.basename(os.fspath(dst)) == md:
            raise OSError(28, "No space left on device (injected)", os.fspath(dst))
        real_replace(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", no_space)
    with pytest.raises((Exception, CheckpointException), match="No space left"):
        save_flat(flat_state(5.0), path, use_collectives)
    monkeypatch.setattr(os, "replace", real_replace)
    check_a()
    if use_collectives:
        stock_load_in_fresh_process(path, A, tmp_path)

    # the next save that succeeds replaces A and removes A's files and every failed save's leftovers
    C = flat_state(6.0)
    save_flat(C, path, use_collectives)
    got = load_flat(path, FastPersistReader) if use_collectives else load_rank_local(path, FastPersistReader)
    assert_equal_state(got, C)
    assert sorted(os.listdir(path)) == sorted(referenced(path, md) | {md})


@pytest.mark.parametrize("use_collectives", [True, False])
def test_overwrite_leaves_only_the_new_files(tmp_path: Any, use_collectives: bool) -> None:
    path = tmp_path / "o"
    md = metadata_name(use_collectives)
    save_flat(flat_state(1.0), path, use_collectives, thread_count=2)
    first = referenced(path, md)
    assert first == {"__0_0.distcp", "__0_1.distcp"}  # a fresh directory: stock's names
    for name in FOREIGN:
        (path / name).write_bytes(b"not ours")
    (path / "__0_fp0123456789ab_0.distcp").write_bytes(b"left by a save that died")  # our shape: garbage
    (path / "__3_fp0123456789ab_1.distcp").write_bytes(b"left by a rank that died")
    for v, kw in ((2.0, {}), (3.0, {"single_file_per_rank": False}), (4.0, {"thread_count": 3})):
        want = flat_state(v)
        save_flat(want, path, use_collectives, **kw)
        got = load_flat(path, FastPersistReader) if use_collectives else load_rank_local(path, FastPersistReader)
        assert_equal_state(got, want)
        files = referenced(path, md)
        tokens = {n.split("_")[3] for n in files}
        assert len(tokens) == 1 and all(n.startswith("__0_fp") for n in files), files  # one token per save
        left = set(os.listdir(path)) - set(FOREIGN) - {md}
        if not use_collectives:
            left -= {"__3_fp0123456789ab_1.distcp"}  # another rank's file: a rank-local save keeps it
        assert left == files, (left, files)
        for name in FOREIGN:
            assert (path / name).read_bytes() == b"not ours"
        assert files.isdisjoint(first)
        first = files
    if use_collectives:
        assert fastpersist.verify(path).ok
    with pytest.raises((Exception, CheckpointException), match="already exists"):
        save_flat(flat_state(9.0), path, use_collectives, overwrite=False)
    assert_equal_state(load_flat(path, FastPersistReader) if use_collectives
                       else load_rank_local(path, FastPersistReader), flat_state(4.0))


def test_overwrite_keeps_files_of_rank_local_checkpoint(tmp_path: Any) -> None:
    """A collective save's garbage collection keeps files that a rank-local ``__N.metadata``
    in the same directory references."""
    path = tmp_path / "mixed"
    save_flat(flat_state(1.0), path, use_collectives=False)
    local_files = referenced(path, "__0.metadata")
    before = {n: (path / n).read_bytes() for n in local_files | {"__0.metadata"}}
    save_flat(flat_state(2.0), path)
    save_flat(flat_state(3.0), path)
    assert_equal_state(load_flat(path, FastPersistReader), flat_state(3.0))
    assert {n: (path / n).read_bytes() for n in local_files | {"__0.metadata"}} == before
    os.unlink(path / ".metadata")  # DCP's load reads __0.metadata only where there is no .metadata
    assert_equal_state(load_rank_local(path, FastPersistReader), flat_state(1.0))


def test_async_save_overwrite(tmp_path: Any) -> None:
    path = tmp_path / "async"
    A = flat_state(1.0)
    save_flat(A, path)
    _native.set_fault("write", 1, "EIO")
    try:
        fut = dcp.async_save(flat_state(2.0), storage_writer=FastPersistWriter(path), no_dist=True)
        with pytest.raises((Exception, CheckpointException)):
            fut.result() if hasattr(fut, "result") else fut.upload_completion.result()
    finally:
        _native.clear_faults()
    assert_loads(path, A)
    C = flat_state(3.0)
    fut = dcp.async_save(C, storage_writer=FastPersistWriter(path), no_dist=True)
    fut.result() if hasattr(fut, "result") else fut.upload_completion.result()
    assert_loads(path, C)
    assert sorted(os.listdir(path)) == sorted(referenced(path) | {".metadata"})


_KILLED_SAVE = textwrap.dedent(
    """
    import os, sys, time, warnings
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed.checkpoint as dcp
    from fastpersist.dcp import FastPersistWriter

    path, where = sys.argv[1], sys.argv[2]

    class Stuck(FastPersistWriter):
        def finish(self, metadata, results):  # every data file is durable: wait to be killed
            print("written", flush=True)
            time.sleep(600)

    state = {f"t{k}": torch.full((16 << 20,), float(k + 100)) for k in range(4)}  # 256 MiB
    state["step"] = 99
    print("ready", flush=True)
    writer = (Stuck if where == "finish" else FastPersistWriter)(path, thread_count=2)
    dcp.save(state, storage_writer=writer, no_dist=True)
    print("saved", flush=True)
    """
)


def _kill_save(path: Any, where: str) -> list[str]:
    """Run a 256 MiB DCP save into ``path`` in a child and SIGKILL it mid-write (``where="write"``:
    once a temporary data file holds 8 MiB) or after its data is durable, before .metadata
    (``"finish"``). Returns the files it left."""
    import signal
    import time

    before = set(os.listdir(path))
    child = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, str(path), where], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        if where == "finish":
            assert child.stdout.readline().strip() == "written"
        else:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                tmps = [n for n in os.listdir(path) if ".fp-tmp-" in n]
                try:
                    if any(os.path.getsize(os.path.join(path, n)) > (8 << 20) for n in tmps):
                        break
                except FileNotFoundError:
                    pass
                assert child.poll() is None, "the save finished before it could be killed"
                time.sleep(0.0005)
            else:
                raise AssertionError("no temporary data file seen in time")
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return sorted(set(os.listdir(path)) - before)


@pytest.mark.slow
def test_sigkill_during_overwrite_keeps_previous(tmp_path: Any) -> None:
    path = tmp_path / "latest"
    A = flat_state(1.0)
    save_flat(A, path)
    files_a = referenced(path)
    left_write = _kill_save(path, "write")
    assert left_write and all(".fp-tmp-" in n for n in left_write), left_write
    assert_loads(path, A)
    left_finish = _kill_save(path, "finish")
    assert left_finish and all(n.startswith("__0_fp") and n.endswith(".distcp") for n in left_finish), left_finish
    assert_loads(path, A)  # its data is complete and durable, but no .metadata names it
    stock_load_in_fresh_process(path, A, tmp_path)
    C = flat_state(3.0)
    save_flat(C, path)
    assert_loads(path, C)
    names = set(os.listdir(path))
    assert names == referenced(path) | {".metadata"}, names
    assert not names & (files_a | set(left_write) | set(left_finish))


# --------------------------------------------------------------------------- two ranks, overwrite


def _overwrite_fault_2(rank: int, world: int, path: str) -> None:
    state = sharded_state(rank, world)
    dcp.save(state, storage_writer=FastPersistWriter(path))
    if rank == 1:
        _native.set_fault("write", 1, "EIO")
    try:
        bad = sharded_state(rank, world)
        bad["w"] = bad["w"] * 0 - 1
        bad["step"] = 8
        dcp.save(bad, storage_writer=FastPersistWriter(path))
    except CheckpointException:
        pass
    else:
        raise AssertionError(f"rank {rank}: the overwrite with a fault on rank 1 did not raise")
    finally:
        _native.clear_faults()
    fresh = sharded_state(rank, world)
    fresh["w"] = fresh["w"] * 0
    fresh["step"] = 0
    dcp.load(fresh, storage_reader=FastPersistReader(path))
    assert torch.equal(fresh["w"].full_tensor(), full_w()) and fresh["step"] == 7


def _overwrite_ok_2(rank: int, world: int, path: str) -> None:
    state = sharded_state(rank, world)
    state["step"] = 9
    dcp.save(state, storage_writer=FastPersistWriter(path))


def test_two_ranks_fault_during_overwrite_keeps_previous(tmp_path: Any) -> None:
    path = str(tmp_path / "latest")
    run_ranks(str(tmp_path), 2, _overwrite_fault_2, path)
    files_a = referenced(path)
    assert files_a == {"__0_0.distcp", "__1_0.distcp"}
    leftovers = set(os.listdir(path)) - files_a - {".metadata"}
    assert leftovers and all(n.startswith("__0_fp") for n in leftovers), leftovers  # rank 0's data of the failed save
    for reader in (FastPersistReader, dcp.FileSystemReader):
        state = empty_like_full()
        dcp.load(state, storage_reader=reader(path), no_dist=True)
        assert_equal_state(state, expected_full())
    assert fastpersist.verify(path).ok
    stock_load_in_fresh_process(path, expected_full(), tmp_path)
    run_ranks(str(tmp_path), 2, _overwrite_ok_2, path)
    state = empty_like_full()
    dcp.load(state, storage_reader=FastPersistReader(path), no_dist=True)
    assert_equal_state(state, {**expected_full(), "step": 9})
    files_c = referenced(path)
    assert set(os.listdir(path)) == files_c | {".metadata"}
    assert {n.split("_")[2] for n in files_c} == {"0", "1"} and len({n.split("_")[3] for n in files_c}) == 1


# --------------------------------------------------------------------------- fork


def test_handle_cache_lock_reset_after_fork() -> None:
    from fastpersist.dcp import _writer

    _writer._handles_lock.acquire()  # as if another thread held it at the fork
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                ok = _writer._handles_lock.acquire(timeout=5)
                code = 0 if ok and not _writer._handles else 2
            finally:
                os._exit(code)
    finally:
        _writer._handles_lock.release()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


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


def test_directory_fsync_failure_after_the_metadata_rename_says_the_checkpoint_is_in_place(tmp_path: Any,
                                                                                           monkeypatch: Any) -> None:
    """The new .metadata was renamed in (the commit), then the directory's fsync failed: the error
    is fastpersist's DirectorySyncError, which says the new checkpoint is in place, and it loads."""
    from fastpersist import commit
    from fastpersist.errors import DirectorySyncError

    path = str(tmp_path / "ckpt")
    save_flat(flat_state(1.0), path)

    def failing(directory: str) -> None:
        raise OSError(5, "Input/output error", directory)

    monkeypatch.setattr(commit, "fsync_dir", failing)  # only the fsync after the commit goes through it
    with pytest.raises((DirectorySyncError, CheckpointException)) as info:
        save_flat(flat_state(2.0), path, sync_files=True)
    monkeypatch.undo()
    assert "the new file is in place" in str(info.value) and "untouched" not in str(info.value), str(info.value)
    assert_loads(path, flat_state(2.0))
