"""Per-operation completion of the native Handle: futures, wait_op/done, and one
long-lived handle shared by several Python threads saving and loading at once."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import zlib

import pytest
import torch

from fastpersist import _native


def _bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.numpy().tobytes())


@pytest.fixture(autouse=True)
def _no_faults():
    _native.clear_faults()
    yield
    _native.clear_faults()


def test_future_write_read_roundtrip(tmp_path):
    h = _native.Handle(threads=2, max_async=2)
    data = _bytes(3 * 4096 + 17, 1)
    path = str(tmp_path / "f")
    fut = h.write_async(path, [(0, data.data_ptr(), data.numel(), 0)], nslots=1)
    assert fut.wait() is True and fut.done()
    assert fut.result() == [_crc(data)]
    assert h.pending() == 0  # futures are not the handle's to collect
    out = torch.empty_like(data)
    rf = h.read_async(path, [(0, out.data_ptr(), out.numel(), 0)], nslots=1)
    assert rf.result(timeout=30) == [_crc(data)]
    assert torch.equal(out, data)
    assert h.wait() == []  # wait() does not see future ops


def test_future_error_is_its_own(tmp_path):
    h = _native.Handle(engine="psync", threads=1, max_async=1)
    data = _bytes(1 << 16, 2)
    bad = h.write_async(str(tmp_path / "missing-dir" / "x"), [(0, data.data_ptr(), data.numel(), -1)])
    good = h.write_async(str(tmp_path / "ok"), [(0, data.data_ptr(), data.numel(), 0)], nslots=1)
    assert good.result() == [_crc(data)]
    assert bad.wait() is True  # wait never raises the op's error
    for _ in range(2):  # every result() raises it again
        with pytest.raises(FileNotFoundError):
            bad.result()


def test_injected_fault_reaches_only_its_op(tmp_path):
    h = _native.Handle(engine="psync", threads=1, max_async=1, direct=False)
    data = _bytes(1 << 16, 3)
    _native.set_fault("write", 1, "EIO")
    first = h.write_async(str(tmp_path / "a"), [(0, data.data_ptr(), data.numel(), -1)])
    first.wait()
    _native.clear_faults()
    second = h.write_async(str(tmp_path / "b"), [(0, data.data_ptr(), data.numel(), 0)], nslots=1)
    with pytest.raises(OSError) as ei:
        first.result()
    assert ei.value.errno == 5
    assert second.result() == [_crc(data)]


def test_wait_op_and_done(tmp_path):
    h = _native.Handle(max_async=2)
    a, b = _bytes(1 << 20, 4), _bytes(5000, 5)
    ia = h.submit_write(str(tmp_path / "a"), [(0, a.data_ptr(), a.numel(), 0)], nslots=1)
    ib = h.submit_write(str(tmp_path / "b"), [(0, b.data_ptr(), b.numel(), 0)], nslots=1)
    assert h.wait_op(ib, timeout=30) == [_crc(b)]
    assert h.pending() == 1
    assert isinstance(h.done(ia), bool)
    assert h.wait() == [(ia, [_crc(a)])]  # wait() still collects the rest
    with pytest.raises(ValueError, match="not pending"):
        h.wait_op(ia)
    with pytest.raises(ValueError, match="not pending"):
        h.done(12345678)


def test_wait_op_raises_its_error_and_keeps_others(tmp_path):
    h = _native.Handle(max_async=1)
    d = _bytes(4096, 6)
    bad = h.submit_write(str(tmp_path / "nodir" / "x"), [(0, d.data_ptr(), d.numel(), -1)])
    good = h.submit_write(str(tmp_path / "y"), [(0, d.data_ptr(), d.numel(), -1)])
    with pytest.raises(FileNotFoundError):
        h.wait_op(bad)
    assert h.pending() == 1
    assert h.wait_op(good) == []
    assert h.pending() == 0


def test_timeouts(tmp_path):
    h = _native.Handle(engine="psync", threads=1, max_async=1, direct=False)
    d = _bytes(1 << 16, 7)
    # A read of a fifo blocks until something writes to it: a deterministic slow op.
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    out = torch.empty(16, dtype=torch.uint8)
    slow = h.read_async(fifo, [(0, out.data_ptr(), out.numel(), -1)])
    assert slow.wait(timeout=0.05) is False
    with pytest.raises(TimeoutError):
        slow.result(timeout=0.01)
    op = h.submit_write(str(tmp_path / "queued"), [(0, d.data_ptr(), d.numel(), -1)])  # queued behind
    with pytest.raises(TimeoutError):
        h.wait_op(op, timeout=0.01)
    assert h.pending() == 1  # still pending after the timeout
    # Unblock the reader: opening the write end lets its open() return. Its pread then
    # fails at once (ESPIPE: a fifo has no offsets) and it closes the fifo, so our
    # write may meet a closed read end (EPIPE): a race the test does not care about.
    with contextlib.suppress(BrokenPipeError), open(fifo, "wb") as w:
        w.write(bytes(16))
    slow.wait(timeout=30)
    assert slow.done()
    assert h.wait_op(op, timeout=30) == []
    with pytest.raises(ValueError):
        slow.wait(timeout=-1)


def test_future_outlives_handle(tmp_path):
    h = _native.Handle(max_async=1)
    d = _bytes(1 << 20, 8)
    futs = [h.write_async(str(tmp_path / f"f{i}"), [(0, d.data_ptr(), d.numel(), 0)], nslots=1) for i in range(4)]
    del h  # queued ops are finished before the handle goes
    assert [f.result() for f in futs] == [[_crc(d)]] * 4


def test_many_threads_share_one_handle(tmp_path):
    """Writers and readers in 6 threads on one long-lived handle: each gets its own results."""
    h = _native.Handle(threads=2, max_async=2)
    errors: list[BaseException] = []
    seed_files = []
    for i in range(3):
        d = _bytes(200_000 + i, 100 + i)
        p = str(tmp_path / f"seed{i}")
        h.write(p, [(0, d.data_ptr(), d.numel(), -1)])
        seed_files.append((p, d))

    def writer(k: int) -> None:
        try:
            for r in range(6):
                d = _bytes(50_000 + 4096 * r + k, 1000 * k + r)
                p = str(tmp_path / f"w{k}-{r}")
                fut = h.write_async(p, [(0, d.data_ptr(), d.numel(), 0)], nslots=1)
                if r % 2:
                    op = h.submit_write(p + ".b", [(0, d.data_ptr(), d.numel(), 0)], nslots=1)
                    assert h.wait_op(op) == [_crc(d)]
                assert fut.result() == [_crc(d)]
                with open(p, "rb") as f:
                    assert f.read() == d.numpy().tobytes()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def reader(k: int) -> None:
        try:
            for r in range(6):
                p, d = seed_files[(k + r) % len(seed_files)]
                out = torch.empty_like(d)
                fut = h.read_async(p, [(0, out.data_ptr(), out.numel(), 0)], nslots=1)
                assert fut.result() == [_crc(d)]
                assert torch.equal(out, d)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(3)]
    threads += [threading.Thread(target=reader, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert h.pending() == 0


def test_waiting_releases_the_gil(tmp_path):
    h = _native.Handle(engine="psync", threads=1, max_async=1, direct=False)
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    out = torch.empty(8, dtype=torch.uint8)
    fut = h.read_async(fifo, [(0, out.data_ptr(), out.numel(), -1)])
    ticks = []

    def spin() -> None:  # the read can complete only after this thread ran 50 times
        while len(ticks) < 50:
            ticks.append(1)
            time.sleep(0.001)
        with open(fifo, "wb") as w:
            w.write(bytes(8))

    t = threading.Thread(target=spin)
    t.start()
    assert fut.wait(timeout=30)  # blocked in native code; spin() must still run
    t.join()
    assert len(ticks) > 20


def test_copy_ranges():
    h = _native.Handle(threads=2)
    src = [_bytes(n, n) for n in (0, 1, 4097, (9 << 20) + 3)]
    dst = [torch.empty_like(s) for s in src]
    crcs = h.copy_ranges([(d.data_ptr(), s.data_ptr(), s.numel()) for d, s in zip(dst, src)], crc=True)
    assert crcs == [_crc(s) for s in src]
    assert all(torch.equal(d, s) for d, s in zip(dst, src))
    assert h.copy_ranges([(dst[1].data_ptr(), src[1].data_ptr(), 1)]) == [0]
