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
storages are staged to host memory).

The file is a plain torch zip with storages aligned to the O_DIRECT block size
(recorded in ``.storage_alignment``): stock ``torch.load`` reads it.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import os
import sys
import re
import struct
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from fastpersist.errors import ChecksumError, UnsupportedLayoutError, ZipFormatError
from fastpersist.formats.base import WritePlan
from fastpersist.formats.torchpickle import capture_module, pick_capture_module
from fastpersist.formats.zipindex import ZipIndex, buffer_reader, fd_reader, parse_zip_index, read_central_directory

log = logging.getLogger(__name__)



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


def plan_torch(obj: Any, alignment: int, *, fast: bool = True) -> WritePlan:
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
    from fastpersist.formats.torchstream import stream_torch

    batches: list[Any] = []
    result = _run_stream(obj, alignment, batches.append, 0, stream_torch, fast=fast)
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
    obj: Any, alignment: int, emit: Any, batch_bytes: int, stream: Any, crcs: Any = dict, fast: bool = True
) -> Any:
    """``stream_torch`` with this module's capture pickler and host staging.

    Python's cyclic garbage collector is paused meanwhile (and restored after):
    pickling allocates a few objects per tensor, and with tens of thousands of
    tensors alive every collection walks all of them; measured on 20,000 small
    tensors, the pauses were a quarter of the planning time. Nothing is leaked:
    the next collection after the save finds whatever cycles were made.
    """
    with _gc_paused():
        return _run_stream_inner(obj, alignment, emit, batch_bytes, stream, crcs, fast)


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
    obj: Any, alignment: int, emit: Any, batch_bytes: int, stream: Any, crcs: Any, fast: bool
) -> Any:
    try:
        return stream(
            obj,
            alignment,
            emit,
            batch_bytes=batch_bytes,
            host_bytes=_host_bytes,
            capture_module=pick_capture_module if fast else capture_module,
            crcs_before_final=crcs,
            fast_layout=fast,
        )
    except RuntimeError as e:
        if "skip_data" in str(e):
            raise UnsupportedLayoutError(str(e)) from e
        raise


def stream_save_torch(
    obj: Any, path: str, handle: Any, alignment: int, *, fsync: bool, batch_bytes: int, fast: bool = True
) -> None:
    """Write ``obj`` to ``path`` in torch's zip format while it is being pickled.

    Batches of ``batch_bytes`` go to the native writer asynchronously as soon as
    pickling has laid them out (see :mod:`fastpersist.formats.torchstream`), so
    torch's per-tensor pickling overlaps the disk writes. ``handle`` must not be
    shared with other work (its ``wait`` collects every op). The file at ``path``
    is created/truncated first; ``fsync`` syncs it at the end.
    """
    from fastpersist.formats.torchstream import stream_torch

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
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
        result = _run_stream(obj, alignment, emit, batch_bytes, stream_torch, collect, fast)
        del result
    finally:
        if handle.pending():
            try:
                handle.wait()
            except OSError:
                pass  # the exception already propagating is the one to report


# --------------------------------------------------------------------------- reading


class _MemoryFile:
    """Minimal read-only file over a memoryview, for ``torch._C.PyTorchFileReader`` (no copies)."""

    def __init__(self, view: memoryview) -> None:
        self._mv = view
        self._pos = 0

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == 0:
            self._pos = offset
        elif whence == 1:
            self._pos += offset
        elif whence == 2:
            self._pos = len(self._mv) + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), len(self._mv) - self._pos))
        out[:n] = self._mv[self._pos : self._pos + n]
        self._pos += n
        return n

    def read(self, n: int = -1) -> bytes:
        end = len(self._mv) if n is None or n < 0 else min(len(self._mv), self._pos + n)
        data = bytes(self._mv[self._pos : end])
        self._pos = max(self._pos, end)
        return data

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True


def fast_load_supported() -> bool:
    """Whether this torch's private ``_load`` takes the arguments the fast reader passes."""
    fn = getattr(torch.serialization, "_load", None)
    if fn is None:
        return False
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "overall_storage" in params and "weights_only" in params


def _native_read(handle: Any, path: str, extents: list[tuple[int, int, int, int]], nslots: int) -> list[int]:
    """``handle.read`` whose ``OSError`` always names ``path``."""
    try:
        return handle.read(path, extents, nslots)
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise type(e)(e.errno, e.strerror or str(e), path) from e


def _file_buffer(path: str, size: int, lock: bool) -> Any:
    """A page-aligned native buffer for the whole file at ``path`` (rounded up to the
    O_DIRECT alignment of its filesystem), page-locked when ``lock``."""
    from fastpersist import _native

    align = 4096
    try:
        align = max(4096, _native.alignment_of(path))
    except OSError:
        pass
    return _native.PinnedBuffer(_round_up(max(size, 1), align), align, lock)


def _whole_file_extents(ptr: int, size: int, slotted: list[tuple[Any, int, int]]) -> list[tuple[int, int, int, int]]:
    """Read extents covering ``[0, size)`` into the buffer at ``ptr``, one CRC slot
    per ``(entry, offset, length)`` of ``slotted`` (sorted, disjoint)."""
    extents: list[tuple[int, int, int, int]] = []
    pos = 0
    for slot, (_entry, off, n) in enumerate(slotted):
        if off > pos:
            extents.append((pos, ptr + pos, off - pos, -1))
        extents.append((off, ptr + off, n, slot))
        pos = off + n
    if pos < size:
        extents.append((pos, ptr + pos, size - pos, -1))
    return extents


def _checksum_error(path: str, problems: list[str]) -> ChecksumError:
    """One error for every record whose CRC-32 is wrong (the first five spelled out)."""
    return ChecksumError(
        f"{path}: {len(problems)} record(s) do not match their checksum (the file is corrupt; "
        f"restore it from a good copy): " + "; ".join(problems[:5])
        + (f"; ... and {len(problems) - 5} more" if len(problems) > 5 else ""),
        path=path,
        records=[p.split(":", 1)[0] for p in problems],
    )


def _predict_records(entries: list[Any], cd_off: int) -> list[tuple[Any, int, int]]:
    """``(central entry, data_offset, length)`` of every non-empty record in file
    order, from the central directory alone: records lie back to back, so a record's
    bytes end where the next local header (or the central directory) starts, less
    its data descriptor. Empty when that does not hold (checked after the read
    against the local headers)."""
    ordered = sorted(entries, key=lambda e: e.header_offset)
    out: list[tuple[Any, int, int]] = []
    for i, e in enumerate(ordered):
        nxt = ordered[i + 1].header_offset if i + 1 < len(ordered) else cd_off
        desc = 0
        if e.flags & 0x0008:
            desc = 24 if e.header_offset >= 0xFFFFFFFF or e.compressed_size >= 0xFFFFFFFF else 16
        off = nxt - desc - e.compressed_size
        if e.compressed_size > 0:
            if off < e.header_offset + 30 or (out and off < out[-1][1] + out[-1][2]):
                return []
            out.append((e, off, e.compressed_size))
    return out


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _read_extents(index: ZipIndex, ptr: int, checksum: bool) -> tuple[list[tuple[int, int, int, int]], list[str]]:
    """Read extents covering the whole file (``ptr`` = 0: discard), one CRC slot per non-empty record."""
    size = index.file_size
    if not checksum:
        return ([(0, ptr, size, -1)] if size else []), []
    records = sorted((e for e in index.entries if e.compressed_size > 0), key=lambda e: e.data_offset)
    extents: list[tuple[int, int, int, int]] = []
    names: list[str] = []
    pos = 0
    for e in records:
        if e.data_offset < pos:
            raise ZipFormatError(
                f"{index.path}: record {e.name} at {e.data_offset} overlaps the previous one",
                index.path,
                e.data_offset,
            )
        if ptr and e.data_offset > pos:
            extents.append((pos, ptr + pos, e.data_offset - pos, -1))
        extents.append((e.data_offset, ptr + e.data_offset if ptr else 0, e.compressed_size, len(names)))
        names.append(e.name)
        pos = e.data_end
    if ptr and pos < size:
        extents.append((pos, ptr + pos, size - pos, -1))
    return extents, names


def _crc_problems(index: ZipIndex, names: list[str], crcs: list[int]) -> list[str]:
    problems = []
    for name, crc in zip(names, crcs):
        entry = index.by_name[name]
        if entry.method != 0:
            continue  # CRC of compressed records is over the inflated bytes; torch never compresses
        if crc != entry.crc32:
            problems.append(
                f"{name}: CRC-32 mismatch (computed {crc:08x}, recorded {entry.crc32:08x}) "
                f"in bytes [{entry.data_offset}, {entry.data_end})"
            )
    return problems


@dataclass
class ReadResult:
    """A whole torch zip file read into one page-aligned host buffer."""

    record_names: list[str]  #: every record of the archive
    size: int  #: file size
    buffer: Any  #: the native PinnedBuffer (keeps the memory alive)
    data: torch.Tensor  #: uint8 tensor over the file bytes (shares ``buffer``)


def read_whole_file(path: str, handle: Any, *, checksum: bool = True, lock: bool = False) -> ReadResult:
    """Read the zip file at ``path`` with one parallel (O_DIRECT where possible) native read.

    With ``checksum`` every record's CRC-32 is computed during the read and compared
    with the central directory.

    The central directory (one small read at the end) tells where each record's
    bytes are, so their CRCs are computed during the bulk read; afterwards each
    local header (now in memory) confirms the prediction. Files whose layout the
    prediction does not fit are indexed in full from memory and checksummed in a
    second pass. Parsing local headers through the page cache before the read
    would cost two small reads per record on a cold file.

    Raises:
        ZipFormatError: not a consistent zip archive.
        ChecksumError: a record's bytes do not match its recorded CRC-32.
        OSError: I/O errors from the native layer (with path and offset).
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        try:
            cd_off, central = read_central_directory(fd_reader(fd), size, path)
        except ZipFormatError:
            cd_off, central = 0, []
    finally:
        os.close(fd)
    predicted = _predict_records(central, cd_off)
    buf = _file_buffer(path, size, lock)
    slotted = predicted if checksum else []
    extents = _whole_file_extents(buf.ptr, size, slotted)
    read_crcs = _native_read(handle, path, extents, len(slotted)) if size else []
    view = memoryview(buf).cast("B")[:size]

    problems: list[str] = []
    if central and _local_headers_agree(view, central, predicted):
        names = [e.name for e in central]
        for (entry, off, n), crc in zip(slotted, read_crcs):
            if crc != entry.crc32:
                problems.append(
                    f"{entry.name}: CRC-32 mismatch (computed {crc:08x}, recorded {entry.crc32:08x}) "
                    f"in bytes [{off}, {off + n})"
                )
    else:  # a layout the prediction does not fit: full index from memory, CRCs in a second pass
        index = parse_zip_index(buffer_reader(view), size, path)
        names = [e.name for e in index.entries]
        if checksum:
            records = [e for e in index.entries if e.compressed_size > 0]
            crcs = handle.crc32_ranges([(buf.ptr + e.data_offset, e.compressed_size) for e in records])
            problems = _crc_problems(index, [e.name for e in records], crcs)
    if problems:
        raise _checksum_error(path, problems)
    data = torch.frombuffer(buf, dtype=torch.uint8, count=size) if size else torch.empty(0, dtype=torch.uint8)
    return ReadResult(record_names=names, size=size, buffer=buf, data=data)


def _local_headers_agree(view: memoryview, central: list[Any], predicted: list[tuple[Any, int, int]]) -> bool:
    """Whether every stored record's local header (in memory) puts its bytes where predicted."""
    expected = {id(e): off for e, off, _n in predicted}
    size = len(view)
    for e in central:
        if e.compressed_size == 0:
            continue
        h = e.header_offset
        if id(e) not in expected or h + 30 > size or bytes(view[h : h + 4]) != b"PK\x03\x04":
            return False
        method = struct.unpack_from("<H", view, h + 8)[0]
        nlen, xlen = struct.unpack_from("<HH", view, h + 26)
        if method != 0 or h + 30 + nlen + xlen != expected[id(e)]:
            return False
    return True


def load_torch(
    path: str,
    handle: Any,
    map_location: Any,
    pickle_module: Any,
    *,
    weights_only: bool,
    checksum: bool = True,
    **pickle_load_args: Any,
) -> Any:
    """Load a torch zip checkpoint: one native read of the whole file, then torch's ``_load``.

    Every CPU storage of the result is a slice of one host buffer holding the file
    (like ``torch.load(..., mmap=True)`` shares one mapping): the buffer is freed
    when the last loaded tensor dies.

    Raises:
        UnsupportedLayoutError: a TorchScript archive or a torch without the private
            entry point; the caller falls back to ``torch.serialization.load``.
        pickle.UnpicklingError: from the (weights-only) unpickler.
    """
    if not fast_load_supported():
        raise UnsupportedLayoutError("torch.serialization._load lacks overall_storage")
    lock = _wants_pinned(map_location)
    if not lock:
        overlapped = _load_overlapped(
            path, handle, map_location, pickle_module, weights_only=weights_only, checksum=checksum, **pickle_load_args
        )
        if overlapped is not None:
            return overlapped[0]
    result = read_whole_file(path, handle, checksum=checksum, lock=lock)
    if any(n == "constants.pkl" or n.endswith("/constants.pkl") for n in result.record_names):
        raise UnsupportedLayoutError("TorchScript archive")
    view = memoryview(result.buffer).cast("B")[: result.size]
    reader = torch._C.PyTorchFileReader(_MemoryFile(view))
    overall = result.data.untyped_storage()
    return torch.serialization._load(
        reader,
        map_location,
        pickle_module,
        overall_storage=overall,
        weights_only=weights_only,
        **pickle_load_args,
    )


#: Rebuild functions that never read storage bytes while unpickling.
_DATA_FREE_REBUILDS = frozenset({b"_rebuild_tensor_v2", b"_rebuild_parameter", b"_rebuild_parameter_with_state"})


class _PredictedReader:
    """What ``torch.serialization._load`` asks of a zip reader, answered from the
    small records (read from the file's tail) and predicted payload offsets, so
    unpickling can run while the payloads are still being read."""

    def __init__(self, small: dict[str, bytes], offsets: dict[str, int]) -> None:
        self._small = small
        self._offsets = offsets

    def has_record(self, name: str) -> bool:
        return name in self._small or name in self._offsets

    def get_record(self, name: str) -> bytes:
        return self._small[name]

    def get_record_offset(self, name: str) -> int:
        return self._offsets[name]

    def serialization_id(self) -> str:
        return self._small.get(".data/serialization_id", b"").decode("ascii", "replace")


def _short(name: str) -> str:
    return name.split("/", 1)[1] if "/" in name else name


def _load_overlapped(
    path: str, handle: Any, map_location: Any, pickle_module: Any, *, weights_only: bool, checksum: bool,
    **pickle_load_args: Any,
) -> Optional[tuple[Any]]:
    """Load with torch's unpickling overlapping the bulk read, or None when the file or
    the call does not allow it (then the caller reads first and unpickles after).

    Needs the streaming layout (every small record after the payloads, so one read of
    the tail holds ``data.pkl``), native byte order, CPU ``map_location`` and a pickle
    whose tensor rebuilds never read storage bytes. The predicted payload offsets are
    checked against the local headers once the read is done; if they were wrong the
    result is discarded (None).
    """
    import zlib

    from fastpersist import _native

    if not (map_location is None or (isinstance(map_location, (str, torch.device)) and torch.device(map_location).type == "cpu")):
        return None
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        try:
            cd_off, central = read_central_directory(fd_reader(fd), size, path)
        except ZipFormatError:
            return None
        predicted = _predict_records(central, cd_off)
        storages = [e for e in central if _record_key(e.name) is not None]
        small = [e for e in central if _record_key(e.name) is None]
        if not predicted or not small or any(_short(e.name) == "constants.pkl" for e in central):
            return None
        payload_end = max((off + n for e, off, n in predicted if _record_key(e.name) is not None), default=0)
        tail_start = min(e.header_offset for e in small)
        if tail_start < payload_end:
            return None  # torch.save's own order (data.pkl first): nothing to overlap
        tail = os.pread(fd, size - tail_start, tail_start)
    finally:
        os.close(fd)
    records: dict[str, bytes] = {}
    for e in small:
        h = e.header_offset - tail_start
        if len(tail) < h + 30 or tail[h : h + 4] != b"PK\x03\x04":
            return None
        nlen, xlen = struct.unpack_from("<HH", tail, h + 26)
        body = tail[h + 30 + nlen + xlen : h + 30 + nlen + xlen + e.compressed_size]
        if len(body) != e.compressed_size or struct.unpack_from("<H", tail, h + 8)[0] != 0:
            return None
        if checksum and zlib.crc32(body) != e.crc32:
            raise ChecksumError(
                f"{path}: record {e.name} does not match its checksum (the file is corrupt; restore it from a "
                f"good copy)", path=path, records=[e.name],
            )
        records[_short(e.name)] = body
    pkl = records.get("data.pkl")
    order = records.get("byteorder")
    if pkl is None or (order is not None and order.decode("ascii", "replace") != sys.byteorder):
        return None
    rebuilds = set(re.findall(rb"_rebuild_[A-Za-z0-9_]+", pkl))
    if not rebuilds <= _DATA_FREE_REBUILDS:
        return None
    offsets = {_short(e.name): e.header_offset for e in storages}  # empty records: any in-range offset
    offsets.update({_short(e.name): off for e, off, _n in predicted if _record_key(e.name) is not None})

    buf = _file_buffer(path, size, False)
    slotted = predicted if checksum else []
    extents = _whole_file_extents(buf.ptr, size, slotted)
    reader_handle = _native.Handle(
        handle.engine, handle.chunk_size, handle.queue_depth, handle.threads, handle.direct,
        stage_reads=handle.stage_reads,
    )
    reader_handle.submit_read(path, extents, len(slotted))
    data = torch.frombuffer(buf, dtype=torch.uint8, count=size)
    try:
        result = torch.serialization._load(
            _PredictedReader(records, offsets),
            map_location,
            pickle_module,
            overall_storage=data.untyped_storage(),
            weights_only=weights_only,
            **pickle_load_args,
        )
    finally:
        try:
            done = reader_handle.wait()  # the bytes must be in place (or the read over) before anything returns
        except OSError as e:
            if e.filename is None and e.errno is not None:
                raise type(e)(e.errno, e.strerror or str(e), path) from e
            raise
    crcs = done[0][1] if done else []
    view = memoryview(buf).cast("B")[:size]
    if not _local_headers_agree(view, central, predicted):
        log.debug("%s: predicted record offsets were wrong; loading again the sequential way", path)
        return None
    problems = [
        f"{e.name}: CRC-32 mismatch (computed {crc:08x}, recorded {e.crc32:08x}) in bytes [{off}, {off + n})"
        for (e, off, n), crc in zip(slotted, crcs)
        if crc != e.crc32
    ]
    if problems:
        raise _checksum_error(path, problems)
    return (result,)


def _wants_pinned(map_location: Any) -> bool:
    """Page-lock the read buffer only when its bytes go on to an accelerator."""
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location).type != "cpu"
    return False


# verify moved to fastpersist.formats.torchverify; re-exported for existing importers
from fastpersist.formats.torchverify import TorchCheck, check_torch, read_index_from_bytes, verify_torch  # noqa: E402,F401
