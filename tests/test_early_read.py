"""Weights-only CPU loads start the bulk read right after the index (torchload._load_fast),
before the pickle is scanned: the bytes and checks must be those of the ordinary path."""

from __future__ import annotations

import io
import zipfile

import pytest
import torch

import fastpersist
from fastpersist.errors import ChecksumError
from fastpersist.formats import torchload


@pytest.fixture
def fast_calls(monkeypatch):
    calls: list[str] = []
    real = torchload._load_fast

    def spy(load, *a, **k):
        calls.append(load.path)
        return real(load, *a, **k)

    monkeypatch.setattr(torchload, "_load_fast", spy)
    return calls


def _data_offset(path, info: zipfile.ZipInfo) -> int:
    """Where a record's payload starts: after its *local* header (whose extra field, the
    alignment padding, differs from the central directory's)."""
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        head = f.read(30)
    assert head[:4] == b"PK\x03\x04"
    return info.header_offset + 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little")


def _with_unreferenced_record(path, obj, corrupt: bool) -> None:
    """A torch.save file of ``obj`` plus a storage record the pickle never names
    (``archive/data/77``), its payload flipped after the CRC was recorded if ``corrupt``."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    zin = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))
        zout.writestr("archive/data/77", bytes(range(256)) * 40)
    if corrupt:
        with zipfile.ZipFile(path) as z:
            start = _data_offset(path, z.getinfo("archive/data/77"))
        raw = bytearray(open(path, "rb").read())
        raw[start + 100] ^= 0xFF
        open(path, "wb").write(bytes(raw))


@pytest.mark.parametrize("corrupt", [False, True])
def test_unreferenced_record_read_but_not_checked(tmp_path, fast_calls, corrupt):
    """torch.load never looks at a record the pickle does not name; neither do we, even
    though the early read fetched it before anyone knew."""
    p = tmp_path / "u.pt"
    obj = {"a": torch.arange(1000.0), "b": torch.ones(3, 5, dtype=torch.int16)}
    _with_unreferenced_record(p, obj, corrupt)
    want = torch.load(p)
    got = fastpersist.load(p)
    assert fast_calls == [str(p)]
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_fallback_to_torchs_unpickler_after_the_early_read(tmp_path, fast_calls):
    """A pickle the fast unpickler does not take (a Parameter): the early read is finished,
    the records the pickle names are checked, torch's unpickler builds the object; an
    unreferenced corrupt record still raises nothing."""
    p = tmp_path / "f.pt"
    obj = {"p": torch.nn.Parameter(torch.randn(40, 3)), "t": torch.arange(7)}
    _with_unreferenced_record(p, obj, corrupt=True)
    want = torch.load(p)
    got = fastpersist.load(p)
    assert fast_calls == [str(p)]
    assert isinstance(got["p"], torch.nn.Parameter)
    assert torch.equal(got["p"], want["p"]) and torch.equal(got["t"], want["t"])


@pytest.mark.parametrize("fast", [True, False])
def test_referenced_corrupt_record_still_raises(tmp_path, fast_calls, fast):
    """A flipped byte in a record the pickle names raises ChecksumError on the early-read
    path, whether the fast unpickler or torch's (after NotFast) builds the object."""
    p = tmp_path / "c.pt"
    w = torch.randn(5000)
    obj = {"w": w} if fast else {"w": torch.nn.Parameter(w)}
    fastpersist.save(obj, p)
    with zipfile.ZipFile(p) as z:
        name = next(n for n in z.namelist() if "/data/" in n and z.getinfo(n).file_size == w.numel() * 4)
        start = _data_offset(p, z.getinfo(name))
    raw = bytearray(p.read_bytes())
    raw[start + 123] ^= 0x01
    p.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError):
        fastpersist.load(p)
    assert fast_calls == [str(p)]


def test_cuda_saved_locations_keep_the_gpu_path(tmp_path, fast_calls):
    """map_location None and a pickle naming "cuda": the early read is not taken (those
    storages would go to their device through the GPU path's ring); the ordinary path
    then says what torch says (here, without CUDA, torch's error)."""
    p = tmp_path / "g.pt"
    t = torch.arange(10.0)
    buf = io.BytesIO()
    torch.save({"t": t}, buf)
    raw = buf.getvalue()
    # a file whose storage location tag reads 'cuda' ('cpu' and 'cuda' differ in length:
    # rewrite the pickle with torch's own writer instead, via a location tag hook)
    torch.serialization.register_package(0, lambda obj: "cuda" if getattr(obj, "_fp_tag_cuda", False) else None,
                                         lambda obj, loc: None)
    s = t.untyped_storage()
    s._fp_tag_cuda = True  # type: ignore[attr-defined]
    try:
        torch.save({"t": t}, p)
    finally:
        del s._fp_tag_cuda
        torch.serialization._package_registry[:] = [e for e in torch.serialization._package_registry if e[0] != 0]
    assert b"cuda" in zipfile.ZipFile(p).read(next(n for n in zipfile.ZipFile(p).namelist() if n.endswith("data.pkl")))
    assert raw  # the plain file for comparison is not needed further
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the load would succeed onto the device")
    with pytest.raises(Exception) as ours:
        fastpersist.load(p)
    with pytest.raises(Exception) as theirs:
        torch.load(p)
    assert type(ours.value) is type(theirs.value)
    assert fast_calls == []
