"""The CRC-32s of an object, checked while it downloads: where each format's records
lie (read from the index before the payloads arrive), and whether the CRCs the GET
threads computed prove every record sound.

:func:`spans` gives :func:`fastpersist.s3download.fetch` the byte ranges to checksum:
for a torch zip file, the data of every record from the central directory (the
offsets predicted as the fast loader predicts them); for a safetensors file, every
tensor's bytes from the header. Once the object is in memory, :func:`all_match`
re-reads the exact index from the fetched bytes (every local header, or the header
again) and compares: only when every record's data span is where it was predicted and
its CRC-32 equals the recorded one (or none was recorded) does it answer True, and
the loader then skips its own pass over the bytes. In every other case (a mismatch,
an index that does not parse, an odd layout) it answers False and the loader runs
with its checks as for a local file, which raises the named error (or, for a file
torch wrote, applies :mod:`fastpersist.formats.crcpolicy`'s rule).
"""

from __future__ import annotations

import struct
from typing import Any, Optional, Sequence

from fastpersist.formats import crcpolicy, safetensors
from fastpersist.formats.torchload import predict_offsets
from fastpersist.formats.zipindex import ReadAt, fd_reader, parse_zip_index, read_central_directory

__all__ = ["all_match", "spans"]

_LEN = struct.Struct("<Q")


def _torch_spans(read_at: ReadAt, size: int) -> Optional[list[tuple[int, int]]]:
    cd_off, entries = read_central_directory(read_at, size, "<object>")
    offsets = predict_offsets(entries, cd_off)
    if offsets is None:
        return None
    return [(offsets[id(e)], e.compressed_size) for e in entries]


def _safetensors_spans(read_at: ReadAt, size: int) -> Optional[list[tuple[int, int]]]:
    if size < _LEN.size:
        return None
    (length,) = _LEN.unpack(read_at(0, _LEN.size))
    if length > safetensors.MAX_HEADER_SIZE or _LEN.size + length > size:
        return None
    header = safetensors.parse_header("<object>", read_at(_LEN.size, length), size)
    return [(header.data_start + e.begin, e.nbytes) for e in header.tensors]


def spans(kind: str) -> tuple[Any, bool]:
    """``(spans_of, index_at_end)`` for :func:`fastpersist.s3download.fetch` of an
    object of ``kind`` (``"torch"`` or ``"safetensors"``)."""
    if kind == "safetensors":
        return _safetensors_spans, False
    return _torch_spans, True


def all_match(kind: str, fd: int, path: str, size: int, crcs: Optional[dict[tuple[int, int], int]]) -> bool:
    """Whether ``crcs`` (by ``(offset, length)``, computed as the bytes of the object in
    ``fd`` arrived) cover every record and all equal the recorded CRC-32s (see the
    module docstring). Never raises for a malformed object: it answers False."""
    if crcs is None:
        return False
    try:
        if kind == "safetensors":
            return _safetensors_match(fd, path, crcs)
        return _torch_match(fd, path, size, crcs)
    except Exception:  # noqa: BLE001 - the loader's own checks name what is wrong
        return False


def _crc(crcs: dict[tuple[int, int], int], offset: int, length: int) -> Optional[int]:
    return 0 if length == 0 else crcs.get((offset, length))


def _torch_match(fd: int, path: str, size: int, crcs: dict[tuple[int, int], int]) -> bool:
    index = parse_zip_index(fd_reader(fd, path), size, path)
    for e in index.entries:
        got = _crc(crcs, e.data_offset, e.compressed_size)
        if e.method != 0 or got is None:
            return False
        if got != e.crc32 and not crcpolicy.no_crc(e.crc32):
            return False
    return bool(index.entries)


def _safetensors_match(fd: int, path: str, crcs: dict[tuple[int, int], int]) -> bool:
    header = safetensors.read_header_fd(fd, path)
    if header.crcs is None:
        return True  # nothing recorded: the loader would check nothing either
    _extents, slots = safetensors.data_extents(header, lambda _off: 0)
    got: Sequence[Optional[int]] = [_crc(crcs, header.data_start + e.begin, e.nbytes) for e in slots]
    if any(c is None for c in got):
        return False
    return not safetensors.crc_problems(header, slots, [int(c) for c in got if c is not None])
