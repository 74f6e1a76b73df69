"""Fault matrix: the write and read paths that the older fault tests did not reach.

Write paths (``.safetensors`` save, save_async snapshot and lazy, the torch.save switch,
the 2-rank group save, the Lightning and Accelerate adapters): EIO/ENOSPC/fsync errors
raise an OSError naming errno and path and keep the previous checkpoint byte for byte;
short writes and EINTR are retried and give the exact bytes of a fault-free save; a
SIGKILL mid-save keeps the previous file.

Read paths (``load(mmap=True)``, safetensors ``load``, ``verify``, ``load_state_dict``,
``open().get``): an I/O error raises (never values); short reads and EINTR give the
exact values. The checked mmap load reads payloads and its CRC pass through a mapping
(page faults, not read syscalls): the native read faults cannot reach it, which
``test_mmap_load_reads_through_the_mapping`` pins down; its syscall reads (the magic /
the safetensors header, ``os.pread``) are faulted from Python instead.
"""

from __future__ import annotations

import copy
import errno
import filecmp
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from functools import partial
from typing import Any, Callable, Iterator

import pytest
import torch

import fastpersist
import fastpersist.testing
from fastpersist import _native
from fastpersist.commit import TMP_MARKER
from test_distributed import launch, ok, outcome, run_scenarios  # tests/ is on sys.path

ENGINES = [e for e in _native.available_engines() if e in ("aio", "psync")]
CHUNK = 64 << 10


def _cfg(engine: str = "psync", **kw: Any) -> fastpersist.Config:
    # small chunks: the ~1 MiB states below take a few dozen write/read calls
    return fastpersist.Config(engine=engine, chunk_size=CHUNK, queue_depth=4, threads=2, **kw)


def _tensors(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 1000, generator=g), "b": torch.randn(1000, generator=g),
            "i": torch.arange(5000, dtype=torch.int32) * seed, "h": torch.randn(777, generator=g).half()}


def _leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if TMP_MARKER in p.name)


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k].view(-1).view(torch.uint8), want[k].view(-1).view(torch.uint8)), k


@pytest.fixture(autouse=True)
def _clean_async():
    yield
    _native.clear_faults()
    from fastpersist import asyncsave

    try:
        fastpersist.wait_all(60)
    except Exception:  # noqa: BLE001 - a test's own injected failure
        pass
    for opt in list(asyncsave._guards.keys()):
        asyncsave._guards[opt].remove()


def _keeps_previous(path, make_old: Callable[[], Any], load_check: Callable[[Any], None]):
    """A good file at ``path``; returns a checker that it is untouched and loadable, no temp left."""
    make_old()
    digest, st = _digest(path), os.stat(path)

    def check() -> None:
        _native.clear_faults()
        assert _digest(path) == digest, "previous checkpoint modified"
        assert os.stat(path).st_ino == st.st_ino, "previous checkpoint replaced"
        load_check(path)
        assert _leftovers(path.parent) == []

    return check


# =========================================================================== 1. save to .safetensors


@pytest.fixture
def st_previous(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    old = _tensors(1)

    def load_check(p):
        from safetensors.torch import load_file

        _equal(load_file(str(p)), old)
        _equal(fastpersist.load(p), old)
        assert fastpersist.verify(p).ok

    check = _keeps_previous(path, lambda: fastpersist.save(old, path), load_check)
    yield path
    check()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("action,code", [("EIO", errno.EIO), ("ENOSPC", errno.ENOSPC)])
@pytest.mark.parametrize("nth", [1, 3, 9])
def test_safetensors_write_errors_keep_previous(st_previous, engine, action, code, nth):
    _native.set_fault("write", nth, action)
    with pytest.raises(OSError) as info:
        fastpersist.save(_tensors(2), st_previous, config=_cfg(engine))
    assert _native.fault_hits() == 1
    assert info.value.errno == code and info.value.filename == str(st_previous)
    assert TMP_MARKER in str(info.value)  # the temporary file is named too


@pytest.mark.parametrize("engine", ENGINES)
def test_safetensors_fsync_error_keeps_previous(st_previous, engine):
    _native.set_fault("fsync", 1, "EIO")
    with pytest.raises(OSError) as info:
        fastpersist.save(_tensors(2), st_previous, config=_cfg(engine, fsync=True))
    assert _native.fault_hits() == 1
    assert info.value.errno == errno.EIO and info.value.filename == str(st_previous)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("action,nth,count", [("short", 1, 1), ("short", 5, 4), ("eintr", 1, 1), ("eintr", 5, 5)])
def test_safetensors_short_and_eintr_writes_are_exact(tmp_path, engine, action, nth, count):
    new = _tensors(3)
    fastpersist.save(new, tmp_path / "ref.safetensors", config=_cfg(engine))
    _native.set_fault("write", nth, action, count)
    fastpersist.save(new, tmp_path / "x.safetensors", config=_cfg(engine))
    assert _native.fault_hits() == count
    _native.clear_faults()
    assert (tmp_path / "x.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert _leftovers(tmp_path) == []


# --------------------------------------------------------------------------- SIGKILL mid-save (subprocess)

_CHILD = textwrap.dedent(
    """
    import sys, time, torch, fastpersist
    path, how = sys.argv[1], sys.argv[2]
    state = {"big": torch.full((50 * 1024 * 1024,), 7.0), "small": torch.ones(10)}   # 200 MiB
    cfg = fastpersist.Config(chunk_size=256 << 10, queue_depth=2, threads=1, fsync=True)
    print("ready", flush=True)
    if how == "save":
        fastpersist.save(state, path, config=cfg)
    else:
        fut = fastpersist.save_async(state, path, config=cfg)
        print("pending", flush=True)
        fut.wait()
    print("saved", flush=True)
    """
)


def _kill_mid_save(path, how: str) -> str:
    """Run a child saving 200 MiB to ``path``; SIGKILL it once its temporary file holds
    more than 8 MiB; return that temporary file's name."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), how], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and child.poll() is None:
            names = _leftovers(path.parent)
            if names and os.path.getsize(path.parent / names[0]) > (8 << 20):
                os.kill(child.pid, signal.SIGKILL)
                assert child.wait(60) == -signal.SIGKILL
                return names[0]
            time.sleep(0.0005)
        raise AssertionError(f"no temporary file seen in time (child exit {child.poll()})")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.parametrize("suffix,how", [(".safetensors", "save"), (".pt", "save_async")])
def test_sigkill_mid_save_keeps_previous(tmp_path, suffix, how):
    path = tmp_path / f"ckpt{suffix}"
    old = {"old": torch.arange(1000, dtype=torch.float32)}
    fastpersist.save(old, path)
    before, st = path.read_bytes(), os.stat(path)
    temp = _kill_mid_save(path, how)
    now = os.stat(path)
    assert (now.st_ino, now.st_mtime_ns, now.st_size) == (st.st_ino, st.st_mtime_ns, st.st_size)
    assert path.read_bytes() == before
    _equal(fastpersist.load(path), old)
    if suffix == ".safetensors":
        from safetensors.torch import load_file

        _equal(load_file(str(path)), old)
    else:
        _equal(torch.load(path, weights_only=True), old)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, temp])
    # the next save removes the dead writer's temporary file
    fastpersist.save({"new": torch.ones(3)}, path)
    assert _leftovers(tmp_path) == [], "the killed writer's temporary file was not cleaned up"
    assert torch.equal(fastpersist.load(path)["new"], torch.ones(3))


# =========================================================================== 2. save_async snapshot


@pytest.fixture
def pt_previous(tmp_path):
    path = tmp_path / "ckpt.pt"
    old = _tensors(1)

    def load_check(p):
        _equal(torch.load(p, weights_only=True), old)
        assert fastpersist.verify(p).ok

    check = _keeps_previous(path, lambda: fastpersist.save(old, path), load_check)
    yield path
    check()


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
@pytest.mark.parametrize("nth", [1, 4])
def test_async_snapshot_enospc_keeps_previous(tmp_path, suffix, nth):
    path = tmp_path / f"ckpt{suffix}"
    old = _tensors(1)
    check = _keeps_previous(path, lambda: fastpersist.save(old, path), lambda p: _equal(fastpersist.load(p), old))
    _native.set_fault("write", nth, "ENOSPC")
    fut = fastpersist.save_async(_tensors(2), path, config=_cfg(async_staging_limit=256 << 10))
    with pytest.raises(OSError) as info:
        fut.wait(60)
    assert _native.fault_hits() == 1
    e = info.value
    assert e.errno == errno.ENOSPC and e.filename == str(path), (e.errno, e.filename, str(e))
    assert "previous file" in str(e)
    check()


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
@pytest.mark.parametrize("action,nth,count", [("short", 1, 3), ("short", 6, 1), ("eintr", 1, 3), ("eintr", 6, 4)])
def test_async_snapshot_short_and_eintr_writes_are_exact(tmp_path, suffix, action, nth, count):
    state = _tensors(4)
    fastpersist.save(copy.deepcopy(state), tmp_path / f"ref{suffix}")
    _native.set_fault("write", nth, action, count)
    fut = fastpersist.save_async(state, tmp_path / f"a{suffix}", config=_cfg(async_staging_limit=256 << 10))
    for t in state.values():  # the saved bytes are those of the call
        t.zero_()
    assert fut.wait(60) is True
    assert _native.fault_hits() == count
    _native.clear_faults()
    assert (tmp_path / f"a{suffix}").read_bytes() == (tmp_path / f"ref{suffix}").read_bytes()
    assert _leftovers(tmp_path) == []


# =========================================================================== 3. save_async lazy (guard)


def _model_opt():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt


def _train_step(model, opt) -> None:
    opt.zero_grad()
    model(torch.randn(16, 128)).pow(2).mean().backward()
    opt.step()


def _in_thread(fn: Callable[[], Any], timeout: float = 60) -> None:
    box: dict = {}

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            box["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "hung (the guard never released the step?)"
    if "e" in box:
        raise box["e"]


def test_lazy_eio_raised_at_wait_keeps_previous_and_step_still_works(tmp_path):
    model, opt = _model_opt()
    fastpersist.guard(opt)
    _train_step(model, opt)
    path = tmp_path / "ckpt.pt"
    old = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
    check = _keeps_previous(path, lambda: fastpersist.save(old, path),
                            lambda p: _equal(torch.load(p, weights_only=True)["model"], old["model"]))
    _train_step(model, opt)
    _native.set_fault("write", 1, "EIO", 100000)
    fut = fastpersist.save_async({"model": model.state_dict(), "optim": opt.state_dict()}, path, mode="lazy",
                                 config=_cfg(async_staging_limit=4 << 20))
    w_before = model[0].weight.detach().clone()
    _in_thread(lambda: _train_step(model, opt))  # the guard lets the step run though the writes fail
    assert not torch.equal(model[0].weight, w_before), "optimizer.step did not update the weights"
    with pytest.raises(OSError) as info:
        fut.wait(60)
    assert info.value.errno == errno.EIO and info.value.filename == str(path), str(info.value)
    assert _native.fault_hits() >= 1
    check()
    _native.clear_faults()
    _in_thread(lambda: _train_step(model, opt))  # and after the failure is collected
    fastpersist.save_async({"model": model.state_dict()}, tmp_path / "next.pt", mode="lazy").wait(60)
    _equal(torch.load(tmp_path / "next.pt", weights_only=True)["model"], model.state_dict())


@pytest.mark.parametrize("action,nth,count", [("short", 1, 3), ("eintr", 2, 5)])
def test_lazy_short_and_eintr_writes_are_exact(tmp_path, action, nth, count):
    model, opt = _model_opt()
    fastpersist.guard(opt)
    _train_step(model, opt)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    fastpersist.save(copy.deepcopy(state), tmp_path / "ref.pt")
    _native.set_fault("write", nth, action, count)
    fut = fastpersist.save_async(state, tmp_path / "l.pt", mode="lazy", config=_cfg(async_staging_limit=4 << 20))
    _in_thread(lambda: _train_step(model, opt))
    _in_thread(lambda: _train_step(model, opt))
    assert fut.wait(60) is True
    assert _native.fault_hits() == count
    assert (tmp_path / "l.pt").read_bytes() == (tmp_path / "ref.pt").read_bytes()
    assert _leftovers(tmp_path) == []


# =========================================================================== 4. the torch.save switch


@pytest.mark.parametrize("action,code", [("EIO", errno.EIO), ("ENOSPC", errno.ENOSPC)])
@pytest.mark.parametrize("nth", [1, 5])
def test_torch_save_switch_write_errors_keep_previous(tmp_path, action, code, nth):
    path = tmp_path / "ckpt.pt"
    old = _tensors(1)
    # the switch takes the process-wide configuration: small chunks, so the 5th write exists
    with fastpersist.config.override(chunk_size=CHUNK, engine="psync"), fastpersist.patch_torch_save():
        assert torch.save is not torch.serialization.save
        check = _keeps_previous(path, lambda: torch.save(old, path),
                                lambda p: _equal(torch.serialization.load(p, weights_only=True), old))
        _native.set_fault("write", nth, action)
        with pytest.raises(OSError) as info:
            torch.save(_tensors(2), path)
    assert _native.fault_hits() == 1
    assert info.value.errno == code and info.value.filename == str(path), str(info.value)
    assert str(path) in str(info.value)
    check()


# =========================================================================== 5. read paths


def _lsd_target(sd: dict) -> dict:
    return {k: torch.zeros_like(v) for k, v in sd.items()}


def _do_load_mmap(path, cfg):
    return fastpersist.load(path, mmap=True, config=cfg)


def _do_load(path, cfg):
    return fastpersist.load(path, config=cfg)


def _do_verify(path, cfg):
    r = fastpersist.verify(path, config=cfg)
    assert r.ok, r
    return r


def _do_lsd(path, cfg):
    target = _lsd_target(_tensors(5))
    fastpersist.load_state_dict(target, path, config=cfg)
    return target


def _do_open_get(path, cfg):
    with fastpersist.open(path, config=cfg) as f:
        return {k: f.get(k) for k in ("w", "h")}


READERS = {"load_mmap": _do_load_mmap, "load": _do_load, "verify": _do_verify, "load_state_dict": _do_lsd,
           "open_get": _do_open_get}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("read")
    want = _tensors(5)
    out = {}
    for suffix in (".pt", ".safetensors"):
        out[suffix] = d / f"c{suffix}"
        fastpersist.save(want, out[suffix])
    return out, want


def _check_values(name: str, got: Any, want: dict) -> None:
    if name == "verify":
        return
    if name == "open_get":
        want = {k: want[k] for k in ("w", "h")}
    _equal(got, want)


# (reader, suffix) cells whose reads go through the native handle
NATIVE_READ_CELLS = [(r, s) for r in READERS if r != "load_mmap" for s in (".pt", ".safetensors")
                     if not (r == "load" and s == ".pt")]  # torch load + native read faults: test_atomic


@pytest.mark.parametrize("reader,suffix", NATIVE_READ_CELLS)
@pytest.mark.parametrize("nth", [1, 3])
def test_native_read_eio_raises_naming_the_path(saved, reader, suffix, nth):
    files, _want = saved
    path = files[suffix]
    _native.set_fault("read", nth, "EIO")
    result: list = []
    with pytest.raises(OSError) as info:
        result.append(READERS[reader](path, _cfg()))
    assert not result
    assert _native.fault_hits() == 1
    e = info.value
    assert e.errno == errno.EIO and e.filename == str(path), (e.errno, e.filename, str(e))
    if reader == "load_state_dict":  # reading had started: the target is partly overwritten
        assert isinstance(e, fastpersist.PartialLoadError) and "partly overwritten" in str(e)


@pytest.mark.parametrize("reader,suffix", NATIVE_READ_CELLS + [("load", ".pt")])
@pytest.mark.parametrize("action,nth,count", [("short", 1, 3), ("eintr", 2, 4)])
def test_native_short_and_eintr_reads_are_exact(saved, reader, suffix, action, nth, count):
    files, want = saved
    _native.set_fault("read", nth, action, count)
    got = READERS[reader](files[suffix], _cfg())
    assert _native.fault_hits() == count
    _native.clear_faults()
    _check_values(reader, got, want)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_mmap_load_reads_through_the_mapping(saved, suffix):
    """Native read faults cannot reach the checked mmap load (payloads and CRC pass read
    through the mapping): it never hits one and returns the right values."""
    files, want = saved
    _native.set_fault("read", 1, "EIO", 100000)
    got = _do_load_mmap(files[suffix], _cfg())
    assert _native.fault_hits() == 0
    _native.clear_faults()
    _equal(got, want)


def _failing_pread(monkeypatch, nth: int, action: str) -> list:
    """Python's os.pread (the index/header/magic reads): the nth call fails with EIO,
    or every call returns at most half of what was asked (short reads)."""
    real = os.pread
    calls: list = []

    def pread(fd, n, off):
        calls.append((n, off))
        if action == "EIO" and len(calls) == nth:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        if action == "short":
            return real(fd, max(1, n // 2), off)
        return real(fd, n, off)

    monkeypatch.setattr(os, "pread", pread)
    return calls


ALL_READ_CELLS = [(r, s) for r in READERS for s in (".pt", ".safetensors")]


@pytest.mark.parametrize("reader,suffix", ALL_READ_CELLS)
def test_index_read_eio_raises(saved, monkeypatch, reader, suffix):
    """EIO on the first Python-level read of the file (magic, zip index, safetensors
    header): an OSError with the errno, never values; a load-into target is untouched."""
    files, _want = saved
    target = _lsd_target(_tensors(5))
    result: list = []
    calls = _failing_pread(monkeypatch, 1, "EIO")
    with pytest.raises(OSError) as info:
        if reader == "load_state_dict":
            fastpersist.load_state_dict(target, files[suffix], config=_cfg())
        else:
            result.append(READERS[reader](files[suffix], _cfg()))
    monkeypatch.undo()
    assert calls and not result
    assert info.value.errno == errno.EIO
    assert all(not t.any() for t in target.values())  # nothing read: nothing overwritten


@pytest.mark.parametrize("reader,suffix", ALL_READ_CELLS)
def test_index_read_eio_names_the_path(saved, monkeypatch, reader, suffix):
    files, _want = saved
    _failing_pread(monkeypatch, 1, "EIO")
    with pytest.raises(OSError) as info:
        READERS[reader](files[suffix], _cfg())
    monkeypatch.undo()
    assert info.value.filename == str(files[suffix]) or str(files[suffix]) in str(info.value), str(info.value)


@pytest.mark.parametrize("reader,suffix", ALL_READ_CELLS)
def test_short_index_reads_are_exact(saved, monkeypatch, reader, suffix):
    files, want = saved
    calls = _failing_pread(monkeypatch, 0, "short")
    got = READERS[reader](files[suffix], _cfg())
    monkeypatch.undo()
    assert calls
    _check_values(reader, got, want)


@pytest.fixture(scope="module")
def corrupted(saved, tmp_path_factory):
    files, _want = saved
    d = tmp_path_factory.mktemp("corrupt")
    out = {}
    for suffix, src in files.items():
        data = bytearray(src.read_bytes())
        data[len(data) // 2] ^= 0x40  # inside the payload of "w" (1 MB of the ~1.05 MB)
        out[suffix] = d / src.name
        out[suffix].write_bytes(bytes(data))
    return out


@pytest.mark.parametrize("reader,suffix", ALL_READ_CELLS)
def test_short_index_reads_still_detect_corruption(corrupted, monkeypatch, reader, suffix):
    """Short Python-level reads (magic, index, header) must not switch off the CRC check."""
    from fastpersist.errors import ChecksumError

    path = corrupted[suffix]
    calls = _failing_pread(monkeypatch, 0, "short")
    if reader == "verify":
        result = fastpersist.verify(path, config=_cfg())
        monkeypatch.undo()
        assert not result.ok, result
    else:
        with pytest.raises((ChecksumError, fastpersist.PartialLoadError)) as info:
            READERS[reader](path, _cfg())
        monkeypatch.undo()
        if reader == "load_state_dict":
            assert isinstance(info.value.__cause__, ChecksumError), repr(info.value)
    assert calls


# =========================================================================== 6. group save (2 gloo ranks, one launch)


def _gstate(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(300, 170, generator=g), "b": torch.randn(1000, generator=g)},
            "many": [torch.randn(17 * i + 1, generator=g) for i in range(12)], "step": 7 + seed}


def _gcfg() -> fastpersist.Config:
    return fastpersist.Config(dist_timeout=5.0, fsync=False, chunk_size=CHUNK)


def _gsave(d: str, name: str, seed: int = 0) -> None:
    fastpersist.save(_gstate(seed), os.path.join(d, name), group=torch.distributed.group.WORLD, config=_gcfg())


def gs_eio_rank1(rank: int, d: str) -> Any:
    if rank == 1:
        _native.set_fault("write", 1, "EIO")
    try:
        _gsave(d, "prev.pt", 1)
    finally:
        _native.clear_faults()


def _retried(action: str, rank: int, d: str) -> Any:
    _native.set_fault("write", 1 + rank, action, 3)
    try:
        _gsave(d, f"{action}.pt")
        return _native.fault_hits()
    finally:
        _native.clear_faults()


def gs_short(rank: int, d: str) -> Any:
    return _retried("short", rank, d)


def gs_eintr(rank: int, d: str) -> Any:
    return _retried("eintr", rank, d)


class _OsWith:
    """Stands for ``os`` inside fastpersist.collectivesave with another ``pwrite``."""

    def __init__(self, pwrite: Callable[..., int]) -> None:
        self.pwrite = pwrite

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


def _with_pwrite(pwrite: Callable[..., int], fn: Callable[[], Any]) -> Any:
    from fastpersist import _sys

    _sys.os = _OsWith(pwrite)  # the CRC-field writes go through fastpersist._sys (fault injection)
    try:
        return fn()
    finally:
        _sys.os = os


def gs_pwrite_eio(rank: int, d: str) -> Any:
    calls = []

    def pwrite(fd, data, off):
        calls.append(off)
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    if rank == 1:
        _with_pwrite(pwrite, lambda: _gsave(d, "prev.pt", 1))
    else:
        _gsave(d, "prev.pt", 1)


def gs_pwrite_short(rank: int, d: str) -> Any:
    calls = []

    def pwrite(fd, data, off):
        calls.append(len(data))
        return os.pwrite(fd, bytes(data[: max(1, len(data) // 3)]), off)

    _with_pwrite(pwrite, lambda: _gsave(d, "pshort.pt"))
    return len(calls)


def gs_commit_faults(rank: int, d: str) -> Any:
    """Rank 0 fails, one by one, every fsync, rename, open and write of a collective save
    with fsync on (section 8); rank 1 saves along. Returns rank 0's outcomes."""
    import torch.distributed as dist

    path = os.path.join(d, "commit.pt")
    cfg = fastpersist.Config(dist_timeout=20.0, fsync=True, chunk_size=CHUNK)
    fastpersist.save(_gstate(1), path, group=dist.group.WORLD, config=cfg)
    before = _digest_path(path) if rank == 0 else None
    out = []
    for op in OPS:
        for nth in range(1, MAX_NTH + 1):
            if rank == 0:
                _native.set_fault(op, nth, "EIO")
            try:
                fastpersist.save(_gstate(2), path, group=dist.group.WORLD, config=cfg)
                err = None
            except Exception as e:  # noqa: BLE001 - recorded
                err = e
            hits = _native.fault_hits() if rank == 0 else 0
            _native.clear_faults()
            flag = [hits]
            dist.broadcast_object_list(flag, src=0)
            if rank == 0 and flag[0]:
                out.append((op, nth, _classify(err, path, before, d)))
            if rank == 0:  # the next try starts from the previous checkpoint again
                fastpersist.save(_gstate(1), path + ".fresh", config=fastpersist.Config(fsync=False))
                os.replace(path + ".fresh", path)
            dist.barrier()
            if not flag[0]:
                break
    return out


def gs_temps(rank: int, d: str) -> Any:
    torch.distributed.barrier()
    return sorted(n for n in os.listdir(d) if TMP_MARKER in n)


GROUP_SCENARIOS = {n[3:]: f for n, f in list(globals().items()) if n.startswith("gs_")}


def _group_worker(rank: int, world: int, port: int, d: str, names: list[str]) -> None:
    run_scenarios(rank, world, port, d, names, {n: partial(_without_world, f) for n, f in GROUP_SCENARIOS.items()})


def _without_world(fn: Callable[[int, str], Any], rank: int, world: int, d: str) -> Any:
    return fn(rank, d)


@pytest.fixture(scope="module")
def group2(tmp_path_factory):
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        pytest.skip("no gloo backend")
    d = str(tmp_path_factory.mktemp("group2"))
    fastpersist.save(_gstate(), os.path.join(d, "ref.pt"), config=_gcfg())
    fastpersist.save(_gstate(), os.path.join(d, "prev.pt"), config=_gcfg())

    names = ["eio_rank1", "short", "eintr", "pwrite_eio", "pwrite_short", "commit_faults", "temps"]
    results = launch(2, d, names, limit=120, target=_group_worker)
    return d, results


@pytest.mark.parametrize("name,words", [("eio_rank1", "Input/output error"),
                                        ("pwrite_eio", "writing CRC fields")])
def test_group_save_failure_on_rank1_fails_every_rank_keeps_previous(group2, name, words):
    d, results = group2
    for rank in range(2):
        got = outcome(results, name, rank)
        assert got[0] == "error" and got[1] == "DistributedCheckpointError", got
        assert "rank 1" in got[2] and words in got[2], got[2]
        assert list(got[3].get("failures", {})) == [1], got
    assert filecmp.cmp(os.path.join(d, "ref.pt"), os.path.join(d, "prev.pt"), shallow=False)
    from conftest import assert_same_object

    assert_same_object(torch.load(os.path.join(d, "prev.pt"), weights_only=True), _gstate())
    assert ok(results, "temps") == [[], []]


@pytest.mark.parametrize("name", ["short", "eintr"])
def test_group_save_short_and_eintr_writes_are_exact(group2, name):
    d, results = group2
    assert ok(results, name) == [3, 3]  # every rank's injected faults were hit and retried
    assert filecmp.cmp(os.path.join(d, "ref.pt"), os.path.join(d, f"{name}.pt"), shallow=False)


def test_group_save_short_crc_field_pwrites_are_exact(group2):
    d, results = group2
    calls = ok(results, "pwrite_short")
    # rank 1's slice holds the central directory's CRC fields: its short writes were retried
    assert calls[1] >= 2, calls
    assert filecmp.cmp(os.path.join(d, "ref.pt"), os.path.join(d, "pshort.pt"), shallow=False)


# =========================================================================== 7. Lightning and Accelerate


@pytest.mark.parametrize("async_save", [False, True])
def test_lightning_checkpoint_io_enospc_keeps_previous(tmp_path, async_save):
    pytest.importorskip("lightning")
    from fastpersist.integrations.lightning import classes_for

    io = classes_for("lightning.pytorch").FastPersistCheckpointIO(async_save=async_save, config=_cfg())
    path = tmp_path / "epoch=0.ckpt"
    old = {"state_dict": _tensors(1), "epoch": 0, "global_step": 10}
    io.save_checkpoint(old, path)
    io.finalize()
    digest = _digest(path)
    _native.set_fault("write", 2, "ENOSPC")
    with pytest.raises(OSError) as info:
        io.save_checkpoint({"state_dict": _tensors(2), "epoch": 1, "global_step": 20}, path)
        io.finalize()  # async: the error surfaces here
    _native.clear_faults()
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path), str(info.value)
    assert _digest(path) == digest
    got = io.load_checkpoint(path)
    _equal(got["state_dict"], old["state_dict"])
    assert got["epoch"] == 0
    assert _leftovers(tmp_path) == []


def _accelerator(project_dir: str, auto: bool):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from fastpersist.integrations import accelerate as fpa

    torch.manual_seed(0)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=project_dir, automatic_checkpoint_naming=auto, total_limit=1 if auto else None))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    fpa.enable(acc, config=_cfg())
    return acc, model, opt


def _acc_step(acc, model, opt) -> None:
    acc.backward(model(torch.randn(4, 8)).pow(2).mean())
    opt.step()
    opt.zero_grad()


def _acc_snapshot(acc, model, opt) -> tuple:
    return ({k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()},
            copy.deepcopy(opt.state_dict()))


def _fail_midway_save_state(acc, *args) -> None:
    """save_state whose first file (model.safetensors) is written and whose second
    (optimizer.bin) fails with ENOSPC."""
    seen: list = []
    real = fastpersist.save

    def save(obj, f, **kw):
        seen.append(os.path.basename(os.fspath(f)))
        if len(seen) == 2:
            _native.set_fault("write", 1, "ENOSPC")
        try:
            return real(obj, f, **kw)
        finally:
            _native.clear_faults()

    fastpersist.save = save
    try:
        with pytest.raises(OSError) as info:
            acc.save_state(*args)
    finally:
        fastpersist.save = real
    assert seen == ["model.safetensors", "optimizer.bin"], seen
    assert info.value.errno == errno.ENOSPC and info.value.filename.endswith("optimizer.bin"), str(info.value)


def test_accelerate_failed_save_state_keeps_previous_checkpoint_loadable(tmp_path):
    """Automatic naming with total_limit=1: the new checkpoint fails mid-way; the
    previous directory was not deleted first (stock Accelerate deletes it before
    writing) and load_state restores it exactly."""
    pytest.importorskip("accelerate")
    acc, model, opt = _accelerator(str(tmp_path), auto=True)
    _acc_step(acc, model, opt)
    first = acc.save_state()
    want = _acc_snapshot(acc, model, opt)
    before = {n: _digest(tmp_path / "checkpoints" / "checkpoint_0" / n)
              for n in os.listdir(os.path.join(first))}
    _acc_step(acc, model, opt)
    _fail_midway_save_state(acc)
    prev = tmp_path / "checkpoints" / "checkpoint_0"
    assert {n: _digest(prev / n) for n in os.listdir(prev)} == before
    for sub in (tmp_path / "checkpoints").iterdir():
        assert _leftovers(sub) == [], sub
    # the incomplete checkpoint_1 was removed: a default resume finds checkpoint_0
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_0"]
    _acc_step(acc, model, opt)
    acc.load_state()
    got = _acc_snapshot(acc, model, opt)
    _equal(got[0], want[0])
    _equal({str(k): v["exp_avg"] for k, v in got[1]["state"].items()},
           {str(k): v["exp_avg"] for k, v in want[1]["state"].items()})
    # and the next save writes checkpoint_1 (Accelerate counts successful saves only), then retention
    _acc_step(acc, model, opt)
    second = acc.save_state()
    assert os.path.basename(second) == "checkpoint_1"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_1"]


def test_accelerate_failed_save_state_into_the_same_directory_leaves_it_unchanged(tmp_path):
    """save_state into an existing directory (no automatic naming) that fails mid-way: the
    adapter stages the new checkpoint beside it and swaps it in only once complete, so the
    directory still holds exactly the previous step, file for file, and nothing of the
    failed save is left beside it."""
    pytest.importorskip("accelerate")
    out = str(tmp_path / "ckpt")
    acc, model, opt = _accelerator(str(tmp_path), auto=False)
    _acc_step(acc, model, opt)
    acc.save_state(out)
    old_model, old_opt = _acc_snapshot(acc, model, opt)
    old = {n: _digest(tmp_path / "ckpt" / n) for n in os.listdir(out)}
    before = sorted(os.listdir(tmp_path))
    _acc_step(acc, model, opt)
    _fail_midway_save_state(acc, out)
    now = {n: _digest(tmp_path / "ckpt" / n) for n in os.listdir(out)}
    assert now == old and _leftovers(tmp_path / "ckpt") == []
    assert sorted(os.listdir(tmp_path)) == before  # no staging directory left beside it
    _equal(fastpersist.load(os.path.join(out, "model.safetensors")), old_model)
    got_opt = torch.load(os.path.join(out, "optimizer.bin"), weights_only=True)
    assert torch.equal(got_opt["state"][0]["exp_avg"], old_opt["state"][0]["exp_avg"])


# =========================================================================== 8. every Python-side syscall


OPS = ("fsync", "rename", "open", "write")
MAX_NTH = 40


def _classify(err: Any, path: str, before: str, directory: str) -> str:
    """What one save under an injected EIO did: "raised" (an error carrying the EIO, the
    previous file byte for byte, no temporary left), "dirsync" (DirectorySyncError: the new
    file is in place, as documented), else a description of what went wrong."""
    from fastpersist.errors import DirectorySyncError

    leftovers = sorted(n for n in os.listdir(directory) if TMP_MARKER in n)
    if err is None:
        return "succeeded though the fault was hit"
    text = f"{type(err).__name__}: {err}"
    if errno.errorcode[errno.EIO] not in text and os.strerror(errno.EIO) not in text and \
            getattr(err, "errno", None) != errno.EIO:
        return f"error without the EIO: {text}"
    if leftovers:
        return f"left {leftovers}"
    if isinstance(err, DirectorySyncError) or "DirectorySyncError" in text:
        return "dirsync"
    if _digest_path(path) != before:
        return f"previous file changed ({text})"
    return "raised"


def _digest_path(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _sweep(ops: tuple, call: Callable[[Any], Any], before: Callable[[str, int], Any]) -> Iterator[tuple]:
    """Fail with EIO, one by one, every call of each op in ``ops`` that ``call(ctx)`` makes,
    yielding ``(op, nth, error or None, ctx)`` for each call reached, right after it (check
    the outcome before the next iteration's ``before`` resets the files). ``before(op, nth)``
    runs first, with nothing armed, and returns the ``ctx`` passed to ``call``. An op stops at
    its first call number that ``call`` no longer reaches."""
    for op in ops:
        for nth in range(1, MAX_NTH + 1):
            ctx = before(op, nth)
            _native.set_fault(op, nth, "EIO")
            try:
                call(ctx)
                err = None
            except BaseException as e:  # noqa: BLE001 - checked by the caller (DCP's CheckpointException is one)
                if isinstance(e, KeyboardInterrupt):
                    raise
                err = e
            hits = _native.fault_hits()
            _native.clear_faults()
            if not hits:
                break
            yield op, nth, err, ctx


def _every_fault(save: Callable[[], Any], reset: Callable[[], None], path: str, directory: str) -> dict:
    """Fail, one by one, every call of each op in OPS that ``save`` makes; ``{op: [outcome per call]}``."""

    def before(_op: str, _nth: int) -> str:
        reset()
        return _digest_path(path)

    out: dict = {op: [] for op in OPS}
    for op, _nth, err, digest in _sweep(OPS, lambda _digest: save(), before):
        out[op].append(_classify(err, path, digest, directory))
    return out


def _assert_every_fault_reported(outcomes: dict, what: str) -> None:
    for op in ("fsync", "rename", "open"):
        assert outcomes[op], f"{what}: no {op} call reached by fault injection ({outcomes})"
    bad = {op: [o for o in outs if o not in ("raised", "dirsync")] for op, outs in outcomes.items()}
    assert not any(bad.values()), f"{what}: {bad}"


def _single_state() -> dict:
    return _tensors(3)


@pytest.mark.parametrize("how", ["save.pt", "save.safetensors", "async_snapshot.pt", "async_snapshot.safetensors",
                                 "async_lazy.pt"])
def test_every_syscall_of_single_and_async_saves_is_a_fault_point(tmp_path, how):
    """issue 24 case 9: inject_fault("fsync") never reached the commit fsync of save_async
    (hits=0, the save succeeded). Every fsync, rename, open and write of each save path,
    failed one at a time: the save raises the EIO, the previous file stays byte for byte
    (or, for the directory's fsync after the rename, DirectorySyncError with the new file in
    place), no temporary file is left."""
    kind, suffix = how.split(".")
    path = tmp_path / f"ckpt.{suffix}"
    cfg = _cfg(fsync=True, async_staging_limit=4 << 20)

    def reset() -> None:
        fastpersist.save(_tensors(1), path, config=_cfg(fsync=False))

    state = _single_state()
    if kind == "async_lazy":  # a lazy save streams live tensors: an optimizer's, guarded
        model, opt = _model_opt()
        fastpersist.guard(opt)
        _train_step(model, opt)
        state = {"model": model.state_dict(), "optim": opt.state_dict()}

    def save() -> None:
        if kind == "save":
            fastpersist.save(state, path, config=cfg)
        else:
            mode = kind.split("_")[1]
            fastpersist.save_async(state, path, mode=mode, config=cfg).wait(60)

    outcomes = _every_fault(save, reset, str(path), str(tmp_path))
    _assert_every_fault_reported(outcomes, how)
    with fastpersist.testing.inject_fault("fsync", 1, "EIO") as fault:  # the documented helper, as in the issue
        with pytest.raises(OSError):
            save()
    assert fault.hits == 1


def test_every_syscall_of_a_dcp_save_is_a_fault_point(tmp_path):
    """DCP (FastPersistWriter, no process group): each fsync, rename, open and write failed
    one at a time makes dcp.save raise with the EIO in its message."""
    import torch.distributed.checkpoint as dcp

    from fastpersist.dcp import FastPersistWriter

    def save(d: Any) -> None:
        dcp.save({"w": torch.randn(300, 300), "b": torch.arange(10)}, storage_writer=FastPersistWriter(d),
                 no_dist=True)

    counts = dict.fromkeys(OPS, 0)
    for op, nth, err, _d in _sweep(OPS, save, lambda op, nth: tmp_path / f"{op}-{nth}"):
        counts[op] += 1
        assert err is not None, f"{op} #{nth}: dcp.save succeeded though the fault was hit"
        causes = [err, *(getattr(err, "failures", None) or {}).values()]  # DCP's CheckpointException: per rank
        assert any(getattr(c, "errno", None) == errno.EIO or "Input/output error" in str(c) for c in causes), \
            f"{op} #{nth}: {err!r}"
    assert counts["fsync"] and counts["rename"] and counts["open"], counts


def test_every_syscall_of_a_directory_commit_is_a_fault_point(tmp_path):
    """The adapters' directory commit (dircommit.swap_in over an existing checkpoint
    directory): a failed fsync, rename or open before the new directory is visible leaves the
    previous one in place; one after it (the parents' fsync) raises with the new one in place."""
    import logging
    import shutil

    from fastpersist import dircommit

    target = tmp_path / "ckpt"
    staging = tmp_path / ".fastpersist-staging-ckpt-x"

    def before(_op: str, _nth: int) -> list:
        for p in tmp_path.iterdir():
            shutil.rmtree(p)
        target.mkdir()
        (target / "model.pt").write_bytes(b"old")
        staging.mkdir()
        (staging / "model.pt").write_bytes(b"new")
        return []  # on_visible's record

    def swap(visible: list) -> None:
        dircommit.swap_in(str(staging), str(target), str(tmp_path / ".fastpersist-old-ckpt-x"),
                          lambda name: name == "model.pt", what="a test checkpoint",
                          logger=logging.getLogger("test"), on_visible=lambda: visible.append(1))

    ops = ("fsync", "rename", "open")
    counts = dict.fromkeys(ops, 0)
    for op, nth, err, visible in _sweep(ops, swap, before):
        counts[op] += 1
        assert isinstance(err, OSError) and err.errno == errno.EIO, f"{op} #{nth}: {err!r}"
        want = b"new" if visible else b"old"
        assert (target / "model.pt").read_bytes() == want, (op, nth, visible)
    assert counts["fsync"] and counts["rename"], counts


def test_every_syscall_of_a_collective_save_is_a_fault_point(group2):
    d, results = group2
    got = outcome(results, "commit_faults", 0)
    assert got[0] == "ok", got
    by_op: dict = {}
    for op, _nth, verdict in got[1]:
        by_op.setdefault(op, []).append(verdict)
    for op in ("fsync", "rename", "open"):
        assert by_op.get(op), f"no {op} of the collective save reached by fault injection: {got[1]}"
    bad = [(op, n, o) for op, n, o in got[1] if o not in ("raised", "dirsync")]
    assert not bad, bad
