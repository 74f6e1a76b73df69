"""The piecewise reads' arenas (fastpersist.formats.torchindex, ``CheckpointFile.read_records``,
behind ``fastpersist.open(...).get/get_many`` and ``fastpersist.load_state_dict`` of tensors
read fresh): records below ``torchload.OWN_BUFFER_MIN`` share arenas of at most
``torchload.ARENA_MAX`` bytes each, in file order, each record at a position congruent to its
file offset modulo 64 and a storage of its own. Round trips of checkpoints with many small
records (more than one arena) are bit-exact against ``torch.load``; damage in the second
arena and truncation raise the errors the rest of the loader raises, naming the path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file as st_save_file

import fastpersist
from fastpersist import handles
from fastpersist.config import get_default
from fastpersist.errors import CheckpointFormatError, ChecksumError
from fastpersist.formats import torchload
from fastpersist.formats.torchindex import open_checkpoint, pack_arenas
from subprocs import flip_byte, tensors_by_name  # tests/ is on sys.path

PARAMS = 300  # Adam keeps two state tensors per parameter: 600 records of about 16 KiB, ~9.6 MB


def sizes() -> list[int]:
    """Elements of each parameter: 16 KiB or a little more (not all multiples of 64 bytes),
    and one of 2 MiB (records with buffers of their own)."""
    return [4096 + (i % 5) * 3 for i in range(PARAMS)] + [1 << 19]


def fresh_optimizer() -> torch.optim.Adam:
    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(n)) for n in sizes()], lr=0.5)


def optimizer_state() -> dict:
    """An Adam state dict: 600 records of 16 KiB or a little more, a 4-byte step record
    per parameter between them, and one 2 MiB pair."""
    g = torch.Generator().manual_seed(7)
    state = {i: {"step": torch.tensor(float(i)), "exp_avg": torch.randn(n, generator=g),
                 "exp_avg_sq": torch.rand(n, generator=g)} for i, n in enumerate(sizes())}
    return {"state": state, "param_groups": fresh_optimizer().state_dict()["param_groups"]}


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (b.dtype, b.shape, b.stride(), b.storage_offset())
    assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes()
    assert torch.equal(storage_bytes(a), storage_bytes(b))


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("arenas")
    sd = optimizer_state()
    out = {"torch": d / "torch.pt", "fastpersist": d / "fp.pt", "safetensors": d / "c.safetensors"}
    torch.save(sd, out["torch"])
    fastpersist.save(sd, out["fastpersist"])
    st_save_file({k: v.clone() for k, v in tensors_by_name(sd).items()}, out["safetensors"])
    return out


def reference(p: Path) -> dict:
    loaded = st_load_file(p) if p.suffix == ".safetensors" else torch.load(p, weights_only=True)
    return tensors_by_name(loaded)


@pytest.mark.parametrize("writer", ["torch", "fastpersist", "safetensors"])
def test_get_many_round_trip_and_arenas(files: dict[str, Path], writer: str) -> None:
    p = files[writer]
    want = reference(p)
    with fastpersist.open(p) as r:
        got = r.get_many(r.keys())
    assert sorted(got) == sorted(want)
    for k in want:
        same(got[k], want[k])

    f = open_checkpoint(str(p))
    try:
        names = sorted(f.records, key=lambda n: f.records[n].offset)
        records = f.read_records(names, handles.handle_for(get_default(), read=True))
        arenas = f.last_arenas
        assert len(arenas) >= 3 and all(0 < size <= torchload.ARENA_MAX for _ptr, size in arenas)
        data = p.read_bytes()
        last = (-1, -1)
        for n in names:
            rec, t = f.records[n], records[n]
            assert t.untyped_storage().nbytes() == rec.size  # a storage of its own
            assert t.untyped_storage().data_ptr() == t.data_ptr()
            assert bytes(t.numpy()) == data[rec.offset : rec.offset + rec.size]
            inside = [i for i, (ptr, size) in enumerate(arenas) if ptr <= t.data_ptr() < ptr + size]
            if rec.size >= torchload.OWN_BUFFER_MIN:
                assert inside == []
                continue
            assert len(inside) == 1 and t.data_ptr() + rec.size <= arenas[inside[0]][0] + arenas[inside[0]][1]
            assert t.data_ptr() % 64 == rec.offset % 64  # the arenas are page-aligned
            here = (inside[0], t.data_ptr())
            assert here > last  # file order: arena by arena, upwards in each
            last = here
    finally:
        os.close(f.fd)


@pytest.mark.parametrize("writer", ["torch", "fastpersist"])
def test_load_state_dict_into_a_fresh_optimizer(files: dict[str, Path], writer: str) -> None:
    p = files[writer]
    opt = fresh_optimizer()  # no state yet: every state tensor is read fresh, through the arenas
    fastpersist.load_state_dict(opt, p)
    want = torch.load(p, weights_only=True)
    got = opt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    fg, fw = tensors_by_name(got["state"]), tensors_by_name(want["state"])
    assert sorted(fg) == sorted(fw)
    for k in fw:
        assert fg[k].dtype == fw[k].dtype and torch.equal(fg[k], fw[k])


def _second_arena_record(p: Path):
    """Name, offset and size of a record in the middle of the second arena of a read of every record."""
    f = open_checkpoint(str(p))
    try:
        small = sorted((r for r in f.records.values() if 0 < r.size < torchload.OWN_BUFFER_MIN),
                       key=lambda r: r.offset)
        placed = pack_arenas(small)[1][1]
        r = placed[len(placed) // 2][0]
        return r.name, r.offset, r.size
    finally:
        os.close(f.fd)


def _get_all(p: Path) -> None:
    with fastpersist.open(p) as r:
        r.get_many(r.keys())


@pytest.mark.parametrize("call", ["open.get_many", "load_state_dict"])
def test_a_flipped_byte_in_the_second_arena_is_refused(files: dict[str, Path], tmp_path: Path, call: str) -> None:
    p = tmp_path / "c.pt"
    p.write_bytes(files["torch"].read_bytes())
    name, offset, size = _second_arena_record(p)
    flip_byte(p, offset + size // 2, 0x10)
    with pytest.raises(ChecksumError, match=str(p)) as e:
        if call == "open.get_many":
            _get_all(p)
        else:
            fastpersist.load_state_dict(fresh_optimizer(), p)
    assert name in str(e.value) and "CRC-32 mismatch" in str(e.value)


def test_a_truncated_file_is_refused(files: dict[str, Path], tmp_path: Path) -> None:
    p = tmp_path / "c.pt"
    data = files["torch"].read_bytes()
    p.write_bytes(data)
    _name, offset, _size = _second_arena_record(p)
    with fastpersist.open(p) as r:  # the index is read; then the file loses its tail
        os.truncate(p, offset)
        with pytest.raises(CheckpointFormatError, match=f"{p}.*shorter than its index says"):
            r.get_many(r.keys())
    for call in (_get_all, lambda q: fastpersist.load_state_dict(fresh_optimizer(), q)):  # cut before the open
        with pytest.raises(CheckpointFormatError, match=str(p)):
            call(p)
