"""What a format planner hands to the writers: the byte layout of one file.

A :class:`WritePlan` lists every byte of a file as extents (host or device pointers,
lengths, CRC slots) and the CRC fields to fill in (patches). The formats produce plans;
the staging and write stages consume them without knowing any format.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

#: Patch kinds understood by the native executor (see ``_native.pyi``).
PATCH_U32LE = 0
PATCH_HEX8 = 1


@dataclass
class WritePlan:
    """The complete byte layout of one file, ready for ``Handle.write``.

    ``extents`` cover ``[0, file_size)`` without gaps, sorted by offset; each is
    ``(file_offset, ptr, length, crc_slot)``. ``patches`` are
    ``(file_offset, crc_slot, kind)``. ``keepalive`` owns every buffer that a
    ``ptr`` points into (tensors, staging copies, the metadata blob) and must
    live until the write has finished.
    """

    extents: list[tuple[int, int, int, int]]
    patches: list[tuple[int, int, int]]
    nslots: int
    file_size: int
    keepalive: list[Any] = field(default_factory=list)
    #: Human-readable name of each crc slot (record or tensor name), for messages.
    slot_names: list[str] = field(default_factory=list)


def patch_bytes(kind: int, crc: int) -> bytes:
    """The bytes a CRC field of ``kind`` holds for ``crc``."""
    if kind == PATCH_U32LE:
        return struct.pack("<I", crc)
    if kind == PATCH_HEX8:
        return f"{crc:08x}".encode("ascii")
    raise ValueError(f"unknown patch kind {kind}")
