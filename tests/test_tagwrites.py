"""fastpersist.tagwrites: a run's tag directory (SAVE_DIR/TAG) written one file per call by every
rank and committed by a later call, then the pointer file (DeepSpeed's save_dir/TAG and latest).
A world of one on real directories, and two gloo ranks writing a replica together."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import fastpersist
from fastpersist.ranks import whole_world
from fastpersist.tagwrites import TagWrites, tag_dir


def _writes() -> TagWrites:
    return TagWrites(is_checkpoint_entry=lambda n: n.endswith(".pt"), what="a test checkpoint",
                     operation="test_save")


def _save_tag(w: TagWrites, run: str, tag: str, files: dict, *, save=fastpersist.save, save_async=None,  # noqa: ANN001
              update_pointer: bool = True) -> None:
    w.open(run, tag, rank=0)
    w.makedirs(tag_dir(run, tag), exist_ok=True)  # as the framework does
    for name, value in files.items():
        w.save({"w": torch.full((4,), value)}, os.path.join(run, tag, name), save=save, save_async=save_async)
    w.commit(run, tag, rank=0, update_pointer=update_pointer)


def _values(directory) -> dict:  # noqa: ANN001
    return {n: fastpersist.load(os.path.join(directory, n))["w"][0].item() for n in sorted(os.listdir(directory))
            if n.endswith(".pt")}


def _hidden(run: str) -> list:
    return sorted(n for n in os.listdir(run) if n.startswith("."))


def test_new_tag_then_a_resave_staged_and_the_pointer_last(tmp_path):
    run = str(tmp_path / "run")
    w = _writes()
    _save_tag(w, run, "step1", {"a.pt": 1.0, "b.pt": 1.0})
    assert _values(tag_dir(run, "step1")) == {"a.pt": 1.0, "b.pt": 1.0}
    assert open(os.path.join(run, "latest")).read() == "step1"
    (tmp_path / "run" / "step1" / "notes.txt").write_text("user")
    w.open(run, "step1", rank=0)  # the tag exists: staged
    assert w.stage is not None and w.key == (run, "step1")
    w.save({"w": torch.full((4,), 2.0)}, os.path.join(run, "step1", "a.pt"), save=fastpersist.save)
    assert _values(tag_dir(run, "step1"))["a.pt"] == 1.0  # nothing visible before the commit
    w.commit(run, "step1", rank=0, update_pointer=False)
    assert sorted(os.listdir(tag_dir(run, "step1"))) == ["a.pt", "notes.txt"]  # b.pt was the old save's
    assert fastpersist.load(os.path.join(run, "step1", "a.pt"))["w"][0].item() == 2.0
    assert _hidden(run) == []


def test_a_failed_file_fails_the_commit_and_keeps_the_previous_tag_and_pointer(tmp_path):
    run = str(tmp_path / "run")
    w = _writes()
    _save_tag(w, run, "step1", {"a.pt": 1.0})

    def failing(obj, path, **kwargs):  # noqa: ANN001, ANN003, ANN202
        raise OSError(errno.ENOSPC, "injected", os.fspath(path))

    w.open(run, "step1", rank=0)
    w.save({"w": torch.zeros(4)}, os.path.join(run, "step1", "a.pt"), save=failing)  # held, not raised
    with pytest.raises(OSError) as info:
        w.commit(run, "step1", rank=0)
    assert info.value.errno == errno.ENOSPC
    assert _values(tag_dir(run, "step1")) == {"a.pt": 1.0} and _hidden(run) == []
    with pytest.raises(OSError):  # a new tag written in place: the pointer still names the old one
        _save_tag(w, run, "step2", {"a.pt": 2.0}, save=failing)
    assert open(os.path.join(run, "latest")).read() == "step1"


def test_background_saves_settle_at_the_commit(tmp_path):
    run = str(tmp_path / "run")
    w = _writes()
    _save_tag(w, run, "step1", {"a.pt": 3.0}, save_async=fastpersist.save_async)
    assert len(w.pending) == 0 and _values(tag_dir(run, "step1")) == {"a.pt": 3.0}
    w.open(run, "step2", rank=0, handle="info-2")
    assert w.uncommitted == "info-2"
    w.abandon(RuntimeError("save_checkpoint raised"), deferred=True)  # its commit comes later: it fails then
    with pytest.raises(RuntimeError, match="save_checkpoint raised"):
        w.commit(run, "step2", rank=0)
    assert w.uncommitted is None and open(os.path.join(run, "latest")).read() == "step1"
    w.open(run, "step1", rank=0, handle="info-1")
    assert w.stage is not None
    w.abandon(RuntimeError("save_checkpoint raised"), deferred=False)  # forgotten: no commit will come
    assert w.stage is None and w.key is None and w.uncommitted is None


def _replica_body(rank: int, world: int, d: str) -> dict:  # also: node-local commits, ranks.whole_world
    import torch.distributed as dist

    w = _writes()
    run = os.path.join(d, "run")
    w.open(run, "step1", rank=rank)
    w.makedirs(tag_dir(run, "step1"), exist_ok=True)
    state = {"w": torch.arange(8, dtype=torch.float32)}
    w.save(state, os.path.join(run, "step1", "model.pt"), save=fastpersist.save, group=dist.group.WORLD)
    w.save({"r": torch.full((2,), float(rank))}, os.path.join(run, "step1", f"optim_{rank}.pt"),
           save=fastpersist.save)
    w.commit(run, "step1", rank=rank)
    local = os.path.join(d, f"node{rank}", "run")  # each node's own disk: each node's local rank 0 commits
    for value in (1.0, 2.0):  # the second save staged (the tag exists) and swapped in on both nodes
        w.open(local, "step1", rank=rank, node_local=True, local_rank=0)
        w.makedirs(tag_dir(local, "step1"), exist_ok=True)
        w.save({"v": torch.full((2,), value + rank)}, os.path.join(local, "step1", "optim.pt"), save=fastpersist.save)
        w.commit(local, "step1", rank=rank)
    small = dist.new_group([0])  # every rank creates it
    return {"local": sorted(os.listdir(os.path.dirname(local))), "whole": whole_world(dist.group.WORLD) is not None,
            "part": whole_world(small) is None}


def test_two_ranks_write_a_replica_together(tmp_path):
    from test_distributed import gloo_rank, rank_results, spawn_ranks  # tests/ is on sys.path (rootdir conftest)

    d = str(tmp_path)
    assert spawn_ranks(2, gloo_rank, (d, _replica_body), 240) == [0, 0]
    r0, r1 = rank_results(d, 2)
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    assert r0["whole"] and r0["part"] and r1["whole"] and r1["part"]
    assert r0["local"] == r1["local"] == ["run"]  # no staging directory left on either node
    for rank in (0, 1):
        local = os.path.join(d, f"node{rank}", "run", "step1", "optim.pt")
        assert fastpersist.load(local)["v"][0].item() == 2.0 + rank
    tag = os.path.join(d, "run", "step1")
    assert sorted(os.listdir(tag)) == ["model.pt", "optim_0.pt", "optim_1.pt"]
    assert torch.equal(fastpersist.load(os.path.join(tag, "model.pt"))["w"], torch.arange(8, dtype=torch.float32))
    assert fastpersist.load(os.path.join(tag, "optim_1.pt"))["r"][0].item() == 1.0
    assert open(os.path.join(d, "run", "latest")).read() == "step1"


def test_asking_pointer_decides_the_commit_of_the_tag_opened_in_the_block(tmp_path):
    """A save call that told the framework not to write the pointer (in place) asks for it
    here: the commit of the tag opened in the block replaces it, even after the block and with
    ``update_pointer`` false (a deferred commit); asked False, or another tag's commit, or a
    dropped tag: the pointer stays."""
    run = str(tmp_path / "run")
    w = _writes()
    _save_tag(w, run, "step1", {"a.pt": 1.0})
    pointer = os.path.join(run, "latest")
    with w.asking_pointer(False):
        _save_tag(w, run, "step2", {"a.pt": 2.0}, update_pointer=False)
    assert open(pointer).read() == "step1"
    with w.asking_pointer(True):
        w.open(run, "step3", rank=0)
        w.makedirs(tag_dir(run, "step3"), exist_ok=True)
        w.save({"w": torch.full((4,), 3.0)}, os.path.join(run, "step3", "a.pt"), save=fastpersist.save)
    assert open(pointer).read() == "step1"  # not before the commit
    inode = os.stat(pointer).st_ino
    w.commit(run, "step3", rank=0, update_pointer=False)
    assert open(pointer).read() == "step3" and os.stat(pointer).st_ino != inode  # replaced, not rewritten
    assert _values(tag_dir(run, "step3")) == {"a.pt": 3.0}
    with w.asking_pointer(True):
        w.open(run, "step4", rank=0)
    w.drop()
    _save_tag(w, run, "step5", {"a.pt": 5.0}, update_pointer=False)
    assert open(pointer).read() == "step3"
