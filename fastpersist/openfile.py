"""The single-process pipeline into a file the caller already holds open.

``torch.save(obj, f)`` with ``f = open(name, "wb")`` writes into the caller's inode,
in place: there is no temporary file and no rename, because the caller keeps the
descriptor (whatever this function wrote under another name, ``f`` would still
point at the old inode). :func:`save_into_fd` is that save for the patched
``torch.save`` (:mod:`fastpersist.patch` decides which file objects qualify):

the file's name read back from ``/proc/self/fd/N`` and checked to be the same inode
→ pending saves of that name waited for → torch's zip format chosen (whatever the
name: ``torch.save`` always writes it) → its writer planned with the alignment of the
file's directory → written through ``/proc/self/fd/N``, reopened by the native
handle (O_DIRECT where the filesystem takes it, buffered otherwise, exactly as a
path save into that directory) → the file's length set to the archive's → fsync as
``Config.fsync`` says.

The bytes are those :func:`fastpersist.save` writes to a path in the same directory
(records named ``archive/``, as torch names them for every file object). The
caller's descriptor and its offset are not touched: the reopened descriptor has
an offset of its own, and the caller moves its file object's position (torch leaves
it at the end of the archive).

Failures: an ``OSError`` names the file the caller opened, its errno and the
temporary descriptor path, and says that the file is partly written, which is
what stock ``torch.save`` leaves behind when its writes fail.
"""

from __future__ import annotations

import logging
import os
import stat
from typing import Any

import torch

from fastpersist import _compat, handles, pending
from fastpersist import config as config_mod
from fastpersist.errors import UnsupportedLayoutError
from fastpersist.formats import registry

__all__ = ["fd_name", "save_into_fd"]

log = logging.getLogger("fastpersist.api")


def fd_name(fd: int) -> str:
    """The absolute name of the regular file open as ``fd``.

    Raises:
        OSError: ``EINVAL`` when ``fd`` is not a regular file with a name in the
            filesystem that still refers to the same inode (a pipe, a socket, a
            device, a deleted or replaced file, a file opened through a name that
            has since been renamed away); the descriptor's own error otherwise.
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(22, "not a regular file", f"/proc/self/fd/{fd}")
    name = os.readlink(f"/proc/self/fd/{fd}")
    try:
        named = os.stat(name)
    except OSError:
        named = None
    if not os.path.isabs(name) or named is None or (named.st_dev, named.st_ino) != (st.st_dev, st.st_ino):
        raise OSError(22, "the open file has no name in the filesystem that refers to it (deleted or renamed)", name)
    return name


def _partly_written(e: OSError, name: str, via: str) -> OSError:
    msg = (f"{e.strerror or e} (saving into the open file {name!r} via {via!r}; the file is partly "
           f"written, as torch.save leaves a file object whose writes fail: save again)")
    return type(e)(e.errno, msg, name)


def save_into_fd(obj: Any, fd: int, *, config: Any = None) -> int:
    """Write ``obj`` in torch's zip format into the open regular file ``fd`` from offset 0.

    The file must be empty (the patched ``torch.save`` only hands over files of
    length 0); afterwards its length is exactly the archive's. ``fd``'s own offset
    is left as it was.

    Args:
        obj: what ``torch.save`` would pickle.
        fd: a descriptor open for writing (not ``O_APPEND``) on a regular named file.
        config: a :class:`fastpersist.Config` or None for the default.

    Returns:
        The number of bytes written (the file's length).

    Raises:
        OSError: the name of the file cannot be established (see :func:`fd_name`),
            or a write, truncate or fsync failed: the file is partly written.
        Exception: what pickling ``obj`` raises, as ``torch.save`` raises it.
    """
    name = fd_name(fd)
    via = f"/proc/self/fd/{fd}"
    cfg = config_mod.resolve(config)
    pending.before_blocking_save(name)
    align = handles.alignment_for(os.path.dirname(name))
    fmt = registry.TORCH
    assert fmt.writer is not None
    write = fmt.writer(obj, name, align, cfg, None)
    try:
        try:
            write(via)
        except UnsupportedLayoutError as e:
            log.debug("fast torch layout not possible for %s (%s); writing with torch's writer", name, e)
            _save_with_torch(obj, via, align, cfg)
        size = os.fstat(fd).st_size
    except OSError as e:
        if e.errno is None:
            raise
        raise _partly_written(e, name, via) from e
    return size


def _save_with_torch(obj: Any, via: str, alignment: int, cfg: Any) -> None:
    """Fallback: torch's own writer into the same inode (still aligned, in place)."""
    with open(via, "wb") as f, _compat.save_storage_alignment(alignment, required=False):
        torch.serialization.save(obj, f)
        f.flush()
        if cfg.fsync:
            os.fsync(f.fileno())
