"""fastpersist.load_state_dict: a checkpoint read straight into existing tensors.

Every result is compared with what ``torch.load`` + ``load_state_dict`` (or
``copy_``) gives; errors raised before reading must leave the target's bytes as
they were (checked bit for bit); failures after reading started raise
PartialLoadError.
"""

from __future__ import annotations

import collections
import errno
import os

import pytest
import torch

import fastpersist
from fastpersist.errors import ChecksumError
from fastpersist.formats.safetensors import DTYPE_CODES
from fastpersist.formats.zipindex import read_zip_index
from fastpersist.testing import inject_fault

WRITERS = ["fastpersist", "torch", "safetensors"]

ALL_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
] + [d for d in (getattr(torch, n, None) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64",
                                                  "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"))
     if isinstance(d, torch.dtype)]


def _values(dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(torch.Size(shape).numel()) * dtype.itemsize,), generator=g, dtype=torch.uint8)
    t = raw.view(dtype).reshape(shape).clone()
    if dtype == torch.bool:
        t = raw.reshape(shape) % 2 == 1 if dtype.itemsize == 1 else t
    return t


def _save(obj, path, writer: str) -> None:
    if writer == "torch":
        torch.save(obj, path)
    else:
        fastpersist.save(obj, path)


def _path(tmp_path, writer: str, name: str = "c"):
    return tmp_path / (f"{name}.safetensors" if writer == "safetensors" else f"{name}.pt")


def _snapshot(sd) -> dict:
    return {k: v.detach().clone() for k, v in sd.items()}


def _assert_bytes_equal(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k in want:
        a, b = got[k].detach(), want[k].detach()
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)), k


class Net(torch.nn.Module):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.block = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 16))
        self.bn = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.bn(self.block(self.emb(x))))


def _trained(tied: bool = False, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    m = Net(tied)
    m(torch.randint(0, 50, (8,))).sum().backward()
    return m


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("writer", WRITERS)
def test_every_dtype_round_trip_in_place(tmp_path, writer):
    dtypes = [d for d in ALL_DTYPES if writer != "safetensors" or d in DTYPE_CODES]
    saved = {f"t{i}": _values(d, (3, 5), i) for i, d in enumerate(dtypes)}
    saved["scalar"] = torch.tensor(7, dtype=torch.int64)
    saved["empty"] = torch.empty(0, 4)
    p = _path(tmp_path, writer)
    _save(saved, p, writer)
    target = {k: torch.zeros_like(v) for k, v in saved.items()}
    ptrs = {k: v.data_ptr() for k, v in target.items()}
    result = fastpersist.load_state_dict(target, p)
    assert result.missing_keys == [] and result.unexpected_keys == []
    want = fastpersist.load(p) if writer == "safetensors" else torch.load(p)
    _assert_bytes_equal(target, {k: want[k] for k in target})
    assert {k: v.data_ptr() for k, v in target.items()} == ptrs  # filled in place


@pytest.mark.parametrize("writer", WRITERS)
def test_module_round_trip_matches_torch(tmp_path, writer):
    src = _trained()
    p = _path(tmp_path, writer)
    _save(dict(src.state_dict()) if writer == "safetensors" else src.state_dict(), p, writer)
    got, want = Net(), Net()
    ptrs = [t.data_ptr() for t in got.state_dict().values()]
    r = fastpersist.load_state_dict(got, p)
    ref = want.load_state_dict(fastpersist.load(p) if writer == "safetensors" else torch.load(p))
    assert (r.missing_keys, r.unexpected_keys) == (ref.missing_keys, ref.unexpected_keys) == ([], [])
    _assert_bytes_equal(_snapshot(got.state_dict()), _snapshot(want.state_dict()))
    assert [t.data_ptr() for t in got.state_dict().values()] == ptrs
    assert isinstance(got.block[0].weight, torch.nn.Parameter) and got.block[0].weight.requires_grad


def test_non_contiguous_and_view_sources(tmp_path):
    """Transposed tensors, views into one storage (q/k/v of one matrix), non-contiguous
    targets: read through a scratch buffer, same values as torch."""
    base = torch.randn(6, 4)
    saved = {"q": base[0:2], "k": base[2:4], "v": base[4:6], "t": torch.randn(3, 5).t(), "s": torch.randn(8)[::2]}
    p = tmp_path / "v.pt"
    fastpersist.save(saved, p)
    target = {"q": torch.zeros(2, 4), "k": torch.zeros(2, 4), "v": torch.zeros(2, 4), "t": torch.zeros(5, 3),
              "s": torch.zeros(8)[1::2]}
    fastpersist.load_state_dict(target, p)
    _assert_bytes_equal(target, {k: v.contiguous() for k, v in saved.items()})


def test_nested_dict_target(tmp_path):
    saved = {"enc": {"w": torch.randn(4, 4), "layers": [torch.randn(3), torch.randn(2)]}, "step": 3}
    p = tmp_path / "n.pt"
    fastpersist.save(saved, p)
    target = {"enc": {"w": torch.zeros(4, 4), "layers": [torch.zeros(3), torch.zeros(2)]}}
    r = fastpersist.load_state_dict(target, p)
    assert r.missing_keys == [] and r.unexpected_keys == []
    assert torch.equal(target["enc"]["w"], saved["enc"]["w"])
    assert torch.equal(target["enc"]["layers"][1], saved["enc"]["layers"][1])


# --------------------------------------------------------------------------- sharing


@pytest.mark.parametrize("writer", ["fastpersist", "torch"])
def test_tied_parameters(tmp_path, writer):
    src = _trained(tied=True)
    p = tmp_path / "tied.pt"
    _save(src.state_dict(), p, writer)
    with fastpersist.open(p) as f:  # the file holds the tied weight once
        assert f.info("emb.weight").record == f.info("head.weight").record
    got = Net(tied=True)
    fastpersist.load_state_dict(got, p)
    assert got.head.weight is got.emb.weight
    assert torch.equal(got.emb.weight, src.emb.weight)
    # tied in the file, untied in the model: both get the bytes
    untied = Net(tied=False)
    fastpersist.load_state_dict(untied, p)
    assert torch.equal(untied.head.weight, src.emb.weight) and torch.equal(untied.emb.weight, src.emb.weight)
    assert untied.head.weight.data_ptr() != untied.emb.weight.data_ptr()


def test_untied_file_into_tied_model_last_wins_like_torch(tmp_path):
    src = _trained(tied=False)
    p = tmp_path / "u.pt"
    fastpersist.save(src.state_dict(), p)
    got, want = Net(tied=True), Net(tied=True)
    fastpersist.load_state_dict(got, p)
    want.load_state_dict(torch.load(p))
    assert torch.equal(got.emb.weight, want.emb.weight)


# --------------------------------------------------------------------------- strict / mismatches


def _file_and_model(tmp_path, writer="fastpersist"):
    src = _trained(seed=1)
    p = _path(tmp_path, writer)
    _save(dict(src.state_dict()), p, writer)
    m = _trained(seed=2)
    return p, src, m, _snapshot(m.state_dict())


@pytest.mark.parametrize("writer", WRITERS)
def test_strict_missing_and_unexpected_raise_before_reading(tmp_path, writer):
    src = _trained(seed=1)
    sd = dict(src.state_dict())
    sd.pop("bn.running_mean")
    sd["extra.weight"] = torch.ones(3)
    p = _path(tmp_path, writer)
    _save(sd, p, writer)
    m = _trained(seed=2)
    before = _snapshot(m.state_dict())
    with pytest.raises(RuntimeError, match=r"(?s)Unexpected key\(s\).*extra\.weight.*Missing key\(s\).*bn\.running_mean"):
        fastpersist.load_state_dict(m, p)
    _assert_bytes_equal(_snapshot(m.state_dict()), before)
    # non-strict: like torch's result; the unexpected entry is reported, not read
    r = fastpersist.load_state_dict(m, p, strict=False)
    assert r.missing_keys == ["bn.running_mean"] and r.unexpected_keys == ["extra.weight"]
    assert torch.equal(m.bn.running_mean, before["bn.running_mean"])
    assert torch.equal(m.block[0].weight, src.block[0].weight)


def test_non_strict_does_not_read_unexpected_entries(tmp_path):
    """A corrupt record the model does not have is never read, so never noticed."""
    src = _trained(seed=1)
    sd = dict(src.state_dict())
    sd["zzz.unused"] = torch.arange(5000, dtype=torch.float32)
    p = tmp_path / "c.pt"
    fastpersist.save(sd, p)
    with fastpersist.open(p) as f:
        info = f.info("zzz.unused")
    data = bytearray(p.read_bytes())
    data[info.file_offset + 100] ^= 0xFF
    p.write_bytes(data)
    m = Net()
    r = fastpersist.load_state_dict(m, p, strict=False)
    assert r.unexpected_keys == ["zzz.unused"]
    assert torch.equal(m.head.weight, src.head.weight)
    with pytest.raises(ChecksumError):
        fastpersist.load(p)


@pytest.mark.parametrize("writer", WRITERS)
def test_shape_mismatch_raises_before_reading(tmp_path, writer):
    src = _trained(seed=1)
    sd = dict(src.state_dict())
    sd["block.0.weight"] = torch.randn(32, 17)
    p = _path(tmp_path, writer)
    _save(sd, p, writer)
    m = _trained(seed=2)
    before = _snapshot(m.state_dict())
    with pytest.raises(RuntimeError, match=r"size mismatch for block\.0\.weight.*\[32, 17\].*\[32, 16\]"):
        fastpersist.load_state_dict(m, p, strict=False)
    _assert_bytes_equal(_snapshot(m.state_dict()), before)


@pytest.mark.parametrize("writer", WRITERS)
def test_dtype_mismatch_raises_unless_cast(tmp_path, writer):
    src = _trained(seed=1)
    sd = {k: (v.to(torch.float16) if v.is_floating_point() else v) for k, v in src.state_dict().items()}
    p = _path(tmp_path, writer)
    _save(sd, p, writer)
    m = _trained(seed=2)
    before = _snapshot(m.state_dict())
    with pytest.raises(fastpersist.StateDictMismatchError, match=r"dtype mismatch for .*torch\.float16.*cast=True"):
        fastpersist.load_state_dict(m, p)
    _assert_bytes_equal(_snapshot(m.state_dict()), before)
    want = Net()
    want.load_state_dict(sd)  # torch casts
    fastpersist.load_state_dict(m, p, cast=True)
    _assert_bytes_equal(_snapshot(m.state_dict()), _snapshot(want.state_dict()))


# --------------------------------------------------------------------------- failures mid-way


@pytest.mark.parametrize("writer", ["fastpersist", "safetensors"])
def test_read_error_midway_says_partly_overwritten(tmp_path, writer):
    sd = {f"w{i}": torch.randn(64, 1024) for i in range(6)}  # 6 x 256 KiB
    p = _path(tmp_path, writer)
    _save(sd, p, writer)
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    cfg = fastpersist.Config(engine="psync", chunk_size=64 << 10)
    with inject_fault("read", 3, "EIO"):
        with pytest.raises(fastpersist.PartialLoadError, match="partly overwritten") as ei:
            fastpersist.load_state_dict(target, p, config=cfg)
    e = ei.value
    assert isinstance(e, OSError) and e.errno == errno.EIO
    assert str(p) in str(e) and "offset" in str(e)
    fastpersist.load_state_dict(target, p, config=cfg)  # the same call works once the disk does
    _assert_bytes_equal(target, sd)


def test_corrupt_record_after_reading_started_says_partly_overwritten(tmp_path):
    sd = {"a": torch.randn(1000), "b": torch.randn(1000)}
    p = tmp_path / "c.pt"
    fastpersist.save(sd, p)
    entry = next(e for e in read_zip_index(p).entries if e.name.endswith("data/1"))
    data = bytearray(p.read_bytes())
    data[entry.data_offset + 7] ^= 0x40
    p.write_bytes(data)
    target = {"a": torch.zeros(1000), "b": torch.zeros(1000)}
    with pytest.raises(fastpersist.PartialLoadError, match="partly overwritten") as ei:
        fastpersist.load_state_dict(target, p)
    assert isinstance(ei.value.__cause__, ChecksumError)


def test_file_shrunk_after_index_read_says_partly_overwritten(tmp_path):
    """The index is read, then the payload is gone (file truncated in place while loading)."""
    from fastpersist.formats.torchindex import open_checkpoint
    from fastpersist.loadinto import _plan

    sd = {f"w{i}": torch.randn(50_000) for i in range(4)}
    p = tmp_path / "c.pt"
    fastpersist.save(sd, p)
    f = open_checkpoint(str(p))
    try:
        target = {k: torch.zeros_like(v) for k, v in sd.items()}
        pairs = [(k, target[k], f.info(k)) for k in sd]
        os.truncate(p, f.info("w2").file_offset + 1000)
        plan = _plan(f, pairs)
        from fastpersist.handles import handle_for

        with pytest.raises(fastpersist.PartialLoadError, match="partly overwritten.*shorter than its index"):
            plan.execute(handle_for(fastpersist.Config(), read=True), "the model")
    finally:
        os.close(f.fd)


# --------------------------------------------------------------------------- other sources


def test_legacy_non_zip_file_falls_back_to_torch_load(tmp_path):
    src = _trained(seed=1)
    p = tmp_path / "legacy.pt"
    torch.save(src.state_dict(), p, _use_new_zipfile_serialization=False)
    m = Net()
    fastpersist.load_state_dict(m, p)
    _assert_bytes_equal(_snapshot(m.state_dict()), _snapshot(src.state_dict()))
    sd = dict(src.state_dict())
    sd["block.0.weight"] = torch.zeros(1)
    torch.save(sd, p, _use_new_zipfile_serialization=False)
    before = _snapshot(m.state_dict())
    with pytest.raises(RuntimeError, match="size mismatch"):
        fastpersist.load_state_dict(m, p)
    _assert_bytes_equal(_snapshot(m.state_dict()), before)


@pytest.mark.parametrize("writer", ["fastpersist", "torch"])
def test_lightning_style_checkpoint_with_key(tmp_path, writer):
    src = _trained(seed=3)
    ckpt = {"epoch": 4, "global_step": 100, "state_dict": src.state_dict(),
            "optimizer_states": [{"state": {}, "param_groups": []}], "hyper_parameters": {"lr": 0.1}}
    p = tmp_path / "l.ckpt"
    _save(ckpt, p, writer)
    m = Net()
    r = fastpersist.load_state_dict(m, p, key="state_dict")
    assert r.missing_keys == [] and r.unexpected_keys == []
    _assert_bytes_equal(_snapshot(m.state_dict()), _snapshot(src.state_dict()))
    with pytest.raises(KeyError, match="no entry 'model'"):
        fastpersist.load_state_dict(m, p, key="model")
    with pytest.raises(RuntimeError, match="Unexpected key"):
        fastpersist.load_state_dict(m, p)  # the whole checkpoint is not the state dict


def test_adam_state_filled_in_place(tmp_path):
    torch.manual_seed(0)
    src = Net()
    opt = torch.optim.Adam(src.parameters(), lr=1e-3)
    for _ in range(2):
        src(torch.randint(0, 50, (8,))).sum().backward()
        opt.step()
    p = tmp_path / "o.pt"
    fastpersist.save({"model": src.state_dict(), "optimizer": opt.state_dict()}, p)

    # a fresh optimizer (no state yet): state read fresh
    m = Net()
    o = torch.optim.Adam(m.parameters(), lr=5.0)
    fastpersist.load_state_dict(m, p, key="model")
    fastpersist.load_state_dict(o, p, key="optimizer")
    ref = torch.optim.Adam(Net().parameters(), lr=5.0)
    ref.load_state_dict(torch.load(p)["optimizer"])
    assert o.param_groups[0]["lr"] == 1e-3
    for i, st in ref.state_dict()["state"].items():
        got = o.state_dict()["state"][i]
        for k in st:
            assert torch.equal(got[k], st[k]), (i, k)

    # an optimizer with state: filled in place
    m(torch.randint(0, 50, (8,))).sum().backward()
    o.step()
    ptrs = {(i, k): v.data_ptr() for i, st in o.state_dict()["state"].items() for k, v in st.items()}
    fastpersist.load_state_dict(o, p, key="optimizer")
    after = o.state_dict()["state"]
    assert {(i, k): v.data_ptr() for i, st in after.items() for k, v in st.items()} == ptrs
    for i, st in ref.state_dict()["state"].items():
        for k in st:
            assert torch.equal(after[i][k], st[k]), (i, k)


def test_state_dict_metadata_reaches_torch(tmp_path):
    """The file's _metadata (module versions) is what Module.load_state_dict sees."""
    src = _trained(seed=1)
    p = tmp_path / "c.pt"
    fastpersist.save(src.state_dict(), p)
    seen = {}

    def hook(module, state_dict, prefix, local_metadata, *args):
        seen[prefix] = local_metadata

    m = Net()
    m.bn._register_load_state_dict_pre_hook(hook, with_module=True)
    fastpersist.load_state_dict(m, p)
    assert seen["bn."].get("version") == 2


def test_bad_target_type(tmp_path):
    p = tmp_path / "c.pt"
    fastpersist.save({"a": torch.ones(1)}, p)
    with pytest.raises(TypeError, match="nn.Module"):
        fastpersist.load_state_dict([torch.ones(1)], p)


def test_tensors_are_written_directly_not_through_torch_copy(tmp_path):
    """The bytes land in the parameters before Module.load_state_dict runs: its copy_ is a
    self-copy, which torch skips (so no second pass over the model)."""
    src = _trained(seed=1)
    p = tmp_path / "c.pt"
    fastpersist.save(src.state_dict(), p)
    m = Net()
    calls = []

    def hook(module, state_dict, prefix, *args):
        for k, v in state_dict.items():
            if k.startswith(prefix) and k[len(prefix):] in dict(module.named_parameters(recurse=False)):
                param = dict(module.named_parameters(recurse=False))[k[len(prefix):]]
                calls.append(v.data_ptr() == param.data_ptr() and torch.equal(v, param))

    for mod in m.modules():
        mod._register_load_state_dict_pre_hook(hook, with_module=True)
    fastpersist.load_state_dict(m, p)
    assert calls and all(calls)
    assert torch.equal(m.block[0].weight, src.block[0].weight)


def test_collections_ordered_dict_target(tmp_path):
    p = tmp_path / "c.safetensors"
    fastpersist.save({"a": torch.arange(4.0)}, p)
    target = collections.OrderedDict(a=torch.zeros(4))
    fastpersist.load_state_dict(target, p)
    assert torch.equal(target["a"], torch.arange(4.0))
    with pytest.raises(ValueError, match="safetensors files are flat"):
        fastpersist.load_state_dict(target, p, key="x")


class WithExtra(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.extra = {"calls": 0, "scale": torch.zeros(2)}

    def get_extra_state(self):
        return self.extra

    def set_extra_state(self, state):
        self.extra = state


def test_extra_state_reaches_set_extra_state(tmp_path):
    src = WithExtra()
    src.extra = {"calls": 5, "scale": torch.tensor([1.5, 2.5])}
    p = tmp_path / "x.pt"
    fastpersist.save(src.state_dict(), p)
    m = WithExtra()
    fastpersist.load_state_dict(m, p)
    assert m.extra["calls"] == 5 and torch.equal(m.extra["scale"], torch.tensor([1.5, 2.5]))
    assert torch.equal(m.lin.weight, src.lin.weight)
    sd = dict(src.state_dict())
    del sd["_extra_state"]
    fastpersist.save(sd, p)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*_extra_state"):
        fastpersist.load_state_dict(WithExtra(), p)


# --------------------------------------------------------------------------- hostile files

def _hostile_files(tmp_path, writer):
    sd = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.tensor([1, 0, 1], dtype=torch.bool),
          "h": torch.arange(5, dtype=torch.bfloat16)}
    src = _path(tmp_path, writer, "src")
    _save(sd, src, writer)
    data = src.read_bytes()
    if writer == "safetensors":
        offsets = list(range(len(data)))
    else:
        idx = read_zip_index(src)
        keep = set(range(idx.cd_offset, len(data)))
        for e in idx.entries:
            keep.update(range(e.header_offset, min(e.header_offset + 38 + len(e.name.encode()), e.data_offset)))
            keep.update(range(e.data_offset, e.data_end))
        offsets = sorted(keep)
    return sd, data, offsets


@pytest.mark.parametrize("writer", WRITERS)
def test_hostile_files_give_the_values_or_a_clear_error_and_untouched_target(tmp_path, writer):
    """Truncated and flipped files: the saved values, or an error; an error other than
    PartialLoadError leaves the target's bytes as they were."""
    import pickle
    import zipfile

    from fastpersist.errors import CheckpointFormatError, UnsupportedLayoutError

    sd, data, offsets = _hostile_files(tmp_path, writer)
    p = _path(tmp_path, writer, "bad")
    variants = [data[:n] for n in range(0, len(data), max(1, len(data) // 300))]
    for off in offsets[:: max(1, len(offsets) // 600)]:
        bad = bytearray(data)
        bad[off] ^= 0x21
        variants.append(bytes(bad))
    outcomes = {"ok": 0, "error": 0, "partial": 0}
    for v in variants:
        p.write_bytes(v)
        target = {k: torch.full_like(t, 3) for k, t in sd.items()}
        before = _snapshot(target)
        try:
            fastpersist.load_state_dict(target, p)
        except fastpersist.PartialLoadError:
            outcomes["partial"] += 1
            continue
        except (KeyError, IndexError, struct_error(), UnicodeDecodeError, RecursionError) as e:
            if not isinstance(e, CheckpointFormatError):
                pytest.fail(f"raw {type(e).__name__}: {e}")
        except (CheckpointFormatError, ChecksumError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError,
                OSError, pickle.UnpicklingError, UnsupportedLayoutError, TypeError, AttributeError):
            _assert_bytes_equal(target, before)
            outcomes["error"] += 1
            continue
        _assert_bytes_equal(target, sd)
        outcomes["ok"] += 1
    assert outcomes["error"] > 0


def struct_error():
    import struct

    return struct.error


def test_scratch_records_in_bounded_batches(tmp_path, monkeypatch):
    """Records that cannot land in place go through scratch memory a batch at a time."""
    import fastpersist.loadinto as li

    monkeypatch.setattr(li, "SCRATCH_BATCH", 64 << 10)
    saved = {f"w{i}": torch.randn(64, 64) for i in range(6)}  # 16 KiB each
    saved["direct"] = torch.randn(1000)
    p = tmp_path / "c.pt"
    fastpersist.save(saved, p)
    target = {k: torch.zeros(64, 64).t() for k in saved if k != "direct"}  # non-contiguous targets
    target["direct"] = torch.zeros(1000)
    fastpersist.load_state_dict(target, p)
    for k, v in saved.items():
        assert torch.equal(target[k], v), k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_targets(tmp_path):
    src = _trained(seed=1)
    p = tmp_path / "c.pt"
    fastpersist.save(src.state_dict(), p)
    m = Net().cuda()
    fastpersist.load_state_dict(m, p)
    _assert_bytes_equal({k: v.cpu() for k, v in m.state_dict().items()}, _snapshot(src.state_dict()))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io")
@pytest.mark.parametrize("writer", ["fastpersist", "torch"])
def test_reads_only_what_the_target_needs(tmp_path, writer):
    """Bytes the process read (rchar, pread engine): the model's records, not the
    optimizer's 8 MiB next to them in the same file."""
    def rchar() -> int:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))

    src = _trained(seed=1)
    model_bytes = sum(v.numel() * v.element_size() for v in src.state_dict().values())
    p = tmp_path / "c.pt"
    _save({"model": src.state_dict(), "optimizer": {"big": torch.zeros(2 << 20)}}, p, writer)
    m = Net()
    a = rchar()
    fastpersist.load_state_dict(m, p, key="model", config=fastpersist.Config(engine="psync"))
    got = rchar() - a
    assert model_bytes <= got < model_bytes + (1 << 20), f"read {got} bytes for {model_bytes} bytes of model"
    _assert_bytes_equal(_snapshot(m.state_dict()), _snapshot(src.state_dict()))


def test_optimizer_group_mismatch_raises_before_reading(tmp_path):
    torch.manual_seed(0)
    src = Net()
    opt = torch.optim.Adam(src.parameters())
    src(torch.randint(0, 50, (8,))).sum().backward()
    opt.step()
    p = tmp_path / "o.pt"
    fastpersist.save(opt.state_dict(), p)
    m = Net()
    other = torch.optim.Adam([{"params": list(m.parameters())[:2]}, {"params": list(m.parameters())[2:]}])
    m(torch.randint(0, 50, (8,))).sum().backward()
    other.step()
    before = {(i, k): v.clone() for i, st in other.state_dict()["state"].items() for k, v in st.items()}
    with pytest.raises(RuntimeError, match="parameter groups do not match"):
        fastpersist.load_state_dict(other, p)
    after = {(i, k): v for i, st in other.state_dict()["state"].items() for k, v in st.items()}
    assert all(torch.equal(after[k], v) for k, v in before.items())
    with pytest.raises(RuntimeError, match="not an optimizer state dict"):
        fastpersist.load_state_dict(other, p, key="state")


def test_tensor_beyond_its_record_refused_even_if_overwritten(tmp_path):
    """The file of tests/test_open.py's test of the same name (torch.load refuses it: a dict
    key set twice, the first tensor reaching past its record): load_state_dict raised
    nothing and wrote the second tensor; now a clear error, the target untouched."""
    from test_open import _dead_tensor_beyond_its_record

    p = _dead_tensor_beyond_its_record(tmp_path)
    for strict in (True, False):
        target = {"x": torch.zeros(4, dtype=torch.int32)}
        with pytest.raises(fastpersist.errors.CheckpointFormatError, match="reaches beyond its record"):
            fastpersist.load_state_dict(target, p, strict=strict)
        assert torch.equal(target["x"], torch.zeros(4, dtype=torch.int32))
