"""Cutting one file's :class:`~fastpersist.formats.base.WritePlan` among several writers.

Used by :mod:`fastpersist.collectivesave` for replicated state: every rank plans the
same file, takes one contiguous slice of its byte range and writes only that slice
into the shared temporary file. Nothing here communicates; the functions are pure
and take the exchanged values as arguments.

* :func:`slice_bounds` cuts ``[0, file_size)`` into ``n`` contiguous slices whose
  boundaries are multiples of the alignment (a writer never shares an O_DIRECT
  block with another; only the last slice may end unaligned).
* :func:`clip` restricts a plan's extents to one slice.
* :func:`partial_crcs` computes, for every CRC slot, the CRC-32 of the part of its
  bytes inside one slice (from memory, on the native handle's threads) with the
  part's length; :func:`combine_crcs` joins the parts of every rank, in file
  order, with zlib's ``crc32_combine`` arithmetic.
* :func:`patch_blocks` names the aligned blocks of a slice that hold CRC fields: a
  writer writes its slice while the CRCs are being computed and exchanged, then
  writes only those blocks again with the fields filled.
* :func:`apply_patches` turns the plan's CRC patches (zip data descriptors and
  central directory, safetensors ``__metadata__`` CRCs), now that every CRC is
  known, into small extents spliced into the slice, so each writer writes its
  slice once, patch-free, with aligned O_DIRECT writes.
* :func:`plan_digest` / :func:`plan_records` describe a plan (sizes, offsets, CRC
  slot names, a hash of every non-payload byte: zip headers, pickle, central
  directory, safetensors header) so ranks can check they planned the same file,
  and name the first record that differs when they did not.
"""

from __future__ import annotations

import bisect
import ctypes
import hashlib
import struct
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from fastpersist import _native
from fastpersist.formats.zipindex import read_central_directory
from fastpersist.plan import PATCH_U32LE, WritePlan, patch_bytes

Extent = tuple[int, int, int, int]


@dataclass
class Layout:
    """A plan and how to read it: which extents are payload (tensor bytes, never hashed)."""

    plan: WritePlan
    format: str  #: "torch" or "safetensors"

    def is_payload(self, index: int, extent: Extent) -> bool:
        if self.format == "safetensors":
            return index > 0  # extent 0 is the header; every other one a tensor
        return extent[3] >= 0


def slice_bounds(file_size: int, n: int, alignment: int) -> list[tuple[int, int]]:
    """``n`` contiguous slices ``(lo, hi)`` covering ``[0, file_size)``; every inner
    boundary is a multiple of ``alignment`` (slices may be empty for small files)."""
    if n < 1:
        raise ValueError(f"need at least one slice, not {n}")
    cuts = [0]
    for i in range(1, n):
        cut = (file_size * i // n) // alignment * alignment
        cuts.append(max(cuts[-1], min(cut, file_size)))
    cuts.append(file_size)
    return [(cuts[i], cuts[i + 1]) for i in range(n)]


def clip(extents: Sequence[Extent], lo: int, hi: int) -> list[Extent]:
    """The parts of ``extents`` (sorted, contiguous) inside ``[lo, hi)``."""
    if lo >= hi:
        return []
    starts = [e[0] for e in extents]
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    out: list[Extent] = []
    for off, ptr, length, slot in extents[i:]:
        if off >= hi:
            break
        a, b = max(off, lo), min(off + length, hi)
        if a < b:
            out.append((a, ptr + (a - off), b - a, slot))
    return out


def partial_crcs(handle: Any, extents: Sequence[Extent]) -> dict[int, tuple[int, int]]:
    """``{slot: (crc, length)}``: the CRC-32 of each slot's bytes within ``extents``
    (a clipped slice) and their length; slots with no bytes there are absent.
    Computed on ``handle``'s threads, or on the calling thread (GIL released) when
    ``handle`` is None (while the handle's threads write)."""
    ranges = [(ptr, length) for _off, ptr, length, slot in extents if slot >= 0 and length > 0]
    if not ranges:
        crcs: list[int] = []
    elif handle is None:
        crcs = _native.crc32_many(ranges)
    else:
        crcs = handle.crc32_ranges(ranges)
    out: dict[int, tuple[int, int]] = {}
    k = 0
    for _off, _ptr, length, slot in extents:
        if slot < 0 or length == 0:
            continue
        if slot in out:
            crc, have = out[slot]
            out[slot] = (_native.crc32_combine(crc, crcs[k], length), have + length)
        else:
            out[slot] = (crcs[k], length)
        k += 1
    return out


def combine_crcs(parts: Sequence[dict[int, tuple[int, int]]], nslots: int) -> list[int]:
    """Whole-slot CRC-32s from every writer's :func:`partial_crcs`, ``parts`` in file (slice) order."""
    out = [0] * nslots
    for part in parts:
        for slot, (crc, length) in part.items():
            out[slot] = _native.crc32_combine(out[slot], crc, length)
    return out


def apply_patches(
    extents: Sequence[Extent], patches: Sequence[tuple[int, int, int]], crcs: Sequence[int], lo: int, hi: int
) -> tuple[list[Extent], Any]:
    """``extents`` (clipped to ``[lo, hi)``) with every patch field inside the slice
    replaced by its CRC's bytes, and the buffer those bytes live in (keep it alive
    until the write returns). A field cut by a slice boundary is written in part by
    each of the two writers. Slots are dropped: the result needs no CRC work."""
    fields = []
    for off, slot, kind in patches:
        data = patch_bytes(kind, crcs[slot])
        a, b = max(off, lo), min(off + len(data), hi)
        if a < b:
            fields.append((a, data[a - off : b - off]))
    fields.sort()
    blob = bytearray(b"".join(d for _a, d in fields) or b"\0")
    base = torch.frombuffer(blob, dtype=torch.uint8)
    bptr = base.data_ptr()
    out: list[Extent] = []
    k = 0  # next field
    pos = 0  # its offset in blob
    for off, ptr, length, _slot in extents:
        cur, end = off, off + length
        while cur < end:
            while k < len(fields) and fields[k][0] + len(fields[k][1]) <= cur:
                pos += len(fields[k][1])
                k += 1
            if k < len(fields) and fields[k][0] <= cur:
                fstart, data = fields[k]
                take = min(end, fstart + len(data)) - cur
                out.append((cur, bptr + pos + (cur - fstart), take, -1))
            else:
                nxt = fields[k][0] if k < len(fields) else end
                take = min(end, nxt) - cur
                out.append((cur, ptr + (cur - off), take, -1))
            cur += take
    return out, (blob, base)


def patch_blocks(patches: Sequence[tuple[int, int, int]], lo: int, hi: int, block: int) -> list[tuple[int, int]]:
    """The ``block``-aligned ranges of ``[lo, hi)`` (clipped to it, merged, sorted) that
    hold a byte of some CRC field: what a writer must write again once every CRC is
    known. The rest of its slice is final when first written."""
    spans: list[tuple[int, int]] = []
    for off, _slot, kind in sorted(patches):
        end = off + (4 if kind == PATCH_U32LE else 8)
        a, b = max(off - off % block, lo), min(-(-end // block) * block, hi)
        if a >= b:
            continue
        if spans and a <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], b))
        else:
            spans.append((a, b))
    return spans


# --------------------------------------------------------------------------- digests


def _host_extents(layout: Layout) -> list[Extent]:
    return [e for i, e in enumerate(layout.plan.extents) if not layout.is_payload(i, e)]


def plan_digest(layout: Layout) -> str:
    """A hash of everything the plan says except payload bytes: sizes, offsets, slots,
    slot names, patches and every non-payload byte (headers, pickle, directory)."""
    plan = layout.plan
    h = hashlib.blake2b(digest_size=20)
    h.update(f"{layout.format}|{plan.file_size}|{plan.nslots}|{len(plan.extents)}".encode())
    h.update("\0".join(plan.slot_names).encode("utf-8", "surrogatepass"))
    h.update(repr(sorted(plan.patches)).encode())
    for i, (off, ptr, length, slot) in enumerate(plan.extents):
        h.update(struct.pack("<qqq", off, length, slot))
        if not layout.is_payload(i, (off, ptr, length, slot)) and length:
            h.update(ctypes.string_at(ptr, length))
    return h.hexdigest()


def _read_host(layout: Layout) -> Callable[[int, int], bytes]:
    """``read_at(offset, length)`` over the plan's non-payload bytes (payload holes read as zeros)."""
    host = _host_extents(layout)

    def read_at(offset: int, length: int) -> bytes:
        out = bytearray(length)
        for off, ptr, n, _slot in clip(host, offset, offset + length) if host else []:
            out[off - offset : off - offset + n] = ctypes.string_at(ptr, n)
        return bytes(out)

    return read_at


def plan_records(layout: Layout) -> list[tuple[str, int, int, str]]:
    """The plan as named records ``(name, start, length, hash of its non-payload bytes)``
    in file order: zip records and the central directory for torch files, the
    header and each tensor for safetensors."""
    plan = layout.plan
    bounds: list[tuple[int, str]] = []
    if layout.format == "torch":
        try:
            cd_off, entries = read_central_directory(_read_host(layout), plan.file_size, "<plan>")
            bounds = sorted((e.header_offset, e.name) for e in entries)
            bounds.append((cd_off, "zip central directory"))
        except Exception:  # noqa: BLE001 - fall back to anonymous ranges below
            bounds = []
    else:
        bounds = [(0, "safetensors header")]
        names = iter(plan.slot_names)
        for i, e in enumerate(plan.extents):
            if i > 0:
                slot_name = next(names, None) if e[3] >= 0 else None
                bounds.append((e[0], f"tensor {slot_name!r}" if slot_name else f"tensor at offset {e[0]}"))
    if not bounds or bounds[0][0] != 0:
        bounds.insert(0, (0, "file start"))
    host = _host_extents(layout)
    out = []
    for k, (start, name) in enumerate(bounds):
        end = bounds[k + 1][0] if k + 1 < len(bounds) else plan.file_size
        h = hashlib.blake2b(digest_size=12)
        for off, ptr, n, _slot in clip(host, start, end):
            h.update(struct.pack("<qq", off, n))
            h.update(ctypes.string_at(ptr, n))
        out.append((name, start, end - start, h.hexdigest()))
    return out


def first_difference(records: Sequence[Sequence[tuple[str, int, int, str]]]) -> Optional[str]:
    """Describe the first record (in file order) on which the ranks' :func:`plan_records` differ."""
    n = max(len(r) for r in records)
    for k in range(n):
        got = [r[k] if k < len(r) else None for r in records]
        if all(g == got[0] for g in got):
            continue
        ref = got[0]
        for rank, g in enumerate(got):
            if g == ref:
                continue
            if ref is None or g is None:
                have = ref if g is None else g
                return (f"record {have[0]!r}: present on rank {0 if g is None else rank} only "
                        f"(rank 0 has {len(records[0])} records, rank {rank} has {len(records[rank])})")
            what = []
            if g[0] != ref[0]:
                what.append(f"name {ref[0]!r} on rank 0, {g[0]!r} on rank {rank}")
            if g[1] != ref[1]:
                what.append(f"offset {ref[1]} on rank 0, {g[1]} on rank {rank}")
            if g[2] != ref[2]:
                what.append(f"{ref[2]} bytes on rank 0, {g[2]} on rank {rank}")
            if g[3] != ref[3] and not what:
                what.append(f"same size, different bytes (headers or pickled values) on ranks 0 and {rank}")
            return f"record {ref[0]!r}: " + "; ".join(what)
    return None
