"""Load errors a framework catches and goes on without: recorded, and raised after its call.

Some framework loads catch every exception of one file's load and resume without that
file's state (Accelerate's ``load_state`` and its RNG file: "Could not load random
states", logged at INFO). A corrupt or unreadable checkpoint file must never be skipped
quietly: inside :func:`watching`, the adapter's load routine calls :func:`record` with
each failure it lets through; if the framework's call then returns anyway,
:func:`watching` logs every such file as an error and raises the first error, with a
note saying what happened.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
from typing import Any, ContextManager, Iterator, Optional

from fastpersist.errors import CheckpointFormatError, ChecksumError
from fastpersist.wrappers import on_failure

__all__ = ["record", "recording", "watching"]

log = logging.getLogger(__name__)

# The failures of the watched call running in this thread/task (None: none running).
_failures: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("fastpersist_swallowed", default=None)


def record(path: Any, error: BaseException) -> None:
    """Note that loading ``path`` failed with ``error`` (the caller raises it on). Only
    inside :func:`watching`, and only corrupt or unreadable files: a missing file
    (``FileNotFoundError``) is the framework's call to make."""
    failures = _failures.get()
    if failures is None or isinstance(error, FileNotFoundError):
        return
    if isinstance(error, (CheckpointFormatError, ChecksumError, OSError)):
        failures.append((os.fspath(path), error))


def recording(path: Any) -> ContextManager[None]:
    """Run one file's load (of ``path``) in the block: an exception it raises is
    :func:`record`-ed, then raised on (:func:`fastpersist.wrappers.on_failure`)."""
    return on_failure(functools.partial(record, path))


@contextlib.contextmanager
def watching(operation: str, *, hint: str = "", logger: logging.Logger = log) -> Iterator[None]:
    """Run the framework's load (``operation``: ``"Accelerate's load_state"``) in the block;
    if it returns although a load of a file failed (:func:`record`), raise the first error,
    naming every such file in an error log. ``hint``: what the lost state is, in the note."""
    failures: list = []
    token = _failures.set(failures)
    try:
        yield
    finally:
        _failures.reset(token)
    if not failures:
        return
    names = ", ".join(path for path, _e in failures)
    logger.error("fastpersist: %s skipped %d checkpoint file(s) it could not load (%s) and would resume without "
                 "their state; failing the resume instead", operation, len(failures), names)
    path, error = failures[0]
    error.add_note(f"fastpersist: {operation} caught this error of {path} and went on without that file's state"
                   f"{hint}; the resume fails instead. Restore the file from a good copy, or resume from an earlier "
                   "checkpoint")
    raise error
