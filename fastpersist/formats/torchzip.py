"""The ``torch.save`` zip format: layout planner, fast reader and verifier.

Planning runs torch's own serializer with ``torch.serialization.skip_data`` into a
*recorder* (a file-like object that keeps what is written and remembers where the
writer skipped ahead). The writer emits every header, the pickle and the small
records, and skips each storage payload with a relative seek, so the recording is
the exact file minus the payload bytes. A pickle module whose ``Pickler`` watches
torch's ``persistent_id`` tells which storage each ``data/KEY`` record holds. The
payload CRCs, which the writer cannot know, become native *patches*: the executor
computes each payload's CRC while writing it and stores it in the data descriptor
and in the central directory. No tensor byte is copied during planning (CUDA and
other non-CPU storages are staged to host memory).

The file is a plain torch zip with storages aligned to the O_DIRECT block size
(recorded in ``.storage_alignment``): stock ``torch.load`` reads it.
"""

from __future__ import annotations

import bisect
import inspect
import logging
import os
import pickle
import threading
import types
from dataclasses import dataclass
from typing import Any, Optional

import torch

from fastpersist.errors import ChecksumError, UnsupportedLayoutError, ZipFormatError
from fastpersist.formats.base import PATCH_U32LE, WritePlan
from fastpersist.formats.zipindex import ZipIndex, buffer_reader, fd_reader, parse_zip_index

log = logging.getLogger(__name__)

# torch's serialization config is process-global: planners take turns.
_CONFIG_LOCK = threading.RLock()


# --------------------------------------------------------------------------- planning


class _Recorder:
    """File-like sink for ``torch.save``: keeps written bytes, leaves skipped ranges as holes."""

    def __init__(self) -> None:
        self.blob = bytearray()
        #: contiguous written runs: (file_offset, blob_offset, length)
        self.segments: list[tuple[int, int, int]] = []
        self._starts: list[int] = []  # file_offset of each segment, for bisect
        self.pos = 0
        self.size = 0

    def write(self, data: Any) -> int:
        if type(data) is not bytes:
            data = memoryview(data).cast("B")
        n = len(data)
        if n == 0:
            return 0
        if self.pos < self.size:
            # torch's writer only moves forward; anything else is a layout we do not know
            raise UnsupportedLayoutError(f"torch's zip writer wrote backwards (offset {self.pos} < {self.size})")
        if self.segments and self.segments[-1][0] + self.segments[-1][2] == self.pos:
            f, b, length = self.segments[-1]
            self.segments[-1] = (f, b, length + n)
        else:
            self.segments.append((self.pos, len(self.blob), n))
            self._starts.append(self.pos)
        self.blob += data
        self.pos += n
        self.size = self.pos
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == 0:
            new = offset
        elif whence == 1:
            new = self.pos + offset
        elif whence == 2:
            new = self.size + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if new < 0:
            raise ValueError(f"negative seek position {new}")
        self.pos = new
        self.size = max(self.size, new)
        return new

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def read_at(self, offset: int, length: int) -> bytes:
        """Recorded bytes of ``[offset, offset+length)``; holes read as zeros."""
        end = min(offset + length, self.size)
        if end <= offset:
            return b""
        out = bytearray(end - offset)
        i = max(0, bisect.bisect_right(self._starts, offset) - 1)
        while i < len(self.segments):
            f, b, n = self.segments[i]
            if f >= end:
                break
            lo, hi = max(f, offset), min(f + n, end)
            if lo < hi:
                out[lo - offset : hi - offset] = self.blob[b + lo - f : b + hi - f]
            i += 1
        return bytes(out)


def _capture_module(found: dict[str, torch.UntypedStorage]) -> Any:
    """A pickle module for ``torch.save`` whose Pickler records key -> storage.

    torch's ``_save`` subclasses ``pickle_module.Pickler`` and overrides
    ``persistent_id`` with a method; we wrap the bound method per instance through
    ``pickle.Pickler``'s C-level ``persistent_id`` attribute, which the C pickler
    consults, so torch's own logic (storage dedup, keys, dtype checks) is unchanged.
    """

    class CapturePickler(pickle.Pickler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            inner = self.persistent_id

            def persistent_id(obj: Any) -> Any:
                pid = inner(obj)
                if pid is not None and type(pid) is tuple and len(pid) == 5 and pid[0] == "storage":
                    storage = obj._untyped_storage if isinstance(obj, torch.storage.TypedStorage) else obj
                    found[str(pid[2])] = storage
                return pid

            pickle.Pickler.persistent_id.__set__(self, persistent_id)  # type: ignore[attr-defined]

    return types.SimpleNamespace(__name__="fastpersist_capture", Pickler=CapturePickler, Unpickler=pickle.Unpickler)


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


def plan_torch(obj: Any, alignment: int) -> WritePlan:
    """Lay out ``obj`` as a torch zip file whose storages start at multiples of ``alignment``.

    Returns a :class:`WritePlan` with one CRC slot per non-empty storage record
    (``slot_names`` are the record names) and patches filling those CRCs in the
    data descriptors and the central directory. Metadata records (pickle,
    version, ...) carry the CRCs torch's writer computed.

    Raises:
        UnsupportedLayoutError: the object contains something ``skip_data`` cannot
            serialize (quantized or nested tensors, ...) or torch's writer produced a
            layout this planner does not understand; callers fall back to torch's writer.
        Anything ``torch.save`` raises for the object (unpicklable values, ...).
    """
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    from torch.utils.serialization import config as tconfig

    found: dict[str, torch.UntypedStorage] = {}
    rec = _Recorder()
    with _CONFIG_LOCK:
        with tconfig.patch({"save.storage_alignment": alignment, "save.compute_crc32": True}):
            with torch.serialization.skip_data():
                try:
                    torch.serialization.save(obj, rec, pickle_module=_capture_module(found))
                except RuntimeError as e:
                    if "skip_data" in str(e):
                        raise UnsupportedLayoutError(str(e)) from e
                    raise
    return _plan_from_recording(rec, found, alignment)


def _plan_from_recording(rec: _Recorder, found: dict[str, torch.UntypedStorage], alignment: int) -> WritePlan:
    index = parse_zip_index(rec.read_at, rec.size, "<torch.save recording>")
    payloads: list[tuple[int, int, str, torch.UntypedStorage]] = []  # offset, nbytes, name, storage
    seen: set[str] = set()
    for e in index.entries:
        key = _record_key(e.name)
        if key is None:
            continue
        if key not in found:
            raise UnsupportedLayoutError(f"record {e.name} has no captured storage")
        storage = found[key]
        seen.add(key)
        if e.method != 0 or e.compressed_size != storage.nbytes():
            raise UnsupportedLayoutError(f"record {e.name}: {e.compressed_size} bytes, storage has {storage.nbytes()}")
        if e.compressed_size and e.data_offset % alignment:
            raise UnsupportedLayoutError(f"record {e.name} at {e.data_offset} is not {alignment}-aligned")
        if e.compressed_size:
            if e.descriptor_offset is None:
                raise UnsupportedLayoutError(f"record {e.name} has no data descriptor for its CRC")
            payloads.append((e.data_offset, e.compressed_size, e.name, storage))
    if seen != set(found):
        raise UnsupportedLayoutError(f"storages without records: {sorted(set(found) - seen)}")
    payloads.sort(key=lambda p: p[0])

    # The holes of the recording must be exactly the non-empty payloads.
    holes = []
    end = 0
    for f, _b, n in rec.segments:
        if f > end:
            holes.append((end, f - end))
        end = f + n
    if end < rec.size:
        holes.append((end, rec.size - end))
    if holes != [(p[0], p[1]) for p in payloads]:
        raise UnsupportedLayoutError("the skipped ranges of torch's writer do not match the storage records")

    keepalive: list[Any] = []
    blob_t = torch.frombuffer(rec.blob, dtype=torch.uint8)
    keepalive += [rec.blob, blob_t]
    base = blob_t.data_ptr()
    extents: list[tuple[int, int, int, int]] = [(f, base + b, n, -1) for f, b, n in rec.segments]
    patches: list[tuple[int, int, int]] = []
    names: list[str] = []
    by_name = index.by_name
    for slot, (off, n, name, storage) in enumerate(payloads):
        keepalive.append(storage)
        extents.append((off, _host_bytes(storage, keepalive), n, slot))
        entry = by_name[name]
        patches.append((entry.cd_crc_offset, slot, PATCH_U32LE))
        patches.append((entry.descriptor_crc_offset, slot, PATCH_U32LE))  # type: ignore[arg-type]
        names.append(name)
    extents.sort(key=lambda x: x[0])
    patches.sort(key=lambda x: x[0])
    return WritePlan(
        extents=extents,
        patches=patches,
        nslots=len(payloads),
        file_size=rec.size,
        keepalive=keepalive,
        slot_names=names,
    )


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

    index: ZipIndex
    buffer: Any  #: the native PinnedBuffer (keeps the memory alive)
    data: torch.Tensor  #: uint8 tensor over the file bytes (shares ``buffer``)


def read_whole_file(path: str, handle: Any, *, checksum: bool = True, lock: bool = False) -> ReadResult:
    """Read the zip file at ``path`` with one parallel (O_DIRECT where possible) native read.

    With ``checksum`` every record's CRC-32 is computed during the read and compared
    with the central directory.

    Raises:
        ZipFormatError: not a consistent zip archive.
        ChecksumError: a record's bytes do not match its recorded CRC-32.
        OSError: I/O errors from the native layer (with path and offset).
    """
    from fastpersist import _native

    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        index = parse_zip_index(fd_reader(fd), size, path)
    finally:
        os.close(fd)
    try:
        align = max(4096, _native.alignment_of(path))
    except OSError:
        align = 4096
    buf = _native.PinnedBuffer(_round_up(max(size, 1), align), align, lock)
    extents, names = _read_extents(index, buf.ptr, checksum)
    crcs = _native_read(handle, path, extents, len(names))
    problems = _crc_problems(index, names, crcs)
    if problems:
        raise ChecksumError(
            f"{path}: {len(problems)} record(s) do not match their checksum (the file is corrupt; "
            f"restore it from a good copy): " + "; ".join(problems),
            path=path,
            records=[p.split(":", 1)[0] for p in problems],
        )
    data = torch.frombuffer(buf, dtype=torch.uint8, count=size) if size else torch.empty(0, dtype=torch.uint8)
    return ReadResult(index=index, buffer=buf, data=data)


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
    result = read_whole_file(path, handle, checksum=checksum, lock=lock)
    if result.index.find("constants.pkl") is not None:
        raise UnsupportedLayoutError("TorchScript archive")
    view = memoryview(result.buffer).cast("B")[: result.index.file_size]
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


def _wants_pinned(map_location: Any) -> bool:
    """Page-lock the read buffer only when its bytes go on to an accelerator."""
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location).type != "cpu"
    return False


# --------------------------------------------------------------------------- verify


@dataclass
class TorchCheck:
    """What ``verify_torch`` looked at."""

    problems: list[str]
    records: int = 0
    nbytes: int = 0


def verify_torch(path: str, handle: Any) -> list[str]:
    """Problems found in the torch zip file at ``path`` (empty list: every record checks out).

    Every record's bytes (storages and metadata alike) are read and checksummed
    natively (read-and-discard extents with CRC slots) and compared with the
    central directory; data descriptors must repeat the central directory's CRC.
    """
    return check_torch(path, handle).problems


def check_torch(path: str, handle: Any) -> TorchCheck:
    """Like :func:`verify_torch`, also counting the records and bytes checked."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        read_at = fd_reader(fd)
        try:
            index = parse_zip_index(read_at, size, path)
        except ZipFormatError as e:
            head = read_at(0, 4)
            if head != b"PK\x03\x04" and size:
                return TorchCheck(
                    [f"{path}: not a zip archive (legacy torch.save format?); it has no checksums to verify"]
                )
            return TorchCheck([str(e)])
        problems: list[str] = []
        for e in index.entries:
            if e.method != 0:
                problems.append(f"{e.name}: compressed record (method {e.method}), not written by torch.save")
            stored = []
            for off in e.crc_field_offsets[1:]:
                raw = read_at(off, 4)
                stored.append(int.from_bytes(raw, "little") if len(raw) == 4 else -1)
            if e.descriptor_offset is not None and stored and stored[0] != e.crc32:
                problems.append(
                    f"{e.name}: data descriptor CRC {stored[0]:08x} differs from central directory {e.crc32:08x}"
                )
            if e.descriptor_offset is None and stored and stored[0] not in (0, e.crc32):
                problems.append(
                    f"{e.name}: local header CRC {stored[0]:08x} differs from central directory {e.crc32:08x}"
                )
            if e.compressed_size == 0 and e.crc32 != 0:
                problems.append(f"{e.name}: empty record with non-zero CRC {e.crc32:08x}")
    finally:
        os.close(fd)
    extents, names = _read_extents(index, 0, True)
    crcs = _native_read(handle, path, extents, len(names)) if extents else []
    problems += _crc_problems(index, names, crcs)
    return TorchCheck(problems, records=len(index.entries), nbytes=sum(e.compressed_size for e in index.entries))


def read_index_from_bytes(data: bytes, path: str = "<buffer>") -> ZipIndex:
    """Parse a zip index from bytes in memory (tests, tools)."""
    return parse_zip_index(buffer_reader(data), len(data), path)
