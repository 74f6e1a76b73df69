"""Atomic, durable replacement of a file: temporary name, write, fsync, rename, fsync the directory.

Whatever goes wrong before the rename (an I/O error, a full disk, an exception in
the caller's writer, ``KeyboardInterrupt``), the temporary file is removed and the
file already at the final path, if any, is left exactly as it was. A process
killed outright (``SIGKILL``, power loss) can leave a ``.fp-tmp-*`` file
behind in the directory, never a partial file under the final name; the next save
into that directory removes it once it is certain that no process is still
writing it (see :func:`clean_stale_temps`).

Targets (:func:`resolve_target`): symbolic links are followed; an existing target
must be a regular file (a device, FIFO or socket is refused with
:class:`UnsupportedTargetError`: a rename would replace the device node itself),
writable by this process (a write-protected file raises ``PermissionError`` as
``torch.save``'s ``open(path, "wb")`` does, and stays untouched), in a directory
this process may create files in.

Temporary names (:func:`temp_path_for`) are
``.fp-tmp-HASH-PID-HOST-START-RANDOM``: 12 hex digits of the SHA-256 of the final
file's name (``HASH``, :func:`name_hash`), the writer's pid, a tag of this machine's
boot and pid namespace (``HOST``), the writer's start time (``START``, field 22 of
``/proc/PID/stat``, hex) and 32 random bits. No part of the final name appears in
it: code that lists a checkpoint directory by name (Lightning's ``hpc_ckpt_N``,
``*.ckpt`` and ``last`` patterns, Accelerate's ``checkpoint_N``, DeepSpeed's tags)
never takes an in-flight or leftover temporary file for a checkpoint, and the name
is short (about 70 bytes) whatever the final name's length. Leftovers of one final
name are still found by its hash (:func:`temps_for`). Names of earlier releases
(``.NAME.fp-tmp-PID-HOST-START-RANDOM`` and ``.NAME.fp-tmp-PID-RANDOM``) are still
recognised and cleaned up.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import functools
import hashlib
import logging
import os
import platform
import re
import secrets
import stat
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, TypeVar, Union

from fastpersist import _sys
from fastpersist.errors import DirectorySyncError

log = logging.getLogger(__name__)

T = TypeVar("T")
PathLike = Union[str, "os.PathLike[str]"]

#: marker inside temporary names, so that leftovers are easy to recognise
TMP_MARKER = ".fp-tmp-"

#: Seconds a leftover temporary file whose writer cannot be checked (written on
#: another machine or boot, in another pid namespace, by another user, by an
#: earlier release, whose names record no boot, or on a system without ``/proc``)
#: must stay unmodified before a save removes it. A save in progress modifies its
#: temporary file continually, so an hour without a write means its writer is
#: gone (or hung) even allowing for clock skew between NFS/Lustre clients.
FOREIGN_TMP_GRACE_S = 3600.0

_HOST_HEX = 10  # length of the HOST field (hex digits)
UNKNOWN_HOST = "0" * _HOST_HEX  # written when this process cannot identify its boot / pid namespace

_HASH_HEX = 12  # length of the HASH field (hex digits of the final name's SHA-256)

# .fp-tmp-HASH-PID-HOST-START-RANDOM (this release: no part of the final name in it)
_TMP_RE = re.compile(
    r"\.fp-tmp-(?P<hash>[0-9a-f]{%d})-(?P<pid>[0-9]{1,10})-(?P<host>[0-9a-f]{%d})-(?P<start>[0-9a-f]{1,16})-[0-9a-f]{8}"
    % (_HASH_HEX, _HOST_HEX)
)
# .NAME.fp-tmp-PID-HOST-START-RANDOM and .NAME.fp-tmp-PID-RANDOM (earlier releases; cleaned up only)
_V1_TMP_RE = re.compile(
    r"\.(?P<name>.*)\.fp-tmp-(?P<pid>[0-9]{1,10})-(?P<host>[0-9a-f]{%d})-(?P<start>[0-9a-f]{1,16})-[0-9a-f]{8}"
    % _HOST_HEX,
    re.DOTALL,
)
_OLD_TMP_RE = re.compile(r"\.(?P<name>.*)\.fp-tmp-(?P<pid>[0-9]{1,10})-[0-9a-f]{8}", re.DOTALL)


class UnsupportedTargetError(OSError):
    """The save target exists and is not a regular file (a character or block device,
    a FIFO, a socket). ``fastpersist.save`` replaces files by renaming a temporary
    file over them, which would replace the device node or pipe itself; use
    ``torch.save`` to write *into* devices and pipes (a patched ``torch.save`` does
    that on its own). ``errno`` is ``EINVAL``, ``filename`` the target."""


def _kind(mode: int) -> str:
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _read_only_fs(directory: str) -> bool:
    try:
        return bool(os.statvfs(directory).f_flag & getattr(os, "ST_RDONLY", 1))
    except (OSError, AttributeError):
        return False


def _writable(path: str, mode: int) -> bool:
    """``access(2)`` with the effective ids, which is what ``open``/``rename`` are checked against."""
    if os.access in os.supports_effective_ids:
        return os.access(path, mode, effective_ids=True)
    return os.access(path, mode)  # pragma: no cover - not on Linux


def resolve_target(path: PathLike) -> str:
    """The absolute path a save to ``path`` replaces.

    Symbolic links are followed (like ``torch.save``, which writes through them),
    so the link itself survives and its target is replaced atomically.

    Raises:
        TypeError: ``path`` is not a str or os.PathLike.
        IsADirectoryError: ``path`` is an existing directory.
        FileNotFoundError: the parent directory does not exist.
        UnsupportedTargetError: ``path`` is a device, FIFO or socket.
        OSError: ``EROFS``, the filesystem is mounted read-only.
        PermissionError: ``path`` is write-protected (``EACCES``, like ``torch.save``;
            a process that may bypass permissions, root, proceeds as torch would), or
            the directory does not let this process create the temporary file.
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
    try:
        st = os.stat(p)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise UnsupportedTargetError(
                errno.EINVAL,
                f"Save target is {_kind(st.st_mode)}, not a regular file: fastpersist.save replaces a file "
                "atomically (temporary file + rename) and would replace the node itself; use torch.save to "
                "write into devices/pipes",
                p,
            )
    if _read_only_fs(parent):
        raise OSError(errno.EROFS, "Read-only file system: cannot save here (the old file, if any, is untouched)", p)
    if st is not None:
        if not _writable(p, os.W_OK):
            raise PermissionError(
                errno.EACCES,
                "Permission denied: the existing file is write-protected (torch.save would fail to open it "
                "too); the old file is untouched. Make it writable (chmod u+w) or remove it to replace it",
                p,
            )
    if not _writable(parent, os.W_OK | os.X_OK):
        raise PermissionError(
            errno.EACCES,
            "Permission denied: cannot create files in this directory; fastpersist.save writes a temporary "
            "file next to the target and renames it, so it needs write access to the directory",
            parent,
        )
    return p


# ---- temporary names and their owners -------------------------------------------------

_identity_cache: dict[int, tuple[str, str]] = {}


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return f.read().decode("ascii", "replace")
    except OSError:
        return None


def _parse_stat(text: Optional[str]) -> Optional[list[str]]:
    if text is None:
        return None
    # comm (field 2) is in parentheses and may contain anything; the rest follows the last ')'
    rest = text[text.rfind(")") + 1:].split()
    return rest if len(rest) >= 20 else None


def stat_fields(pid: int) -> Optional[list[str]]:
    """Fields 3.. of ``/proc/PID/stat`` (state first), or None if there is no such process."""
    return _parse_stat(_read_text(f"/proc/{pid}/stat"))


def _host_tag() -> str:
    """A tag of this boot and pid namespace: pids are comparable only between processes that share both."""
    boot = _read_text("/proc/sys/kernel/random/boot_id")
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = None
    if not boot or not boot.strip() or not pidns:
        return UNKNOWN_HOST
    tag = hashlib.sha256(f"{boot.strip()}|{pidns}".encode()).hexdigest()[:_HOST_HEX]
    return tag if tag != UNKNOWN_HOST else "1" + tag[1:]


def process_identity() -> tuple[str, str]:
    """(HOST, START) of this process; cached per pid (a forked child computes its own)."""
    pid = os.getpid()
    got = _identity_cache.get(pid)
    if got is None:
        host = _host_tag()
        text = _read_text("/proc/self/stat")
        fields = _parse_stat(text)
        # /proc/self must be this process: a /proc of another pid namespace would mislead
        if host == UNKNOWN_HOST or fields is None or text.split(None, 1)[0] != str(pid):
            got = (UNKNOWN_HOST, "0")
        else:
            try:
                got = (host, format(int(fields[19]), "x"))
            except ValueError:  # pragma: no cover - malformed /proc
                got = (UNKNOWN_HOST, "0")
        _identity_cache.clear()
        _identity_cache[pid] = got
    return got


def name_hash(name: str) -> str:
    """The ``HASH`` field of temporary names for a final file named ``name`` (its base name)."""
    return hashlib.sha256(os.fsencode(os.path.basename(name))).hexdigest()[:_HASH_HEX]


def temp_path_for(final: str) -> str:
    """A fresh temporary name in the directory of ``final``: ``.fp-tmp-HASH-PID-HOST-START-RANDOM``
    (no part of ``final``'s name in it; ``HASH`` is :func:`name_hash` of it)."""
    directory, name = os.path.split(final)
    host, start = process_identity()
    return os.path.join(
        directory, f"{TMP_MARKER}{name_hash(name)}-{os.getpid()}-{host}-{start}-{secrets.token_hex(4)}"
    )


@dataclass(frozen=True)
class TempFile:
    """A temporary file of a fastpersist save found in a directory (see :func:`scan_temps`)."""

    path: str
    #: the (possibly shortened) name of the file it was to replace, for names of earlier
    #: releases; "" for this release's names, which record only its hash (``name_hash``)
    name: str
    size: int
    mtime: float
    pid: int  #: the writer's pid (in its own pid namespace)
    state: str  #: "live" (writer running here), "stale" (writer gone here), "foreign" (cannot tell)
    removable: bool  #: whether the next save into this directory removes it
    reason: str  #: why, in words
    name_hash: str = ""  #: :func:`name_hash` of the file it was to replace ("" for earlier releases' names)

    def is_for(self, final: str) -> bool:
        """Whether this was a temporary file of a save to ``final`` (a path or a base name)."""
        base = os.path.basename(final)
        if self.name_hash:
            return self.name_hash == name_hash(base)
        return base == self.name or (bool(self.name) and base.startswith(self.name))


def classify(pid: int, host: Optional[str], start: Optional[str], st: os.stat_result, now: float,
              grace: float) -> tuple[str, bool, str]:
    age = now - st.st_mtime
    mine_host, _ = process_identity()
    checkable = (
        host is not None
        and host == mine_host
        and mine_host != UNKNOWN_HOST
        and start not in (None, "0")
        # other users' processes may be hidden (/proc mounted with hidepid): only root or the
        # file's owner can tell "gone" from "invisible"
        and (os.geteuid() == 0 or st.st_uid == os.geteuid())
    )
    if checkable:
        fields = stat_fields(pid)
        if fields is None:
            return "stale", True, f"process {pid} has exited"
        if fields[0] in ("Z", "X"):
            return "stale", True, f"process {pid} has exited (zombie)"
        try:
            live_start = format(int(fields[19]), "x")
        except ValueError:  # pragma: no cover - malformed /proc
            live_start = None
        if live_start is not None and live_start != start:
            return "stale", True, f"process {pid} has exited (its pid was reused)"
        return "live", False, f"process {pid} is still running"
    if host is None:
        why = "written by an earlier fastpersist release"
    elif host != mine_host or mine_host == UNKNOWN_HOST:
        why = "written on another machine, boot or pid namespace"
    else:
        why = "owned by another user"
    if age > grace:
        return "foreign", True, f"{why}; unmodified for {age:.0f} s (more than {grace:.0f} s)"
    return "foreign", False, f"{why}; modified {max(age, 0.0):.0f} s ago (removed after {grace:.0f} s unmodified)"


def scan_temps(directory: str, *, grace: float = FOREIGN_TMP_GRACE_S, now: Optional[float] = None) -> list[TempFile]:
    """Temporary files of fastpersist saves in ``directory``, each with its owner's state.

    Only regular files (never symbolic links) whose names match the temporary-name
    pattern exactly are listed. A file written by a process of this boot and pid
    namespace (and of this user, or when running as root) is ``"live"`` while that
    process runs (same pid *and* start time) and ``"stale"`` once it has exited;
    any other file is ``"foreign"`` and counts as abandoned when unmodified for
    ``grace`` seconds. Raises ``OSError`` if the directory cannot be listed.
    """
    now = time.time() if now is None else now
    found = []
    with os.scandir(directory) as it:
        for entry in it:
            if TMP_MARKER not in entry.name or not entry.name.startswith("."):
                continue
            m = _TMP_RE.fullmatch(entry.name) or _V1_TMP_RE.fullmatch(entry.name)
            old = None if m else _OLD_TMP_RE.fullmatch(entry.name)
            if m is None and old is None:
                continue
            try:
                if not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            digest = ""
            if m is not None:
                pid, host, start = int(m["pid"]), m["host"], m["start"]
                groups = m.groupdict()
                name, digest = groups.get("name") or "", groups.get("hash") or ""
            else:
                pid, host, start, name = int(old["pid"]), None, None, old["name"]
            state, removable, reason = classify(pid, host, start, st, now, grace)
            found.append(TempFile(entry.path, name, st.st_size, st.st_mtime, pid, state, removable, reason, digest))
    found.sort(key=lambda t: t.path)
    return found


def temps_for(final: str, *, grace: float = FOREIGN_TMP_GRACE_S) -> list[TempFile]:
    """The temporary files in ``final``'s directory of saves to ``final`` (by :func:`name_hash`,
    or by name for earlier releases' names). Raises ``OSError`` if the directory cannot be listed."""
    return [t for t in scan_temps(os.path.dirname(os.path.abspath(final)), grace=grace) if t.is_for(final)]


def clean_stale_temps(directory: str, *, grace: float = FOREIGN_TMP_GRACE_S) -> list[str]:
    """Remove the temporary files of saves that can no longer finish (see :func:`scan_temps`).

    Called at the start of every save into ``directory``. Never raises: problems are
    logged at debug level. Returns the paths removed.
    """
    removed = []
    try:
        temps = scan_temps(directory, grace=grace)
    except Exception as e:  # noqa: BLE001 - cleanup must never fail a save
        log.debug("cannot scan %s for leftover temporary files: %s", directory, e)
        return removed
    for t in temps:
        if not t.removable:
            continue
        try:
            os.unlink(t.path)  # unlink never follows a symbolic link
        except FileNotFoundError:
            continue
        except Exception as e:  # noqa: BLE001
            log.debug("cannot remove leftover temporary file %s: %s", t.path, e)
            continue
        log.debug("removed leftover temporary file %s (%s bytes): %s", t.path, t.size, t.reason)
        removed.append(t.path)
    return removed


def clean_stale_temps_below(root: str, *, grace: float = FOREIGN_TMP_GRACE_S) -> list[str]:
    """:func:`clean_stale_temps` in ``root`` and in each directory directly inside it.

    The adapters call it on a checkpoint root at every save: a save killed while writing
    into a directory of its own (a new DeepSpeed tag, an Accelerate ``checkpoint_N``)
    leaves its temporary file where no later save writes, so the cleanup at the start of
    a save into that directory would never run. Symbolic links are not followed; temps
    of live processes are kept (see :func:`scan_temps`). Never raises. Returns the paths
    removed.
    """
    removed = clean_stale_temps(root, grace=grace)
    try:
        with os.scandir(root) as it:
            subdirs = [e.path for e in it if e.is_dir(follow_symlinks=False)]
    except OSError as e:
        log.debug("cannot list %s for leftover temporary files: %s", root, e)
        return removed
    for d in sorted(subdirs):
        removed += clean_stale_temps(d, grace=grace)
    return removed


def fsync_path(path: str) -> None:
    """fsync the file at ``path`` (used after writers that do not fsync themselves)."""
    fd = _sys.open(path, os.O_RDONLY)
    try:
        _sys.fsync(fd, path)
    finally:
        os.close(fd)


def fsync_dir(directory: str) -> None:
    """fsync a directory, making a rename inside it durable.

    Filesystems that cannot fsync a directory (``EINVAL``/``ENOTSUP``, some network
    and FUSE filesystems) are tolerated with a debug log; other errors raise.
    """
    fd = _sys.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        _sys.fsync(fd, directory)
    except OSError as e:
        if e.errno in (22, 95):  # EINVAL, EOPNOTSUPP/ENOTSUP
            log.debug("fsync of directory %s not supported: %s", directory, e)
        else:
            raise
    finally:
        os.close(fd)


def remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:  # pragma: no cover - best effort; the original error matters more
        log.warning("could not remove temporary file %s: %s", path, e)


def keep_mode(final: str, tmp: str) -> None:
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

    Before writing, leftover temporary files of killed saves in the same directory
    are removed (:func:`clean_stale_temps`).

    Returns:
        Whatever ``write`` returned.
    """
    final = resolve_target(path)
    clean_stale_temps(os.path.dirname(final))
    tmp = temp_path_for(final)
    try:
        result = write(tmp)
        if not os.path.exists(tmp):
            raise FileNotFoundError(2, "writer did not create the temporary file", tmp)
        keep_mode(final, tmp)
        _sys.rename(tmp, final)
    except BaseException:
        remove_quietly(tmp)
        raise
    if fsync:
        fsync_dir_after_rename(final)
    return result


# Directories whose whole tree the caller fsyncs before it counts as written (a staged
# checkpoint directory's commit): blocking saves into them skip their own fsyncs.
_synced_later: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("fastpersist_synced_later",
                                                                                default=())


@contextlib.contextmanager
def synced_later(directory: str) -> Iterator[None]:
    """In this context (this thread), blocking saves of ``directory`` (a file) or of files under it write
    without their own fsyncs of the file and of its folder: the caller promises to fsync the
    whole tree (every file, then every folder) before anything counts as written, as a staged
    checkpoint directory's commit does (:func:`fastpersist.dircommit.fsync_tree`). One
    journal commit for the directory instead of two per file. Background saves (another
    thread) are not affected."""
    token = _synced_later.set(_synced_later.get() + (os.path.abspath(directory).rstrip(os.sep) + os.sep,))
    try:
        yield
    finally:
        _synced_later.reset(token)


def sync_deferred(path: PathLike) -> bool:
    """Whether a blocking save of ``path`` in this context leaves its fsyncs to the caller
    of :func:`synced_later`."""
    roots = _synced_later.get()
    if not roots:
        return False
    p = os.path.abspath(os.fspath(path))
    return any(p.startswith(r) or p == r[:-1] for r in roots)


def write_small_file(path: PathLike, data: bytes) -> None:
    """Replace the file at ``path`` with ``data``, atomically and durably (:func:`atomic_write`:
    a temporary file written and fsynced, renamed over ``path``, the directory fsynced). For
    small files that name a checkpoint (DeepSpeed's ``latest``): a crash leaves the old bytes
    or the new ones, never a mix."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    atomic_write(path, write)


def write_and_replace(tmp: str, final: str, data: Union[bytes, bytearray, memoryview], *, fsync: bool = True,
                      exclusive: bool = True, faults: bool = True) -> None:
    """Write ``data`` to the new file ``tmp`` (mode ``0666 & ~umask``), fsync it when
    ``fsync`` is true, and rename it over ``final``. On any exception (including
    ``KeyboardInterrupt``) ``tmp`` is removed and the exception re-raised, ``final``
    untouched. ``exclusive``: ``tmp`` must not exist yet (``O_EXCL``); otherwise an
    existing ``tmp`` is truncated. ``faults``: the calls go through
    :mod:`fastpersist._sys` (an injected fault reaches them and counts them); false for
    bookkeeping files that injected faults aimed at checkpoint writes must not hit. The
    caller picks ``tmp`` in ``final``'s directory and fsyncs that directory afterwards if
    the rename must survive a crash."""

    def point(op: str, *paths: str) -> None:
        if faults:
            _sys.fault_point(op, *paths)

    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_EXCL if exclusive else os.O_TRUNC)
    try:
        point("open", tmp)
        fd = os.open(tmp, flags, 0o666)
        try:
            view = memoryview(data)
            while view:
                point("write", tmp)
                view = view[os.write(fd, view):]
            if fsync:
                if faults:
                    _sys.fsync(fd, tmp)
                else:
                    os.fsync(fd)
        finally:
            os.close(fd)
        point("rename", tmp, final)
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def fsync_dir_after_rename(final: str) -> None:
    """fsync the directory of ``final`` after a new file was renamed there; a failure raises
    :class:`~fastpersist.errors.DirectorySyncError`, which says that the new file is in place
    but its rename may not survive a crash (not that the previous file is untouched)."""
    directory = os.path.dirname(final)
    try:
        fsync_dir(directory)
    except OSError as e:
        raise DirectorySyncError(
            e.errno, f"{e.strerror or e}: the new file is in place at {final!r} (the previous one was replaced), "
            f"but fsync of its directory {directory!r} failed, so the rename may not survive a crash or power "
            "loss; check the filesystem, then save again to make the checkpoint durable", final) from e


# ---- swapping two directories in one step ---------------------------------------------

#: errnos with which :func:`exchange_paths` says "no atomic exchange here" (kernel < 3.15,
#: a filesystem without ``RENAME_EXCHANGE`` such as some network and FUSE filesystems, or
#: no ``renameat2`` at all): callers fall back to two renames.
EXCHANGE_REFUSED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)})
_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
# renameat2's syscall number, for a libc without the renameat2 wrapper (glibc < 2.28)
_SYS_RENAMEAT2 = {"x86_64": 316, "amd64": 316, "i386": 353, "i686": 353, "aarch64": 276, "arm64": 276,
                  "riscv64": 276, "loongarch64": 276, "armv7l": 382, "armv6l": 382, "ppc64le": 357,
                  "ppc64": 357, "s390x": 347}


@functools.lru_cache(maxsize=None)
def _renameat2() -> Optional[Callable[[bytes, bytes, int], int]]:
    """``renameat2(AT_FDCWD, a, AT_FDCWD, b, flags)`` through ctypes (Python's ``os`` has no
    renameat2 up to 3.13 at least): libc's wrapper, else the raw syscall; None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - no libc handle
        return None
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
        return lambda a, b, flags: fn(_AT_FDCWD, a, _AT_FDCWD, b, flags)
    nr = _SYS_RENAMEAT2.get(platform.machine())  # pragma: no cover - glibc < 2.28
    syscall = getattr(libc, "syscall", None)  # pragma: no cover
    if nr is None or syscall is None:  # pragma: no cover
        return None
    syscall.restype = ctypes.c_long  # pragma: no cover
    return lambda a, b, flags: syscall(ctypes.c_long(nr), ctypes.c_int(_AT_FDCWD), ctypes.c_char_p(a),  # pragma: no cover
                                       ctypes.c_int(_AT_FDCWD), ctypes.c_char_p(b), ctypes.c_uint(flags))


def exchange_paths(a: str, b: str) -> None:
    """Swap the two existing paths ``a`` and ``b`` atomically: ``renameat2(RENAME_EXCHANGE)``
    (Linux >= 3.15, both on one filesystem). After it, ``a`` names what ``b`` named and the
    other way round; a crash leaves either the old or the new state, never neither. Used to
    replace a checkpoint *directory* in one step (write the new one beside it, swap, remove
    the old one), which ``os.rename`` cannot do over a non-empty directory. Nothing is
    fsynced: fsync the parent(s) afterwards to make the swap durable.

    Raises:
        OSError: with ``errno`` in :data:`EXCHANGE_REFUSED` where there is no atomic
            exchange (``ENOSYS``: renameat2 cannot be called here; ``EINVAL``/``EOPNOTSUPP``:
            the kernel or filesystem refuses ``RENAME_EXCHANGE``); any other errno
            (``ENOENT``, ``EXDEV``, ``EACCES``...) as ``rename`` would raise it.
            ``filename``/``filename2`` are ``a``/``b``.
    """
    import ctypes

    _sys.fault_point("rename", a, b)  # an injected rename fault (fastpersist.testing) fails the exchange too
    fn = _renameat2()
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available on this system", a, None, b)
    if fn(os.fsencode(a), os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), a, None, b)
