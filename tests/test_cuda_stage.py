"""The host side of the GPU save path (fastpersist.cudastage), on CPU.

CPU storages are declared *device sources* (the planners' ``device_sources``
predicate accepts them) and copied by :class:`HostCopier`, a copier whose copies
run late on a thread of their own: the window pipeline (cutting, per-window
tokens, submission only after the copies, file order, CRC fields, errors) is the
one CUDA saves use. The CUDA copier itself is covered by tests/test_gpu_path.py
(skipped without a GPU).
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

import fastpersist
from fastpersist import _native, cudastage
from fastpersist.asyncstage import StagingPool
from fastpersist.formats.safetensors import plan_safetensors
from fastpersist.formats.torchzip import plan_torch


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    big = torch.randn(700, 1000, generator=g)  # 2.8 MB: crosses several 1 MiB pool windows
    return {
        "big": big,
        "view": big[5:9],  # shares big's storage
        "ints": torch.arange(5000, dtype=torch.int64),
        "half": torch.randn(333, generator=g).half(),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.empty(0),
        "scalar": torch.tensor(7.5),
        "meta": {"step": 3},
    }


def _same(a: dict, b: dict) -> None:
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert b[k].dtype == v.dtype and torch.equal(b[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)), k
        else:
            assert b[k] == v


def test_plan_records_sources_instead_of_copying():
    sd = _state()
    plan = plan_torch(sd, 4096, device_sources=lambda s: True)
    src = cudastage.device_sources_of(plan)
    assert src is not None
    # big (with its view), ints, half, bool, scalar: one source per non-empty storage
    assert len(src) == 5
    ptrs = {e[1] for e in plan.extents}
    assert sd["big"].untyped_storage().data_ptr() in ptrs  # the extent points at the source itself
    found = src.find(sd["big"].data_ptr() + 100, 50)
    assert found is not None and found[1] == 100
    assert src.find(sd["big"].data_ptr() + sd["big"].untyped_storage().nbytes() - 10, 20) is None
    assert cudastage.device_sources_of(plan_torch(sd, 4096)) is None


@pytest.mark.parametrize("pool_bytes", [2 * 4096, 1 << 20, 64 << 20])
@pytest.mark.parametrize("late", [False, True])
def test_torch_file_through_windows(tmp_path, pool_bytes, late):
    # late: every window's copies finish well after the next window is cut (cutting one takes
    # microseconds), 20 ms late; 2 ms with the 4 KiB windows, which are about 700 (14 s at 20 ms)
    delay = (0.02 if pool_bytes >= 1 << 20 else 0.002) if late else 0.0
    sd = _state()
    plan = plan_torch(sd, 4096, device_sources=lambda s: True)
    path = str(tmp_path / "x.pt")
    cudastage.write_plan_blocking(plan, path, _native.Handle(), StagingPool(pool_bytes), fsync=False,
                                  copier=cudastage.HostCopier(delay=delay))
    ref = str(tmp_path / "ref.pt")
    fastpersist.save(sd, ref)
    with open(path, "rb") as a, open(ref, "rb") as b:
        assert a.read() == b.read()  # byte-identical to the ordinary save, CRC fields included
    out = torch.load(path, weights_only=True)
    _same(sd, out)
    assert out["view"].untyped_storage().data_ptr() == out["big"].untyped_storage().data_ptr()
    assert fastpersist.verify(path).ok


def test_safetensors_through_windows(tmp_path):
    from safetensors.torch import load_file

    sd = {k: v for k, v in _state().items() if isinstance(v, torch.Tensor) and k != "view"}
    plan = plan_safetensors(sd, None, 4096, device_sources=lambda s: True)
    assert len(cudastage.device_sources_of(plan)) == 5
    path = str(tmp_path / "x.safetensors")
    cudastage.write_plan_blocking(plan, path, _native.Handle(), StagingPool(1 << 20), fsync=False,
                                  copier=cudastage.HostCopier(delay=0.01))
    out = load_file(path)
    _same(sd, out)
    assert fastpersist.verify(path).ok


class _Recording:
    """A submit() that checks each window's bytes are final when submitted."""

    def __init__(self, handle, path, plan_bytes: bytes):
        self.handle, self.path, self.expect = handle, path, plan_bytes
        self.offsets: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, off, ptr, n):
        import ctypes

        got = ctypes.string_at(ptr, n)
        exp = self.expect[off:off + n]
        # CRC fields are placeholders in the windows; compare everything else
        assert len(got) == len(exp)
        with self.lock:
            self.offsets.append(off)
        self.mismatch = getattr(self, "mismatch", 0) + sum(1 for a, b in zip(got[::97], exp[::97]) if a != b)
        return self.handle.write_async(self.path, [(off, ptr, n, -1)], truncate=False)


def test_window_submitted_only_after_its_copies(tmp_path):
    sd = {"a": torch.full((1 << 20,), 7, dtype=torch.uint8), "b": torch.full((3 << 20,), 9, dtype=torch.uint8)}
    ref = str(tmp_path / "ref.pt")
    fastpersist.save(sd, ref)
    expect = open(ref, "rb").read()
    plan = plan_torch(sd, 4096, device_sources=lambda s: True)
    path = str(tmp_path / "x.pt")
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC))
    rec = _Recording(_native.Handle(), path, expect)
    writes, crc = cudastage.stream_plan(plan, StagingPool(1 << 20), rec.handle, rec,
                                        copier=cudastage.HostCopier(delay=0.03))
    writes.result()
    crc.done.wait()
    assert rec.offsets == sorted(rec.offsets) and len(rec.offsets) >= 4
    assert rec.mismatch == 0  # sampled bytes: none was submitted before its late copy landed


def test_copy_error_fails_and_stops(tmp_path):
    sd = {"a": torch.ones(3 << 20, dtype=torch.uint8), "b": torch.ones(3 << 20, dtype=torch.uint8)}
    plan = plan_torch(sd, 4096, device_sources=lambda s: True)
    path = str(tmp_path / "x.pt")
    pool = StagingPool(1 << 20)
    with pytest.raises(RuntimeError, match="injected device copy failure"):
        cudastage.write_plan_blocking(plan, path, _native.Handle(), pool, fsync=False,
                                      copier=cudastage.HostCopier(fail_after=2))
    # every window given back: the pool serves a full save afterwards
    cudastage.write_plan_blocking(plan, path, _native.Handle(), pool, fsync=False, copier=cudastage.HostCopier())
    _same(sd, torch.load(path, weights_only=True))


def test_write_error_mid_stream(tmp_path):
    sd = {"a": torch.ones(3 << 20, dtype=torch.uint8)}
    plan = plan_torch(sd, 4096, device_sources=lambda s: True)
    path = str(tmp_path / "x.pt")
    _native.set_fault("write", 2, "EIO")
    try:
        with pytest.raises(OSError):
            cudastage.write_plan_blocking(plan, path, _native.Handle(engine="psync"), StagingPool(1 << 20),
                                          fsync=False, copier=cudastage.HostCopier())
    finally:
        _native.clear_faults()


def test_blocking_save_restarts_on_the_device_path(tmp_path):
    """fastpersist.save's streaming writer meets a device storage after some batches
    were written (batch_bytes tiny): it waits for them and restarts on the GPU path,
    which truncates and rewrites the file. Here the "device" storages are the CPU
    ones named ``dev`` (by address), copied late by HostCopier."""
    from fastpersist.formats.torchzip import stream_save_torch

    sd = {"a": torch.randn(300000), "b": torch.arange(70000), "dev": torch.full((500000,), 3.0), "c": torch.ones(9)}
    dev_ptr = sd["dev"].untyped_storage().data_ptr()
    seen = []

    def pred(storage):
        hit = storage.data_ptr() == dev_ptr
        seen.append(hit)
        return hit

    path = str(tmp_path / "x.pt")
    stream_save_torch(sd, path, _native.Handle(), 4096, fsync=False, batch_bytes=4096, device_pred=pred,
                      copier=cudastage.HostCopier(delay=0.01))
    assert True in seen
    ref = str(tmp_path / "ref.pt")
    fastpersist.save(sd, ref)
    with open(path, "rb") as a, open(ref, "rb") as b:
        assert a.read() == b.read()
    assert fastpersist.verify(path).ok


def test_cpu_saves_never_take_the_device_path(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the GPU path ran for a CPU state")

    monkeypatch.setattr(cudastage, "stream_plan", boom)
    sd = _state()
    fastpersist.save(sd, str(tmp_path / "a.pt"))
    fastpersist.save_async(sd, str(tmp_path / "b.pt")).wait()
    fastpersist.save_async({k: v for k, v in sd.items() if k in ("big", "ints")}, str(tmp_path / "c.safetensors")).wait()
    _same(sd, torch.load(str(tmp_path / "b.pt"), weights_only=True))


def _as_device(monkeypatch, tensors, copier=None):
    """Make the async snapshot treat these CPU storages as device sources (checks the
    save_async hook and the finisher, not CUDA: HostCopier copies them)."""
    ptrs = {t.untyped_storage().data_ptr() for t in tensors}
    monkeypatch.setattr(cudastage, "is_cuda_storage", lambda s: s.data_ptr() in ptrs)
    if copier is not None:
        monkeypatch.setattr(cudastage, "copier_for", lambda sources: copier)


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_save_async_snapshot_hook(tmp_path, monkeypatch, fmt):
    sd = {"a": torch.randn(1 << 20), "b": torch.arange(1000), "c": torch.randn(3 << 18)}
    _as_device(monkeypatch, [sd["a"], sd["c"]])
    calls = []
    real = cudastage.stream_plan
    monkeypatch.setattr(cudastage, "stream_plan", lambda *a, **k: calls.append(1) or real(*a, **k))
    p = str(tmp_path / f"x.{fmt}")
    fut = fastpersist.save_async(sd, p, config=fastpersist.Config(async_staging_limit=1 << 20))
    fut.wait()
    assert fut.exception() is None and calls
    ref = str(tmp_path / f"ref.{fmt}")
    fastpersist.save(sd, ref)
    with open(p, "rb") as a, open(ref, "rb") as b:
        assert a.read() == b.read()
    assert fastpersist.verify(p).ok


def test_save_async_copy_failure_keeps_previous(tmp_path, monkeypatch):
    p = str(tmp_path / "x.pt")
    fastpersist.save({"a": torch.zeros(10)}, p)
    sd = {"a": torch.ones(3 << 20, dtype=torch.uint8), "b": torch.ones(3 << 20, dtype=torch.uint8)}
    _as_device(monkeypatch, list(sd.values()), copier=cudastage.HostCopier(fail_after=1))
    try:
        fut = fastpersist.save_async(sd, p, config=fastpersist.Config(async_staging_limit=1 << 20))
    except RuntimeError as e:  # the failure may be met inside the call
        assert "injected" in str(e)
    else:
        fut.wait()
        assert "injected" in str(fut.exception())
    assert torch.equal(torch.load(p, weights_only=True)["a"], torch.zeros(10))
    assert sorted(os.listdir(tmp_path)) == ["x.pt"]
