"""fastpersist.collectivedir: a directory the ranks write together, swapped in whole by the
committers (real gloo ranks; injected faults; a rank SIGKILLed part-way)."""

from __future__ import annotations

import errno
import logging
import os
import re
import signal

from fastpersist import dircommit
from fastpersist.collectivedir import CollectiveDir, ListExchange, WorldExchange, agree
from fastpersist.testing import inject_fault

log = logging.getLogger("test_collectivedir")
ENTRY = re.compile(r"rank_[0-9]+\.bin").fullmatch  # the checkpoint's own entries


def _tree(directory: str) -> dict:
    out = {}
    for base, _dirs, files in os.walk(directory):
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = f.read()
    return out


def _leftovers(directory: str) -> list:
    return sorted(n for n in os.listdir(directory) if n.startswith(".fastpersist-"))


def _previous(target: str) -> None:
    """The previous checkpoint: two ranks' files, a stale one (a third rank's) and a user's note."""
    os.makedirs(target, exist_ok=True)
    for name, data in (("rank_0.bin", b"A0"), ("rank_1.bin", b"A1"), ("rank_7.bin", b"stale"), ("notes.txt", b"n")):
        with open(os.path.join(target, name), "wb") as f:
            f.write(data)


def _save(target: str, rank: int, *, committer: bool, fail: bool = False, per_node: bool = False,
          veto=None, data: bytes = b"B") -> dict:
    """One collective save of ``target`` by this rank (every rank calls it): its outcome."""
    staged = dircommit.StagedDir(target)
    if committer:
        staged.clean_leftovers(operation="test", logger=log, fsync_after_restore=False)
    token = CollectiveDir.plan(staged, rank=rank, committer=committer, veto=veto, existing_only=True,
                               operation="test save", logger=log)
    out: dict = {"token": token}
    if token is None:
        return out
    cd = CollectiveDir(staged, token, committer=committer, rank=rank, is_checkpoint_entry=ENTRY,
                       what="a test checkpoint", operation="test save", logger=log)

    def elsewhere(failed, message):
        return RuntimeError(f"failed on rank(s) {failed}: {message}")

    error = None
    try:
        path = cd.redirect(os.path.join(target, f"rank_{rank}.bin"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if fail:
            raise OSError(errno.ENOSPC, "injected", path)
        with open(path, "wb") as f:
            f.write(data + str(rank).encode())
    except OSError as e:
        error = e
    try:
        if cd.agree(error, elsewhere):
            cd.commit(elsewhere, per_node=per_node, missing_ok=True)
    except (OSError, RuntimeError) as e:
        out["raised"] = f"{type(e).__name__}: {e}"
    out["visible"] = cd.visible
    return out


def _body(rank: int, world: int, d: str) -> dict:
    out: dict = {}
    shared = os.path.join(d, "shared", "ckpt")
    os.makedirs(os.path.dirname(shared), exist_ok=True)
    # 1. a target no rank sees: not staged (written directly)
    out["new"] = _save(shared, rank, committer=rank == 0)
    # 2. every rank writes into rank 0's staging directory; rank 0 swaps it in
    if rank == 0:
        _previous(shared)
    out["tokens"] = agree(None, RuntimeError, value=None)  # a barrier: the previous checkpoint is there
    out["ok"] = _save(shared, rank, committer=rank == 0)
    # 3. rank 1 fails writing: every rank raises, the target is untouched, the staging directory gone
    before = _tree(shared) if rank == 0 else None
    out["fail"] = _save(shared, rank, committer=rank == 0, fail=rank == 1, data=b"C")
    out["ok_tree"] = before
    out["fail_unchanged"] = _tree(shared) == before if rank == 0 else None
    out["fail_leftovers"] = _leftovers(os.path.dirname(shared))
    # 4. a rank's veto: not staged, on every rank
    out["veto"] = _save(shared, rank, committer=rank == 0, veto="a reason of the framework's" if rank == 1 else None)
    # 5. rank 0's swap fails (an injected rename fault): every rank raises, the target is untouched
    agree(None, RuntimeError)
    if rank == 0:
        with inject_fault("rename", 1, "EIO"):
            out["swap_fault"] = _save(shared, rank, committer=True, data=b"D")
        out["swap_unchanged"] = _tree(shared) == before
    else:
        out["swap_fault"] = _save(shared, rank, committer=False, data=b"D")
    out["swap_leftovers"] = _leftovers(os.path.dirname(shared))
    # 6. node-local disks (each rank's own root): every rank's committer swaps its own copy
    local = os.path.join(d, f"node{rank}", "ckpt")
    _previous(local)
    out["per_node"] = _save(local, rank, committer=True, per_node=True, data=b"E")
    out["per_node_tree"] = _tree(local)
    # 7. both committers on one shared filesystem: rank 0's swap takes the staging directory away
    out["shared_per_node"] = _save(shared, rank, committer=True, per_node=True, data=b"F")
    agree(None, RuntimeError)
    out["shared_tree"] = _tree(shared)
    out["shared_leftovers"] = _leftovers(os.path.dirname(shared))
    return out


def test_two_ranks(tmp_path):
    from test_distributed import gloo_rank, rank_results, spawn_ranks  # tests/ is on sys.path (rootdir conftest)

    d = str(tmp_path)
    assert spawn_ranks(2, gloo_rank, (d, _body), 240) == [0, 0]
    r0, r1 = rank_results(d, 2)
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    assert r0["new"] == r1["new"] == {"token": None}
    # the save: the same token everywhere, each rank's file, the note carried over, the stale file gone
    assert r0["ok"]["token"] == r1["ok"]["token"] and len(r0["ok"]["token"]) == 16
    assert r0["ok"]["visible"] and r1["ok"]["visible"] and "raised" not in r0["ok"] and "raised" not in r1["ok"]
    assert r0["ok_tree"] == {"rank_0.bin": b"B0", "rank_1.bin": b"B1", "notes.txt": b"n"}
    # a failing rank: its own error there, the failing ranks named elsewhere; nothing changed
    assert r1["fail"]["raised"].startswith("OSError") and "injected" in r1["fail"]["raised"]
    assert r0["fail"]["raised"].startswith("RuntimeError: failed on rank(s) [1]: OSError")
    assert r0["fail_unchanged"] is True and r0["fail_leftovers"] == [] and not r0["fail"]["visible"]
    assert r0["veto"] == r1["veto"] == {"token": None}
    # rank 0's swap fails: its OSError there, rank 1 told so; the target and no leftovers
    assert r0["swap_fault"]["raised"].startswith("OSError: [Errno 5]"), r0["swap_fault"]
    assert r1["swap_fault"]["raised"].startswith("RuntimeError: failed on rank(s) [0]")
    assert not r0["swap_fault"]["visible"] and not r1["swap_fault"]["visible"]
    assert r0["swap_unchanged"] is True and r0["swap_leftovers"] == r1["swap_leftovers"] == []
    # node-local disks: each node's copy swapped in by its own committer
    assert r0["per_node_tree"] == {"rank_0.bin": b"E0", "notes.txt": b"n"}
    assert r1["per_node_tree"] == {"rank_1.bin": b"E1", "notes.txt": b"n"}
    assert "raised" not in r0["per_node"] and "raised" not in r1["per_node"]
    # one filesystem, two committers: rank 0's swap holds both files; rank 1 finds nothing to do
    assert "raised" not in r0["shared_per_node"] and "raised" not in r1["shared_per_node"]
    assert r0["shared_tree"] == {"rank_0.bin": b"F0", "rank_1.bin": b"F1", "notes.txt": b"n"}
    assert r0["shared_leftovers"] == []


def _killed_body(rank: int, world: int, d: str) -> dict:
    target = os.path.join(d, "ckpt")
    if rank == 0:
        _previous(target)
    agree(None, RuntimeError)
    staged = dircommit.StagedDir(target)
    token = CollectiveDir.plan(staged, rank=rank, committer=rank == 0, existing_only=True, logger=log)
    cd = CollectiveDir(staged, token, committer=rank == 0, rank=rank, is_checkpoint_entry=ENTRY,
                       what="a test checkpoint", operation="test save", logger=log)
    path = cd.redirect(os.path.join(target, f"rank_{rank}.bin"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"K")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # killed after writing, before the ranks agree
    out: dict = {}
    try:
        cd.agree(None, lambda failed, m: RuntimeError(f"rank(s) {failed}: {m}"))
        out["raised"] = None
    except Exception as e:  # noqa: BLE001 - gloo's error for the lost peer
        out["raised"] = type(e).__name__
    out["unchanged"] = _tree(target) == {"rank_0.bin": b"A0", "rank_1.bin": b"A1", "rank_7.bin": b"stale",
                                         "notes.txt": b"n"}
    out["leftovers"] = _leftovers(d)
    return out


def _killed_rank(rank: int, world: int, port: int, d: str) -> None:
    import pickle

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out = _killed_body(rank, world, d)
    except BaseException as e:  # noqa: BLE001
        out = {"error": repr(e)}
    with open(os.path.join(d, f"result-{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
    os._exit(0)  # the group cannot be left cleanly without its peer


def test_a_rank_killed_before_the_commit_leaves_the_previous_directory(tmp_path):
    """Rank 1 is SIGKILLed after writing its file into the staging directory: rank 0 raises (gloo
    loses its peer), the target is exactly the previous checkpoint, and the next save's cleanup
    removes the killed save's staging directory."""
    from test_distributed import rank_results, spawn_ranks

    d = str(tmp_path)
    assert spawn_ranks(2, _killed_rank, (d,), 240) == [0, -signal.SIGKILL]
    r0 = rank_results(d, 2)[0]
    assert r0["raised"] is not None and r0["unchanged"] is True, r0
    assert len(r0["leftovers"]) == 1 and r0["leftovers"][0].startswith(dircommit.staging_name("ckpt", "")), r0
    dircommit.StagedDir(str(tmp_path / "ckpt")).clean_leftovers(operation="test", logger=log,
                                                                 fsync_after_restore=False)
    assert _leftovers(d) == []


def test_one_process(tmp_path):
    """Without torch.distributed: a world of one (rank 0 commits; no transport)."""
    target = str(tmp_path / "ckpt")
    assert _save(target, 0, committer=True) == {"token": None}  # no target yet: not staged
    _previous(target)
    out = _save(target, 0, committer=True)
    assert out["visible"] and "raised" not in out
    assert _tree(target) == {"rank_0.bin": b"B0", "notes.txt": b"n"}  # rank_1 and rank_7: stale, gone
    assert WorldExchange().gather(5) == [5] and WorldExchange().broadcast(5) == 5
    out = _save(target, 0, committer=True, fail=True, data=b"C")
    assert out["raised"].startswith("OSError") and not out["visible"]
    assert _tree(target) == {"rank_0.bin": b"B0", "notes.txt": b"n"} and _leftovers(str(tmp_path)) == []


def test_list_exchange_over_a_frameworks_list_collectives():
    """ListExchange: the framework's collectives take and return lists (one process here: as
    Accelerate's broadcast_object_list and gather_object in a world of one)."""
    calls: list = []

    def broadcast_list(values: list) -> list:
        calls.append(("broadcast", list(values)))
        return values

    def gather_list(values: list) -> list:
        calls.append(("gather", list(values)))
        return list(values)

    exchange = ListExchange(broadcast_list, gather_list)
    assert exchange.broadcast({"token": "ab"}) == {"token": "ab"} and exchange.gather(3) == [3]
    assert calls == [("broadcast", [{"token": "ab"}]), ("gather", [3])]
    assert agree(None, RuntimeError, exchange=exchange, value="v") == ["v"]
