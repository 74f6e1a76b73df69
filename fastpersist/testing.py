"""Helpers for testing code built on fastpersist: fault injection in the native I/O layer.

Every read, write, fsync and open that the engines make goes through one
syscall layer in the native core, which can be told to fail the Nth matching
call. The steps of a save that run in Python (creating the temporary file, the
commit's fsyncs of the file and its directory, the renames, the CRC-field writes
of a collective save, DCP's ``.metadata``, the adapters' directory swaps) go
through :mod:`fastpersist._sys`, which asks the same layer first: a fault reaches
every system call of every save path (single, async snapshot and lazy, collective,
DCP, directory commits)::

    from fastpersist.testing import inject_fault

    with inject_fault("write", 3, "ENOSPC") as fault:
        fastpersist.save(state, "ckpt.pt")   # raises OSError(ENOSPC) naming the file
    assert fault.hits == 1

The same can be set for a whole process with the environment variable
``FASTPERSIST_FAULT="op:nth:action[:count]"`` (read once, when the native module
is loaded), e.g. ``FASTPERSIST_FAULT=write:1:EIO``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

from fastpersist.io import native_module

__all__ = ["Fault", "inject_fault"]


@dataclass
class Fault:
    """An active (or finished) injected fault; :attr:`hits` counts the calls it hit."""

    op: str
    nth: int
    action: str
    count: int = 1
    _final_hits: Optional[int] = field(default=None, repr=False)

    @property
    def hits(self) -> int:
        """Calls hit so far (frozen when the ``with`` block ends)."""
        if self._final_hits is not None:
            return self._final_hits
        return int(native_module().fault_hits())


@contextmanager
def inject_fault(op: str, nth: int, action: str, count: int = 1) -> Iterator[Fault]:
    """Make the native I/O layer fail calls while the ``with`` block runs.

    Args:
        op: ``"write"``, ``"read"``, ``"fsync"``, ``"open"``, ``"rename"`` (also
            ``renameat2`` exchanges) or ``"any"``.
        nth: 1-based index of the first matching call to hit, counted from now
            (for the ``"aio"`` engine, a write or read is one AIO completion).
        action: an errno name (``"EIO"``, ``"ENOSPC"``, ``"EACCES"``, ...) to fail
            with; ``"short"``: the call transfers only half the bytes; ``"eintr"``:
            the call fails with EINTR. Short transfers and EINTR are retried by the
            engines, so those must not change the result, only exercise the retry.
        count: how many consecutive matching calls to hit.

    Raises ValueError for an unknown op or action, ``nth < 1`` or ``count < 1``.
    Faults are process-wide (all handles, all threads); one fault is active at a
    time, and leaving the block clears it (also one set by ``FASTPERSIST_FAULT``).
    """
    native = native_module()
    native.set_fault(op, nth, action, count)
    fault = Fault(op, nth, action, count)
    try:
        yield fault
    finally:
        fault._final_hits = int(native.fault_hits())
        native.clear_faults()
