"""The host side of the GPU load path (fastpersist.cudaload), on CPU.

:func:`ring_read` streams records through a few page-locked windows into
destination tensors; with CPU destinations it runs here, checking the windowing,
the local headers and CRC-32s, and the error handling. The loader hook is run with
:func:`destinations` replaced by one that sends every storage to the CPU through the
ring (labelled as such: it checks the host part of the hook, not CUDA). CUDA
destinations are covered by tests/test_gpu_path.py (skipped without a GPU).
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

import fastpersist
from fastpersist import _native, cudaload
from fastpersist._sys import pread_full
from fastpersist.errors import ChecksumError
from fastpersist.formats import torchdevice, torchload
from fastpersist.io import GpuPath


def _state():
    g = torch.Generator().manual_seed(5)
    big = torch.randn(600, 1000, generator=g)
    return {
        "big": big,
        "view": big[10:20],
        "small": torch.arange(100, dtype=torch.int16),
        "odd": torch.randn(12345, generator=g).to(torch.bfloat16),
        "bool": torch.tensor([True, False]),
        "empty": torch.empty(0, 3),
        "x": {"y": [torch.ones(7, dtype=torch.complex64)]},
    }


def _open_load(path):
    fd = os.open(path, os.O_RDONLY)
    load = torchload.LoadState(path, fd, os.fstat(fd).st_size, True, False)
    load.index()
    return fd, load


@pytest.mark.parametrize("window,windows", [(4096, 1), (8192, 2), (1 << 20, 3), (16 << 20, 4)])
def test_ring_read_cpu_destinations(tmp_path, window, windows):
    p = str(tmp_path / "a.pt")
    fastpersist.save(_state(), p)
    fd, load = _open_load(p)
    try:
        recs = [r for r in load.records if r.short.startswith("data/") and r.size]
        recs.sort(key=lambda r: r.entry.header_offset)
        items = [cudaload.RingItem(r.entry.header_offset, r.data_offset, r.size,
                                   torch.empty(r.size, dtype=torch.uint8)) for r in recs]
        cudaload.ring_read(fd, _native.Handle(), items, windows=windows, window=window)
        with open(p, "rb") as f:
            data = f.read()
        for r, it in zip(recs, items):
            assert bytes(it.dest.numpy()) == data[r.data_offset:r.data_end]
            assert bytes(it.header) == data[r.entry.header_offset:r.data_offset]
            assert it.crc == r.entry.crc32
            load.check_header(r, memoryview(it.header))
    finally:
        os.close(fd)


def _all_to_cpu(map_location, pids):
    """Stand-in for destinations(): every storage through the ring, to the CPU."""
    return {str(pid[2]): torch.device("cpu") for pid in pids if isinstance(pid, tuple) and len(pid) == 5}


def _ring_for_cpu(monkeypatch):
    """Route every storage of a CPU load through the ring. Weights-only CPU loads
    normally take torchload._load_fast (no storage can go to a device there, so the
    ring is never asked); switched off here, so the hook the GPU path uses is reached."""
    monkeypatch.setattr(torchdevice, "destinations", _all_to_cpu)
    monkeypatch.setattr(torchload, "_fast_unpickle_allowed", lambda *a, **k: False)


def test_loader_hook_through_ring(tmp_path, monkeypatch):
    sd = _state()
    p = str(tmp_path / "a.pt")
    fastpersist.save(sd, p)
    calls = []
    real = torchdevice.read_to_device

    def spy(*a, **k):
        out = real(*a, **k)
        calls.append(len(out))
        return out

    _ring_for_cpu(monkeypatch)
    monkeypatch.setattr(torchdevice, "read_to_device", spy)
    out = fastpersist.load(p, weights_only=True)
    ref = torch.load(p, weights_only=True)
    assert calls and calls[0] == 5  # every non-empty storage went through the ring
    for k in ("big", "view", "small", "odd", "bool", "empty"):
        assert torch.equal(out[k], ref[k]) and out[k].dtype == ref[k].dtype
    assert torch.equal(out["x"]["y"][0], ref["x"]["y"][0])
    assert out["view"].untyped_storage().data_ptr() == out["big"].untyped_storage().data_ptr()


def test_loader_hook_detects_corruption(tmp_path, monkeypatch):
    p = str(tmp_path / "a.pt")
    fastpersist.save({"w": torch.ones(100000)}, p)
    fd, load = _open_load(p)
    r = load.by_short["data/0"]
    os.close(fd)
    with open(p, "r+b") as f:
        f.seek(r.data_offset + 1000)
        f.write(b"\x12")
    _ring_for_cpu(monkeypatch)
    with pytest.raises(ChecksumError):
        fastpersist.load(p, weights_only=True)


def test_ring_read_error_waits_and_raises(tmp_path):
    p = str(tmp_path / "a.pt")
    fastpersist.save({"w": torch.ones(1 << 20)}, p)
    fd, load = _open_load(p)
    try:
        r = load.by_short["data/0"]
        it = cudaload.RingItem(r.entry.header_offset, r.data_offset, r.size, torch.empty(r.size, dtype=torch.uint8))
        _native.set_fault("read", 2, "EIO")
        try:
            with pytest.raises(OSError):
                cudaload.ring_read(fd, _native.Handle(engine="psync"), [it], window=1 << 20, windows=2)
        finally:
            _native.clear_faults()
    finally:
        os.close(fd)


def test_destinations_without_cuda_targets():
    pids = [("storage", None, "0", "cpu", 4), ("storage", None, "1", "cuda:0", 4)]
    assert torchdevice.destinations("cpu", pids) == {}
    assert torchdevice.destinations(torch.device("cpu"), pids) == {}
    assert torchdevice.destinations({"cuda:0": "cpu"}, pids) == {}
    assert torchdevice.destinations(lambda s, loc: s, pids) == {}
    if not torch.cuda.is_available():
        assert torchdevice.destinations(None, pids) == {}  # torch raises its own error for cuda:0 later
        assert torchdevice.destinations("cuda", pids) == {}


def test_windows_of_cuts_and_merges():
    mk = lambda h, d, n: cudaload.RingItem(h, d, n, torch.empty(0, dtype=torch.uint8))  # noqa: E731
    items = [mk(0, 100, 5000), mk(5100, 8192, 10000), mk(50 << 20, (50 << 20) + 64, 10)]
    cuts = cudaload._windows_of(items, 8192)
    assert cuts[0][0] == 0 and cuts[-1] == (50 << 20, (50 << 20) + 74)
    covered = [c for c in cuts if c[0] < 18192]
    assert covered[-1][1] == 18192 and all(b - a <= 8192 for a, b in cuts)
    assert all(cuts[i][1] == cuts[i + 1][0] for i in range(len(covered) - 1))


def test_safetensors_ring_load_on_cpu(tmp_path):
    """The CUDA safetensors load path (every tensor through the ring), with CPU destinations."""
    from fastpersist.formats.safetensors.header import read_header
    from fastpersist.formats.safetensors.load import _load_via_ring

    g = torch.Generator().manual_seed(1)
    sd = {"a": torch.randn(300, 700, generator=g), "b": torch.arange(11, dtype=torch.int8),
          "c": torch.randn(5, generator=g).to(torch.bfloat16), "e": torch.empty(0, 4), "t": torch.tensor(True)}
    p = str(tmp_path / "a.safetensors")
    fastpersist.save(sd, p)
    out = _load_via_ring(p, read_header(p), _native.Handle(), torch.device("cpu"), checksum=True)
    for k, v in sd.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape and torch.equal(out[k], v), k
    with open(p, "r+b") as f:
        f.seek(-100, 2)
        b = f.read(1)
        f.seek(-100, 2)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(ChecksumError):
        _load_via_ring(p, read_header(p), _native.Handle(), torch.device("cpu"), checksum=True)
    _load_via_ring(p, read_header(p), _native.Handle(), torch.device("cpu"), checksum=False)


def test_ring_windows_reused_across_loads(tmp_path):
    p = str(tmp_path / "a.pt")
    fastpersist.save({"w": torch.randn(1 << 20)}, p)
    fd, load = _open_load(p)
    try:
        r = load.by_short["data/0"]
        cudaload._spare.clear()

        def once():
            it = cudaload.RingItem(r.entry.header_offset, r.data_offset, r.size, torch.empty(r.size, dtype=torch.uint8))
            cudaload.ring_read(fd, _native.Handle(), [it], window=1 << 20, windows=2)
            assert it.crc == r.entry.crc32

        once()
        kept = [b.ptr for b in cudaload._spare[1 << 20]]
        assert len(kept) == 2
        once()
        assert sorted(b.ptr for b in cudaload._spare[1 << 20]) == sorted(kept)
    finally:
        os.close(fd)
        cudaload._spare.clear()


@pytest.mark.parametrize("err", [errno.ENOTSUP, errno.EIO])
def test_cufile_refusal_falls_back_to_the_ring(tmp_path, monkeypatch, err):
    """cuFile's driver opened but cuFileHandleRegister refuses the file (ENOTSUP: seen on a
    GPU VM whose filesystem has no nvidia-fs): engine "auto" reads the same records through
    the ring, with nothing left over from the refused attempt (its headers were read already);
    any other error is raised. CUDA destinations are declared, the bytes land in CPU tensors."""
    p = str(tmp_path / "a.pt")
    fastpersist.save(_state(), p)
    monkeypatch.setattr(cudaload, "gpu_path", lambda *a, **k: GpuPath("pinned", "test", "cufile", "test"))
    tried = []

    def refused(fd, path, reader, items):  # as _cufile_read: headers read first, then the data op fails
        for it in items:
            it.header = bytearray(pread_full(fd, it.data_offset - it.header_offset, it.header_offset, path))
        tried.append(len(items))
        raise OSError(err, "cuFileHandleRegister refused the file", path)

    monkeypatch.setattr(cudaload, "_cufile_read", refused)
    fd, load = _open_load(p)
    try:
        dest = {r.short[5:]: torch.device("cuda") for r in load.records if r.short.startswith("data/") and r.size}
        cpu = lambda n, dev: torch.empty(n, dtype=torch.uint8)  # noqa: E731
        if err != errno.ENOTSUP:
            with pytest.raises(OSError) as info:
                torchdevice.read_to_device(load, _native.Handle(), fd, dest, allocate=cpu)
            assert info.value.errno == err
            return
        records = torchdevice.read_to_device(load, _native.Handle(), fd, dest, allocate=cpu)
    finally:
        os.close(fd)
    assert tried == [len(dest)] and len(records) == len(dest)
    with open(p, "rb") as f:
        data = f.read()
    for r in records:
        assert bytes(r.device.numpy()) == data[r.data_offset:r.data_offset + r.size]
