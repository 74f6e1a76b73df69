"""The ``torch.save`` zip format: layout planner, fast reader and verifier.

Planning runs torch's own ``_save`` under ``torch.serialization.skip_data`` with a
pickle module of :mod:`fastpersist.formats.torchpickle` that reports each storage
the moment it is named; its record is laid out at once into a *recorder* (a
file-like object that keeps the headers and leaves each payload as a hole) by
:mod:`fastpersist.formats.zipwriter`, which writes the bytes torch's zip writer
would (see :mod:`fastpersist.formats.torchstream`). The recording is the exact
file minus the payload bytes. The payload CRCs, which are not known while
planning, become native *patches*: the executor computes each payload's CRC
while writing it and stores it in the data descriptor and in the central
directory. No tensor byte is copied during planning (CUDA and other non-CPU
storages are staged to host memory, unless the caller asks for *device sources*:
then CUDA storages are recorded, not copied, and :mod:`fastpersist.cudastage`
streams them through the staging pool; see docs/gpu.md).

The file is a plain torch zip with storages aligned to the O_DIRECT block size
(recorded in ``.storage_alignment``): stock ``torch.load`` reads it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from typing import Any, Iterator, Optional

import torch

from fastpersist import _sys, asyncstage, cudastage
from fastpersist.config import get_default
from fastpersist.errors import UnsupportedLayoutError
from fastpersist.formats.base import WritePlan
from fastpersist.formats.torchpickle import capture_module, pick_capture_module

log = logging.getLogger(__name__)

#: Bytes a blocking streamed save lays out before a batch goes to the disk while torch
#: is still pickling (:func:`stream_save_torch`'s ``batch_bytes`` in ``fastpersist.save``).
STREAM_BATCH = 256 << 20



# --------------------------------------------------------------------------- planning


def _host_bytes(storage: torch.UntypedStorage, keepalive: list[Any]) -> int:
    """Host address of the storage's bytes, staging non-CPU storages to (pinned) host memory."""
    if storage.device.type == "cpu":
        return storage.data_ptr()
    if storage.device.type == "meta":
        raise UnsupportedLayoutError("meta storages have no bytes to write")
    pin = storage.device.type == "cuda" and torch.cuda.is_available()
    host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
    host.untyped_storage().copy_(storage)
    keepalive.append(host)
    return host.data_ptr()


def _record_key(name: str) -> Optional[str]:
    """``archive/data/12`` -> ``"12"``; None for other records."""
    parts = name.split("/")
    if len(parts) == 3 and parts[1] == "data":
        return parts[2]
    return None


def _device_host_bytes(pred: Any) -> tuple[Any, Any]:
    """A ``host_bytes`` for the planner that records storages matching ``pred`` as
    device sources (their extent's ptr is their own address; no copy) and stages the
    other non-CPU ones as :func:`_host_bytes`. Returns ``(host_bytes, sources)``."""
    sources = DeviceSources()
    kept: list[int] = []  # id of the keepalive list that holds ``sources``

    def host_bytes(storage: torch.UntypedStorage, keepalive: list[Any]) -> int:
        if pred(storage):
            if id(keepalive) not in kept:
                keepalive.append(sources)
                kept.append(id(keepalive))
            return sources.add_storage(storage)
        return _host_bytes(storage, keepalive)

    return host_bytes, sources


def plan_torch(obj: Any, alignment: int, *, fast: bool = True, device_sources: Any = None) -> WritePlan:
    """Lay out ``obj`` as a torch zip file whose storages start at multiples of ``alignment``.

    The layout is the streaming one of :mod:`fastpersist.formats.torchstream`
    (storage records first, then ``data.pkl`` and the small records), as one
    batch: one CRC slot per non-empty storage record (``slot_names`` are the
    record names) and patches filling those CRCs in the data descriptors and the
    central directory. ``fastpersist.save`` streams the same layout while
    pickling instead of planning it whole.

    Raises:
        UnsupportedLayoutError: the object contains something ``skip_data`` cannot
            serialize (quantized or nested tensors, ...) or torch's writer produced a
            layout this planner does not understand; callers fall back to torch's writer.
        Anything ``torch.save`` raises for the object (unpicklable values, ...).
    """
    batches: list[Any] = []
    hb = _host_bytes if device_sources is None else _device_host_bytes(device_sources)[0]
    result = _run_stream(obj, alignment, batches.append, 0, stream_torch, fast=fast, host_bytes=hb)
    (b,) = batches
    names = [result.names[k] for k in b.payloads]
    return WritePlan(
        extents=b.extents,
        patches=b.patches,
        nslots=len(b.payloads),
        file_size=result.file_size,
        keepalive=result.keepalive,
        slot_names=names,
    )


def _run_stream(
    obj: Any, alignment: int, emit: Any, batch_bytes: int, stream: Any, crcs: Any = dict, fast: bool = True,
    host_bytes: Any = None,
) -> Any:
    """``stream_torch`` with this module's capture pickler and host staging.

    Python's cyclic garbage collector is paused meanwhile (and restored after):
    pickling allocates a few objects per tensor, and with tens of thousands of
    tensors alive every collection walks all of them; measured on 20,000 small
    tensors, the pauses were a quarter of the planning time. Nothing is leaked:
    the next collection after the save finds whatever cycles were made.
    """
    with _gc_paused():
        return _run_stream_inner(obj, alignment, emit, batch_bytes, stream, crcs, fast, host_bytes or _host_bytes)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _run_stream_inner(
    obj: Any, alignment: int, emit: Any, batch_bytes: int, stream: Any, crcs: Any, fast: bool, host_bytes: Any
) -> Any:
    try:
        return stream(
            obj,
            alignment,
            emit,
            batch_bytes=batch_bytes,
            host_bytes=host_bytes,
            capture_module=pick_capture_module if fast else capture_module,
            crcs_before_final=crcs,
            fast_layout=fast,
        )
    except RuntimeError as e:
        if "skip_data" in str(e):
            raise UnsupportedLayoutError(str(e)) from e
        raise


class _DeviceStorageFound(Exception):
    """Raised by the streaming save's ``host_bytes`` at the first device storage: the
    save restarts on the GPU path (never a RuntimeError: the planner wraps those)."""


def stream_save_torch(
    obj: Any, path: str, handle: Any, alignment: int, *, fsync: bool, batch_bytes: int, fast: bool = True,
    device_pred: Any = None, copier: Any = None,
) -> None:
    """Write ``obj`` to ``path`` in torch's zip format while it is being pickled.

    Batches of ``batch_bytes`` go to the native writer asynchronously as soon as
    pickling has laid them out (see :mod:`fastpersist.formats.torchstream`), so
    torch's per-tensor pickling overlaps the disk writes. ``handle`` must not be
    shared with other work (its ``wait`` collects every op). The file at ``path``
    is created/truncated first; ``fsync`` syncs it at the end.

    An object holding CUDA storages restarts at the first one (what was written is
    waited for and truncated): it is planned whole with its CUDA storages as device
    sources and written through the async saves' staging pool
    (``Config.async_staging_limit`` of the default config), D2H copies overlapping
    the disk writes (:func:`_save_cuda`). CPU-only objects pay nothing for this.
    ``device_pred``/``copier``: which storages count as device storages (default:
    CUDA ones) and the copier of the GPU path (tests run that path on CPU with these).
    """
    pred = device_pred or cudastage.is_cuda_storage

    def host_bytes(storage: torch.UntypedStorage, keepalive: list[Any]) -> int:
        if pred(storage):
            raise _DeviceStorageFound()
        return _host_bytes(storage, keepalive)

    fd = _sys.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    os.close(fd)
    submitted: list[tuple[int, list[int]]] = []  # (op id, payload index per slot)
    crcs: dict[int, int] = {}

    def collect() -> dict[int, int]:
        done = dict(handle.wait())
        for op, slots in submitted:
            for slot, crc in enumerate(done.get(op, [])):
                crcs[slots[slot]] = crc
        submitted.clear()
        return crcs

    def emit(batch: Any) -> None:
        if batch.final:
            handle.write(path, batch.extents, batch.patches, len(batch.payloads), truncate=False, fsync=fsync)
        else:
            op = handle.submit_write(path, batch.extents, batch.patches, len(batch.payloads), truncate=False)
            submitted.append((op, batch.payloads))

    try:
        result = _run_stream(obj, alignment, emit, batch_bytes, stream_torch, collect, fast, host_bytes)
        del result
    except _DeviceStorageFound:
        if handle.pending():
            handle.wait()  # the batches written so far; the GPU path truncates the file
        log.debug("%s: device storages found while pickling; saving through the GPU path", path)
        return _save_cuda(obj, path, handle, alignment, fsync=fsync, fast=fast, pred=pred, copier=copier)
    finally:
        if handle.pending():
            try:
                handle.wait()
            except OSError:
                pass  # the exception already propagating is the one to report


def _save_cuda(obj: Any, path: str, handle: Any, alignment: int, *, fsync: bool, fast: bool,
               pred: Any = None, copier: Any = None) -> None:
    """Blocking save of an object with CUDA tensors: plan with device sources, then
    :func:`fastpersist.cudastage.write_plan_blocking` through the shared staging pool
    (one capture at a time with the async saves); see docs/gpu.md."""
    plan = plan_torch(obj, alignment, fast=fast, device_sources=pred or cudastage.is_cuda_storage)
    pool = asyncstage.shared_pool(get_default().async_staging_limit)
    with asyncstage.capture_lock():
        cudastage.write_plan_blocking(plan, path, handle, pool, fsync=fsync, copier=copier)


# --------------------------------------------------------------------------- reading

# The reader lives in fastpersist.formats.torchload; re-exported for existing importers.
from fastpersist import _sys, cudastage
from fastpersist.cudastage import DeviceSources
from fastpersist.formats.torchload import fast_load_supported, load_torch  # noqa: E402,F401
from fastpersist.formats.torchstream import stream_torch

# verify moved to fastpersist.formats.torchverify; re-exported for existing importers
from fastpersist.formats.torchverify import TorchCheck, check_torch, read_index_from_bytes, verify_torch  # noqa: E402,F401
