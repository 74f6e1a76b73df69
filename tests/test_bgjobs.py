"""fastpersist.bgjobs: background jobs whose errors must be collected (the bookkeeping
under async saves and the tiered mode's drains): call order, errors collected once, a
forked child's empty board, and the exit (pending jobs waited for, an error nobody
collected printed with exit status 1), the exit in fresh interpreters."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from functools import partial
from typing import Callable

import pytest

from fastpersist import bgjobs
from subprocs import side_by_side  # tests/ is on sys.path

WORDS = bgjobs.Wording(noun="test job(s)", collect_by="fut.wait()", kept="nothing kept", announce_wait=True)


class Fut(bgjobs.JobFuture):
    def __init__(self, board: bgjobs.JobBoard, name: str) -> None:
        super().__init__(board)
        self.name = name

    @property
    def label(self) -> str:
        return self.name

    def describe(self) -> str:
        return f"test job {self.name}"


@dataclass(eq=False)
class Job:
    future: Fut
    fn: Callable[[], None]


def _run(board: bgjobs.JobBoard, job: Job) -> None:
    try:
        job.fn()
    except Exception as e:  # noqa: BLE001 - the job's error, through its future
        board.settle(job, e)
    else:
        board.settle(job, None)


def _board() -> bgjobs.JobBoard:
    box: list[bgjobs.JobBoard] = []
    box.append(bgjobs.JobBoard(lambda job: _run(box[0], job), "test-bgjobs", WORDS))
    return box[0]


def _job(board: bgjobs.JobBoard, name: str, fn: Callable[[], None] = lambda: None) -> Job:
    return Job(Fut(board, name), fn)


def _fail(exc: BaseException) -> Callable[[], None]:
    def fn() -> None:
        raise exc
    return fn


def test_jobs_run_in_call_order_and_each_error_is_collected_once(caplog: pytest.LogCaptureFixture) -> None:
    board = _board()
    ran: list[str] = []
    jobs = [_job(board, "a", lambda: ran.append("a")), _job(board, "b", _fail(ValueError("b failed"))),
            _job(board, "c", lambda: ran.append("c")), _job(board, "d", _fail(KeyError("d"))),
            _job(board, "e", _fail(OSError(5, "e failed")))]
    for j in jobs:
        board.submit(j)
    assert jobs[-1].future._event.wait(60)
    assert ran == ["a", "c"] and board.snapshot() == [] and all(j.future.done() for j in jobs)
    assert jobs[0].future.wait(0) is True and jobs[0].future.exception(0) is None
    with pytest.raises(ValueError, match="b failed"):
        jobs[1].future.wait()  # collected: not raised by raise_uncollected
    with pytest.raises(ValueError, match="b failed"):
        jobs[1].future.wait()  # the future itself says it every time
    with caplog.at_level(logging.ERROR, logger="fastpersist.bgjobs"):
        with pytest.raises(KeyError):  # the first of the two nobody collected
            board.raise_uncollected()
    assert "1 more test job(s) failed; raising the first" in caplog.text
    board.raise_uncollected()  # both collected
    assert isinstance(jobs[4].future.exception(0), OSError)  # still the future's


def test_raise_uncollected_of_some_futures_leaves_the_others() -> None:
    board = _board()
    a, b = _job(board, "a", _fail(ValueError("a"))), _job(board, "b", _fail(ValueError("b")))
    board.submit(a)
    board.submit(b)
    assert b.future._event.wait(60)
    with pytest.raises(ValueError, match="b"):
        board.raise_uncollected(lambda f: f.label == "b")
    board.raise_uncollected(lambda f: f.label == "b")
    assert isinstance(a.future.exception(0), ValueError)  # collected here
    board.raise_uncollected()


def test_an_added_job_is_pending_but_runs_only_once_started() -> None:
    board = _board()
    held, other = _job(board, "held"), _job(board, "other")
    board.add(held)
    board.submit(other)
    assert other.future.wait(60)
    assert not held.future.done() and board.snapshot() == [held]  # the worker passed it over
    board.start(held)
    assert held.future.wait(60) and board.snapshot() == []


def test_a_run_that_raises_without_settling_fails_its_job_and_the_worker_goes_on() -> None:
    def run(job: Job) -> None:
        if job.future.name == "bad":
            raise RuntimeError("run broke")
        board.settle(job, None)

    board = bgjobs.JobBoard(run, "test-bgjobs", WORDS)
    bad, good = _job(board, "bad"), _job(board, "good")
    board.submit(bad)
    board.submit(good)
    assert good.future.wait(60)
    with pytest.raises(RuntimeError, match="run broke"):
        bad.future.wait(0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_forked_child_starts_with_an_empty_board() -> None:
    board = _board()
    gate = threading.Event()
    failed, blocked = _job(board, "failed", _fail(ValueError("parent's"))), _job(board, "blocked", gate.wait)
    board.submit(failed)
    assert failed.future._event.wait(60)
    board.submit(blocked)  # running in the parent's worker when the child is forked
    pid = os.fork()
    if pid == 0:  # the child: none of the parent's jobs or errors; its own run on a worker of its own
        code = 1
        try:
            board.raise_uncollected()
            assert board.snapshot() == []
            mine = _job(board, "child", _fail(KeyError("child's")))
            board.submit(mine)
            assert mine.future._event.wait(60)
            with pytest.raises(KeyError):
                board.raise_uncollected()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert board.snapshot() == [blocked]
    gate.set()
    assert blocked.future.wait(60)
    with pytest.raises(ValueError, match="parent's"):
        board.raise_uncollected()


# A fresh interpreter ends with a job of a board still pending, failed, or failed and
# collected. argv: the phase of the exit handling (bgjobs.at_shutdown, atexit), the scenario.
EXIT_SCRIPT = """
import atexit, sys, threading
from fastpersist import bgjobs

phase, scenario = sys.argv[1], sys.argv[2]


class Fut(bgjobs.JobFuture):
    label = "job-1"

    def describe(self):
        return "test job job-1"


class Job:
    def __init__(self, fn):
        self.future, self.fn = Fut(board), fn


def run(job):
    try:
        job.fn()
    except Exception as e:
        board.settle(job, e)
    else:
        board.settle(job, None)


words = bgjobs.Wording(noun="test job(s)", collect_by="fut.wait()", kept="nothing kept", announce_wait=True)
board = bgjobs.JobBoard(run, "exit-test", words)
if phase == "shutdown":
    bgjobs.at_shutdown(board.finish_at_exit)
else:
    atexit.register(board.finish_at_exit, True)
announced = threading.Event()


class Stderr:  # the job goes on once the exit handling said it waits for it: pending at exit, certainly
    def write(self, s):
        if "waiting for" in s:
            announced.set()
        return sys.__stderr__.write(s)

    def flush(self):
        sys.__stderr__.flush()


sys.stderr = Stderr()


def finish_at_exit():
    assert announced.wait(120)
    print("job finished", flush=True)


def boom():
    raise ValueError("boom")


if scenario == "pending":
    board.submit(Job(finish_at_exit))
elif scenario == "failed":
    board.submit(Job(boom))
elif scenario == "collected":
    job = Job(boom)
    board.submit(job)
    assert isinstance(job.future.exception(60), ValueError)
    sys.exit(3)
print("script ends", flush=True)
"""


def _exit_run(phase: str, scenario: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", EXIT_SCRIPT, phase, scenario],
                          capture_output=True, text=True, timeout=300)


#: the (phase, scenario) runs of EXIT_SCRIPT the tests below check
EXIT_RUNS = [("shutdown", "pending"), ("atexit", "pending"), ("shutdown", "failed"), ("shutdown", "collected")]


@pytest.fixture(scope="module")
def exit_runs() -> dict:
    """Every run of :data:`EXIT_RUNS`, each its own interpreter, side by side (each imports torch)."""
    return dict(zip(EXIT_RUNS, side_by_side([partial(_exit_run, *run) for run in EXIT_RUNS])))


@pytest.mark.parametrize("phase", ["shutdown", "atexit"])
def test_exit_waits_for_a_pending_job(phase: str, exit_runs: dict) -> None:
    r = exit_runs[phase, "pending"].result()
    assert r.returncode == 0, r.stderr
    assert r.stdout == "script ends\njob finished\n", r.stdout + r.stderr
    assert "fastpersist: waiting for 1 test job(s) before exiting (job-1)" in r.stderr, r.stderr


def test_exit_with_a_failed_job_nobody_collected_prints_it_and_exits_1(exit_runs: dict) -> None:
    r = exit_runs["shutdown", "failed"].result()  # atexit's: tests/test_exit_abort.py (async saves)
    assert r.returncode == bgjobs.EXIT_STATUS == 1, (r.returncode, r.stderr)
    assert "fastpersist: test job job-1 failed: ValueError: boom" in r.stderr, r.stderr
    assert ("fastpersist: 1 test job(s) failed and nobody collected the error (fut.wait()); exit status 1"
            in r.stderr), r.stderr


def test_exit_after_the_error_was_collected_keeps_the_scripts_status(exit_runs: dict) -> None:
    r = exit_runs["shutdown", "collected"].result()
    assert r.returncode == 3, r.stderr
    assert "failed" not in r.stderr, r.stderr
