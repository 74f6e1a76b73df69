"""torch's zip container, laid out in Python: what ``PyTorchFileWriter`` writes, less its cost.

``torch.save`` writes its archive through ``torch._C.PyTorchFileWriter`` (miniz with
torch's alignment padding). Called once per storage record, that writer makes four
Python ``write`` calls into the planner's recorder and the planner then has to find
the payload and its CRC fields again: with 20,000 small tensors this was about a
third of the save's CPU time. :class:`MinizLayout` produces the same bytes directly:

* local header (no time/date, flags ``0x0808``, sizes and CRC left to the data
  descriptor), the record name, a zip64 extra field when the size or the header
  offset reaches 2^32-1, and torch's ``FB`` padding field that aligns the payload;
* the data descriptor after each non-empty payload (64-bit sizes under zip64);
* at the end torch's ``version`` and ``byteorder`` records (the latter only when not
  written yet), ``.data/serialization_id``, the central directory, the zip64 end
  record and locator (torch's writer always writes them) and the end record.

The one record whose *content* differs from torch's writer is
``.data/serialization_id``: torch derives it from C++ ``std::hash`` values; here it
is 40 digits from BLAKE2 of the record names and the CRC-32 of ``data.pkl`` (torch
only logs the id). :func:`layout_matches_torch` compares both writers on a probe
sequence (empty, small, >4 GiB records, records past 4 GiB) byte for byte, that
record aside, and the planner only uses this module when they agree (the
``zip_layout`` feature of :mod:`fastpersist._compat`; torch's writer itself is
reached through :func:`fastpersist._compat.file_writer`).
"""

from __future__ import annotations

import bisect
import functools
import io
import logging
import struct
import sys
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, Optional

import torch

from fastpersist import _compat
from fastpersist.errors import UnsupportedLayoutError
from fastpersist.formats.crcpolicy import serialization_id
from fastpersist.formats.zipindex import parse_zip_index

_MAX32 = 0xFFFFFFFF
_LOCAL = struct.Struct("<4s5H3L2H")  # 30 bytes
_CENTRAL = struct.Struct("<4s6H3L5HLL")  # 46 bytes
_DESC32 = struct.Struct("<4sLLL")
_DESC64 = struct.Struct("<4sLQQ")
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_EOCD = struct.Struct("<4s4H2LH")
_LOCAL_SIG = b"PK\x03\x04"
_CENTRAL_SIG = b"PK\x01\x02"
_DESC_SIG = b"PK\x07\x08"
_FLAGS = 0x0808  # UTF-8 names, data descriptor
_FLAGS_EMPTY = 0x0800
_PAD = b"Z" * 65536
#: offset of the CRC-32 inside a data descriptor / a central directory entry
DESC_CRC_FIELD = 4
CD_CRC_FIELD = 16
_BLOCK = 1 << 20
_FIRST_BLOCK = 64 << 10
_PAD_BYTES = bytearray(b"Z" * 65536)
_PAD_BLOCK = (_PAD_BYTES, torch.frombuffer(_PAD_BYTES, dtype=torch.uint8))


class BlockRecorder:
    """File-like sink for torch's zip writer whose bytes never move.

    Written bytes land in fixed blocks (each wrapped once as a tensor, so their
    addresses can be handed to the native writer while more is recorded);
    forward seeks leave holes (the payloads). Only forward writes are accepted.
    """

    def __init__(self) -> None:
        self.pos = 0
        self.blocks: list[Any] = []  # (bytearray, tensor) pairs: keep alive
        self._cur: Optional[bytearray] = None
        self._cur_index = -1  # index of ``_cur`` in ``blocks``
        self._cur_ptr = 0
        self._used = 0
        self._cap = 0
        #: written runs in file order: [file_offset, ptr, length, block_index, block_offset]
        self.runs: list[list[int]] = []
        self._starts: list[int] = []
        self.last_hole: Optional[tuple[int, int]] = None
        self._pad_index = -1

    def _room(self, n: int) -> None:
        if self._cur is None or self._used + n > self._cap:
            # 64 KiB first, doubling up to 1 MiB: a small checkpoint's headers and pickle
            # fit the first block, and a bytearray's every page is zeroed when made.
            cap = max(min(_BLOCK, _FIRST_BLOCK << (self._cur_index + 1)), n)
            ba = bytearray(cap)
            t = torch.frombuffer(ba, dtype=torch.uint8)
            self.blocks.append((ba, t))
            self._cur_index = len(self.blocks) - 1
            self._cur, self._cur_ptr, self._used, self._cap = ba, t.data_ptr(), 0, cap

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        n = len(mv)
        if n == 0:
            return 0
        self._room(n)
        assert self._cur is not None
        self._cur[self._used : self._used + n] = mv
        ptr = self._cur_ptr + self._used
        last = self.runs[-1] if self.runs else None
        if last is not None and last[0] + last[2] == self.pos and last[1] + last[2] == ptr:
            last[2] += n
        else:
            self.runs.append([self.pos, ptr, n, self._cur_index, self._used])
            self._starts.append(self.pos)
        self._used += n
        self.pos += n
        return n

    def pad(self, n: int) -> None:
        """Append ``n`` (< 64 KiB) bytes of ``Z``, torch's alignment padding, as a run
        over one shared read-only block: no copy, no fresh memory to fault in."""
        if n <= 0:
            return
        if n > len(_PAD_BLOCK[0]):
            raise ValueError(f"padding of {n} bytes is longer than {len(_PAD_BLOCK[0])}")
        if self._pad_index < 0:
            self.blocks.append(_PAD_BLOCK)
            self._pad_index = len(self.blocks) - 1
        self.runs.append([self.pos, _PAD_BLOCK[1].data_ptr(), n, self._pad_index, 0])
        self._starts.append(self.pos)
        self.pos += n

    def seek(self, offset: int, whence: int = 0) -> int:
        new = offset if whence == 0 else self.pos + offset if whence == 1 else None
        if new is None or new < self.pos:
            raise UnsupportedLayoutError(f"torch's zip writer moved backwards or seeked from the end ({offset}, {whence})")
        if new > self.pos:
            self.last_hole = (self.pos, new - self.pos)
        self.pos = new
        return new

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass

    def writable(self) -> bool:
        return True

    def run_index(self, offset: int) -> int:
        """Index in :attr:`runs` of the run a scan of the bytes from ``offset`` on starts
        at: the last run starting at or before ``offset`` (0 when none does)."""
        return max(0, bisect.bisect_right(self._starts, offset) - 1)

    def _locate(self, offset: int) -> list[int]:
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0 or offset >= self.runs[i][0] + self.runs[i][2]:
            raise UnsupportedLayoutError(f"offset {offset} is not in a recorded run")
        return self.runs[i]

    def read_at(self, offset: int, length: int) -> bytes:
        """Recorded bytes of ``[offset, offset+length)``; holes read as zeros."""
        end = min(offset + length, self.pos)
        if end <= offset:
            return b""
        out = bytearray(end - offset)
        i = self.run_index(offset)
        while i < len(self.runs) and self.runs[i][0] < end:
            f, _ptr, n, bi, bo = self.runs[i]
            lo, hi = max(f, offset), min(f + n, end)
            if lo < hi:
                ba = self.blocks[bi][0]
                out[lo - offset : hi - offset] = ba[bo + lo - f : bo + hi - f]
            i += 1
        return bytes(out)

    def patch(self, offset: int, data: bytes) -> None:
        """Overwrite recorded bytes in place (before they are handed out)."""
        while data:
            run = self._locate(offset)
            ba = self.blocks[run[3]][0]
            start = run[4] + (offset - run[0])
            n = min(len(data), run[0] + run[2] - offset)
            ba[start : start + n] = data[:n]
            offset += n
            data = data[n:]


SERIALIZATION_ID = ".data/serialization_id"


@dataclass
class _Entry:
    name: bytes
    offset: int  # local header
    size: int
    crc: int
    cd_crc_field: int = -1  # filled by finish()


class MinizLayout:
    """Appends torch-format zip records to ``sink`` (``write(bytes)``, ``seek(n, 1)``,
    ``tell()``, and optionally ``pad(n)``: append ``n`` bytes of ``Z``).

    Payloads of :meth:`add_payload` are holes in the sink (a forward seek): their
    bytes and CRC-32s are the native writer's business. ``alignment`` is the
    payload alignment (``PyTorchFileWriter``'s ``storage_alignment``).
    """

    def __init__(self, sink: Any, alignment: int, version: bytes, archive: str = "archive") -> None:
        if alignment <= 0 or alignment > 65536:
            raise ValueError(f"alignment must be in (0, 65536], got {alignment}")
        self._sink = sink
        self._align = alignment
        self._version = version
        self._prefix = archive + "/"
        self.entries: list[_Entry] = []
        self._written: set[str] = set()
        self._pending = b""  # the previous record's data descriptor, written with the next header
        self.pos = sink.tell()

    def _header(self, name: bytes, size: int, offset: int) -> tuple[bytes, int]:
        """The local header up to the padding bytes, and the number of padding bytes."""
        zip64 = b""
        if size >= _MAX32 or offset >= _MAX32:
            body = (struct.pack("<QQ", size, 0) if size >= _MAX32 else b"") + (
                struct.pack("<Q", offset) if offset >= _MAX32 else b""
            )
            zip64 = struct.pack("<HH", 1, len(body)) + body
        start = offset + 30 + len(name) + len(zip64) + 4
        pad = -start % self._align
        flags = _FLAGS if size else _FLAGS_EMPTY
        head = _LOCAL.pack(_LOCAL_SIG, 0, flags, 0, 0, 0, 0, 0, 0, len(name), len(zip64) + 4 + pad)
        return head + name + zip64 + b"FB" + struct.pack("<H", pad), pad

    def _descriptor(self, size: int, offset: int, crc: int) -> bytes:
        if size >= _MAX32 or offset >= _MAX32:
            return _DESC64.pack(_DESC_SIG, crc, size, size)
        return _DESC32.pack(_DESC_SIG, crc, size, size)

    def _begin(self, short: str, size: int, crc: int) -> tuple[_Entry, int]:
        name = (self._prefix + short).encode("utf-8")
        offset = self.pos + len(self._pending)
        head, pad = self._header(name, size, offset)
        self._sink.write(self._pending + head if self._pending else head)
        if pad:
            writer_pad = getattr(self._sink, "pad", None)
            if writer_pad is not None:
                writer_pad(pad)  # shared padding bytes, no copy
            else:
                self._sink.write(_PAD[:pad])
        self._pending = b""
        entry = _Entry(name, offset, size, crc)
        self.entries.append(entry)
        self._written.add(short)
        self.pos = offset + len(head) + pad
        return entry, self.pos

    def add_payload(self, short: str, size: int) -> tuple[int, int]:
        """A record whose ``size`` bytes are written elsewhere: ``(payload offset,
        file offset of the descriptor's CRC-32)`` (-1 for an empty record)."""
        entry, data = self._begin(short, size, 0)
        if not size:
            return data, -1
        self._sink.seek(size, 1)
        self.pos = data + size
        self._pending = self._descriptor(size, entry.offset, 0)
        return data, self.pos + DESC_CRC_FIELD

    def add_record(self, short: str, data: Any) -> None:
        """A record written here in full (its CRC-32 computed here)."""
        raw = bytes(data) if not isinstance(data, bytes) else data
        crc = zlib.crc32(raw)
        entry, _at = self._begin(short, len(raw), crc)
        if raw:
            self._sink.write(raw)
            self.pos += len(raw)
            self._pending = self._descriptor(len(raw), entry.offset, crc)

    def has_record(self, short: str) -> bool:
        """Whether a record of that name was added."""
        return short in self._written

    def finish(self, byteorder: str = sys.byteorder) -> int:
        """Write torch's closing records, the central directory and the end records;
        return the file size. Each entry's ``cd_crc_field`` is set."""
        self.add_record("version", self._version)
        if not self.has_record("byteorder"):
            self.add_record("byteorder", byteorder.encode("ascii"))
        self.add_record(SERIALIZATION_ID, self._serialization_id())
        cd_start = self.pos + len(self._pending)
        parts = [self._pending]
        self._pending = b""
        at = cd_start
        for e in self.entries:
            body = b""
            usize = csize = e.size
            hoff = e.offset
            if e.size >= _MAX32:
                body += struct.pack("<QQ", e.size, e.size)
                usize = csize = _MAX32
            if e.offset >= _MAX32:
                body += struct.pack("<Q", e.offset)
                hoff = _MAX32
            extra = struct.pack("<HH", 1, len(body)) + body if body else b""
            flags = _FLAGS if e.size else _FLAGS_EMPTY
            rec = _CENTRAL.pack(
                _CENTRAL_SIG, 0, 0, flags, 0, 0, 0, e.crc, csize, usize, len(e.name), len(extra), 0, 0, 0, 0, hoff
            )
            e.cd_crc_field = at + CD_CRC_FIELD
            parts.append(rec + e.name + extra)
            at += len(rec) + len(e.name) + len(extra)
        cd_size = at - cd_start
        n = len(self.entries)
        z64 = at
        parts.append(_ZIP64_EOCD.pack(b"PK\x06\x06", 44, 0x031E, 0x002D, 0, 0, n, n, cd_size, cd_start))
        parts.append(_ZIP64_LOCATOR.pack(b"PK\x06\x07", 0, z64, 1))
        parts.append(
            _EOCD.pack(b"PK\x05\x06", 0, 0, min(n, 0xFFFF), min(n, 0xFFFF), min(cd_size, _MAX32), min(cd_start, _MAX32), 0)
        )
        tail = b"".join(parts)
        self._sink.write(tail)
        self.pos += len(tail)
        return self.pos

    def _serialization_id(self) -> bytes:
        # The form crcpolicy recognises as "written by fastpersist" (its CRCs bind loads).

        pkl_crc = 0
        for e in self.entries:
            if e.name.endswith(b"/data.pkl"):
                pkl_crc = e.crc
        return serialization_id([e.name for e in self.entries], pkl_crc)


@functools.cache
def torch_version_record() -> bytes:
    """The ``version`` record torch's writer produces (``b"3\\n"`` for torch 2.x; computed once)."""
    buf = io.BytesIO()
    w = _compat.file_writer(buf, 64)
    w.write_end_of_file()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        (name,) = [n for n in z.namelist() if n.endswith("/version")]
        return z.read(name)


#: A probe sequence: (name, size or bytes). Sizes are payload holes.
PROBE = (
    ("data/0", 100),
    ("data/1", 0),
    ("data/2", (5 << 30) + 123),
    ("data/3", 10),
    ("data/4", 0),
    ("data.pkl", b"\x80\x02}q\x00."),
    (".format_version", b"1"),
    (".storage_alignment", b"4096"),
    ("byteorder", sys.byteorder.encode("ascii")),
)


def run_layouts(seq: Any, alignment: int, sink_factory: Any) -> tuple[Any, Any, "MinizLayout"]:
    """``seq`` through torch's writer and through :class:`MinizLayout`, each into a
    fresh ``sink_factory()`` sink: ``(torch sink, our sink, our layout)``."""
    theirs = sink_factory()
    w = _compat.file_writer(theirs, alignment)
    ours = sink_factory()
    layout = MinizLayout(ours, alignment, torch_version_record())
    for name, item in seq:
        if isinstance(item, bytes):
            w.write_record(name, item, len(item))
            layout.add_record(name, item)
        else:
            w.write_record_metadata(name, item)
            layout.add_payload(name, item)
    w.write_end_of_file()
    layout.finish()
    return theirs, ours, layout


def mask_serialization_id(read_at: Any, size: int) -> list[tuple[int, int]]:
    """Byte ranges that hold ``.data/serialization_id``'s content and CRC-32 fields."""
    index = parse_zip_index(read_at, size)
    e = index.find(SERIALIZATION_ID)
    if e is None:
        return []
    return [(e.data_offset, e.compressed_size)] + [(off, 4) for off in e.crc_field_offsets]


def layout_matches_torch() -> bool:
    """Whether :class:`MinizLayout` writes what this torch's writer writes (checked
    once per process, see :func:`zip_layout_ok`)."""
    return zip_layout_ok()


def recorded_bytes(sink: Any, mask: bool = True) -> list[tuple[int, bytes]]:
    """What a :class:`~fastpersist.formats.torchstream.BlockRecorder` holds, as
    ``(file offset, bytes)`` of maximal contiguous runs (holes left out), with
    ``.data/serialization_id``'s content and CRC-32 fields zeroed when ``mask``."""
    merged: list[list[Any]] = []
    for f, _ptr, n, *_ in sink.runs:
        if merged and merged[-1][0] + len(merged[-1][1]) == f:
            merged[-1][1] += sink.read_at(f, n)
        else:
            merged.append([f, bytearray(sink.read_at(f, n))])
    if mask:
        for off, n in mask_serialization_id(sink.read_at, sink.pos):
            for f, buf in merged:
                if f <= off and off + n <= f + len(buf):
                    buf[off - f : off - f + n] = bytes(n)
    return [(f, bytes(buf)) for f, buf in merged]


def _probe() -> bool:
    """Both writers on :data:`PROBE` (and it less its last record) at two alignments:
    True when the bytes agree; raises (``_compat.Unavailable`` naming the first
    difference, or whatever torch's writer raised) otherwise."""
    for alignment in (64, 4096):
        for seq in (PROBE, PROBE[:-1]):
            theirs, ours, _ = run_layouts(seq, alignment, BlockRecorder)
            if theirs.pos != ours.pos:
                raise _compat.Unavailable(
                    f"MinizLayout wrote {ours.pos} bytes where PyTorchFileWriter wrote {theirs.pos} (alignment {alignment})"
                )
            a, b = recorded_bytes(theirs), recorded_bytes(ours)
            if a != b:
                where = next((x[0] for x, y in zip(a, b) if x != y), min(len(a), len(b)))
                raise _compat.Unavailable(
                    f"MinizLayout's bytes differ from PyTorchFileWriter's (alignment {alignment}, run at offset {where})"
                )
    return True


@_compat.feature("zip_layout", "torch's PyTorchFileWriter lays out the zip records (slower)", logging.INFO)
def _probe_zip_layout() -> None:
    _compat.require("file_writer")
    _probe()


def zip_layout_ok() -> bool:
    """Whether ``MinizLayout`` writes the bytes of this torch's writer."""
    return _compat.ok("zip_layout")
