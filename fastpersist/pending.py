"""Saves still in flight in this process: what readers and blocking saves wait for.

A mode that leaves saves running after its call returns (``fastpersist.asyncsave``)
registers itself here as a *source*; the layers below it (the single-process pipeline,
the collective save, the partial readers) ask this module, never the mode itself:

- :func:`before_blocking_save`: a blocking save of ``final`` first waits for this
  process's pending saves of the same file and raises the first uncollected error of
  an earlier one (nothing has been written when it raises);
- :func:`wait_for_path` / :func:`wait_for_dir`: a read, a listing or an existence check
  sees the finished file (or what was there before, if the pending save failed);
- :func:`pending_paths`: the final paths not finished yet.

With no source registered every call returns at once.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Protocol


class Source(Protocol):
    """What a mode with saves in flight answers (``fastpersist.asyncsave`` does)."""

    def before_blocking_save(self, final: str) -> None: ...

    def wait_for_path(self, path: Any, timeout: Optional[float] = None) -> bool: ...

    def wait_for_dir(self, directory: Any, timeout: Optional[float] = None) -> bool: ...

    def pending_paths(self) -> list[str]: ...


_sources: list[Source] = []


def register(source: Source) -> None:
    """Add ``source`` (once) to what the functions below consult."""
    if not any(s is source for s in _sources):
        _sources.append(source)


def before_blocking_save(final: str) -> None:
    """Called by every blocking save before it writes ``final`` (see the module docstring)."""
    for s in _sources:
        s.before_blocking_save(final)


def wait_for_path(path: Any, timeout: Optional[float] = None) -> bool:
    """Wait until no save of this process is pending for ``path``; False if ``timeout``
    seconds passed first."""
    return all(s.wait_for_path(path, timeout) for s in list(_sources))


def wait_for_dir(directory: Any, timeout: Optional[float] = None) -> bool:
    """Wait until no save of this process is pending for a file in ``directory`` or below."""
    return all(s.wait_for_dir(directory, timeout) for s in list(_sources))


def pending_paths() -> list[str]:
    """The final paths of this process's saves that have not finished yet, in call order."""
    return [p for s in list(_sources) for p in s.pending_paths()]


def wait_before_reading(path: Any, *, tree: bool = False) -> None:
    """Before reading ``path`` (a path; file objects are left alone): wait for its pending
    saves, and with ``tree`` for those of files below it when it is a directory."""
    if not isinstance(path, (str, os.PathLike)):
        return
    wait_for_path(path)
    if tree and os.path.isdir(path):
        wait_for_dir(path)
