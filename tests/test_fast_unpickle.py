"""fastpersist.formats.fastunpickle: the fast weights-only unpickler returns exactly what torch's
unpickler returns, or hands the pickle to torch's (NotFast), never other values."""

from __future__ import annotations

import collections
import io
import pickle
import random
import struct
import warnings
import zipfile
import zlib

import pytest
import torch

import fastpersist
from fastpersist.formats import fastunpickle


def _equal(a, b, seen_a: dict, seen_b: dict, hooks: bool = True) -> bool:
    """Deep equality that also compares tensor layout, autograd flags and which tensors share storage."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        if (a.dtype, a.shape, a.stride(), a.storage_offset(), a.requires_grad) != (
                b.dtype, b.shape, b.stride(), b.storage_offset(), b.requires_grad):
            return False
        if hooks and (a._backward_hooks != b._backward_hooks
                      or type(a._backward_hooks) is not type(b._backward_hooks)):
            return False
        # storage sharing: the n-th distinct storage of one is the n-th of the other
        ka, kb = a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()
        ia, ib = seen_a.setdefault(ka, len(seen_a)), seen_b.setdefault(kb, len(seen_b))
        if ia != ib or a.untyped_storage().nbytes() != b.untyped_storage().nbytes():
            return False
        return bytes(a.untyped_storage()) == bytes(b.untyped_storage())
    if isinstance(a, (torch.storage.TypedStorage, torch.UntypedStorage)):
        ua, ub = (a._untyped_storage, b._untyped_storage) if isinstance(a, torch.storage.TypedStorage) else (a, b)
        if isinstance(a, torch.storage.TypedStorage) and a.dtype != b.dtype:
            return False
        ia, ib = seen_a.setdefault(ua.data_ptr(), len(seen_a)), seen_b.setdefault(ub.data_ptr(), len(seen_b))
        return ia == ib and bytes(ua) == bytes(ub)
    if isinstance(a, dict):
        return list(a.keys()) == list(b.keys()) and all(_equal(a[k], b[k], seen_a, seen_b, hooks) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y, seen_a, seen_b, hooks) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return b != b
    if isinstance(a, (set, frozenset, str, bytes, int, float, complex, type(None), bool)):
        return a == b
    return a is b  # globals (functions, storage types) and anything else: the same object


def equal(a, b, hooks: bool = True) -> bool:
    """``hooks=False``: do not compare ``_backward_hooks`` (None on a live tensor, an empty
    OrderedDict after any load)."""
    return _equal(a, b, {}, {}, hooks)


def states() -> list:
    torch.manual_seed(0)
    base = torch.randn(6, 5)
    tied = torch.arange(10, dtype=torch.int64)
    grad = torch.randn(3).requires_grad_()
    return [
        {"w": base, "view": base[2:, 1:], "t": base.t(), "tied": tied, "again": tied, "n": 3, "f": -1.5,
         "s": "x\u00e9", "none": None, "flags": (True, False), "big": 2**70, "neg": -(2**40)},
        collections.OrderedDict((f"layer.{i}", torch.full((i + 1,), float(i), dtype=d))
                                for i, d in enumerate([torch.float16, torch.bfloat16, torch.float64, torch.int8,
                                                       torch.uint8, torch.bool, torch.complex64, torch.int32])),
        [torch.zeros(0), torch.empty(0, 3), torch.ones(()), {"nested": [[torch.tensor([1, 2])], [3]]}],
        {"state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.randn(4)}}, "param_groups": [{"lr": 0.1,
                                                                                               "params": [0]}]},
        {"g": grad.detach().requires_grad_(), "empty": {}, "list": [], "tuple": ()},
        {f"k{i}": torch.randn(i % 7 + 1) for i in range(1500)},  # >1000 items: several SETITEMS batches
    ]


@pytest.fixture
def fast_calls(monkeypatch):
    """Counts fast-path outcomes in fastpersist.load: returned / handed to torch."""
    counts = {"fast": 0, "fallback": 0}
    real = fastunpickle.unpickle

    def spy(*args, **kwargs):
        try:
            out = real(*args, **kwargs)
        except fastunpickle.NotFast:
            counts["fallback"] += 1
            raise
        counts["fast"] += 1
        return out

    monkeypatch.setattr(fastunpickle, "unpickle", spy)
    return counts


@pytest.mark.parametrize("index", range(len(states())))
@pytest.mark.parametrize("writer", ["torch", "fastpersist"])
def test_plain_states_take_the_fast_path_and_equal_torch_load(tmp_path, fast_calls, index, writer) -> None:
    obj = states()[index]
    path = str(tmp_path / "s.pt")
    (torch.save if writer == "torch" else fastpersist.save)(obj, path)
    got = fastpersist.load(path)
    assert fast_calls == {"fast": 1, "fallback": 0}
    assert equal(got, torch.load(path, weights_only=True))
    assert equal(got, obj, hooks=False)


@pytest.mark.parametrize("case", ["parameter", "counter", "set", "callable_map_location", "protocol4",
                                  "no_weights_only"])
def test_outside_the_subset_torch_decides(tmp_path, fast_calls, case) -> None:
    path = str(tmp_path / "s.pt")
    load_kw: dict = {}
    if case == "parameter":
        torch.save({"p": torch.nn.Parameter(torch.randn(2))}, path)
    elif case == "counter":
        torch.save({"c": collections.Counter(a=1), "w": torch.ones(1)}, path)
    elif case == "set":
        torch.save({"s": {1, 2}, "w": torch.ones(1)}, path)
    elif case == "callable_map_location":
        torch.save({"w": torch.randn(3)}, path)
        load_kw = {"map_location": lambda storage, _loc: storage}
    elif case == "protocol4":
        torch.save({"w": torch.randn(3)}, path, pickle_protocol=4)
    elif case == "no_weights_only":
        torch.save({"w": torch.randn(3)}, path)
        load_kw = {"weights_only": False}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about protocol 4; both loads do
        ours = _outcome(lambda: fastpersist.load(path, **load_kw))
        theirs = _outcome(lambda: torch.load(path, **load_kw))
    assert ours[0] == theirs[0]
    if ours[0] == "ok":
        assert equal(ours[1], theirs[1])
    assert fast_calls["fast"] == 0


def _patch_same_length(path: str, data: bytes, mutated: bytes) -> None:
    """Write ``mutated`` (as long as the original) over data.pkl in a copy of the zip file ``data``
    and fix its CRC-32 in the local header and the central directory."""
    buf = bytearray(data)
    crc = zlib.crc32(mutated)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
    name_len, extra_len = struct.unpack_from("<HH", buf, info.header_offset + 26)
    start = info.header_offset + 30 + name_len + extra_len
    buf[start:start + len(mutated)] = mutated
    struct.pack_into("<I", buf, info.header_offset + 14, crc)
    pos = data.find(b"PK\x01\x02")
    while pos >= 0:
        n = struct.unpack_from("<H", buf, pos + 28)[0]
        if bytes(buf[pos + 46:pos + 46 + n]).endswith(b"/data.pkl"):
            struct.pack_into("<I", buf, pos + 16, crc)
            break
        pos = data.find(b"PK\x01\x02", pos + 4)
    with open(path, "wb") as f:
        f.write(buf)


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - any error counts as "refused"
        return ("error", type(e).__name__)


def test_mutated_pickles_give_torchs_answer_or_an_error(tmp_path, fast_calls) -> None:
    """Random byte changes inside data.pkl (CRC fixed so the checksum cannot catch them): whenever
    fastpersist returns, torch's weights-only load returns an equal object. The mutations hit
    strings, integers, opcodes and memo indices; some of them must still load through the fast path."""
    src = str(tmp_path / "src.pt")
    obj = {"a": torch.arange(12, dtype=torch.float32).view(3, 4), "b": [torch.ones(2), 7, "name"],
           "c": {"x": torch.zeros(3, dtype=torch.int16), "y": (1.5, None)}}
    obj["v"] = obj["a"][1]
    torch.save(obj, src)
    with open(src, "rb") as f:
        data = f.read()
    with zipfile.ZipFile(src) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    rng = random.Random(1234)
    path = str(tmp_path / "m.pt")
    fast_ok = 0
    for trial in range(400):
        m = bytearray(pkl)
        for _ in range(rng.choice([1, 1, 2, 3])):
            i = rng.randrange(len(m))
            m[i] = rng.choice([rng.randrange(256), m[i] ^ (1 << rng.randrange(8)), ord("q"), ord("h"), ord("s"),
                               ord("a"), ord("b"), ord("R"), 0x81])
        _patch_same_length(path, data, bytes(m))
        before = fast_calls["fast"]
        ours = _outcome(lambda: fastpersist.load(path))
        took_fast = fast_calls["fast"] > before
        theirs = _outcome(lambda: torch.load(path, weights_only=True))
        if ours[0] == "ok":
            assert theirs[0] == "ok", f"trial {trial}: fastpersist returned where torch.load raised {theirs[1]}"
            assert equal(ours[1], theirs[1]), f"trial {trial}: fastpersist returned other values than torch.load"
            fast_ok += took_fast
    assert fast_ok >= 20  # the fast path really returned mutated-but-valid pickles


def test_unpickle_refuses_what_torch_would_treat_differently() -> None:
    def get(name, nbytes):
        return torch.zeros(nbytes, dtype=torch.uint8)

    cases = {
        "build": b"\x80\x02]b.",  # BUILD on a list
        "newobj": b"\x80\x02ccollections\nOrderedDict\n)\x81.",
        "append_to_dict": b"\x80\x02}K\x01a.",
        "setitem_on_list": b"\x80\x02]K\x00K\x01s.",
        "other_global": b"\x80\x02cos\nsystem\n.",
        "protocol3": b"\x80\x03}.",
        "cuda_storage": b"\x80\x02(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x06\x00\x00\x00"
                        b"cuda:0K\x01tQ.",
        "truncated": b"\x80\x02}X\x05\x00\x00\x00ab",
        "reduce_storage_type": b"\x80\x02ctorch\nFloatStorage\n)R.",
    }
    for name, data in cases.items():
        with pytest.raises(fastunpickle.NotFast):
            fastunpickle.unpickle(data, get)
            pytest.fail(name)
    assert fastunpickle.unpickle(pickle.dumps({"a": [1, 2.5, None]}, protocol=2), get) == {"a": [1, 2.5, None]}


def test_the_global_itself_is_torchs_function() -> None:
    data = b"\x80\x02}X\x01\x00\x00\x00fctorch._utils\n_rebuild_tensor_v2\ns."
    got = fastunpickle.unpickle(data, lambda *_: torch.zeros(0, dtype=torch.uint8))
    assert got["f"] is torch._utils._rebuild_tensor_v2
