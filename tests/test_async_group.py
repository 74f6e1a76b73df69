"""fastpersist.save_async(..., group=...) with real gloo process groups (2 ranks, CPU).

Each launch starts the ranks once (torch.multiprocessing, spawn); the ranks run a
list of scenarios in order and record each outcome in a file the tests read. Rank 0
writes, right before each collective async save, the reference file that a 1-rank
``fastpersist.save`` of a deep copy of the state gives at that moment; the tests
compare the group's file with it byte for byte. Scenarios that break the group (a
rank killed) run last.
"""

from __future__ import annotations

import copy
import filecmp
import os
import pickle
import sys
import time
import traceback
from typing import Any, Callable

import pytest
import torch

import fastpersist

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()), reason="no gloo backend"
)

#: the collective timeout of the scenario whose rank dies (the test waits for it to expire)
TIMEOUT = 5.0
#: every other scenario's: long enough that a rank delayed by a busy machine never times out
#: (a 5 s timeout failed 3 tests once at a load average of 10 on 2 cores)
SLOW_OK = 120.0


def cfg(timeout: float = SLOW_OK, **kw: Any) -> fastpersist.Config:
    return fastpersist.Config(dist_timeout=timeout, fsync=False, **kw)


def temps(d: str) -> list[str]:
    return sorted(n for n in os.listdir(d) if ".fp-tmp-" in n or n.startswith(".fastpersist-probe-"))


def model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.BatchNorm1d(1024), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 64))
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    return m, opt


def train_step(m: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)  # the same batch on every rank: the replicas stay equal
    x = torch.randn(16, 64, generator=g)
    opt.zero_grad()
    m(x).pow(2).mean().backward()
    opt.step()


def full_state(m: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    return {"model": m.state_dict(), "optim": opt.state_dict(), "step": step, "name": "run"}


def mutate(obj: Any) -> None:
    with torch.no_grad():
        if isinstance(obj, torch.Tensor):
            obj.add_(1)
        elif isinstance(obj, dict):
            for v in obj.values():
                mutate(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                mutate(v)


def reference(rank: int, state: Any, d: str, name: str) -> None:
    if rank == 0:
        fastpersist.save(copy.deepcopy(state), os.path.join(d, f"ref-{name}"), config=cfg())


def busy_collectives(n: int = 20) -> None:
    """The training's own collectives on the user's group, while the background commit runs."""
    t = torch.ones(1000)
    for _ in range(n):
        torch.distributed.all_reduce(t, group=torch.distributed.group.WORLD)
    torch.distributed.barrier()


# --------------------------------------------------------------------------- scenarios (run on every rank)


def sc_snapshot(rank: int, world: int, d: str) -> Any:
    m, opt = model_and_opt()
    train_step(m, opt, 1)
    st = full_state(m, opt, 1)
    reference(rank, st, d, "snapshot.pt")
    fut = fastpersist.save_async(st, os.path.join(d, "snapshot.pt"), group=torch.distributed.group.WORLD,
                                 config=cfg(async_staging_limit=256 << 10))  # a pool smaller than a slice
    mutate(st)  # every tensor changes right after the call
    train_step(m, opt, 2)
    busy_collectives()
    assert fut.wait(60) is True
    return fut.done(), temps(d)


def sc_lazy(rank: int, world: int, d: str) -> Any:
    m, opt = model_and_opt()
    fastpersist.guard(opt)
    train_step(m, opt, 1)
    st = full_state(m, opt, 1)
    reference(rank, st, d, "lazy.pt")
    fut = fastpersist.save_async(st, os.path.join(d, "lazy.pt"), mode="lazy", group=torch.distributed.group.WORLD,
                                 config=cfg())
    for i in range(3):
        train_step(m, opt, 10 + i)  # the guard holds optimizer.step until the slice is read
        busy_collectives(3)
    assert fut.wait(60) is True
    return True


def sc_safetensors(rank: int, world: int, d: str) -> Any:
    g = torch.Generator().manual_seed(5)
    st = {f"t{i}": torch.randn(3000 * i + 7, generator=g) for i in range(8)}
    reference(rank, st, d, "st.safetensors")
    fut = fastpersist.save_async(st, os.path.join(d, "st.safetensors"), group=torch.distributed.group.WORLD,
                                 config=cfg())
    mutate(st)
    fut.wait(60)
    return True


def sc_queue(rank: int, world: int, d: str) -> Any:
    """Three async saves back to back, a blocking group save and a group load in between."""
    m, opt = model_and_opt()
    wg = torch.distributed.group.WORLD
    futs = []
    for i in range(3):
        train_step(m, opt, 100 + i)
        st = full_state(m, opt, i)
        reference(rank, st, d, f"q{i}.pt")
        futs.append(fastpersist.save_async(st, os.path.join(d, f"q{i}.pt"), group=wg, config=cfg()))
        if i == 1:
            fastpersist.save(st, os.path.join(d, "blocking.pt"), group=wg, config=cfg())
            fastpersist.load(os.path.join(d, "blocking.pt"), group=wg, config=cfg(), weights_only=True)
    assert fastpersist.wait_all(60) is True
    return [f.done() for f in futs]


def sc_fault(rank: int, world: int, d: str) -> Any:
    """ENOSPC on rank 1's background write: every rank's future fails, naming rank 1."""
    from fastpersist import _native

    m, opt = model_and_opt()
    st = full_state(m, opt, 7)
    torch.distributed.barrier()
    if rank == 1:
        _native.set_fault("write", 1, "ENOSPC")
    try:
        fut = fastpersist.save_async(st, os.path.join(d, "snapshot.pt"), group=torch.distributed.group.WORLD,
                                     config=cfg())
        exc = fut.exception(60)
    finally:
        _native.clear_faults()
    torch.distributed.barrier()
    assert exc is not None
    return type(exc).__name__, str(exc), getattr(exc, "failures", None), temps(d)


def sc_no_guard(rank: int, world: int, d: str) -> Any:
    import fastpersist.asyncsave as A

    for opt in list(A._guards.keys()):
        A._guards[opt].remove()
    m, opt = model_and_opt()
    fastpersist.save_async(full_state(m, opt, 0), os.path.join(d, "lazy.pt"), mode="lazy",
                           group=torch.distributed.group.WORLD, config=cfg())


def sc_kill(rank: int, world: int, d: str) -> Any:
    """Rank 1 dies right after its call returned; rank 0's future names it."""
    m, opt = model_and_opt()
    st = full_state(m, opt, 9)
    t0 = time.monotonic()
    fut = fastpersist.save_async(st, os.path.join(d, "snapshot.pt"), group=torch.distributed.group.WORLD,
                                 config=cfg(TIMEOUT))
    if rank == 1:
        os._exit(3)
    exc = fut.exception(60)
    assert exc is not None
    return type(exc).__name__, str(exc), getattr(exc, "missing", None), time.monotonic() - t0, temps(d)


def sc_exit_pending(rank: int, world: int, d: str) -> Any:
    """Each rank leaves with its save still pending (normal interpreter exit): atexit finishes it."""
    m, opt = model_and_opt()
    st = full_state(m, opt, 11)
    reference(rank, st, d, "exit.pt")
    fastpersist.save_async(st, os.path.join(d, "exit.pt"), group=torch.distributed.group.WORLD, config=cfg())
    return True


SCENARIOS: dict[str, Callable[[int, int, str], Any]] = {
    name[3:]: fn for name, fn in list(globals().items()) if name.startswith("sc_")
}


# --------------------------------------------------------------------------- launcher


def _worker(rank: int, world: int, port: int, d: str, names: list[str], clean_exit: bool) -> None:
    import torch.distributed as dist

    out = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        for i, name in enumerate(names):
            if i:  # a scenario starts when every rank has finished the previous one (and listed its files)
                dist.barrier()
            try:
                out[name] = ("ok", SCENARIOS[name](rank, world, d))
            except Exception as e:  # noqa: BLE001
                out[name] = ("error", type(e).__name__, str(e), traceback.format_exc())
            with open(os.path.join(d, f"result-{rank}.pkl"), "wb") as f:
                pickle.dump(out, f)
    finally:
        sys.stdout.flush()
        if not clean_exit:
            os._exit(0)
    sys.exit(0)  # interpreter exit: atexit handlers run (pending async saves)


def launch(d: str, names: list[str], clean_exit: bool = False, limit: float = 180) -> tuple[list[dict], list[Any]]:
    """Run ``names`` on 2 spawned gloo ranks; every rank's results and exit codes."""
    from test_distributed import rank_results, spawn_ranks  # tests/ is on sys.path (rootdir conftest)

    codes = spawn_ranks(2, _worker, (d, names, clean_exit), limit)
    return rank_results(d, 2), codes


def ok(results: list[dict], name: str) -> list[Any]:
    values = []
    for rank, res in enumerate(results):
        got = res.get(name)
        assert got is not None, f"rank {rank} has no result for {name!r}: {res}"
        assert got[0] == "ok", f"rank {rank} {name}: {got[1]}: {got[2]}\n{got[3]}"
        values.append(got[1])
    return values


def same(d: str, name: str) -> bool:
    return filecmp.cmp(os.path.join(d, f"ref-{name}"), os.path.join(d, name), shallow=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    d = str(tmp_path_factory.mktemp("agroup"))
    results, _codes = launch(d, ["snapshot", "lazy", "safetensors", "queue", "fault", "no_guard", "kill"])
    return d, results


# --------------------------------------------------------------------------- tests


def test_snapshot_is_bit_exact_while_training_mutates_and_runs_collectives(run: tuple) -> None:
    d, results = run
    assert ok(results, "snapshot") == [(True, [])] * 2
    assert same(d, "snapshot.pt")
    from conftest import assert_same_object

    got = torch.load(os.path.join(d, "snapshot.pt"), weights_only=True)  # stock reader
    assert_same_object(got, torch.load(os.path.join(d, "ref-snapshot.pt"), weights_only=True))
    assert fastpersist.verify(os.path.join(d, "snapshot.pt")).ok


def test_lazy_is_bit_exact_under_the_guard(run: tuple) -> None:
    d, results = run
    assert ok(results, "lazy") == [True, True]
    assert same(d, "lazy.pt")


def test_safetensors_is_bit_exact(run: tuple) -> None:
    d, results = run
    assert ok(results, "safetensors") == [True, True]
    assert same(d, "st.safetensors")


def test_queued_saves_with_blocking_collectives_in_between(run: tuple) -> None:
    d, results = run
    assert ok(results, "queue") == [[True] * 3] * 2
    for i in range(3):
        assert same(d, f"q{i}.pt")


def test_fault_on_one_rank_fails_every_future_and_keeps_the_old_file(run: tuple) -> None:
    d, results = run
    outs = ok(results, "fault")
    for name, msg, failures, left in outs:
        assert name == "DistributedCheckpointError", msg
        assert "rank 1" in msg and "No space left on device" in msg, msg
        assert list(failures) == [1]
        assert left == []
    assert outs[0][1] == outs[1][1]  # the same error on both ranks
    assert same(d, "snapshot.pt")  # the previous checkpoint (scenario "snapshot") is intact


def test_lazy_without_guard_is_refused_on_every_rank(run: tuple) -> None:
    _d, results = run
    for rank in range(2):
        got = results[rank]["no_guard"]
        assert got[0] == "error" and got[1] == "DistributedCheckpointError", got
        assert "fastpersist.guard(optimizer)" in got[2] and "Nothing was written" in got[2], got[2]


def test_killed_rank_fails_the_pending_future_naming_it(run: tuple) -> None:
    d, results = run
    assert "kill" not in results[1]
    name, msg, missing, _elapsed, left = ok(results[:1], "kill")[0]
    assert name == "DistributedTimeoutError", msg
    assert missing == [1], msg
    assert "rank 1" in msg
    assert f"within {TIMEOUT:g} s" in msg, msg  # the configured timeout ended the wait
    assert left == []
    assert same(d, "snapshot.pt")


def test_exit_with_a_pending_group_save_finishes_it(tmp_path: Any) -> None:
    d = str(tmp_path)
    results, codes = launch(d, ["exit_pending"], clean_exit=True)
    assert ok(results, "exit_pending") == [True, True]
    assert codes == [0, 0]
    assert same(d, "exit.pt")
    assert temps(d) == []


def test_group_of_one_is_the_single_process_path(tmp_path: Any) -> None:
    """A 1-rank group needs no store or side group (exercised in a spawned 1-rank world)."""
    from test_distributed import spawn_ranks

    assert spawn_ranks(1, _one_rank, (str(tmp_path),), 120) == [0]
    assert filecmp.cmp(str(tmp_path / "ref.pt"), str(tmp_path / "one.pt"), shallow=False)


def _one_rank(rank: int, world: int, port: int, d: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    m, opt = model_and_opt()
    st = full_state(m, opt, 0)
    fastpersist.save(copy.deepcopy(st), os.path.join(d, "ref.pt"), config=cfg())
    fastpersist.save_async(st, os.path.join(d, "one.pt"), group=dist.group.WORLD, config=cfg()).wait()
    os._exit(0)
