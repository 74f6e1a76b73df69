"""Route ``torch.save`` / ``torch.load`` through fastpersist.

Code you do not control (a trainer, a framework) calls ``torch.save(obj, path)``;
:func:`patch_torch_save` makes those calls write with fastpersist::

    fastpersist.patch_torch_save()          # from now on, process-wide
    with fastpersist.patch_torch_save():    # only inside the block (nests)
        trainer.fit(model)

Only the attributes ``torch.save`` and ``torch.load`` are replaced
(``torch.serialization.save``/``load`` stay torch's own). Calls with a path (``str``
or ``os.PathLike``) and torch's default arguments go to :func:`fastpersist.save` /
:func:`fastpersist.load`. ``torch.save`` into an open file (``with open(name, "wb") as
f: torch.save(obj, f)``) goes to :func:`fastpersist.openfile.save_into_fd` when the
object is one :func:`open_file_target` takes (``open()``'s ``FileIO``/``BufferedWriter``/
``BufferedRandom``, or fsspec's ``LocalFileOpener`` around one, on a named, empty,
regular file, writable, not appended to, at position 0): the bytes a path save writes,
written in place (the caller holds the inode, so there is no rename; a failed write
leaves the file partly written, as torch does), the position left at the end. Other
file-like objects (``io.BytesIO``, pipes, sockets, appended, non-empty or unlinked
files, files at an offset, ``tempfile`` wrappers), ``torch.load`` of any file object, and
arguments the fast path does not implement (a custom ``pickle_module``, a
``pickle_protocol`` other than torch's default, ``_use_new_zipfile_serialization=False``,
``_disable_byteorder_record=True``) go to the original functions unchanged.
A path that ``torch.save`` writes *into* rather than replaces also goes to the
original ``torch.save``: an existing device, FIFO or socket (``torch.save(x,
"/dev/null")`` keeps working and ``/dev/null`` stays a device), and a writable file
in a directory this process cannot create files in (fastpersist's atomic
replacement needs a temporary file beside the target; torch overwrites in place).
A write-protected file raises ``PermissionError`` either way, as with torch.
torch's serialization settings that change the bytes written go to torch as well:
``skip_data()``, ``set_crc32_options(False)``, a ``config.save.storage_alignment`` that
is not a power of two (a power of two is honoured by the fast path), an active
fake-tensor mode (see :func:`_torch_settings_differ`); ``torch.load`` inside
``skip_data()`` is torch's. Errors keep torch's types: where stock ``torch.save`` or
``torch.load`` raises ``RuntimeError``, the wrappers raise a class that is both
fastpersist's error and ``RuntimeError`` (:mod:`fastpersist.torcherrors`). Loads check
CRC-32s by :mod:`fastpersist.formats.crcpolicy`'s rule (files torch writes without CRCs,
or changes through a ``MAP_SHARED`` mmap load, load as torch loads them).
``torch.save`` always writes torch's zip format, whatever the file name; ``torch.load``
of a ``.safetensors`` name is left to the original (whose handling depends on the
torch version).

``FASTPERSIST_PATCH_TORCH_SAVE=1`` patches with no code change: in every Python process
of an environment where fastpersist is installed (torchrun, Lightning, Accelerate and
DeepSpeed workers included), the start-up hook ``_fastpersist_startup`` (run by
``fastpersist-startup.pth``; source ``integrations/_startup.py``) calls
:func:`patch_torch_save` right after ``import torch`` completes; it imports neither
torch nor fastpersist before that. ``import fastpersist`` also patches when the
variable is set. Check it in the environment that runs your job::

    FASTPERSIST_PATCH_TORCH_SAVE=1 python -c "import torch; print(hasattr(torch.save, '_fastpersist_original'))"

(``True``: patched; this line itself never imports fastpersist.)
"""

from __future__ import annotations

import fcntl
import functools
import inspect
import io
import logging
import os
import stat
import sys
import threading
from typing import Any, Callable, Optional

import torch

from fastpersist import openfile
from fastpersist.api import load as fast_load
from fastpersist.api import save as fast_save
from fastpersist.config import parse_bool
from fastpersist.formats import registry
from fastpersist.torcherrors import for_torch_load, for_torch_save
from fastpersist.wrappers import MARK

__all__ = ["is_patched", "open_file_target", "patch_torch_save", "unpatch_torch_save"]

log = logging.getLogger(__name__)

_ENV_VAR = "FASTPERSIST_PATCH_TORCH_SAVE"

_lock = threading.RLock()

# torch's own signatures and defaults: callers of torch.save use torch's API, whatever
# the attribute held before we replaced it.
_SAVE_SIG = inspect.signature(torch.serialization.save)
_SAVE_DEFAULTS = {
    name: p.default for name, p in _SAVE_SIG.parameters.items() if p.default is not inspect.Parameter.empty
}


def _is_path(f: Any) -> bool:
    return isinstance(f, (str, os.PathLike)) and isinstance(os.fspath(f), str)


def _is_safetensors_name(f: Any) -> bool:
    return registry.format_for(os.fspath(f)) is registry.SAFETENSORS


def _save_fast_path(args: tuple, kwargs: dict) -> Optional[inspect.BoundArguments]:
    """The bound arguments if this ``torch.save`` call can go to fastpersist, else None
    (``f`` may be a path or a file object; :func:`open_file_target` checks the latter)."""
    try:
        bound = _SAVE_SIG.bind(*args, **kwargs)
    except TypeError:
        return None  # let the original raise its own error
    if "f" not in bound.arguments:
        return None
    for name, value in bound.arguments.items():
        if name in ("obj", "f"):
            continue
        default = _SAVE_DEFAULTS.get(name, inspect.Parameter.empty)
        if value is not default and value != default:
            return None  # non-default pickle_module / protocol / legacy format / byteorder flag
    return bound


def _power_of_two(n: Any) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def _torch_settings_differ() -> Optional[str]:
    """Why torch's serialization settings in effect make this ``torch.save`` torch's to
    write, or None when the fast path writes what they ask for.

    Every setting of ``torch.serialization`` and ``torch.utils.serialization.config``
    (torch 2.15) that changes the bytes ``torch.save`` writes:

    * ``skip_data()`` (thread-local; storages announced, their bytes not written, CRC 0):
      torch writes;
    * ``set_crc32_options(False)`` / ``config.save.compute_crc32 = False`` (every CRC-32
      field 0): torch writes;
    * ``config.save.storage_alignment``: a power of two is honoured by the fast path
      (storages start at multiples of the larger of it and the O_DIRECT alignment, and
      ``.storage_alignment`` records that value); any other value: torch writes;
    * an active fake-tensor mode (fake tensors are saved by torch under ``skip_data``): torch.

    ``config.save.use_pinned_memory_for_d2h`` changes how torch copies accelerator
    storages, not the bytes written (the fast path copies through its own pinned
    buffers). Arguments (``pickle_module``, ``pickle_protocol``,
    ``_use_new_zipfile_serialization``, ``_disable_byteorder_record``) are checked by
    :func:`_save_fast_path`.
    """
    ser = torch.serialization
    tls = getattr(ser, "_serialization_tls", None)
    if getattr(tls, "skip_data", False):
        return "torch.serialization.skip_data() is active"
    get_crc = getattr(ser, "get_crc32_options", None)
    if get_crc is not None and not get_crc():
        return "torch.serialization.set_crc32_options(False) is in effect"
    try:
        from torch.utils.serialization import config
    except ImportError:  # pragma: no cover - torch older than 2.6
        config = None
    if config is not None:
        align = getattr(config.save, "storage_alignment", 64)
        if not _power_of_two(align):
            return f"torch.utils.serialization.config.save.storage_alignment is {align!r}, not a power of two"
    try:
        if torch._guards.detect_fake_mode(None) is not None:
            return "a fake-tensor mode is active"
    except Exception:  # noqa: BLE001 - private API; assume no fake mode
        pass
    return None


def _load_settings_differ() -> Optional[str]:
    """Why torch's loading settings in effect make this ``torch.load`` torch's, or None."""
    tls = getattr(torch.serialization, "_serialization_tls", None)
    if getattr(tls, "skip_data", False):
        return "torch.serialization.skip_data() is active"
    return None


def _written_in_place(f: Any) -> Optional[str]:
    """Why ``torch.save`` must write into the existing ``f`` instead of fastpersist replacing
    it (a device, FIFO or socket; a directory that refuses new files), or None."""
    path = os.path.abspath(os.fspath(f))
    try:
        st = os.stat(path)  # follows symbolic links, like open()
    except OSError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
        return "not a regular file (device, FIFO or socket)"
    directory = os.path.dirname(os.path.realpath(path))
    if os.path.isdir(directory):
        check = {"effective_ids": True} if os.access in os.supports_effective_ids else {}
        if not os.access(directory, os.W_OK | os.X_OK, **check):
            return "its directory does not allow creating the temporary file"
    return None


_OPEN_TYPES = (io.FileIO, io.BufferedWriter, io.BufferedRandom)


def _fsspec_local_file(f: Any) -> Optional[Any]:
    """The ``open()`` object inside fsspec's ``LocalFileOpener`` ``f`` (uncompressed), else None.

    fsspec (2026.9) opens local files with the built-in ``open()`` and keeps that
    object as ``.f`` (with ``autocommit=False``, a ``mkstemp`` file it moves into
    place on ``commit()``); its ``write``/``seek``/``tell`` are ``.f``'s. With a
    ``compression=`` the inner object is a compressor: refused. fsspec is not imported
    here: a ``LocalFileOpener`` exists only if its module is already loaded."""
    local = sys.modules.get("fsspec.implementations.local")
    opener = getattr(local, "LocalFileOpener", None)
    if opener is None or type(f) is not opener or getattr(f, "compression", None):
        return None
    return getattr(f, "f", None)


def open_file_target(f: Any) -> tuple[Optional[Any], str]:
    """``(file, "")`` when the patched ``torch.save`` writes into the file object ``f``
    itself (``file``: the ``open()`` object to write through and to move), else
    ``(None, why)`` and torch's own ``torch.save`` writes it.

    Taken: exactly ``io.FileIO``, ``io.BufferedWriter`` and ``io.BufferedRandom`` (what
    the built-in ``open()`` returns for binary modes ``"wb"``, ``"w+b"``, ``"r+b"``,
    ``"xb"``, ``buffering=0`` included; subclasses are not taken: they may change
    ``write``), and fsspec's ``LocalFileOpener`` around one of them, when the file is
    open, writable (``O_WRONLY``/``O_RDWR``), not in append mode (``"a"``/``O_APPEND``),
    a regular file of length 0 with a name in the filesystem that still refers to it
    (not deleted, not renamed away), that ``/proc/self/fd/N`` reopens for writing (its
    permissions allow it; ``/proc`` is mounted), at position 0 (object and descriptor),
    with nothing buffered.

    A file of length > 0 goes to torch too: torch writes over its start and leaves
    its tail, where the fast path sets the length to the archive's.
    """
    inner = _fsspec_local_file(f)
    target = inner if inner is not None else f
    if type(target) not in _OPEN_TYPES:
        return None, f"{type(f).__name__} is not one of open()'s writable binary file types"
    try:
        if target.closed:
            return None, "the file is closed"
        if not target.writable():
            return None, "the file is not open for writing"
        if "a" in str(getattr(target, "mode", "")):
            return None, "the file is open in append mode"
        fd = target.fileno()
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        if flags & os.O_APPEND or (flags & os.O_ACCMODE) not in (os.O_WRONLY, os.O_RDWR):
            return None, "the descriptor is in append mode or not open for writing"
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "not a regular file (pipe, socket or device)"
        if st.st_size != 0:
            return None, "the file is not empty (torch writes over its start and keeps its tail)"
        if target.tell() != 0 or os.lseek(fd, 0, os.SEEK_CUR) != 0:
            return None, "the file's position is not 0"
        openfile.fd_name(fd)  # a named regular file, the same inode (OSError otherwise)
        try:  # the writer reopens it as /proc/self/fd/N: refused there (permissions, a
            # filesystem that does not reopen), torch writes through the caller's descriptor
            os.close(os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_CLOEXEC))
        except OSError as e:
            return None, f"the file cannot be reopened for writing ({e.strerror})"
    except (OSError, ValueError) as e:
        return None, f"not a plain named file ({e})"
    return target, ""


def _save_into_open_file(obj: Any, target: Any) -> None:
    """Write ``obj`` into the ``open()`` object ``target`` (see :func:`open_file_target`)
    and leave its position at the end, as torch does."""
    fd = target.fileno()
    try:
        size = openfile.save_into_fd(obj, fd)
    except BaseException:
        try:
            target.seek(0, os.SEEK_END)  # where torch's failed writes leave it
        except (OSError, ValueError):
            pass
        raise
    target.seek(size)


def _make_save(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def save(*args: Any, **kwargs: Any) -> Any:
        bound = _save_fast_path(args, kwargs)
        if bound is None:
            return original(*args, **kwargs)
        f = bound.arguments["f"]
        target = None
        if _is_path(f):
            why = _torch_settings_differ() or _written_in_place(f)
        else:
            target, why = open_file_target(f)
            why = why or _torch_settings_differ() or ""
        if why:
            log.debug("torch.save(%r): %s; using torch's own save", f, why)
            return original(*args, **kwargs)

        try:
            if target is not None:
                return _save_into_open_file(bound.arguments["obj"], target)
            return fast_save(bound.arguments["obj"], f, format="torch")
        except Exception as e:
            dual = for_torch_save(e)
            if dual is None:
                raise
            raise dual.with_traceback(e.__traceback__) from None

    setattr(save, MARK, original)
    return save


def _make_load(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        if not _is_path(f) or _is_safetensors_name(f):
            return original(f, *args, **kwargs)
        why = _load_settings_differ()
        if why is not None:
            log.debug("torch.load(%r): %s; using torch's own load", f, why)
            return original(f, *args, **kwargs)
        # fastpersist.load takes torch.load's arguments and hands what it cannot do
        # itself (mmap, legacy files, ...) to torch.serialization.load.

        try:
            return fast_load(f, *args, **kwargs)
        except Exception as e:
            dual = for_torch_load(e)
            if dual is None:
                raise
            raise dual.with_traceback(e.__traceback__) from None

    setattr(load, MARK, original)
    return load


def _is_ours(fn: Any) -> bool:
    return callable(fn) and hasattr(fn, MARK)


class TorchSavePatch:
    """Returned by :func:`patch_torch_save`; as a context manager it restores, on exit,
    the ``torch.save``/``torch.load`` that were in place before the call."""

    def __init__(self, previous_save: Callable[..., Any], previous_load: Callable[..., Any]) -> None:
        self._previous: Optional[tuple[Callable[..., Any], Callable[..., Any]]] = (previous_save, previous_load)

    def __enter__(self) -> "TorchSavePatch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def restore(self) -> None:
        """Put back the functions replaced by this patch (idempotent)."""
        with _lock:
            if self._previous is not None:
                torch.save, torch.load = self._previous
                self._previous = None


def patch_torch_save() -> TorchSavePatch:
    """Replace ``torch.save`` and ``torch.load`` with fastpersist-backed wrappers.

    Call it once to switch process-wide, or use it as a context manager to switch
    for a block (the previous functions come back on exit; blocks nest). Patching
    an already patched torch changes nothing. The wrappers keep torch's signatures
    (``inspect.signature(torch.save)`` is unchanged) and fall back to the original
    functions for non-default arguments and for file-like objects other than the
    open files :func:`open_file_target` takes.

    Returns:
        A :class:`TorchSavePatch`, usable with ``with``.
    """
    with _lock:
        previous = TorchSavePatch(torch.save, torch.load)
        if not _is_ours(torch.save):
            torch.save = _make_save(torch.save)
        if not _is_ours(torch.load):
            torch.load = _make_load(torch.load)
        return previous


def unpatch_torch_save() -> None:
    """Restore the original ``torch.save`` / ``torch.load`` (no-op if not patched)."""
    with _lock:
        while _is_ours(torch.save):
            torch.save = getattr(torch.save, MARK)
        while _is_ours(torch.load):
            torch.load = getattr(torch.load, MARK)


def is_patched() -> bool:
    """Whether ``torch.save`` currently goes through fastpersist."""
    return _is_ours(torch.save)


def apply_env_patch() -> None:
    """Patch at import if ``FASTPERSIST_PATCH_TORCH_SAVE`` is true (called by ``fastpersist/__init__``).

    Raises:
        ValueError: the variable is set to something that is not a boolean.
    """
    raw = os.environ.get(_ENV_VAR, "")
    if raw.strip() == "":
        return

    if parse_bool(_ENV_VAR, raw):
        patch_torch_save()
