"""The cutting of a planned file into S3 parts (no server): every byte lands in its part,
CRC fields are filled with the CRC-32 of their slot's bytes, also when a field straddles
two parts or comes before its payload (a safetensors header), and parts holding such a
field wait until the payload was copied."""

from __future__ import annotations

import zlib

import pytest
import torch

from fastpersist import handles
from fastpersist import config as fpconfig
from fastpersist.plan import PATCH_HEX8, PATCH_U32LE, WritePlan
from fastpersist.s3upload import MiB, PartStager, part_size, stage_all


def _plan(chunks: list[tuple[bytes, int]], patches: list[tuple[int, int, int]], nslots: int) -> WritePlan:
    extents, keep, off = [], [], 0
    for data, slot in chunks:
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        keep.append(t)
        extents.append((off, t.data_ptr(), len(data), slot))
        off += len(data)
    return WritePlan(extents, patches, nslots, off, keepalive=keep)


def _expected(chunks: list[tuple[bytes, int]], patches: list[tuple[int, int, int]]) -> bytes:
    out = bytearray(b"".join(d for d, _s in chunks))
    crcs: dict[int, int] = {}
    for data, slot in chunks:
        if slot >= 0:
            crcs[slot] = zlib.crc32(data, crcs.get(slot, 0))
    for off, slot, kind in patches:
        field = crcs.get(slot, 0).to_bytes(4, "little") if kind == PATCH_U32LE else f"{crcs.get(slot, 0):08x}".encode()
        out[off:off + len(field)] = field
    return bytes(out)


@pytest.mark.parametrize("boundary_shift", [0, 3, 7])
def test_fields_before_their_payload_and_across_a_part_boundary(boundary_shift: int) -> None:
    psize = part_size(0, 5 * MiB)
    g = torch.Generator().manual_seed(boundary_shift)

    def rnd(n: int) -> bytes:
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()

    head = rnd(psize - boundary_shift) + b"\0" * 16  # a hex field at psize - shift straddles parts 1 and 2
    chunks = [(head, -1), (rnd(3 * MiB), 0), (rnd(4 * MiB + 11), 1), (rnd(2 * MiB), 0), (rnd(100), -1)]
    size = sum(len(d) for d, _ in chunks)
    patches = [(psize - boundary_shift, 0, PATCH_HEX8), (size - 50, 1, PATCH_U32LE), (10, 1, PATCH_U32LE)]
    plan = _plan(chunks, patches, 2)
    handle = handles.handle_for(fpconfig.get_default())
    stager = PartStager(plan, psize, handle)
    assert stager.nparts == -(-size // psize)
    staged = [stager.stage(0)]
    assert not stager.ready(staged[0])  # slot 0's payload continues in later parts
    for i in range(1, stager.nparts):
        staged.append(stager.stage(i))
    assert all(stager.ready(p) for p in staged)
    for p in staged:
        stager.fill_crcs(p)
    assert [p.number for p in staged] == list(range(1, stager.nparts + 1))
    assert all(len(p.data) == psize for p in staged[:-1]) and 0 < len(staged[-1].data) <= psize
    assert b"".join(bytes(p.data) for p in staged) == _expected(chunks, patches)
    again = stage_all(_plan(chunks, patches, 2), handle, 5 * MiB)
    assert b"".join(bytes(p.data) for p in again) == _expected(chunks, patches)


def test_a_plan_with_a_gap_is_refused() -> None:
    a = torch.zeros(10, dtype=torch.uint8)
    plan = WritePlan([(0, a.data_ptr(), 5, -1), (7, a.data_ptr(), 3, -1)], [], 0, 10, keepalive=[a])
    with pytest.raises(ValueError, match="gap"):
        PartStager(plan, 5 * MiB, handles.handle_for(fpconfig.get_default())).stage(0)
