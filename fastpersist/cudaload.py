"""The GPU path of loads: records streamed disk -> page-locked ring -> device memory.

A loader hands :func:`read_items` a list of :class:`RingItem` (a record's local header
and data ranges in the file, and the tensor its bytes go to). :func:`ring_read` reads
them through a few page-locked windows (:data:`RING_WINDOWS` x :data:`RING_WINDOW`
bytes, whatever the file's size), fills in each record's local header bytes and the
CRC-32 of its data from the host window, and copies the data into its destination on a
side stream (:class:`H2DCopier`); a window is read again only once its copies are done,
while the next windows are already being read. :func:`read_items` chooses between that
ring and GPUDirect (cuFile) from the folder and the settings.

This layer knows no format: which records go where, and what their headers and CRC-32s
must be, is the loaders' business (torch zip: :mod:`fastpersist.formats.torchdevice`,
which applies torch's ``map_location`` rules; safetensors:
:mod:`fastpersist.formats.safetensors.load`).

:func:`ring_read` works for CPU destinations too (plain copies); the tests use
that to check the windowing, the header and CRC reads and the error handling on
machines without a GPU; the CUDA parts are checked by tests/test_gpu_path.py on a GPU
(docs/gpu.md).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from fastpersist import _native
from fastpersist._sys import pread_full
from fastpersist.cudastage import mark_side_streams, wait_events
from fastpersist.io import gpu_path, require_cufile

log = logging.getLogger(__name__)

__all__ = ["H2DCopier", "RING_WINDOW", "RING_WINDOWS", "RingItem", "read_items", "ring_read"]

#: Page-locked windows of the load ring, and bytes per window.
RING_WINDOWS = 4
RING_WINDOW = 16 << 20
_PAGE = 4096
#: Records closer than this in the file are read in one run (the gap is read too).
_MERGE_GAP = 1 << 20

#: Ring windows of finished loads, kept for the next one: page-locking and
#: registering 64 MiB with CUDA costs milliseconds per load. Keyed by window size;
#: forgotten in a forked child (CUDA cannot be used there).
_spare: dict[int, list[Any]] = {}
_spare_lock = threading.Lock()


def _take_windows(k: int, window: int, register_cuda: bool) -> list[Any]:
    with _spare_lock:
        free = _spare.get(window, [])
        bufs, _spare[window] = free[:k], free[k:]
    while len(bufs) < k:
        bufs.append(_native.PinnedBuffer(window, _PAGE, True))
    if register_cuda:
        for b in bufs:
            if not b.cuda_registered and not b.cuda_register():
                log.debug("fastpersist: load ring window not registered with CUDA; H2D copies from it are synchronous")
    return bufs


def _give_back(window: int, bufs: list[Any]) -> None:
    with _spare_lock:
        free = _spare.setdefault(window, [])
        free.extend(bufs[: max(0, RING_WINDOWS - len(free))])


def _forget_in_child() -> None:
    _spare.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


@dataclass
class RingItem:
    """One record to read: its local header ``[header_offset, data_offset)`` (returned
    in :attr:`header`) and its data ``[data_offset, data_offset + size)`` copied into
    ``dest`` (1-D uint8 tensor of ``size`` bytes, any device), CRC-32 in :attr:`crc`."""

    header_offset: int
    data_offset: int
    size: int
    dest: torch.Tensor
    header: bytearray = field(default_factory=bytearray)
    crc: int = 0

    @property
    def end(self) -> int:
        return self.data_offset + self.size


class H2DCopier:
    """Copies window bytes into destination tensors: for CUDA destinations on a side
    stream per device (ordered after the device's current stream, which waits for the
    copies at :meth:`end`), one event per device and window; for CPU destinations a
    plain copy."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}
        self._used: set[torch.device] = set()

    def _side(self, dev: torch.device) -> Any:
        s = self._streams.get(dev)
        if s is None:
            s = torch.cuda.Stream(device=dev)
            s.wait_stream(torch.cuda.current_stream(dev))  # the destinations were allocated there
            self._streams[dev] = s
        return s

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.device.type != "cuda":
            dst.copy_(src)
            return
        side = self._side(dst.device)
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        dst.record_stream(side)
        self._used.add(dst.device)

    def mark(self) -> Any:
        return mark_side_streams(self._streams, self._used)

    def wait(self, token: Any) -> None:
        wait_events(token)

    def end(self) -> None:
        for dev, side in self._streams.items():
            torch.cuda.current_stream(dev).wait_stream(side)


def _windows_of(items: list[RingItem], window: int) -> list[tuple[int, int]]:
    """File ranges ``[start, end)`` to read, in order: runs of records (merged across
    gaps below :data:`_MERGE_GAP`), cut into pieces that fit a window with their
    start's page offset."""
    runs: list[list[int]] = []
    for it in items:
        if runs and it.header_offset - runs[-1][1] < _MERGE_GAP and it.header_offset >= runs[-1][0]:
            runs[-1][1] = max(runs[-1][1], it.end)
        else:
            runs.append([it.header_offset, it.end])
    out: list[tuple[int, int]] = []
    for a, z in runs:
        pos = a
        while pos < z:
            end = min(z, pos + window - pos % _PAGE)
            out.append((pos, end))
            pos = end
    return out


def ring_read(fd: int, reader: Any, items: list[RingItem], *, checksum: bool = True,
              windows: int = RING_WINDOWS, window: int = RING_WINDOW,
              copier: Optional[H2DCopier] = None, register_cuda: Optional[bool] = None) -> None:
    """Read ``items`` (sorted by ``header_offset``, not overlapping) from ``fd`` through
    ``windows`` page-locked buffers of ``window`` bytes with ``reader.read_async``; fill
    each item's :attr:`~RingItem.header`, copy its data into its ``dest`` and (with
    ``checksum``) compute its :attr:`~RingItem.crc` from the host window. Returns once
    every copy is done (the device's current stream is ordered after them).

    Raises the read's ``OSError``/``EOFError``; every read and copy in flight has
    finished by then (the windows can go).
    """
    if not items:
        return
    if copier is None:
        copier = H2DCopier()
    if register_cuda is None:
        register_cuda = any(it.dest.device.type == "cuda" for it in items)
    cuts = _windows_of(items, window)
    k = max(1, min(windows, len(cuts)))
    bufs = _take_windows(k, window, register_cuda)
    tensors = [torch.frombuffer(b, dtype=torch.uint8) for b in bufs]
    futs: list[Any] = [None] * k
    tokens: list[Any] = [None] * k
    first = 0  # the first item that may still overlap the next window

    def start(i: int) -> None:
        w = i % k
        copier.wait(tokens[w])
        tokens[w] = None
        a, z = cuts[i]
        futs[w] = reader.read_async(fd, [(a, bufs[w].ptr + a % _PAGE, z - a, -1)])

    try:
        for i in range(k):
            start(i)
        for i, (a, z) in enumerate(cuts):
            w = i % k
            fut, futs[w] = futs[w], None
            fut.result()  # GIL released; raises the read's error
            base = bufs[w].ptr + a % _PAGE
            t = tensors[w]
            lead = a % _PAGE
            j = first
            while j < len(items) and items[j].header_offset < z:
                it = items[j]
                h0, h1 = max(it.header_offset, a), min(it.data_offset, z)
                if h0 < h1:
                    it.header += bytes(memoryview(bufs[w])[lead + h0 - a: lead + h1 - a])
                d0, d1 = max(it.data_offset, a), min(it.end, z)
                if d0 < d1:
                    if checksum:
                        it.crc = _native.crc32(base + d0 - a, d1 - d0, it.crc)  # GIL released
                    copier.copy(it.dest[d0 - it.data_offset:d1 - it.data_offset], t[lead + d0 - a: lead + d1 - a])
                if it.end <= z:
                    if j == first:
                        first += 1
                j += 1
            tokens[w] = copier.mark()
            if i + k < len(cuts):
                start(i + k)
        for w in range(k):
            copier.wait(tokens[w])
            tokens[w] = None
        copier.end()
        del tensors
        _give_back(window, bufs)
    except BaseException:
        for f in futs:
            if f is not None:
                f.wait()
        for tok in tokens:
            try:
                copier.wait(tok)
            except BaseException:  # noqa: BLE001 - the first error is the one to report
                pass
        raise


def _cufile_read(fd: int, path: str, reader: Any, items: list[RingItem]) -> None:
    """GPUDirect: each record's data read by cuFile straight into its device tensor
    (one native op, the file registered once), local headers read with pread. Only
    with checksums off (no host bytes to check). Its data path has not run on a GPU yet:
    the one GPU machine tried refused cuFileHandleRegister (docs/gpu.md)."""
    for it in items:
        it.header = bytearray(pread_full(fd, it.data_offset - it.header_offset, it.header_offset, path))
    for dev in {it.dest.device for it in items}:
        # the caching allocator may hand out memory that kernels queued on the current
        # stream still use; cuFile writes it outside any stream
        torch.cuda.current_stream(dev).synchronize()
    h = _native.Handle(engine="cufile", chunk_size=getattr(reader, "chunk_size", 8 << 20))
    h.read(fd, [(it.data_offset, it.dest.data_ptr(), it.size, -1) for it in items], 0)
    log.debug("%s: %d storages read with cuFile", path, len(items))


def read_items(fd: int, path: str, reader: Any, items: list[RingItem], *, cuda: bool, checksum: bool) -> list[RingItem]:
    """Read ``items`` (sorted by ``header_offset``) into their ``dest`` tensors the way
    the GPU path chooses for the file's folder (:func:`fastpersist.io.gpu_path`):
    GPUDirect (cuFile) when it is usable and checksums are off, else the page-locked
    ring (:func:`ring_read`). ``cuda``: the destinations are CUDA devices (the way is
    chosen only for them; anything else takes the ring). Returns the items read, with
    their local headers and (``checksum``) CRC-32s filled in: new ones when cuFile refused
    the file and engine ``"auto"`` fell back to the ring. Knows no format: the caller
    checks the headers and CRC-32s against its own records.

    Raises:
        RuntimeError: engine ``"cufile"`` where cuFile cannot load (``require_cufile``).
        OSError, EOFError: a read failed.
    """
    engine = getattr(reader, "engine", "auto")
    directory = os.path.dirname(os.path.abspath(path))
    if cuda and engine == "cufile":
        require_cufile(directory, "load", checksum=checksum)
    way = gpu_path(directory, engine=engine, checksum=checksum) if cuda else None
    if way is not None and way.load == "cufile":
        try:
            _cufile_read(fd, path, reader, items)
        except OSError as e:
            # cuFile loaded and its driver opened, but it refuses this file (no nvidia-fs, no
            # compatibility mode): engine "auto" reads through the pinned ring instead
            if engine == "cufile" or e.errno != errno.ENOTSUP:
                raise
            log.info("%s: cuFile refused the file (%s); reading through the pinned ring", path, e)
            items = [replace(it, header=bytearray(), crc=0) for it in items]  # nothing half-read
            ring_read(fd, reader, items, checksum=checksum)
    else:
        if way is not None:
            log.debug("%s: CUDA records read through the pinned ring (%s)", path, way.load_reason)
        ring_read(fd, reader, items, checksum=checksum)
    return items
