"""Collective saves and loads (fastpersist.distributed) with real gloo process groups.

Each world size is launched once (torch.multiprocessing, spawn, CPU only) and its
ranks run a list of scenarios in order; every rank records each scenario's outcome
(value or exception) in a file the tests below read. Scenarios that break the group
(a rank killed) run last. Small states keep the whole file under a minute on 2 cores.
"""

from __future__ import annotations

import filecmp
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional

import pytest
import torch

import fastpersist
from fastpersist.formats import split

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()), reason="no gloo backend"
)

TIMEOUT = 5.0  # Config.dist_timeout of the scenarios


# --------------------------------------------------------------------------- states


def state(seed: int = 0, w_shape: tuple[int, int] = (300, 170), many: tuple[int, int] = (20, 17)) -> dict:
    """A small replicated state whose records straddle the slices of 2, 3 and 4 ranks (``w`` of
    ``w_shape``; ``many[0]`` tensors of ``many[1] * i + 1`` elements)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*w_shape, generator=g)
    return {
        "model": {"w": w, "w_t": w.t(), "row": w[7], "b": torch.randn(1000, generator=g).to(torch.bfloat16)},
        "many": [torch.randn(many[1] * i + 1, generator=g) for i in range(many[0])],
        "misc": {"mask": torch.rand(999, generator=g) > 0.5, "z": torch.zeros(()), "e": torch.empty(0, 3),
                 "c": torch.randn(33, dtype=torch.complex64, generator=g), "i": torch.arange(4097, dtype=torch.int16)},
        "step": 1234,
        "name": "run-1",
        "lr": [0.1, 0.01],
    }


def tensors(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(5 + 1000 * i, generator=g) for i in range(6)} | {
        "h": torch.randn(777, generator=g).half(), "i": torch.arange(5000, dtype=torch.int32)}


def by_name(d: dict) -> dict:
    return dict(sorted(d.items()))


def cfg() -> fastpersist.Config:
    return fastpersist.Config(dist_timeout=TIMEOUT, fsync=False)


def temps(d: str) -> list[str]:
    return sorted(n for n in os.listdir(d) if ".fp-tmp-" in n or n.startswith(".fastpersist-probe-"))


# --------------------------------------------------------------------------- scenarios (run on every rank)


def sc_identical(rank: int, world: int, d: str) -> Any:
    wg = torch.distributed.group.WORLD
    fastpersist.save(state(), os.path.join(d, f"group{world}.pt"), group=wg, config=cfg())
    fastpersist.save(tensors(), os.path.join(d, f"group{world}.safetensors"), group=wg, config=cfg())
    # overwrite an existing file: still one file, same bytes
    fastpersist.save(state(), os.path.join(d, f"group{world}.pt"), group=wg, config=cfg())
    return temps(d)


def sc_load(rank: int, world: int, d: str) -> Any:
    from conftest import assert_same_object

    from fastpersist.distributed import last_load_phases

    wg = torch.distributed.group.WORLD
    for mode in ("slices", "whole"):
        c = cfg().replace(dist_load=mode)
        got = fastpersist.load(os.path.join(d, "ref.pt"), group=wg, config=c, weights_only=True)
        assert_same_object(got, state())
        # where the load's time went, step by step (bench dist reports these)
        steps = [step for step, local, wait in last_load_phases() if local >= 0 and wait >= 0]
        assert steps == (["open", "exchange", "read", "load", "end"] if mode == "slices" else ["hosts", "load", "end"]), steps
        got = fastpersist.load(os.path.join(d, "ref.safetensors"), group=wg, config=c)
        assert_same_object(by_name(got), by_name(tensors()))
    # whole-file loads by ranks of one host go through the page cache (read once by the host)
    # under read_mode "auto"; an explicit read_mode is honoured (O_DIRECT leaves the cache cold)
    from fastpersist.io import cached_fraction

    path = os.path.join(d, "ref.pt")
    cached = {}
    for read_mode in ("auto", "direct"):
        torch.distributed.barrier()
        if rank == 0:
            with open(path, "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        torch.distributed.barrier()
        c = cfg().replace(dist_load="whole", read_mode=read_mode)
        assert_same_object(fastpersist.load(path, group=wg, config=c, weights_only=True), state())
        torch.distributed.barrier()
        fd = os.open(path, os.O_RDONLY)
        try:
            cached[read_mode] = cached_fraction(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
    assert cached["auto"] is None or cached["auto"] > 0.9, cached
    assert cached["direct"] is None or cached["direct"] < 0.5, cached
    return True


def sc_disagree_shape(rank: int, world: int, d: str) -> Any:
    obj = state()
    if rank == world - 1:
        obj["many"][3] = torch.randn(5)
    fastpersist.save(obj, os.path.join(d, "ref.pt"), group=torch.distributed.group.WORLD, config=cfg())


def sc_disagree_value(rank: int, world: int, d: str) -> Any:
    obj = state()
    if rank == 1:
        obj["step"] = 1235
    fastpersist.save(obj, os.path.join(d, "ref.pt"), group=torch.distributed.group.WORLD, config=cfg())


def sc_different_paths(rank: int, world: int, d: str) -> Any:
    """Issue 24 case 1: rank 0 saves ckpt.pt, the others other.pt, in one directory."""
    name = "ckpt.pt" if rank == 0 else "other.pt"
    fastpersist.save(state(), os.path.join(d, name), group=torch.distributed.group.WORLD, config=cfg())


def sc_different_paths_async(rank: int, world: int, d: str) -> Any:
    name = "ckpt_async.pt" if rank == 0 else "other_async.pt"
    fastpersist.save_async(state(), os.path.join(d, name), group=torch.distributed.group.WORLD, config=cfg()).wait()


def sc_different_paths_load(rank: int, world: int, d: str) -> Any:
    """Slices of different files are never assembled (each rank reading its own whole file,
    ``dist_load="whole"``, is node-local loading and allowed)."""
    name = "ref.pt" if rank == 0 else "ref.safetensors"
    fastpersist.load(os.path.join(d, name), group=torch.distributed.group.WORLD,
                     config=cfg().replace(dist_load="slices"), weights_only=True)


def differing(rank: int) -> dict:
    """Same layout on every rank, one tensor's values differ on rank 1 (issue 24 case 2)."""
    obj = state()
    if rank == 1:
        obj["model"]["b"][500:] = 4.0
    return obj


def sc_different_values(rank: int, world: int, d: str) -> Any:
    fastpersist.save(differing(rank), os.path.join(d, "group2.pt"), group=torch.distributed.group.WORLD,
                     config=cfg())


def sc_different_values_async(rank: int, world: int, d: str) -> Any:
    fastpersist.save_async(differing(rank), os.path.join(d, "group2.pt"), group=torch.distributed.group.WORLD,
                           config=cfg()).wait()


def sc_different_values_safetensors(rank: int, world: int, d: str) -> Any:
    obj = tensors()
    if rank == 1:
        obj["t3"][1:2] = 4.0
    fastpersist.save(obj, os.path.join(d, "group2.safetensors"), group=torch.distributed.group.WORLD, config=cfg())


def sc_fault(rank: int, world: int, d: str) -> Any:
    from fastpersist import _native

    if rank == 1:
        _native.set_fault("write", 1, "ENOSPC")
    try:
        fastpersist.save(state(1), os.path.join(d, "ref.pt"), group=torch.distributed.group.WORLD, config=cfg())
    finally:
        _native.clear_faults()


def sc_fault_after_write(rank: int, world: int, d: str) -> Any:
    """A non-committing rank fails after its slice is written (it has no fsync of its own to fail)."""
    from fastpersist import pipeline

    real = pipeline.naming_final

    def failing(final: str, write: Callable[[str], Any]) -> Callable[[str], Any]:
        def run(tmp: str) -> Any:
            real(final, write)(tmp)
            raise OSError(5, "injected after the write", tmp)

        return run

    if rank == 1:
        pipeline.naming_final = failing
    try:
        fastpersist.save(state(1), os.path.join(d, "ref.pt"), group=torch.distributed.group.WORLD, config=cfg())
    finally:
        pipeline.naming_final = real


def sc_fault_leader_fsync(rank: int, world: int, d: str) -> Any:
    """The committing rank's fsync (the one that covers every rank's writes) fails."""
    from fastpersist import commit

    real = commit.fsync_path

    def failing(path: str) -> None:
        raise OSError(5, "injected fsync failure", path)

    if rank == 0:
        commit.fsync_path = failing
    try:
        fastpersist.save(state(1), os.path.join(d, "ref.pt"), group=torch.distributed.group.WORLD,
                         config=cfg().replace(fsync=True))
    finally:
        commit.fsync_path = real


def sc_fault_dir_fsync(rank: int, world: int, d: str) -> Any:
    """The committing rank's directory fsync fails after its rename: every rank's error must say the
    new file is in place (not that the previous one is untouched)."""
    from fastpersist import commit

    p = os.path.join(d, "dirsync.pt")
    if rank == 0:
        fastpersist.save(state(), p, config=cfg())
    torch.distributed.barrier()
    real = commit.fsync_dir

    def failing(path: str) -> None:
        raise OSError(5, "injected directory fsync failure", path)

    if rank == 0:
        commit.fsync_dir = failing
    try:
        fastpersist.save(state(1), p, group=torch.distributed.group.WORLD, config=cfg().replace(fsync=True))
    finally:
        commit.fsync_dir = real


def sc_plan_error(rank: int, world: int, d: str) -> Any:
    obj = state()
    if rank == 0:
        obj["bad"] = lambda: 0  # not picklable
    fastpersist.save(obj, os.path.join(d, "ref.pt"), group=torch.distributed.group.WORLD, config=cfg())


def sc_async_then_blocking(rank: int, world: int, d: str) -> Any:
    """A collective save_async and then a collective blocking save to the same file: every rank's
    blocking save waits for its pending async save there, so the newer state is what stays."""
    from fastpersist import asyncsave

    real = asyncsave._finish
    real_before = asyncsave.before_blocking_save
    blocking_started = threading.Event()

    def before(final: str) -> None:
        blocking_started.set()
        real_before(final)

    def slow(job: Any) -> None:  # keep the async save pending until the blocking save has started
        assert blocking_started.wait(120)
        real(job)

    asyncsave._finish = slow
    asyncsave.before_blocking_save = before
    try:
        p = os.path.join(d, "order.pt")
        fut = fastpersist.save_async(state(5), p, group=torch.distributed.group.WORLD, config=cfg())
        fastpersist.save(state(6), p, group=torch.distributed.group.WORLD, config=cfg())
        waited = fut.done()
        fut.wait(60)
    finally:
        asyncsave._finish = real
        asyncsave.before_blocking_save = real_before
    torch.distributed.barrier()
    from conftest import assert_same_object

    assert_same_object(fastpersist.load(p, weights_only=True), state(6))
    return waited


def sc_uncollected_async_error(rank: int, world: int, d: str) -> Any:
    """Rank 1 holds an async save's error nobody collected: the next collective save fails on every
    rank at the plan step, naming rank 1, before anything is written."""
    from fastpersist import _native, asyncsave

    if rank == 1:
        _native.set_fault("write", 1, "EIO", 1000)
        fastpersist.save_async(state(7), os.path.join(d, f"alone-{rank}.pt"), config=cfg())
        assert asyncsave.wait_for_path(os.path.join(d, f"alone-{rank}.pt"), timeout=120)  # failed, not collected
        _native.clear_faults()
    fastpersist.save(state(8), os.path.join(d, "ref.pt"), group=torch.distributed.group.WORLD, config=cfg())


def sc_after_failures(rank: int, world: int, d: str) -> Any:
    """The group still works after the refused and failed saves, and nothing was left behind."""
    torch.distributed.barrier()
    left = temps(d)
    # Every rank lists before any rank starts the save below: its probe file would otherwise show up
    # in a slower rank's listing.
    torch.distributed.barrier()
    fastpersist.save(state(), os.path.join(d, "again.pt"), group=torch.distributed.group.WORLD, config=cfg())
    return left


def sc_nonshared(rank: int, world: int, d: str) -> Any:
    """Ranks 0..world/2-1 save into one directory, the others into another: two filesystems as far as
    the probe can tell; each half writes a complete copy."""
    sub = os.path.join(d, "nodeA" if rank < world // 2 else "nodeB")
    os.makedirs(sub, exist_ok=True)
    fastpersist.save(state(), os.path.join(sub, "copy.pt"), group=torch.distributed.group.WORLD, config=cfg())
    got = fastpersist.load(os.path.join(sub, "copy.pt"), group=torch.distributed.group.WORLD, config=cfg())
    from conftest import assert_same_object

    assert_same_object(got, state())
    return True


def sc_nonshared_rollback(rank: int, world: int, d: str) -> Any:
    """After ``nonshared``: the second node's leader fails its rename; the first node, whose rename
    succeeded, puts its previous file back, so both nodes keep the same (previous) checkpoint."""
    import errno

    sub = os.path.join(d, "nodeA" if rank < world // 2 else "nodeB")
    real = os.rename
    if rank == world // 2:  # the leader of nodeB's write group

        def failing(src: Any, dst: Any, *a: Any, **k: Any) -> Any:
            if ".fp-tmp-" in os.fspath(src) and os.fspath(dst).endswith("copy.pt"):
                raise OSError(errno.EIO, "injected rename failure", dst)
            return real(src, dst, *a, **k)

        os.rename = failing
    try:
        fastpersist.save(state(3), os.path.join(sub, "copy.pt"), group=torch.distributed.group.WORLD, config=cfg())
    finally:
        os.rename = real


def _die_in_write(victim: int) -> None:
    real = split.apply_patches

    def die(*a: Any, **k: Any) -> Any:
        real(*a, **k)
        os._exit(3)

    split.apply_patches = die


def sc_kill0(rank: int, world: int, d: str) -> Any:
    """Rank 0, which hosts the rendezvous store, dies while writing: the survivors name it."""
    if rank == 0:
        _die_in_write(0)
    t0 = time.monotonic()
    try:
        fastpersist.save(state(2), os.path.join(d, "ref.pt"), group=torch.distributed.group.WORLD, config=cfg())
    except Exception as e:
        e.elapsed = time.monotonic() - t0  # type: ignore[attr-defined]
        raise


def sc_kill(rank: int, world: int, d: str) -> Any:
    """Rank 1 dies (os._exit) while writing its slice; the others must raise within the timeout.
    Rank 0 (the store host) leaves as soon as it has raised: the product must keep the
    store up until the other survivors have read the verdict."""
    if rank == 1:
        real = split.apply_patches

        def die(*a: Any, **k: Any) -> Any:
            real(*a, **k)
            os._exit(3)

        split.apply_patches = die
    t0 = time.monotonic()
    try:
        fastpersist.save(state(2), os.path.join(d, "ref.pt"), group=torch.distributed.group.WORLD, config=cfg())
    except Exception as e:
        e.elapsed = time.monotonic() - t0  # type: ignore[attr-defined]
        raise


SCENARIOS: dict[str, Callable[[int, int, str], Any]] = {
    name[3:]: fn for name, fn in list(globals().items()) if name.startswith("sc_")
}


# --------------------------------------------------------------------------- launcher


def run_scenarios(rank: int, world: int, port: int, d: str, names: list[str],
                  scenarios: dict[str, Callable[[int, int, str], Any]]) -> None:
    """The body of a spawned rank: joins a gloo group of ``world`` ranks and runs the
    scenarios ``names`` of ``scenarios`` in order (each ``fn(rank, world, d)``), every rank
    starting one when all have finished the previous one. After each, this rank's outcomes so
    far go to ``result-{rank}.pkl`` in ``d`` (:func:`rank_results`), each ``("ok", value)`` or
    ``("error", type name, message, {"failures"/"missing"/"elapsed" the error has},
    traceback, type name of its cause or "")``. Ends the process (``os._exit``)."""
    import torch.distributed as dist

    out = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        for i, name in enumerate(names):
            if i:  # a scenario starts when every rank has finished the previous one (and listed its files)
                dist.barrier()
            try:
                out[name] = ("ok", scenarios[name](rank, world, d))
            except Exception as e:  # noqa: BLE001
                out[name] = ("error", type(e).__name__, str(e), {
                    k: getattr(e, k) for k in ("failures", "missing", "elapsed") if hasattr(e, k)},
                    traceback.format_exc(), type(e.__cause__).__name__ if e.__cause__ is not None else "")
            with open(os.path.join(d, f"result-{rank}.pkl"), "wb") as f:
                pickle.dump(out, f)
    finally:
        sys.stdout.flush()
        os._exit(0)  # no destroy_process_group: a killed peer could hang it


def _worker(rank: int, world: int, port: int, d: str, names: list[str]) -> None:
    run_scenarios(rank, world, port, d, names, SCENARIOS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(world: int, target: Callable[..., None], args: tuple, limit: float, ctx: Any = None) -> list[Optional[int]]:
    """Start ``world`` spawned processes running ``target(rank, world, port, *args)`` (a fresh
    TCP port for gloo's rendezvous), wait up to ``limit`` seconds for all of them, kill the
    ones still running; their exit codes (negative: the signal that ended them). ``ctx``: the
    multiprocessing context (default: torch's "spawn")."""
    import torch.multiprocessing as mp

    ctx = ctx or mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + limit
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    codes = []
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
        codes.append(p.exitcode)
    return codes


def gloo_rank(rank: int, world: int, port: int, d: str, body: Callable[..., dict], *args: Any) -> None:
    """A :func:`spawn_ranks` target: joins a gloo group of ``world`` ranks, runs
    ``body(rank, world, d, *args)`` (a module-level function returning this rank's results),
    leaves the group, and writes the results to ``result-{rank}.pkl`` in ``d`` for
    :func:`rank_results`; an exception is reported as ``{"error": traceback}``."""
    import torch.distributed as dist

    out: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        out.update(body(rank, world, d, *args))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        out["error"] = traceback.format_exc()
    with open(os.path.join(d, f"result-{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)


def rank_results(d: str, world: int) -> list[dict]:
    """Every rank's ``result-{rank}.pkl`` in ``d`` (``{}`` for a rank that wrote none)."""
    results = []
    for r in range(world):
        try:
            with open(os.path.join(d, f"result-{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        except FileNotFoundError:
            results.append({})
    return results


def launch(world: int, d: str, names: list[str], limit: float = 150,
           target: Optional[Callable[[int, int, int, str, list[str]], None]] = None) -> list[dict]:
    """Run ``names`` on ``world`` spawned ranks (``target``: a module-level worker with
    :func:`_worker`'s signature that writes ``result-{rank}.pkl`` into ``d``; default :func:`_worker`);
    every rank's results (``{}`` for a rank that wrote none)."""
    spawn_ranks(world, target or _worker, (d, names), limit)
    return rank_results(d, world)


def outcome(results: list[dict], name: str, rank: int) -> tuple:
    got = results[rank].get(name)
    assert got is not None, f"rank {rank} has no result for {name!r}: {results[rank]}"
    return got


def ok(results: list[dict], name: str) -> list[Any]:
    values = []
    for rank in range(len(results)):
        got = outcome(results, name, rank)
        assert got[0] == "ok", f"rank {rank} {name}: {got[1]}: {got[2]}\n{got[4]}"
        values.append(got[1])
    return values


def reference(d: str) -> None:
    fastpersist.save(state(), os.path.join(d, "ref.pt"), config=cfg())
    fastpersist.save(tensors(), os.path.join(d, "ref.safetensors"), config=cfg())


FULL = ["identical", "load", "disagree_shape", "disagree_value", "different_paths", "different_paths_async",
        "different_paths_load", "different_values", "different_values_async", "different_values_safetensors", "fault", "fault_after_write", "fault_leader_fsync",
        "fault_dir_fsync", "plan_error", "async_then_blocking", "uncollected_async_error", "after_failures"]


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    d = str(tmp_path_factory.mktemp("world2"))
    reference(d)
    return d, launch(2, d, FULL)


@pytest.fixture(scope="module")
def world3(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    d = str(tmp_path_factory.mktemp("world3"))
    reference(d)
    return d, launch(3, d, ["identical", "load", "kill"])


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    d = str(tmp_path_factory.mktemp("world4"))
    reference(d)
    return d, launch(4, d, ["identical", "load", "fault", "nonshared", "nonshared_rollback"])


@pytest.fixture(scope="module")
def world3_kill0(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    d = str(tmp_path_factory.mktemp("world3k0"))
    reference(d)
    return d, launch(3, d, ["kill0"])


WORLDS = ["world2", "world3", "world4"]


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("world", WORLDS)
def test_group_save_is_byte_identical_to_one_rank(world: str, request: pytest.FixtureRequest) -> None:
    d, results = request.getfixturevalue(world)
    n = len(results)
    assert ok(results, "identical") == [[]] * n  # no temporary or probe file left
    assert filecmp.cmp(os.path.join(d, "ref.pt"), os.path.join(d, f"group{n}.pt"), shallow=False)
    assert filecmp.cmp(os.path.join(d, "ref.safetensors"), os.path.join(d, f"group{n}.safetensors"), shallow=False)
    from conftest import assert_same_object

    # stock readers
    assert_same_object(torch.load(os.path.join(d, f"group{n}.pt"), weights_only=True), state())
    safetensors = pytest.importorskip("safetensors.torch")
    assert_same_object(by_name(safetensors.load_file(os.path.join(d, f"group{n}.safetensors"))), by_name(tensors()))
    assert fastpersist.verify(os.path.join(d, f"group{n}.pt")).ok


@pytest.mark.parametrize("world", WORLDS)
def test_group_load_equals_single_load(world: str, request: pytest.FixtureRequest) -> None:
    _d, results = request.getfixturevalue(world)
    assert ok(results, "load") == [True] * len(results)


@pytest.mark.parametrize("name, record", [("disagree_shape", "archive/data/"), ("disagree_value", "archive/data.pkl")])
def test_disagreeing_ranks_are_refused_on_every_rank(world2: tuple, name: str, record: str) -> None:
    d, results = world2
    for rank in range(2):
        got = outcome(results, name, rank)
        assert got[0] == "error" and got[1] == "ReplicasDifferError", got
        assert "do not hold the same state" in got[2] and record in got[2], got[2]
    # refused before anything was written: the reference is untouched
    assert filecmp.cmp(os.path.join(d, "ref.pt"), os.path.join(d, "group2.pt"), shallow=False)


@pytest.mark.parametrize("name", ["different_paths", "different_paths_async"])
def test_ranks_passing_different_paths_fail_on_every_rank(world2: tuple, name: str) -> None:
    """Issue 24 case 1: never a success with a file missing; every rank names both paths."""
    d, results = world2
    for rank in range(2):
        got = outcome(results, name, rank)
        assert got[0] == "error" and got[1] == "DistributedCheckpointError", got
        assert "different paths" in got[2], got[2]
        assert "rank 0" in got[2] and "rank 1" in got[2] and "other" in got[2] and "ckpt" in got[2], got[2]
    names = os.listdir(d)
    assert not any(n.startswith(("ckpt", "other")) for n in names), names
    assert temps(d) == []


def test_ranks_loading_different_paths_fail_on_every_rank(world2: tuple) -> None:
    _d, results = world2
    for rank in range(2):
        got = outcome(results, "different_paths_load", rank)
        assert got[0] == "error" and got[1] == "DistributedCheckpointError", got
        assert "do not see the same file" in got[2], got[2]


@pytest.mark.parametrize("name, where", [
    ("different_values", "tensor ['model']['b']"), ("different_values_async", "tensor ['model']['b']"),
    ("different_values_safetensors", "tensor ['t3']")])
def test_replicas_differing_in_values_are_refused_never_blended(world2: tuple, name: str, where: str) -> None:
    """Issue 24 case 2: same layout, different values: every rank refuses, naming the tensor;
    the previous file is untouched (no blend of rank 0's and rank 1's values)."""
    d, results = world2
    for rank in range(2):
        got = outcome(results, name, rank)
        assert got[0] == "error" and got[1] == "ReplicasDifferError", got
        assert "different tensor values" in got[2] and where in got[2], got[2]
    assert filecmp.cmp(os.path.join(d, "ref.pt"), os.path.join(d, "group2.pt"), shallow=False)
    assert filecmp.cmp(os.path.join(d, "ref.safetensors"), os.path.join(d, "group2.safetensors"), shallow=False)
    assert temps(d) == []


@pytest.mark.parametrize("world", ["world2", "world4"])
def test_fault_on_one_rank_fails_every_rank_and_keeps_the_old_file(world: str, request: pytest.FixtureRequest) -> None:
    d, results = request.getfixturevalue(world)
    for rank in range(len(results)):
        got = outcome(results, "fault", rank)
        assert got[0] == "error" and got[1] == "DistributedCheckpointError", got
        assert "rank 1" in got[2] and "No space left on device" in got[2], got[2]
        assert list(got[3]["failures"]) == [1]
    assert filecmp.cmp(os.path.join(d, "ref.pt"), os.path.join(d, f"group{len(results)}.pt"), shallow=False)
    from conftest import assert_same_object

    assert_same_object(torch.load(os.path.join(d, "ref.pt"), weights_only=True), state())
    assert temps(d) == []


def test_directory_fsync_failure_after_the_rename_is_reported_as_such(world2: tuple) -> None:
    d, results = world2
    for rank in range(2):
        got = outcome(results, "fault_dir_fsync", rank)
        assert got[0] == "error" and got[1] == "DistributedCheckpointError", got
        assert "DirectorySyncError" in got[2] and "The new file is in place" in got[2], got[2]
        assert "untouched" not in got[2], got[2]
    from conftest import assert_same_object

    assert_same_object(fastpersist.load(os.path.join(d, "dirsync.pt"), weights_only=True), state(1))


def test_planning_error_on_one_rank_fails_every_rank(world2: tuple) -> None:
    _d, results = world2
    for rank in range(2):
        got = outcome(results, "plan_error", rank)
        assert got[0] == "error" and got[1] == "DistributedCheckpointError", got
        assert "rank 0" in got[2] and "Nothing was written" in got[2], got[2]


def test_blocking_group_save_waits_for_the_pending_async_one(world2: tuple) -> None:
    _d, results = world2
    assert ok(results, "async_then_blocking") == [True, True]


def test_uncollected_async_error_fails_the_next_group_save_on_every_rank(world2: tuple) -> None:
    d, results = world2
    for rank in range(2):
        got = outcome(results, "uncollected_async_error", rank)
        assert got[0] == "error" and got[1] == "DistributedCheckpointError", got
        assert "rank 1" in got[2] and "Nothing was written" in got[2] and "alone-1.pt" in got[2], got[2]
    assert filecmp.cmp(os.path.join(d, "ref.pt"), os.path.join(d, "group2.pt"), shallow=False)


def test_group_still_works_after_failures(world2: tuple) -> None:
    d, results = world2
    assert ok(results, "after_failures") == [[], []]
    assert filecmp.cmp(os.path.join(d, "ref.pt"), os.path.join(d, "again.pt"), shallow=False)


def test_killed_rank_is_named_within_the_timeout(world3: tuple) -> None:
    d, results = world3
    assert "kill" not in results[1]  # it died
    for rank in (0, 2):
        got = outcome(results, "kill", rank)
        assert got[0] == "error" and got[1] == "DistributedTimeoutError", got
        assert got[3]["missing"] == [1], got
        assert "rank 1 did not reach step" in got[2], got[2]
        assert f"within {TIMEOUT:g} s" in got[2], got[2]  # the configured timeout ended the wait
    from conftest import assert_same_object

    assert_same_object(fastpersist.load(os.path.join(d, "ref.pt"), weights_only=True), state())
    assert temps(d) == []


def test_killed_store_host_is_named_by_the_survivors(world3_kill0: tuple) -> None:
    d, results = world3_kill0
    assert "kill0" not in results[0]
    for rank in (1, 2):
        got = outcome(results, "kill0", rank)
        assert got[0] == "error" and got[1] == "DistributedTimeoutError", got
        assert got[3]["missing"] == [0], got
        assert "rank 0" in got[2], got[2]
    from conftest import assert_same_object

    assert_same_object(fastpersist.load(os.path.join(d, "ref.pt"), weights_only=True), state())


def test_failed_rename_on_one_node_rolls_back_the_others(world4: tuple) -> None:
    d, results = world4
    messages = set()
    for rank in range(4):
        got = outcome(results, "nonshared_rollback", rank)
        assert got[0] == "error" and got[1] == "DistributedCheckpointError", got
        assert "rank 2" in got[2] and "injected rename failure" in got[2], got[2]
        assert list(got[3]["failures"]) == [2], got
        messages.add(got[2])
    for node in ("nodeA", "nodeB"):  # both nodes still hold the previous (nonshared) checkpoint
        assert filecmp.cmp(os.path.join(d, "ref.pt"), os.path.join(d, node, "copy.pt"), shallow=False)
        assert temps(os.path.join(d, node)) == []


def test_nonshared_directories_each_get_a_complete_copy(world4: tuple) -> None:
    d, results = world4
    assert ok(results, "nonshared") == [True] * 4
    for node in ("nodeA", "nodeB"):
        assert filecmp.cmp(os.path.join(d, "ref.pt"), os.path.join(d, node, "copy.pt"), shallow=False)
        assert temps(os.path.join(d, node)) == []


# --------------------------------------------------------------------------- single process: the pieces


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_split_pieces_reassemble_the_file(tmp_path: Any, n: int, fmt: str) -> None:
    from fastpersist import _native
    from fastpersist.formats.safetensors import plan_safetensors
    from fastpersist.formats.torchzip import plan_torch

    obj = state() if fmt == "torch" else tensors()
    ref = str(tmp_path / ("ref." + ("pt" if fmt == "torch" else "safetensors")))
    fastpersist.save(obj, ref, config=cfg())
    plan = plan_torch(obj, 4096) if fmt == "torch" else plan_safetensors(obj, fastpersist.api.safetensors_metadata(None), 4096)
    h = _native.Handle()
    bounds = split.slice_bounds(plan.file_size, n, 4096)
    assert all(lo % 4096 == 0 for lo, _ in bounds) and bounds[-1][1] == plan.file_size
    parts = [split.partial_crcs(h, split.clip(plan.extents, lo, hi)) for lo, hi in bounds]
    crcs = split.combine_crcs(parts, plan.nslots)
    out = str(tmp_path / "out")
    with open(out, "wb") as f:
        f.truncate(plan.file_size)
    for lo, hi in reversed(bounds):
        ext, keep = split.apply_patches(split.clip(plan.extents, lo, hi), plan.patches, crcs, lo, hi)
        if ext:
            h.write(out, ext, [], 0, truncate=False, fsync=False)
    assert filecmp.cmp(ref, out, shallow=False)


@pytest.mark.parametrize("n", [1, 2, 3, 7])
@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_slices_written_before_the_crcs_are_known_reassemble_the_file(tmp_path: Any, n: int, fmt: str) -> None:
    """The group save's order: every slice written whole while its CRC fields still hold the
    plan's placeholders, then only the page blocks holding CRC fields, with the combined CRCs,
    through the page cache."""
    from fastpersist import _native
    from fastpersist.collectivesave import _pwrite_runs
    from fastpersist.formats.safetensors import plan_safetensors
    from fastpersist.formats.torchzip import plan_torch

    obj = state() if fmt == "torch" else tensors()
    ref = str(tmp_path / ("ref." + ("pt" if fmt == "torch" else "safetensors")))
    fastpersist.save(obj, ref, config=cfg())
    plan = plan_torch(obj, 4096) if fmt == "torch" else plan_safetensors(obj, fastpersist.api.safetensors_metadata(None), 4096)
    h = _native.Handle()
    out = str(tmp_path / "out")
    with open(out, "wb") as f:
        f.truncate(plan.file_size)
    bounds = split.slice_bounds(plan.file_size, n, 4096)
    held = []
    for lo, hi in bounds:
        spans = split.patch_blocks(plan.patches, lo, hi, 4096)
        assert all(lo <= a < b <= hi and a % 4096 == 0 and (b % 4096 == 0 or b == hi) for a, b in spans)
        body = [(o, p, k, -1) for o, p, k, _s in split.clip(plan.extents, lo, hi)]
        if body:
            h.write(out, body, [], 0, truncate=False, fsync=False)
        held.append(spans)
    for off, _slot, kind in plan.patches:  # every CRC field byte lies in a held block
        for x in range(off, off + (4 if kind == 0 else 8)):
            assert any(a <= x < b for spans in held for a, b in spans), x
    parts = [split.partial_crcs(None, split.clip(plan.extents, lo, hi)) for lo, hi in bounds]
    assert parts == [split.partial_crcs(h, split.clip(plan.extents, lo, hi)) for lo, hi in bounds]
    crcs = split.combine_crcs(parts, plan.nslots)
    assert not filecmp.cmp(ref, out, shallow=False)  # the CRC fields are not written yet
    for (lo, hi), spans in zip(bounds, held):
        pieces = [e for a, b in spans for e in split.clip(plan.extents, a, b)]
        ext, keep = split.apply_patches(pieces, plan.patches, crcs, lo, hi)
        _pwrite_runs(out, ext, fsync=False)
    assert filecmp.cmp(ref, out, shallow=False)


def test_patch_blocks_are_aligned_merged_and_clipped() -> None:
    # u32 fields at 10 and 4094 (across a block boundary), hex8 at 9000, u32 in the next slice
    patches = [(4094, 0, 0), (10, 1, 0), (9000, 2, 1), (20000, 3, 0)]
    assert split.patch_blocks(patches, 0, 16384, 4096) == [(0, 12288)]
    assert split.patch_blocks(patches, 4096, 16384, 4096) == [(4096, 12288)]
    assert split.patch_blocks(patches, 0, 6000, 4096) == [(0, 6000)]
    assert split.patch_blocks(patches, 12288, 16384, 4096) == []
    assert split.patch_blocks([(100, 0, 0), (9000, 1, 0)], 0, 16384, 4096) == [(0, 4096), (8192, 12288)]


def test_first_difference_names_the_record() -> None:
    from fastpersist.formats.torchzip import plan_torch

    a = split.Layout(plan_torch(state(), 4096), "torch")
    other = state()
    other["name"] = "run-2"
    b = split.Layout(plan_torch(other, 4096), "torch")
    assert split.plan_digest(a) != split.plan_digest(b)
    assert split.plan_digest(a) == split.plan_digest(split.Layout(plan_torch(state(), 4096), "torch"))
    why = split.first_difference([split.plan_records(a), split.plan_records(b)])
    assert why is not None and "archive/data.pkl" in why and "different bytes" in why


def test_patch_field_cut_by_a_slice_boundary() -> None:
    """A 4-byte CRC field across a boundary is written half by each side."""
    buf = bytearray(b"A" * 8192)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    ext = [(0, t.data_ptr(), 8192, -1)]
    whole = b""
    for lo, hi in [(0, 4096), (4096, 8192)]:
        out, keep = split.apply_patches(split.clip(ext, lo, hi), [(4094, 0, 0)], [0x11223344], lo, hi)
        import ctypes

        whole += b"".join(ctypes.string_at(p, n) for _o, p, n, _s in out)
    assert whole[4090:4100] == b"AAAA\x44\x33\x22\x11AA"
    assert len(whole) == 8192


def test_group_none_is_single_process(tmp_path: Any) -> None:
    p = str(tmp_path / "a.pt")
    fastpersist.save(state(), p, group=None, config=cfg())
    from conftest import assert_same_object

    assert_same_object(fastpersist.load(p, group=None, weights_only=True), state())


def test_group_without_init_is_an_error(tmp_path: Any) -> None:
    if torch.distributed.is_initialized():  # pragma: no cover
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        fastpersist.save(state(), str(tmp_path / "a.pt"), group=object(), config=cfg())


# --------------------------------------------------------------------------- the verdict on missing ranks (one process)


def _bare_coordinator(store: Any, rank: int, size: int, timeout: float) -> Any:
    """A coordinator of ``size`` ranks as ``rank`` sees it, over ``store``, without a process group."""
    from fastpersist.coordinator import Coordinator

    co = object.__new__(Coordinator)
    co.what, co.timeout, co.rank, co.size = "op", timeout, rank, size
    co.global_ranks, co.tag, co.prefix = list(range(size)), "t", "fastpersist/t/1"
    co.store, co._marks, co._first, co._who = store, [], True, {}
    return co


def test_published_verdict_is_adopted() -> None:
    store = torch.distributed.HashStore()
    co = _bare_coordinator(store, 0, 3, 30.0)
    store.set(co._key("write", 2), "1")
    store.set("fastpersist/t/1/write/verdict", "missing:1")  # another survivor decided first
    store.add("fastpersist/t/1/write/verdict/read", 1)
    err = co._lost("write", RuntimeError("connection closed"), time.monotonic())
    assert err.missing == [1] and "rank 1 did not reach step 'write'" in str(err)


def test_first_local_verdict_is_published_for_the_others() -> None:
    store = torch.distributed.HashStore()
    co = _bare_coordinator(store, 0, 3, 0.2)
    store.set(co._key("write", 1), "1")  # rank 1 arrived, rank 2 never does
    err = co._lost("write", RuntimeError("timed out"), time.monotonic())
    assert err.missing == [2]
    assert store.get("fastpersist/t/1/write/verdict") == b"missing:2"
    assert store.add("fastpersist/t/1/write/verdict/read", 0) == 1  # this rank read it
    other = _bare_coordinator(store, 1, 3, 0.2)  # the other survivor gets the same verdict
    assert other._lost("write", RuntimeError("x"), time.monotonic()).missing == [2]


def test_exited_peer_is_named_without_waiting_for_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    from fastpersist import coordinator as D
    from fastpersist.commit import process_identity

    gone = subprocess.Popen(["true"])
    gone.wait()  # exited and reaped: its pid is free
    host, start = process_identity()
    store = torch.distributed.HashStore()
    store.set("fastpersist/t/who/1", f"{host}|{gone.pid}|{start}")
    store.add("fastpersist/t/1/crc/verdict/read", 1)  # the other survivor, rank 2, read the verdict
    store.set("fastpersist/t/1/crc/2", "1")
    co = _bare_coordinator(store, 0, 3, 3600.0)
    frozen = time.monotonic()
    monkeypatch.setattr(D.time, "monotonic", lambda: frozen)  # the deadline never comes: only the exit can end it
    err = co._lost("crc", RuntimeError("connection closed"), frozen)
    assert err.missing == [1]


def test_store_gone_gives_the_local_verdict() -> None:
    class Gone:
        def __getattr__(self, name: str) -> Any:
            def fail(*a: Any, **k: Any) -> Any:
                raise RuntimeError("Connection reset by peer")
            return fail

    err = _bare_coordinator(Gone(), 1, 3, 1.0)._lost("write", RuntimeError("closed"), time.monotonic())
    assert err.missing == [0] and "rendezvous store is unreachable" in str(err) and "untouched" in str(err)
    err = _bare_coordinator(None, 1, 3, 1.0)._lost("write", RuntimeError("closed"), time.monotonic())
    assert err.missing == [] and "no rendezvous store" in str(err)


def test_one_fsync_per_host_rule():
    """A member's own fsync is skipped only when it shares its write group leader's host
    (the leader's fsync after the write exchange covers the inode); other hosts fsync themselves."""
    from fastpersist.collectiveplan import Agreed as _Agreed

    one_host = _Agreed("/d/f.pt", "/d", "torch", None, 4096, [[0, 1, 2]], [0, 1, 2], False, ["a", "a", "a"])
    assert all(one_host.leader_fsync_covers(r) for r in range(3))
    shared_fs = _Agreed("/d/f.pt", "/d", "torch", None, 4096, [[0, 1, 2, 3]], [0, 1, 2, 3], False,
                        ["a", "a", "b", "b"])
    assert [shared_fs.leader_fsync_covers(r) for r in range(4)] == [True, True, False, False]
    node_local = _Agreed("/d/f.pt", "/d", "torch", None, 4096, [[0, 1], [2, 3]], [2, 3], False,
                         ["a", "a", "b", "b"])
    assert node_local.leader == 2 and node_local.leader_fsync_covers(3)
    unknown = _Agreed("/d/f.pt", "/d", "torch", None, 4096, [[0, 1]], [0, 1], False)
    assert not unknown.leader_fsync_covers(1)  # no host names: every rank fsyncs


def test_leader_fsync_covers_only_the_same_inode_under_the_same_kernel(tmp_path: Any) -> None:
    """A member skips its own fsync only when it sees the leader's very inode under the
    leader's kernel; another file, another kernel or an unknown identity: it fsyncs."""
    from fastpersist.collectivesave import _boot_id, _file_identity, _same_inode

    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x")
    b.write_bytes(b"y")
    ident = _file_identity(str(a))
    if not _boot_id():
        pytest.skip("no kernel boot id here")
    assert _same_inode(str(a), ident)
    assert not _same_inode(str(b), ident)  # another inode (e.g. a second mount of a share)
    assert not _same_inode(str(a), ("another-kernel",) + tuple(ident[1:]))
    assert not _same_inode(str(a), ("",) + tuple(ident[1:]))
    assert not _same_inode(str(a), None)
    assert not _same_inode(str(tmp_path / "gone"), ident)


def test_bench_dist_group_phase_medians() -> None:
    """bench dist's per-rank, per-step medians of the group save phases (local work, exchange)."""
    from fastpersist.bench.dist_bench import DistBenchResult

    runs = [
        [[("plan", 0.2, 0.01), ("write", 1.0, 0.1)], [("plan", 0.3, 0.0), ("write", 1.1, 0.0)]],
        [[("plan", 0.4, 0.03), ("write", 3.0, 0.3)], [("plan", 0.5, 0.0), ("write", 1.3, 0.0)]],
        [[("plan", 0.6, 0.02), ("write", 2.0, 0.2)], None],  # a rank that reported nothing
    ]
    res = DistBenchResult(None, 2, 2, {}, 3, [], {}, group_phases=runs)  # type: ignore[arg-type]
    med = res.group_phase_medians()
    assert med[0]["plan"] == {"local_s": 0.4, "exchange_s": 0.02}
    assert med[0]["write"] == {"local_s": 2.0, "exchange_s": 0.2}
    assert med[1]["write"]["local_s"] == pytest.approx(1.2) and list(med[1]) == ["plan", "write"]


@pytest.mark.parametrize("name, rank_failing, words", [
    ("fault_after_write", 1, "injected after the write"), ("fault_leader_fsync", 0, "injected fsync failure")])
def test_failure_after_the_writes_fails_every_rank_and_keeps_the_old_file(world2: tuple, name: str, rank_failing: int,
                                                                         words: str) -> None:
    """A rank failing once its slice is written (a non-committing rank), or the committing
    rank's fsync failing: every rank raises, nothing under the final name changes."""
    from conftest import assert_same_object

    d, results = world2
    for rank in range(2):
        got = outcome(results, name, rank)
        assert got[0] == "error" and got[1] == "DistributedCheckpointError", got
        assert words in got[2] and list(got[3]["failures"]) == [rank_failing], got
    assert filecmp.cmp(os.path.join(d, "ref.pt"), os.path.join(d, "group2.pt"), shallow=False)
    assert_same_object(torch.load(os.path.join(d, "ref.pt"), weights_only=True), state())
    assert temps(d) == []
