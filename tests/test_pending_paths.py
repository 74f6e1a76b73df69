"""The process-wide registry of pending async saves (issue 23 case 3, core part).

Any reader in the process (``fastpersist.load``/``verify``/``open``, and through the
Lightning adapter Lightning's own checks) must see the finished file of a
``save_async`` still in flight, whoever started it. The finisher is slowed down
(``slow_finisher``) so that a save is certainly still pending when the reader runs:
without the registry those reads find no file.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

import fastpersist
from fastpersist import asyncsave


def _state(step: int) -> dict:
    return {"w": torch.arange(64, dtype=torch.float32) * step, "step": step}


def test_pending_paths_lists_the_save_until_it_is_committed(tmp_path, slow_finisher):
    path = tmp_path / "a.pt"
    fut = fastpersist.save_async(_state(1), path)
    assert os.path.realpath(path) in [os.path.realpath(p) for p in asyncsave.pending_paths()]
    assert not path.exists()
    assert asyncsave.wait_for_path(str(path)) is True
    assert fut.done() and path.exists()
    assert asyncsave.pending_paths() == []


def test_load_waits_for_a_pending_save_of_the_same_path(tmp_path, slow_finisher):
    path = tmp_path / "a.pt"
    fastpersist.save(_state(1), path)
    fastpersist.save_async(_state(2), path)
    got = fastpersist.load(path)  # the newest state, not the previous file
    assert got["step"] == 2 and torch.equal(got["w"], _state(2)["w"])


def test_load_of_a_new_path_waits_instead_of_file_not_found(tmp_path, slow_finisher):
    path = tmp_path / "new.pt"
    fastpersist.save_async(_state(3), path)
    assert fastpersist.load(path)["step"] == 3


def test_verify_and_open_wait(tmp_path, slow_finisher):
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    fastpersist.save_async(_state(4), a)
    assert fastpersist.verify(a).ok
    fastpersist.save_async(_state(5), b)
    with fastpersist.open(b) as reader:
        assert torch.equal(reader.get("w"), _state(5)["w"])


def test_verify_of_a_directory_waits_for_files_below_it(tmp_path, slow_finisher):
    sub = tmp_path / "ckpt"
    sub.mkdir()
    fastpersist.save_async(_state(6), sub / "x.pt")
    assert asyncsave.wait_for_dir(str(tmp_path)) is True
    assert (sub / "x.pt").exists()


def test_wait_for_path_of_other_paths_returns_at_once(tmp_path, slow_finisher):
    fastpersist.save_async(_state(7), tmp_path / "a.pt")
    assert asyncsave.wait_for_path(str(tmp_path / "b.pt"), timeout=0) is True
    assert asyncsave.wait_for_dir(str(tmp_path / "elsewhere"), timeout=0) is True
    assert asyncsave.wait_for_path(str(tmp_path / "a.pt"), timeout=0) is False  # still pending


def test_a_failed_pending_save_leaves_the_previous_file_for_the_reader(tmp_path, monkeypatch):
    path = tmp_path / "a.pt"
    fastpersist.save(_state(1), path)
    original = asyncsave._finish

    def failing(job):
        threading.Event().wait(0.5)
        job.writes = []
        job.crc = None
        job.fields = None
        job.feed = None
        os.unlink(job.tmp)  # the rename then fails: the save fails, the old file stays
        original(job)

    monkeypatch.setattr(asyncsave, "_finish", failing)
    fut = fastpersist.save_async(_state(2), path)
    assert fastpersist.load(path)["step"] == 1  # waited, then read what is there
    with pytest.raises(OSError):
        fut.wait()


def _child_saves(path: str) -> None:
    asyncsave._finish = _slow(asyncsave._finish)
    fastpersist.save_async(_state(8), path)  # the child returns at once; multiprocessing then os._exit()s


def _slow(original):
    def finish(job):
        threading.Event().wait(0.5)
        original(job)
    return finish


def test_a_forked_multiprocessing_child_finishes_its_saves_before_exit(tmp_path):
    """multiprocessing's fork children leave through os._exit (no atexit): Lightning's
    ddp_fork/ddp_spawn workers save their last weights that way."""
    import multiprocessing

    path = str(tmp_path / "child.pt")
    child = multiprocessing.get_context("fork").Process(target=_child_saves, args=(path,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert fastpersist.load(path)["step"] == 8
