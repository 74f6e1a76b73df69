"""Verify a ``torch.save`` zip checkpoint without loading it.

Every record's bytes are read natively (read-and-discard extents with CRC slots)
and compared with the CRC-32 recorded in the central directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from fastpersist.errors import ZipFormatError
from fastpersist.formats.zipindex import ZipIndex, buffer_reader, fd_reader, parse_zip_index


def _native_read(handle: Any, path: str, extents: list[tuple[int, int, int, int]], nslots: int) -> list[int]:
    """``handle.read`` whose ``OSError`` always names ``path``."""
    try:
        return handle.read(path, extents, nslots)
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise type(e)(e.errno, e.strerror or str(e), path) from e


def _read_extents(index: ZipIndex) -> tuple[list[tuple[int, int, int, int]], list[str]]:
    """Read-and-discard extents, one CRC slot per non-empty record."""
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
        extents.append((e.data_offset, 0, e.compressed_size, len(names)))
        names.append(e.name)
        pos = e.data_end
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
    extents, names = _read_extents(index)
    crcs = _native_read(handle, path, extents, len(names)) if extents else []
    problems += _crc_problems(index, names, crcs)
    return TorchCheck(problems, records=len(index.entries), nbytes=sum(e.compressed_size for e in index.entries))


def read_index_from_bytes(data: bytes, path: str = "<buffer>") -> ZipIndex:
    """Parse a zip index from bytes in memory (tests, tools)."""
    return parse_zip_index(buffer_reader(data), len(data), path)
