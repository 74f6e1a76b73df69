"""fastpersist.open: tensor names, dtypes and shapes from the index without reading
payloads; get/get_many read only the named records (counted in bytes the process
read, /proc/self/io rchar, with the pread engine) and check them; hostile files give
torch's values or a clear error."""

from __future__ import annotations

import os
import pickle
import struct
import zipfile

import pytest
import torch

import fastpersist
from fastpersist.errors import CheckpointFormatError, ChecksumError, UnsupportedLayoutError
from fastpersist.formats.torchindex import AmbiguousNameError
from fastpersist.formats.zipindex import read_zip_index
from subprocs import tensors_by_name  # tests/ is on sys.path

MiB = 1 << 20
PSYNC = fastpersist.Config(engine="psync")  # reads are pread calls: counted in rchar


def rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise AssertionError("no rchar")


needs_proc_io = pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io")


def _save(obj, path, writer: str) -> None:
    (torch.save if writer == "torch" else fastpersist.save)(obj, path)


def _leaf(obj, name: str):
    return tensors_by_name(obj)[name]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.requires_grad == b.requires_grad
            and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))


def nested() -> dict:
    base = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    return {
        "model": {"fc.weight": torch.nn.Parameter(torch.randn(3, 4)), "fc.bias": torch.randn(3)},
        "views": [base[0:2], base[2:4], base.t()],
        "opt": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 4)}}, "param_groups": [{"lr": 0.1}]},
        "half": torch.arange(5, dtype=torch.bfloat16),
        "flags": torch.tensor([True, False]),
        "empty": torch.empty(0, 3),
        "epoch": 7,
        "name": "run",
    }


NAMES = ["model.fc.weight", "model.fc.bias", "views.0", "views.1", "views.2", "opt.state.0.step",
         "opt.state.0.exp_avg", "half", "flags", "empty"]


@pytest.mark.parametrize("writer", ["fastpersist", "torch"])
def test_keys_info_get_match_torch_load(tmp_path, writer):
    p = tmp_path / "n.pt"
    _save(nested(), p, writer)
    want = torch.load(p)
    with fastpersist.open(p) as f:
        assert f.format == "torch"
        assert f.keys() == NAMES
        assert f.metadata() is None
        for name in NAMES:
            info = f.info(name)
            ref = _leaf(want, name)
            assert (info.dtype, info.shape, info.stride, info.storage_offset) == (
                ref.dtype, tuple(ref.shape), ref.stride(), ref.storage_offset())
            assert info.nbytes == ref.numel() * ref.element_size()
            assert _same(f.get(name), ref), name
        got = f.get_many(NAMES)
        for name in NAMES:
            assert _same(got[name], _leaf(want, name)), name
        # views of one storage share it, as after torch.load
        assert got["views.0"].untyped_storage().data_ptr() == got["views.2"].untyped_storage().data_ptr()
        assert f.info("views.0").record == f.info("views.1").record
        assert f.object()["epoch"] == 7 and f.object()["views"][0].device.type == "meta"
        with pytest.raises(KeyError, match="no tensor named 'nope'"):
            f.info("nope")


def test_safetensors_keys_info_get_metadata(tmp_path):
    p = tmp_path / "s.safetensors"
    tensors = {"b": torch.randn(3, 4), "a": torch.arange(6, dtype=torch.int16), "h": torch.ones(2, dtype=torch.float16)}
    from safetensors.torch import save_file

    save_file(tensors, p, metadata={"format": "pt"})
    with fastpersist.open(p) as f:
        assert f.format == "safetensors"
        assert sorted(f.keys()) == ["a", "b", "h"]
        assert f.metadata() == {"format": "pt"}
        assert f.info("b").shape == (3, 4) and f.info("a").dtype == torch.int16
        for k, v in f.get_many(["a", "b", "h"]).items():
            assert torch.equal(v, tensors[k])
    p2 = tmp_path / "f.safetensors"
    fastpersist.save(tensors, p2)
    with fastpersist.open(p2) as f:
        assert torch.equal(f.get("b"), tensors["b"])


def test_names_that_collide_are_ambiguous(tmp_path):
    p = tmp_path / "c.pt"
    fastpersist.save({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}, "c": torch.ones(2)}, p)
    with fastpersist.open(p) as f:
        assert sorted(f.keys()) == ["a.b", "c"]
        with pytest.raises(AmbiguousNameError, match="stands for 2 tensors"):
            f.get("a.b")
        assert torch.equal(f.get("c"), torch.ones(2))


def test_bare_tensor_and_list_roots(tmp_path):
    p = tmp_path / "t.pt"
    fastpersist.save(torch.arange(3), p)
    with fastpersist.open(p) as f:
        assert f.keys() == [""] and torch.equal(f.get(""), torch.arange(3))
    fastpersist.save([torch.ones(2), (torch.zeros(1),)], p)
    with fastpersist.open(p) as f:
        assert f.keys() == ["0", "1.0"]


# --------------------------------------------------------------------------- what is read


def _big(tmp_path, writer: str):
    tensors = {f"w{i}": torch.full((MiB // 4,), float(i)) for i in range(8)}  # 8 x 1 MiB
    p = tmp_path / ("b.safetensors" if writer == "safetensors" else "b.pt")
    _save(tensors, p, writer)
    return p, tensors


@needs_proc_io
@pytest.mark.parametrize("writer", ["fastpersist", "torch", "safetensors"])
def test_index_and_partial_reads_count_bytes(tmp_path, writer):
    p, tensors = _big(tmp_path, writer)
    a = rchar()
    f = fastpersist.open(p, config=PSYNC)
    f.keys()
    f.info("w3")
    b = rchar()
    assert b - a < 256 << 10, f"open + keys + info read {b - a} bytes (payload: 8 MiB)"
    t = f.get("w3")
    c = rchar()
    assert MiB <= c - b < MiB + (64 << 10), f"get read {c - b} bytes for a 1 MiB tensor"
    assert torch.equal(t, tensors["w3"])
    got = f.get_many(["w1", "w6"])
    d = rchar()
    assert 2 * MiB <= d - c < 2 * MiB + (64 << 10), f"get_many read {d - c} bytes for 2 MiB"
    assert torch.equal(got["w6"], tensors["w6"])
    f.close()


@needs_proc_io
def test_shared_record_read_once(tmp_path):
    base = torch.randn(3, MiB // 4)  # one 3 MiB storage
    p = tmp_path / "qkv.pt"
    fastpersist.save({"q": base[0], "k": base[1], "v": base[2]}, p)
    with fastpersist.open(p, config=PSYNC) as f:
        a = rchar()
        got = f.get_many(["q", "k", "v"])
        b = rchar()
    assert 3 * MiB <= b - a < 3 * MiB + (64 << 10), f"read {b - a} bytes, the record is 3 MiB"
    assert torch.equal(got["v"], base[2])
    assert got["q"].untyped_storage().data_ptr() == got["v"].untyped_storage().data_ptr()


@pytest.mark.parametrize("writer", ["fastpersist", "torch", "safetensors"])
def test_corrupt_unrequested_record_not_noticed(tmp_path, writer):
    p, tensors = _big(tmp_path, writer)
    with fastpersist.open(p) as f:
        off = f.info("w5").file_offset
    data = bytearray(p.read_bytes())
    data[off + 12345] ^= 0x01
    p.write_bytes(data)
    with fastpersist.open(p) as f:
        got = f.get_many(["w0", "w4", "w7"])
        assert all(torch.equal(got[k], tensors[k]) for k in got)
        if writer == "safetensors":
            # safetensors' own writer records no checksum: only fastpersist's files are checked
            pytest.skip("no checksums in files from safetensors' writer")
        with pytest.raises(ChecksumError, match="w5|data/5"):
            f.get("w5")
    with fastpersist.open(p, config=fastpersist.Config(checksum=False)) as f:
        assert not torch.equal(f.get("w5"), tensors["w5"])  # unchecked: the flipped byte comes back


def test_closed_reader(tmp_path):
    p = tmp_path / "c.pt"
    fastpersist.save({"a": torch.ones(2)}, p)
    with fastpersist.open(p) as f:
        fd = f._f.fd
        os.fstat(fd)
    assert f.closed
    with pytest.raises(OSError):
        os.fstat(fd)
    with pytest.raises(ValueError, match="closed"):
        f.keys()
    f.close()  # idempotent


def test_reader_keeps_reading_the_file_it_opened(tmp_path):
    p = tmp_path / "c.pt"
    fastpersist.save({"a": torch.ones(1000)}, p)
    with fastpersist.open(p) as f:
        fastpersist.save({"a": torch.zeros(1000)}, p)  # renamed over the path
        assert torch.equal(f.get("a"), torch.ones(1000))


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_weights_only_is_kept(tmp_path):
    p = tmp_path / "e.pt"
    torch.save({"t": torch.ones(1), "x": Evil()}, p)
    with pytest.raises(pickle.UnpicklingError, match="weights_only"):
        fastpersist.open(p)
    with pytest.raises(pickle.UnpicklingError):
        fastpersist.load_state_dict({"t": torch.zeros(1)}, p)


def test_legacy_file_is_refused_clearly(tmp_path):
    p = tmp_path / "l.pt"
    torch.save({"a": torch.ones(1)}, p, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsupportedLayoutError, match="legacy"):
        fastpersist.open(p)


# --------------------------------------------------------------------------- hostile files

CLEAR = (CheckpointFormatError, ChecksumError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError,
         pickle.UnpicklingError, UnsupportedLayoutError, TypeError, AttributeError, AssertionError)
RAW = (KeyError, struct.error, UnicodeDecodeError, RecursionError, IndexError)


def small() -> dict:
    return {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([1, 0, 1], dtype=torch.bool),
            "h": torch.arange(5, dtype=torch.bfloat16), "e": torch.empty(0)}


def _check(p, want: dict) -> str:
    """'ok': every name read gives the saved tensor; 'error': a clear error."""
    try:
        with fastpersist.open(p) as f:
            names = list(f.keys())
            got = f.get_many(names)
    except AmbiguousNameError as e:
        pytest.fail(f"{p}: unexpected ambiguity: {e}")
    except RAW as e:
        pytest.fail(f"{p}: raw {type(e).__name__}: {e}")
    except CLEAR:
        return "error"
    assert sorted(got) == sorted(want), f"{p}: other names: {sorted(got)}"
    for k, v in got.items():
        assert _same(v, want[k]), f"{p}: {k} holds other values than were saved"
    return "ok"


@pytest.fixture(scope="module", params=["fastpersist", "torch", "safetensors"])
def original(request, tmp_path_factory):
    suffix = ".safetensors" if request.param == "safetensors" else ".pt"
    p = tmp_path_factory.mktemp("orig") / f"c{suffix}"
    _save(small(), p, request.param)
    return request.param, suffix, p.read_bytes()


def test_truncations(original, tmp_path):
    writer, suffix, data = original
    p = tmp_path / f"t{suffix}"
    counts = {"ok": 0, "error": 0}
    step = 1 if len(data) < 4000 else 17
    for n in range(0, len(data), step):
        p.write_bytes(data[:n])
        counts[_check(p, small())] += 1
    assert counts["ok"] == 0


def _meaningful_offsets(data: bytes, path, suffix: str) -> list[int]:
    """Every byte but the padding of aligned records (local header extra fields)."""
    if suffix != ".pt":
        return list(range(len(data)))
    idx = read_zip_index(path)
    out = set(range(idx.cd_offset, len(data)))
    for e in idx.entries:
        out.update(range(e.header_offset, min(e.header_offset + 30 + len(e.name.encode()) + 8, e.data_offset)))
        out.update(range(e.data_offset, e.data_end))
    return sorted(out)


def test_flipped_bytes(original, tmp_path):
    writer, suffix, data = original
    src = tmp_path / f"src{suffix}"
    src.write_bytes(data)
    p = tmp_path / f"f{suffix}"
    counts = {"ok": 0, "error": 0}
    offsets = _meaningful_offsets(data, src, suffix)
    for off in offsets[:: max(1, len(offsets) // 1500)]:
        bad = bytearray(data)
        bad[off] ^= 0x21
        p.write_bytes(bad)
        counts[_check(p, small())] += 1
    assert counts["error"] > 0


@pytest.mark.parametrize("field,width", [(20, 4), (24, 4), (42, 4), (28, 2), (30, 2)])
@pytest.mark.parametrize("value", [0, 1, 0xFFFFFFFF, 4096])
def test_lying_central_directory(tmp_path, field, width, value):
    src = tmp_path / "src.pt"
    fastpersist.save(small(), src)
    data = src.read_bytes()
    p = tmp_path / "l.pt"
    for e in read_zip_index(src).entries:
        bad = bytearray(data)
        bad[e.cd_offset + field : e.cd_offset + field + width] = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "little")
        p.write_bytes(bad)
        _check(p, small())


def test_pickle_lying_about_storage_size(tmp_path):
    """A pickle claiming more elements than its record holds: refused at open."""
    src = tmp_path / "src.pt"
    torch.save({"w": torch.arange(4, dtype=torch.int32)}, src)
    with zipfile.ZipFile(src) as z:
        names = z.namelist()
        pkl_name = next(n for n in names if n.endswith("data.pkl"))
        pkl = z.read(pkl_name)
        records = {n: z.read(n) for n in names}
    # the storage's numel is pickled as BININT1 4 after the location string 'cpu'
    i = pkl.index(b"cpu")
    j = pkl.index(b"K\x04", i)
    records[pkl_name] = pkl[:j] + b"K\x08" + pkl[j + 2 :]
    p = tmp_path / "lie.pt"
    with zipfile.ZipFile(p, "w", compression=zipfile.ZIP_STORED) as z:
        for n in names:
            z.writestr(n, records[n])
    with pytest.raises(CheckpointFormatError, match="holds 16 bytes but the pickle claims a storage of 32"):
        fastpersist.open(p)


def _rewrite_pickle(src, dst, edit) -> None:
    with zipfile.ZipFile(src) as z:
        names = z.namelist()
        records = {n: z.read(n) for n in names}
    pkl_name = next(n for n in names if n.endswith("data.pkl"))
    records[pkl_name] = edit(records[pkl_name])
    with zipfile.ZipFile(dst, "w", compression=zipfile.ZIP_STORED) as z:
        for n in names:
            z.writestr(n, records[n])


def test_pickle_lying_about_a_view_offset(tmp_path):
    """A view whose storage offset reaches past its record: refused (torch refuses too)."""
    src = tmp_path / "src.pt"
    torch.save({"w": torch.arange(16, dtype=torch.int32)[2:6]}, src)
    p = tmp_path / "lie.pt"
    _rewrite_pickle(src, p, lambda pkl: pkl.replace(b"QK\x02K\x04", b"QK\x0eK\x04", 1))
    with pytest.raises(RuntimeError):
        torch.load(p)
    with pytest.raises((CheckpointFormatError, UnsupportedLayoutError)):
        fastpersist.open(p)
    target = {"w": torch.zeros(4, dtype=torch.int32)}
    with pytest.raises((CheckpointFormatError, RuntimeError)):
        fastpersist.load_state_dict(target, p)
    assert torch.equal(target["w"], torch.zeros(4, dtype=torch.int32))


def _dead_tensor_beyond_its_record(tmp_path):
    """A file whose pickle builds a tensor reaching past its record and then sets the same
    dict key again to a sound tensor: the out-of-bounds one is in no result, but torch.load
    builds it and refuses the file (fuzz: partial and into readers, seed 1)."""
    src = tmp_path / "src.pt"
    torch.save({"x": torch.arange(7, dtype=torch.float32), "y": torch.arange(4, dtype=torch.int32)}, src)
    p = tmp_path / "dead.pt"

    def edit(pkl: bytes) -> bytes:
        assert pkl.count(b"K\x07\x85") == 1 and pkl.count(b"X\x01\x00\x00\x00y") == 1
        pkl = pkl.replace(b"K\x07\x85", b"K\x09\x85")  # x: shape (9,) over a 7-element record
        return pkl.replace(b"X\x01\x00\x00\x00y", b"X\x01\x00\x00\x00x")  # then "x" again: the int32 tensor

    _rewrite_pickle(src, p, edit)
    with pytest.raises(RuntimeError, match="not resizable"):
        torch.load(p, weights_only=True, map_location="cpu")
    return p


def test_tensor_beyond_its_record_refused_even_if_overwritten(tmp_path):
    """open() indexed only the surviving tensors and returned the second "x" where torch
    refuses the file; the index now notices the storage the dead tensor grew."""
    p = _dead_tensor_beyond_its_record(tmp_path)
    with pytest.raises(CheckpointFormatError, match="reaches beyond its record"):
        with fastpersist.open(p) as f:
            f.get("x")
