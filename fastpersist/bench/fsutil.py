"""File-system helpers of the benchmarks: durability (fsync) and cold reads (page-cache drop).

Cold reads need no root: after the data is on disk (``fsync``), every page of the
file is clean, and ``posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)`` makes Linux
evict the file's clean pages from the page cache, so the next read comes from
the device. (Pages another process holds mapped or dirty stay; the benchmark
files are ours alone.)
"""

from __future__ import annotations

import os
import shutil
from typing import Iterable

# The same helpers the atomic commit uses (directory fsync tolerant of filesystems that refuse it).
from fastpersist.commit import fsync_dir, fsync_path  # noqa: E402

__all__ = ["drop_page_cache", "drop_page_cache_all", "files_under", "fsync_dir", "fsync_path", "remove_path", "total_size"]


def files_under(path: str) -> list[str]:
    """``[path]`` for a file, every regular file below it (sorted) for a directory."""
    if os.path.isdir(path):
        found = []
        for root, _dirs, names in os.walk(path):
            found.extend(os.path.join(root, name) for name in names)
        return sorted(p for p in found if os.path.isfile(p))
    return [path]


def total_size(path: str) -> int:
    """Size in bytes of a file, or of all files below a directory."""
    return sum(os.path.getsize(p) for p in files_under(path))


def drop_page_cache(path: str) -> None:
    """Write back and evict one file's pages from the page cache (no root needed).

    Raises ``OSError`` naming the path when the file cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped; make every page clean first
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop_page_cache_all(paths: Iterable[str]) -> None:
    """:func:`drop_page_cache` for every file below each of ``paths`` (files or directories)."""
    for path in paths:
        for file in files_under(path):
            drop_page_cache(file)


def remove_path(path: str) -> None:
    """Remove a file or a directory tree; a missing path is not an error."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
