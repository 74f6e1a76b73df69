"""Shared fixtures: no fault injection leaks between tests; deep comparison of loaded objects."""

from __future__ import annotations

import os
import sys
from typing import Any, Iterator

import pytest
import torch

# DeepSpeed JIT-builds its C++ ops at first use into TORCH_EXTENSIONS_DIR (default
# ~/.cache/torch_extensions, one directory for every environment). Two virtual
# environments testing at once rebuilt each other's ops there (each build names its own
# sources) and waited on each other's build locks until the tests' subprocess timeouts:
# the ops of this environment's tests are built inside it, once.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))


@pytest.fixture(autouse=True)
def _python_sigint_handler() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt in every test: a framework run in an earlier test
    may leave SIGINT ignored (Lightning's trainer does after a KeyboardInterrupt) or at
    SIG_DFL (Lightning's process-group teardown), and a test of what an interrupt does
    would then see none."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


@pytest.fixture(autouse=True)
def _no_faults() -> Iterator[None]:
    """Clear native fault injection before and after every test."""
    try:
        from fastpersist import _native
    except ImportError:  # pragma: no cover - the extension is not built
        yield
        return
    _native.clear_faults()
    yield
    _native.clear_faults()


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _tensors(obj: Any, path: str, out: list) -> None:
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _tensors(v, f"{path}[{k!r}]", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _tensors(v, f"{path}[{i}]", out)


def assert_same_object(got: Any, want: Any, path: str = "obj") -> None:
    """Structure, types, values (bit for bit, whole storages) and tensor metadata are equal,
    and tensors share storages exactly where ``want``'s do."""
    _assert_same(got, want, path)
    gt: list = []
    wt: list = []
    _tensors(got, path, gt)
    _tensors(want, path, wt)

    def groups(items: list) -> list:
        by_storage: dict = {}
        for p, t in items:
            if t.is_quantized or t.device.type == "meta" or t.untyped_storage().nbytes() == 0:
                continue
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(p)
        return sorted(sorted(g) for g in by_storage.values())

    assert groups(gt) == groups(wt), "storage sharing differs"


def _assert_same(got: Any, want: Any, path: str) -> None:
    assert type(got) is type(want), f"{path}: {type(got)} != {type(want)}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        assert got.device == want.device, f"{path}: device {got.device} != {want.device}"
        assert got.requires_grad == want.requires_grad, f"{path}: requires_grad"
        if want.is_quantized:
            assert got.qscheme() == want.qscheme()
            assert torch.equal(got.int_repr(), want.int_repr()), f"{path}: quantized values"
            if want.qscheme() == torch.per_tensor_affine:
                assert (got.q_scale(), got.q_zero_point()) == (want.q_scale(), want.q_zero_point())
            else:
                assert torch.equal(got.q_per_channel_scales(), want.q_per_channel_scales())
            return
        assert got.stride() == want.stride(), f"{path}: stride {got.stride()} != {want.stride()}"
        assert got.storage_offset() == want.storage_offset(), f"{path}: storage offset"
        if want.device.type != "meta":
            assert torch.equal(_storage_bytes(got).cpu(), _storage_bytes(want).cpu()), f"{path}: bytes differ"
    elif isinstance(want, dict):
        assert list(got.keys()) == list(want.keys()), f"{path}: keys {list(got)} != {list(want)}"
        assert getattr(got, "_metadata", None) == getattr(want, "_metadata", None), f"{path}: _metadata"
        for k in want:
            _assert_same(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{path}[{i}]")
    else:
        assert got == want or (got != got and want != want), f"{path}: {got!r} != {want!r}"


@pytest.fixture
def assert_same() -> Any:
    """``assert_same(got, want)``: see :func:`assert_same_object`."""
    return assert_same_object


@pytest.fixture
def slow_finisher(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every async save stays pending (its file not yet renamed into place) for about 1 s,
    so that code checking, listing or loading the path certainly runs while it is in flight."""
    import threading

    import fastpersist
    from fastpersist import asyncsave

    original = asyncsave._finish

    def finish(job: Any) -> None:
        threading.Event().wait(1.0)
        original(job)

    monkeypatch.setattr(asyncsave, "_finish", finish)
    yield
    fastpersist.wait_all()


@pytest.fixture
def fresh_accelerate(monkeypatch, tmp_path):
    """The Accelerate adapter (``fastpersist.integrations.accelerate``) in a clean state: the
    working directory is ``tmp_path``, no switch variable set, and afterwards Accelerate's
    singletons reset and the adapter's hooks removed (tests of the adapter and transformers')."""
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from fastpersist.integrations import accelerate as fpa

    monkeypatch.chdir(tmp_path)
    for var in ("FASTPERSIST_ACCELERATE", "FASTPERSIST_PATCH_TORCH_SAVE"):
        monkeypatch.delenv(var, raising=False)
    yield fpa
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState._reset_state()
    fpa._uninstall()
