"""The bulk read's arenas (fastpersist.formats.torchload): the storage records below
``OWN_BUFFER_MIN`` share arenas of at most ``ARENA_MAX`` bytes each (buffers the native
allocator takes from malloc's heap, not a fresh mapping per load). Round trips on both
sides of that size are bit-exact against ``torch.load``; damage to a record or a local
header in any arena raises the same errors as before."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import fastpersist
from fastpersist import handles
from fastpersist.config import get_default
from fastpersist.errors import CheckpointFormatError, ChecksumError
from fastpersist.formats import torchload
from fastpersist.formats.zipindex import read_zip_index


def state(total: int, tensors: int = 8) -> dict:
    g = torch.Generator().manual_seed(total + tensors)
    per = max(total // tensors // 4, 1)
    out: dict = {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(tensors)}
    base = torch.arange(64, dtype=torch.int16)
    out["view_a"], out["view_b"] = base[2:10], base[::3]  # two views of one storage
    out["half"] = torch.randn(300, generator=g).to(torch.bfloat16)
    out["step"] = 3
    return out


def bit_equal(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            bit_equal(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (b.dtype, b.shape, b.stride(), b.storage_offset())
        assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes()
        assert torch.equal(_storage_bytes(a), _storage_bytes(b))
    else:
        assert a == b


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def arenas_of(path: Path) -> list[int]:
    """Sizes of the arenas a load of ``path`` plans."""
    fd = os.open(path, os.O_RDONLY)
    try:
        load = torchload.LoadState(str(path), fd, os.fstat(fd).st_size, True, False)
        load.index()
        load.plan_bulk(None)
        return [a.size for a in load.arenas]
    finally:
        os.close(fd)


# 2 MiB: one arena; 4 MiB of 512 KiB records: two; 6 MiB of 64 KiB records: several;
# 16 MiB: 2 MiB records with buffers of their own, their headers in one arena.
@pytest.mark.parametrize("total,tensors,n_arenas", [(2 << 20, 8, 1), (4 << 20, 8, 2), (6 << 20, 96, 2),
                                                    (16 << 20, 8, 1)])
@pytest.mark.parametrize("writer", ["fastpersist", "torch"])
def test_round_trip_on_both_sides_of_the_arena_size(tmp_path: Path, total: int, tensors: int, n_arenas: int,
                                                    writer: str) -> None:
    p = tmp_path / "c.pt"
    sd = state(total, tensors)
    (fastpersist.save if writer == "fastpersist" else torch.save)(sd, p)
    sizes = arenas_of(p)
    assert len(sizes) >= n_arenas and all(s <= torchload.ARENA_MAX for s in sizes)
    got = fastpersist.load(p)
    bit_equal(got, torch.load(p, weights_only=True))
    bit_equal(got, sd)
    assert got["view_a"].untyped_storage().data_ptr() == got["view_b"].untyped_storage().data_ptr()
    bit_equal(fastpersist.load(p, weights_only=False), torch.load(p, weights_only=False))


def test_the_arenas_hold_the_records_in_file_order(tmp_path: Path) -> None:
    p = tmp_path / "c.pt"
    fastpersist.save(state(4 << 20), p)
    fd = os.open(p, os.O_RDONLY)
    try:
        load = torchload.LoadState(str(p), fd, os.fstat(fd).st_size, True, False)
        load.index()
        extents, bulk = load.plan_bulk(None)
        assert [e[0] for e in extents] == sorted(e[0] for e in extents)
        assert len({id(r.arena) for r in bulk}) == len(load.arenas) >= 2
        for r in bulk:  # the data lands at its file offset modulo the page, as one whole-file buffer would have it
            assert (r.arena.buffer.ptr + r.buffer_offset) % 4096 == r.data_offset % 4096
        reader = handles.handle_for(get_default(), read=True)
        reader.read(fd, extents, len(bulk))
        load.check_bulk(bulk, [r.entry.crc32 for r in bulk])
    finally:
        os.close(fd)


def _second_arena_record(p: Path):
    """The zip entry of the first storage record in the second arena of a load of ``p``."""
    fd = os.open(p, os.O_RDONLY)
    try:
        load = torchload.LoadState(str(p), fd, os.fstat(fd).st_size, True, False)
        load.index()
        _extents, bulk = load.plan_bulk(None)
        r = next(r for r in bulk if r.arena is load.arenas[1])
        name = r.entry.name
    finally:
        os.close(fd)
    return next(e for e in read_zip_index(p).entries if e.name == name)


@pytest.mark.parametrize("damage, error", [
    ("a flipped payload byte", ChecksumError),
    ("a local header at odds with the index (the first byte of its name)", CheckpointFormatError),
])
def test_damage_in_the_second_arena_is_refused(tmp_path: Path, damage: str, error: type) -> None:
    p = tmp_path / "c.pt"
    fastpersist.save(state(4 << 20), p)
    e = _second_arena_record(p)
    data = bytearray(p.read_bytes())
    if damage.startswith("a flipped"):
        data[e.data_offset + e.compressed_size // 2] ^= 0x10
    else:
        data[e.header_offset + 30] ^= 0x01
    p.write_bytes(data)
    with pytest.raises(error, match=str(p)):
        fastpersist.load(p)


def test_a_truncated_small_file_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "c.pt"
    fastpersist.save(state(4 << 20), p)
    data = p.read_bytes()
    for n in (len(data) // 2, len(data) - 5000, len(data) - 1):
        p.write_bytes(data[:n])
        with pytest.raises((CheckpointFormatError, RuntimeError)):
            fastpersist.load(p)
