"""What a reader is pointed at, checked before it opens it.

``verify``, ``load`` and ``open`` read checkpoint *files* with positioned reads. A
FIFO with no writer would block their ``open()`` forever, a terminal or another
character device would block or feed them bytes without end, and a symbolic-link
loop must be reported as the OS reports it (``ELOOP``), not as a missing file.
:func:`check_input` stats the path (no open: a FIFO's writer is not disturbed) and
raises an ``OSError`` at once, with an errno, for anything that is not a regular
file (or a directory, where one is accepted).
"""

from __future__ import annotations

import errno
import os
import stat

__all__ = ["check_input", "is_path", "special_file_error"]

# (test, errno, what it is): the errno is what the OS answers to the access a
# checkpoint reader needs: a positioned read of a FIFO or socket is ESPIPE ("Illegal
# seek"); mapping a device file is ENODEV ("No such device").
_KINDS = (
    (stat.S_ISFIFO, errno.ESPIPE, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, errno.ESPIPE, "a socket"),
    (stat.S_ISCHR, errno.ENODEV, "a character device"),
    (stat.S_ISBLK, errno.ENODEV, "a block device"),
)


def is_path(f: object) -> bool:
    """Whether ``f`` names a file by path (str or os.PathLike), as opposed to a file object."""
    return isinstance(f, (str, os.PathLike))


def special_file_error(path: str, mode: int, action: str) -> OSError:
    """The error for ``path`` of ``mode`` (``st_mode``), a FIFO, socket or device file."""
    for test, code, kind in _KINDS:
        if test(mode):
            return OSError(code, f"{os.strerror(code)}: {kind}, not a checkpoint file ({action} reads regular files "
                                 f"only)", path)
    return OSError(errno.EINVAL, f"not a regular file (mode {stat.filemode(mode)}); {action} reads regular files "
                                 "only", path)


def check_input(path: str, action: str, *, directory_ok: bool = False) -> os.stat_result:
    """The ``os.stat`` of ``path`` (links followed), which ``action`` ("verify",
    "load", "open") is about to read; raises at once where it could not.

    Raises:
        FileNotFoundError: nothing at ``path`` (also a dangling symbolic link).
        OSError: the OS's error for the path itself (``ELOOP`` for a symbolic-link loop,
            ``EACCES`` for a directory on the way that cannot be searched,
            ``ENAMETOOLONG``, ``ENOTDIR``), or, for a FIFO, socket or device file,
            ``ESPIPE`` / ``ENODEV`` naming what it is.
        IsADirectoryError: a directory, unless ``directory_ok``.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"No such file to {action}", path) from None
    if stat.S_ISREG(st.st_mode) or (directory_ok and stat.S_ISDIR(st.st_mode)):
        return st
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, f"Is a directory ({action} takes a checkpoint file)", path)
    raise special_file_error(path, st.st_mode, action)
