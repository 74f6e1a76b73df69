"""The safetensors format: planner, loader and verifier, against the safetensors package."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch

safetensors = pytest.importorskip("safetensors")
import safetensors.torch as st  # noqa: E402

import fastpersist  # noqa: E402
from fastpersist.config import Config  # noqa: E402
from fastpersist.errors import ChecksumError  # noqa: E402
from fastpersist.formats import safetensors as fst  # noqa: E402
from fastpersist.formats.base import PATCH_HEX8  # noqa: E402


def _native() -> Any:
    return pytest.importorskip("fastpersist._native", reason="native extension not built")


@pytest.fixture
def handle() -> Any:
    return _native().Handle(**Config().handle_kwargs())


def _write(handle: Any, path: Path, tensors: dict, metadata: Optional[dict] = None, **kw: Any) -> list[int]:
    plan = fst.plan_safetensors(tensors, metadata, kw.pop("alignment", 4096), **kw)
    return handle.write(str(path), plan.extents, plan.patches, plan.nslots)


def _raw(t: torch.Tensor) -> bytes:
    """The tensor's bytes (any dtype, any shape)."""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    assert _raw(a) == _raw(b)


def _header(path: Path) -> tuple[int, dict]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8 : 8 + n])


# Every dtype the installed safetensors accepts that this torch has.
DTYPES = sorted(fst.DTYPE_CODES, key=str)


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _all_dtypes_dict() -> dict[str, torch.Tensor]:
    out = {}
    for i, dt in enumerate(DTYPES):
        name = str(dt).replace("torch.", "")
        out[f"{name}.matrix"] = _sample(dt, (3, 5), seed=i)
        out[f"{name}.empty"] = _sample(dt, (0, 4), seed=i)
        if fst.DTYPE_CODES[dt] != "F4":  # two values per byte: no 0-d tensor in safetensors
            out[f"{name}.scalar"] = _sample(dt, (), seed=i + 100)
    return out


# ---------------------------------------------------------------------------
# Planner (pure Python).


def test_plan_covers_file_and_patches_header() -> None:
    tensors = {"w": torch.arange(1000.0), "b": torch.zeros(3, dtype=torch.int64), "e": torch.zeros(0)}
    plan = fst.plan_safetensors(tensors, {"note": "x"}, 4096)
    pos = 0
    for off, ptr, length, _slot in plan.extents:
        assert off == pos and length > 0 and ptr != 0
        pos += length
    assert pos == plan.file_size
    data_start = plan.extents[1][0]
    assert data_start % 4096 == 0
    assert plan.nslots == 2 == len(plan.patches) and plan.slot_names == ["b", "w"]  # I64 before F32
    for off, slot, kind in plan.patches:
        assert kind == PATCH_HEX8 and 8 <= off and off + 8 <= data_start
        assert 0 <= slot < plan.nslots
    assert [e[3] for e in plan.extents] == [-1, 0, 1]


def test_plan_without_checksum_has_no_patches() -> None:
    plan = fst.plan_safetensors({"w": torch.ones(4)}, None, 4096, checksum=False)
    assert plan.patches == [] and plan.nslots == 0
    assert all(e[3] == -1 for e in plan.extents)


def test_conj_views_and_grad_tensors_save_their_values(tmp_path: Path, handle: Any) -> None:
    c = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    w = torch.ones(3, requires_grad=True)
    path = tmp_path / "c.safetensors"
    _write(handle, path, {"c": c.conj(), "w": w}, None)
    assert c.imag.tolist() == [2.0, -4.0]  # the caller's tensor is unchanged
    loaded = st.load_file(str(path))
    assert loaded["c"].tolist() == [1 - 2j, 3 + 4j]  # the values, not the un-conjugated memory
    assert torch.equal(loaded["w"], w.detach())


def _bad_inputs() -> list[tuple[str, Callable[[], tuple[Any, Any]]]]:
    base = torch.zeros(10)
    return [
        ("not a dict", lambda: ([torch.zeros(1)], None)),
        ("non-str key", lambda: ({1: torch.zeros(1)}, None)),
        ("non-tensor value", lambda: ({"a": 1}, None)),
        ("non-contiguous", lambda: ({"a": torch.zeros(3, 4).t()}, None)),
        ("expanded", lambda: ({"a": torch.zeros(1).expand(4)}, None)),
        ("sparse", lambda: ({"a": torch.zeros(3, 4).to_sparse()}, None)),
        ("same tensor twice", lambda: ({"a": base, "b": base}, None)),
        ("overlapping views", lambda: ({"a": base[:6], "b": base[4:]}, None)),
        ("reshaped view", lambda: ({"a": base, "b": base.view(2, 5)}, None)),
        ("metadata value not str", lambda: ({"a": torch.zeros(1)}, {"x": 1})),
        ("metadata key not str", lambda: ({"a": torch.zeros(1)}, {1: "x"})),
        ("metadata value None", lambda: ({"a": torch.zeros(1)}, {"x": None})),
        ("metadata a list", lambda: ({"a": torch.zeros(1)}, [("x", "y")])),
        ("metadata a str", lambda: ({"a": torch.zeros(1)}, "xy")),
        ("meta tensor", lambda: ({"a": torch.zeros(2, device="meta")}, None)),
        ("complex128", lambda: ({"a": torch.zeros(2, dtype=torch.complex128)}, None)),
        ("non-contiguous and bad metadata", lambda: ({"a": torch.zeros(3, 4).t()}, {"x": 1})),
    ] + ([("0-d float4", lambda: ({"a": torch.empty((), dtype=torch.float4_e2m1fn_x2)}, None))]
         if hasattr(torch, "float4_e2m1fn_x2") else [])  # torch 2.7 has no float4


@pytest.mark.parametrize("label,make", _bad_inputs(), ids=[b[0] for b in _bad_inputs()])
def test_invalid_input_raises_like_safetensors(label: str, make: Callable[[], tuple[Any, Any]]) -> None:
    """Every exception safetensors raises for bad input is one ours is an instance of
    (ours may also be another type: e.g. ValueError besides safetensors' KeyError)."""
    tensors, metadata = make()
    with pytest.raises(Exception) as theirs:
        st.save(tensors, metadata=metadata)
    with pytest.raises(Exception) as ours:
        fst.plan_safetensors(tensors, metadata, 4096)
    assert isinstance(ours.value, type(theirs.value)), (ours.value, theirs.value)
    if label == "meta tensor":
        assert "Cannot copy out of meta tensor" in str(ours.value)


def test_save_file_stand_in_raises_like_safetensors(tmp_path: Path) -> None:
    """fastpersist.save_file and safetensors.torch.save_file on the same bad input."""
    import fastpersist

    for label, make in _bad_inputs():
        tensors, metadata = make()
        with pytest.raises(Exception) as theirs:
            st.save_file(tensors, str(tmp_path / "s.safetensors"), metadata=metadata)
        with pytest.raises(Exception) as ours:
            fastpersist.save_file(tensors, tmp_path / "f.safetensors", metadata=metadata)
        assert isinstance(ours.value, type(theirs.value)), (label, ours.value, theirs.value)
        # the messages safetensors' own tests check word for word
        if label in ("not a dict", "non-tensor value", "sparse"):
            assert str(ours.value) == str(theirs.value)
    for bad in (3, b"x.safetensors"):
        with pytest.raises(TypeError):
            st.save_file({"a": torch.zeros(1)}, bad)
        with pytest.raises(TypeError):
            fastpersist.save_file({"a": torch.zeros(1)}, bad)
    assert not list(tmp_path.iterdir())


def test_load_file_stand_in_raises_like_safetensors(tmp_path: Path) -> None:
    import fastpersist

    path = tmp_path / "a.safetensors"
    st.save_file({"a": torch.arange(3)}, str(path))
    garbage = tmp_path / "g.safetensors"
    garbage.write_bytes(b"garbage!garbage")
    empty = tmp_path / "e.safetensors"
    empty.write_bytes(b"")
    cases = [
        ("missing", lambda f: f(str(tmp_path / "missing.safetensors"))),
        ("garbage", lambda f: f(str(garbage))),
        ("empty", lambda f: f(str(empty))),
        ("bad device", lambda f: f(str(path), device="bogus")),
        ("bad backend", lambda f: f(str(path), backend="bogus")),
        ("int path", lambda f: f(3)),
    ]
    for label, call in cases:
        with pytest.raises(Exception) as theirs:
            call(st.load_file)
        with pytest.raises(Exception) as ours:
            call(fastpersist.load_file)
        assert isinstance(ours.value, type(theirs.value)), (label, ours.value, theirs.value)
    for backend in ("mmap", "pread"):
        assert torch.equal(fastpersist.load_file(str(path), backend=backend)["a"], torch.arange(3))


def test_shared_error_names_tensors_and_gives_advice() -> None:
    base = torch.zeros(10)
    with pytest.raises(RuntimeError, match="save_model") as e:
        fst.plan_safetensors({"a": base, "b": base, "c": torch.ones(2)}, None, 4096)
    assert "'a'" in str(e.value) and "'b'" in str(e.value) and "'c'" not in str(e.value)


def test_unsupported_dtype_and_reserved_name_are_refused() -> None:
    with pytest.raises(ValueError, match="complex128"):
        fst.plan_safetensors({"a": torch.zeros(2, dtype=torch.complex128)}, None, 4096)
    with pytest.raises(KeyError, match="complex128"):  # what safetensors raises
        fst.plan_safetensors({"a": torch.zeros(2, dtype=torch.complex128)}, None, 4096)
    with pytest.raises(ValueError, match="__metadata__"):
        fst.plan_safetensors({"__metadata__": torch.zeros(2)}, None, 4096)
    with pytest.raises(NotImplementedError, match="meta device"):
        fst.plan_safetensors({"a": torch.zeros(2, device="meta")}, None, 4096)


# ---------------------------------------------------------------------------
# Writing with the native executor, reading with safetensors and with ours.


def test_bytes_identical_to_safetensors_without_extras(tmp_path: Path, handle: Any) -> None:
    """Same order, same JSON, same 8-byte padding: the very same file."""
    tensors = _all_dtypes_dict()
    tensors["a.disjoint"], tensors["b.disjoint"] = torch.arange(10.0)[:4], torch.arange(10.0)[4:]
    path = tmp_path / "x.safetensors"
    _write(handle, path, tensors, None, alignment=8, checksum=False)
    assert path.read_bytes() == st.save(tensors)


def test_round_trip_every_dtype(tmp_path: Path, handle: Any) -> None:
    tensors = _all_dtypes_dict()
    path = tmp_path / "all.safetensors"
    crcs = _write(handle, path, tensors, {"step": "7"})
    theirs = st.load_file(str(path))
    ours = fst.load_safetensors(path, handle)
    assert set(theirs) == set(ours) == set(tensors)
    for name, t in tensors.items():
        _same(theirs[name], t)
        _same(ours[name], t)
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(tensors)
        assert f.metadata()["step"] == "7"
        for name in tensors:
            _same(f.get_tensor(name), tensors[name])
    # the CRCs the writer returned are in the header, in data order, for the non-empty tensors
    header = fst.read_header(path)
    recorded = header.crcs
    assert recorded is not None and len(recorded) == len(tensors)
    nonempty = [r for e, r in zip(header.tensors, recorded) if e.nbytes]
    assert nonempty == crcs
    for entry, crc in zip(header.tensors, recorded):
        assert crc == zlib.crc32(_raw(tensors[entry.name]))


@pytest.mark.parametrize("alignment", [4096, 512, 8192, 1])
def test_data_section_starts_aligned(tmp_path: Path, handle: Any, alignment: int) -> None:
    path = tmp_path / "a.safetensors"
    _write(handle, path, {"w": torch.randn(100), "i": torch.arange(7, dtype=torch.int8)}, {"k": "v"}, alignment=alignment)
    n, head = _header(path)
    assert (8 + n) % max(alignment, 8) == 0
    assert path.read_bytes()[8 : 8 + n].rstrip(b" ").endswith(b"}")  # JSON, then spaces up to the data
    assert head["w"]["data_offsets"][0] == 0  # the first tensor starts exactly at the aligned data start
    _same(fst.load_safetensors(path, handle)["w"], st.load_file(str(path))["w"])


def test_metadata_is_exactly_the_callers(tmp_path: Path, handle: Any) -> None:
    """__metadata__ holds the caller's entries only (keys named like fastpersist's own
    included); the CRCs are in the tensors' entries."""
    path = tmp_path / "m.safetensors"
    meta = {"format": "pt", "ünïcode": "line\nbreak \"quoted\"", fst.CRC_METADATA_KEY: "user value"}
    _write(handle, path, {"w": torch.ones(3)}, meta)
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert f.metadata() == meta
    head = _header(path)[1]
    assert head["w"][fst.ENTRY_CRC_KEY] == f"{zlib.crc32(_raw(torch.ones(3))):08x}"
    assert fst.verify_safetensors(path, handle) == []

    _write(handle, path, {"w": torch.ones(3)}, meta, checksum=False)
    with safetensors.safe_open(str(path), framework="pt") as f:
        assert f.metadata() == meta
    assert fst.ENTRY_CRC_KEY not in _header(path)[1]["w"]
    assert fst.check_safetensors(path, handle).checked is False  # the caller's key is not a legacy CRC list
    assert fst.verify_safetensors(path, handle) == []
    for checksum in (True, False):
        _write(handle, path, {"w": torch.ones(3)}, None, checksum=checksum)
        assert "__metadata__" not in _header(path)[1]
        with safetensors.safe_open(str(path), framework="pt") as f:
            assert f.metadata() is None
        _write(handle, path, {"w": torch.ones(3)}, {}, checksum=checksum)
        with safetensors.safe_open(str(path), framework="pt") as f:
            assert f.metadata() == {}


@pytest.mark.parametrize("metadata", [None, {}, {"Something": "more"}, {"format": "np", "k": "v"}])
def test_save_file_metadata_equals_stock(tmp_path: Path, metadata: Optional[dict]) -> None:
    """safe_open(...).metadata(), keys and tensors: fastpersist.save_file as stock save_file."""
    import fastpersist

    tensors = {"w": torch.randn(4, 3), "b": torch.arange(5, dtype=torch.int16), "e": torch.zeros(0)}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    fastpersist.save_file(tensors, ours, metadata=None if metadata is None else dict(metadata))
    st.save_file(tensors, str(theirs), metadata=metadata)
    with safetensors.safe_open(str(ours), framework="pt") as f, safetensors.safe_open(str(theirs), "pt") as g:
        assert f.metadata() == g.metadata() == metadata
        assert sorted(f.keys()) == sorted(g.keys())
    loaded = fastpersist.load_file(ours)
    for name, t in tensors.items():
        _same(loaded[name], t)
        _same(st.load_file(str(ours))[name], t)
    assert fastpersist.verify(ours).status == "ok"


def test_fastpersist_save_writes_format_pt(tmp_path: Path) -> None:
    """fastpersist.save of a .safetensors path writes {"format": "pt"} (what transformers'
    save_pretrained writes) plus the caller's metadata; the caller's "format" wins."""
    import fastpersist

    path = tmp_path / "m.safetensors"
    cases = [(None, {"format": "pt"}), ({"step": "3"}, {"format": "pt", "step": "3"}),
             ({"format": "np"}, {"format": "np"})]
    for given, expected in cases:
        fastpersist.save({"w": torch.ones(2)}, path, metadata=given)
        with safetensors.safe_open(str(path), framework="pt") as f:
            assert f.metadata() == expected
        assert fastpersist.verify(path).status == "ok"
    fastpersist.save({"w": torch.ones(2)}, tmp_path / "x.bin", format="safetensors")
    with safetensors.safe_open(str(tmp_path / "x.bin"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    with pytest.raises(TypeError):
        fastpersist.save({"w": torch.ones(2)}, path, metadata={"k": 1})
    with pytest.raises(TypeError, match="safetensors"):
        fastpersist.save({"w": torch.ones(2)}, tmp_path / "x.pt", metadata={"k": "v"})
    for given, expected in cases:
        fastpersist.save_async({"w": torch.ones(2)}, tmp_path / "a.safetensors", metadata=given).wait()
        with safetensors.safe_open(str(tmp_path / "a.safetensors"), framework="pt") as f:
            assert f.metadata() == expected
        assert fastpersist.verify(tmp_path / "a.safetensors").status == "ok"
    with pytest.raises(TypeError, match="safetensors"):
        fastpersist.save_async({"w": torch.ones(2)}, tmp_path / "a.pt", metadata={"k": "v"})


def test_empty_dict_and_only_empty_tensors(tmp_path: Path, handle: Any) -> None:
    for tensors in ({}, {"e": torch.zeros(0), "f": torch.zeros(2, 0, dtype=torch.int64)}):
        path = tmp_path / "e.safetensors"
        _write(handle, path, tensors, None)
        assert st.load_file(str(path)).keys() == tensors.keys()
        ours = fst.load_safetensors(path, handle)
        assert ours.keys() == tensors.keys()
        for k in tensors:
            _same(ours[k], tensors[k])
        assert fst.verify_safetensors(path, handle) == []


def test_large_tensor_spanning_many_chunks(tmp_path: Path) -> None:
    h = _native().Handle(**Config(chunk_size=64 << 10, queue_depth=3).handle_kwargs())
    tensors = {"big": torch.randn(3 << 18), "small": torch.arange(5, dtype=torch.int16)}  # 3 MiB
    path = tmp_path / "big.safetensors"
    _write(h, path, tensors, None)
    for name, t in st.load_file(str(path)).items():
        _same(t, tensors[name])
    assert fst.verify_safetensors(path, h) == []


def test_loads_files_written_by_safetensors(tmp_path: Path, handle: Any) -> None:
    tensors = _all_dtypes_dict()
    path = tmp_path / "theirs.safetensors"
    st.save_file(tensors, str(path), metadata={"a": "b"})
    ours = fst.load_safetensors(str(path), handle)
    assert ours.keys() == tensors.keys()
    for name, t in tensors.items():
        _same(ours[name], t)
    assert not fst.has_checksums(path)
    assert fst.verify_safetensors(path, handle) == []  # structure only: no checksums to compare


def test_loaded_tensors_own_separate_storages(tmp_path: Path, handle: Any) -> None:
    path = tmp_path / "s.safetensors"
    _write(handle, path, {"a": torch.randn(1000), "b": torch.randn(10)}, None)
    ours = fst.load_safetensors(path, handle)
    for t in ours.values():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    ours["b"].add_(1)  # writable
    assert ours["b"].data_ptr() % 4 == 0


def test_unaligned_tensor_in_foreign_file(tmp_path: Path, handle: Any) -> None:
    """The format allows any order; an F32 at an odd offset still loads (copied)."""
    head = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"b":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}}'
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"\x07" + struct.pack("<2f", 1.5, -2.0))
    ours = fst.load_safetensors(path, handle)
    assert ours["b"].tolist() == [1.5, -2.0] and ours["a"].tolist() == [7]
    assert st.load_file(str(path))["b"].tolist() == [1.5, -2.0]


@pytest.mark.gpu
def test_cuda_tensors_are_staged_and_loaded_to_device(tmp_path: Path, handle: Any) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    tensors = {"w": torch.randn(1000, device="cuda"), "b": torch.arange(5, device="cuda")}
    path = tmp_path / "g.safetensors"
    _write(handle, path, tensors, None)
    ours = fst.load_safetensors(path, handle, device="cuda")
    for name, t in tensors.items():
        assert ours[name].device.type == "cuda"
        assert torch.equal(ours[name], t)
    assert torch.equal(st.load_file(str(path))["w"], tensors["w"].cpu())


# ---------------------------------------------------------------------------
# Malformed files and corruption.


def _file(header: Any, data: bytes = b"", length: Optional[int] = None) -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h) if length is None else length) + h + data


def _u8(begin: int, end: int, n: Optional[int] = None) -> dict:
    return {"dtype": "U8", "shape": [end - begin if n is None else n], "data_offsets": [begin, end]}


MALFORMED: dict[str, tuple[bytes, str]] = {
    "shorter than 8 bytes": (b"\x01\x00", "shorter than the 8-byte"),
    "length past end": (_file({"a": _u8(0, 1)}, b"x", length=1000), "header length 1000"),
    "huge length": (_file(b"{}", length=1 << 40), "100 MB"),
    "not JSON": (_file(b"{not json}"), "not valid UTF-8 JSON"),
    "not UTF-8": (_file(b'{"\xff":1}'), "not valid UTF-8 JSON"),
    "not an object": (_file(b"[1, 2]"), "not a JSON object"),
    "entry not an object": (_file({"a": 3}), "not an object"),
    "unknown dtype": (_file({"a": {"dtype": "Q8", "shape": [1], "data_offsets": [0, 1]}}, b"x"), "dtype 'Q8'"),
    "negative shape": (_file({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, b"x"), "invalid shape"),
    "offsets reversed": (_file({"a": {"dtype": "U8", "shape": [0], "data_offsets": [1, 0]}}, b"x"), "end before"),
    "shape does not fill": (_file({"a": _u8(0, 4, n=3)}, b"xxxx"), "does not fill"),
    "offsets out of range": (_file({"a": _u8(0, 8)}, b"xxxx"), "file has"),
    "hole": (_file({"a": _u8(0, 2), "b": _u8(4, 6)}, b"xxxxxx"), "hole"),
    "overlap": (_file({"a": _u8(0, 4), "b": _u8(2, 6)}, b"xxxxxx"), "overlap"),
    "trailing bytes": (_file({"a": _u8(0, 2)}, b"xxx"), "trailing"),
    "bad metadata": (_file({"__metadata__": {"k": 1}, "a": _u8(0, 1)}, b"x"), "__metadata__"),
    "duplicate key": (
        _file(b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x"),
        "duplicate key",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_file_errors_name_the_path(tmp_path: Path, case: str) -> None:
    content, message = MALFORMED[case]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(fst.SafetensorsFormatError, match=message) as e:
        fst.read_header(path)
    assert str(path) in str(e.value) and e.value.path == str(path)
    assert isinstance(e.value, ValueError)
    if case != "duplicate key":  # safetensors itself keeps one of the duplicates
        with pytest.raises(Exception):
            st.load_file(str(path))


@pytest.mark.parametrize("case", ["hole", "not JSON", "offsets out of range"])
def test_malformed_file_through_load_and_verify(tmp_path: Path, handle: Any, case: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(MALFORMED[case][0])
    with pytest.raises(fst.SafetensorsFormatError, match=MALFORMED[case][1]):
        fst.load_safetensors(path, handle)
    problems = fst.verify_safetensors(path, handle)
    assert len(problems) == 1 and str(path) in problems[0]


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_flipped_data_byte_is_detected(tmp_path: Path, handle: Any) -> None:
    tensors = {"alpha": torch.randn(64), "beta": torch.randn(300), "gamma": torch.arange(9, dtype=torch.int64)}
    path = tmp_path / "c.safetensors"
    _write(handle, path, tensors, None)
    assert fst.verify_safetensors(path, handle) == []
    header = fst.read_header(path)
    beta = next(e for e in header.tensors if e.name == "beta")
    _flip(path, header.data_start + beta.begin + 123)

    problems = fst.verify_safetensors(path, handle)
    assert len(problems) == 1 and "'beta'" in problems[0] and str(path) in problems[0]
    with pytest.raises(ChecksumError) as e:
        fst.load_safetensors(path, handle)
    assert e.value.records == ["beta"] and e.value.path == str(path)
    loaded = fst.load_safetensors(path, handle, checksum=False)  # opt out: the damaged bytes come back
    assert not torch.equal(loaded["beta"], tensors["beta"]) and torch.equal(loaded["alpha"], tensors["alpha"])


def test_damaged_checksum_field_is_reported(tmp_path: Path, handle: Any) -> None:
    path = tmp_path / "d.safetensors"
    _write(handle, path, {"w": torch.ones(4)}, None)
    raw = path.read_bytes()
    at = raw.index(b'"' + fst.ENTRY_CRC_KEY.encode() + b'":"') + len(fst.ENTRY_CRC_KEY) + 4
    data = bytearray(raw)
    data[at] = ord("g") if data[at] != ord("g") else ord("h")  # not a hex digit any more
    path.write_bytes(bytes(data))
    problems = fst.verify_safetensors(path, handle)
    assert problems and "'w'" in problems[0] and "8 hex digits" in problems[0]


def _edit_header(path: Path, old: bytes, new: bytes) -> None:
    """Replace ``old`` by ``new`` (same length) in the header of ``path``."""
    assert len(old) == len(new)
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    assert data[8 : 8 + n].count(old) == 1, old
    path.write_bytes(data.replace(old, new, 1))


@pytest.mark.parametrize(
    "old,new,what",
    [
        (b'"shape":[2,3]', b'"shape":[3,2]', "header"),  # a shape, same bytes
        (b'"dtype":"I32"', b'"dtype":"U32"', "header"),  # a dtype of the same width
        (b'"step":"7"', b'"step":"8"', "header"),  # the caller's metadata
        (b'"fastpersist.header_crc32"', b'"fastpersist.header_crc3X"', "fastpersist.header_crc32"),
        (b'[24,40],"fastpersist.crc32":"', b'[24,40],"fastpersist.crc3X":"', "no recorded checksum"),
    ],
)
def test_altered_header_is_detected(tmp_path: Path, handle: Any, old: bytes, new: bytes, what: str) -> None:
    """The header CRC in the first entry covers names, dtypes, shapes, offsets and the
    whole __metadata__; a stray or missing fastpersist key is reported too."""
    import fastpersist

    path = tmp_path / "h.safetensors"
    fastpersist.save_file({"w": torch.randn(2, 3), "i": torch.arange(4, dtype=torch.int32)}, path,
                          metadata={"step": "7"})
    assert fastpersist.verify(path).status == "ok"
    _edit_header(path, old, new)
    result = fastpersist.verify(path)
    assert result.status == "corrupt" and what in "\n".join(result.problems), result.problems
    with pytest.raises(ChecksumError):
        fastpersist.load(path)
    with pytest.raises(ChecksumError):
        fastpersist.load_file(path)


def test_legacy_metadata_crcs_are_still_verified(tmp_path: Path, handle: Any) -> None:
    """Files of earlier fastpersist versions (CRCs in __metadata__) verify and load checked."""
    import fastpersist

    tensors = {"w": torch.randn(5), "i": torch.arange(3)}
    path = tmp_path / "legacy.safetensors"
    st.save_file(tensors, str(path))  # then rewritten with the old header layout
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    head = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    order = sorted((k for k in head), key=lambda k: head[k]["data_offsets"][0])
    meta = {fst.CRC_METADATA_KEY: ",".join(
        f"{zlib.crc32(body[head[k]['data_offsets'][0]:head[k]['data_offsets'][1]]):08x}" for k in order)}
    meta[fst.HEADER_CRC_METADATA_KEY] = f"{fst.header_crc32({k: (e['dtype'], e['shape'], e['data_offsets']) for k, e in head.items()}, meta):08x}"
    text = json.dumps({"__metadata__": meta, **head}).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)
    assert fastpersist.verify(path).status == "ok"
    _flip(path, 8 + len(text) + 2)
    assert fastpersist.verify(path).status == "corrupt"


@pytest.mark.parametrize("crc_value", [123, None, ["00000000"], {"a": 1}, "ABCDEF01", "0000000"])
def test_entry_checksum_of_the_wrong_type_is_reported(tmp_path: Path, crc_value: Any) -> None:
    """A hostile header: an entry's fastpersist.crc32 that is not 8 lowercase hex digits
    is a problem of verify and a ChecksumError of load, never a crash; safetensors
    itself ignores the key and loads the file."""
    import fastpersist

    tensors = {"w": torch.randn(3), "i": torch.arange(2)}
    path = tmp_path / "x.safetensors"
    fastpersist.save_file(tensors, path)
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    head = json.loads(data[8 : 8 + n])
    head["w"][fst.ENTRY_CRC_KEY] = crc_value
    text = json.dumps(head).encode()
    assert len(text) <= n
    path.write_bytes(data[:8] + text + b" " * (n - len(text)) + data[8 + n :])
    result = fastpersist.verify(path)
    assert result.status == "corrupt" and "'w'" in "\n".join(result.problems), result.problems
    with pytest.raises(ChecksumError):
        fastpersist.load_file(path)
    assert torch.equal(st.load_file(str(path))["w"], tensors["w"])


def test_header_checksum_in_two_entries_is_reported(tmp_path: Path) -> None:
    import fastpersist

    path = tmp_path / "x.safetensors"
    fastpersist.save_file({"w": torch.randn(3), "i": torch.arange(2)}, path)
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    head = json.loads(data[8 : 8 + n])
    first = next(k for k in head if fst.ENTRY_HEADER_CRC_KEY in head[k])
    other = next(k for k in head if k != first)
    head[other][fst.ENTRY_HEADER_CRC_KEY] = head[first][fst.ENTRY_HEADER_CRC_KEY]
    text = json.dumps(head).encode()
    path.write_bytes(data[:8] + text + b" " * (n - len(text)) + data[8 + n :])
    result = fastpersist.verify(path)
    assert result.status == "corrupt" and fst.ENTRY_HEADER_CRC_KEY in "\n".join(result.problems)


# --------------------------------------------------------------------------- load_model


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.body = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied, as a language model's head


def _fresh_tied(seed: int) -> _Tied:
    torch.manual_seed(seed)
    return _Tied()


def test_load_model_matches_safetensors_load_model(tmp_path) -> None:
    # The same file into two fresh models, by safetensors and by fastpersist: the same
    # (missing, unexpected), the same weights, the tie kept.
    path = str(tmp_path / "m.safetensors")
    st.save_model(_fresh_tied(0), path)
    a, b = _fresh_tied(1), _fresh_tied(2)
    want = st.load_model(a, path)
    got = fastpersist.load_model(b, path)
    assert got == want == (set(), [])  # the same types as safetensors' (a set of missing names)
    for (na, ta), (nb, tb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(ta, tb)
    assert b.head.weight is b.embed.weight
    # fastpersist's own file (the model's tensors, one name per tie) loads the same way
    fastpersist.save_file({k: v for k, v in _fresh_tied(0).state_dict().items() if k != "head.weight"},
                          str(tmp_path / "fp.safetensors"))
    c = _fresh_tied(3)
    assert fastpersist.load_model(c, str(tmp_path / "fp.safetensors")) == (set(), [])
    assert torch.equal(c.embed.weight, a.embed.weight) and c.head.weight is c.embed.weight


def test_load_model_reports_names_like_safetensors(tmp_path) -> None:
    sd = {k: v for k, v in _fresh_tied(0).state_dict().items() if k not in ("head.weight", "body.bias")}
    sd["extra"] = torch.zeros(3)
    path = str(tmp_path / "partial.safetensors")
    st.save_file(sd, path)
    for strict in (True, False):
        outcomes = []
        for loader in (st.load_model, fastpersist.load_model):
            try:
                m, u = loader(_fresh_tied(1), path, strict=strict)
                outcomes.append((sorted(m), sorted(u)))
            except RuntimeError as e:
                outcomes.append(str(e))
        assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[1] == (["body.bias"], ["extra"])
    # the file naming the tie by its other name: that name is kept, nothing is reported
    swapped = {k: v for k, v in _fresh_tied(0).state_dict().items() if k != "embed.weight"}
    st.save_file(swapped, str(tmp_path / "swapped.safetensors"))
    m = _fresh_tied(1)
    assert fastpersist.load_model(m, str(tmp_path / "swapped.safetensors")) == (set(), [])
    assert torch.equal(m.embed.weight, swapped["head.weight"])
