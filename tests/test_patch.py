"""patch_torch_save: torch.save/torch.load on paths go through fastpersist, everything else does not."""

from __future__ import annotations

import inspect
import io
import os
import pickle
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import fastpersist
from fastpersist import patch

ORIGINAL_SAVE = torch.serialization.save
ORIGINAL_LOAD = torch.serialization.load


@pytest.fixture(autouse=True)
def _unpatched() -> Iterator[None]:
    fastpersist.unpatch_torch_save()
    assert torch.save is ORIGINAL_SAVE and torch.load is ORIGINAL_LOAD
    yield
    fastpersist.unpatch_torch_save()
    torch.save, torch.load = ORIGINAL_SAVE, ORIGINAL_LOAD


def _native() -> Any:
    return pytest.importorskip("fastpersist._native", reason="native extension not built")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(300, generator=g),
        "b": torch.randn(77, generator=g),
        "i": torch.arange(10, dtype=torch.int64),
        "step": 3,
    }


def _payload_offsets(path: Path) -> list[int]:
    """File offsets where each tensor payload (``*/data/<n>``) starts."""
    offsets = []
    with open(path, "rb") as f, zipfile.ZipFile(f) as z:
        for info in z.infolist():
            if "/data/" not in info.filename:
                continue
            f.seek(info.header_offset)
            local = f.read(30)
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            offsets.append(info.header_offset + 30 + name_len + extra_len)
    assert offsets
    return offsets


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


# ---------------------------------------------------------------------------
# Switching on and off (no I/O).


def test_wrappers_keep_torch_signatures_and_names() -> None:
    with fastpersist.patch_torch_save():
        assert torch.save is not ORIGINAL_SAVE and torch.load is not ORIGINAL_LOAD
        assert inspect.signature(torch.save) == inspect.signature(ORIGINAL_SAVE)
        assert inspect.signature(torch.load) == inspect.signature(ORIGINAL_LOAD)
        assert torch.save.__name__ == "save" and torch.save.__doc__ == ORIGINAL_SAVE.__doc__
        assert torch.serialization.save is ORIGINAL_SAVE  # only the torch.* attributes change
    assert torch.save is ORIGINAL_SAVE and torch.load is ORIGINAL_LOAD


def test_call_form_is_global_until_unpatch() -> None:
    fastpersist.patch_torch_save()
    assert patch.is_patched()
    wrapped = torch.save
    fastpersist.patch_torch_save()  # patching twice does not wrap twice
    assert torch.save is wrapped
    fastpersist.unpatch_torch_save()
    assert torch.save is ORIGINAL_SAVE and torch.load is ORIGINAL_LOAD and not patch.is_patched()
    fastpersist.unpatch_torch_save()  # no-op
    assert torch.save is ORIGINAL_SAVE


def test_context_managers_nest() -> None:
    with fastpersist.patch_torch_save():
        outer = torch.save
        with fastpersist.patch_torch_save():
            assert torch.save is outer
        assert torch.save is outer  # the inner exit restores the patched state it found
    assert torch.save is ORIGINAL_SAVE


def test_context_exit_restores_global_patch() -> None:
    fastpersist.patch_torch_save()
    wrapped = torch.save
    with fastpersist.patch_torch_save():
        pass
    assert torch.save is wrapped
    with fastpersist.patch_torch_save():
        fastpersist.unpatch_torch_save()
        assert torch.save is ORIGINAL_SAVE
    assert torch.save is wrapped  # exit puts back what was there when the block began


def test_previous_wrapper_is_kept_as_fallback_and_restored() -> None:
    calls: list[Any] = []

    def someone_elses_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(f)
        ORIGINAL_SAVE(obj, f, *args, **kwargs)

    torch.save = someone_elses_save
    with fastpersist.patch_torch_save():
        buf = io.BytesIO()
        torch.save({"x": 1}, buf)  # file-like: goes to the function we replaced
        assert calls == [buf]
    assert torch.save is someone_elses_save


# ---------------------------------------------------------------------------
# Routing (real files).


def test_save_inside_goes_through_fastpersist(tmp_path: Path) -> None:
    _native()
    state = _state()
    stock, fast = tmp_path / "stock.pt", tmp_path / "fast.pt"
    torch.save(state, stock)
    with fastpersist.patch_torch_save():
        torch.save(state, fast)
        _equal(torch.load(fast), state)
    assert all(o % 4096 == 0 for o in _payload_offsets(fast))
    assert not all(o % 4096 == 0 for o in _payload_offsets(stock))  # stock torch.save aligns to 64
    _equal(ORIGINAL_LOAD(fast), state)  # and the file is a normal torch file


def test_save_after_unpatch_is_stock(tmp_path: Path) -> None:
    with fastpersist.patch_torch_save():
        pass
    torch.save(_state(), tmp_path / "after.pt")
    assert not all(o % 4096 == 0 for o in _payload_offsets(tmp_path / "after.pt"))


def test_load_inside_goes_through_fastpersist(tmp_path: Path) -> None:
    native = _native()
    path = tmp_path / "x.pt"
    torch.save(_state(), path)
    native.set_fault("read", 1, "EIO", 1000)  # only fastpersist's native reads can see this
    try:
        _equal(torch.load(path), _state())  # stock: unaffected
        with fastpersist.patch_torch_save():
            with pytest.raises(OSError) as e:
                torch.load(path)
            assert e.value.errno == 5
    finally:
        native.clear_faults()
    with fastpersist.patch_torch_save():
        _equal(torch.load(path, map_location="cpu", weights_only=True), _state())


def test_path_like_targets(tmp_path: Path) -> None:
    _native()
    with fastpersist.patch_torch_save():
        torch.save(_state(), str(tmp_path / "s.pt"))
        torch.save(_state(), f=tmp_path / "k.pt")
        _equal(torch.load(str(tmp_path / "s.pt")), _state())
        _equal(torch.load(f=tmp_path / "k.pt"), _state())
    for name in ("s.pt", "k.pt"):
        assert all(o % 4096 == 0 for o in _payload_offsets(tmp_path / name))


def test_bytesio_falls_back_and_round_trips() -> None:
    state = _state()
    with fastpersist.patch_torch_save():
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        _equal(torch.load(buf), state)
    buf.seek(0)
    _equal(ORIGINAL_LOAD(buf), state)


@pytest.mark.parametrize(
    "kwargs",
    [{"pickle_protocol": 4}, {"pickle_module": pickle}, {"_use_new_zipfile_serialization": False}],
    ids=["protocol", "pickle_module", "legacy"],
)
def test_unsupported_arguments_fall_back(tmp_path: Path, kwargs: dict) -> None:
    path = tmp_path / "f.pt"
    state = _state()
    with fastpersist.patch_torch_save():
        torch.save(state, path, **kwargs)
        _equal(torch.load(path, weights_only=False), state)
    if kwargs.get("_use_new_zipfile_serialization") is False:
        assert not zipfile.is_zipfile(path)
    elif "pickle_protocol" in kwargs:
        assert not all(o % 4096 == 0 for o in _payload_offsets(path))
    else:  # pickle_module=pickle is the default: still the fast path
        _native()
        assert all(o % 4096 == 0 for o in _payload_offsets(path))


def test_safetensors_suffix_still_writes_a_torch_file(tmp_path: Path) -> None:
    """torch.save writes its zip format whatever the name; fastpersist must not switch to safetensors."""
    _native()
    path = tmp_path / "weights.safetensors"
    with fastpersist.patch_torch_save():
        torch.save(_state(), path)
        with open(path, "rb") as f:  # a file object: torch.load does not look at the name
            _equal(torch.load(f), _state())
    assert zipfile.is_zipfile(path)
    assert all(o % 4096 == 0 for o in _payload_offsets(path))


def test_safetensors_files_load_as_torch_load_does(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    path = tmp_path / "real.safetensors"
    tensors = {"w": torch.randn(10), "i": torch.arange(3)}
    st.save_file(tensors, str(path))
    try:
        want = ORIGINAL_LOAD(path)
    except Exception as e:  # torch versions that do not read safetensors by name
        with fastpersist.patch_torch_save(), pytest.raises(type(e)):
            torch.load(path)
        return
    with fastpersist.patch_torch_save():
        _equal(torch.load(path), want)


def test_errors_are_torch_like(tmp_path: Path) -> None:
    with fastpersist.patch_torch_save():
        with pytest.raises(TypeError):
            torch.save(_state())  # type: ignore[call-arg]
        with pytest.raises(FileNotFoundError):
            torch.load(tmp_path / "missing.pt")


# ---------------------------------------------------------------------------
# FASTPERSIST_PATCH_TORCH_SAVE in a fresh interpreter.

_PROBE = (
    "import fastpersist, torch, sys; "
    "print(torch.save is not torch.serialization.save, torch.load is not torch.serialization.load); "
    "torch.save({'w': torch.arange(5000.), 'v': torch.ones(3)}, sys.argv[1])"
)


@pytest.mark.parametrize("value,patched", [("1", True), ("TRUE", True), ("on", True), ("0", False), ("", False)])
def test_env_variable_patches_at_import(tmp_path: Path, value: str, patched: bool) -> None:
    if patched:
        _native()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTPERSIST_")}
    env["FASTPERSIST_PATCH_TORCH_SAVE"] = value
    path = tmp_path / "env.pt"
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(patched)] * 2
    aligned = all(o % 4096 == 0 for o in _payload_offsets(path))
    assert aligned is patched


def test_env_variable_with_bad_value_fails_loudly() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTPERSIST_")}
    env["FASTPERSIST_PATCH_TORCH_SAVE"] = "sometimes"
    out = subprocess.run([sys.executable, "-c", "import fastpersist"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "FASTPERSIST_PATCH_TORCH_SAVE" in out.stderr and "sometimes" in out.stderr
