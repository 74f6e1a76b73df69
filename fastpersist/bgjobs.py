"""Background jobs whose errors must be collected.

A mode that goes on working after its call returned (asynchronous saves, the tiered
mode's drains to object storage) keeps its jobs on a :class:`JobBoard`:

- a job is *added* when its call captured what it needs (from then on it is pending:
  readers and guards can see it) and *started* when it may run; a worker thread of the
  board's own (a daemon, started on first use) runs the started jobs one at a time, in
  the order they were added, and *settles* each: its :class:`JobFuture` is then done,
  with the job's error or without;
- an error is *collected* when a caller gets it (``JobFuture.wait()``/``exception()``,
  or :meth:`JobBoard.raise_uncollected`, which the mode's next call and its "wait for
  everything" function call). Each error is collected once;
- at exit (:meth:`JobBoard.finish_at_exit`) the pending jobs are waited for; each error
  nobody collected is printed on stderr and the process then exits with status
  :data:`EXIT_STATUS` (as with an uncaught exception; ``_native.set_exit_status``);
- a forked child starts with an empty board (the parent's jobs run in the parent).

Where the exit handling runs is the mode's choice: :func:`at_shutdown` (before
``concurrent.futures`` stops accepting work) or ``atexit`` (after every thread but the
daemons ended, before the native exit gate closes).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import sys
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing import util as mp_util
from typing import Any, Callable, Optional

from fastpersist import io as fpio

log = logging.getLogger(__name__)

__all__ = ["EXIT_STATUS", "JobBoard", "JobFuture", "Wording", "at_shutdown"]

#: The exit status of a process that ends with a background job's error nobody collected.
EXIT_STATUS = 1


class JobFuture:
    """The outcome of one background job: done once it succeeded or failed. Subclasses
    name the job (:attr:`label`, :meth:`describe`) for the messages."""

    def __init__(self, board: "JobBoard") -> None:
        self._board = board
        self._event = threading.Event()
        self._exc: Optional[BaseException] = None
        self._reported = False
        self._report_at_exit = True

    @property
    def label(self) -> str:
        """The job's name in lists (a path, a URL)."""
        return repr(self)

    def describe(self) -> str:
        """What the job is, as the messages say it ("asynchronous save of 'x.pt'")."""
        return self.label

    def done(self) -> bool:
        """Whether the job has finished (succeeded, or failed)."""
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the job is done: True; False when ``timeout`` seconds passed
        first. Raises the job's error if it failed (the error is then collected)."""
        if not self._event.wait(timeout):
            return False
        if self._exc is not None:
            self._mark_collected()
            raise self._exc
        return True

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        """The job's error (None if it succeeded), waiting up to ``timeout`` seconds
        (``TimeoutError`` if still running). Counts as collected."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self.describe()} still running")
        if self._exc is not None:
            self._mark_collected()
        return self._exc

    def _succeeded(self) -> bool:
        return self._event.is_set() and self._exc is None

    def _mark_collected(self) -> None:
        self._board.mark_collected(self)


@dataclass(frozen=True)
class Wording:
    """How a board's messages name its jobs.

    ``noun``: its jobs, counted ("asynchronous save(s)"); ``collect_by``: the calls that
    collect an error; ``kept``: what stays when jobs are left unfinished; ``failed_note``:
    appended to each failure printed at exit; ``announce_wait``: say on stderr that the
    exit waits for running jobs."""

    noun: str
    collect_by: str
    kept: str
    failed_note: str = ""
    announce_wait: bool = False


def _reset_after_fork(ref: "weakref.ref[JobBoard]") -> None:
    board = ref()
    if board is not None:
        board.reset()


class JobBoard:
    """The background jobs of one kind in this process (see the module docstring).

    ``run(job)`` runs a started job on the worker thread and settles it
    (:meth:`settle`); a job is any object with a ``future`` attribute (a
    :class:`JobFuture` of this board). ``thread_name`` names the worker thread."""

    def __init__(self, run: Callable[[Any], None], thread_name: str, words: Wording) -> None:
        self.run = run
        self.thread_name = thread_name
        self.words = words
        #: Jobs added and not settled yet, in the order they were added.
        self.pending: deque[Any] = deque()
        self.reset()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=lambda r=weakref.ref(self): _reset_after_fork(r))

    def reset(self) -> None:
        """Forget every job (a forked child's start: the parent's jobs run in the parent)."""
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)
        self.pending.clear()  # in place: callers may hold the deque
        self._started: set[int] = set()
        self._uncollected: list[JobFuture] = []
        self._worker: Optional[threading.Thread] = None
        self._exit_handled = False
        self._mp_pid = 0

    # ---- jobs ----------------------------------------------------------------------

    def snapshot(self) -> list[Any]:
        """The pending jobs, in the order they were added."""
        with self.lock:
            return list(self.pending)

    def add(self, job: Any) -> None:
        """Make ``job`` pending (visible to :meth:`snapshot`); :meth:`start` runs it."""
        with self.lock:
            self.pending.append(job)

    def start(self, job: Any) -> None:
        """Let the worker run ``job`` (added before), after the jobs added before it."""
        with self.lock:
            self._started.add(id(job))
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._work, name=self.thread_name, daemon=True)
                self._worker.start()
            self.cv.notify_all()

    def submit(self, job: Any) -> None:
        """:meth:`add` and :meth:`start`."""
        self.add(job)
        self.start(job)

    def _next(self) -> Any:
        return next((j for j in self.pending if id(j) in self._started and not j.future.done()), None)

    def _work(self) -> None:
        while True:
            with self.lock:
                while (job := self._next()) is None:
                    self.cv.wait()
            try:
                self.run(job)
            except BaseException as e:  # noqa: BLE001 - run() settles its job; a job it did not settle fails
                if job.future.done():
                    log.error("fastpersist: %s: its background job raised after it finished: %s: %s",
                              job.future.describe(), type(e).__name__, e)
                else:
                    self.settle(job, e)

    def settle(self, job: Any, exc: Optional[BaseException], report_at_exit: bool = True) -> None:
        """``job`` finished (``exc``: its error, or None): its future is done and it is no
        longer pending. ``report_at_exit=False``: an error reported by another future
        (it is still raised by :meth:`raise_uncollected`, never printed at exit)."""
        fut = job.future
        with self.lock:
            fut._exc = exc
            if exc is not None:
                fut._report_at_exit = report_at_exit
                self._uncollected.append(fut)
            fut._event.set()
            try:
                self.pending.remove(job)
            except ValueError:
                pass
            self._started.discard(id(job))
            self.cv.notify_all()

    # ---- errors --------------------------------------------------------------------

    def mark_collected(self, fut: JobFuture) -> None:
        """``fut``'s error reached a caller: not to be raised or reported again."""
        with self.lock:
            fut._reported = True
            if fut in self._uncollected:
                self._uncollected.remove(fut)

    def collect(self, match: Optional[Callable[[JobFuture], bool]] = None) -> list[JobFuture]:
        """Take the failed futures nobody collected (those ``match`` accepts), in the
        order they failed; they count as collected."""
        with self.lock:
            taken = [f for f in self._uncollected if match is None or match(f)]
            for f in taken:
                f._reported = True
                self._uncollected.remove(f)
        return taken

    def raise_uncollected(self, match: Optional[Callable[[JobFuture], bool]] = None) -> None:
        """Raise the first error nobody collected (of the futures ``match`` accepts);
        every such error counts as collected (the others are logged as a count)."""
        failed = self.collect(match)
        if not failed:
            return
        if len(failed) > 1:
            log.error("fastpersist: %d more %s failed; raising the first", len(failed) - 1, self.words.noun)
        assert failed[0]._exc is not None
        raise failed[0]._exc

    # ---- exit ----------------------------------------------------------------------

    def finish_at_exit(self, interpreter_exit: bool = True) -> None:
        """Wait for the pending jobs; print the errors nobody collected.

        With such an error the process that ends through the interpreter's exit then
        exits with :data:`EXIT_STATUS` instead of the status it would have had, once
        every other exit handler has run. ``interpreter_exit=False``: called by
        multiprocessing's exit handling (:meth:`finish_in_multiprocessing_children`),
        whose ``fork`` children leave through ``os._exit``: there the error is printed
        only. Runs once per process."""
        if self._exit_handled:  # multiprocessing's exit handling, after the atexit hook of this process
            return
        self._exit_handled = interpreter_exit
        w = self.words
        running = [j.future for j in self.snapshot() if not j.future.done()]
        if running and w.announce_wait:
            names = ", ".join(f.label for f in running[:4]) + (" ..." if len(running) > 4 else "")
            print(f"fastpersist: waiting for {len(running)} {w.noun} before exiting ({names})", file=sys.stderr,
                  flush=True)
        try:
            for f in running:
                f._event.wait()
        except KeyboardInterrupt:
            left = [f.label for f in running if not f.done()]
            print(f"fastpersist: interrupted at exit with {len(left)} {w.noun} unfinished: {left}; {w.kept}",
                  file=sys.stderr, flush=True)
        failed = self.collect(lambda f: f._report_at_exit)
        if not failed:
            return
        for f in failed:
            print(f"fastpersist: {f.describe()} failed: {type(f._exc).__name__}: {f._exc}{w.failed_note}",
                  file=sys.stderr)
        # Set whatever the path: a process that leaves through os._exit never runs the hook.
        status = ""
        if fpio.native_module().set_exit_status(EXIT_STATUS) and (
                interpreter_exit or multiprocessing.parent_process() is None):
            status = f"; exit status {EXIT_STATUS}"
        print(f"fastpersist: {len(failed)} {w.noun} failed and nobody collected the error ({w.collect_by}){status}",
              file=sys.stderr, flush=True)

    def finish_in_multiprocessing_children(self) -> None:
        """A ``multiprocessing`` child (``fork`` start method: Lightning's ``ddp_fork``/
        ``ddp_spawn`` launchers, ``torch.multiprocessing``) leaves through ``os._exit``,
        which skips ``atexit``: run :meth:`finish_at_exit` in multiprocessing's own exit
        handling too. Call it when a job is submitted; it registers once per process (a
        forked child starts with multiprocessing's finalizers cleared)."""
        pid = os.getpid()
        if self._mp_pid == pid:
            return
        self._mp_pid = pid
        mp_util.Finalize(None, self.finish_at_exit, exitpriority=100)


def at_shutdown(fn: Callable[[], None]) -> None:
    """Run ``fn`` early in the interpreter's shutdown, with the hooks of
    ``threading._register_atexit``: after the main thread's code, before the non-daemon
    threads are joined and before ``atexit``'s hooks. Those hooks run newest first, so
    ``fn`` runs before ``concurrent.futures``' own (registered when it was imported),
    after which its ThreadPoolExecutors refuse new work: jobs that upload through them
    must be finished here."""
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(fn)
    else:  # pragma: no cover - CPython has it since 3.9
        atexit.register(fn)
