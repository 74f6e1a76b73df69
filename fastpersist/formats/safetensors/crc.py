"""The CRC-32s a safetensors file written by fastpersist records, compared with its bytes.

:func:`data_extents` lists the reads of a file's tensors (one CRC slot per non-empty
tensor, in data order); :func:`crc_problems` compares the CRC-32s computed during those
reads, and the header's own CRC-32, with what the header records (entry keys, or
``__metadata__`` in files of earlier versions); :func:`checksum_error` is the error a
load raises for them.
"""

from __future__ import annotations

from typing import Any, Sequence

from fastpersist.errors import ChecksumError
from fastpersist.formats.safetensors.header import (CRC_METADATA_KEY, ENTRY_HEADER_CRC_KEY, HEADER_CRC_METADATA_KEY,
                                                    SafetensorsHeader, TensorEntry, entries_header_crc32,
                                                    header_crc32)

__all__ = ["checksum_error", "crc_problems", "data_extents"]


def data_extents(header: SafetensorsHeader, ptr_of: Any) -> tuple[list[tuple[int, int, int, int]], list[TensorEntry]]:
    """The native reads of ``header``'s non-empty tensors, ``(file offset, ptr_of(file offset),
    nbytes, slot)``, and the tensor of each CRC slot (data order)."""
    extents = []
    slots = []
    for entry in header.tensors:
        if entry.nbytes:
            start = header.data_start + entry.begin
            extents.append((start, ptr_of(start), entry.nbytes, len(slots)))
            slots.append(entry)
    return extents, slots


def crc_problems(header: SafetensorsHeader, slots: list[TensorEntry], crcs: Sequence[int]) -> list[tuple[str, str]]:
    """``(record, message)`` for every recorded CRC-32 that does not match (record: tensor name)."""
    recorded = header.crcs
    assert recorded is not None
    if len(recorded) != len(header.tensors):
        return [
            (
                CRC_METADATA_KEY,
                f"{header.path}: {CRC_METADATA_KEY} lists {len(recorded)} checksums for {len(header.tensors)} "
                "tensors; the header was altered after fastpersist wrote it",
            )
        ]
    expected = {e.name: r for e, r in zip(header.tensors, recorded)}
    problems: list[tuple[str, str]] = []
    meta = header.metadata or {}
    altered = "it was altered after fastpersist wrote it"
    meaning = {e.name: (e.dtype, list(e.shape), [e.begin, e.end]) for e in header.tensors}
    want_h: Any = None
    if not header.legacy:
        if len(header.entry_header_crcs) != 1:
            problems.append((ENTRY_HEADER_CRC_KEY, f"{header.path}: {len(header.entry_header_crcs)} tensor entries "
                             f"carry {ENTRY_HEADER_CRC_KEY} where fastpersist writes it in one; the header was "
                             "altered after fastpersist wrote it"))
        else:
            want_h = header.entry_header_crcs[0][1]
            got_h = entries_header_crc32(meaning, header.metadata)
    elif HEADER_CRC_METADATA_KEY in meta:
        want_h = meta[HEADER_CRC_METADATA_KEY]
        got_h = header_crc32(meaning, meta)
    if want_h is not None and want_h != f"{got_h:08x}":
        problems.append(
            (
                ENTRY_HEADER_CRC_KEY if not header.legacy else HEADER_CRC_METADATA_KEY,
                f"{header.path}: the header (tensor names, dtypes, shapes, offsets or metadata) does not match "
                f"its recorded CRC-32 ({got_h:08x}, recorded {str(want_h)[:8]!r}); {altered}",
            )
        )
    for entry in header.tensors:
        if expected[entry.name] is None:
            what = "has no recorded checksum (other tensors have one)" if not header.legacy and \
                entry.name not in header.entry_crcs else "recorded checksum is not 8 hex digits"
            problems.append((entry.name, f"{header.path}: tensor {entry.name!r}: {what}"))
        elif entry.nbytes == 0 and expected[entry.name] != 0:
            problems.append(
                (entry.name, f"{header.path}: tensor {entry.name!r} is empty but its recorded CRC-32 is not 00000000")
            )
    for entry, actual in zip(slots, crcs):
        want = expected[entry.name]
        if want is not None and actual != want:
            problems.append(
                (
                    entry.name,
                    f"{header.path}: tensor {entry.name!r}: CRC-32 of its bytes is {actual:08x}, recorded {want:08x} "
                    f"(file bytes {header.data_start + entry.begin}..{header.data_start + entry.end})",
                )
            )
    return problems


def checksum_error(path: str, problems: list[tuple[str, str]]) -> ChecksumError:
    """The error for ``(tensor name, message)`` CRC mismatches of ``path``."""
    return ChecksumError(
        f"{path}: checksum mismatch, the file is corrupt (restore it from a good copy, or pass "
        "checksum=False to read the bytes anyway):\n" + "\n".join(msg for _, msg in problems),
        path,
        [name for name, _ in problems],
    )
