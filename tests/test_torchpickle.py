"""The pickle modules of the torch-format planner (fastpersist.formats.torchpickle).

The fast module must write torch's own ``data.pkl`` byte for byte, name storages
with torch's keys and refuse what torch refuses; when it is not verified for the
running torch the plain capture module is used and saving still works.
"""

from __future__ import annotations

import collections
import io
import pickle
import warnings
import zipfile

import pytest
import torch

import fastpersist
from fastpersist import _compat
from fastpersist.bench.state import iter_tensors
from fastpersist.formats import torchpickle
from fastpersist.formats.torchpickle import capture_module, data_pkl, fast_capture_module

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _all_dtypes() -> list[torch.dtype]:
    found = {}
    for name in dir(torch):
        value = getattr(torch, name)
        if isinstance(value, torch.dtype):
            found[str(value)] = value
    return [found[k] for k in sorted(found)]


def _zeros(dtype: torch.dtype, shape=(2, 3)):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return torch.zeros(*shape, dtype=dtype)
        except (RuntimeError, TypeError, NotImplementedError):
            return None


#: every dtype torch can make (dense) zeros of
ZEROS_DTYPES = [dt for dt in _all_dtypes() if _zeros(dt) is not None]


def _savable(dtype: torch.dtype) -> bool:
    try:
        data_pkl(_zeros(dtype))
        return True
    except Exception:
        return False


def _complex() -> torch.Tensor:
    return torch.complex(torch.arange(4.0), torch.ones(4))


class MyTensor(torch.Tensor):
    pass


def _with_attribute():
    t = torch.arange(5.0)
    t.foo = 1
    return {"t": t, "plain": torch.ones(2)}


def _shared_views():
    base = torch.arange(24, dtype=torch.float32)
    return {"base": base, "slice": base[3:11], "grid": base.view(4, 6), "t": base.view(4, 6).t(), "step": base[::5]}


def _same_twice():
    t = torch.randn(3, 4)
    return [t, t, {"again": t}]


def _module_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model.state_dict()


def _adam_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3}


def _nested():
    return {
        "a": [torch.ones(2), (torch.zeros(1, dtype=torch.int8), 7, "seven", None), 2.5],
        "b": collections.OrderedDict(x=torch.arange(3), y={"deep": [torch.eye(2), b"raw", True]}),
        "c": (1, 2, (3, torch.tensor(4))),
        "meta": {"shape": torch.Size([2, 3]), "dtype": torch.float16, "device": torch.device("cpu"), "n": 10**30},
        "empty": {},
    }


def _typed_and_untyped():
    t = torch.arange(6, dtype=torch.float64)
    return {
        "untyped": torch.arange(6, dtype=torch.uint8).untyped_storage(),
        "typed": t._typed_storage(),
        "tensor_of_typed": t,
        "bare_typed": torch.ones(3, dtype=torch.int16)._typed_storage(),
    }


def _grad_tensors():
    leaf = torch.ones(2, 2, requires_grad=True)
    return {"leaf": leaf, "nonleaf": leaf * 2, "detached": (leaf * 3).detach()}


def _hooked():
    t = torch.ones(3, requires_grad=True)
    t.register_hook(lambda g: g)
    return {"hooked": t}


OBJECTS = {
    "scalar_0d": lambda: torch.tensor(2.5, dtype=torch.float64),
    "scalar_0d_int": lambda: {"s": torch.tensor(3), "t": torch.tensor(True)},
    "empty": lambda: torch.empty(0),
    "empty_2d": lambda: {"a": torch.empty(0, 3), "b": torch.empty(2, 0, dtype=torch.int32), "c": torch.empty(0)},
    "noncontiguous": lambda: torch.arange(100.0)[10:90:3],
    "transposed": lambda: torch.randn(5, 7).t(),
    "expanded_stride0": lambda: torch.ones(3, 1).expand(3, 4),
    "permuted": lambda: torch.randn(2, 3, 4).permute(2, 0, 1),
    "channels_last": lambda: torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
    "shared_views": _shared_views,
    "same_tensor_twice": _same_twice,
    "requires_grad": _grad_tensors,
    "hooked": _hooked,
    "parameter": lambda: {"p": torch.nn.Parameter(torch.randn(3)), "frozen": torch.nn.Parameter(torch.ones(2), requires_grad=False)},
    "parameter_sharing_with_tensor": lambda: (lambda p: {"p": p, "data": p.data, "view": p.data[1:]})(torch.nn.Parameter(torch.randn(4))),
    "conj": lambda: _complex().conj(),
    "neg": lambda: torch._neg_view(_complex()),
    "conj_and_plain_share": lambda: (lambda c: {"c": c, "conj": c.conj(), "neg": torch._neg_view(c)})(_complex()),
    "conj_transposed": lambda: torch.complex(torch.randn(2, 3), torch.randn(2, 3)).conj().t(),
    "untyped_storage": lambda: torch.arange(6, dtype=torch.uint8).untyped_storage(),
    "typed_storage": lambda: torch.arange(6.0)._typed_storage(),
    "storages": _typed_and_untyped,
    "nested": _nested,
    "python_only": lambda: {"a": 1, "b": [1.5, "x", None], "c": (True, b"y")},
    "tensor_with_attribute": _with_attribute,
    "tensor_subclass": lambda: {"sub": torch.arange(4.0).as_subclass(MyTensor), "plain": torch.ones(1)},
    "module_state_dict": _module_state,
    "adam_state_dict": _adam_state,
    "quantized": lambda: {"q": torch.quantize_per_tensor(torch.randn(4), 0.1, 2, torch.qint8), "x": torch.ones(2)},
    "quantized_per_channel": lambda: torch.quantize_per_channel(
        torch.randn(3, 4), torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0, 1, 2]), 0, torch.quint8
    ),
    "sparse_coo": lambda: {"s": torch.eye(3).to_sparse(), "d": torch.ones(3)},
    "sparse_csr": lambda: torch.eye(3).to_sparse_csr(),
    "meta_device": lambda: {"m": torch.empty(3, 4, device="meta"), "c": torch.ones(2)},
    "many_small": lambda: {f"t{i}": torch.full((i % 7 + 1,), float(i)) for i in range(200)},
}


@pytest.mark.parametrize("name", sorted(OBJECTS))
def test_fast_data_pkl_equals_torch(name):
    obj = OBJECTS[name]()
    assert data_pkl(obj, fast_capture_module()) == data_pkl(obj)


@pytest.mark.parametrize("dtype", ZEROS_DTYPES, ids=str)
def test_fast_data_pkl_equals_torch_for_every_dtype(dtype):
    z = _zeros(dtype)
    obj = {"t": z, "row": z[1], "tail": z[:, 1:], "t2": z.t(), "other": torch.ones(2)}
    try:
        want = data_pkl(obj)
    except Exception as e:  # torch cannot save this dtype: the fast module fails the same way
        with pytest.raises(type(e)) as info:
            data_pkl(obj, fast_capture_module())
        assert str(info.value) == str(e)
        return
    assert data_pkl(obj, fast_capture_module()) == want


def test_dtype_table_covers_the_interesting_dtypes():
    required = [
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
        torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex32, torch.complex64,
        torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    ]
    savable = [dt for dt in ZEROS_DTYPES if _savable(dt)]
    for dt in required:
        assert dt in savable, dt


def test_probe_state_itself_matches():
    state = torchpickle.probe_state()
    assert data_pkl(state, fast_capture_module()) == data_pkl(state)


def test_data_pkl_equals_torch_save_with_default_pickle():
    obj = _shared_views()
    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        (name,) = [n for n in z.namelist() if n.endswith("/data.pkl")]
        assert z.read(name) == data_pkl(obj)


# ---------------------------------------------------------------- the fast path is taken


def _pickler(module=None):
    """A Pickler of the module as torch's ``_save`` builds it (subclass defining ``persistent_id``)."""
    module = module or fast_capture_module()

    class Pickler(module.Pickler):
        def persistent_id(self, obj):
            return None

    return Pickler(io.BytesIO(), 2)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(10.0),
        lambda: torch.arange(10.0)[2:8],
        lambda: torch.randn(3, 4).t(),
        lambda: torch.tensor(1.5),
        lambda: torch.empty(0),
        lambda: torch.ones(2, requires_grad=True),
        lambda: _complex().conj(),
        lambda: torch.zeros(3, dtype=torch.bfloat16),
        lambda: torch.zeros(3, dtype=torch.bool),
    ],
    ids=["plain", "view", "transposed", "0d", "empty", "requires_grad", "conj", "bfloat16", "bool"],
)
def test_reducer_override_gives_torchs_v2_reduction(make):
    t = make()
    got = _pickler().reducer_override(t)
    assert isinstance(got, tuple)
    want = t.__reduce_ex__(2)
    assert got[0] is torch._utils._rebuild_tensor_v2 is want[0]
    ref = got[1][0]
    assert ref.storage is not None and ref.storage.data_ptr() == t.untyped_storage().data_ptr()
    assert ref.typed == t.dtype
    assert got[1][1:] == want[1][1:]  # offset, size, stride, requires_grad, hooks (, metadata)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_reducer_override_gives_v3_for_new_dtypes(dtype):
    t = torch.zeros(2, 3, dtype=dtype)[:, 1:]
    got = _pickler().reducer_override(t)
    want = t.__reduce_ex__(2)
    assert got[0] is torch._utils._rebuild_tensor_v3 is want[0]
    assert got[1][0].typed is None
    assert got[1][1:] == want[1][1:]
    assert got[1][-1] == dtype


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.nn.Parameter(torch.ones(3)),
        lambda: _with_attribute()["t"],
        lambda: torch.eye(3).to_sparse(),
        lambda: torch.eye(3).to_sparse_csr(),
        lambda: torch.arange(4.0).as_subclass(MyTensor),
        lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8),
        lambda: torch.empty(3, device="meta"),
        lambda: _hooked()["hooked"],
        lambda: "not a tensor",
        lambda: torch.ones(2).untyped_storage(),
        lambda: [torch.ones(2)],
    ],
    ids=["parameter", "dict", "sparse", "csr", "subclass", "quantized", "meta", "hooked", "str", "storage", "list"],
)
def test_reducer_override_leaves_the_rest_to_torch(make):
    assert _pickler().reducer_override(make()) is NotImplemented


def test_fast_module_runs_reducer_override_during_save(monkeypatch):
    calls = []
    module = fast_capture_module()
    original = module.Pickler.reducer_override

    def spy(self, obj):
        result = original(self, obj)
        calls.append((type(obj), result is not NotImplemented))
        return result

    monkeypatch.setattr(module.Pickler, "reducer_override", spy)
    data_pkl({"a": torch.ones(3), "b": torch.nn.Parameter(torch.ones(2))}, module)
    assert (torch.Tensor, True) in calls  # the plain tensor went the fast way
    assert (torch.nn.Parameter, False) in calls


# ---------------------------------------------------------------- storage keys


def _on_new_calls(module_factory, obj):
    calls = []
    data_pkl(obj, module_factory(lambda key, storage: calls.append((key, storage))))
    return calls


@pytest.mark.parametrize("factory", [fast_capture_module, capture_module], ids=["fast", "plain"])
def test_on_new_once_per_storage_in_first_seen_order(factory):
    a = torch.arange(10.0)
    b = torch.ones(3, dtype=torch.int64)
    c = torch.zeros(2, dtype=torch.uint16)
    raw = torch.arange(5, dtype=torch.uint8).untyped_storage()
    e1, e2 = torch.empty(0), torch.empty(0)
    p = torch.nn.Parameter(torch.randn(4))
    obj = {
        "a": a,
        "a_view": a[2:],
        "b": b,
        "a_again": a.view(2, 5).t(),
        "raw": raw,
        "c": c,
        "b_typed": b._typed_storage(),
        "e1": e1,
        "e2": e2,
        "p": p,
        "p_data": p.data[1:],
        "conj": _complex().conj(),
    }
    calls = _on_new_calls(factory, obj)
    keys = [k for k, _ in calls]
    assert keys == [str(i) for i in range(len(calls))]
    expected = [a, b, raw, c, e1, e2, p]
    assert len(calls) == len(expected) + 1
    for (key, storage), want in zip(calls, expected):
        want_storage = want if isinstance(want, torch.UntypedStorage) else want.untyped_storage()
        assert isinstance(storage, torch.UntypedStorage), key
        assert storage.data_ptr() == want_storage.data_ptr(), key
        assert storage.nbytes() == want_storage.nbytes(), key
    assert calls[-1][1].nbytes() == obj["conj"].untyped_storage().nbytes()


def test_fast_and_plain_modules_name_the_same_storages():
    state = {**_shared_views(), **_typed_and_untyped(), "adam": _adam_state(), "nested": _nested()}
    fast = [(k, s.data_ptr(), s.nbytes()) for k, s in _on_new_calls(fast_capture_module, state)]
    plain = [(k, s.data_ptr(), s.nbytes()) for k, s in _on_new_calls(capture_module, state)]
    assert fast == plain


def test_on_new_keys_restart_for_each_save():
    seen = []
    module = fast_capture_module(lambda key, storage: seen.append(key))
    data_pkl({"a": torch.ones(1), "b": torch.ones(1)}, module)
    data_pkl({"c": torch.ones(1)}, module)
    assert seen == ["0", "1", "0"]


# ---------------------------------------------------------------- what torch refuses


def _different_dtype_views():
    t = torch.zeros(4)
    return {"f": t, "i": t.view(torch.int32)}


def _tensor_and_its_untyped_storage():
    t = torch.zeros(4)
    return {"t": t, "s": t.untyped_storage()}


def _typed_storages_of_two_dtypes():
    t = torch.zeros(4)
    return {"a": t._typed_storage(), "b": t.view(torch.int16)._typed_storage()}


@pytest.mark.parametrize("make", [_different_dtype_views, _tensor_and_its_untyped_storage, _typed_storages_of_two_dtypes])
@pytest.mark.parametrize("factory", [fast_capture_module, capture_module, None], ids=["fast", "plain", "torch"])
def test_views_of_one_storage_with_different_dtypes_raise(make, factory):
    obj = make()
    with pytest.raises(RuntimeError, match="view the same data as different types"):
        if factory is None:
            torch.save(obj, io.BytesIO())
        else:
            torch.save(obj, io.BytesIO(), pickle_module=factory())


def test_unpicklable_value_raises_like_torch():
    obj = {"t": torch.ones(2), "f": lambda: None}
    with pytest.raises(Exception) as want:
        data_pkl(obj)
    with pytest.raises(type(want.value)):
        data_pkl(obj, fast_capture_module())


# ---------------------------------------------------------------- the probe and the fallback


def pick_name(module) -> str:
    return module.__name__


def test_fast_pickling_ok_on_this_torch():
    assert torchpickle.fast_pickling_ok() is True
    assert pick_name(torchpickle.pick_capture_module()) == "fastpersist_fast"


def test_probe_failure_means_plain_module(monkeypatch):
    monkeypatch.setattr(_compat, "_RESULTS", {})  # probe again, restored after the test

    def broken(on_new=None):
        raise RuntimeError("this torch is different")

    monkeypatch.setattr(torchpickle, "fast_capture_module", broken)
    assert torchpickle.fast_pickling_ok() is False
    assert pick_name(torchpickle.pick_capture_module()) == "fastpersist_capture"


def test_probe_mismatch_means_plain_module(monkeypatch):
    monkeypatch.setattr(_compat, "_RESULTS", {})
    monkeypatch.setattr(torchpickle, "fast_capture_module", lambda on_new=None: capture_module(on_new))
    real = torchpickle.data_pkl
    monkeypatch.setattr(
        torchpickle, "data_pkl", lambda obj, module=pickle: real(obj, module) + (b"!" if module is not pickle else b"")
    )
    assert torchpickle.fast_pickling_ok() is False


def _round_trip_state():
    state = {f"layer{i}.weight": torch.randn(i + 1, 3) for i in range(20)}
    state.update(_shared_views())
    state["adam"] = _adam_state()
    state["half"] = torch.randn(5).to(torch.bfloat16)
    state["u16"] = torch.zeros(3, dtype=torch.uint16)
    state["empty"] = torch.empty(0)
    state["step"] = 12
    return state


def _assert_tensors_equal(got, want):
    g, w = dict(iter_tensors(got)), dict(iter_tensors(want))
    assert g.keys() == w.keys()
    for k in w:
        assert g[k].dtype == w[k].dtype, k
        assert g[k].shape == w[k].shape, k
        assert g[k].is_conj() == w[k].is_conj() and g[k].is_neg() == w[k].is_neg(), k
        assert torch.equal(_raw(g[k]), _raw(w[k])), k


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values as bytes (torch.equal is not implemented for every dtype)."""
    return t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def test_forced_plain_pickling_still_round_trips(tmp_path, monkeypatch, assert_same):
    monkeypatch.setitem(_compat._RESULTS, "fast_pickle", _compat.Status(False, "forced by the test"))

    def must_not_run(on_new=None):
        raise AssertionError("fast module used although not verified")

    monkeypatch.setattr(torchpickle, "fast_capture_module", must_not_run)
    assert pick_name(torchpickle.pick_capture_module()) == "fastpersist_capture"
    state = _round_trip_state()
    path = tmp_path / "plain.pt"
    fastpersist.save(state, path)
    stock = torch.load(path, weights_only=True)
    _assert_tensors_equal(stock, state)
    assert_same(stock, state)
    ours = fastpersist.load(path, weights_only=True)
    _assert_tensors_equal(ours, stock)
    assert_same(ours, state)
    # the same data.pkl as with the fast module
    monkeypatch.undo()
    fast_path = tmp_path / "fast.pt"
    fastpersist.save(state, fast_path)
    assert _member(fast_path, "data.pkl") == _member(path, "data.pkl")


def test_save_uses_fast_module_when_verified(tmp_path, monkeypatch):
    assert torchpickle.fast_pickling_ok()
    made = []
    real = torchpickle.fast_capture_module

    def counting(on_new=None):
        made.append(1)
        return real(on_new)

    monkeypatch.setattr(torchpickle, "fast_capture_module", counting)
    fastpersist.save({"a": torch.ones(3)}, tmp_path / "x.pt")
    assert made


# ---------------------------------------------------------------- whole files


def _member(path, short: str) -> bytes:
    with zipfile.ZipFile(path) as z:
        (name,) = [n for n in z.namelist() if n.split("/", 1)[1] == short]
        return z.read(name)


def _many_tensor_state(n: int = 600) -> dict:
    g = torch.Generator().manual_seed(1)
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.bool, torch.uint16,
              torch.complex64, torch.float8_e4m3fn]
    state: dict = {}
    for i in range(n):
        dt = dtypes[i % len(dtypes)]
        t = torch.randn(i % 13 + 1, i % 5 + 1, generator=g).to(dt) if dt not in (torch.uint16,) else torch.zeros(i % 9 + 1, dtype=dt)
        state[f"t{i}"] = t
        if i % 17 == 0:
            state[f"t{i}.view"] = t.view(-1)[1:]
        if i % 23 == 0 and t.dim() == 2:
            state[f"t{i}.T"] = t.t()
    state["param"] = torch.nn.Parameter(torch.randn(4))
    state["conj"] = _complex().conj()
    state["storage"] = torch.arange(7, dtype=torch.uint8).untyped_storage()
    state["nested"] = _nested()
    state["empty"] = torch.empty(0, 4)
    return state


def test_saved_data_pkl_equals_torch_save(tmp_path):
    state = _many_tensor_state()
    ours = tmp_path / "ours.pt"
    ref = tmp_path / "ref.pt"
    fastpersist.save(state, ours)
    torch.save(state, ref)
    assert _member(ours, "data.pkl") == _member(ref, "data.pkl")
    with zipfile.ZipFile(ours) as z:
        assert z.testzip() is None
    _assert_tensors_equal(torch.load(ours, weights_only=True), torch.load(ref, weights_only=True))


@pytest.mark.parametrize("how", ["config", "env"])
def test_fast_pickle_off_uses_torchs_reductions_and_writer(tmp_path, monkeypatch, how):
    from fastpersist.formats import torchstream, zipwriter

    def must_not_run(*args, **kwargs):
        raise AssertionError("fastpersist's own pickling/layout used although fast_pickle is off")

    monkeypatch.setattr(torchpickle, "fast_capture_module", must_not_run)
    monkeypatch.setattr(torchstream, "_OurRecords", must_not_run)
    used = []
    real_records = torchstream._TorchRecords

    def torch_records(*args, **kwargs):
        used.append(1)
        return real_records(*args, **kwargs)

    monkeypatch.setattr(torchstream, "_TorchRecords", torch_records)
    state = _round_trip_state()
    path = tmp_path / "torchs.pt"
    if how == "config":
        fastpersist.save(state, path, config=fastpersist.Config(fast_pickle=False))
    else:
        monkeypatch.setenv("FASTPERSIST_FAST_PICKLE", "0")
        assert fastpersist.Config.from_env().fast_pickle is False
        fastpersist.save(state, path, config=fastpersist.Config.from_env())
    assert used
    stock = torch.load(path, weights_only=True)
    _assert_tensors_equal(stock, state)
    monkeypatch.undo()
    # the fast path writes the same file, serialization id aside
    fast = tmp_path / "fast.pt"
    fastpersist.save(state, fast)
    assert _member(fast, "data.pkl") == _member(path, "data.pkl")
    a, b = bytearray(path.read_bytes()), bytearray(fast.read_bytes())
    for data, p in ((a, path), (b, fast)):
        for off, n in zipwriter.mask_serialization_id(zipwriter_reader(data), len(data)):
            data[off : off + n] = bytes(n)
    assert a == b


def zipwriter_reader(data):
    from fastpersist.formats.zipindex import buffer_reader

    return buffer_reader(bytes(data))
