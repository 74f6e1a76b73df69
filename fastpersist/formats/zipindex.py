"""A small, strict reader of zip *indexes* (no decompression).

It finds every record of a zip archive (the end-of-central-directory record, its
zip64 variant, the central directory and each local header) and reports where
the record's bytes and CRC fields lie in the file. It is used three ways:

* by the torch planner, over the bytes recorded from ``torch.save`` run with
  ``skip_data`` (payload ranges are holes there, read as zeros);
* by ``load``, to checksum each record while the file is read;
* by ``verify``, to checksum each record and compare it with the central directory.

Only what torch's writer (miniz) and Python's :mod:`zipfile` produce is needed,
but the parser follows the zip specification (APPNOTE 6.3) for the fields it reads.
Every inconsistency raises :class:`~fastpersist.errors.ZipFormatError` naming the
path and the offset.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional

from fastpersist._sys import pread_full  # noqa: F401 (the formats import it from here too)
from fastpersist.errors import ZipFormatError

#: ``read_at(offset, length) -> bytes``: exactly ``length`` bytes unless the range
#: passes the end of the file (then fewer).
ReadAt = Callable[[int, int], bytes]

_EOCD_SIG = b"PK\x05\x06"
_ZIP64_LOCATOR_SIG = b"PK\x06\x07"
_ZIP64_EOCD_SIG = b"PK\x06\x06"
_CD_SIG = b"PK\x01\x02"
_LOCAL_SIG = b"PK\x03\x04"
_DESCRIPTOR_SIG = b"PK\x07\x08"

_EOCD = struct.Struct("<4s4H2LH")  # 22 bytes
_ZIP64_LOCATOR = struct.Struct("<4sLQL")  # 20 bytes
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")  # 56 bytes
_CD = struct.Struct("<4s6H3L5H2L")  # 46 bytes
_LOCAL = struct.Struct("<4s5H3L2H")  # 30 bytes

_U32_MAX = 0xFFFFFFFF
_U16_MAX = 0xFFFF
_FLAG_DESCRIPTOR = 0x0008
#: general purpose flags no reader of torch files supports: encrypted (bit 0),
#: compressed patch data (bit 5), strong encryption (bit 6), masked local headers (bit 13)
_FLAGS_UNSUPPORTED = 0x0001 | 0x0020 | 0x0040 | 0x2000
_FLAG_UTF8 = 0x0800
_DOS_DIRECTORY = 0x10
#: compression methods torch's reader (miniz) extracts: stored, deflated
METHODS_SUPPORTED = (0, 8)
_ZIP64_EXTRA_ID = 0x0001
#: offset of the crc32 field inside a central directory entry / a local header
CD_CRC_FIELD = 16
LOCAL_CRC_FIELD = 14


@dataclass(frozen=True)
class ZipEntry:
    """One record of a zip archive and the location of its bytes and CRC fields."""

    name: str
    header_offset: int  #: local file header
    data_offset: int  #: first byte of the (stored) data
    compressed_size: int
    uncompressed_size: int
    crc32: int  #: from the central directory
    method: int  #: 0 = stored
    flags: int
    cd_offset: int  #: this entry's central directory record
    #: the data descriptor after the data (flag bit 3), else ``None``
    descriptor_offset: Optional[int] = None
    descriptor_size: int = 0
    #: where the record's CRC-32 is stored in the file: central directory, and
    #: the data descriptor or (without one) the local header
    crc_field_offsets: tuple[int, ...] = ()
    #: external file attributes from the central directory (bit 0x10: MS-DOS directory)
    external_attr: int = 0

    @property
    def is_directory(self) -> bool:
        """Whether torch's reader (miniz) would treat the entry as a directory and refuse to extract it."""
        return self.name.endswith("/") or bool(self.external_attr & _DOS_DIRECTORY)

    @property
    def record_end(self) -> int:
        """One past the record's last byte (its data descriptor included)."""
        return self.data_end + self.descriptor_size

    @property
    def cd_crc_offset(self) -> int:
        """File offset of this entry's CRC field in the central directory."""
        return self.cd_offset + CD_CRC_FIELD

    @property
    def descriptor_crc_offset(self) -> Optional[int]:
        """File offset of the CRC field of the data descriptor, if there is one."""
        return self.crc_field_offsets[1] if self.descriptor_offset is not None else None

    @property
    def data_end(self) -> int:
        """One past the last byte of the stored data."""
        return self.data_offset + self.compressed_size


@dataclass
class ZipIndex:
    """All records of an archive, in central directory order."""

    path: str
    file_size: int
    entries: list[ZipEntry]
    cd_offset: int
    cd_size: int
    eocd_offset: int
    zip64: bool
    by_name: dict[str, ZipEntry] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.by_name:
            self.by_name = {e.name: e for e in self.entries}

    def find(self, suffix: str) -> Optional[ZipEntry]:
        """The entry named ``<archive>/<suffix>`` (torch prefixes every record with a folder)."""
        for e in self.entries:
            if e.name == suffix or e.name.endswith("/" + suffix):
                return e
        return None


def _fail(path: str, offset: int, what: str) -> ZipFormatError:
    return ZipFormatError(f"{path}: not a valid zip archive at offset {offset}: {what}", path=path, offset=offset)


def _read_exact(read_at: ReadAt, path: str, offset: int, length: int, what: str) -> bytes:
    data = read_at(offset, length)
    if len(data) != length:
        raise _fail(path, offset, f"file truncated while reading {what} ({len(data)} of {length} bytes)")
    return data


def _u16(buf: bytes, pos: int) -> int:
    return int.from_bytes(buf[pos : pos + 2], "little")


def _u32(buf: bytes, pos: int) -> int:
    return int.from_bytes(buf[pos : pos + 4], "little")


def _zip64_extra(extra: bytes, need: list[str], path: str, offset: int) -> dict[str, int]:
    """Values of the zip64 extended information extra field (id 0x0001) for ``need``."""
    pos = 0
    while pos + 4 <= len(extra):
        hid, size = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4 : pos + 4 + size]
        if hid == _ZIP64_EXTRA_ID:
            out: dict[str, int] = {}
            p = 0
            for key in need:
                width = 4 if key == "disk" else 8
                if p + width > len(body):
                    raise _fail(path, offset, f"zip64 extra field too short for {key}")
                out[key] = struct.unpack_from("<L" if width == 4 else "<Q", body, p)[0]
                p += width
            return out
        pos += 4 + size
    if need:
        raise _fail(path, offset, f"zip64 extra field missing (needed for {', '.join(need)})")
    return {}


def _find_eocd(read_at: ReadAt, size: int, path: str) -> tuple[int, bytes]:
    if size < _EOCD.size:
        raise _fail(path, 0, f"file is {size} bytes, too small for a zip archive")
    tail_len = min(size, _EOCD.size + _U16_MAX)
    tail_start = size - tail_len
    tail = _read_exact(read_at, path, tail_start, tail_len, "end of central directory")
    pos = tail.rfind(_EOCD_SIG)
    while pos >= 0:
        if pos + _EOCD.size <= len(tail) and pos + _EOCD.size + _u16(tail, pos + 20) == len(tail):
            return tail_start + pos, tail
        pos = tail.rfind(_EOCD_SIG, 0, pos)
    raise _fail(path, size, "end of central directory record not found (truncated or not a zip file)")


def _descriptor(
    read_at: ReadAt, path: str, at: int, csize: int, usize: int, prefer64: bool
) -> tuple[int, int]:
    """Size of the data descriptor at ``at`` and the offset of its CRC field."""
    raw = read_at(at, 24)
    sig = raw[:4] == _DESCRIPTOR_SIG
    crc_at = at + 4 if sig else at
    body = raw[4:] if sig else raw
    base = 4 if sig else 0
    fits32 = len(body) >= 12 and struct.unpack_from("<2L", body, 4) == (csize, usize)
    fits64 = len(body) >= 20 and struct.unpack_from("<2Q", body, 4) == (csize, usize)
    if fits64 and (prefer64 or not fits32):
        return base + 20, crc_at
    if fits32:
        return base + 12, crc_at
    raise _fail(path, at, "data descriptor does not match the sizes in the central directory")


def _locate_central_directory(read_at: ReadAt, size: int, path: str) -> tuple[int, int, int, int, bool]:
    """``(cd_offset, cd_size, entries, eocd_offset, zip64)`` from the (zip64) end records.

    As strict as torch's reader (miniz) and stricter where miniz is lenient: one disk
    only, entry counts that agree, the central directory inside the file and
    directly before the (zip64) end records.
    """
    eocd_off, tail = _find_eocd(read_at, size, path)
    tail_start = size - len(tail)
    (_, disk, cd_disk, n_disk, n_total, cd_size, cd_off, _clen) = _EOCD.unpack_from(tail, eocd_off - tail_start)
    zip64 = False
    cd_end = eocd_off  # where the central directory must end
    loc_off = eocd_off - _ZIP64_LOCATOR.size
    if loc_off >= 0:
        loc = read_at(loc_off, _ZIP64_LOCATOR.size)
        if len(loc) == _ZIP64_LOCATOR.size and loc[:4] == _ZIP64_LOCATOR_SIG:
            zip64 = True
            _, z64_disk, z64_off, n_disks = _ZIP64_LOCATOR.unpack(loc)
            if z64_disk != 0 or n_disks != 1:
                raise _fail(path, loc_off, f"zip64 locator names disk {z64_disk} of {n_disks} (multi-disk archives are not supported)")
            if z64_off + _ZIP64_EOCD.size > loc_off:
                raise _fail(path, loc_off, f"zip64 locator points past itself ({z64_off})")
            rec = _read_exact(read_at, path, z64_off, _ZIP64_EOCD.size, "zip64 end of central directory")
            if rec[:4] != _ZIP64_EOCD_SIG:
                raise _fail(path, z64_off, "bad zip64 end of central directory signature")
            (_, rec_size, _vm, _vn, disk64, cd_disk64, n_disk64, n_total64, cd_size64, cd_off64) = _ZIP64_EOCD.unpack(rec)
            if z64_off + 12 + rec_size != loc_off:
                raise _fail(path, z64_off, f"zip64 end of central directory claims {rec_size} bytes, "
                            f"but the locator follows at {loc_off}")
            # the 32-bit fields must repeat the zip64 ones, or say "see zip64" (all ones)
            for what, v32, v64, sat in (
                ("disk number", disk, disk64, _U16_MAX), ("central directory disk", cd_disk, cd_disk64, _U16_MAX),
                ("entries on this disk", n_disk, n_disk64, _U16_MAX), ("total entries", n_total, n_total64, _U16_MAX),
                ("central directory size", cd_size, cd_size64, _U32_MAX),
                ("central directory offset", cd_off, cd_off64, _U32_MAX),
            ):
                if v32 != v64 and v32 != sat:
                    raise _fail(path, eocd_off, f"end record's {what} ({v32}) contradicts the zip64 end record ({v64})")
            disk, cd_disk, n_disk, n_total, cd_size, cd_off = disk64, cd_disk64, n_disk64, n_total64, cd_size64, cd_off64
            cd_end = z64_off
    if disk != 0 or cd_disk != 0:
        raise _fail(path, eocd_off, f"disk numbers {disk}/{cd_disk} (multi-disk archives are not supported)")
    if n_disk != n_total:
        raise _fail(path, eocd_off, f"{n_disk} entries on this disk but {n_total} in total (multi-disk archive?)")
    if cd_off + cd_size > size:
        raise _fail(
            path, eocd_off, f"central directory [{cd_off}, {cd_off + cd_size}) lies past the end of file ({size} bytes)"
        )
    if cd_off + cd_size != cd_end:
        raise _fail(
            path, eocd_off, f"central directory [{cd_off}, {cd_off + cd_size}) does not end where the end records "
            f"start ({cd_end}): its offset or size is wrong"
        )
    if n_total * _CD.size > cd_size:
        raise _fail(path, eocd_off, f"{n_total} entries cannot fit in a {cd_size}-byte central directory")
    return cd_off, cd_size, n_total, eocd_off, zip64


def _iter_central_directory(
    cd: bytes, cd_off: int, n_total: int, path: str
) -> Iterator[tuple[int, str, int, int, int, int, int, int, bytes, int]]:
    """``(pos, name, flags, method, crc, csize, usize, header_offset, raw_name,
    external_attr)`` of each central directory entry (zip64 extra fields applied);
    ``pos`` is relative to ``cd_off``.

    Refuses what torch's reader refuses (encryption, unsupported methods, other
    disks, a stored record whose sizes differ, a record running past the central
    directory) and what makes names ambiguous (undecodable or duplicate names);
    the entries must fill the central directory exactly (the end record's count).
    """
    pos = 0
    seen: set[str] = set()
    for i in range(n_total):
        here = cd_off + pos
        if pos + _CD.size > len(cd) or cd[pos : pos + 4] != _CD_SIG:
            raise _fail(path, here, f"bad central directory entry signature (entry {i} of {n_total})")
        fields = _CD.unpack_from(cd, pos)
        flags, method, crc, csize, usize, nlen, xlen, clen, dstart = fields[3:5] + fields[7:14]
        hoff = fields[16]
        name_b = cd[pos + 46 : pos + 46 + nlen]
        extra = cd[pos + 46 + nlen : pos + 46 + nlen + xlen]
        if pos + 46 + nlen + xlen + clen > len(cd):
            raise _fail(path, here, "central directory entry runs past the directory")
        need = [k for k, v in (("usize", usize), ("csize", csize), ("hoff", hoff)) if v == _U32_MAX]
        if dstart == _U16_MAX:
            need.append("disk")
        big = _zip64_extra(extra, need, path, here)
        usize, csize, hoff = big.get("usize", usize), big.get("csize", csize), big.get("hoff", hoff)
        dstart = big.get("disk", dstart)
        try:
            name = name_b.decode("utf-8" if flags & _FLAG_UTF8 else "cp437")
        except UnicodeDecodeError as exc:
            raise _fail(path, here + 46 + exc.start, f"entry name {name_b!r} is not valid UTF-8") from None
        if flags & _FLAGS_UNSUPPORTED:
            raise _fail(path, here + 8, f"entry {name!r} is encrypted or uses unsupported features (flags {flags:#06x})")
        if method not in METHODS_SUPPORTED:
            raise _fail(path, here + 10, f"entry {name!r} uses unsupported compression method {method}")
        if method == 0 and csize != usize:
            raise _fail(path, here + 20, f"stored entry {name!r} has compressed size {csize} != uncompressed size {usize}")
        if usize and not csize:
            raise _fail(path, here + 20, f"entry {name!r} claims {usize} bytes from 0 compressed bytes")
        if dstart != 0:
            raise _fail(path, here + 34, f"entry {name!r} starts on disk {dstart} (multi-disk archives are not supported)")
        if hoff + _LOCAL.size + nlen + csize > cd_off:
            raise _fail(path, here + 42, f"record {name!r} at {hoff} ({csize} bytes) runs into the central directory at {cd_off}")
        if name in seen:
            raise _fail(path, here, f"duplicate entry name {name!r}")
        seen.add(name)
        yield pos, name, flags, method, crc, csize, usize, hoff, name_b, fields[15]
        pos += 46 + nlen + xlen + clen
    if pos != len(cd):
        raise _fail(
            path, cd_off + pos, f"the end record counts {n_total} entries but the {len(cd)}-byte central directory "
            f"holds more ({len(cd) - pos} bytes left over)"
        )


@dataclass
class CentralEntry:
    """What the central directory alone says about a record."""

    name: str
    cd_offset: int
    header_offset: int
    compressed_size: int
    crc32: int
    flags: int
    method: int = 0  #: compression method (0 = stored)
    uncompressed_size: int = 0


def starts_like_zip(path: "str | bytes | os.PathLike[str]") -> bool:
    """Whether the file at ``path`` begins with a zip local header (torch's format, whatever
    its name); False where it cannot be read (the caller's own open reports that)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False


def check_deflated(read_at: ReadAt, path: str, entries: Iterable[ZipEntry], chunk: int = 8 << 20) -> None:
    """Raise :class:`ZipFormatError` naming the first deflated record whose bytes do not
    inflate to exactly its recorded size and CRC-32.

    ``torch.save`` and fastpersist write every record stored; a file repacked by a zip
    tool may hold deflated ones, which torch's reader (miniz) extracts, and fastpersist
    hands such files to ``torch.load``. But a record *marked* deflated whose bytes are no
    valid deflate stream (a damaged method field, in the local header and the directory
    alike) made ``torch.load`` return heap memory it never filled as tensor values. So
    every deflated record is inflated here first (in ``chunk``-sized reads, nothing
    kept) and checked; only a file whose every record checks out goes to ``torch.load``.
    """
    for e in entries:
        if e.method != 8:
            continue
        inflater = zlib.decompressobj(-15)  # raw deflate, as zip stores it
        crc = size = done = 0
        why = None
        try:
            while done < e.compressed_size and not inflater.eof and size <= e.uncompressed_size:
                n = min(chunk, e.compressed_size - done)
                data = read_at(e.data_offset + done, n)
                if len(data) != n:
                    why = f"file truncated at offset {e.data_offset + done + len(data)}"
                    break
                done += n
                out = inflater.decompress(data, chunk)  # at most chunk bytes at a time: no inflate bomb
                while True:
                    crc, size = zlib.crc32(out, crc), size + len(out)
                    if size > e.uncompressed_size or (len(out) < chunk and not inflater.unconsumed_tail):
                        break
                    out = inflater.decompress(inflater.unconsumed_tail, chunk)
            if why is None:
                if size > e.uncompressed_size:
                    why = f"it inflates to more than the {e.uncompressed_size} bytes recorded"
                elif not inflater.eof:
                    why = "the deflate stream does not end within the record"
                elif size != e.uncompressed_size:
                    why = f"it inflates to {size} bytes, not the {e.uncompressed_size} recorded"
                elif crc != e.crc32:
                    why = f"CRC-32 of the inflated bytes {crc:08x}, recorded {e.crc32:08x}"
        except zlib.error as exc:
            why = f"not a valid deflate stream ({exc})"
        if why is not None:
            raise ZipFormatError(
                f"{path}: record {e.name!r} (local header at offset {e.header_offset}) is marked compressed "
                f"(zip method 8, deflated) but does not inflate to its recorded bytes: {why}. torch.save never "
                "compresses records, so the file is damaged (torch.load would return memory it never filled "
                "for this record): restore the checkpoint from another copy",
                path=path, offset=e.header_offset)


def read_central_directory(read_at: ReadAt, size: int, path: str = "<buffer>") -> tuple[int, list[CentralEntry]]:
    """``(cd_offset, entries)`` from the end records and the central directory only
    (no local headers): one small read at the end of a file."""
    cd_off, cd_size, n_total, _eocd, _z = _locate_central_directory(read_at, size, path)
    cd = _read_exact(read_at, path, cd_off, cd_size, "central directory")
    return cd_off, [
        CentralEntry(name, cd_off + pos, hoff, csize, crc, flags, method, usize)
        for pos, name, flags, method, crc, csize, usize, hoff, _raw, _x in _iter_central_directory(cd, cd_off, n_total, path)
    ]


def central_directory_names(read_at: ReadAt, size: int, path: str = "<buffer>") -> list[tuple[str, int]]:
    """``(name, central directory entry offset)`` of every entry, reading only the
    end records and the central directory (no local headers): cheap for archives
    of many records. The CRC-32 field of an entry is at ``offset + CD_CRC_FIELD``."""
    _cd_off, entries = read_central_directory(read_at, size, path)
    return [(e.name, e.cd_offset) for e in entries]


def check_local_fields(
    path: str, header_offset: int, name: str, local: tuple[int, int, int, int, int], central: tuple[int, int, int, int, int]
) -> None:
    """Raise :class:`ZipFormatError` unless a local header's ``(flags, method, CRC-32,
    compressed size, size)`` say what its central directory entry says.

    The local CRC and sizes may be 0 when the record has a data descriptor (flag bit 3),
    and a size may be 0xFFFFFFFF (zip64: the real value is in the extra field). Every
    reader applies this one rule, so that a file ``verify`` calls inconsistent is never
    loaded (nor handed to ``torch.load``, which believes the central directory alone).
    """
    lflags, lmethod = local[0], local[1]
    flags, method = central[0], central[1]
    if lflags != flags or lmethod != method:
        raise _fail(
            path, header_offset + 6, f"local header of {name!r} says flags {lflags:#06x} method {lmethod}, the central "
            f"directory flags {flags:#06x} method {method}"
        )
    for what, lv, cv in zip(("CRC-32", "compressed size", "size"), local[2:], central[2:]):
        ok = lv == cv or (lflags & _FLAG_DESCRIPTOR and lv == 0) or (what != "CRC-32" and lv == _U32_MAX)
        if not ok:
            raise _fail(path, header_offset + 14, f"local header of {name!r} says {what} {lv}, the central directory {cv}")


def parse_zip_index(read_at: ReadAt, size: int, path: str = "<buffer>") -> ZipIndex:
    """Parse the index of a zip archive of ``size`` bytes readable through ``read_at``.

    Raises:
        ZipFormatError: the bytes are not a consistent zip archive (names the path and offset).
    """
    cd_off, cd_size, n_total, eocd_off, zip64 = _locate_central_directory(read_at, size, path)
    cd = _read_exact(read_at, path, cd_off, cd_size, "central directory")

    entries: list[ZipEntry] = []
    for pos, name, flags, method, crc, csize, usize, hoff, raw_name, external in _iter_central_directory(
        cd, cd_off, n_total, path
    ):
        here = cd_off + pos
        local = _read_exact(read_at, path, hoff, _LOCAL.size, f"local header of {name!r}")
        (sig, _lv, lflags, lmethod, _lt, _ld, lcrc, lcsize, lusize, lnlen, lxlen) = _LOCAL.unpack(local)
        if sig != _LOCAL_SIG:
            raise _fail(path, hoff, f"bad local header signature for {name!r}")
        lname = _read_exact(read_at, path, hoff + _LOCAL.size, lnlen, f"local name of {name!r}")
        if lname != raw_name:
            raise _fail(path, hoff + _LOCAL.size, f"local header names {lname!r}, the central directory {raw_name!r}")
        check_local_fields(path, hoff, name, (lflags, lmethod, lcrc, lcsize, lusize), (flags, method, crc, csize, usize))
        data_off = hoff + _LOCAL.size + lnlen + lxlen
        if data_off + csize > cd_off:
            raise _fail(path, data_off, f"data of {name!r} ({csize} bytes) runs past the central directory at {cd_off}")
        crc_fields: tuple[int, ...]
        desc_off: Optional[int] = None
        desc_size = 0
        if lflags & _FLAG_DESCRIPTOR:
            desc_off = data_off + csize
            prefer64 = csize >= _U32_MAX or usize >= _U32_MAX or hoff >= _U32_MAX
            desc_size, desc_crc = _descriptor(read_at, path, desc_off, csize, usize, prefer64)
            if desc_off + desc_size > cd_off:
                raise _fail(path, desc_off, f"data descriptor of {name!r} runs into the central directory at {cd_off}")
            crc_fields = (cd_off + pos + CD_CRC_FIELD, desc_crc)
        else:
            crc_fields = (cd_off + pos + CD_CRC_FIELD, hoff + LOCAL_CRC_FIELD)
        entries.append(
            ZipEntry(
                name=name,
                header_offset=hoff,
                data_offset=data_off,
                compressed_size=csize,
                uncompressed_size=usize,
                crc32=crc,
                method=method,
                flags=lflags,
                cd_offset=here,
                descriptor_offset=desc_off,
                descriptor_size=desc_size,
                crc_field_offsets=crc_fields,
                external_attr=external,
            )
        )
    previous: Optional[ZipEntry] = None
    for e in sorted(entries, key=lambda e: (e.header_offset, e.record_end)):
        if previous is not None and e.header_offset < previous.record_end:
            raise _fail(
                path, e.header_offset, f"record {e.name!r} [{e.header_offset}, {e.record_end}) overlaps record "
                f"{previous.name!r} [{previous.header_offset}, {previous.record_end})"
            )
        previous = e
    return ZipIndex(
        path=path,
        file_size=size,
        entries=entries,
        cd_offset=cd_off,
        cd_size=cd_size,
        eocd_offset=eocd_off,
        zip64=zip64,
    )


def buffer_reader(buf: "bytes | bytearray | memoryview") -> ReadAt:
    """A ``read_at`` over an in-memory buffer."""
    mv = memoryview(buf).cast("B")

    def read_at(offset: int, length: int) -> bytes:
        return bytes(mv[offset : offset + length])

    return read_at


def fd_reader(fd: int, path: Optional[str] = None) -> ReadAt:
    """A ``read_at`` over an open file descriptor (:func:`pread_full`; errors name ``path``)."""

    def read_at(offset: int, length: int) -> bytes:
        return pread_full(fd, length, offset, path)

    return read_at


def read_zip_index(path: "str | os.PathLike[str]") -> ZipIndex:
    """Parse the index of the zip file at ``path`` (a few small ``pread`` calls)."""
    p = os.fspath(path)
    fd = os.open(p, os.O_RDONLY)
    try:
        return parse_zip_index(fd_reader(fd, p), os.fstat(fd).st_size, p)
    finally:
        os.close(fd)


def is_zip_file(path: "str | os.PathLike[str]") -> bool:
    """Whether the file starts with a zip local header (what ``torch.load`` checks too)."""
    with open(path, "rb") as f:
        return f.read(4) == _LOCAL_SIG
