"""Checked ``mmap=True`` loads (fastpersist.formats.mmapload): the tensors are backed by
a private mapping of the file, like ``torch.load(mmap=True)``'s, and the bytes under
them were compared with the file's CRC-32s first."""

from __future__ import annotations

import gc
import io
import os
import zipfile
import zlib
from collections import OrderedDict

import pytest
import torch

import fastpersist
from fastpersist import _native
from fastpersist.errors import CheckpointFormatError, ChecksumError, ZipFormatError
from fastpersist.formats import mmapload
from fastpersist.formats.zipindex import read_zip_index
from test_hostile_load import check, header_offsets, original, payload_flips, saved  # noqa: F401 - original is a fixture

# --------------------------------------------------------------------------- helpers


def mapping_of(t: torch.Tensor):
    """``(permissions, inode)`` of the mapping in /proc/self/maps that holds the tensor's
    storage, or None (anonymous memory has inode 0)."""
    addr = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return parts[1], int(parts[4])
    return None


def tensors(obj, out=None) -> list:
    out = [] if out is None else out
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            tensors(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            tensors(v, out)
    return out


def assert_file_backed(obj, path) -> None:
    """Every non-empty tensor lies in a private (copy-on-write) mapping of ``path``'s inode."""
    ino = os.stat(path).st_ino
    ts = [t for t in tensors(obj) if t.untyped_storage().nbytes() > 0]
    assert ts
    for t in ts:
        m = mapping_of(t)
        assert m is not None and m[1] == ino and m[0][3] == "p", f"tensor not in a private mapping of {path}: {m}"


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 300, generator=g)
    big = torch.randn(5 << 20, generator=g)  # 20 MiB: several CRC chunks on two threads
    dtypes = {
        str(dt): torch.arange(24).to(dt)
        for dt in (torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int32, torch.int64,
                   torch.bool, torch.complex64, torch.float8_e4m3fn)
    }
    return {
        "model": OrderedDict(w=w, wt=w.t(), row=w[3], cols=w[:, 5:9], big=big, head=big[:10]),
        "dtypes": dtypes,
        "nested": [torch.zeros(()), (torch.empty(0, 3), torch.tensor(7, dtype=torch.int16)), {"x": [1, 2.5, "s"]}],
        "step": 3,
        "name": "run",
        "none": None,
    }


def flip(path, offset: int, xor: int = 0x10) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ xor]))


def storage_record(path, min_size: int = 1024):
    return next(e for e in read_zip_index(path).entries if "/data/" in e.name and e.compressed_size >= min_size)


@pytest.fixture(scope="module", params=["fastpersist", "torch"])
def saved_file(request, tmp_path_factory):
    p = tmp_path_factory.mktemp("mm") / "s.pt"
    (fastpersist.save if request.param == "fastpersist" else torch.save)(state(), p)
    return p


def open_fds() -> list[str]:
    """What this process's descriptors name, except files under /proc and /sys: those are
    read for a moment by fastpersist's background threads (``prefault.FreeWatch`` samples
    /proc/buddyinfo every 0.1 s for 30 s after a load), so their number changes under a
    test at any time (a count of every descriptor failed now and then this way)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (listdir's own descriptor, a sampler's)
        if not target.startswith(("/proc/", "/sys/")):
            out.append(target)
    return sorted(out)


# --------------------------------------------------------------------------- torch files


@pytest.mark.parametrize("weights_only", [True, False])
@pytest.mark.parametrize("map_location", [None, "cpu"])
def test_round_trip_equals_torch_mmap(saved_file, weights_only, map_location, assert_same):
    fds = open_fds()
    got = fastpersist.load(saved_file, map_location=map_location, weights_only=weights_only, mmap=True)
    want = torch.load(saved_file, map_location=map_location, weights_only=weights_only, mmap=True)
    assert open_fds() == fds  # the descriptor is closed; the mappings keep the file
    assert_same(got, want)
    assert_same(got, state())
    assert_file_backed(got, saved_file)
    assert_file_backed(want, saved_file)  # the property torch's own mmap result has
    assert all(mapping_of(t) is None or mapping_of(t)[1] != os.stat(saved_file).st_ino
               for t in tensors(fastpersist.load(saved_file)))  # and a copying load's tensors lack


def test_tensors_outlive_everything_else(saved_file):
    got = fastpersist.load(saved_file, mmap=True)
    keep = got["model"]["row"]
    want = state()["model"]["row"]
    del got
    gc.collect()
    assert torch.equal(keep, want)
    assert_file_backed(keep, saved_file)


def test_writes_stay_private(saved_file, tmp_path):
    p = tmp_path / "c.pt"
    p.write_bytes(saved_file.read_bytes())
    got = fastpersist.load(p, mmap=True)
    got["model"]["w"].fill_(1.0)
    assert fastpersist.load(p)["model"]["w"].ne(1.0).any()


def test_flipped_payload_byte_is_caught(saved_file, tmp_path, request):
    p = tmp_path / "f.pt"
    p.write_bytes(saved_file.read_bytes())
    e = storage_record(p)
    at = e.data_offset + e.compressed_size // 2
    flip(p, at)
    if request.node.callspec.params["saved_file"] == "torch":
        # a file torch wrote: its storages may have been changed through a MAP_SHARED mmap
        # load, so it loads as torch.load loads it (fastpersist.formats.crcpolicy)
        assert all(torch.equal(a, b) for a, b in zip(tensors(fastpersist.load(p, mmap=True)),
                                                     tensors(torch.load(p, mmap=True))))
        return
    with pytest.raises(ChecksumError) as info:
        fastpersist.load(p, mmap=True)
    msg = str(info.value)
    assert str(p) in msg and e.name in msg and f"[{e.data_offset}, {e.data_end})" in msg
    assert info.value.records == [e.name] and info.value.path == str(p)
    # what the check prevents: torch's mmap load returns other values without a word
    plain = torch.load(p, mmap=True)
    assert any(not torch.equal(a, b) for a, b in zip(tensors(plain), tensors(state())))


def test_flipped_pickle_byte_is_caught(saved_file, tmp_path):
    p = tmp_path / "f.pt"
    data = saved_file.read_bytes()
    p.write_bytes(data)
    pkl = next(e for e in read_zip_index(p).entries if e.name.endswith("/data.pkl"))
    at = pkl.data_offset + data[pkl.data_offset:pkl.data_end].index(b"run")  # the "name" string
    flip(p, at, 0x01)  # "run" -> "sun": still a valid pickle
    assert torch.load(p, mmap=True)["name"] == "sun"
    with pytest.raises(ChecksumError, match="data.pkl"):
        fastpersist.load(p, mmap=True)


def test_default_mmap_config_takes_the_checked_path(saved_file, tmp_path):
    from torch.utils.serialization import config

    p = tmp_path / "f.pt"
    p.write_bytes(saved_file.read_bytes())
    pkl = next(e for e in read_zip_index(p).entries if e.name.endswith("/data.pkl"))
    flip(p, pkl.data_offset + pkl.compressed_size // 2)  # the pickle: a mismatch in any file
    with config.patch({"load.mmap": True}):
        got = fastpersist.load(saved_file)
        assert_file_backed(got, saved_file)
        with pytest.raises(ChecksumError):
            fastpersist.load(p)


def count_crc_calls(monkeypatch) -> list:
    calls: list = []
    real = mmapload.crc32_mapped

    def counting(handle, base, ranges):
        calls.append(sum(n for _a, n in ranges))
        return real(handle, base, ranges)

    monkeypatch.setattr(mmapload, "crc32_mapped", counting)
    return calls


def test_checksum_off_skips_the_crc_pass(saved_file, tmp_path, monkeypatch, assert_same):
    calls = count_crc_calls(monkeypatch)
    fastpersist.load(saved_file, mmap=True)
    assert sum(calls) >= state()["model"]["big"].nbytes
    calls.clear()
    off = fastpersist.Config(checksum=False)
    got = fastpersist.load(saved_file, mmap=True, config=off)
    assert calls == []
    assert_same(got, torch.load(saved_file, mmap=True))
    assert_file_backed(got, saved_file)
    # and with it off, a flipped byte is torch's answer, as asked
    p = tmp_path / "f.pt"
    p.write_bytes(saved_file.read_bytes())
    flip(p, storage_record(p).data_offset)
    got = fastpersist.load(p, mmap=True, config=off)
    assert_same(got, torch.load(p, mmap=True))


def test_renamed_over_during_load_loads_the_checked_inode(tmp_path, monkeypatch, assert_same):
    """A save renaming a new file over the path after the check: torch loads the inode
    that was checked (through /proc/self/fd), not the new file."""
    p = tmp_path / "c.pt"
    old, new = {"w": torch.arange(4096.0), "n": 1}, {"w": torch.zeros(4096), "n": 2}
    fastpersist.save(old, p)
    old_ino = os.stat(p).st_ino
    real = torch.serialization.load
    seen = []

    def rename_then_load(f, *args, **kwargs):
        seen.append(f)
        fastpersist.save(new, p)  # temporary file + rename over p
        return real(f, *args, **kwargs)

    monkeypatch.setattr(torch.serialization, "load", rename_then_load)
    got = fastpersist.load(p, mmap=True)
    monkeypatch.undo()
    assert seen and str(seen[0]).startswith("/proc/self/fd/")
    assert os.stat(p).st_ino != old_ino
    assert_same(got, old)
    m = mapping_of(got["w"])
    assert m is not None and m[1] == old_ino
    assert_same(fastpersist.load(p, mmap=True), new)


def test_renamed_over_during_the_crc_pass(tmp_path, monkeypatch, assert_same):
    p = tmp_path / "c.pt"
    old, new = {"w": torch.arange(4096.0)}, {"w": torch.zeros(4096)}
    fastpersist.save(old, p)
    real = mmapload.crc32_mapped
    renamed = []

    def rename_then_crc(handle, base, ranges):
        if not renamed:
            renamed.append(1)
            fastpersist.save(new, p)
        return real(handle, base, ranges)

    monkeypatch.setattr(mmapload, "crc32_mapped", rename_then_crc)
    got = fastpersist.load(p, mmap=True)
    assert renamed
    assert_same(got, old)


def test_pickle_lying_about_a_storage_size(tmp_path):
    """Every CRC right, but the pickle claims 12 floats of a 6-float record: torch's mmap
    load slices 24 bytes past the record (other values); ours refuses."""
    def records(obj):
        b = io.BytesIO()
        torch.save(obj, b)
        z = zipfile.ZipFile(io.BytesIO(b.getvalue()))
        return {n.split("/", 1)[1]: z.read(n) for n in z.namelist()}

    big, small = records({"w": torch.arange(12.0)}), records({"w": torch.arange(6.0)})
    p = tmp_path / "lie.pt"
    with zipfile.ZipFile(p, "w", zipfile.ZIP_STORED) as z:
        for k, v in big.items():
            z.writestr("archive/" + k, small[k] if k.startswith("data/") else v)
        z.writestr("archive/zzz", b"\xff" * 64)
    assert not torch.equal(torch.load(p, mmap=True)["w"], torch.arange(12.0))
    with pytest.raises(ZipFormatError, match="holds 24 bytes but the pickle claims a storage of 48 bytes") as info:
        fastpersist.load(p, mmap=True)
    assert info.value.path == str(p) and info.value.offset is not None


def test_legacy_file_gets_torchs_answer(tmp_path):
    p = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(3)}, p, _use_new_zipfile_serialization=False)
    with pytest.raises(RuntimeError) as theirs:
        torch.load(p, mmap=True)
    with pytest.raises(RuntimeError) as ours:
        fastpersist.load(p, mmap=True)
    assert str(ours.value) == str(theirs.value)


def test_crc32_mapped_matches_zlib():
    data = bytes(range(256)) * 40_000 + b"tail"  # 10 MiB: several 4 MiB pieces
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    ranges = [(0, len(data)), (5, 0), (7, 4096 * 7 + 3), (100_000, 1), (len(data) - 30_000, 30_000),
              (3, (5 << 20) + 11)]
    for threads in (1, 2, 3):
        got = mmapload.crc32_mapped(_native.Handle(threads=threads), buf.data_ptr(), ranges)
        assert got == [zlib.crc32(data[o:o + n]) for o, n in ranges]


# --------------------------------------------------------------------------- hostile torch files
# (test_hostile_load's helpers: the answer is the saved values or a clear error, never other values)


def test_truncations(original, tmp_path):
    _writer, data = original
    p = tmp_path / "t.pt"
    counts = {"ok": 0, "error": 0}
    offsets = set(range(0, len(data), max(1, len(data) // 150))) | {len(data) - 1, len(data) - 22, 4, 30}
    for n in sorted(offsets):
        p.write_bytes(data[:n])
        counts[check(p, saved(), mmap=True)] += 1
    assert counts["ok"] == 0


def test_flipped_header_bytes(original, tmp_path):
    _writer, data = original
    src = tmp_path / "src.pt"
    src.write_bytes(data)
    p = tmp_path / "f.pt"
    counts = {"ok": 0, "error": 0}
    for i, off in enumerate(header_offsets(data, src)[::4]):
        bad = bytearray(data)
        bad[off] ^= (0xFF, 0x01)[i % 2]
        p.write_bytes(bad)
        counts[check(p, saved(), mmap=True)] += 1
    assert counts["error"] > 0


def test_record_marked_as_a_directory_is_refused(tmp_path):
    """A flipped bit in a central directory entry's external attributes (MS-DOS directory)
    makes torch's reader skip the record and read memory it never filled (its answer
    varies from run to run); the checked load refuses the file instead."""
    p = tmp_path / "c.pt"
    torch.save(saved(), p)
    data = bytearray(p.read_bytes())
    idx = read_zip_index(p)
    version = next(e for e in idx.entries if e.name.endswith("/version"))
    data[version.cd_offset + 38] |= 0x10  # external attributes, low byte
    p.write_bytes(data)
    with pytest.raises(ZipFormatError, match="marked as a directory"):
        fastpersist.load(p, mmap=True)


def test_every_payload_byte_flipped(original, tmp_path):
    writer, _data = original
    for p in payload_flips(original, tmp_path):
        if writer == "torch":  # loads as torch.load loads it (fastpersist.formats.crcpolicy)
            assert all(torch.equal(a, b) for a, b in zip(tensors(fastpersist.load(p, mmap=True)),
                                                         tensors(torch.load(p, mmap=True))))
            continue
        with pytest.raises(ChecksumError):
            fastpersist.load(p, mmap=True)


@pytest.mark.parametrize("field,width", [(18, 4), (22, 4), (20, 4), (24, 4), (42, 4), (28, 2), (30, 2), (10, 2)])
def test_lying_central_directory_fields(original, tmp_path, field, width):
    _writer, data = original
    src = tmp_path / "src.pt"
    src.write_bytes(data)
    p = tmp_path / "f.pt"
    for value in (0, 1, 0xFFFFFFFF, 4096):
        for e in read_zip_index(src).entries:
            bad = bytearray(data)
            bad[e.cd_offset + field : e.cd_offset + field + width] = (value & ((1 << (8 * width)) - 1)).to_bytes(
                width, "little")
            p.write_bytes(bad)
            check(p, saved(), mmap=True)


# --------------------------------------------------------------------------- safetensors


def st_state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(300, 70, generator=g),
        "h": torch.randn(33, generator=g).to(torch.bfloat16),
        "i": torch.arange(17, dtype=torch.int64),
        "b": torch.tensor([True, False, True]),
        "e": torch.empty(0, 4),
        "s": torch.tensor(2.5, dtype=torch.float16),
    }


@pytest.mark.parametrize("map_location", [None, "cpu"])
def test_safetensors_round_trip_is_file_backed(tmp_path, map_location, assert_same):
    import safetensors.torch

    p = tmp_path / "m.safetensors"
    fastpersist.save(st_state(), p)
    fds = open_fds()
    got = fastpersist.load(p, map_location=map_location, mmap=True)
    assert open_fds() == fds
    assert_same(got, fastpersist.load(p))
    assert_same(got, safetensors.torch.load_file(p))
    assert_file_backed(got, p)
    for name, t in got.items():  # a storage of its own over its bytes
        assert t.untyped_storage().nbytes() == t.nbytes, name
    keep = got["w"]
    del got
    gc.collect()
    assert torch.equal(keep, st_state()["w"])
    keep.zero_()  # private: the file keeps its bytes
    assert torch.equal(fastpersist.load(p)["w"], st_state()["w"])


def test_safetensors_flipped_byte(tmp_path):
    p = tmp_path / "m.safetensors"
    fastpersist.save(st_state(), p)
    from fastpersist.formats.safetensors import read_header

    h = read_header(p)
    e = next(t for t in h.tensors if t.name == "w")
    flip(p, h.data_start + e.begin + 100)
    with pytest.raises(ChecksumError, match="'w'") as info:
        fastpersist.load(p, mmap=True)
    assert info.value.records == ["w"] and str(p) in str(info.value)
    got = fastpersist.load(p, mmap=True, config=fastpersist.Config(checksum=False))
    assert not torch.equal(got["w"], st_state()["w"])
    assert torch.equal(got["i"], st_state()["i"])


def test_stock_safetensors_file(tmp_path, assert_same, monkeypatch):
    import safetensors.torch

    p = tmp_path / "stock.safetensors"
    safetensors.torch.save_file(st_state(), p)
    calls = count_crc_calls(monkeypatch)
    got = fastpersist.load(p, mmap=True)
    assert calls == []  # no fastpersist CRCs to compare with
    assert_same(got, safetensors.torch.load_file(p))
    assert_file_backed(got, p)


def test_safetensors_bad_file_is_a_format_error(tmp_path):
    p = tmp_path / "bad.safetensors"
    fastpersist.save(st_state(), p)
    data = p.read_bytes()
    p.write_bytes(data[:-5])
    with pytest.raises(CheckpointFormatError, match="truncated"):
        fastpersist.load(p, mmap=True)
