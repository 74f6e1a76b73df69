"""The streaming torch layout: storages written while torch pickles (fastpersist.formats.torchstream)."""

from __future__ import annotations

import errno
import os
import zipfile

import pytest
import torch

import fastpersist
from fastpersist import _native
from fastpersist.formats import torchzip


def many_tensors(n: int = 300, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 40_000, (n,), generator=g).tolist()
    state = {f"t{i}": torch.randn(s, generator=g) for i, s in enumerate(sizes)}
    state["view"] = state["t3"][5:50]  # shares t3's storage
    state["empty"] = torch.empty(0)
    state["meta"] = {"step": 7, "names": ["a", "b"]}
    return state



@pytest.mark.parametrize("batch_bytes", [1, 4096, 1 << 20, 0])
def test_stream_in_batches_round_trips(tmp_path, batch_bytes, assert_same):
    state = many_tensors()
    path = str(tmp_path / "s.pt")
    torchzip.stream_save_torch(state, path, _native.Handle(), 4096, fsync=True, batch_bytes=batch_bytes)
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None  # every CRC (descriptor and central directory) is right
    loaded = torch.load(path, weights_only=True)
    assert_same(loaded, state)
    assert loaded["view"].untyped_storage().data_ptr() == loaded["t3"].untyped_storage().data_ptr()
    # one batch or many: the same bytes
    ref = str(tmp_path / "ref.pt")
    torchzip.stream_save_torch(state, ref, _native.Handle(), 4096, fsync=False, batch_bytes=0)
    assert open(path, "rb").read() == open(ref, "rb").read()


def test_storages_come_first_in_key_order_and_calculated_offsets_hold(tmp_path, monkeypatch, assert_same):
    state = many_tensors(50)
    path = tmp_path / "s.pt"
    fastpersist.save(state, path)
    with zipfile.ZipFile(path) as zf:
        names = [n.split("/", 1)[1] for n in zf.namelist()]
    nstor = sum(n.startswith("data/") for n in names)
    assert names[:nstor] == [f"data/{i}" for i in range(nstor)]
    assert names[nstor] == "data.pkl"
    # torch's offset-calculating mmap loader assumes contiguous storage records in key order
    from torch.utils.serialization import config as tconfig

    monkeypatch.setenv("TORCH_SERIALIZATION_DEBUG", "1")  # torch asserts each calculated offset
    with tconfig.patch({"load.calculate_storage_offsets": True}):
        assert_same(torch.load(path, mmap=True, weights_only=True), state)


@pytest.mark.parametrize("nth", [1, 2, 5])
def test_fault_in_a_middle_batch_keeps_previous(tmp_path, monkeypatch, nth):
    monkeypatch.setattr(torchzip, "STREAM_BATCH", 64 << 10)  # many batches
    path = tmp_path / "ckpt.pt"
    old = {"old": torch.arange(1000)}
    fastpersist.save(old, path)
    before = path.read_bytes()
    _native.set_fault("write", nth, "EIO")
    try:
        with pytest.raises(OSError) as info:
            fastpersist.save(many_tensors(), path)
    finally:
        _native.clear_faults()
    assert info.value.errno == errno.EIO and info.value.filename == str(path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]  # no temporary file left


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot pickle this on purpose")


def test_pickling_error_after_batches_went_out_keeps_previous(tmp_path, monkeypatch):
    monkeypatch.setattr(torchzip, "STREAM_BATCH", 4096)
    path = tmp_path / "ckpt.pt"
    fastpersist.save({"old": torch.ones(3)}, path)
    before = path.read_bytes()
    state = many_tensors(100)
    state["zz_bad"] = Unpicklable()  # pickled after the tensors: batches are already on disk
    with pytest.raises(RuntimeError, match="on purpose"):
        fastpersist.save(state, path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]
