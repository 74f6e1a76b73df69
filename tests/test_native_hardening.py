"""Hardening of the native core: EAGAIN is retried with a bounded backoff (a
persistent EAGAIN becomes a clear OSError within seconds instead of a thread
spinning forever; a transient one is invisible), and ENOSPC messages say what
to do. Faults come from the native syscall layer (fastpersist.testing)."""

from __future__ import annotations

import errno

import pytest
import torch

import fastpersist.io as fio
from fastpersist.testing import inject_fault

# the same file size, block size, data and handles as the fault tests of the I/O handle
from test_io_faults import BLOCK, CPU_ENGINES, MiB, SIZE, _bytes, _data, _handle, _tensor  # noqa: E402

FOREVER = 10**9  # fault count: every matching call for the rest of the block


# ---- EAGAIN ------------------------------------------------------------------------


@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_persistent_eagain_fails_clearly_and_quickly(tmp_path, engine, direct, op) -> None:
    """Every call fails with EAGAIN: the op gives up after its backoff budget with an
    OSError(EAGAIN) naming file, op and offset, after a bounded number of retries
    (a backoff that sleeps: a spinning loop retries millions of times). How long the
    budget lasts is not asserted here (speed belongs to the benchmarks); a retry loop
    that never gives up fails by the suite's timeout."""
    path = tmp_path / "eagain.bin"
    offset = 4096 + 17
    path.write_bytes(_data(offset + SIZE, 1))
    h = _handle(engine, direct)
    dst = torch.empty(SIZE, dtype=torch.uint8)
    with inject_fault(op, 1, "EAGAIN", FOREVER) as fault:
        with pytest.raises(OSError) as ei:
            if op == "write":
                h.pwrite(_tensor(_data(SIZE)), path, offset)
            else:
                h.pread(dst, path, offset)
    e = ei.value
    assert e.errno == errno.EAGAIN
    assert e.filename == str(path)
    assert e.operation == ("pwrite" if op == "write" else "pread")
    assert offset // 4096 * 4096 <= e.offset < offset + SIZE
    assert f"at offset {e.offset}" in str(e) and "retrying with backoff" in str(e), str(e)
    # Retried, but with sleeps between the tries: a few dozen calls per request, not
    # the millions of a loop that spins through its budget.
    assert 2 <= fault.hits < 1000, fault.hits
    # The handle is fine afterwards.
    data = _data(SIZE, 2)
    h.pwrite(_tensor(data), path, offset)
    h.pread(dst, path, offset)
    assert _bytes(dst) == data


@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("nth,count", [(1, 1), (3, 4), (1, 12)])
def test_transient_eagain_recovers_exactly(tmp_path, engine, direct, op, nth, count) -> None:
    """A few EAGAINs (up to 12 in a row on one request, ~0.2 s of backoff) are
    retried: the op succeeds with exact bytes, and every hit was retried."""
    offset = 4096 + 17
    data = _data(SIZE, 3)
    path = tmp_path / "eagain.bin"
    if op == "read":
        path.write_bytes(bytes(offset) + data)
    h = _handle(engine, direct)
    dst = torch.empty(SIZE, dtype=torch.uint8)
    with inject_fault(op, nth, "EAGAIN", count) as fault:
        if op == "write":
            h.pwrite(_tensor(data), path, offset)
        else:
            h.pread(dst, path, offset)
    assert fault.hits == count
    if op == "write":
        assert path.read_bytes() == bytes(offset) + data
    else:
        assert _bytes(dst) == data


@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_transient_eagain_in_async_ops(tmp_path, engine) -> None:
    pieces = [_data(5000, i) for i in range(20)]
    path = tmp_path / "async.bin"
    path.write_bytes(b"")
    h = _handle(engine, max_async=4)
    with inject_fault("write", 2, "EAGAIN", 6) as fault:
        for i, p in enumerate(pieces):
            h.pwrite(_tensor(p), path, i * 5000, async_=True, truncate=False)
        assert h.wait() == len(pieces)
    assert fault.hits == 6
    assert path.read_bytes() == b"".join(pieces)


# ---- ENOSPC message ----------------------------------------------------------------


@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("nth", [1, 5])
def test_enospc_write_message_says_what_to_do(tmp_path, engine, direct, nth) -> None:
    path = tmp_path / "full.bin"
    h = _handle(engine, direct)
    with inject_fault("write", nth, "ENOSPC"):
        with pytest.raises(OSError) as ei:
            h.pwrite(_tensor(_data(SIZE)), path, 4096 + 17)
    e = ei.value
    assert e.errno == errno.ENOSPC and e.filename == str(path)
    msg = str(e)
    assert f"free space on the filesystem holding '{path}'" in msg, msg
    # What the native layer knows: the failed request's remaining bytes and offset.
    assert f"this write needed {e.length} more bytes at offset {e.offset}" in msg, msg
    assert 0 < e.length <= SIZE


def test_enospc_fsync_message_claims_no_sizes(tmp_path) -> None:
    path = tmp_path / "full.bin"
    with inject_fault("fsync", 1, "ENOSPC"):
        with pytest.raises(OSError) as ei:
            _handle("psync").pwrite(_tensor(_data(5000)), path, fsync=True)
    msg = str(ei.value)
    assert ei.value.errno == errno.ENOSPC
    assert f"free space on the filesystem holding '{path}'" in msg, msg
    assert "needed" not in msg, msg  # fsync does not know how many bytes it lacked


def test_other_errors_have_no_hint(tmp_path) -> None:
    path = tmp_path / "eio.bin"
    with inject_fault("write", 1, "EIO"):
        with pytest.raises(OSError) as ei:
            _handle("psync").pwrite(_tensor(_data(SIZE)), path)
    assert "free space" not in str(ei.value) and "retrying" not in str(ei.value)


# ---- errors racing with the fill tasks ---------------------------------------------


@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_write_error_while_fills_run(tmp_path, engine) -> None:
    """A write fails while the pool is still filling (copy + CRC) later chunks: the
    error the main thread records and the fills' shared state are kept under one
    lock (checked for data races by the native driver under ThreadSanitizer,
    .ci/sanitize thread); here: the error surfaces every time, the handle lives on."""
    path = tmp_path / "race.bin"
    h = fio.IOHandle(engine=engine, block_size=BLOCK, queue_depth=8, threads=4)
    data = _data(4 * MiB + 7, 8)
    for nth in (1, 2, 3, 7, 20):
        with inject_fault("write", nth, "EIO"):
            with pytest.raises(OSError) as ei:
                h.pwrite(_tensor(data), path)
        assert ei.value.errno == errno.EIO
    h.pwrite(_tensor(data), path)
    assert path.read_bytes() == data
