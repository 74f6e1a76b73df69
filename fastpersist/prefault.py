"""Fault a load's fresh destination buffers in on a second thread while the reads run.

Memory a process has never used costs a page fault per page on its first write: the
kernel zeroes the page (and, in a VM, the host may first have to back it). A load that
reads into new buffers pays that inside the reads, serially with them; on the
reference VM the first touch of fresh memory swung between 0.6 and 5.5 GB/s from one
minute to the next, and was the variable part of every cold load. A thread that
populates the buffers ahead of the reads (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14
and later, 32 MiB at a time, in file order) takes that cost off the read path: in the
ram-disk experiment of docs/benchmarks.md ("Loads on a fast disk") it raised cold loads
from 0.88x to 1.09x fio's read. Where the call is refused (an older kernel) the thread
stops at once and nothing changes.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import threading
import weakref
from typing import Any, Optional, Sequence

__all__ = ["Prefaulter", "STEP"]

_MADV_POPULATE_WRITE = 23
#: bytes populated per call (the stop flag is checked between calls)
STEP = 32 << 20
_libc: Optional[Any] = None


def _madvise() -> Optional[Any]:
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            _libc.madvise.restype = ctypes.c_int
        except (OSError, AttributeError):
            _libc = False
    return _libc.madvise if _libc else None


class Prefaulter:
    """Populates ``buffers`` (objects with ``ptr`` and ``nbytes``: page-aligned native
    buffers), in order, on a daemon thread started at construction. The thread holds
    the buffers until it ends; :meth:`close` stops it and waits (a fraction of a second
    at most: one :data:`STEP`)."""

    #: the running ones, stopped at interpreter exit (before finalization, so that no
    #: thread comes back from madvise into a finalizing interpreter)
    _live: "weakref.WeakSet[Prefaulter]" = weakref.WeakSet()

    def __init__(self, buffers: Sequence[Any]) -> None:
        self._buffers = list(buffers)
        self._stop = threading.Event()
        self.populated = 0  #: bytes populated so far
        self.error: Optional[int] = None  #: errno of a refused call (then the thread stopped)
        fn = _madvise()
        self._thread: Optional[threading.Thread] = None
        if fn is not None and self._buffers:
            self._thread = threading.Thread(target=self._run, args=(fn,), name="fastpersist-prefault", daemon=True)
            Prefaulter._live.add(self)
            self._thread.start()

    def _run(self, fn: Any) -> None:
        for b in self._buffers:
            ptr, n = int(b.ptr), int(b.nbytes)
            off = 0
            while off < n:
                if self._stop.is_set():
                    return
                step = min(STEP, n - off)
                if fn(ptr + off, step, _MADV_POPULATE_WRITE) != 0:  # GIL released during the call
                    self.error = ctypes.get_errno()
                    return
                self.populated += step
                off += step

    def close(self) -> None:
        """Stop populating and wait for the thread; drops the buffers."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._buffers = []


@atexit.register
def _stop_all() -> None:
    for p in list(Prefaulter._live):
        p.close()
