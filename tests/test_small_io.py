"""Small checkpoints: an op of one transfer (up to ``chunk_size``) runs in the calling
thread (no engine threads, no pool handoff). Round trips at the sizes around that
limit, and faults in that path: errors name the path, the previous checkpoint stays,
no temporary file is left, short and interrupted transfers stay exact."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import fastpersist
from fastpersist import _native
from fastpersist import io as fio
from fastpersist.testing import inject_fault

KiB = 1024
MiB = 1024 * KiB
CHUNK = 256 * KiB  # a small chunk_size, so "one transfer" and "several" are both cheap to reach


def _state(nbytes: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = max(nbytes // 4, 0)
    return {"w": torch.randn(n, generator=g), "i": torch.arange(7, dtype=torch.int16), "step": seed}


def _equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def _drop(path) -> None:
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


@pytest.mark.parametrize("nbytes", [0, 4, 4092, 4100, CHUNK - 4096, CHUNK, CHUNK + 4096, 3 * CHUNK + 12])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_round_trips_around_one_transfer(tmp_path, nbytes, direct):
    cfg = fastpersist.Config(chunk_size=CHUNK, direct=direct)
    state = _state(nbytes, nbytes)
    p = tmp_path / "c.pt"
    fastpersist.save(state, p, config=cfg)
    assert _equal(torch.load(p, weights_only=True), state)  # a torch file
    for mode in ("auto", "direct", "buffered"):
        _drop(p)
        assert _equal(fastpersist.load(p, config=cfg.replace(read_mode=mode)), state)
    q = tmp_path / "c.safetensors"
    fastpersist.save({"w": state["w"], "i": state["i"]}, q, config=cfg)
    _drop(q)
    out = fastpersist.load(q, config=cfg)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["i"], state["i"])


@pytest.mark.parametrize("engine", [e for e in fio.available_engines() if e != "cufile"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_one_transfer_on_the_native_handle(tmp_path, engine, direct):
    """The handle's own write and read of one chunk: exact, and errors name the path."""
    h = _native.Handle(engine, CHUNK, 8, 2, direct)
    src = torch.randint(0, 256, (CHUNK - 100,), dtype=torch.uint8)
    p = str(tmp_path / "one.bin")
    crc = h.write(p, [(0, src.data_ptr(), src.numel(), 0)], [], 1, fsync=True)
    dst = torch.zeros_like(src)
    assert h.read(p, [(0, dst.data_ptr(), dst.numel(), 0)], 1) == crc and torch.equal(dst, src)
    with inject_fault("read", 1, "EIO"):
        with pytest.raises(OSError) as ei:
            h.read(p, [(0, dst.data_ptr(), dst.numel(), -1)], 0)
    assert ei.value.errno == errno.EIO and ei.value.filename == p
    with inject_fault("write", 1, "ENOSPC"):
        with pytest.raises(OSError) as ei:
            h.write(p, [(0, src.data_ptr(), src.numel(), -1)], [], 0)
    assert ei.value.errno == errno.ENOSPC and ei.value.filename == p
    # short and interrupted transfers are retried: exact bytes
    for action in ("short", "eintr"):
        with inject_fault("write", 1, action, 3):
            h.write(p, [(0, src.data_ptr(), src.numel(), -1)], [], 0)
        dst.zero_()
        with inject_fault("read", 1, action, 3):
            h.read(p, [(0, dst.data_ptr(), dst.numel(), -1)], 0)
        assert torch.equal(dst, src)
    # an async op of one transfer runs on the handle's worker and is collected by wait()
    dst.zero_()
    h.submit_read(p, [(0, dst.data_ptr(), dst.numel(), -1)], 0)
    assert len(h.wait()) == 1 and torch.equal(dst, src)


@pytest.mark.parametrize("op,action,code", [("write", "EIO", errno.EIO), ("write", "ENOSPC", errno.ENOSPC),
                                            ("fsync", "EIO", errno.EIO)])
def test_a_failed_small_save_keeps_the_previous_checkpoint(tmp_path, op, action, code):
    p = tmp_path / "ckpt.pt"
    old = _state(64 * KiB, 1)
    fastpersist.save(old, p)
    with inject_fault(op, 1, action):
        with pytest.raises(OSError) as ei:
            fastpersist.save(_state(64 * KiB, 2), p)
    assert ei.value.errno == code
    assert str(p) in str(ei.value) or ei.value.filename is not None
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]  # no temporary file left
    assert _equal(fastpersist.load(p), old) and _equal(torch.load(p, weights_only=True), old)


def test_a_failed_small_load_names_the_file(tmp_path):
    p = tmp_path / "ckpt.pt"
    state = _state(64 * KiB, 3)
    fastpersist.save(state, p)
    for mode in ("direct", "buffered"):
        _drop(p)
        with inject_fault("read", 1, "EIO", 1000):
            with pytest.raises(OSError) as ei:
                fastpersist.load(p, config=fastpersist.Config(read_mode=mode))
        assert ei.value.errno == errno.EIO and str(p) in str(ei.value)
    assert _equal(fastpersist.load(p), state)  # the file itself is fine
