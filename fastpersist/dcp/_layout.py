"""Byte layout of one ``.distcp`` file: DCP's stock payload encoding at aligned offsets.

DCP's ``FileSystemWriter`` (``serialization_format=TORCH_SAVE``, the default)
writes each item of a rank's plan back to back into a ``.distcp`` file and
records ``(relative_path, offset, length)`` for it in ``.metadata``:

* a bytes item (``WriteItemType.BYTE_IO``): the raw bytes of its ``BytesIO``;
* a tensor item: ``torch.save(tensor)`` of the (CPU, minimal-storage) tensor: a
  complete torch zip file, which the reader ``torch.load``s from that slice.

This module lays out the same items in the same encoding, with two changes that
the stock reader cannot see: items may be separated by zero padding (the
recorded offsets skip it), and each tensor item's zip starts where its storage
bytes land on a multiple of the O_DIRECT alignment (the zip's own records keep
torch's default 64-byte alignment, so the zip is byte for byte what ``torch.save``
writes, minus the random serialization id). Each item gets a CRC-32 of its
exact byte range ``[offset, offset + length)``, which the writer records in
``.metadata`` (see :mod:`fastpersist.dcp`).

The zip of a tensor is planned once per distinct (dtype, shape, strides, ...) by
:func:`fastpersist.formats.torchzip.plan_torch` and reused as a template: the
header and trailer bytes are shared, the payload is the tensor's own memory
(never copied on the host), and the two CRC fields of the zip are native patches.
"""

from __future__ import annotations

import ctypes
import io
import logging
import struct
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from fastpersist import _native
from fastpersist.errors import UnsupportedLayoutError
from fastpersist.formats.base import PATCH_U32LE
from fastpersist.formats.torchzip import plan_torch

log = logging.getLogger(__name__)

#: torch's default ``save.storage_alignment``: the zip records of a tensor item
#: are aligned like ``torch.save``'s, so the item is what stock DCP writes.
ZIP_ALIGNMENT = 64
_TEMPLATES_MAX = 4096


@dataclass(frozen=True)
class _Template:
    """The bytes of ``torch.save(t)`` for tensors like ``t``, split around the payload."""

    head: bytes  # [0, payload offset)
    tail: bytes  # after the payload, to the end of the zip
    nbytes: int  # payload length
    tail_patches: tuple[int, ...]  # offsets in ``tail`` of the payload's CRC fields (u32 LE)

    @property
    def size(self) -> int:
        return len(self.head) + self.nbytes + len(self.tail)


_templates: "OrderedDict[tuple, _Template]" = OrderedDict()
_templates_lock = threading.Lock()


def _template_key(t: torch.Tensor) -> Optional[tuple]:
    """What ``torch.save``'s bytes (other than the payload) depend on; None: do not cache."""
    if type(t) is not torch.Tensor or t.layout != torch.strided or t.is_quantized:
        return None
    if getattr(t, "__dict__", None) or t.requires_grad or t.is_conj() or t.is_neg():
        return None
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.untyped_storage().nbytes())


def _plan_template(t: torch.Tensor) -> _Template:
    plan = plan_torch(t, ZIP_ALIGNMENT)
    if plan.nslots > 1:
        raise UnsupportedLayoutError(f"a tensor planned as {plan.nslots} storages")
    image = bytearray()
    payload: Optional[tuple[int, int]] = None
    for off, ptr, n, slot in plan.extents:
        if off != len(image) + (payload[1] if payload else 0):
            raise UnsupportedLayoutError("torch zip plan with a gap")
        if slot >= 0:
            payload = (off, n)
        else:
            image += ctypes.string_at(ptr, n) if n else b""
    if payload is None:  # empty storage: the whole zip is host bytes
        return _Template(bytes(image), b"", 0, ())
    poff, n = payload
    tail_patches = tuple(p[0] - poff - n for p in plan.patches)
    if any(p[2] != PATCH_U32LE or p[0] < poff + n for p in plan.patches):
        raise UnsupportedLayoutError("torch zip plan with an unexpected CRC patch")
    return _Template(bytes(image[:poff]), bytes(image[poff:]), n, tail_patches)


def template_for(t: torch.Tensor) -> Optional[_Template]:
    """The zip template for ``t`` (cached), or None when ``t`` must go through ``torch.save``."""
    key = _template_key(t)
    if key is None:
        return None
    with _templates_lock:
        tpl = _templates.get(key)
        if tpl is not None:
            _templates.move_to_end(key)
            return tpl
    try:
        tpl = _plan_template(t)
    except UnsupportedLayoutError as e:
        log.debug("dcp: tensor %s %s saved through torch.save (%s)", t.dtype, tuple(t.shape), e)
        return None
    with _templates_lock:
        _templates[key] = tpl
        while len(_templates) > _TEMPLATES_MAX:
            _templates.popitem(last=False)
    return tpl


def stock_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor stock DCP serializes for a resolved write item (its ``_SerialCpuLoader``):
    detached, on the CPU, with a storage of exactly its own bytes."""
    t = t.detach()
    t = t.cpu()
    if t.untyped_storage().size() != t.nbytes:
        t = t.clone()
    return t


@dataclass
class Item:
    """One item placed in a file: ``[offset, offset + length)``."""

    index: Any  # DCP MetadataIndex
    offset: int
    length: int
    # pieces in file order: ("host", bytes) or ("payload", ptr, nbytes)
    pieces: list[tuple] = field(default_factory=list)
    tail_patches: tuple[int, ...] = ()  # offsets (absolute in file) of the payload-CRC fields


@dataclass
class FileLayout:
    """Everything ``Handle.write`` needs for one ``.distcp`` file, and the items in it."""

    extents: list[tuple[int, int, int, int]]
    patches: list[tuple[int, int, int]]
    nslots: int
    size: int
    items: list[Item]
    slot_of: list[int]  # per item: its payload crc slot, -1 when none
    keepalive: list[Any]


def _align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def plan_file(entries: list[tuple[Any, Any]], alignment: int) -> FileLayout:
    """Lay out ``entries`` (``(MetadataIndex, io.BytesIO | CPU tensor)``, in write order).

    Bytes items start at multiples of ``alignment``; a tensor item starts where
    its storage bytes fall on a multiple of ``alignment``. Gaps are zeros.
    """
    zeros = bytes(alignment)
    keepalive: list[Any] = [zeros]
    zptr = ctypes.cast(ctypes.c_char_p(zeros), ctypes.c_void_p).value or 0
    extents: list[tuple[int, int, int, int]] = []
    patches: list[tuple[int, int, int]] = []
    items: list[Item] = []
    slot_of: list[int] = []
    pos = 0
    nslots = 0

    def host(data: bytes, at: int) -> None:
        if not data:
            return
        keepalive.append(data)
        ptr = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
        extents.append((at, ptr, len(data), -1))

    def pad_to(target: int) -> None:
        nonlocal pos
        while pos < target:
            n = min(target - pos, alignment)
            extents.append((pos, zptr, n, -1))
            pos += n

    for index, data in entries:
        if isinstance(data, io.BytesIO):
            raw = bytes(data.getbuffer())
            pad_to(_align_up(pos, alignment))
            item = Item(index, pos, len(raw), [("host", raw)])
            host(raw, pos)
            pos += len(raw)
            items.append(item)
            slot_of.append(-1)
            continue
        t: torch.Tensor = data
        tpl = template_for(t)
        if tpl is None:  # torch.save's own bytes for this one (copied)
            buf = io.BytesIO()
            torch.save(t, buf)
            raw = buf.getvalue()
            pad_to(_align_up(pos, alignment))
            item = Item(index, pos, len(raw), [("host", raw)])
            host(raw, pos)
            pos += len(raw)
            items.append(item)
            slot_of.append(-1)
            continue
        head = len(tpl.head)
        start = _align_up(pos + head, alignment) - head if tpl.nbytes else pos
        pad_to(start)
        item = Item(index, start, tpl.size)
        host(tpl.head, start)
        item.pieces.append(("host", tpl.head))
        slot = -1
        if tpl.nbytes:
            slot = nslots
            nslots += 1
            keepalive.append(t)
            extents.append((start + head, t.data_ptr(), tpl.nbytes, slot))
            item.pieces.append(("payload", t.data_ptr(), tpl.nbytes))
            tail_at = start + head + tpl.nbytes
            item.tail_patches = tuple(tail_at + p for p in tpl.tail_patches)
            for p in item.tail_patches:
                patches.append((p, slot, PATCH_U32LE))
        host(tpl.tail, start + head + tpl.nbytes)
        item.pieces.append(("host", tpl.tail))
        pos = start + tpl.size
        items.append(item)
        slot_of.append(slot)
    return FileLayout(extents, patches, nslots, pos, items, slot_of, keepalive)


def item_crcs(layout: FileLayout, slot_crcs: list[int]) -> list[int]:
    """CRC-32 of each item's byte range, from the payload CRCs the native write returned
    (the header and trailer bytes are checksummed here, with the payload CRC patched in)."""
    out = []
    for item, slot in zip(layout.items, layout.slot_of):
        crc = 0
        pos = item.offset
        for piece in item.pieces:
            if piece[0] == "payload":
                crc = _combine(crc, slot_crcs[slot], piece[2])
                pos += piece[2]
                continue
            data = piece[1]
            if item.tail_patches and pos > item.offset:  # the trailer: patch the payload CRC in
                ba = bytearray(data)
                for p in item.tail_patches:
                    struct.pack_into("<L", ba, p - pos, slot_crcs[slot])
                data = bytes(ba)
            crc = zlib.crc32(data, crc)
            pos += len(data)
        out.append(crc & 0xFFFFFFFF)
    return out


def _combine(crc1: int, crc2: int, len2: int) -> int:
    return _native.crc32_combine(crc1, crc2, len2)
