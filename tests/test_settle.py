"""fastpersist.settle (every future settled, the first error raised, the rest logged) and
fastpersist.commit.write_small_file (DeepSpeed's ``latest``: atomic and durable)."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from fastpersist.commit import write_small_file
from fastpersist.settle import PendingSaves, settle
from fastpersist.testing import inject_fault

log = logging.getLogger("test_settle")


class _Future:
    def __init__(self, error=None, done=True):
        self.error, self._done, self.waited = error, threading.Event(), False
        if done:
            self._done.set()

    def done(self):
        return self._done.is_set()

    def wait(self):
        self._done.wait(60)
        self.waited = True
        if self.error is not None:
            raise self.error


def test_settle_waits_for_every_future_and_raises_the_first_error(caplog):
    futures = [_Future(), _Future(ValueError("first")), _Future(), _Future(OSError("second"))]
    settled = []
    with caplog.at_level(logging.ERROR), pytest.raises(ValueError, match="first"):
        settle(futures, what="checkpoint 'x'", logger=log, on_settled=settled.append)
    assert all(f.waited for f in futures) and settled == futures
    assert any("second" in r.getMessage() and "checkpoint 'x'" in r.getMessage() for r in caplog.records)
    with pytest.raises(KeyError):  # an error met before comes first
        settle([_Future(ValueError("later"))], errors=[KeyError("earlier")], logger=log)
    settle([_Future(), _Future()])  # no error: returns


def test_pending_saves_collects_finished_ones_and_keeps_the_rest():
    pending = PendingSaves()
    running = _Future(done=False)
    failed = _Future(RuntimeError("boom"))
    for f in (_Future(), running, failed):
        pending.add(f)
    assert len(pending) == 3 and pending.running() == 1
    with pytest.raises(RuntimeError, match="boom"):
        pending.collect(block=False)
    assert list(pending) == [running] and not running.waited
    threading.Timer(0.05, running._done.set).start()
    pending.collect(block=True)  # waits for it
    assert running.waited and len(pending) == 0


def test_write_small_file(tmp_path):
    path = tmp_path / "latest"
    write_small_file(path, b"global_step1")
    assert path.read_bytes() == b"global_step1"
    with inject_fault("rename", 1, "EIO"), pytest.raises(OSError):
        write_small_file(path, b"global_step2")
    assert path.read_bytes() == b"global_step1"  # the previous bytes, whole
    assert os.listdir(tmp_path) == ["latest"]  # no temporary file left
    write_small_file(path, b"global_step2")
    assert path.read_bytes() == b"global_step2"
