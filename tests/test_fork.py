"""Fork safety: a child forked after (or while) the parent used fastpersist works.

DataLoader workers and many launchers fork. After ``fork()`` only the forking
thread exists in the child: the native handles' worker threads are gone and a
lock one of them held stays locked. Every child here runs under a timeout, so a
hang fails the test instead of hanging the run; results are compared with
``torch.load`` / ``safetensors``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
import zlib
from typing import Any, Callable

import pytest
import torch

import fastpersist
import fastpersist.io as fio
from fastpersist import _native

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")

TIMEOUT = float(os.environ.get("FASTPERSIST_FORK_TEST_TIMEOUT", "60"))  # seconds before a child counts as hung
FORK = mp.get_context("fork")
# Small chunks: every save and load is many I/Os through the handle's threads.
CONFIG = fastpersist.Config(chunk_size=64 << 10, queue_depth=4, read_queue_depth=4, threads=2, fsync=False)
ENGINES = [e for e in fio.available_engines() if e != "cufile"]


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(256, 1024, generator=g),  # 1 MiB: many chunks
        "b": torch.randn(1000, generator=g).to(torch.float16),
        "i": torch.randint(0, 1 << 30, (4097,), generator=g, dtype=torch.int64),
        "empty": torch.empty(0),
    }


def _reference(path: str) -> Any:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, weights_only=True)


def _assert_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k


def _roundtrip(path: str, seed: int) -> None:
    """save + load + verify through fastpersist, checked against the stock reader."""
    sd = _state(seed)
    fastpersist.save(sd, path, config=CONFIG)
    _assert_equal(_reference(path), sd)
    _assert_equal(fastpersist.load(path, config=CONFIG), sd)
    res = fastpersist.verify(path, config=CONFIG)
    assert res.ok, res


# ---- running a function in a forked child, with a timeout --------------------------


def _child_main(fn: Callable[..., Any], args: tuple) -> None:
    """Body of every child: exit 0 on success, 1 with a traceback otherwise; never return."""
    code = 1
    try:
        # As DataLoader workers do: torch's own OpenMP pool does not survive fork
        # (a parallel torch op in the child, e.g. torch.equal on 1 MiB, can hang
        # in libgomp); this is torch's rule, not fastpersist's.
        torch.set_num_threads(1)
        fn(*args)
        code = 0
    except BaseException:  # noqa: BLE001 - reported through the exit code
        traceback.print_exc()
    finally:
        os._exit(code)


def run_mp_fork(fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` in a multiprocessing child started with the "fork" method."""
    p = FORK.Process(target=_child_main, args=(fn, args))
    p.start()
    p.join(TIMEOUT)
    if p.exitcode is None:
        p.kill()
        p.join()
        pytest.fail(f"forked child running {fn.__name__} hung (> {TIMEOUT} s)")
    assert p.exitcode == 0, f"forked child running {fn.__name__} failed (exit code {p.exitcode})"


def _wait_child(pid: int, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"forked child running {what} hung (> {timeout} s)")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status) == 0, f"forked child running {what} failed ({status:#x})"


def run_os_fork(fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` in a child made by ``os.fork()`` directly."""
    pid = os.fork()
    if pid == 0:
        _child_main(fn, args)
    _wait_child(pid, fn.__name__)


RUNNERS = {"mp": run_mp_fork, "os": run_os_fork}


# ---- save / load / verify ------------------------------------------------------------


@pytest.mark.parametrize("runner", sorted(RUNNERS))
@pytest.mark.parametrize("ext", ["pt", "safetensors"])
def test_child_saves_loads_verifies_after_parent_did(tmp_path, ext, runner):
    parent_file = str(tmp_path / f"parent.{ext}")
    _roundtrip(parent_file, seed=1)  # the parent's cached handles now have threads

    def child() -> None:
        _assert_equal(fastpersist.load(parent_file, config=CONFIG), _state(1))
        assert fastpersist.verify(parent_file, config=CONFIG).ok
        _roundtrip(str(tmp_path / f"child.{ext}"), seed=2)

    RUNNERS[runner](child)
    # The child's file is right, and the parent's own handles still work.
    _assert_equal(_reference(str(tmp_path / f"child.{ext}")), _state(2))
    _roundtrip(str(tmp_path / f"parent2.{ext}"), seed=3)


def test_grandchild(tmp_path):
    """A child of a child (two forks: the fork generation moves twice)."""
    _roundtrip(str(tmp_path / "p.pt"), seed=1)

    def grandchild() -> None:
        _roundtrip(str(tmp_path / "g.safetensors"), seed=5)

    def child() -> None:
        _roundtrip(str(tmp_path / "c.pt"), seed=4)
        run_os_fork(grandchild)
        _roundtrip(str(tmp_path / "c2.pt"), seed=6)

    run_os_fork(child)
    _assert_equal(_reference(str(tmp_path / "g.safetensors")), _state(5))
    _assert_equal(_reference(str(tmp_path / "c2.pt")), _state(6))


def test_child_that_only_drops_inherited_handles_exits(tmp_path):
    """Destroying a handle whose threads belong to the parent must not join them."""
    _roundtrip(str(tmp_path / "p.pt"), seed=1)
    h = _native.Handle(threads=3, max_async=3)
    buf = torch.zeros(10)
    assert h.crc32_ranges([(buf.data_ptr(), 40)]) == [zlib.crc32(bytes(40))]

    def child() -> None:
        import gc

        nonlocal h
        del h
        fastpersist.handles.forget_handles()
        gc.collect()

    run_os_fork(child)
    run_mp_fork(child)
    assert h.pending() == 0  # the parent's handle is untouched


# ---- fastpersist.io IOHandle, sync and async ----------------------------------------


def _io_roundtrip(h: fio.IOHandle, path: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randint(0, 255, (n,), generator=g, dtype=torch.uint8) for n in (3 << 20, 4096, 12345)]
    offsets = [0, 3 << 20, (3 << 20) + 4096]
    for t, off in zip(parts, offsets):
        h.async_pwrite(t, path, off)
    assert h.wait() == 3
    back = [torch.empty_like(t) for t in parts]
    for t, off in zip(back, offsets):
        h.async_pread(t, path, off)
    assert h.wait() == 3
    for t, want in zip(back, parts):
        assert torch.equal(t, want)
    whole = torch.empty(sum(t.numel() for t in parts), dtype=torch.uint8)
    h.pread(whole, path)  # synchronous
    assert torch.equal(whole, torch.cat(parts))
    with open(path, "rb") as f:
        assert f.read() == torch.cat(parts).numpy().tobytes()


@pytest.mark.parametrize("runner", sorted(RUNNERS))
@pytest.mark.parametrize("engine", ENGINES)
def test_iohandle_in_child(tmp_path, engine, runner):
    h = fio.IOHandle(engine=engine, block_size=64 << 10, queue_depth=4, threads=2, max_async=2)
    _io_roundtrip(h, str(tmp_path / "parent.bin"), seed=1)

    def child() -> None:
        _io_roundtrip(h, str(tmp_path / "child.bin"), seed=2)  # the inherited handle
        h2 = fio.IOHandle(engine=engine, block_size=64 << 10)  # and a new one
        _io_roundtrip(h2, str(tmp_path / "child2.bin"), seed=3)

    RUNNERS[runner](child)
    _io_roundtrip(h, str(tmp_path / "parent2.bin"), seed=4)


def test_parent_async_ops_uncollected_at_fork(tmp_path):
    """Ops the parent submitted and had not collected: the child's first wait() says so
    (RuntimeError), then the handle works normally; the parent collects its own."""
    h = fio.IOHandle(block_size=64 << 10, max_async=2)
    data = torch.arange(1 << 20, dtype=torch.int32)  # 4 MiB
    h.async_pwrite(data, str(tmp_path / "a.bin"))
    h.async_pwrite(data, str(tmp_path / "b.bin"))

    def child() -> None:
        assert h.pending() == 2
        with pytest.raises(RuntimeError, match="2 asynchronous operation.*forked"):
            h.wait()
        assert h.pending() == 0
        assert h.wait() == 0
        _io_roundtrip(h, str(tmp_path / "child.bin"), seed=2)

    run_os_fork(child)
    run_mp_fork(child)
    assert h.wait() == 2
    for name in ("a.bin", "b.bin"):
        back = torch.empty_like(data)
        h.pread(back, str(tmp_path / name))
        assert torch.equal(back, data)


def test_fork_while_parent_thread_waits_on_iohandle(tmp_path):
    """A parent thread blocked in IOHandle.wait() holds the handle's lock at the fork;
    the child's copy of the handle must still be usable."""
    h = fio.IOHandle(block_size=64 << 10, queue_depth=2, threads=1, max_async=1)
    data = torch.arange(4 << 20, dtype=torch.int32)  # 16 MiB in 64 KiB I/Os, one op at a time
    for i in range(6):
        h.async_pwrite(data, str(tmp_path / f"w{i}.bin"))
    done = threading.Event()
    t = threading.Thread(target=lambda: (h.wait(), done.set()), daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while not h._lock.locked() and time.monotonic() < deadline:
        time.sleep(0.001)
    locked_at_fork = h._lock.locked() and not done.is_set()

    def child() -> None:
        with pytest.raises(RuntimeError, match="forked"):
            h.wait()
        _io_roundtrip(h, str(tmp_path / "child.bin"), seed=2)

    run_os_fork(child)
    t.join(TIMEOUT)
    assert done.is_set()
    if not locked_at_fork:
        pytest.skip("the parent's wait() finished before the fork (machine too fast)")


def test_native_handle_wait_in_child_without_parent_ops(tmp_path):
    h = _native.Handle(threads=2, max_async=2)
    assert h.wait() == []

    def child() -> None:
        assert h.pending() == 0
        assert h.wait() == []
        assert h.last_engine == "none"

    run_os_fork(child)


# ---- fork while a parent thread is in the middle of I/O ------------------------------


@pytest.mark.parametrize("ext", ["pt", "safetensors"])
def test_fork_while_parent_thread_saves_and_loads(tmp_path, ext):
    """Fork repeatedly while another thread is inside native saves/loads (its locks
    held at random moments). With a never-firing fault armed, every I/O also takes
    the process-wide fault-injection lock."""
    big = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(8)}  # 32 MiB
    stop = threading.Event()
    errors: list[BaseException] = []
    rounds = [0]
    started, one_round = threading.Event(), threading.Event()

    def busy() -> None:
        try:
            while not stop.is_set():
                p = str(tmp_path / f"busy.{ext}")
                started.set()
                fastpersist.save(big, p, config=CONFIG)
                got = fastpersist.load(p, config=CONFIG)
                assert torch.equal(got["t7"], big["t7"])
                assert fastpersist.verify(p, config=CONFIG).ok
                rounds[0] += 1
                one_round.set()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            started.set()
            one_round.set()

    def child(n: int) -> None:
        _roundtrip(str(tmp_path / f"child{n}.{ext}"), seed=n)

    _native.set_fault("any", 1 << 60, "EIO")
    t = threading.Thread(target=busy, daemon=True)
    t.start()
    try:
        assert started.wait(TIMEOUT), "the saving thread did not start"
        forks_during_io = 0
        for n in range(8):
            time.sleep(0.05 * (n % 3))  # forks at varied moments of the thread's saves and loads
            alive = t.is_alive()
            if n % 2:
                run_os_fork(child, n)
            else:
                run_mp_fork(child, n)
            forks_during_io += alive
        assert one_round.wait(TIMEOUT), "the saving thread finished no round"
    finally:
        stop.set()
        t.join(TIMEOUT)
        _native.clear_faults()
    assert not t.is_alive(), "the parent's saving thread hung"
    assert not errors, errors
    assert forks_during_io >= 4 and rounds[0] >= 1
    for n in range(8):
        _assert_equal(_reference(str(tmp_path / f"child{n}.{ext}")), _state(n))


# ---- DataLoader workers (fork) -------------------------------------------------------


class _CheckpointDataset(torch.utils.data.Dataset):
    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        return fastpersist.load(self.paths[i], config=CONFIG)["w"]


def test_dataloader_fork_workers(tmp_path):
    paths = []
    for i in range(8):
        p = str(tmp_path / (f"s{i}.safetensors" if i % 2 else f"s{i}.pt"))
        fastpersist.save({"w": torch.full((300, 1000), float(i))}, p, config=CONFIG)
        _assert_equal(fastpersist.load(p, config=CONFIG), {"w": torch.full((300, 1000), float(i))})
        paths.append(p)
    dl = torch.utils.data.DataLoader(
        _CheckpointDataset(paths),
        batch_size=2,
        num_workers=2,
        multiprocessing_context="fork",
        timeout=TIMEOUT,  # a hung worker raises instead of hanging
    )
    batches = list(dl)
    got = torch.cat(batches)
    want = torch.cat([_reference(p)["w"].unsqueeze(0) for p in paths])
    assert torch.equal(got, want)


# ---- the torch-config lock held by another thread at fork time ---------------------------


def test_fork_while_parent_thread_holds_torch_config_lock(tmp_path):
    from fastpersist import _compat

    held, release = threading.Event(), threading.Event()

    def holder() -> None:  # what a thread planning a torch-format save does
        with _compat.CONFIG_LOCK:
            held.set()
            release.wait()

    t = threading.Thread(target=holder, daemon=True)
    t.start()
    held.wait()
    try:
        pid = os.fork()
        if pid == 0:
            _child_main(_roundtrip, (str(tmp_path / "c.pt"), 1))
    finally:
        release.set()
        t.join()
    _wait_child(pid, "_roundtrip", timeout=5)
