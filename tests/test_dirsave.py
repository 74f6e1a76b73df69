"""fastpersist.dirsave and fastpersist.retention: a framework call that writes a whole checkpoint
directory, made atomic (staged and swapped in; in place where it cannot be staged), the
previous directory kept on failure, and retention only after the new one is durable. One
process (a world of one); the two-rank protocol is tests/test_collectivedir.py's."""

from __future__ import annotations

import logging
import os
import pathlib
import re

import pytest

from fastpersist import dircommit, dirsave, retention
from fastpersist.collectivedir import WorldExchange

ENTRY = re.compile(r"model\.bin|optimizer\.bin").fullmatch


def _tree(directory) -> dict:  # noqa: ANN001
    return {str(p.relative_to(directory)): p.read_bytes() for p in pathlib.Path(directory).rglob("*") if p.is_file()}


def _leftovers(directory) -> list:  # noqa: ANN001
    return sorted(n for n in os.listdir(directory) if n.startswith(".fastpersist-"))


def _writer(files: dict, seen: list, fail: bool = False):  # noqa: ANN202
    def write(staging):  # noqa: ANN001, ANN202 - the framework's call: returns the path it wrote
        seen.append(staging)
        out = pathlib.Path(staging) if staging is not None else None
        for name, data in files.items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_bytes(data)
        if fail:
            raise OSError(28, "injected: no space left", str(out))
        return out

    return write


def _save(staged, write, **kwargs):  # noqa: ANN001, ANN202
    return dirsave.save_directory(staged, write, rank=0, committer=True, exchange=WorldExchange(),
                                  is_checkpoint_entry=ENTRY, what="a test checkpoint", operation="test_save", **kwargs)


def test_staged_save_replaces_the_directory_and_keeps_it_on_failure(tmp_path):
    final = tmp_path / "ckpt"
    seen: list = []
    got = _save(dirsave.CheckpointDir(str(final)), _writer({"model.bin": b"A"}, seen))
    assert got == final and isinstance(got, pathlib.Path)  # the staging path given back as the final one
    assert seen[0] != str(final) and os.path.dirname(seen[0]) == str(tmp_path)
    (final / "notes.txt").write_bytes(b"user")
    (final / "optimizer.bin").write_bytes(b"stale")
    after: list = []
    _save(dirsave.CheckpointDir(str(final)), _writer({"model.bin": b"B"}, seen), after=after.append)
    assert _tree(final) == {"model.bin": b"B", "notes.txt": b"user"}  # a stale entry gone, the note carried over
    assert after == [str(final)] and _leftovers(tmp_path) == []
    rolled: list = []
    with pytest.raises(OSError, match="injected"):
        _save(dirsave.CheckpointDir(str(final)), _writer({"model.bin": b"C"}, seen, fail=True),
              rollback=lambda: rolled.append(True), after=after.append)
    assert _tree(final) == {"model.bin": b"B", "notes.txt": b"user"} and _leftovers(tmp_path) == []
    assert rolled == [True] and after == [str(final)]


def test_listed_parent_stages_one_level_up_and_gives_siblings_back(tmp_path):
    listed = tmp_path / "checkpoints"
    listed.mkdir()
    staged = dirsave.CheckpointDir(str(listed / "checkpoint_3"), listed=str(listed),
                                   siblings=re.compile(r"checkpoint_[0-9]+").fullmatch)
    assert staged.stage_parent == str(tmp_path)
    seen: list = []
    _save(staged, _writer({"model.bin": b"A"}, seen))
    assert os.path.dirname(seen[0]) == str(tmp_path) and os.listdir(listed) == ["checkpoint_3"]
    # a killed fallback commit of checkpoint_1 left it moved aside in the project directory: given back
    (tmp_path / dircommit.old_name("checkpoint_1", "0123456789abcdef")).mkdir()
    staged.clean_leftovers(operation="test", logger=logging.getLogger("t"), fsync_after_restore=False)
    assert sorted(os.listdir(listed)) == ["checkpoint_1", "checkpoint_3"] and _leftovers(tmp_path) == []


def test_in_place_when_not_staged_and_a_new_partial_directory_removed(tmp_path, caplog):
    final = tmp_path / "ckpt"
    staged = dirsave.CheckpointDir(str(final))
    staged.why_not_staged = lambda: "a test reason"  # what a rank would see on another filesystem
    seen: list = []

    def write(staging):  # noqa: ANN001, ANN202 - writes in place when not staged
        seen.append(staging)
        return _writer({"model.bin": b"A"}, [], fail=True)(str(final))

    with caplog.at_level(logging.WARNING), pytest.raises(OSError, match="injected"):
        _save(staged, write, remove_new_on_failure=True)
    assert seen == [None] and not final.exists()  # never a partial checkpoint left to resume from
    assert any("a test reason" in r.getMessage() for r in caplog.records)
    after: list = []
    got = _save(staged, lambda staging: _writer({"model.bin": b"B"}, [])(str(final)), after=after.append)
    assert got == final and _tree(final) == {"model.bin": b"B"} and after == [str(final)]


def test_retention_deletes_the_oldest_by_number(tmp_path):
    for n in (0, 1, 2, 9, 10):
        (tmp_path / f"checkpoint_{n}").mkdir()
    assert retention.checkpoint_number(str(tmp_path / "checkpoint_12")) == 12
    with pytest.raises(ValueError, match="no number"):
        retention.checkpoint_number("/a1/checkpoint")
    gone = retention.prune(str(tmp_path), 3, str(tmp_path / "checkpoint_10"))
    assert [os.path.basename(p) for p in gone] == ["checkpoint_0", "checkpoint_1"]  # with the new one, 3 remain
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_10", "checkpoint_2", "checkpoint_9"]
    assert retention.prune(str(tmp_path), 3, str(tmp_path / "checkpoint_10")) == []


def test_the_committers_own_files_are_synced_once_by_the_commit(tmp_path):
    """In a staged save the committing process's fastpersist saves skip their own fsyncs (every
    fsync fails here, yet the files are written); the commit's fsync of the tree covers them: it
    fails, and the previous directory stays as it was."""
    import torch

    import fastpersist
    from fastpersist.testing import inject_fault

    final = tmp_path / "ckpt"
    _save(dirsave.CheckpointDir(str(final)), _writer({"model.bin": b"A"}, []))
    written: list = []

    def write(staging):  # noqa: ANN001, ANN202
        os.makedirs(staging, exist_ok=True)  # as the framework does
        for name in ("model.bin", "optimizer.bin"):
            fastpersist.save({"w": torch.arange(4.0)}, os.path.join(staging, name))
            written.append(name)
        fastpersist.save_file({"w": torch.ones(3)}, os.path.join(staging, "model.safetensors"))
        written.append("model.safetensors")
        return staging

    with inject_fault("fsync", 1, "EIO", count=1000), pytest.raises(OSError) as err:
        _save(dirsave.CheckpointDir(str(final)), write)
    assert written == ["model.bin", "optimizer.bin", "model.safetensors"]  # no save fsynced on its own
    assert err.value.errno == 5
    assert _tree(final) == {"model.bin": b"A"} and _leftovers(tmp_path) == []
    # outside a staged commit a save fsyncs itself: the same fault fails it
    with inject_fault("fsync", 1, "EIO", count=1000), pytest.raises(OSError):
        fastpersist.save({"w": torch.arange(4.0)}, str(tmp_path / "alone.pt"))
    # without faults: the saved files are there and load
    written.clear()
    _save(dirsave.CheckpointDir(str(final)), write)
    assert torch.equal(fastpersist.load(str(final / "optimizer.bin"))["w"], torch.arange(4.0))
    assert torch.equal(fastpersist.load_file(str(final / "model.safetensors"))["w"], torch.ones(3))
