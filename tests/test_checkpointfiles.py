"""fastpersist.checkpointfiles: one checkpoint file per call, blocking or in the background,
with the pending saves finished before loads and removals (real files, real async saves)."""

from __future__ import annotations

import errno
import pickle
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import fastpersist
from fastpersist import _native, asyncsave, checkpointfiles
from fastpersist.checkpointfiles import CheckpointFiles


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Every async save stays in flight (its file not renamed into place) until the
    returned event is set; :func:`release_soon` sets it from another thread."""
    release = threading.Event()
    original = asyncsave._finish

    def finish(job: Any) -> None:
        release.wait(120)
        original(job)

    monkeypatch.setattr(asyncsave, "_finish", finish)
    yield release
    release.set()
    fastpersist.wait_all()


def release_soon(release: threading.Event) -> None:
    """Set ``release`` from another thread: a wait the test runs next must block until then
    (had it returned before, the file it waited for would be missing)."""
    threading.Timer(0.2, release.set).start()


def _state(n: int) -> dict:
    return {"state_dict": {"w": torch.full((64, 64), float(n))}, "epoch": n}


def test_blocking_save_and_load_round_trip(tmp_path: Path) -> None:
    files = CheckpointFiles(async_save=False)
    path = tmp_path / "new" / "a.ckpt"  # the folder is created
    files.save_file(_state(1), path)
    stock = torch.load(path, weights_only=True)
    assert stock["epoch"] == 1 and torch.equal(stock["state_dict"]["w"], _state(1)["state_dict"]["w"])
    got = files.load_file(f"file://{path}", weights_only=True)
    assert got["epoch"] == 1 and torch.equal(got["state_dict"]["w"], stock["state_dict"]["w"])
    assert files.counts == {"save": 1, "save_async": 0, "save_group": 0, "load": 1, "load_group": 0, "torch": 0}


def test_background_saves_finish_before_loads_and_removals(tmp_path: Path, held: threading.Event) -> None:
    files = CheckpointFiles()
    assert files.async_save
    files.save_file(_state(1), tmp_path / "a.ckpt")
    files.save_file(_state(2), tmp_path / "b.ckpt")
    assert files.pending == 2 and not (tmp_path / "a.ckpt").exists()
    release_soon(held)
    assert files.load_file(tmp_path / "b.ckpt", weights_only=True)["epoch"] == 2
    assert files.pending == 0 and (tmp_path / "a.ckpt").exists()
    files.save_file(_state(3), tmp_path / "c.ckpt")
    assert files.remove_object(tmp_path / "a.ckpt") is False  # a file: the caller's to remove
    assert files.pending == 0 and (tmp_path / "c.ckpt").exists()
    assert files.counts["save_async"] == 3


def test_a_pickled_copy_has_no_pending_saves_and_finish_all(tmp_path: Path, held: threading.Event) -> None:
    files = CheckpointFiles(mode="snapshot")
    files.save_file(_state(1), tmp_path / "a.ckpt")
    copy = pickle.loads(pickle.dumps(files))
    assert files.pending == 1 and copy.pending == 0 and copy.mode == "snapshot"
    release_soon(held)
    checkpointfiles.finish_all()
    assert files.pending == 0 and copy.load_file(tmp_path / "a.ckpt", weights_only=True)["epoch"] == 1


def test_other_urls_are_passed_on_after_pending_saves(tmp_path: Path, held: threading.Event) -> None:
    files = CheckpointFiles()
    files.save_file(_state(1), tmp_path / "a.ckpt")
    assert not files.passes_on(tmp_path / "a.ckpt") and not files.passes_on("s3://bucket/a.ckpt")
    assert files.pending == 1
    release_soon(held)
    assert files.passes_on("memory://x/a.ckpt")
    assert files.pending == 0 and files.counts["torch"] == 1
    with pytest.raises(ValueError, match="memory://x/a.ckpt"):
        files.save_file(_state(1), "memory://x/a.ckpt")


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found: .*nothing.ckpt"):
        CheckpointFiles().load_file(tmp_path / "nothing.ckpt")


@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_save_raises_and_keeps_the_previous_file(tmp_path: Path, async_save: bool) -> None:
    files = CheckpointFiles(async_save=async_save)
    path = tmp_path / "a.ckpt"
    files.save_file(_state(1), path)
    files.finalize()
    before = path.read_bytes()
    _native.set_fault("write", 1, "ENOSPC")
    try:
        with pytest.raises(OSError) as info:
            files.save_file(_state(2), path)
            files.finalize()  # a background save's error surfaces here
    finally:
        _native.clear_faults()
    assert info.value.errno == errno.ENOSPC and str(path) in str(info.value)
    assert path.read_bytes() == before and files.pending == 0
    assert files.load_file(path, weights_only=True)["epoch"] == 1
