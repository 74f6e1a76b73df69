"""The GPU path of loads: storage records streamed disk -> page-locked ring -> device.

``fastpersist.load(path, map_location=...)`` of a torch zip file decides, from the
pickle's persistent ids (:func:`fastpersist.formats.picklescan.scan_pickle` records
each storage's saved location), where torch's ``map_location`` semantics put each
storage (:func:`destinations`: a device string or ``torch.device`` maps every
storage; a dict maps saved locations; ``None`` keeps them). Storages that end up on
a CUDA device are not read into host buffers: :func:`ring_read` reads their records
through a few page-locked windows (:data:`RING_WINDOWS` x :data:`RING_WINDOW`
bytes, whatever the file's size), checks each record's local header and CRC-32 from
the host window, and copies the payload into a freshly allocated device tensor on a
side stream (:class:`H2DCopier`); a window is read again only once its copies are
done, while the next windows are already being read. The unpickler's
``persistent_load`` then gets those device storages, and torch's
``restore_location`` leaves them where they are (``storage.to(device)`` is the
identity on the right device).

A callable ``map_location`` keeps the host path (torch's unpickler moves
storages after the callable saw a CPU storage, which it may rely on).

:func:`ring_read` works for CPU destinations too (plain copies); the tests use
that to check the windowing, the header and CRC checks and the error handling on
machines without a GPU; the CUDA parts are checked by tests/test_gpu_path.py on a GPU
(docs/gpu.md).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch

from fastpersist import _native
from fastpersist._sys import pread_full
from fastpersist.cudastage import mark_side_streams, wait_events
from fastpersist.io import gpu_path, require_cufile

log = logging.getLogger(__name__)

__all__ = ["H2DCopier", "RING_WINDOW", "RING_WINDOWS", "RingItem", "destinations", "ring_read"]

#: Page-locked windows of the load ring, and bytes per window.
RING_WINDOWS = 4
RING_WINDOW = 16 << 20
_PAGE = 4096
#: Records closer than this in the file are read in one run (the gap is read too).
_MERGE_GAP = 1 << 20
_CUDA_LOCATION = re.compile(r"^cuda(:[0-9]+)?$")

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


def _cuda_device(target: Any) -> Optional[torch.device]:
    """The CUDA device torch's ``default_restore_location`` would put a storage on for
    the location ``target``, or None (not CUDA, or not restorable: torch raises then)."""
    if isinstance(target, bytes):
        target = target.decode()
    if isinstance(target, torch.device):
        target = str(target)
    if not isinstance(target, str) or not _CUDA_LOCATION.match(target):
        return None
    if not torch.cuda.is_available():
        return None
    index = int(target[5:]) if ":" in target else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        return None
    return torch.device("cuda", index)


def _is_storage_pid(pid: Any) -> bool:
    return isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[3], str)


def destinations(map_location: Any, pids: list[Any]) -> dict[str, torch.device]:
    """Storage key -> the CUDA device torch would restore it to, for the storages
    that go to a CUDA device under ``map_location`` (None, str, bytes, torch.device or
    dict; a callable gives ``{}``). ``pids``: the pickle's persistent ids
    (``('storage', type, key, location, numel)``). Costs one check when nothing goes
    to a CUDA device (a CPU ``map_location``, or no CUDA device here), and never
    initialises CUDA then (``torch.cuda.is_available()`` does not)."""
    if isinstance(map_location, (str, bytes, torch.device)):
        dev = _cuda_device(map_location)
        if dev is None:
            return {}
        return {str(pid[2]): dev for pid in pids if _is_storage_pid(pid)}
    if map_location is not None and not isinstance(map_location, dict):
        return {}  # a callable: the host path (it may rely on getting CPU storages)
    if not torch.cuda.is_available():
        return {}  # saved CUDA locations cannot be restored here: torch raises its own error
    where: dict[str, Optional[torch.device]] = {}  # saved location -> device (None: not CUDA)
    out: dict[str, torch.device] = {}
    seen: dict[str, Optional[torch.device]] = {}
    for pid in pids:
        if not _is_storage_pid(pid):
            continue
        key, loc = str(pid[2]), pid[3]
        if loc not in where:
            target = map_location.get(loc, loc) if isinstance(map_location, dict) else loc
            where[loc] = _cuda_device(target)
        dev = where[loc]
        if key in seen and seen[key] != dev:  # one key, two places: leave it to torch
            out.pop(key, None)
            continue
        seen[key] = dev
        if dev is not None:
            out[key] = dev
    return out


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


def records_for_device(load: Any, dest: dict[str, torch.device]) -> list[Any]:
    """The storage records of a :class:`fastpersist.formats.torchload.LoadState` whose key
    goes to a CUDA device (non-empty, not read yet), in file order."""
    out = []
    for key in dest:
        r = load.by_short.get(f"data/{key}")
        if r is not None and r.buffer is None and r.size > 0:
            out.append(r)
    out.sort(key=lambda r: r.entry.header_offset)
    return out


def read_to_device(load: Any, reader: Any, fd: int, dest: dict[str, torch.device],
                   allocate: Optional[Callable[[int, torch.device], torch.Tensor]] = None) -> list[Any]:
    """Read every record of ``dest``'s keys into device memory through the ring; each
    record's ``device`` attribute is set to its uint8 tensor once its local header and
    CRC-32 (``load.checksum``) are checked. Returns the records."""

    records = records_for_device(load, dest)
    if not records:
        return []
    engine = getattr(reader, "engine", "auto")
    directory = os.path.dirname(os.path.abspath(load.path))
    cuda = any(d.type == "cuda" for d in dest.values())
    if cuda and engine == "cufile":
        require_cufile(directory, "load", checksum=load.checksum)
    way = gpu_path(directory, engine=engine, checksum=load.checksum) if cuda else None
    alloc = allocate or (lambda n, dev: torch.empty(n, dtype=torch.uint8, device=dev))
    items = [RingItem(r.entry.header_offset, r.data_offset, r.size, alloc(r.size, dest[r.short[5:]]))
             for r in records]
    if way is not None and way.load == "cufile":
        try:
            _cufile_read(fd, load.path, reader, items)
        except OSError as e:
            # cuFile loaded and its driver opened, but it refuses this file (no nvidia-fs, no
            # compatibility mode): engine "auto" reads through the pinned ring instead
            if engine == "cufile" or e.errno != errno.ENOTSUP:
                raise
            log.info("%s: cuFile refused the file (%s); reading through the pinned ring", load.path, e)
            items = [replace(it, header=bytearray(), crc=0) for it in items]  # nothing half-read
            ring_read(fd, reader, items, checksum=load.checksum)
    else:
        if way is not None:
            log.debug("%s: CUDA storages read through the pinned ring (%s)", load.path, way.load_reason)
        ring_read(fd, reader, items, checksum=load.checksum)
    for r, it in zip(records, items):
        load._check_header(r, memoryview(it.header))
    if load.checksum:
        bad = [f"{r.entry.name}: CRC-32 mismatch (computed {it.crc:08x}, recorded {r.entry.crc32:08x}) "
               f"in bytes [{r.data_offset}, {r.data_end})" for r, it in zip(records, items)
               if it.crc != r.entry.crc32 and r.entry.crc32 != 0]  # 0: no CRC (fastpersist.formats.crcpolicy)
        if bad:
            load.crc_mismatch(bad)  # raises for files fastpersist wrote
    for r, it in zip(records, items):
        r.device = it.dest
    return records
