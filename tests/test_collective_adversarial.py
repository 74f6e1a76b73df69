"""Adversarial family of the collective save (issue 24 "Done when"): 3 gloo ranks.

Every case starts from a checkpoint already at the path (``state(0)``, one-rank save)
and runs ``fastpersist.save(state(1), path, group=WORLD)`` on 3 spawned CPU ranks while
something goes wrong: a rank killed (``os._exit``) before, during or after each step
of the save (plan agreement, probe, write, commit), a rank that dies before the save
or never calls it, ENOSPC or EIO on one rank, ranks passing different paths, ranks
holding different states. For each case the test checks the contract:

* every surviving rank raises a documented error (:class:`DistributedCheckpointError`
  or a subclass) within the timeout, or every surviving rank succeeds;
* the file at the path holds exactly one rank's state, byte for byte: the previous
  checkpoint (``state(0)``), or the new one (``state(1)``) when the save committed
  (every survivor succeeded, or a rank died after the leader's rename);
* nothing is left in the directory (no temporary file, no probe).

A kill ends the process group, so each kill case is its own launch (about 10 s on 2
cores); the cases that keep the group alive share one launch.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
import traceback
from typing import Any

import pytest
import torch

import fastpersist
import test_distributed
from test_distributed import rank_results, state, temps

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()), reason="no gloo backend"
)

WORLD = 3
TIMEOUT = 4.0  # Config.dist_timeout of every case
LIMIT = 90.0  # seconds a launch may take before its processes are killed (a hang fails the case)
DOCUMENTED = {"DistributedCheckpointError", "DistributedTimeoutError", "ReplicasDifferError"}


def cfg() -> fastpersist.Config:
    return fastpersist.Config(dist_timeout=TIMEOUT, fsync=False)


def _exit() -> None:
    sys.stdout.flush()
    os._exit(3)


# --------------------------------------------------------------------------- kill points (run on the victim)


def _kill_at(step: str, when: str, rank: int) -> None:
    """Make this process exit at ``when`` (before, during, after) ``step`` of the next collective save."""
    from fastpersist import collectiveplan as D
    from fastpersist.coordinator import Coordinator
    from fastpersist.formats import split

    def on_gather(name: str, after: bool) -> None:
        real = Coordinator.gather

        def gather(self: Any, s: str, value: Any) -> Any:
            if s == name and not after:
                _exit()
            out = real(self, s, value)
            if s == name and after:
                _exit()
            return out

        Coordinator.gather = gather  # type: ignore[method-assign]

    def wrap(owner: Any, attr: str, before: bool = False) -> None:
        real = getattr(owner, attr)

        def dying(*a: Any, **k: Any) -> Any:
            if before:
                _exit()
            real(*a, **k)
            _exit()

        setattr(owner, attr, dying)

    if when == "during":
        if step == "plan":
            wrap(D, "_plan", before=True)
        elif step == "probe":
            wrap(D, "_make_probe") if rank == 0 else wrap(D, "_probe_visible")
        elif step == "write":
            wrap(split, "apply_patches")
        elif step == "commit":  # the leader: after its rename, before the directory fsync and the exchange
            wrap(os, "rename")
        return
    if step == "write":  # before: the temporary file exists, nothing written; after: every slice written
        on_gather("tmp" if when == "before" else "write", after=True)
        return
    on_gather(step, after=when == "after")


# --------------------------------------------------------------------------- scenarios


def _save(d: str, obj: Any = None, name: str = "ckpt.pt", mode: str = "sync") -> None:
    path = os.path.join(d, name)
    obj = state(1) if obj is None else obj
    if mode == "sync":
        fastpersist.save(obj, path, group=torch.distributed.group.WORLD, config=cfg())
    else:
        fastpersist.save_async(obj, path, group=torch.distributed.group.WORLD, config=cfg()).wait()


def _run_kill(rank: int, d: str, case: dict) -> Any:
    if rank == case["victim"]:
        _kill_at(case["step"], case["when"], rank)
    _save(d)


def _run_dies_before(rank: int, d: str, case: dict) -> Any:
    if rank == case["victim"]:
        _exit()
    _save(d)


def _run_never_calls(rank: int, d: str, case: dict) -> Any:
    if case.get("warm"):  # the group has already done a collective save together
        _save(d, state(0))
    if rank == case["victim"]:
        end = time.monotonic() + TIMEOUT * 3 + 15  # alive, busy elsewhere, never calls; leaves once the others are done
        while time.monotonic() < end and not all(_has_result(d, r, "never_calls") for r in range(WORLD) if r != rank):
            time.sleep(0.2)
        return "skipped"
    _save(d)


def _has_result(d: str, rank: int, name: str) -> bool:
    try:
        with open(os.path.join(d, f"result-{rank}.pkl"), "rb") as f:
            return name in pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return False


def _run_alive(rank: int, d: str, case: dict) -> Any:
    """The cases that keep the group alive, in order; each is one result key."""
    from fastpersist.testing import inject_fault

    what = case["what"]
    if what in ("enospc", "eio", "enospc_async"):
        victim = 1 if what != "eio" else 2
        if rank == victim:
            with inject_fault("write", 1, "ENOSPC" if what != "eio" else "EIO"):
                _save(d, mode="async" if what.endswith("async") else "sync")
        else:
            _save(d, mode="async" if what.endswith("async") else "sync")
    elif what == "paths":
        _save(d, name="ckpt.pt" if rank == 0 else f"other{rank}.pt")
    elif what == "paths_async":
        _save(d, name="ckpt.pt" if rank != 2 else "other.pt", mode="async")
    elif what in ("values", "values_async"):
        obj = state(1)
        if rank == 2:
            obj["model"]["w"][100, 5] += 1.0
        _save(d, obj, mode="async" if what.endswith("async") else "sync")
    elif what == "layout":
        obj = state(1)
        if rank == 1:
            obj["extra"] = torch.zeros(3)
        _save(d, obj)
    elif what == "clean":
        _save(d, state(0))  # back to the previous state, so every case starts alike
    return sorted(n for n in os.listdir(d) if n.startswith("."))


ALIVE = ["enospc", "eio", "enospc_async", "paths", "paths_async", "values", "values_async", "layout"]


def _worker(rank: int, world: int, port: int, d: str, case: dict) -> None:
    import torch.distributed as dist

    out: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        kind = case["kind"]
        names = ALIVE if kind == "alive" else [kind]
        for i, name in enumerate(names):
            if i:
                dist.barrier()
            t0 = time.monotonic()
            try:
                if kind == "alive":
                    value = _run_alive(rank, d, {"what": name})
                else:
                    value = globals()[f"_run_{kind}"](rank, d, case)
                out[name] = ("ok", value, time.monotonic() - t0)
            except Exception as e:  # noqa: BLE001
                out[name] = ("error", type(e).__name__, str(e), time.monotonic() - t0, traceback.format_exc())
            with open(os.path.join(d, f"result-{rank}.pkl"), "wb") as f:
                pickle.dump(out, f)
            if kind == "alive":
                dist.barrier()
                if rank == 0 and out[name][0] == "ok":  # put the previous state back for the next case
                    fastpersist.save(state(0), os.path.join(d, "ckpt.pt"), config=cfg())
    finally:
        sys.stdout.flush()
        os._exit(0)


def spawn_ranks(world: int, target: Any, args: tuple, limit: float) -> list[Any]:
    """As ``test_distributed.spawn_ranks``, but forked from a forkserver that has imported torch
    and fastpersist once (a spawned rank spends seconds importing them on a busy 2-core machine;
    the family launches about 20 groups)."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "fastpersist", "fastpersist.distributed",
                                "test_collective_adversarial"])
    return test_distributed.spawn_ranks(world, target, args, limit, ctx)


# --------------------------------------------------------------------------- the contract


def _bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    d = str(tmp_path_factory.mktemp("refs"))
    out = {}
    for seed in (0, 1):
        p = os.path.join(d, f"s{seed}.pt")
        fastpersist.save(state(seed), p, config=cfg())
        out[f"s{seed}"] = _bytes(p)
    return out


@pytest.fixture(scope="module")
def refs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    return _references(tmp_path_factory)


def _leftovers(d: str) -> list[str]:
    return temps(d) + sorted(n for n in os.listdir(d) if n.startswith("other"))


def check(d: str, name: str, results: list[dict], refs: dict[str, bytes], dead: set[int]) -> list[str]:
    """Every violation of the contract in words (empty: clean)."""
    bad = []
    outcomes = {r: results[r].get(name) for r in range(WORLD) if r not in dead}
    for r, got in outcomes.items():
        if got is None:
            bad.append(f"rank {r} has no result (hung or died)")
        elif got[0] == "error" and got[1] not in DOCUMENTED:
            bad.append(f"rank {r} raised undocumented {got[1]}: {got[2]}\n{got[4]}")
        elif got[0] == "error" and got[3] > TIMEOUT + 15:
            bad.append(f"rank {r} raised after {got[3]:.1f} s (timeout {TIMEOUT} s)")
    raised = [r for r, g in outcomes.items() if g is not None and g[0] == "error"]
    succeeded = [r for r, g in outcomes.items() if g is not None and g[0] == "ok" and g[1] != "skipped"]
    if raised and succeeded:
        bad.append(f"ranks {raised} raised while ranks {succeeded} succeeded")
    final = _bytes(os.path.join(d, "ckpt.pt"))
    if succeeded and not raised:
        if final != refs["s1"]:
            bad.append("every rank succeeded but the file is not the new state byte for byte")
    elif final not in (refs["s0"], refs["s1"]):
        bad.append("the file is neither the previous nor the new state byte for byte")
    if final == refs["s1"] and raised and not dead:
        bad.append("the ranks raised but the new file is in place (no rank died)")
    if final == refs["s0"]:
        from conftest import assert_same_object

        assert_same_object(fastpersist.load(os.path.join(d, "ckpt.pt"), weights_only=True), state(0))
    left = _leftovers(d)
    if left:
        bad.append(f"left in the directory: {left}")
    return bad


def _setup(tmp_path_factory: pytest.TempPathFactory, tag: str) -> str:
    d = str(tmp_path_factory.mktemp(tag))
    fastpersist.save(state(0), os.path.join(d, "ckpt.pt"), config=cfg())
    return d


KILLS = [(step, when, 1) for step in ("plan", "probe", "write", "commit") for when in ("before", "during", "after")
         if (step, when) != ("commit", "during")]
KILLS += [("plan", "before", 0), ("probe", "during", 0), ("write", "during", 0), ("commit", "during", 0)]


@pytest.mark.parametrize("step, when, victim", KILLS, ids=[f"{s}-{w}-rank{v}" for s, w, v in KILLS])
def test_rank_killed_at_each_step(tmp_path_factory: pytest.TempPathFactory, refs: dict, step: str, when: str,
                                  victim: int) -> None:
    d = _setup(tmp_path_factory, f"kill-{step}-{when}-{victim}")
    spawn_ranks(WORLD, _worker, (d, {"kind": "kill", "step": step, "when": when, "victim": victim}), LIMIT)
    results = rank_results(d, WORLD)
    assert "kill" not in results[victim], results[victim]  # it died at the point asked
    bad = check(d, "kill", results, refs, {victim})
    assert not bad, "\n".join(bad)
    for r in set(range(WORLD)) - {victim}:
        got = results[r]["kill"]
        if got[0] == "error" and got[1] == "DistributedTimeoutError":
            assert f"rank {victim}" in got[2], got[2]


@pytest.mark.parametrize("kind, warm", [("dies_before", False), ("never_calls", False), ("never_calls", True)],
                         ids=["dies-before-the-save", "never-calls-first-save", "never-calls-later-save"])
def test_rank_missing_from_the_save_is_named(tmp_path_factory: pytest.TempPathFactory, refs: dict, kind: str,
                                             warm: bool) -> None:
    """Issue 24 case 3: the survivors raise DistributedTimeoutError naming the missing rank
    (not torch's raw DistStoreError), within the timeout."""
    d = _setup(tmp_path_factory, f"{kind}-{warm}")
    spawn_ranks(WORLD, _worker, (d, {"kind": kind, "victim": 2, "warm": warm}), LIMIT)
    results = rank_results(d, WORLD)
    bad = check(d, kind, results, refs, {2})
    assert not bad, "\n".join(bad)
    for r in (0, 1):
        got = results[r][kind]
        assert got[0] == "error" and got[1] == "DistributedTimeoutError", got
        assert "rank 2" in got[2] and "DistStoreError" not in got[1], got[2]


def _probe_and_exit(d: str) -> None:
    from fastpersist import collectiveplan as D

    D._make_probe(d)
    os._exit(0)


def dead_probe(d: str) -> str:
    """A probe file whose creator (a process of this host) has exited, as a rank killed in the probe step leaves."""
    import multiprocessing as mp

    p = mp.get_context("fork").Process(target=_probe_and_exit, args=(d,))
    p.start()
    p.join()
    (name,) = [n for n in os.listdir(d) if n.startswith(".fastpersist-probe-")]
    return name


def test_stale_probes_are_removed_and_live_ones_kept(tmp_path: Any) -> None:
    """Issue 24 case 4: a probe whose creator exited is removed; one of a live process is kept;
    one that names no creator (earlier releases, another host) only after the grace period."""
    from fastpersist import collectiveplan as D

    d = str(tmp_path)
    stale = dead_probe(d)
    anonymous = os.path.join(d, ".fastpersist-probe-0123456789abcdef")
    with open(anonymous, "w") as f:
        f.write("x")
    assert D.clean_stale_probes(d) == [os.path.join(d, stale)]
    live, _token = D._make_probe(d)  # this process: alive
    assert D.clean_stale_probes(d) == []
    assert sorted(os.listdir(d)) == sorted([live, os.path.basename(anonymous)])
    old = time.time() - 7200
    os.utime(anonymous, (old, old))
    assert D.clean_stale_probes(d) == [anonymous]
    assert os.listdir(d) == [live]


def test_faults_paths_and_states_on_one_rank(tmp_path_factory: pytest.TempPathFactory, refs: dict) -> None:
    """ENOSPC and EIO on one rank, different paths, different values or layouts: every rank
    raises, the previous checkpoint stays, nothing is left (also not the probe a rank killed
    in an earlier save left: the next collective save removes it, issue 24 case 4)."""
    d = _setup(tmp_path_factory, "alive")
    dead_probe(d)
    spawn_ranks(WORLD, _worker, (d, {"kind": "alive"}), LIMIT * 2)
    results = rank_results(d, WORLD)
    problems = {}
    for name in ALIVE:
        bad = check(d, name, results, refs, set())
        if not all(results[r].get(name, ("?",))[0] == "error" for r in range(WORLD)):
            bad.append(f"not every rank raised: {[results[r].get(name, ('?',))[:3] for r in range(WORLD)]}")
        if bad:
            problems[name] = bad
    assert not problems, problems
    assert "ReplicasDifferError" == results[0]["values"][1] and "['model']['w']" in results[0]["values"][2]
    assert "different paths" in results[0]["paths"][2] and "other1.pt" in results[0]["paths"][2]
