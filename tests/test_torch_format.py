"""The torch zip layout: zip index parser, planner invariants, compatibility with torch and zipfile."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import zipfile
import zlib

import pytest
import torch

import fastpersist
from fastpersist.errors import UnsupportedLayoutError, ZipFormatError
from fastpersist.formats.base import PATCH_U32LE
from fastpersist.formats.torchzip import plan_torch, read_index_from_bytes
from fastpersist.formats.zipindex import read_zip_index


def sample_state():
    base = torch.arange(1000, dtype=torch.float32)
    return {
        "w": torch.randn(33, 17),
        "b": torch.zeros(17, dtype=torch.bfloat16),
        "view": base[100:200],
        "base": base,
        "t": base.view(10, 100).t(),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2, dtype=torch.int16),
        "flag": torch.tensor([True, False]),
        "meta": {"step": 10, "names": ["a", "b"]},
    }


# ---------------------------------------------------------------- zip index parser


class _Unseekable:
    """A write-only stream: zipfile then writes data descriptors (flag bit 3)."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()

    def write(self, b: bytes) -> int:
        return self.buf.write(b)

    def flush(self) -> None:
        pass

    def getvalue(self) -> bytes:
        return self.buf.getvalue()


def _python_zip(force_zip64: bool, descriptor: bool) -> bytes:
    buf = _Unseekable() if descriptor else io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, data in (("a.txt", b"hello"), ("dir/b.bin", os.urandom(5000)), ("empty", b"")):
            if descriptor:
                with zf.open(name, "w", force_zip64=force_zip64) as f:
                    f.write(data)
            else:
                zf.writestr(name, data)
    return buf.getvalue()


@pytest.mark.parametrize("force_zip64", [False, True])
@pytest.mark.parametrize("descriptor", [False, True])
def test_index_matches_python_zipfile(force_zip64, descriptor):
    raw = _python_zip(force_zip64, descriptor)
    index = read_index_from_bytes(raw)
    zf = zipfile.ZipFile(io.BytesIO(raw))
    assert [e.name for e in index.entries] == zf.namelist()
    for e, info in zip(index.entries, zf.infolist()):
        assert (e.header_offset, e.compressed_size, e.uncompressed_size, e.crc32) == (
            info.header_offset, info.compress_size, info.file_size, info.CRC)
        data = raw[e.data_offset : e.data_end]
        assert data == zf.read(info.filename)
        assert zlib.crc32(data) == e.crc32
        for off in e.crc_field_offsets:  # every CRC field holds the CRC (local headers of streamed entries hold 0)
            stored = int.from_bytes(raw[off : off + 4], "little")
            assert stored == e.crc32 or (off == e.header_offset + 14 and stored == 0)
        if descriptor and e.compressed_size:
            assert e.descriptor_offset == e.data_end


def test_index_with_zip64_central_directory(monkeypatch):
    """zip64 extra fields in the central directory and the zip64 end records (as in files > 4 GiB)."""
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 16)
    monkeypatch.setattr(zipfile, "ZIP_FILECOUNT_LIMIT", 1)
    raw = _python_zip(False, False)
    index = read_index_from_bytes(raw)
    assert index.zip64
    zf = zipfile.ZipFile(io.BytesIO(raw))
    for e, info in zip(index.entries, zf.infolist()):
        assert (e.header_offset, e.compressed_size, e.crc32) == (info.header_offset, info.compress_size, info.CRC)
        assert raw[e.data_offset : e.data_end] == zf.read(info.filename)
    assert b"PK\x06\x06" in raw[index.cd_offset + index.cd_size :]


def test_index_of_torch_save_file(tmp_path):
    path = tmp_path / "ref.pt"
    torch.save(sample_state(), path)
    index = read_zip_index(path)
    zf = zipfile.ZipFile(path)
    assert [e.name for e in index.entries] == zf.namelist()
    raw = path.read_bytes()
    for e in index.entries:
        assert raw[e.data_offset : e.data_end] == zf.read(e.name)
        if e.compressed_size:
            assert e.descriptor_offset is not None
            assert int.from_bytes(raw[e.descriptor_crc_offset : e.descriptor_crc_offset + 4], "little") == e.crc32
        assert int.from_bytes(raw[e.cd_crc_offset : e.cd_crc_offset + 4], "little") == e.crc32


def test_index_errors_name_path_and_offset(tmp_path):
    raw = _python_zip(False, False)
    with pytest.raises(ZipFormatError, match="end of central directory"):
        read_index_from_bytes(raw[: len(raw) - 30], "cut.zip")
    with pytest.raises(ZipFormatError, match="too small"):
        read_index_from_bytes(b"PK", "tiny.zip")
    with pytest.raises(ZipFormatError, match="not a valid zip"):
        read_index_from_bytes(b"\0" * 200, "zeros.zip")
    bad = bytearray(raw)
    first_local = read_index_from_bytes(raw).entries[0].header_offset
    bad[first_local : first_local + 4] = b"XXXX"
    with pytest.raises(ZipFormatError, match="local header signature") as info:
        read_index_from_bytes(bytes(bad), "bad.zip")
    assert info.value.path == "bad.zip" and info.value.offset == first_local
    truncated = tmp_path / "t.pt"
    torch.save({"a": torch.ones(1000)}, truncated)
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ZipFormatError, match=str(truncated)):
        read_zip_index(truncated)


# ---------------------------------------------------------------- planner


@pytest.mark.parametrize("alignment", [64, 4096, 8192])
def test_plan_invariants(alignment):
    state = sample_state()
    plan = plan_torch(state, alignment)
    pos = 0
    for off, ptr, length, slot in plan.extents:  # cover [0, size) without gaps, sorted
        assert off == pos and length > 0 and ptr != 0
        assert -1 <= slot < plan.nslots
        pos += length
    assert pos == plan.file_size
    payloads = [x for x in plan.extents if x[3] >= 0]
    assert len(payloads) == plan.nslots == len(plan.slot_names)
    assert all(off % alignment == 0 for off, _, _, _ in payloads)
    assert all("/data/" in n for n in plan.slot_names)
    # each slot's CRC goes to the data descriptor and to the central directory
    assert sorted(p[1] for p in plan.patches) == sorted(list(range(plan.nslots)) * 2)
    assert all(p[2] == PATCH_U32LE for p in plan.patches)
    # payload pointers are the tensors' own memory: nothing was copied
    ptrs = {x[1] for x in payloads}
    assert state["base"].untyped_storage().data_ptr() in ptrs
    assert state["w"].data_ptr() in ptrs


def test_plan_keys_match_storages():
    a, b = torch.arange(10.0), torch.ones(3, dtype=torch.int64)
    plan = plan_torch({"x": [a, a[2:], b], "y": b.view(3, 1)}, 4096)
    assert plan.nslots == 2
    by_name = {n: x for n, x in zip(plan.slot_names, [e for e in plan.extents if e[3] >= 0])}
    sizes = sorted(x[2] for x in by_name.values())
    assert sizes == sorted([a.nbytes, b.nbytes])
    assert {x[1] for x in by_name.values()} == {a.data_ptr(), b.data_ptr()}


def test_quantized_needs_fallback():
    with pytest.raises(UnsupportedLayoutError):
        plan_torch({"q": torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)}, 4096)


def test_bad_alignment():
    with pytest.raises(ValueError):
        plan_torch({}, 3000)


# ---------------------------------------------------------------- files on disk


def test_payloads_aligned_and_zipfile_checks_pass(tmp_path):
    path = tmp_path / "ckpt.pt"
    fastpersist.save(sample_state(), path)
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None  # every CRC correct
        names = zf.namelist()
    align = fastpersist.io.alignment_of(tmp_path)
    index = read_zip_index(path)
    alignment_record = index.find(".storage_alignment")
    with zipfile.ZipFile(path) as zf:
        assert int(zf.read(alignment_record.name)) == align
    data = [e for e in index.entries if "/data/" in e.name]
    assert len(data) == 6 and [e.name for e in index.entries] == names
    for e in data:
        if e.compressed_size:
            assert e.data_offset % align == 0, e.name


def test_same_records_as_torch_save(tmp_path):
    """Record for record the file holds what torch.save writes with the same alignment.

    Only the order differs, on purpose (fastpersist.formats.torchstream): storage
    records come first, in key order, so they can be written while torch pickles."""
    from torch.utils.serialization import config as tconfig

    state = sample_state()
    ours = tmp_path / "ours.pt"
    fastpersist.save(state, ours)
    align = fastpersist.io.alignment_of(tmp_path)
    ref = tmp_path / "ref.pt"
    with tconfig.patch({"save.storage_alignment": align}):
        torch.save(state, ref)
    with zipfile.ZipFile(ours) as a, zipfile.ZipFile(ref) as b:
        strip = lambda n: n.split("/", 1)[1]  # noqa: E731 - archive folder names differ
        ours_names = [strip(n) for n in a.namelist()]
        ref_names = [strip(n) for n in b.namelist()]
        assert sorted(ours_names) == sorted(ref_names)
        storages = [n for n in ref_names if n.startswith("data/")]
        assert ours_names[: len(storages)] == sorted(storages, key=lambda n: int(n.split("/")[1]))
        assert [n for n in ours_names if not n.startswith("data/")] == [n for n in ref_names if not n.startswith("data/")]
        ref_by_short = {strip(n): n for n in b.namelist()}
        for na in a.namelist():
            if not na.endswith("serialization_id"):
                assert a.read(na) == b.read(ref_by_short[strip(na)]), na


def test_stock_torch_load_in_clean_interpreter(tmp_path):
    """A Python that never imports fastpersist reads our file with stock torch.load."""
    state = sample_state()
    ours = tmp_path / "ours.pt"
    fastpersist.save(state, ours)
    ref = tmp_path / "expected.pt"
    torch.save(state, ref)
    script = textwrap.dedent(
        f"""
        import sys, torch
        got = torch.load({str(ours)!r}, weights_only=True)
        want = torch.load({str(ref)!r}, weights_only=True)
        assert "fastpersist" not in sys.modules
        def same(a, b):
            if isinstance(b, torch.Tensor):
                raw = lambda t: torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
                return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
                        and a.storage_offset() == b.storage_offset() and torch.equal(raw(a), raw(b)))
            if isinstance(b, dict):
                return list(a) == list(b) and all(same(a[k], b[k]) for k in b)
            if isinstance(b, (list, tuple)):
                return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
            return a == b
        assert same(got, want), "objects differ"
        assert got["view"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
        got_mm = torch.load({str(ours)!r}, weights_only=True, mmap=True)
        assert same(got_mm, want), "mmap objects differ"
        print("OK")
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTPERSIST")}
    env.pop("PYTHONPATH", None)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "OK"


def test_unzip_accepts_file(tmp_path):
    import shutil

    if shutil.which("unzip") is None:
        pytest.skip("unzip not installed")
    path = tmp_path / "ckpt.pt"
    fastpersist.save(sample_state(), path)
    res = subprocess.run(["unzip", "-t", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


# ---------------------------------------------------------------- one entry point, from a file or from memory


def test_load_torch_from_memory_equals_load_from_file(tmp_path):
    """``torchload.load_torch`` over the file's bytes in memory (the collective load's
    assembled file) gives what it gives from the file, and what ``torch.load`` gives."""
    import mmap

    from fastpersist import _compat, handles
    from fastpersist.formats import torchload

    state = sample_state()
    path = str(tmp_path / "s.pt")
    fastpersist.save(state, path)
    handle = handles.handle_for(fastpersist.Config(), read=True)
    unpickler = _compat.weights_only_unpickler()
    from_file = torchload.load_torch(path, handle, None, unpickler, weights_only=True, encoding="utf-8")
    fd = os.open(path, os.O_RDONLY)
    try:
        memory = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        from_memory = torchload.load_torch(path, handle, None, unpickler, weights_only=True, memory=memory, fd=fd,
                                           encoding="utf-8")
        with pytest.raises(ValueError, match="memory= and fd= go together"):
            torchload.load_torch(path, handle, None, unpickler, weights_only=True, fd=fd)
        with pytest.raises(UnsupportedLayoutError, match="the buffer holds"):
            torchload.load_torch(path, handle, None, unpickler, weights_only=True, memory=bytearray(10), fd=fd)
    finally:
        os.close(fd)
    expected = torch.load(path, weights_only=True)
    for got in (from_file, from_memory):
        assert got.keys() == expected.keys()
        for k, v in expected.items():
            if isinstance(v, torch.Tensor):
                assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
            else:
                assert got[k] == v
