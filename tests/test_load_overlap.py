"""Loads whose unpickling overlaps the bulk read (torchload._overlap_allowed decides)."""

from __future__ import annotations

import errno
import pickle

import pytest
import torch

import fastpersist
from fastpersist import _native
from fastpersist.errors import ChecksumError
from fastpersist.formats import torchload
from fastpersist.formats.zipindex import read_zip_index
from test_load_safety import ReadsTensorInSetstate, ReducesWithTensorSum


@pytest.fixture
def spy(monkeypatch):
    """Counts loads ("tried") and how many unpickled while reading ("used")."""
    seen = {"tried": 0, "used": 0}
    real = torchload._overlap_allowed

    def wrapped(*args, **kwargs):
        seen["tried"] += 1
        out = real(*args, **kwargs)
        seen["used"] += bool(out)
        return out

    monkeypatch.setattr(torchload, "_overlap_allowed", wrapped)
    # Weights-only CPU loads take torchload._load_fast: its read starts before the pickle
    # is looked at, and the fast unpickler runs while it goes on (overlapped) unless it
    # gives up (NotFast), when the read is finished before torch's unpickler runs.
    real_fast = torchload.fastunpickle.unpickle

    def fast(*args, **kwargs):
        seen["tried"] += 1
        out = real_fast(*args, **kwargs)
        seen["used"] += 1
        return out

    monkeypatch.setattr(torchload.fastunpickle, "unpickle", fast)
    return seen


def state() -> dict:
    g = torch.Generator().manual_seed(1)
    s = {f"w{i}": torch.randn(1000 * (i + 1), generator=g) for i in range(30)}
    s["half"] = torch.randn(300, generator=g).to(torch.bfloat16)
    s["view"] = s["w3"][10:20]
    s["empty"] = torch.empty(0)
    s["step"] = 12
    return s



def test_our_files_load_overlapped(tmp_path, spy, assert_same):
    s = state()
    fastpersist.save(s, tmp_path / "c.pt")
    out = fastpersist.load(tmp_path / "c.pt")
    assert spy == {"tried": 1, "used": 1}
    assert_same(out, s)
    assert out["view"].untyped_storage().data_ptr() == out["w3"].untyped_storage().data_ptr()


def test_torch_save_layout_loads_overlapped_too(tmp_path, spy, assert_same):
    s = state()
    torch.save(s, tmp_path / "t.pt")  # data.pkl first: read on its own, then the payloads
    assert_same(fastpersist.load(tmp_path / "t.pt"), s)
    assert spy == {"tried": 1, "used": 1}


def test_sparse_tensors_wait_for_their_bytes(tmp_path, spy):
    s = {"sp": torch.eye(4).to_sparse(), "d": torch.arange(5.0)}
    fastpersist.save(s, tmp_path / "s.pt")
    out = fastpersist.load(tmp_path / "s.pt", weights_only=False)
    assert spy["used"] == 0  # the sparse rebuild validates indices while unpickling
    assert torch.equal(out["sp"].to_dense(), torch.eye(4)) and torch.equal(out["d"], s["d"])


@pytest.mark.parametrize("where", ["cpu", torch.device("cpu"), None])
def test_cpu_map_locations_overlap(tmp_path, spy, where, assert_same):
    s = state()
    fastpersist.save(s, tmp_path / "c.pt")
    assert_same(fastpersist.load(tmp_path / "c.pt", map_location=where), s)
    assert spy["used"] == 1


def test_other_map_locations_load_sequentially(tmp_path, spy, assert_same):
    s = state()
    fastpersist.save(s, tmp_path / "c.pt")
    out = fastpersist.load(tmp_path / "c.pt", map_location=lambda storage, loc: storage)
    assert spy["used"] == 0
    assert_same(out, s)


def flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_corrupt_payload_detected_while_overlapped(tmp_path, spy):
    p = tmp_path / "c.pt"
    fastpersist.save(state(), p)
    entry = read_zip_index(p).find("data/5")
    flip(p, entry.data_offset + 7)
    with pytest.raises(ChecksumError) as info:
        fastpersist.load(p)
    assert spy["tried"] == 1 and entry.name in info.value.records


def test_corrupt_pickle_detected(tmp_path):
    p = tmp_path / "c.pt"
    fastpersist.save(state(), p)
    entry = read_zip_index(p).find("data.pkl")
    flip(p, entry.data_offset + entry.compressed_size // 2)
    with pytest.raises(ChecksumError):
        fastpersist.load(p)


@pytest.mark.parametrize("action,err", [("EIO", errno.EIO), ("ENOSPC", errno.ENOSPC)])
def test_read_fault_while_unpickling(tmp_path, spy, action, err, assert_same):
    p = tmp_path / "c.pt"
    fastpersist.save(state(), p)
    _native.set_fault("read", 1, action)
    try:
        with pytest.raises(OSError) as info:
            fastpersist.load(p)
    finally:
        _native.clear_faults()
    assert info.value.errno == err and info.value.filename == str(p)
    assert spy["tried"] == 1
    assert_same(fastpersist.load(p), state())  # nothing broken: loads fine afterwards


class Custom:
    """A class the weights-only unpickler refuses."""


def test_unpickling_error_waits_for_the_read(tmp_path, spy):
    p = tmp_path / "c.pt"
    s = state()
    s["custom"] = Custom()
    fastpersist.save(s, p)
    with pytest.raises(pickle.UnpicklingError):
        fastpersist.load(p, weights_only=True)  # refused by torch's weights-only unpickler
    out = fastpersist.load(p, weights_only=False)
    assert isinstance(out["custom"], Custom)


@pytest.mark.parametrize("writer", ["fastpersist", "torch"])
def test_setstate_sees_the_real_bytes(tmp_path, spy, writer):
    t = torch.arange(1, 300_001, dtype=torch.float64)  # > 1 MiB: a buffer of its own
    small = torch.arange(1, 101, dtype=torch.float32)
    obj = {"big": ReadsTensorInSetstate(t), "small": ReadsTensorInSetstate(small), "r": ReducesWithTensorSum(t)}
    p = tmp_path / "c.pt"
    (fastpersist.save if writer == "fastpersist" else torch.save)(obj, p)
    want = torch.load(p, weights_only=False)
    got = fastpersist.load(p, weights_only=False)
    assert got["big"].total == want["big"].total == float(t.sum())
    assert got["small"].total == want["small"].total == float(small.sum())
    assert got["r"] == want["r"] == float(t.sum())
    assert spy["used"] == 0  # user globals in the pickle: read first


def test_big_endian_files_read_first(tmp_path, spy):
    """A byte swap reads storage bytes while unpickling: no overlap, torch's values."""
    import zipfile

    import numpy as np

    src, p = tmp_path / "le.pt", tmp_path / "be.pt"
    torch.save({"w": torch.arange(300_000, dtype=torch.int32)}, src)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(p, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("/byteorder"):
                data = b"big"
            elif "/data/" in info.filename and not info.filename.endswith("serialization_id"):
                data = np.frombuffer(data, dtype="<i4").astype(">i4").tobytes()
            zout.writestr(info.filename, data)
    want = torch.load(p)
    assert torch.equal(want["w"], torch.arange(300_000, dtype=torch.int32))
    out = fastpersist.load(p)
    assert torch.equal(out["w"], want["w"]) and spy["used"] == 0
