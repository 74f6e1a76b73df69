"""fastpersist.rankwrites: one rank's files of a checkpoint directory written one call at a time
(DeepSpeed's CheckpointEngine): redirected into the save's staging directory, a failed file
held for the commit, background saves settled and directories fsynced before the commit."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import fastpersist
from fastpersist import dircommit
from fastpersist.collectivedir import CollectiveDir, conclude, failed_elsewhere
from fastpersist.rankwrites import RankWrites

ELSEWHERE = failed_elsewhere("test checkpoint", after="nothing changed")


def _open(target: str) -> CollectiveDir:
    stage = CollectiveDir.open(dircommit.StagedDir(target), rank=0, committer=True, existing_only=True,
                               is_checkpoint_entry=lambda n: n.endswith(".pt"), what="a test checkpoint",
                               operation="test", logger=logging.getLogger("t"))
    assert stage is not None
    return stage


def test_staged_writes_settle_and_commit(tmp_path):
    target = tmp_path / "tag"
    (target / "old").mkdir(parents=True)
    (target / "old" / "a.pt").write_bytes(b"old")
    w = RankWrites()
    w.begin(_open(str(target)))
    made = w.makedirs(str(target / "new"))
    assert made != str(target / "new") and os.path.isdir(made)  # in the staging directory
    path = w.path(str(target / "old" / "a.pt"))  # its folder made there too
    w.write(path, lambda: w.track(fastpersist.save_async({"x": torch.arange(4)}, path)))
    assert w.settle("test checkpoint", also=[str(target)]) is None and len(w.pending) == 0
    conclude(w.stage, None, ELSEWHERE)
    assert torch.equal(fastpersist.load(str(target / "old" / "a.pt"))["x"], torch.arange(4))
    assert os.path.isdir(target / "new") and [n for n in os.listdir(tmp_path) if n.startswith(".")] == []


def test_a_failed_file_is_held_for_the_commit(tmp_path):
    target = tmp_path / "tag"
    target.mkdir()
    (target / "a.pt").write_bytes(b"previous")
    w = RankWrites()
    w.begin(_open(str(target)))
    path = w.path(str(target / "a.pt"))

    def fails() -> None:
        raise OSError(28, "injected", path)

    w.write(path, fails)  # not raised here: the other ranks would wait for this one
    w.fail(RuntimeError("later"))  # the first failure wins
    error = w.settle("test checkpoint")
    assert isinstance(error, OSError) and "injected" in str(error)
    with pytest.raises(OSError) as info:
        conclude(w.stage, error, ELSEWHERE)
    assert info.value is error
    assert (target / "a.pt").read_bytes() == b"previous"
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []  # the staging directory removed


def test_unstaged_and_empty_saves(tmp_path):
    w = RankWrites()
    w.begin(None)
    assert w.path(str(tmp_path / "x.pt")) == str(tmp_path / "x.pt")
    assert w.settle("test") is None
    conclude(None, None, ELSEWHERE)  # nothing to agree on in a world of one
    target = tmp_path / "tag"
    target.mkdir()
    stage = _open(str(target))  # staged, but no file of this save went there: removed, target untouched
    os.makedirs(stage.staging)
    conclude(stage, None, ELSEWHERE)
    assert not os.path.exists(stage.staging) and target.is_dir()
    assert str(ELSEWHERE([1], "OSError: x")) == "test checkpoint failed on another rank: rank(s) [1]: OSError: x; " \
                                                "nothing changed"


def test_blocking_saves_are_fsynced_once_at_settle(tmp_path):
    """A blocking fastpersist save through write() skips its own fsyncs (every fsync fails here,
    yet the save succeeds); settle fsyncs the file and reports the failure as the rank's error."""
    import torch

    import fastpersist
    from fastpersist.testing import inject_fault

    w = RankWrites()
    w.begin(None)
    target = str(tmp_path / "mp_rank_00_model_states.pt")
    w.path(target)
    with inject_fault("fsync", 1, "EIO", count=1000):
        w.write(target, lambda: fastpersist.save({"w": torch.arange(3.0)}, target))
        assert w.error is None and w.unsynced == [target]
        error = w.settle("checkpoint 'x'")
    assert isinstance(error, OSError) and error.errno == 5 and target in str(error)
    w.begin(None)
    w.write(target, lambda: fastpersist.save({"w": torch.arange(3.0)}, target))
    assert w.settle("checkpoint 'x'") is None and w.unsynced == []
    assert torch.equal(fastpersist.load(target)["w"], torch.arange(3.0))
