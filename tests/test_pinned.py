"""Pinned host tensors (pinned_empty, is_page_locked) and byte views (as_bytes)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

import fastpersist.io as fio

MiB = 1024 * 1024
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# AddressSanitizer intercepts mlock and makes it a no-op (.ci/sanitize runs the suite under it).
MLOCK_WORKS = "libasan" not in os.environ.get("LD_PRELOAD", "")
needs_mlock = pytest.mark.skipif(not MLOCK_WORKS, reason="mlock is a no-op under AddressSanitizer")


def _vmlck_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmLck:"):
                return int(line.split()[1])
    raise AssertionError("no VmLck in /proc/self/status")


def _pages_kib(nbytes: int) -> int:
    return -(-nbytes // 4096) * 4


# ---- pinned_empty -------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 4096, 10 * MiB])
@pytest.mark.parametrize(
    "dtype",
    [
        torch.uint8,
        torch.float32,
        torch.bfloat16,
        torch.bool,
        torch.complex64,
        torch.int64,
        torch.float8_e4m3fn,
    ],
    ids=str,
)
def test_pinned_empty_sizes_and_dtypes(size, dtype) -> None:
    numel = size // dtype.itemsize if size >= dtype.itemsize or size == 0 else 1
    gc.collect()
    before = _vmlck_kib()
    t = fio.pinned_empty(numel, dtype)
    nbytes = numel * dtype.itemsize
    assert t.shape == (numel,) and t.dtype == dtype and t.device.type == "cpu"
    assert t.is_contiguous()
    assert t.data_ptr() % 4096 == 0
    if MLOCK_WORKS:
        assert fio.is_page_locked(t)
        assert _vmlck_kib() - before >= _pages_kib(nbytes)
    # usable memory: every byte writable and readable
    b = fio.as_bytes(t)
    b.copy_(torch.arange(nbytes, dtype=torch.int64).remainder_(251).to(torch.uint8))
    assert torch.equal(b, torch.arange(nbytes, dtype=torch.int64).remainder_(251).to(torch.uint8))


@pytest.mark.parametrize("shape", [(3, 4), torch.Size([2, 0, 5]), (), [7, 1, 9]], ids=str)
def test_pinned_empty_shapes(shape) -> None:
    t = fio.pinned_empty(shape, torch.float64)
    assert t.shape == torch.Size(shape)
    t.fill_(1.5)
    assert t.sum().item() == 1.5 * t.numel()


def test_pinned_empty_bad_size() -> None:
    with pytest.raises(ValueError):
        fio.pinned_empty(-1)
    with pytest.raises(ValueError):
        fio.pinned_empty((2, -3))


def test_pinned_empty_alignment() -> None:
    t = fio.pinned_empty(100_000, alignment=1 << 16)
    assert t.data_ptr() % (1 << 16) == 0
    assert fio.is_page_locked(t) or not MLOCK_WORKS


@needs_mlock
def test_pinned_memory_freed_when_tensor_dies() -> None:
    gc.collect()
    base = _vmlck_kib()
    t = fio.pinned_empty(8 * MiB)
    assert _vmlck_kib() - base >= 8 * 1024
    view = t[4096:].view(torch.int32)  # a view keeps the memory alive
    del t
    gc.collect()
    assert _vmlck_kib() - base >= 8 * 1024
    assert fio.is_page_locked(view)
    view.fill_(7)
    del view
    gc.collect()
    assert _vmlck_kib() <= base


@needs_mlock
def test_pinned_many_allocations_do_not_leak() -> None:
    gc.collect()
    base = _vmlck_kib()
    for i in range(200):
        t = fio.pinned_empty(MiB + i)
        t[-1] = i
    del t
    gc.collect()
    assert _vmlck_kib() <= base


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_cpu_only_defaults_no_cuda_registration() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no PinningWarning: CUDA registration is not attempted
        t = fio.pinned_empty(4096)
    assert fio.is_page_locked(t) or not MLOCK_WORKS
    with pytest.raises(RuntimeError):  # torch's own pinning needs CUDA; ours does not
        torch.empty(4096, pin_memory=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_register_cuda_true_without_cuda_raises() -> None:
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        fio.pinned_empty(4096, register_cuda=True)


@needs_mlock
def test_memlock_limit_degrades_with_a_warning() -> None:
    """With RLIMIT_MEMLOCK at 64 KiB a 4 MiB buffer cannot be locked (unless the
    process has CAP_IPC_LOCK, e.g. root): it must still work, and say so."""
    code = textwrap.dedent(
        """
        import resource, warnings
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, 65536))
        import fastpersist.io as fio
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            t = fio.pinned_empty(4 << 20)
        t.fill_(3)
        assert t.data_ptr() % 4096 == 0 and int(t.sum()) == 3 * (4 << 20)
        kinds = [x.category.__name__ for x in w]
        names_fix = any("ulimit" in str(x.message) for x in w)
        print(fio.is_page_locked(t), "PinningWarning" in kinds, names_fix)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    locked, warned, names_fix = r.stdout.split()
    if locked == "True":  # privileged: the limit does not apply, and nothing to warn about
        assert warned == "False"
    else:
        assert (warned, names_fix) == ("True", "True")


def test_is_page_locked_false_for_ordinary_memory() -> None:
    assert not fio.is_page_locked(torch.empty(4 * MiB, dtype=torch.uint8))
    assert fio.is_page_locked(torch.empty(0))  # no bytes: nothing to lock


@pytest.mark.gpu
@needs_cuda
def test_pinned_empty_cuda_registered() -> None:
    t = fio.pinned_empty(MiB, torch.float32)
    # torch's is_pinned() answers False for any memory until torch itself has initialised
    # CUDA (seen on an H200 with torch 2.11: cudaHostRegister had succeeded, is_pinned() was
    # False before torch.cuda.init() and True after); every device copy initialises it first
    torch.cuda.init()
    assert t.is_pinned()
    assert fio.is_page_locked(t)
    t.copy_(torch.arange(MiB, dtype=torch.float32))
    d = t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(d.cpu(), t)
    assert not fio.is_page_locked(d)


# ---- as_bytes -------------------------------------------------------------------------

ALL_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.complex32,
    torch.complex64,
    torch.complex128,
]
NUMPY = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.float16: np.float16,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}


def _random(shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (*shape, dtype.itemsize), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (5, 7), (2, 0, 3)], ids=str)
def test_as_bytes_every_dtype(dtype, shape) -> None:
    t = _random(shape, dtype)
    b = fio.as_bytes(t)
    nbytes = t.numel() * dtype.itemsize
    assert b.dtype == torch.uint8 and b.shape == (nbytes,)
    if nbytes:
        assert b.data_ptr() == t.data_ptr()  # zero-copy
    # same bytes as the uint8 reinterpretation torch itself gives
    expected = t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
    assert torch.equal(b, expected.reshape(-1))
    if dtype in NUMPY:
        assert b.numpy().tobytes() == t.numpy().tobytes()


def test_as_bytes_known_values() -> None:
    assert fio.as_bytes(torch.tensor(1.0)).tolist() == [0, 0, 128, 63]  # 0-d float32, little-endian
    assert fio.as_bytes(torch.tensor([True, False, True])).tolist() == [1, 0, 1]
    c = torch.tensor([1 + 2j], dtype=torch.complex64)
    assert fio.as_bytes(c).tolist() == [0, 0, 128, 63, 0, 0, 0, 64]
    assert fio.as_bytes(torch.tensor([1.0], dtype=torch.bfloat16)).tolist() == [128, 63]
    assert fio.as_bytes(torch.tensor([258], dtype=torch.int16)).tolist() == [2, 1]


def test_as_bytes_shares_and_keeps_storage() -> None:
    t = torch.zeros(4, dtype=torch.int32)
    b = fio.as_bytes(t)
    b[4] = 9  # writes go through to the tensor
    assert t.tolist() == [0, 9, 0, 0]
    del t
    gc.collect()
    assert b.tolist()[4] == 9  # the view keeps the storage alive


def test_as_bytes_of_slice_starts_at_its_offset() -> None:
    t = torch.arange(10, dtype=torch.int16)
    b = fio.as_bytes(t[3:6])
    assert b.tolist() == [3, 0, 4, 0, 5, 0]
    assert b.data_ptr() == t.data_ptr() + 6


def test_as_bytes_parameter_and_inference_tensor() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    b = fio.as_bytes(p)
    assert not b.requires_grad and b.tolist() == [0, 0, 128, 63] * 2
    with torch.inference_mode():
        t = torch.ones(2)
        assert fio.as_bytes(t).tolist() == [0, 0, 128, 63] * 2
    assert fio.as_bytes(t).tolist() == [0, 0, 128, 63] * 2


def test_as_bytes_non_contiguous_is_value_error() -> None:
    t = torch.arange(12.0).reshape(3, 4)
    for bad in (t.t(), t[:, ::2], t[:, 1]):
        with pytest.raises(ValueError, match=r"\.contiguous\(\)"):
            fio.as_bytes(bad)
    assert fio.as_bytes(t.t().contiguous()).numel() == 48


def test_as_bytes_lazy_conj_and_other_errors() -> None:
    c = torch.tensor([1 + 2j], dtype=torch.complex64)
    with pytest.raises(ValueError, match="resolve_conj"):
        fio.as_bytes(c.conj())
    assert fio.as_bytes(c.conj().resolve_conj()).tolist() == [0, 0, 128, 63, 0, 0, 0, 192]
    with pytest.raises(ValueError):
        fio.as_bytes(torch.eye(3).to_sparse())
    with pytest.raises(TypeError):
        fio.as_bytes(b"bytes")  # type: ignore[arg-type]


@pytest.mark.gpu
@needs_cuda
def test_as_bytes_cuda() -> None:
    t = torch.arange(6, dtype=torch.float32, device="cuda")
    b = fio.as_bytes(t)
    assert b.is_cuda and b.data_ptr() == t.data_ptr()
    assert b.cpu().numpy().tobytes() == t.cpu().numpy().tobytes()


def test_program_exiting_with_loaded_tensors_alive_prints_no_leak_report(tmp_path):
    # Loaded tensors are views of a PinnedBuffer; a script that still holds them at
    # exit must not get nanobind's "leaked instances" report on stderr.
    script = (
        "import torch, fastpersist\n"
        f"path = {str(tmp_path / 'x.pt')!r}\n"
        "fastpersist.save({'w': torch.arange(1000.0), 'b': torch.ones(3)}, path)\n"
        "state = fastpersist.load(path)\n"
        "view = fastpersist.io.as_bytes(state['w'])\n"
        "assert torch.equal(state['w'], torch.arange(1000.0))\n"
        "print('OK')\n"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "OK"
    assert "leak" not in res.stderr, res.stderr
