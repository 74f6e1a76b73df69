"""Round trips: fastpersist.save / fastpersist.load against torch.save / torch.load."""

from __future__ import annotations

import collections
import io
import os
import pathlib
import pickle
import stat
import tempfile
import warnings

import pytest
import torch

import fastpersist
from fastpersist.errors import ChecksumError
from fastpersist.formats.zipindex import read_zip_index

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def torch_roundtrip(obj, tmp_path, name="reference.pt"):
    """What stock torch.save + torch.load give for ``obj``."""
    ref = tmp_path / name
    torch.save(obj, ref)
    return torch.load(ref, weights_only=False)


def check_roundtrip(obj, tmp_path, assert_same, name="ckpt.pt", weights_only=False):
    path = tmp_path / name
    fastpersist.save(obj, path)
    want = torch_roundtrip(obj, tmp_path)
    assert_same(fastpersist.load(path, weights_only=weights_only), want)
    assert_same(torch.load(path, weights_only=weights_only), want)
    return path


def _saveable_dtypes() -> list[torch.dtype]:
    """Every dtype that torch.save/torch.load round-trips on this torch."""
    found = []
    names = sorted(n for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype))
    for d in sorted({getattr(torch, n) for n in names}, key=str):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t = torch.zeros(3, dtype=d)
                buf = io.BytesIO()
                torch.save(t, buf)
                buf.seek(0)
                torch.load(buf)
        except Exception:
            continue
        found.append(d)
    return found


SAVEABLE_DTYPES = _saveable_dtypes()


def _random_tensor(dtype: torch.dtype, shape, gen: torch.Generator) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    nbytes = n * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


def test_expected_dtypes_are_covered():
    for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.bool, torch.complex64,
              torch.complex128, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        assert d in SAVEABLE_DTYPES
    for name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
        if hasattr(torch, name):
            assert getattr(torch, name) in SAVEABLE_DTYPES


@pytest.mark.parametrize("dtype", SAVEABLE_DTYPES, ids=str)
def test_every_dtype(dtype, tmp_path, assert_same):
    gen = torch.Generator().manual_seed(1)
    obj = {
        "matrix": _random_tensor(dtype, (5, 7), gen),
        "scalar": _random_tensor(dtype, (), gen),
        "empty": _random_tensor(dtype, (0, 3), gen),
        "big": _random_tensor(dtype, (3, 4099), gen),
    }
    obj["transposed"] = obj["matrix"].t()
    check_roundtrip(obj, tmp_path, assert_same, weights_only=True)


@pytest.mark.parametrize("dtype", ["qint8", "quint8", "qint32"])
def test_quantized(dtype, tmp_path, assert_same):
    if not hasattr(torch, dtype):
        pytest.skip(f"torch.{dtype} does not exist")
    qd = getattr(torch, dtype)
    x = torch.randn(4, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            per_tensor = torch.quantize_per_tensor(x, 0.05, 3, qd)
            per_channel = torch.quantize_per_channel(x, torch.rand(4) + 0.01, torch.zeros(4, dtype=torch.long), 0, qd)
        except (RuntimeError, NotImplementedError) as e:
            pytest.skip(f"quantization unavailable: {e}")
        obj = {"pt": per_tensor, "pc": per_channel, "plain": torch.arange(5)}
        check_roundtrip(obj, tmp_path, assert_same)


def test_nested_containers_and_python_values(tmp_path, assert_same):
    t = torch.randn(3, 3)
    obj = {
        "list": [t, 1, 2.5, "text", None, True, b"bytes", [torch.ones(2)]],
        "tuple": (torch.zeros(1), ("deep", (torch.arange(4),))),
        "od": collections.OrderedDict(b=1, a=torch.tensor(7)),
        "nested": {"a": {"b": {"c": torch.full((2,), 3.0)}}},
        "int_keys": {1: "one", 2: torch.ones(1)},
        "float": float("inf"),
        "set": {1, 2, 3},
        "big_int": 2**80,
        "complex": 1 + 2j,
        "slice": slice(1, 5, 2),
        "dtype": torch.float16,
        "device": torch.device("cpu"),
        "size": torch.Size([2, 3]),
    }
    check_roundtrip(obj, tmp_path, assert_same)


def test_bare_tensor_and_non_tensor_objects(tmp_path, assert_same):
    check_roundtrip(torch.arange(10), tmp_path, assert_same, name="t.pt")
    check_roundtrip({"step": 3, "name": "x"}, tmp_path, assert_same, name="d.pt")
    check_roundtrip([], tmp_path, assert_same, name="l.pt")
    check_roundtrip(None, tmp_path, assert_same, name="n.pt")


def test_zero_dim_and_empty(tmp_path, assert_same):
    obj = {
        "scalar": torch.tensor(3.5),
        "int_scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0),
        "empty2d": torch.empty(0, 5, dtype=torch.int32),
        "empty_view": torch.arange(10)[5:5],
    }
    check_roundtrip(obj, tmp_path, assert_same, weights_only=True)


def test_shared_storages_and_views_keep_aliasing(tmp_path, assert_same):
    base = torch.arange(100, dtype=torch.float32)
    obj = {
        "base": base,
        "slice": base[10:20],
        "strided": base[::3],
        "matrix_t": base.view(10, 10).t(),
        "same_object_twice": [base, base],
        "narrow": base.view(10, 10)[2:5, 3:7],
        "other": torch.ones(4),
    }
    path = check_roundtrip(obj, tmp_path, assert_same, weights_only=True)
    got = fastpersist.load(path)
    assert got["slice"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
    got["base"][15] = -1.0  # writes through every alias, as after torch.load
    assert got["slice"][5].item() == -1.0
    assert got["narrow"].is_contiguous() is False
    # one storage record for the shared base, one for "other"
    data_records = [e for e in read_zip_index(path).entries if "/data/" in e.name]
    assert len(data_records) == 2


def test_module_and_adam_state(tmp_path, assert_same):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3, "rng": torch.get_rng_state()}
    path = check_roundtrip(state, tmp_path, assert_same, weights_only=True)
    got = fastpersist.load(path)
    model2 = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
    )
    model2.load_state_dict(got["model"])
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    opt2.load_state_dict(got["optimizer"])
    x = torch.randn(4, 8)
    model.eval()
    model2.eval()
    assert torch.equal(model(x), model2(x))


def test_parameters_and_requires_grad(tmp_path, assert_same):
    p = torch.nn.Parameter(torch.randn(3, 2))
    obj = {"param": p, "grad_tensor": torch.randn(2, requires_grad=True), "module": torch.nn.Linear(2, 2)}
    path = tmp_path / "m.pt"
    fastpersist.save(obj, path)
    want = torch_roundtrip(obj, tmp_path)
    got = fastpersist.load(path, weights_only=False)
    assert_same(got["param"], want["param"])
    assert_same(got["grad_tensor"], want["grad_tensor"])
    assert isinstance(got["module"], torch.nn.Linear)
    assert_same(got["module"].state_dict(), want["module"].state_dict())


class Custom:
    """A class weights_only loading does not allow."""

    def __init__(self, v):
        self.v = v

    def __eq__(self, other):
        return isinstance(other, Custom) and other.v == self.v


def test_weights_only_refuses_arbitrary_objects_like_torch(tmp_path):
    path = tmp_path / "unsafe.pt"
    fastpersist.save({"custom": Custom(3), "t": torch.ones(1)}, path)
    with pytest.raises(pickle.UnpicklingError) as ours:
        fastpersist.load(path)  # weights_only defaults to True, as in torch.load
    with pytest.raises(pickle.UnpicklingError) as theirs:
        torch.load(path)
    assert str(ours.value) == str(theirs.value)
    assert fastpersist.load(path, weights_only=False)["custom"] == Custom(3)


def test_force_weights_only_env(tmp_path, monkeypatch):
    path = tmp_path / "unsafe.pt"
    fastpersist.save({"custom": Custom(4)}, path)
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(pickle.UnpicklingError):
        fastpersist.load(path, weights_only=False)
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.warns(UserWarning):
        assert fastpersist.load(path)["custom"] == Custom(4)


def test_pickle_module_and_encoding_args(tmp_path, assert_same):
    path = tmp_path / "p.pt"
    obj = {"a": torch.arange(3), "s": "text"}
    fastpersist.save(obj, path)
    want = torch_roundtrip(obj, tmp_path)
    assert_same(fastpersist.load(path, pickle_module=pickle, weights_only=False), want)
    assert_same(fastpersist.load(path, None, pickle, weights_only=False, encoding="latin1"), want)
    with pytest.raises(RuntimeError):  # torch's rule: no explicit pickle_module with weights_only
        fastpersist.load(path, pickle_module=pickle, weights_only=True)


def test_mmap_with_stock_and_fastpersist_load(tmp_path, assert_same):
    obj = {"w": torch.randn(64, 65), "b": torch.arange(7)}
    path = tmp_path / "m.pt"
    fastpersist.save(obj, path)
    want = torch_roundtrip(obj, tmp_path)
    assert_same(torch.load(path, mmap=True, weights_only=True), want)
    assert_same(fastpersist.load(path, mmap=True), want)


@pytest.mark.parametrize(
    "map_location",
    ["cpu", torch.device("cpu"), {"cpu": "cpu"}, (lambda storage, loc: storage), "meta"],
    ids=["str", "device", "dict", "callable", "meta"],
)
def test_map_location(map_location, tmp_path, assert_same):
    obj = {"w": torch.randn(5, 3), "v": torch.arange(4)[1:]}
    path = tmp_path / "m.pt"
    fastpersist.save(obj, path)
    torch.save(obj, tmp_path / "ref.pt")
    want = torch.load(tmp_path / "ref.pt", map_location=map_location)
    got = fastpersist.load(path, map_location=map_location)
    assert_same(got, want)


def test_loads_files_written_by_plain_torch_save_through_fast_path(tmp_path, assert_same):
    obj = {"a": torch.randn(100), "b": torch.randn(3, 3).t(), "c": torch.tensor(1)}
    path = tmp_path / "plain.pt"
    torch.save(obj, path)  # 64-byte alignment, no fastpersist
    got = fastpersist.load(path)
    assert_same(got, torch.load(path))
    # fast path: every storage is a slice of one buffer holding the whole file
    idx = read_zip_index(path)
    offsets = {e.name.split("/")[-1]: e.data_offset for e in idx.entries if "/data/" in e.name}
    ptrs = sorted(t.untyped_storage().data_ptr() for t in got.values())
    assert [p - ptrs[0] for p in ptrs] == sorted(o - min(offsets.values()) for o in offsets.values())


def test_fast_loaded_tensors_outlive_each_other(tmp_path):
    path = tmp_path / "x.pt"
    fastpersist.save({"a": torch.arange(1000.0), "b": torch.full((1000,), 2.0)}, path)
    got = fastpersist.load(path)
    b = got.pop("b")
    del got
    import gc

    gc.collect()
    assert torch.equal(b, torch.full((1000,), 2.0))


def test_legacy_format_and_file_objects_go_to_torch(tmp_path, assert_same):
    obj = {"a": torch.arange(6).view(2, 3)}
    legacy = tmp_path / "legacy.pt"
    torch.save(obj, legacy, _use_new_zipfile_serialization=False)
    assert_same(fastpersist.load(legacy), torch.load(legacy))
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    assert_same(fastpersist.load(buf), obj)


def test_save_to_file_object_is_a_clear_type_error():
    with pytest.raises(TypeError, match="torch.save"):
        fastpersist.save({"a": torch.ones(1)}, io.BytesIO())


def test_pathlike_non_ascii_and_overwrite(tmp_path, assert_same):
    path = pathlib.Path(tmp_path) / "prüfpunkt ü.pt"
    fastpersist.save({"v": 1}, path)
    os.chmod(path, 0o600)
    fastpersist.save({"v": 2, "t": torch.ones(2)}, path)
    assert fastpersist.load(path)["v"] == 2
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # replaced file keeps its permissions
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


def test_symlink_target_is_replaced(tmp_path):
    real = tmp_path / "real.pt"
    link = tmp_path / "link.pt"
    fastpersist.save({"v": 1}, real)
    link.symlink_to(real)
    fastpersist.save({"v": 2}, link)
    assert link.is_symlink()
    assert torch.load(real)["v"] == 2


def test_bad_destinations(tmp_path):
    with pytest.raises(FileNotFoundError, match="Parent directory"):
        fastpersist.save({"a": 1}, tmp_path / "missing" / "x.pt")
    with pytest.raises(IsADirectoryError):
        fastpersist.save({"a": 1}, tmp_path)


def test_unpicklable_object_leaves_nothing(tmp_path):
    path = tmp_path / "x.pt"
    fastpersist.save({"v": 1}, path)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        fastpersist.save({"f": lambda: 0}, path)
    assert torch.load(path)["v"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["x.pt"]


def test_thousands_of_small_tensors(tmp_path, assert_same):
    gen = torch.Generator().manual_seed(3)
    obj = {f"layer{i}.w": torch.randn(i % 7 + 1, generator=gen) for i in range(3000)}
    obj["shared"] = [obj["layer5.w"], obj["layer5.w"][1:]]
    path = check_roundtrip(obj, tmp_path, assert_same, weights_only=True)
    assert fastpersist.verify(path).ok


def test_load_detects_corruption_and_checksum_can_be_disabled(tmp_path):
    path = tmp_path / "c.pt"
    fastpersist.save({"w": torch.zeros(1000)}, path)
    entry = next(e for e in read_zip_index(path).entries if e.name.endswith("data/0"))
    with open(path, "r+b") as f:
        f.seek(entry.data_offset + 100)
        f.write(b"\x01")
    with pytest.raises(ChecksumError, match="data/0") as info:
        fastpersist.load(path)
    assert info.value.records == [entry.name]
    got = fastpersist.load(path, config=fastpersist.Config(checksum=False))
    assert got["w"].count_nonzero().item() == 1


def test_safetensors_by_extension(tmp_path):
    pytest.importorskip("fastpersist.formats.safetensors")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    obj = {"a": torch.randn(3, 5), "b": torch.arange(10, dtype=torch.int32)}
    path = tmp_path / "w.safetensors"
    fastpersist.save(obj, path)
    for got in (fastpersist.load(path), safetensors_torch.load_file(str(path))):
        assert got.keys() == obj.keys()
        for k in obj:
            assert torch.equal(got[k], obj[k])
    with pytest.raises(TypeError):
        fastpersist.save([torch.ones(1)], tmp_path / "l.safetensors")


@pytest.mark.gpu
def test_cuda_tensors(tmp_path, assert_same):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    obj = {"gpu": torch.randn(1000, 3, device="cuda"), "cpu": torch.arange(5), "view": None}
    obj["view"] = obj["gpu"][10:20].t()
    path = tmp_path / "g.pt"
    fastpersist.save(obj, path)
    want = torch_roundtrip(obj, tmp_path)
    assert_same(fastpersist.load(path), want)
    assert_same(torch.load(path), want)
    on_cpu = fastpersist.load(path, map_location="cpu")
    assert_same(on_cpu, torch.load(tmp_path / "reference.pt", map_location="cpu"))
    to_gpu = fastpersist.load(path, map_location="cuda:0")
    assert to_gpu["cpu"].device.type == "cuda"


# ---------------------------------------------------------------- property test

_PROPERTY_DTYPES = SAVEABLE_DTYPES

_shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)
_leaf = st.one_of(
    st.tuples(st.sampled_from(_PROPERTY_DTYPES), _shapes, st.integers(0, 2**31)),
    st.integers(),
    st.text(max_size=5),
    st.none(),
)
_state = st.recursive(
    _leaf,
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=4), kids, max_size=4)),
    max_leaves=12,
)


def _materialize(spec):
    if isinstance(spec, tuple):
        dtype, shape, seed = spec
        return _random_tensor(dtype, shape, torch.Generator().manual_seed(seed))
    if isinstance(spec, list):
        return [_materialize(s) for s in spec]
    if isinstance(spec, dict):
        return {k: _materialize(v) for k, v in spec.items()}
    return spec


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=_state)
def test_property_random_state_dicts(spec, assert_same):
    obj = _materialize(spec)
    with tempfile.TemporaryDirectory() as d:
        tmp = pathlib.Path(d)
        check_roundtrip(obj, tmp, assert_same, weights_only=True)
        assert fastpersist.verify(tmp / "ckpt.pt").ok


def test_fallback_to_torchs_writer_round_trips(tmp_path, monkeypatch, assert_same):
    """A save the fast layout cannot take (UnsupportedLayoutError: an old torch, an
    object the planner refuses) is written by torch's own writer into the temporary
    file. torch names a path's archive after the file name up to its last dot and
    refuses an empty one, which the temporary names (.fp-tmp-HASH-...) would give:
    every fallback save failed with "invalid file name" on every torch."""
    from fastpersist.errors import UnsupportedLayoutError
    from fastpersist.formats import torchzip

    def refuse(*args, **kwargs):
        raise UnsupportedLayoutError("refused by the test")

    monkeypatch.setattr(torchzip, "stream_save_torch", refuse)
    obj = {"w": torch.randn(3, 5), "step": 7, "view": torch.arange(10)[2:6]}
    path = tmp_path / "ckpt.pt"
    fastpersist.save(obj, path)
    assert_same(torch.load(path, weights_only=True), obj)
    assert_same(fastpersist.load(path, weights_only=True), obj)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]
