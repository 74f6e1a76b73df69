"""The CRC-32s of an object, checked while it downloads: where each format's records
lie (read from the index before the payloads arrive), and whether the CRCs the GET
threads computed prove every record sound.

:func:`spans` gives :func:`fastpersist.s3download.fetch` the byte ranges to checksum:
for a torch zip file, the data of every record from the central directory (the
offsets predicted as the fast loader predicts them); for a safetensors file, every
tensor's bytes from the header. Once the object is in memory, :func:`check`
re-reads the exact index from the fetched bytes (every local header, or the header
again) and compares, before any loader runs (so before ``load_state_dict`` writes
anything into a model): when every record's data span is where it was predicted,
the recorded CRC-32s decide, by the loaders' rule
(:mod:`fastpersist.formats.crcpolicy`): all match, and the loader skips its own pass
over the bytes; a mismatch raises :class:`~fastpersist.errors.ChecksumError`. Every
record is compared, also those the pickle does not refer to. Where it cannot decide
(an index that does not parse, an odd layout) the loader runs with its checks as for
a local file, and names what is wrong.
"""

from __future__ import annotations

import os
import struct
from typing import Any, Optional, Sequence

from fastpersist.formats import crcpolicy, safetensors
from fastpersist.formats.torchload import predict_offsets, record_prefix
from fastpersist.formats.torchverify import crc_mismatch
from fastpersist.formats.zipindex import ReadAt, ZipEntry, fd_reader, parse_zip_index, read_central_directory

__all__ = ["KnownCrcs", "NotKnown", "check", "spans"]

_LEN = struct.Struct("<Q")


def _torch_spans(read_at: ReadAt, size: int) -> Optional[list[tuple[int, int, bool]]]:
    cd_off, entries = read_central_directory(read_at, size, "<object>")
    offsets = predict_offsets(entries, cd_off)
    if offsets is None:
        return None
    prefix = record_prefix("<object>", entries)
    # droppable: the stored storage records (a verify reads the others' bytes: the pickle, ...)
    return [(offsets[id(e)], e.compressed_size, e.method == 0 and e.name[len(prefix):].startswith("data/"))
            for e in entries]


def _safetensors_spans(read_at: ReadAt, size: int) -> Optional[list[tuple[int, int, bool]]]:
    if size < _LEN.size:
        return None
    (length,) = _LEN.unpack(read_at(0, _LEN.size))
    if length > safetensors.MAX_HEADER_SIZE or _LEN.size + length > size:
        return None
    header = safetensors.parse_header("<object>", read_at(_LEN.size, length), size)
    return [(header.data_start + e.begin, e.nbytes, True) for e in header.tensors]


def spans(kind: str) -> tuple[Any, bool]:
    """``(spans_of, index_at_end)`` for :func:`fastpersist.s3download.fetch` of an
    object of ``kind`` (``"torch"`` or ``"safetensors"``)."""
    if kind == "safetensors":
        return _safetensors_spans, False
    return _torch_spans, True


def check(kind: str, fd: int, name: str, size: int, crcs: Optional[dict[tuple[int, int], int]]) -> bool:
    """Decide from ``crcs`` (by ``(offset, length)``, computed as the bytes of the object
    in ``fd`` arrived) whether the object is sound, before any loader looks at it:

    * True: every record's CRC-32 was compared and all match (or, in a torch file torch
      wrote, only storage records differ: logged as the loaders log it); the loader need
      not check again;
    * :class:`~fastpersist.errors.ChecksumError` (naming ``name``): a record differs
      where the loaders would raise (see :mod:`fastpersist.formats.crcpolicy`);
    * False: it cannot tell (no CRCs, an index that does not parse, a layout other than
      predicted): the loader checks, and names what is wrong.
    """
    if crcs is None:
        return False
    try:
        if kind == "safetensors":
            problems = _safetensors_problems(fd, name, crcs)
        else:
            problems = _torch_problems(fd, name, size, crcs)
    except Exception:  # noqa: BLE001 - the loader's own checks name what is wrong
        return False
    if problems is None:
        return False
    if problems:
        problems()
    return True


def _crc(crcs: dict[tuple[int, int], int], offset: int, length: int) -> Optional[int]:
    return 0 if length == 0 else crcs.get((offset, length))


def _torch_problems(fd: int, name: str, size: int, crcs: dict[tuple[int, int], int]) -> Any:
    """None (undecided), an empty list (all match), or a callable applying the policy."""
    index = parse_zip_index(fd_reader(fd, name), size, name)
    if not index.entries:
        return None
    bad: list[tuple[ZipEntry, int]] = []
    for e in index.entries:
        got = _crc(crcs, e.data_offset, e.compressed_size)
        if e.method != 0 or got is None:
            return None
        if got != e.crc32 and not crcpolicy.no_crc(e.crc32):
            bad.append((e, got))
    if not bad:
        return []

    def ours() -> bool:
        sid = index.find(crcpolicy.SERIALIZATION_ID)
        raw = os.pread(fd, sid.compressed_size, sid.data_offset) if sid is not None else None
        return crcpolicy.written_by_fastpersist(index.entries, raw)

    def apply() -> None:
        prefix = record_prefix(name, index.entries)  # type: ignore[arg-type]  # needs .name and .cd_offset only
        storages = all(e.name[len(prefix):].startswith("data/") for e, _c in bad)
        crcpolicy.mismatch(name, [crc_mismatch(e, c) for e, c in bad], ours, storages)

    return apply


def _safetensors_problems(fd: int, name: str, crcs: dict[tuple[int, int], int]) -> Any:
    header = safetensors.read_header_fd(fd, name)
    if header.crcs is None:
        return []  # nothing recorded: the loader would check nothing either
    _extents, slots = safetensors.data_extents(header, lambda _off: 0)
    got: Sequence[Optional[int]] = [_crc(crcs, header.data_start + e.begin, e.nbytes) for e in slots]
    if any(c is None for c in got):
        return None
    problems = safetensors.crc_problems(header, slots, [int(c) for c in got if c is not None])
    if not problems:
        return []

    def apply() -> None:
        raise safetensors.checksum_error(name, problems)

    return apply


class NotKnown(Exception):
    """A verifier asked for a CRC-32 the download did not compute."""


class KnownCrcs:
    """The verifiers' reader (``read(target, extents, nslots)`` over read-and-discard
    extents, one per CRC slot) answered from the CRC-32s computed during the download,
    whose payload pages may be gone (:func:`fastpersist.s3download.fetch` with
    ``discard``); raises :class:`NotKnown` for anything else (then the caller fetches
    the object whole and verifies it as a file)."""

    def __init__(self, crcs: dict[tuple[int, int], int]) -> None:
        self.crcs = crcs

    def read(self, _target: Any, extents: Sequence[tuple[int, int, int, int]], nslots: int = 0) -> list[int]:
        out: list[Optional[int]] = [None] * nslots
        for off, ptr, n, slot in extents:
            c = _crc(self.crcs, off, n)
            if ptr != 0 or not 0 <= slot < nslots or out[slot] is not None or c is None:
                raise NotKnown(f"bytes [{off}, {off + n}) in slot {slot}")
            out[slot] = c
        if any(c is None for c in out):
            raise NotKnown("a slot without an extent")
        return [int(c) for c in out if c is not None]
