"""The system calls the Python side of a save makes (opening, fsyncing, renaming the
temporary file and its directory), routed through the native fault injection.

The engines' reads, writes, fsyncs and opens go through the native syscall layer
(``native/src/sys.cpp``), which :func:`fastpersist.testing.inject_fault` can fail. The
commit steps run in Python: each call here first asks that same layer whether the
call is to fail (counting it like a native call of the same kind), so an injected
``fsync``, ``open`` or ``rename`` fault reaches every save path (single, async,
collective, DCP, the adapters' directory commits).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

from fastpersist import _native

__all__ = ["fault_point", "fsync", "open", "pwrite", "rename", "replace", "write"]

_check: Optional[Callable[[str], int]] = None


def fault_point(op: str, path: Any = None, path2: Any = None) -> None:
    """Raise the ``OSError`` an injected fault gives this call of ``op``, if any."""
    global _check
    if _check is None:
        _check = _native.fault_errno
    err = _check(op)
    if err:
        raise OSError(err, os.strerror(err), path, None, path2)


def open(path: Any, flags: int, mode: int = 0o777) -> int:  # noqa: A001 - os.open's name
    """``os.open``, unless an injected ``open`` fault fails it."""
    fault_point("open", path)
    return os.open(path, flags, mode)


def fsync(fd: int, path: Any = None) -> None:
    """``os.fsync``, unless an injected ``fsync`` fault fails it (``path``: named in its error)."""
    fault_point("fsync", path)
    try:
        os.fsync(fd)
    except OSError as e:
        if path is not None and e.filename is None:
            raise OSError(e.errno, e.strerror, path) from e
        raise


def rename(src: Any, dst: Any) -> None:
    """``os.rename``, unless an injected ``rename`` fault fails it."""
    fault_point("rename", src, dst)
    os.rename(src, dst)


def replace(src: Any, dst: Any) -> None:
    """``os.replace``, unless an injected ``rename`` fault fails it."""
    fault_point("rename", src, dst)
    os.replace(src, dst)


def pwrite(fd: int, data: bytes, offset: int, path: Any = None) -> int:
    """``os.pwrite``, unless an injected ``write`` fault fails it (``path``: named in its error)."""
    fault_point("write", path)
    return os.pwrite(fd, data, offset)


def write(fd: int, data: Any, path: Any = None) -> int:
    """``os.write``, unless an injected ``write`` fault fails it (``path``: named in its error)."""
    fault_point("write", path)
    return os.write(fd, data)


def pread_full(fd: int, length: int, offset: int, path: Optional[str] = None) -> bytes:
    """``length`` bytes at ``offset`` of ``fd`` (``os.pread``, page cache), short reads
    retried: fewer only where the file ends. An ``OSError`` names ``path``, the offset and
    the length (the bare one from ``os.pread`` names no file)."""
    chunks = []
    while length > 0:
        try:
            b = os.pread(fd, length, offset)
        except OSError as e:
            if path is None or e.errno is None:
                raise
            raise type(e)(e.errno, f"{e.strerror or e} (reading {length} bytes at offset {offset} of {path!r})",
                          path) from e
        if not b:
            break
        chunks.append(b)
        offset += len(b)
        length -= len(b)
    return b"".join(chunks)
