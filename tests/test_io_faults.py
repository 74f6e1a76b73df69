"""Faults injected in the native syscall layer: errors raise the right OSError
naming path and offset; short transfers and EINTR are retried and the data stays
byte-exact; nothing crashes and the handle stays usable."""

from __future__ import annotations

import errno
import os
import random
import re
import subprocess
import sys

import pytest
import torch

import fastpersist.io as fio
from fastpersist import _native
from fastpersist.testing import inject_fault

KiB = 1024
MiB = 1024 * 1024
BLOCK = 64 * KiB
SIZE = MiB + 3  # 17 blocks of 64 KiB: many syscalls per op, an unaligned tail
CPU_ENGINES = [e for e in fio.available_engines() if e != "cufile"]


def _data(n: int, seed: int = 0) -> bytes:
    return random.Random(seed * 7919 + n).randbytes(n)


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _bytes(t: torch.Tensor) -> bytes:
    return fio.as_bytes(t).numpy().tobytes()


def _handle(engine: str, direct: bool = True, **kw) -> fio.IOHandle:
    return fio.IOHandle(engine=engine, block_size=BLOCK, direct=direct, **kw)


def _assert_offset_in_message(e: BaseException, offset: int, length: int) -> None:
    """The message names a file offset inside the op's range, widened to whole
    4096-byte blocks (direct I/O may start at the block holding ``offset``)."""
    m = re.search(r"offset (\d+)", str(e))
    assert m, f"no offset in the message: {e}"
    assert offset // 4096 * 4096 <= int(m.group(1)) < offset + length, str(e)


def _assert_usable(h: fio.IOHandle, path, offset: int = 0) -> None:
    """After an error the same handle writes and reads correctly."""
    data = _data(SIZE, 99)
    h.pwrite(_tensor(data), path, offset)
    assert path.read_bytes()[offset:] == data
    dst = torch.empty(SIZE, dtype=torch.uint8)
    h.pread(dst, path, offset)
    assert _bytes(dst) == data


# ---- errno faults ---------------------------------------------------------------


ERRNOS = [("EIO", errno.EIO, OSError), ("ENOSPC", errno.ENOSPC, OSError)]


@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("name,code,exc_type", ERRNOS, ids=[e[0] for e in ERRNOS])
@pytest.mark.parametrize("nth", [1, 3, 17])
@pytest.mark.parametrize("offset", [0, 4096 + 17])
def test_write_errno(tmp_path, engine, direct, name, code, exc_type, nth, offset) -> None:
    path = tmp_path / "w.bin"
    h = _handle(engine, direct)
    with inject_fault("write", nth, name) as fault:
        with pytest.raises(exc_type) as ei:
            h.pwrite(_tensor(_data(SIZE)), path, offset)
    assert fault.hits == 1
    e = ei.value
    assert e.errno == code
    assert e.filename == str(path)
    _assert_offset_in_message(e, offset, SIZE)
    _assert_usable(h, path, offset)


@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("name,code,exc_type", ERRNOS, ids=[e[0] for e in ERRNOS])
@pytest.mark.parametrize("nth", [1, 3, 17])
@pytest.mark.parametrize("offset", [0, 4096 + 17])
def test_read_errno(tmp_path, engine, direct, name, code, exc_type, nth, offset) -> None:
    path = tmp_path / "r.bin"
    path.write_bytes(_data(offset + SIZE, 1))
    h = _handle(engine, direct)
    dst = torch.empty(SIZE, dtype=torch.uint8)
    with inject_fault("read", nth, name) as fault:
        with pytest.raises(exc_type) as ei:
            h.pread(dst, path, offset)
    assert fault.hits == 1
    e = ei.value
    assert e.errno == code
    assert e.filename == str(path)
    _assert_offset_in_message(e, offset, SIZE)
    _assert_usable(h, path, offset)


@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("op", ["write", "read"])
def test_errno_in_async_op_surfaces_at_wait(tmp_path, engine, op) -> None:
    path = tmp_path / "a.bin"
    path.write_bytes(_data(SIZE, 2))
    h = _handle(engine, max_async=1)
    with inject_fault(op, 5, "EIO") as fault:
        if op == "write":
            h.pwrite(_tensor(_data(SIZE)), path, async_=True)
        else:
            h.pread(torch.empty(SIZE, dtype=torch.uint8), path, async_=True)
        with pytest.raises(OSError) as ei:
            h.wait()
    assert fault.hits == 1
    assert ei.value.errno == errno.EIO and ei.value.filename == str(path)
    assert h.pending() == 0
    _assert_usable(h, path)


@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_every_failure_point_is_clean(tmp_path, engine) -> None:
    """Fail each write and each read call in turn: an OSError(EIO) every time, or
    success with exact bytes once nth is past the op's last call; never a crash."""
    data = _data(256 * KiB + 5, 3)  # 5 blocks of 64 KiB
    h = _handle(engine)
    path = tmp_path / "each.bin"
    for op in ("write", "read"):
        outcomes = []
        for nth in range(1, 12):
            if op == "read":
                path.write_bytes(data)
            with inject_fault(op, nth, "EIO") as fault:
                try:
                    if op == "write":
                        h.pwrite(_tensor(data), path)
                    else:
                        dst = torch.empty(len(data), dtype=torch.uint8)
                        h.pread(dst, path)
                except OSError as e:
                    assert e.errno == errno.EIO and e.filename == str(path)
                    outcomes.append("error")
                    continue
            assert fault.hits == 0
            assert (path.read_bytes() if op == "write" else _bytes(dst)) == data
            outcomes.append("ok")
        # the early calls all fail; once past the last call everything succeeds
        assert outcomes[0] == "error" and outcomes[-1] == "ok"
        assert outcomes == sorted(outcomes)  # "error"... then "ok"...


# ---- faults that must be retried transparently -------------------------------------


@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("action", ["short", "eintr"])
@pytest.mark.parametrize("nth,count", [(1, 1), (4, 1), (2, 5), (1, 40)])
@pytest.mark.parametrize("offset", [0, 4096 + 17])
def test_retried_faults_keep_data_exact(
    tmp_path, engine, direct, op, action, nth, count, offset
) -> None:
    data = _data(SIZE, 4)
    path = tmp_path / "retry.bin"
    h = _handle(engine, direct)
    if op == "read":
        path.write_bytes(bytes(offset) + data)
    dst = torch.empty(SIZE, dtype=torch.uint8)
    with inject_fault(op, nth, action, count) as fault:
        if op == "write":
            h.pwrite(_tensor(data), path, offset)
        else:
            h.pread(dst, path, offset)
    assert fault.hits == count  # the retries themselves were hit: every hit was retried
    if op == "write":
        assert path.read_bytes() == bytes(offset) + data
    else:
        assert _bytes(dst) == data


@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("action", ["short", "eintr"])
def test_retried_faults_in_async_ops(tmp_path, engine, action) -> None:
    pieces = [_data(5000, i) for i in range(20)]
    path = tmp_path / "async.bin"
    path.write_bytes(b"")
    h = _handle(engine, max_async=4)
    with inject_fault("write", 2, action, 10) as fault:
        for i, p in enumerate(pieces):
            h.pwrite(_tensor(p), path, i * 5000, async_=True, truncate=False)
        assert h.wait() == len(pieces)
    assert fault.hits == 10
    assert path.read_bytes() == b"".join(pieces)


# ---- fsync and open -----------------------------------------------------------------


@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("name,code", [("EIO", errno.EIO), ("ENOSPC", errno.ENOSPC)])
def test_fsync_errno(tmp_path, engine, name, code) -> None:
    path = tmp_path / "s.bin"
    h = _handle(engine)
    with inject_fault("fsync", 1, name) as fault:
        with pytest.raises(OSError) as ei:
            h.pwrite(_tensor(_data(SIZE)), path, fsync=True)
    assert fault.hits == 1
    assert ei.value.errno == code and ei.value.filename == str(path)
    assert "fsync" in str(ei.value)
    # without fsync=True no fsync is made, so the fault is not reached
    with inject_fault("fsync", 1, name) as fault:
        h.pwrite(_tensor(_data(SIZE)), path)
    assert fault.hits == 0
    _assert_usable(h, path)


@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_fsync_eintr_is_retried(tmp_path, engine) -> None:
    path = tmp_path / "s.bin"
    data = _data(SIZE, 5)
    with inject_fault("fsync", 1, "eintr") as fault:
        _handle(engine).pwrite(_tensor(data), path, fsync=True)
    assert fault.hits == 1
    assert path.read_bytes() == data


OPEN_FAULTS = [
    ("EACCES", errno.EACCES, PermissionError),
    ("ENOENT", errno.ENOENT, FileNotFoundError),
    ("EMFILE", errno.EMFILE, OSError),
    ("EROFS", errno.EROFS, OSError),
]


@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("name,code,exc_type", OPEN_FAULTS, ids=[f[0] for f in OPEN_FAULTS])
def test_open_errno(tmp_path, engine, op, name, code, exc_type) -> None:
    path = tmp_path / "o.bin"
    path.write_bytes(_data(SIZE, 6))
    h = _handle(engine)
    with inject_fault("open", 1, name) as fault:
        with pytest.raises(exc_type) as ei:
            if op == "write":
                h.pwrite(_tensor(_data(SIZE)), path)
            else:
                h.pread(torch.empty(SIZE, dtype=torch.uint8), path)
    assert fault.hits == 1
    assert ei.value.errno == code and ei.value.filename == str(path)
    assert path.read_bytes() == _data(SIZE, 6)  # a failed open changes nothing
    _assert_usable(h, path)


@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_any_op_fault(tmp_path, engine) -> None:
    """op "any" counts opens, writes, reads and fsyncs together: the 1st is the open."""
    path = tmp_path / "any.bin"
    h = _handle(engine)
    with inject_fault("any", 1, "EACCES") as fault:
        with pytest.raises(PermissionError):
            h.pwrite(_tensor(_data(SIZE)), path)
    assert fault.hits == 1
    with inject_fault("any", 2, "EIO") as fault:  # the first write after the open
        with pytest.raises(OSError) as ei:
            h.pwrite(_tensor(_data(SIZE)), path)
    assert fault.hits == 1 and ei.value.errno == errno.EIO


# ---- the fault API itself ------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [("bogus", 1, "EIO"), ("write", 1, "EWHAT"), ("write", 0, "EIO"), ("write", 1, "EIO", 0)],
)
def test_bad_fault_spec_is_value_error(args) -> None:
    with pytest.raises(ValueError):
        with inject_fault(*args):
            pass


def test_fault_hits_frozen_after_block(tmp_path) -> None:
    with inject_fault("write", 1, "eintr", 3) as fault:
        fio.IOHandle().pwrite(_tensor(_data(5000)), tmp_path / "h.bin")
        assert fault.hits == 3
    fio.IOHandle().pwrite(_tensor(_data(5000)), tmp_path / "h.bin")  # no fault active now
    assert fault.hits == 3
    assert _native.fault_hits() == 0


def _run_child(code: str, spec: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, FASTPERSIST_FAULT=spec)
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


CHILD = """
import errno, sys, torch
import fastpersist.io as fio
path = sys.argv[1] if len(sys.argv) > 1 else {path!r}
try:
    fio.IOHandle(engine={engine!r}).pwrite(torch.ones(100_000), path)
except OSError as e:
    print("ERRNO", errno.errorcode[e.errno], e.filename == path)
else:
    print("OK")
"""


@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_env_var_fault(tmp_path, engine) -> None:
    path = str(tmp_path / "env.bin")
    r = _run_child(CHILD.format(path=path, engine=engine), "write:1:EIO")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ERRNO", "EIO", "True"]
    r = _run_child(CHILD.format(path=path, engine=engine), "write:1:eintr:3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["OK"]
    assert os.path.getsize(path) == 400_000


@pytest.mark.parametrize("spec", ["write:1", "write:one:EIO", "scribble:1:EIO", "write:1:EWHAT"])
def test_env_var_bad_spec_is_reported(spec) -> None:
    """A bad FASTPERSIST_FAULT fails the import, naming the variable, not ignored."""
    r = _run_child("import fastpersist.io", spec)
    assert r.returncode != 0
    assert "FASTPERSIST_FAULT" in r.stderr, r.stderr
