"""The native handles every save and load runs on, one per distinct I/O setting, and the
alignment of a directory's files.

Part of the I/O layer: :func:`handle_for` builds a ``fastpersist._native.Handle`` for a
:class:`~fastpersist.config.Config`'s engine settings once and reuses it for the life of
the process (a forked child starts with none and builds its own); :func:`borrow_writer`
lends a handle to one save alone (idle ones are kept, so that a save does not start a
handle's threads); :func:`alignment_for` says where storages start in a file written
to a directory.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from fastpersist import io, readpolicy
from fastpersist.config import Config
from fastpersist.idlepool import IdlePool

_handles: dict[tuple, Any] = {}
_handles_lock = threading.Lock()
_WRITERS_MAX = 2  #: idle writers kept per setting
_writers: IdlePool[Any] = IdlePool(_WRITERS_MAX)  # emptied in a forked child and at exit (idlepool)


def _forget_handles_in_child() -> None:
    """A forked child starts with no cached handles and a fresh lock (a parent
    thread may have held the old one at the fork). The native handles are
    fork-safe on their own (``_native.pyi``); dropping them just lets the child
    build its own threads once, when it first saves or loads."""
    global _handles_lock
    _handles_lock = threading.Lock()
    _handles.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_handles_in_child)


def handle_for(config: Config, *, read: bool = False) -> Any:
    """A native Handle for ``config``'s I/O settings (one per distinct setting, reused);
    ``read``: for loads and verification (``config.read_queue_depth``; where it is None,
    the depth a load's plan chooses for the device, see :func:`fastpersist.readpolicy.plan_read`)."""
    kwargs = config.handle_kwargs(read=read)
    # read_staging "auto" lets read_mode "auto" choose zero-copy or staged reads
    # (fastpersist.readpolicy.plan_read); such a handle is a different one from an explicit setting's
    stage_auto = read and config.read_staging == "auto"
    # read_queue_depth None lets the load's plan take the depth the device calls for
    depth_auto = read and config.read_queue_depth is None
    key = (*sorted(kwargs.items()), ("stage_auto", stage_auto), ("depth_auto", depth_auto))
    with _handles_lock:
        h = _handles.get(key)
        if h is None:
            h = _handles[key] = io.native_module().Handle(**kwargs)
            # the handle lives in _handles for the life of the process
            if stage_auto:
                readpolicy.mark_staging_auto(h)
            if depth_auto:
                readpolicy.mark_depth_auto(h)
        return h


def forget_handles() -> None:
    """Drop the cached handles (their threads end when nothing else holds them)."""
    with _handles_lock:
        _handles.clear()


def borrow_writer(config: Config) -> Any:
    """A native Handle with ``config``'s write settings for one save alone (a save collects
    its batches with ``wait()``, which takes every op of the handle, so two saves never
    share one): an idle one kept by :func:`give_back_writer`, or a new one. Reusing it
    spares each save the handle's thread starts (a new handle per save was a fixed cost
    of every small save). One not handed back is simply dropped."""
    kwargs = config.handle_kwargs()
    idle = _writers.take(tuple(sorted(kwargs.items())))
    return idle if idle is not None else io.native_module().Handle(**kwargs)


def give_back_writer(config: Config, handle: Any) -> None:
    """Keep ``handle`` (from :func:`borrow_writer` with the same ``config``) for the next
    save, when it has nothing pending; it keeps one staging buffer, not all its last
    save used."""
    if handle.pending():
        return
    handle.trim_buffers(1)
    _writers.keep(tuple(sorted(config.handle_kwargs().items())), handle)


def forget_writers() -> None:
    """Drop the idle writers (their threads end)."""
    _writers.clear()


def alignment_for(directory: str) -> int:
    """Where storages start: a multiple of the directory's O_DIRECT alignment (at least
    4096) and of torch's ``config.save.storage_alignment`` when that is a larger power of two."""
    align = max(4096, int(io.native_module().alignment_of(directory)))
    try:
        from torch.utils.serialization import config

        wanted = config.save.storage_alignment
    except (ImportError, AttributeError):  # pragma: no cover - torch older than 2.6
        return align
    if isinstance(wanted, int) and wanted > align and wanted & (wanted - 1) == 0 and align & (align - 1) == 0:
        return wanted
    return align
