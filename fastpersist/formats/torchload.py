"""The fast reader of torch zip checkpoints (what ``fastpersist.load`` runs).

One load, one file descriptor
    The path is opened once; the central directory, the small records (the
    pickle, ``byteorder`` ...) and the native parallel read of the payloads all go
    through that descriptor. A save that renames a new file over the path while
    we read cannot mix two checkpoints: we keep reading the inode we opened.

Where the bytes go
    Each storage record of at least :data:`OWN_BUFFER_MIN` bytes is read into a
    page-aligned buffer of its own, so a loaded tensor keeps only its own storage
    alive (``torch.load`` allocates each storage separately too). Smaller records
    and the local headers share one compact buffer. Records that the pickle cannot
    name (their key is not among its string literals) are not read at all.

What is checked
    Every record's local header (signature, name, method, where its data starts)
    against the central directory; every storage the pickle asks for exists and has
    exactly the byte size it claims (as ``torch.load`` requires); no two records
    overlap; compressed, encrypted or TorchScript archives are handed to
    ``torch.load``; with checksums on, every record that was read has its CRC-32
    compared before the result is returned.

Overlap
    Unpickling runs while the payloads are read only when every global of the
    pickle is known not to read storage bytes (:mod:`fastpersist.formats.picklescan`)
    and the bytes stay on the CPU in native byte order. Otherwise the payloads are
    read and checked first.
"""

from __future__ import annotations

import gc
import logging
import os
import stat
import struct
import sys
import threading
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch

from fastpersist import _compat, _native
from fastpersist.errors import ChecksumError, UnsupportedLayoutError, ZipFormatError
from fastpersist.formats import crcpolicy, fastunpickle, torchdevice
from fastpersist.formats.picklescan import data_free, scan_pickle
from fastpersist.formats.zipindex import (
    CentralEntry,
    check_deflated,
    check_local_fields,
    fd_reader,
    parse_zip_index,
    pread_full,
    read_central_directory,
)
from fastpersist.readpolicy import borrow_reader, depth_auto, give_back_reader, plan_read, staging_auto
from fastpersist.prefault import Prefaulter, choose_pages

log = logging.getLogger(__name__)

#: Storage records at least this large get a buffer of their own (released with the tensor).
OWN_BUFFER_MIN = 1 << 20
_PAGE = 4096
#: The smaller records share arenas (:class:`_Arena`) of at most this many bytes. The native
#: allocator gives buffers of 4 MiB and more a fresh mapping of their own (native/src/handle.cpp,
#: ``kHugeMin``), whose every page faults in on the load's first touch (4 KiB pages where
#: :func:`fastpersist.prefault.choose_pages` picks them); smaller buffers come from malloc's
#: heap, memory earlier loads used and freed, as ``torch.load``'s storages do. Measured on the
#: 2-vCPU reference VM (virtio disk, busy), a cold load of a 4 MiB checkpoint of 8 tensors
#: (one 4.1 MiB arena) was 0.51-0.67x ``torch.load``; see docs/loading.md for the figures
#: with the arena cut below 4 MiB.
ARENA_MAX = (4 << 20) - _PAGE
_LOCAL_HEADER = 30
_FLAG_ENCRYPTED = 0x0001
_FLAG_DESCRIPTOR = 0x0008
_LOCAL_FIELDS = struct.Struct("<4s5H3L2H")  # a local file header (APPNOTE 4.3.7)


def fast_load_supported() -> bool:
    """Whether this torch's private ``_load`` takes our zip reader (probed once, see
    :mod:`fastpersist._compat`)."""
    return _compat.ok("private_load")


# --------------------------------------------------------------------------- records


@dataclass
class _Record:
    """One zip record: where its data lies, and where we put it in memory."""

    entry: CentralEntry
    short: str  #: name without the archive prefix (``data/3``, ``data.pkl``)
    data_offset: int
    size: int
    buffer: Any = None  #: PinnedBuffer holding the data (None: not read)
    buffer_offset: int = 0  #: where the data starts in ``buffer``
    slot: int = -1  #: CRC slot in the bulk read
    header_pos: int = -1  #: where the bulk read put the local header in the arena
    arena: Any = None  #: the :class:`_Arena` holding the local header (and the data of a small record)
    device: Any = None  #: uint8 device tensor holding the data (the GPU path, fastpersist.formats.torchdevice)
    used: bool = False  #: the unpickler asked for this record's storage

    @property
    def data_end(self) -> int:
        return self.data_offset + self.size


def bad(path: str, offset: Optional[int], what: str) -> ZipFormatError:
    return ZipFormatError(f"{path}: not a loadable torch checkpoint: {what}", path, offset)


def predict_offsets(entries: list[CentralEntry], cd_off: int) -> Optional[dict[int, int]]:
    """Data offset of every record (by ``id(entry)``) from the central directory alone:
    records lie back to back, so one ends where the next local header starts, less its
    data descriptor. None when the directory does not fit that (odd writers): then
    every local header is read. The prediction is checked against the headers."""
    ordered = sorted(entries, key=lambda e: e.header_offset)
    out: dict[int, int] = {}
    end = 0
    for i, e in enumerate(ordered):
        nxt = ordered[i + 1].header_offset if i + 1 < len(ordered) else cd_off
        desc = 0
        if e.flags & _FLAG_DESCRIPTOR:
            desc = 24 if e.header_offset >= 0xFFFFFFFF or e.compressed_size >= 0xFFFFFFFF else 16
        off = nxt - desc - e.compressed_size
        if off < e.header_offset + _LOCAL_HEADER or e.header_offset < end:
            return None
        out[id(e)] = off
        end = off + e.compressed_size
    return out


def _exact(fd: int, path: str, size: int) -> tuple[int, dict[int, int], list[CentralEntry]]:
    """Data offsets from every local header (slow path: a few small reads per record)."""
    index = parse_zip_index(fd_reader(fd, path), size, path)
    entries = [
        CentralEntry(e.name, e.cd_offset, e.header_offset, e.compressed_size, e.crc32, e.flags, e.method,
                     e.uncompressed_size)
        for e in index.entries
    ]
    return index.cd_offset, {id(c): e.data_offset for c, e in zip(entries, index.entries)}, entries


def record_prefix(path: str, entries: list[CentralEntry]) -> str:
    """The archive folder every record of a torch file lives in (``name/``)."""
    pkl = [e.name for e in entries if e.name == "data.pkl" or e.name.endswith("/data.pkl")]
    if not pkl:
        raise bad(path, None, "it has no data.pkl record")
    # torch's reader takes the folder of the first record; data.pkl must be in it
    first = entries[0].name
    prefix = first[: first.index("/") + 1] if "/" in first else ""
    if prefix + "data.pkl" not in pkl:
        raise bad(path, entries[0].cd_offset, f"data.pkl is not in the archive folder {prefix!r}")
    return prefix


def _check_layout(path: str, size: int, cd_off: int, records: list[_Record]) -> None:
    """Extents inside the file, before the central directory, and disjoint."""
    end = 0
    for r in sorted(records, key=lambda r: r.entry.header_offset):
        h = r.entry.header_offset
        if h < end:
            raise bad(path, h, f"record {r.entry.name!r} overlaps the previous record")
        if r.data_offset < h + _LOCAL_HEADER or r.data_end > cd_off or r.data_end > size:
            raise bad(path, r.data_offset, f"record {r.entry.name!r} [{r.data_offset}, {r.data_end}) lies outside "
                       f"the file's data area (central directory at {cd_off}, file size {size})")
        end = r.data_end


# --------------------------------------------------------------------------- memory


class _Arena:
    """Packs file ranges into one compact page-aligned buffer; each range lands at a
    buffer offset congruent to its file offset modulo the page size, so O_DIRECT
    alignment is the same as reading the whole file into one buffer."""

    def __init__(self) -> None:
        self.size = 0
        self.buffer: Any = None

    def place(self, file_offset: int, length: int) -> int:
        pos = self.end(file_offset, length) - length
        self.size = pos + length
        return pos

    def end(self, file_offset: int, length: int) -> int:
        """The arena's size once :meth:`place` put that range in it."""
        return self.size + (file_offset - self.size) % _PAGE + length

    def allocate(self, lock: bool) -> None:
        self.buffer = _native.PinnedBuffer(_round_up(max(self.size, 1), _PAGE), _PAGE, lock)
        if not lock:
            choose_pages(self.buffer)


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _own_buffer(file_offset: int, length: int, lock: bool) -> tuple[Any, int]:
    lead = file_offset % _PAGE
    buf = _native.PinnedBuffer(_round_up(lead + length, _PAGE), _PAGE, lock)
    return (buf if lock else choose_pages(buf)), lead


def _pread_into(fd: int, path: str, view: memoryview, offset: int) -> None:
    """Fill ``view`` from ``offset`` of ``fd`` (retrying short reads; EOF is an error)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise bad(path, offset + done, f"the file ends inside a record ({len(view) - done} bytes missing; "
                       "truncated, or rewritten in place while loading)")
        done += n


# --------------------------------------------------------------------------- the reader torch sees


class Reader:
    """What ``torch.serialization._load`` asks of its zip reader, served from our buffers.

    ``get_storage_from_record`` checks that the record exists and holds exactly the
    bytes the pickle claims, and reads a record on demand if the bulk read skipped it.
    """

    def __init__(self, load: "LoadState") -> None:
        self._load = load

    def has_record(self, name: str) -> bool:
        return name in self._load.by_short

    def get_record(self, name: str) -> bytes:
        return bytes(self._load.record_bytes(self._load.record(name)))

    def get_record_offset(self, name: str) -> int:
        return self._load.record(name).data_offset

    def get_record_header_offset(self, name: str) -> int:
        return self._load.record(name).entry.header_offset

    def get_record_offset_no_read(self, _current: int, name: str, _numel: int, _alignment: int) -> int:
        return self._load.record(name).data_offset

    def serialization_id(self) -> str:
        r = self._load.by_short.get(".data/serialization_id")
        return bytes(self._load.record_bytes(r)).decode("ascii", "replace") if r is not None else ""

    def get_all_records(self) -> list[str]:
        return list(self._load.by_short)

    def get_storage_from_record(self, name: str, nbytes: int, _storage_type: Any) -> torch.Tensor:
        return self._load.storage_tensor(name, nbytes)


class LoadState:
    """State of one load of one file through one descriptor."""

    def __init__(self, path: str, fd: int, size: int, checksum: bool, lock: bool, memory: Any = None) -> None:
        self.path = path
        self.fd = fd
        self.size = size
        self.checksum = checksum
        self.lock = lock
        #: the whole file's bytes, already in memory (``load_torch(memory=...)``): a writable
        #: buffer of ``size`` bytes that the storages are built over; None: read from ``fd``
        self.memory = memory
        #: ``(data offset, length) -> CRC-32`` of ranges of :attr:`memory` computed already
        self.checked_crcs: Mapping[tuple[int, int], int] = {}
        self.records: list[_Record] = []
        self.by_short: dict[str, _Record] = {}
        self.arenas: list[_Arena] = []  #: the bulk read's arenas, each under :data:`ARENA_MAX`
        self.headers_checked = False  # every local header was read and checked (the exact index)
        self.header_ok: set[str] = set()  #: records whose local header was checked
        self.entries: list[CentralEntry] = []  #: the central directory, in its order
        self._ours: Optional[bool] = None

    # -- index ---------------------------------------------------------------

    def index(self, exact: bool = False) -> None:
        """Records from the central directory; data offsets predicted, or (``exact``,
        or when the prediction does not fit) read from every local header."""
        try:
            cd_off, entries = read_central_directory(fd_reader(self.fd, self.path), self.size, self.path)
        except ZipFormatError:
            raise
        except (ValueError, UnicodeDecodeError, struct.error) as e:  # defensive: the parser should raise ZipFormatError
            raise bad(self.path, None, f"unreadable zip index ({e})") from e
        if not entries:
            raise bad(self.path, cd_off, "the archive has no records")
        unsupported = None
        for e in entries:
            if e.flags & _FLAG_ENCRYPTED:
                unsupported = f"encrypted record {e.name!r}"
            elif e.method != 0:
                unsupported = f"compressed record {e.name!r} (method {e.method})"
        prefix = record_prefix(self.path, entries)
        if unsupported is None and any(e.name == prefix + "constants.pkl" for e in entries):
            unsupported = "TorchScript archive"
        if unsupported is not None:
            # Handed to torch.load, which believes the central directory alone: first every
            # local header must agree with it (as verify requires), or a directory saying
            # "deflated" over stored bytes comes back as heap memory torch never filled.
            full = parse_zip_index(fd_reader(self.fd, self.path), self.size, self.path)
            # and a record marked deflated must inflate to its size and CRC-32: torch.load
            # returns heap memory for one that does not
            check_deflated(fd_reader(self.fd, self.path), self.path, full.entries)
            raise UnsupportedLayoutError(unsupported)
        offsets = None if exact else predict_offsets(entries, cd_off)
        if offsets is None:
            cd_off, offsets, entries = _exact(self.fd, self.path, self.size)
            self.headers_checked = True
        self.entries = entries
        for e in entries:
            if not e.name.startswith(prefix):
                continue  # torch's reader ignores records outside its folder
            short = e.name[len(prefix):]
            if short in self.by_short:
                raise bad(self.path, e.cd_offset, f"two records are named {e.name!r}")
            r = _Record(e, short, offsets[id(e)], e.compressed_size)
            self.records.append(r)
            self.by_short[short] = r
        _check_layout(self.path, self.size, cd_off, self.records)

    def record(self, short: str) -> _Record:
        r = self.by_short.get(short)
        if r is None:
            raise bad(self.path, None, f"record {short!r} is missing (the pickle refers to it)")
        return r

    # -- small records, read at once through the descriptor --------------------

    def read_small(self, r: _Record) -> bytes:
        """A small record's bytes with its local header checked and its CRC verified."""
        h = r.entry.header_offset
        raw = bytearray(r.data_end - h)
        _pread_into(self.fd, self.path, memoryview(raw), h)
        self.check_header(r, memoryview(raw)[: r.data_offset - h])
        body = bytes(raw[r.data_offset - h :])
        if self.checksum and not crcpolicy.no_crc(r.entry.crc32) and zlib.crc32(body) != r.entry.crc32:
            self.crc_mismatch([f"{r.entry.name}: CRC-32 mismatch (computed {zlib.crc32(body):08x}, recorded "
                               f"{r.entry.crc32:08x}) in bytes [{r.data_offset}, {r.data_end})"],
                              storages_only=r.short.startswith("data/"))
        r.buffer = body
        return body

    def record_bytes(self, r: _Record) -> memoryview:
        if r.buffer is None:
            self.read_small(r)
        if isinstance(r.buffer, bytes):
            return memoryview(r.buffer)
        return memoryview(r.buffer).cast("B")[r.buffer_offset : r.buffer_offset + r.size]

    def check_header(self, r: _Record, header: memoryview) -> None:
        """The local header must name the same record and put its data where we read it."""
        e = r.entry
        if len(header) < _LOCAL_HEADER or bytes(header[:4]) != b"PK\x03\x04":
            raise bad(self.path, e.header_offset, f"bad local header for {e.name!r}")
        _sig, _v, flags, method, _t, _d, crc, csize, usize, nlen, xlen = _LOCAL_FIELDS.unpack(header[:_LOCAL_HEADER])
        # The central directory (checked in index()) says stored and not encrypted: a
        # local header saying otherwise (or other sizes, CRC-32, flags) is a file at odds
        # with itself, refused as verify refuses it; not a layout to hand to torch.load
        # (which reads the directory's word, skips the CRC-32 check and, with other
        # damage, returns memory it never filled as values).
        check_local_fields(self.path, e.header_offset, e.name, (flags, method, crc, csize, usize),
                           (e.flags, e.method, e.crc32, e.compressed_size, e.uncompressed_size))
        if _LOCAL_HEADER + nlen + xlen != len(header):
            raise HeaderMismatch(e.name)
        if bytes(header[_LOCAL_HEADER : _LOCAL_HEADER + nlen]) != e.name.encode("utf-8") and \
                bytes(header[_LOCAL_HEADER : _LOCAL_HEADER + nlen]) != _cp437(e.name):
            raise bad(self.path, e.header_offset, f"local header names {bytes(header[30:30 + nlen])!r}, "
                       f"the central directory {e.name!r}")
        self.header_ok.add(r.short)

    def check_unread_headers(self, storages: bool = True) -> None:
        """The local headers of the records the load did not read (``.format_version``,
        ``version``, storages nothing refers to): a file whose own index disagrees with
        itself is refused whatever the load needed (``verify`` reports it corrupt).
        A few small reads; none after an exact index (every header was checked).
        ``storages=False``: the other records only (a lazy reader checks each storage's
        header when it reads it)."""
        if self.headers_checked:
            return
        for r in self.records:
            if r.short in self.header_ok or (not storages and r.short.startswith("data/")):
                continue
            h = r.entry.header_offset
            raw = bytearray(r.data_offset - h)
            _pread_into(self.fd, self.path, memoryview(raw), h)
            self.check_header(r, memoryview(raw))

    # -- the bulk read ---------------------------------------------------------

    def plan_bulk(self, wanted: Optional[set[str]]) -> tuple[list[tuple[int, int, int, int]], list[_Record]]:
        """Extents of the bulk read: every non-empty storage record not read yet (those
        whose key is in ``wanted`` when given) with its local header, one CRC slot per
        record, in file order."""
        bulk = [r for r in self.records if r.buffer is None and r.size > 0 and r.short.startswith("data/")]
        if wanted is not None:
            bulk = [r for r in bulk if r.short[5:] in wanted]
        bulk.sort(key=lambda r: r.entry.header_offset)
        self.arenas = [_Arena()]
        for i, r in enumerate(bulk):
            r.slot = i
            h = r.entry.header_offset
            own = r.size >= OWN_BUFFER_MIN
            if own:
                r.buffer, r.buffer_offset = _own_buffer(r.data_offset, r.size, self.lock)
            length = (r.data_offset if own else r.data_end) - h
            arena = self.arenas[-1]
            if arena.size and arena.end(h, length) > ARENA_MAX:
                arena = _Arena()
                self.arenas.append(arena)
            r.arena = arena
            r.header_pos = arena.place(h, length)
            if not own:
                r.buffer_offset = r.header_pos + (r.data_offset - h)
        for arena in self.arenas:
            arena.allocate(False)
        extents: list[tuple[int, int, int, int]] = []
        for r in bulk:
            pos = r.header_pos
            h = r.entry.header_offset
            if r.data_offset > h:
                extents.append((h, r.arena.buffer.ptr + pos, r.data_offset - h, -1))
            if r.size < OWN_BUFFER_MIN:
                r.buffer = r.arena.buffer
            extents.append((r.data_offset, r.buffer.ptr + r.buffer_offset, r.size, r.slot))
        return extents, bulk

    def plan_memory(self, wanted: Optional[set[str]]) -> list[_Record]:
        """:meth:`plan_bulk` of a load whose bytes are all in :attr:`memory`: nothing to
        read; every non-empty storage record (those whose key is in ``wanted`` when given)
        is served from its bytes there, in file order."""
        bulk = [r for r in self.records if r.buffer is None and r.size > 0 and r.short.startswith("data/")]
        if wanted is not None:
            bulk = [r for r in bulk if r.short[5:] in wanted]
        bulk.sort(key=lambda r: r.entry.header_offset)
        for i, r in enumerate(bulk):
            r.slot = i
            r.buffer, r.buffer_offset = self.memory, r.data_offset
        return bulk

    def check_bulk(self, bulk: list[_Record], crcs: list[int], only: Optional[Callable[[_Record], bool]] = None) -> None:
        """Local headers of the bulk-read records, then their CRCs (with ``only``: of the
        records it accepts; the others were read but nothing uses them, as torch.load
        never looks at them)."""
        if self.memory is not None:
            whole = memoryview(self.memory).cast("B")
            for r in bulk:
                self.check_header(r, whole[r.entry.header_offset : r.data_offset])
        else:
            for r in bulk:  # every header read (they are in memory): the index must agree with itself
                arena = memoryview(r.arena.buffer).cast("B")
                self.check_header(r, arena[r.header_pos : r.header_pos + r.data_offset - r.entry.header_offset])
        if only is not None:
            kept = [(r, c) for r, c in zip(bulk, crcs) if only(r)]
            bulk, crcs = [r for r, _c in kept], [c for _r, c in kept]
        if not self.checksum:
            return
        problems = [
            f"{r.entry.name}: CRC-32 mismatch (computed {crc:08x}, recorded {r.entry.crc32:08x}) "
            f"in bytes [{r.data_offset}, {r.data_end})"
            for r, crc in zip(bulk, crcs)
            if crc != r.entry.crc32 and not crcpolicy.no_crc(r.entry.crc32)
        ]
        if problems:
            self.crc_mismatch(problems, storages_only=all(r.short.startswith("data/") for r in bulk))

    # -- the checksum policy (fastpersist.formats.crcpolicy) -------------------

    def written_by_fastpersist(self) -> bool:
        """Whether fastpersist's writer wrote this file (its CRCs then bind the load)."""
        if self._ours is None:
            r = self.by_short.get(crcpolicy.SERIALIZATION_ID)
            raw = None
            if r is not None and 0 < r.size <= 64:
                raw = bytearray(r.size)
                _pread_into(self.fd, self.path, memoryview(raw), r.data_offset)
            self._ours = crcpolicy.written_by_fastpersist(self.entries, None if raw is None else bytes(raw))
        return self._ours

    def crc_mismatch(self, problems: list[str], *, storages_only: bool = True) -> None:
        """Records whose bytes differ from a nonzero recorded CRC-32: ChecksumError in a file
        fastpersist wrote or outside the storage records, else a logged warning (and the
        load goes on, as torch's): :mod:`fastpersist.formats.crcpolicy`."""
        crcpolicy.mismatch(self.path, problems, self.written_by_fastpersist, storages_only)

    # -- storages ------------------------------------------------------------

    def storage_tensor(self, short: str, nbytes: int) -> torch.Tensor:
        r = self.record(short)
        r.used = True
        if nbytes != r.size:
            raise bad(self.path, r.data_offset, f"record {r.entry.name!r} holds {r.size} bytes but the pickle "
                       f"claims a storage of {nbytes} bytes")
        if r.size == 0:
            return _empty_storage()
        if r.device is not None:  # read to its CUDA device through the ring (fastpersist.cudaload)
            return r.device
        if r.buffer is None:  # not in the bulk read: read it now, checked
            r.buffer, r.buffer_offset = _own_buffer(r.data_offset, r.size, self.lock)
            view = memoryview(r.buffer).cast("B")[r.buffer_offset : r.buffer_offset + r.size]
            hdr = bytearray(r.data_offset - r.entry.header_offset)
            _pread_into(self.fd, self.path, memoryview(hdr), r.entry.header_offset)
            self.check_header(r, memoryview(hdr))
            _pread_into(self.fd, self.path, view, r.data_offset)
            if self.checksum and not crcpolicy.no_crc(r.entry.crc32) and zlib.crc32(view) != r.entry.crc32:
                self.crc_mismatch([f"{r.entry.name}: CRC-32 mismatch (recorded {r.entry.crc32:08x}) "
                                   f"in bytes [{r.data_offset}, {r.data_end})"], storages_only=True)
        if isinstance(r.buffer, bytes):
            return torch.frombuffer(bytearray(r.buffer), dtype=torch.uint8)
        return torch.frombuffer(r.buffer, dtype=torch.uint8, count=r.size, offset=r.buffer_offset)


def _empty_storage() -> torch.Tensor:
    """A 0-byte uint8 tensor over a storage that cannot grow, as torch's reader returns for an
    empty record. ``torch.empty(0)`` has a resizable storage: a pickle claiming a shape,
    stride or offset past the record's 0 bytes would make torch's ``set_`` grow it and
    hand back uninitialized memory as values, where ``torch.load`` raises "Trying to
    resize storage that is not resizable". Every empty record's storage points at the same
    (empty) buffer, as torch's all point at address 0, so "which tensors share storage"
    comes out as for ``torch.load``."""
    global _EMPTY
    if _EMPTY is None:
        import numpy

        _EMPTY = numpy.empty(0, dtype=numpy.uint8)
    return torch.from_numpy(_EMPTY)


_EMPTY: Any = None


class HeaderMismatch(Exception):
    """A local header's length differs from the prediction: reload with the exact index."""


def _cp437(name: str) -> bytes:
    try:
        return name.encode("cp437")
    except UnicodeEncodeError:
        return b""


# --------------------------------------------------------------------------- entry point


def _cpu(map_location: Any) -> bool:
    return map_location is None or (
        isinstance(map_location, (str, torch.device)) and torch.device(map_location).type == "cpu"
    )


def _wants_pinned(map_location: Any) -> bool:
    """Page-lock the read buffers only when their bytes go on to an accelerator (storages
    that go to a CUDA device take the ring of :mod:`fastpersist.cudaload` instead; the
    rest, e.g. a callable ``map_location``, still come here)."""
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location).type != "cpu"
    return False


def load_torch(
    path: str,
    handle: Any,
    map_location: Any,
    pickle_module: Any,
    *,
    weights_only: bool,
    checksum: bool = True,
    memory: Any = None,
    fd: Optional[int] = None,
    checked_crcs: Optional[Mapping[tuple[int, int], int]] = None,
    **pickle_load_args: Any,
) -> Any:
    """Load the torch zip checkpoint at ``path`` (see the module docstring).

    ``handle`` supplies the I/O settings (engine, chunk size, queue depth, threads,
    O_DIRECT, staged reads); the read runs on a handle of its own.

    With ``memory`` the file's bytes are all in memory already (the collective load's
    assembled file): no read and no copy of the payloads. ``memory`` is a writable
    buffer holding the whole file (a private mapping of ``fd``, say) and ``fd`` a
    descriptor reading the same bytes (the index, the pickle and the local headers are
    read through it); ``path`` then only names the file in errors. Every storage is a
    view of its record's bytes in ``memory``: each tensor has a storage of its own (no
    two overlap, none can grow), and together they keep ``memory`` alive, as a
    ``torch.load(mmap=True)`` result keeps its mapping. Every record the load uses has
    its local header checked and its CRC-32 computed in place (on ``handle``'s threads)
    and compared before the result is returned. ``checked_crcs`` (with ``memory``) maps
    ``(data offset, length)`` to the CRC-32 of those bytes of ``memory``, computed
    already (as the collective load's pieces arrived,
    :class:`fastpersist.formats.piececrc.PieceCrcs`): a record whose bytes are exactly such
    a range is compared with that value instead of being read again; every other record
    is computed here.

    Raises:
        UnsupportedLayoutError: not something this reader loads (not a zip file,
            compressed or encrypted records, TorchScript, meta/fake loads, a torch
            whose private ``_load`` differs, a ``memory`` whose size is not the file's);
            the caller hands the path to ``torch.load``.
        ZipFormatError: the file is inconsistent (names the path and what is wrong).
        ChecksumError: a record's bytes do not match their CRC-32.
        OSError: I/O errors (path, offset, errno).
        ValueError: ``memory`` without ``fd``, or ``fd`` without ``memory``.
    """
    if (memory is None) != (fd is None):
        raise ValueError("load_torch: memory= and fd= go together (the file's bytes and a descriptor reading them)")
    private_load = _compat.private_load()  # UnsupportedLayoutError when torch's _load changed
    if meta_or_fake(map_location):
        raise UnsupportedLayoutError("meta or fake-tensor load")

    def load_from(fd: int, size: int) -> Any:
        try:
            return _load_fd(path, fd, size, handle, map_location, pickle_module, private_load, memory=memory,
                            checked_crcs=checked_crcs, weights_only=weights_only, checksum=checksum,
                            **pickle_load_args)
        except HeaderMismatch:
            log.debug("%s: predicted record offsets were wrong; loading with every local header read", path)
            return _load_fd(path, fd, size, handle, map_location, pickle_module, private_load, exact=True,
                            memory=memory, checked_crcs=checked_crcs, weights_only=weights_only, checksum=checksum,
                            **pickle_load_args)

    if fd is not None:
        size = os.fstat(fd).st_size
        view = memoryview(memory)
        if view.nbytes != size:
            raise UnsupportedLayoutError(f"the buffer holds {view.nbytes} bytes, the file {size}")
        if bytes(view[:4]) != b"PK\x03\x04":
            raise UnsupportedLayoutError("not a zip file (legacy torch format?)")
        del view
        return load_from(fd, size)
    own = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(own)
        if not stat.S_ISREG(st.st_mode):
            raise UnsupportedLayoutError("not a regular file")
        if pread_full(own, 4, 0, path) != b"PK\x03\x04":  # a short read must not pass for "not a zip"
            raise UnsupportedLayoutError("not a zip file (legacy torch format?)")
        return load_from(own, st.st_size)
    finally:
        os.close(own)


def meta_or_fake(map_location: Any) -> bool:
    try:
        if torch._guards.detect_fake_mode(None) is not None:
            return True
    except Exception:  # noqa: BLE001 - private API; assume no fake mode
        pass
    if isinstance(map_location, (str, torch.device)):
        try:
            return torch.device(map_location).type == "meta"
        except RuntimeError:
            return False
    return False


def _overlap_allowed(scan: Any, native_order: bool, map_location: Any) -> bool:
    """Unpickle during the read only when nothing can look at storage bytes meanwhile:
    every global of the pickle data-free, no byte swap, no copy to another device."""
    return data_free(scan) and native_order and _cpu(map_location)


def _fast_unpickle_allowed(marked_native: bool, map_location: Any, pickle_module: Any, weights_only: bool,
                           pickle_load_args: dict[str, Any]) -> bool:
    """Whether :mod:`fastpersist.formats.fastunpickle` may try first: a weights-only load onto the
    CPU of a file that says it is in this machine's byte order, with torch's defaults in effect."""
    if not (weights_only and marked_native and _cpu(map_location) and set(pickle_load_args) <= {"encoding"}):
        return False
    if pickle_module is not _compat.weights_only_unpickler():
        return False
    if getattr(torch.serialization._serialization_tls, "skip_data", False):
        return False
    default_device = getattr(torch, "get_default_device", None)
    return default_device is None or default_device().type == "cpu"


def _load_fd(
    path: str, fd: int, size: int, handle: Any, map_location: Any, pickle_module: Any, private_load: Any, *,
    weights_only: bool, checksum: bool, exact: bool = False, memory: Any = None,
    checked_crcs: Optional[Mapping[tuple[int, int], int]] = None, **pickle_load_args: Any,
) -> Any:

    load = LoadState(path, fd, size, checksum, _wants_pinned(map_location), memory)
    if memory is not None and checked_crcs:
        load.checked_crcs = checked_crcs
    load.index(exact)
    result = _load_records(load, path, fd, handle, map_location, pickle_module, private_load,
                           weights_only=weights_only, **pickle_load_args)
    load.check_unread_headers()
    return result


def _load_records(
    load: LoadState, path: str, fd: int, handle: Any, map_location: Any, pickle_module: Any, private_load: Any, *,
    weights_only: bool, **pickle_load_args: Any,
) -> Any:
    """The rest of :func:`_load_fd` once the index is read: the pickle, the bulk read, the unpickling."""
    pkl = load.read_small(load.record("data.pkl"))
    order = load.by_short.get("byteorder")
    native_order = order is None or load.read_small(order) == sys.byteorder.encode()
    fast_unpickle = _fast_unpickle_allowed(order is not None and native_order, map_location, pickle_module,
                                           weights_only, pickle_load_args)
    # map_location None restores each storage to the device it was saved from: a pickle
    # naming "cuda" anywhere may hold CUDA storages, which the GPU path reads through
    # its ring (below), not into host memory first.
    if fast_unpickle and not (map_location is None and b"cuda" in pkl):
        return _load_fast(load, pkl, handle, map_location, pickle_module, private_load, weights_only=weights_only,
                          **pickle_load_args)
    scan = scan_pickle(pkl, bound_memo=weights_only)  # weights_only=False: torch's C unpickler runs it anyway
    wanted = scan.keys
    overlap = _overlap_allowed(scan, native_order, map_location)
    # The GPU path: storages that torch would put on a CUDA device are read through a
    # page-locked ring straight into device memory (formats.torchdevice over cudaload), not into
    # host buffers; only in native byte order (no byte swap of device storages).
    to_device: dict[str, Any] = {}
    if wanted is not None and native_order and load.memory is None:
        to_device = torchdevice.destinations(map_location, scan.pids)
        if to_device:
            wanted = wanted - set(to_device)

    reader, finish = _start_bulk(load, handle, wanted)
    if to_device:
        try:
            torchdevice.read_to_device(load, reader, fd, to_device)
        except BaseException:
            _drain(reader)
            raise

    def unpickle() -> Any:
        # The unpickler allocates several tracked objects per tensor; with the cyclic GC
        # on, its collections walk them again and again (6% of a 2 GiB load's samples,
        # more for many small tensors). Paused for the unpickling, restored after; the
        # next collection finds whatever cycles were made.
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            if fast_unpickle:
                try:
                    return fastunpickle.unpickle(pkl, load.storage_tensor, encoding=pickle_load_args.get("encoding",
                                                                                                     "utf-8"))
                except fastunpickle.NotFast as e:
                    log.debug("%s: torch's unpickler runs instead of the fast one (%s)", path, e)
            return private_load(Reader(load), map_location, pickle_module, weights_only=weights_only,
                                **pickle_load_args)
        finally:
            if was_enabled:
                gc.enable()

    if not overlap:
        finish()
        return unpickle()
    try:
        result = unpickle()
    except BaseException:
        _drain(reader)  # the read must be over before its buffers can go
        raise
    finish()
    return result


#: Bulk reads of at least this many bytes get a pre-fault thread (fastpersist.prefault).
PREFAULT_MIN = 16 << 20


def _start_bulk(load: LoadState, handle: Any, wanted: Optional[set[str]]) -> tuple[Any, Callable[..., None]]:
    """Plan (:func:`fastpersist.readpolicy.plan_read`) and submit the bulk read of the
    storage records (``wanted``: their keys, None: all); returns ``(reader, finish)``: the
    native handle reading, and ``finish(only=None)``, which waits for it, hands the reader
    back to the pool and checks local headers and CRC-32s (of the records ``only`` accepts)."""
    if load.memory is not None:
        return _memory_bulk(load, handle, wanted)
    extents, bulk = load.plan_bulk(wanted)
    nbytes = sum(r.size for r in bulk)
    plan = plan_read(load.fd, nbytes, read_mode=getattr(handle, "read_mode", "direct"), direct=handle.direct,
                     stage=handle.stage_reads, stage_auto=staging_auto(handle), depth_auto=depth_auto(handle))
    reader = borrow_reader(handle, plan)
    # The buffers are new memory: a second thread faults them in ahead of the reads
    # (fastpersist.prefault). Locked buffers (pinned for CUDA) were populated by mlock.
    prefault = None
    if not load.lock and nbytes >= PREFAULT_MIN:
        prefault = Prefaulter(list({id(r.buffer): r.buffer for r in bulk}.values()))
    # A read of one transfer is done here, in this thread: handing it to the handle's
    # worker costs more than it overlaps with the unpickling (on a busy machine, a
    # scheduling delay each way). Its outcome is kept for finish(), so errors surface
    # where the asynchronous read's do.
    sync = bool(extents) and prefault is None and nbytes <= int(getattr(reader, "chunk_size", 0))
    early: list[Any] = []
    try:
        if extents:
            if sync:
                try:
                    early.append(reader.read(load.fd, extents, len(bulk)))
                except (OSError, EOFError) as e:
                    early.append(e)
            else:
                reader.submit_read(load.fd, extents, len(bulk))
    except BaseException:
        if prefault is not None:
            prefault.close()
        raise

    def finish(only: Optional[Callable[[_Record], bool]] = None) -> None:
        try:
            try:
                if sync:
                    if isinstance(early[0], BaseException):
                        raise early[0]
                    done = [(0, early[0])]
                else:
                    done = reader.wait()
            finally:
                if prefault is not None:
                    prefault.close()
        except EOFError as e:
            raise bad(load.path, None, f"the file is shorter than its index says (truncated, or rewritten in "
                       f"place while loading): {e}") from e
        except OSError as e:
            if e.filename is None and e.errno is not None:
                raise type(e)(e.errno, e.strerror or str(e), load.path) from e
            raise
        give_back_reader(reader)
        crcs = done[0][1] if done else []
        load.check_bulk(bulk, crcs, only)

    return reader, finish


class _NoRead:
    """The reader of a load whose bytes are all in memory: nothing in flight."""

    def wait(self) -> list[Any]:
        return []


def _memory_bulk(load: LoadState, handle: Any, wanted: Optional[set[str]]) -> tuple[Any, Callable[..., None]]:
    """:func:`_start_bulk` of a load whose bytes are all in ``load.memory``: the storages
    are served from there; ``finish(only=None)`` checks the local headers, computes the
    CRC-32 of every record ``only`` accepts in place (in parallel, on ``handle``'s
    threads) and compares them."""
    bulk = load.plan_memory(wanted)

    def finish(only: Optional[Callable[[_Record], bool]] = None) -> None:
        chosen = [r for r in bulk if only is None or only(r)]
        got: dict[int, int] = {}
        if load.checksum:
            done = load.checked_crcs
            for r in chosen:
                c = done.get((r.data_offset, r.size))
                if c is not None:
                    got[id(r)] = c
            chosen = [r for r in chosen if id(r) not in got]
        if load.checksum and chosen:
            keep = torch.frombuffer(load.memory, dtype=torch.uint8)  # the address; holds the buffer meanwhile
            base = keep.data_ptr()
            crcs = handle.crc32_ranges([(base + r.data_offset, r.size) for r in chosen])
            got.update({id(r): c for r, c in zip(chosen, crcs)})
            del keep
        load.check_bulk(bulk, [got.get(id(r), r.entry.crc32) for r in bulk], only)

    return _NoRead(), finish


def _load_fast(load: LoadState, pkl: bytes, handle: Any, map_location: Any, pickle_module: Any, private_load: Any, *,
               weights_only: bool, **pickle_load_args: Any) -> Any:
    """A weights-only CPU load the fast unpickler may take (:func:`_fast_unpickle_allowed`).

    The bulk read of every storage record starts right after the index, before the
    pickle is even looked at: the fast unpickler only makes tensor views over the read
    buffers (it never reads their bytes), so it runs while the read goes on, and no
    dry run of the pickle (:func:`scan_pickle`, a quarter of a second for 20,000
    tensors) decides that first. Only the records the unpickler used are checked (a
    record nothing refers to is never looked at by torch.load either). If the pickle
    is not one the fast unpickler takes, the read is finished, the dry run tells which
    records the pickle refers to, those are checked, and torch's unpickler runs.
    """
    reader, finish = _start_bulk(load, handle, None)
    encoding = pickle_load_args.get("encoding", "utf-8")
    was_enabled = gc.isenabled()
    gc.disable()  # see _load_fd's unpickle(): the same pause, for the same reason
    try:
        try:
            result = fastunpickle.unpickle(pkl, load.storage_tensor, encoding=encoding)
        except fastunpickle.NotFast as e:
            log.debug("%s: torch's unpickler runs instead of the fast one (%s)", load.path, e)
            result = _NOT_FAST
        except BaseException:
            _drain(reader)  # the read must be over before its buffers can go
            raise
        if result is not _NOT_FAST:
            finish(lambda r: r.used)
            return result
        wanted = scan_pickle(pkl).keys
        finish(None if wanted is None else (lambda r: r.short[5:] in wanted))
        for r in load.records:
            r.used = False
        return private_load(Reader(load), map_location, pickle_module, weights_only=weights_only,
                            **pickle_load_args)
    finally:
        if was_enabled:
            gc.enable()


_NOT_FAST = object()


def _drain(handle: Any) -> None:
    """Wait for a handle's reads, dropping their errors (another one is propagating)."""
    try:
        handle.wait()
    except (OSError, EOFError):
        pass
