"""The single-process pipeline: one save, load or verify of one file, blocking.

Every mode above composes these stages; this module is the one-process composition
that :func:`fastpersist.save`/:func:`~fastpersist.load`/:func:`~fastpersist.verify`
run when no process group is given:

save
    pending saves of the same file waited for (:mod:`fastpersist.pending`) → the
    target resolved → the format chosen (:func:`fastpersist.formats.registry.format_for`)
    → its writer planned (layout, alignment of the directory) → written to a temporary
    file by a native handle → committed (fsync, rename, fsync of the directory:
    :func:`fastpersist.commit.atomic_write`). An object only torch's writer can lay out
    is written by torch's writer, still aligned, atomic and durable.
load
    pending saves waited for → special files refused → the format's loader (index,
    parallel reads, CRC checks, rebuild), or ``torch.serialization.load`` for what
    only torch reads (file objects, legacy files, ...).
verify
    pending saves waited for → input checked (FIFOs, devices, link loops: the OS's
    error at once) → the format's verifier, or DCP's for a directory.
"""

from __future__ import annotations

import logging
import os
import stat
from typing import Any, Callable, Optional, TypeVar, Union

import torch

from fastpersist import _compat, handles, objectstore, pending, s3tier
from fastpersist import config as config_mod
from fastpersist._inputs import check_input, is_path, special_file_error
from fastpersist.commit import atomic_write, fsync_path, resolve_target, sync_deferred
from fastpersist.errors import UnsupportedLayoutError
from fastpersist.formats import registry
from fastpersist.formats.base import VerifyResult
from fastpersist.formats.safetensors import SafetensorsValueError

log = logging.getLogger("fastpersist.api")

PathLike = Union[str, "os.PathLike[str]"]
T = TypeVar("T")

#: ``backend=`` values ``safetensors.torch.load_file`` accepts.
ST_BACKENDS = ("mmap", "pread")


def naming_final(final: str, write: Callable[[str], T]) -> Callable[[str], T]:
    """Wrap a temp-file writer so that its ``OSError`` names the file the user asked
    for; the message keeps the temporary name, offset and length from the native layer."""

    def wrapped(tmp: str) -> T:
        try:
            return write(tmp)
        except OSError as e:
            if e.errno is None:
                raise
            raise type(e)(e.errno, f"{e.strerror or e} (saving {final!r} via temporary file {tmp!r}; "
                          f"the previous file at this path is untouched)", final) from e

    return wrapped


def save(obj: Any, path: PathLike, *, config: Any = None, format: Optional[str] = None,
         metadata: Optional[dict] = None) -> None:
    """:func:`fastpersist.save` in this process alone (see its docstring)."""
    if objectstore.is_s3_url(path):
        pending.before_blocking_save(os.fspath(path))  # an async save to the same URL first
        cfg = config_mod.resolve(config)
        if s3tier.enabled(cfg):  # the local copy as any local save, then the drain queued
            s3tier.save_through(path, cfg, lambda local: save(obj, local, config=cfg, format=format,
                                                              metadata=metadata))
            return None
        return objectstore.save(obj, path, config=config, format=format, metadata=metadata)
    if not is_path(path):
        raise TypeError(
            f"fastpersist.save writes to a file path (str or os.PathLike), got {type(path).__name__}; "
            "for file-like objects such as io.BytesIO use torch.save"
        )
    cfg = config_mod.resolve(config)
    final = resolve_target(path)
    if cfg.fsync and sync_deferred(final):  # a staged directory whose commit fsyncs the whole tree
        cfg = cfg.replace(fsync=False)
    pending.before_blocking_save(final)
    fmt = registry.format_for(final, format)
    align = handles.alignment_for(os.path.dirname(final))
    assert fmt.writer is not None
    write = fmt.writer(obj, final, align, cfg, metadata)
    try:
        atomic_write(final, naming_final(final, write), fsync=cfg.fsync)
    except UnsupportedLayoutError as e:
        if fmt is not registry.TORCH:
            raise
        log.debug("fast torch layout not possible for %s (%s); writing with torch's writer", final, e)
        save_with_torch(obj, final, align, cfg)


def save_file(tensors: dict, filename: PathLike, metadata: Optional[dict] = None, *, config: Any = None) -> None:
    """:func:`fastpersist.save_file` (see its docstring)."""
    if isinstance(filename, bytes) or not is_path(filename):
        raise TypeError(f"argument 'filename': expected str or os.PathLike object, not {type(filename).__name__}")
    if objectstore.is_s3_url(filename):
        pending.before_blocking_save(os.fspath(filename))
        cfg = config_mod.resolve(config)
        if s3tier.enabled(cfg):
            s3tier.save_through(filename, cfg, lambda local: save_file(tensors, local, metadata, config=cfg))
            return None
        return objectstore.save_file(tensors, filename, metadata, config=config)
    cfg = config_mod.resolve(config)
    final = resolve_target(filename)
    if cfg.fsync and sync_deferred(final):  # a staged directory whose commit fsyncs the whole tree
        cfg = cfg.replace(fsync=False)
    pending.before_blocking_save(final)
    write = registry.safetensors_writer(tensors, final, handles.alignment_for(os.path.dirname(final)), cfg, metadata)
    atomic_write(final, naming_final(final, write), fsync=cfg.fsync)


def save_with_torch(obj: Any, final: str, alignment: int, cfg: Any) -> None:
    """Fallback: torch's own writer (still aligned, atomic and durable)."""

    def write(tmp: str) -> None:
        # torch names the archive after a path's file name up to its last dot, and
        # refuses an empty name ("invalid file name"): a temporary name such as
        # ".fp-tmp-HASH-..." has none. Given an open file, torch names it "archive",
        # as for every file object (torch.load reads any name).
        with open(tmp, "wb") as f, _compat.save_storage_alignment(alignment, required=False):
            torch.serialization.save(obj, f)
        if cfg.fsync:
            fsync_path(tmp)

    atomic_write(final, write, fsync=cfg.fsync)


def load_file(filename: PathLike, device: Union[str, int, torch.device] = "cpu", *, backend: str = "mmap",
              config: Any = None) -> dict:
    """:func:`fastpersist.load_file` (see its docstring)."""
    if not is_path(filename) and not isinstance(filename, bytes):
        raise TypeError(f"argument 'filename': expected str, bytes or os.PathLike object, not {type(filename).__name__}")
    if backend not in ST_BACKENDS:
        raise SafetensorsValueError(f'backend "{backend}" is invalid (expected one of: "mmap", "pread")')
    if isinstance(device, int) and not isinstance(device, bool):
        device = f"cuda:{device}"
    try:
        target = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise SafetensorsValueError(f"device {device} is invalid ({e})") from None
    if objectstore.is_s3_url(filename):
        pending.wait_before_reading(os.fspath(filename))
        cfg = config_mod.resolve(config)
        return s3tier.read_best(filename, cfg, lambda local: load_file(local, target, backend=backend, config=cfg),
                                lambda: objectstore.load_file(filename, target, config=cfg))
    fspath = os.fsdecode(os.fspath(filename))
    cfg = config_mod.resolve(config)
    return registry.load_safetensors_file(fspath, target, cfg, None)


def load(path: Any, map_location: Any = None, pickle_module: Any = None, *, weights_only: Optional[bool] = None,
         mmap: Optional[bool] = None, config: Any = None, **pickle_load_args: Any) -> Any:
    """:func:`fastpersist.load` in this process alone (see its docstring)."""
    pending.wait_before_reading(path)
    req = registry.LoadRequest(path, map_location, pickle_module, weights_only, mmap, dict(pickle_load_args))
    if objectstore.is_s3_url(path):
        cfg = config_mod.resolve(config)
        return s3tier.read_best(
            path, cfg, lambda local: load(local, map_location, pickle_module, weights_only=weights_only, mmap=mmap,
                                          config=cfg, **pickle_load_args),
            lambda: objectstore.load(path, req, config=cfg))
    if not is_path(path):
        return req.torch_load()
    fspath = os.fsdecode(os.fspath(path))
    refuse_special_file(fspath, "load")
    cfg = config_mod.resolve(config)
    fmt = registry.format_for(fspath)
    assert fmt.load is not None
    return fmt.load(fspath, cfg, req)


def refuse_special_file(path: str, action: str) -> None:
    """A FIFO, socket or device file at ``path``: an ``OSError`` now (ESPIPE, ENODEV),
    where torch.load would block in ``open()`` on a FIFO with no writer, or read a
    device without end. Anything else (a missing path, a directory, a link loop) goes
    on to the reader, whose error is torch's."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        raise special_file_error(path, mode, action)


def verify(path: PathLike, *, config: Any = None) -> VerifyResult:
    """:func:`fastpersist.verify` (see its docstring)."""
    if objectstore.is_s3_url(path):
        pending.wait_before_reading(os.fspath(path))
        cfg = config_mod.resolve(config)
        prefix = os.fspath(path).endswith("/")  # a DCP checkpoint's prefix: never a tiered copy
        return _verify_tiered(path, cfg) if s3tier.enabled(cfg) and not prefix else objectstore.verify(path, config=cfg)
    fspath = os.fsdecode(os.fspath(path))
    pending.wait_before_reading(fspath, tree=True)
    st = check_input(fspath, "verify", directory_ok=True)  # a FIFO, device, link loop: an OSError at once
    handle = handles.handle_for(config_mod.resolve(config), read=True)
    if stat.S_ISDIR(st.st_mode):  # a torch.distributed.checkpoint directory
        return registry.DCP.verify(fspath, handle)
    return registry.format_for(fspath).verify(fspath, handle)


def _verify_tiered(url: Any, cfg: Any) -> VerifyResult:
    """:func:`verify` of an ``s3://`` URL: its tiered mode's local copy when there is one
    (the result names the URL; a note names the copy), the object when there is none, or
    when the copy is damaged and the store holds the same checkpoint."""
    copy = s3tier.local_copy(url, cfg)
    if copy is not None:
        try:
            result = verify(copy.path, config=cfg)
        except OSError as e:
            if not copy.durable:
                raise
            log.warning("tiered mode: the local copy %s of %s cannot be read (%s); verifying the object", copy.path,
                        url, e)
        else:
            if result.ok or not copy.durable:
                name = os.fspath(url)
                result.problems = [p.replace(copy.path, name) for p in result.problems]
                result.notes.append(f"checked the local copy {copy.path} of the tiered mode (s3_local_dir)")
                result.path = name
                return result
            log.warning("tiered mode: the local copy %s of %s is %s (%s); verifying the object", copy.path, url,
                        result.status, "; ".join(result.problems))
    return objectstore.verify(url, config=cfg)
