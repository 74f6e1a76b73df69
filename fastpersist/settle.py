"""Settling background saves: every future waited for, the first error raised, the rest logged.

An adapter that starts saves in the background (:func:`fastpersist.save_async`) must,
before a checkpoint counts as written (DeepSpeed's ``commit``, Lightning's
``finalize``), wait until *every* one of them finished, even after one failed: none may
still rename a file into the checkpoint afterwards. :func:`settle` does that for a list of
futures; :class:`PendingSaves` is a thread-safe list of the futures an object started,
with :meth:`PendingSaves.collect` settling the finished ones (or all of them).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterable, Iterator, Optional

__all__ = ["PendingSaves", "settle"]

log = logging.getLogger(__name__)


def settle(futures: Iterable[Any], *, errors: Iterable[BaseException] = (), what: str = "a save",
           logger: logging.Logger = log, on_settled: Optional[Callable[[Any], None]] = None) -> None:
    """Wait for every future (``future.wait()``); then raise the first error: of ``errors``
    (failures the caller already met), else of the futures in order. The other errors are
    logged (``what`` names the saves in the message). ``on_settled(future)`` runs after each
    future settled, failed or not."""
    found = list(errors)
    for future in futures:
        try:
            future.wait()
        except BaseException as e:  # noqa: BLE001 - collected; the first one is raised below
            found.append(e)
        if on_settled is not None:
            on_settled(future)
    for e in found[1:]:
        logger.error("fastpersist: another save of %s failed too: %s", what, e)
    if found:
        raise found[0]


class PendingSaves:
    """The background saves one object started and has not settled yet (thread-safe)."""

    def __init__(self) -> None:
        self._futures: list[Any] = []
        self._lock = threading.Lock()

    def add(self, future: Any) -> None:
        """Track ``future`` (a :class:`fastpersist.asyncsave.SaveFuture`)."""
        with self._lock:
            self._futures.append(future)

    def take(self) -> list[Any]:
        """Every tracked future, no longer tracked."""
        with self._lock:
            futures, self._futures = self._futures, []
        return futures

    def __iter__(self) -> Iterator[Any]:
        with self._lock:
            return iter(list(self._futures))

    def __len__(self) -> int:
        with self._lock:
            return len(self._futures)

    def running(self) -> int:
        """How many tracked futures have not finished."""
        with self._lock:
            return sum(1 for f in self._futures if not f.done())

    def collect(self, *, block: bool, what: str = "a save", logger: logging.Logger = log,
                on_settled: Optional[Callable[[Any], None]] = None) -> None:
        """Settle the finished futures (with ``block``, all of them, waiting) and stop tracking
        them: :func:`settle`, the first error raised. Unfinished ones stay tracked."""
        futures = self.take()
        keep = [] if block else [f for f in futures if not f.done()]
        done = futures if block else [f for f in futures if f not in keep]
        try:
            settle(done, what=what, logger=logger, on_settled=on_settled)
        finally:
            with self._lock:
                self._futures[:0] = keep
