"""A small pool of idle objects, per key, lent to one user at a time.

Saves and loads run on native handles whose threads cost something to start: a handle
that has finished its work is kept idle (:meth:`IdlePool.keep`) and lent to the next
save or load with the same settings (:meth:`IdlePool.take`) instead of a new one. The
writers of :mod:`fastpersist.handles` and the readers of :mod:`fastpersist.readpolicy`
are two such pools. A forked child starts with empty pools and a fresh lock (a parent
thread may have held the old one at the fork); at interpreter exit every pool is
emptied while the interpreter still runs, so that the idle handles' threads are joined
then, not in whatever order module teardown destroys things.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections.abc import Hashable
from typing import Generic, Optional, TypeVar

__all__ = ["IdlePool"]

T = TypeVar("T")


class IdlePool(Generic[T]):
    """At most ``max_idle`` idle objects per key. Thread-safe; an object is either lent
    (nobody else can take it) or idle in the pool, never both."""

    _all: "weakref.WeakSet[IdlePool]" = weakref.WeakSet()

    def __init__(self, max_idle: int) -> None:
        if max_idle < 0:
            raise ValueError(f"max_idle must be >= 0, got {max_idle}")
        self.max_idle = max_idle
        self._idle: dict[Hashable, list[T]] = {}
        self._lock = threading.Lock()
        IdlePool._all.add(self)

    def take(self, key: Hashable) -> Optional[T]:
        """An idle object kept under ``key`` (now lent to the caller), or None."""
        with self._lock:
            idle = self._idle.get(key)
            return idle.pop() if idle else None

    def keep(self, key: Hashable, item: T) -> bool:
        """Keep ``item`` idle under ``key`` for the next :meth:`take`. Returns False (and
        keeps nothing) when ``max_idle`` objects are idle under ``key`` already, or when
        ``item`` itself is (handed back twice)."""
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if len(idle) >= self.max_idle or any(i is item for i in idle):
                return False
            idle.append(item)
            return True

    def idle(self, key: Hashable) -> int:
        """How many objects are idle under ``key``."""
        with self._lock:
            return len(self._idle.get(key, ()))

    def clear(self) -> None:
        """Drop every idle object (a native handle's threads end when nothing holds it)."""
        with self._lock:
            dropped = self._idle
            self._idle = {}
        dropped.clear()  # outside the lock: a handle's destructor joins its threads

    def _reset_in_child(self) -> None:
        self._lock = threading.Lock()
        self._idle = {}


def _reset_all_in_child() -> None:
    for pool in list(IdlePool._all):
        pool._reset_in_child()


def _clear_all() -> None:
    for pool in list(IdlePool._all):
        pool.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_all_in_child)
atexit.register(_clear_all)
