"""Atomic, durable replacement of a file: temporary name, write, fsync, rename, fsync the directory.

Whatever goes wrong before the rename (an I/O error, a full disk, an exception in
the caller's writer, ``KeyboardInterrupt``), the temporary file is removed and the
file already at the final path, if any, is left exactly as it was. A process
killed outright (``SIGKILL``, power loss) can leave a ``.NAME.fp-tmp-*`` file
behind in the directory, never a partial file under the final name.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from typing import Callable, TypeVar, Union

log = logging.getLogger(__name__)

T = TypeVar("T")
PathLike = Union[str, "os.PathLike[str]"]

#: marker inside temporary names, so that leftovers are easy to recognise
TMP_MARKER = ".fp-tmp-"


def resolve_target(path: PathLike) -> str:
    """The absolute path a save to ``path`` replaces.

    Symbolic links are followed (like ``torch.save``, which writes through them),
    so the link itself survives and its target is replaced atomically.

    Raises:
        TypeError: ``path`` is not a str or os.PathLike.
        IsADirectoryError: ``path`` is an existing directory.
        FileNotFoundError: the parent directory does not exist.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"expected a file path (str or os.PathLike), got {type(path).__name__}")
    p = os.path.abspath(os.fsdecode(os.fspath(path)))
    if os.path.islink(p):
        p = os.path.realpath(p)
    if os.path.isdir(p):
        raise IsADirectoryError(21, "Is a directory; give a file name to save to", p)
    parent = os.path.dirname(p)
    if not os.path.isdir(parent):
        raise FileNotFoundError(2, "Parent directory does not exist; create it before saving", parent)
    return p


def temp_path_for(final: str) -> str:
    """A fresh temporary name in the directory of ``final``: ``.NAME.fp-tmp-PID-RANDOM``."""
    directory, name = os.path.split(final)
    return os.path.join(directory, f".{name}{TMP_MARKER}{os.getpid()}-{secrets.token_hex(4)}")


def fsync_path(path: str) -> None:
    """fsync the file at ``path`` (used after writers that do not fsync themselves)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str) -> None:
    """fsync a directory, making a rename inside it durable.

    Filesystems that cannot fsync a directory (``EINVAL``/``ENOTSUP``, some network
    and FUSE filesystems) are tolerated with a debug log; other errors raise.
    """
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno in (22, 95):  # EINVAL, EOPNOTSUPP/ENOTSUP
            log.debug("fsync of directory %s not supported: %s", directory, e)
        else:
            raise
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:  # pragma: no cover - best effort; the original error matters more
        log.warning("could not remove temporary file %s: %s", path, e)


def _keep_mode(final: str, tmp: str) -> None:
    """Give the new file the permission bits of the one it replaces (if any)."""
    try:
        mode = stat.S_IMODE(os.stat(final).st_mode)
    except FileNotFoundError:
        return
    os.chmod(tmp, mode)


def atomic_write(path: PathLike, write: Callable[[str], T], *, fsync: bool = True) -> T:
    """Replace the file at ``path`` atomically with what ``write(tmp_path)`` produces.

    ``write`` receives the temporary path (in the same directory as ``path``) and
    must create and fill it; it is expected to fsync the file itself when
    ``fsync`` is true (the native writer does, with ``fsync=True``). Then the
    temporary file is renamed over ``path`` and, when ``fsync`` is true, the
    directory is fsync'ed so the rename survives a crash.

    On any exception (including ``KeyboardInterrupt``) the temporary file is
    removed and the exception re-raised; the previous file at ``path`` is untouched.

    Returns:
        Whatever ``write`` returned.
    """
    final = resolve_target(path)
    tmp = temp_path_for(final)
    try:
        result = write(tmp)
        if not os.path.exists(tmp):
            raise FileNotFoundError(2, "writer did not create the temporary file", tmp)
        _keep_mode(final, tmp)
        os.rename(tmp, final)
    except BaseException:
        _remove_quietly(tmp)
        raise
    if fsync:
        fsync_dir(os.path.dirname(final))
    return result
