"""fastpersist.save_async: bit-exact snapshot and lazy saves while training mutates
the state, guard, refusals, queueing and the staging limit, error propagation,
exit handling, threads."""

from __future__ import annotations

import copy
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import fastpersist
from fastpersist import _native, asyncsave, asyncstage, handles
from fastpersist.asyncsave import LazySaveError


@pytest.fixture(autouse=True)
def _clean():
    _native.clear_faults()
    yield
    _native.clear_faults()
    try:
        fastpersist.wait_all()
    except Exception:  # noqa: BLE001 - a test's own injected failure
        pass
    for opt in list(asyncsave._guards.keys()):
        asyncsave._guards[opt].remove()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.BatchNorm1d(512), torch.nn.ReLU(), torch.nn.Linear(512, 256)
    )


def _train_step(model, opt) -> None:
    x = torch.randn(32, 256)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def _state(model, opt) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3, "note": "x" * 10}


def _reference_bytes(state, tmp_path, name: str) -> bytes:
    """What fastpersist.save writes for a deep copy of ``state`` taken now."""
    ref = copy.deepcopy(state)
    p = tmp_path / f"ref-{name}"
    fastpersist.save(ref, p)
    return p.read_bytes()


def _mutate_all(state) -> None:
    with torch.no_grad():
        for t in _tensors(state):
            t.add_(1) if t.is_floating_point() else t.add_(1)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


@pytest.mark.parametrize("limit", [64 << 10, 1 << 30], ids=["tiny-pool", "big-pool"])
def test_snapshot_bit_exact_while_everything_changes(tmp_path, limit):
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    _train_step(model, opt)
    state = _state(model, opt)
    want = _reference_bytes(state, tmp_path, "s")
    cfg = fastpersist.Config(async_staging_limit=limit)
    fut = fastpersist.save_async(state, tmp_path / "a.pt", config=cfg)
    assert gc.isenabled()  # the GC pause of planning did not outlive the call
    _mutate_all(state)
    _train_step(model, opt)
    assert fut.wait(timeout=60) is True and fut.done() and fut.exception() is None
    assert (tmp_path / "a.pt").read_bytes() == want
    assert fastpersist.verify(tmp_path / "a.pt").ok
    assert asyncstage.current_pool().allocated <= max(limit, 2 * asyncstage.current_pool().window)


def test_snapshot_safetensors_bit_exact(tmp_path):
    tensors = {f"t{i}": torch.randn(1000 * (i + 1)) for i in range(5)}
    ref = {k: v.clone() for k, v in tensors.items()}
    fastpersist.save(ref, tmp_path / "ref.safetensors")
    fut = fastpersist.save_async(tensors, tmp_path / "a.safetensors", config=fastpersist.Config(async_staging_limit=16 << 10))
    for v in tensors.values():
        v.mul_(-1)
    fut.wait()
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert fastpersist.verify(tmp_path / "a.safetensors").ok


class _RecordingHandle:
    """A native handle whose copy_ranges calls are recorded (ranges count, crc flag)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.copies: list[tuple[int, bool]] = []

    def copy_ranges(self, ranges, crc=False):
        self.copies.append((len(ranges), bool(crc)))
        return self.inner.copy_ranges(ranges, crc)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_snapshot_call_copies_without_crc_and_crcs_come_later(tmp_path, monkeypatch, suffix):
    """The call makes plain copies only; the CRC fields are still right (computed from
    the staged windows in the background, written before the commit)."""
    real = handles.handle_for
    rec: list[_RecordingHandle] = []

    def handle(cfg, **kw):
        rec.append(_RecordingHandle(real(cfg, **kw)))
        return rec[-1]

    monkeypatch.setattr(handles, "handle_for", handle)
    if suffix == ".pt":
        model = _model()
        opt = torch.optim.Adam(model.parameters())
        _train_step(model, opt)
        state = _state(model, opt)
        want = _reference_bytes(state, tmp_path, "c")
    else:
        state = {f"t{i}": torch.randn(5000 * (i + 1)) for i in range(4)}
        fastpersist.save({k: v.clone() for k, v in state.items()}, tmp_path / "ref.safetensors")
        want = (tmp_path / "ref.safetensors").read_bytes()
    fut = fastpersist.save_async(state, tmp_path / f"a{suffix}", config=fastpersist.Config(async_staging_limit=64 << 10))
    _mutate_all(state)
    assert fut.wait(timeout=60) is True
    copies = [c for h in rec for c in h.copies]
    assert copies and not any(crc for _n, crc in copies)
    monkeypatch.undo()
    assert (tmp_path / f"a{suffix}").read_bytes() == want
    assert fastpersist.verify(tmp_path / f"a{suffix}").ok


def test_snapshot_slow_background_crc_holds_windows_without_deadlock(tmp_path, monkeypatch):
    """A pool of two windows and a slow background CRC: a window is reused only once its
    CRC was read (else the CRC would cover the next window's bytes), and a call that
    must wait for a window starts the CRC thread first (else it would wait forever)."""
    real = _native.crc32_many

    class SlowNative:
        def __getattr__(self, name):
            return getattr(_native, name)

        @staticmethod
        def crc32_many(ranges):
            time.sleep(0.01)
            return real(ranges)

    monkeypatch.setattr(asyncstage, "_native", SlowNative())
    state = {f"t{i}": torch.randn(6000 + 777 * i) for i in range(8)}
    want = _reference_bytes(state, tmp_path, "w")
    cfg = fastpersist.Config(async_staging_limit=16 << 10)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("f", fastpersist.save_async(state, tmp_path / "w.pt", config=cfg)))
    t.start()
    t.join(60)
    assert not t.is_alive(), "save_async deadlocked waiting for a window"
    _mutate_all(state)
    assert box["f"].wait(timeout=60) is True
    assert (tmp_path / "w.pt").read_bytes() == want


def test_snapshot_background_crc_error_reported_previous_kept(tmp_path, monkeypatch):
    target = tmp_path / "k.pt"
    fastpersist.save({"w": torch.ones(10)}, target)
    before = target.read_bytes()

    class BadNative:
        def __getattr__(self, name):
            return getattr(_native, name)

        @staticmethod
        def crc32_many(ranges):
            raise RuntimeError("injected crc failure")

    monkeypatch.setattr(asyncstage, "_native", BadNative())
    fut = fastpersist.save_async({"w": torch.zeros(100_000)}, target)
    with pytest.raises(RuntimeError, match="injected crc failure"):
        fut.wait(timeout=60)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["k.pt"]  # temp file removed


def test_lazy_bit_exact_under_guard(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fastpersist.guard(opt)
    _train_step(model, opt)
    state = _state(model, opt)
    want = _reference_bytes(state, tmp_path, "l")
    fut = fastpersist.save_async(state, tmp_path / "l.pt", mode="lazy")
    assert gc.isenabled()
    # forward mutates the BatchNorm running stats right away; step waits in the guard
    for _ in range(3):
        _train_step(model, opt)
    fut.wait(timeout=60)
    assert (tmp_path / "l.pt").read_bytes() == want
    loaded = torch.load(tmp_path / "l.pt")
    assert not torch.equal(loaded["model"]["0.weight"], model.state_dict()["0.weight"])


class _Gated:
    """A native write future that reports completion only once ``gate`` is set (the write
    itself runs at once): lets a test see what waits for the disk and what does not."""

    def __init__(self, fut, gate):
        self._f, self._gate = fut, gate

    def done(self):
        return self._gate.is_set() and self._f.done()

    def wait(self, timeout=None):
        self._gate.wait()
        return self._f.wait() if timeout is None else self._f.wait(timeout)

    def result(self):
        self._gate.wait()
        return self._f.result()


class _GatedHandle:
    def __init__(self, real, gate):
        self._real, self._gate = real, gate

    def write_async(self, *a, **k):
        return _Gated(self._real.write_async(*a, **k), self._gate)

    def __getattr__(self, name):
        return getattr(self._real, name)


def test_lazy_guard_waits_for_the_copy_not_the_disk(tmp_path, monkeypatch):
    """The guard returns once every live byte has been copied into the staging pool, while
    no write has (as far as anyone can tell) reached the disk; the file is still exact."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = fastpersist.guard(opt)
    assert fastpersist.guard(opt) is g
    state = _state(model, opt)
    gate = threading.Event()
    real_io = asyncsave._io_handle
    monkeypatch.setattr(asyncsave, "_io_handle", lambda cfg: _GatedHandle(real_io(cfg), gate))
    released = []
    real_release = asyncstage.LazyFeed.release

    def spy(self):
        real_release(self)
        released.append((self.done.is_set(), self.exc, any(f.done() for f in self.futures)))

    monkeypatch.setattr(asyncstage.LazyFeed, "release", spy)
    want = _reference_bytes(state, tmp_path, "g")
    fut = fastpersist.save_async(state, tmp_path / "g.pt", mode="lazy")
    _train_step(model, opt)  # the pre-hook ran: the rest of the state was copied, no write reported done
    assert released == [(True, None, False)]
    assert not fut.done()
    gate.set()
    assert fut.wait(60) is True
    assert (tmp_path / "g.pt").read_bytes() == want


def test_lazy_bit_exact_with_a_pool_smaller_than_the_state(tmp_path):
    """The feed streams through a tiny pool: the guard then waits for windows to drain."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    fastpersist.guard(opt)
    _train_step(model, opt)
    state = _state(model, opt)
    want = _reference_bytes(state, tmp_path, "small")
    fut = fastpersist.save_async(state, tmp_path / "small.pt", mode="lazy",
                                 config=fastpersist.Config(async_staging_limit=256 << 10))
    for _ in range(2):
        _train_step(model, opt)
    fut.wait(60)
    assert (tmp_path / "small.pt").read_bytes() == want


def test_lazy_copies_without_crc_and_crcs_come_later(tmp_path, monkeypatch):
    """The lazy feed and the guard make plain copies (neither the feeder thread nor the
    training's step pays for CRC-32); the CRC fields are still right, computed from the
    staged windows in the background and written before the commit."""
    rec: list[_RecordingHandle] = []
    real_fg, real_bg = handles.handle_for, asyncsave._io_handle

    def fg(cfg, **kw):
        rec.append(_RecordingHandle(real_fg(cfg, **kw)))
        return rec[-1]

    def bg(cfg):
        rec.append(_RecordingHandle(real_bg(cfg)))
        return rec[-1]

    monkeypatch.setattr(handles, "handle_for", fg)
    monkeypatch.setattr(asyncsave, "_io_handle", bg)
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    fastpersist.guard(opt)
    _train_step(model, opt)
    state = _state(model, opt)
    want = _reference_bytes(state, tmp_path, "lc")
    fut = fastpersist.save_async(state, tmp_path / "lc.pt", mode="lazy",
                                 config=fastpersist.Config(async_staging_limit=256 << 10))
    _train_step(model, opt)  # the guard copies what the feeder has not reached
    assert fut.wait(timeout=60) is True
    copies = [c for h in rec for c in h.copies]
    assert copies and not any(crc for _n, crc in copies)
    monkeypatch.undo()
    assert (tmp_path / "lc.pt").read_bytes() == want
    assert fastpersist.verify(tmp_path / "lc.pt").ok


def test_lazy_without_guard_is_refused(tmp_path):
    model = _model()
    with pytest.raises(LazySaveError, match="guard"):
        fastpersist.save_async(model.state_dict(), tmp_path / "x.pt", mode="lazy")
    assert not (tmp_path / "x.pt").exists()
    assert not [p for p in os.listdir(tmp_path)]


def test_lazy_copies_unguarded_tensors_within_limit(tmp_path):
    model = _model()
    other = torch.nn.Linear(512, 512)  # trained by nobody guarded: copied at call time
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fastpersist.guard(opt)
    state = {"m": model.state_dict(), "frozen": other.state_dict()}
    want = _reference_bytes(state, tmp_path, "u")
    fut = fastpersist.save_async(state, tmp_path / "u.pt", mode="lazy")
    with torch.no_grad():
        other.weight.zero_()
    _train_step(model, opt)
    fut.wait()
    assert (tmp_path / "u.pt").read_bytes() == want
    with pytest.raises(LazySaveError, match="async_staging_limit"):
        fastpersist.save_async(state, tmp_path / "v.pt", mode="lazy", config=fastpersist.Config(async_staging_limit=8192))


def test_guard_remove(tmp_path):
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    with fastpersist.guard(opt):
        assert opt in asyncsave._guards
    assert opt not in asyncsave._guards


def test_queueing_and_pool_reuse(tmp_path):
    cfg = fastpersist.Config(async_staging_limit=256 << 10)
    states = [{"w": torch.full((300_000,), float(i))} for i in range(4)]
    wants = [_reference_bytes(s, tmp_path, str(i)) for i, s in enumerate(states)]
    futs = [fastpersist.save_async(s, tmp_path / f"q{i}.pt", config=cfg) for i, s in enumerate(states)]
    pool = asyncstage.current_pool()
    bufs = {w.buf.ptr for w in pool._windows}
    for s in states:
        s["w"].zero_()
    assert fastpersist.wait_all(timeout=60) is True
    assert all(f.done() for f in futs)
    for i in range(4):
        assert (tmp_path / f"q{i}.pt").read_bytes() == wants[i]
    assert pool.allocated <= pool.limit
    fastpersist.save_async(states[0], tmp_path / "again.pt", config=cfg).wait()
    assert {w.buf.ptr for w in asyncstage.current_pool()._windows} == bufs  # same memory, reused


def test_failed_save_keeps_previous_and_reports(tmp_path):
    target = tmp_path / "c.pt"
    fastpersist.save({"w": torch.ones(10)}, target)
    before = target.read_bytes()
    _native.set_fault("write", 1, "EIO", 1000)
    fut = fastpersist.save_async({"w": torch.zeros(100_000)}, target)
    with pytest.raises(OSError) as ei:
        fut.wait(timeout=60)
    _native.clear_faults()
    assert ei.value.errno == 5 and "previous file" in str(ei.value)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # temp file removed


def test_uncollected_error_raised_by_next_save_and_wait_all(tmp_path):
    _native.set_fault("write", 1, "EIO", 1000)
    fut = fastpersist.save_async({"w": torch.zeros(100_000)}, tmp_path / "e.pt")
    assert isinstance(fut.exception(timeout=60), OSError)  # counts as reported: nothing left to raise
    _native.clear_faults()
    fastpersist.save_async({"w": torch.zeros(10)}, tmp_path / "ok.pt").wait()
    _native.set_fault("write", 1, "EIO", 1000)
    fastpersist.save_async({"w": torch.zeros(100_000)}, tmp_path / "e2.pt")
    assert asyncsave.wait_for_path(tmp_path / "e2.pt", timeout=120)  # failed; error not collected by anyone
    _native.clear_faults()
    with pytest.raises(OSError):
        fastpersist.save_async({"w": torch.zeros(10)}, tmp_path / "next.pt")
    assert not (tmp_path / "next.pt").exists()
    _native.set_fault("write", 1, "EIO", 1000)
    fastpersist.save_async({"w": torch.zeros(100_000)}, tmp_path / "e3.pt")
    with pytest.raises(OSError):
        fastpersist.wait_all()
    _native.clear_faults()
    assert fastpersist.wait_all() is True  # reported once only


def test_blocking_save_after_async_to_same_file_keeps_the_newer_state(tmp_path, monkeypatch):
    """save_async(A, p) then save(B, p): the blocking save waits for the pending async save to
    the same file, so B (the newer call) ends up in the file; before, the async finisher renamed
    the older A over B after save had returned. Async saves to other files are not waited for."""
    real = asyncsave._finish
    gates = {}

    def gated(job):
        gates[os.path.basename(job.future.path)].wait(30)
        real(job)

    monkeypatch.setattr(asyncsave, "_finish", gated)
    target, other = tmp_path / "c.pt", tmp_path / "other.pt"
    gates["c.pt"], gates["other.pt"] = threading.Event(), threading.Event()
    fut = fastpersist.save_async({"v": 1, "w": torch.zeros(1000)}, target)
    opener = threading.Timer(0.3, gates["c.pt"].set)
    opener.start()
    fastpersist.save({"v": 2, "w": torch.ones(10)}, target)
    assert fut.done() and fut.exception() is None
    assert torch.load(target, weights_only=True)["v"] == 2
    fut_other = fastpersist.save_async({"v": 3}, other)
    fastpersist.save({"v": 4}, target)  # does not wait for the save to another file
    assert not fut_other.done()
    gates["other.pt"].set()
    fut_other.wait(60)
    assert torch.load(target, weights_only=True)["v"] == 4 and torch.load(other, weights_only=True)["v"] == 3


def test_uncollected_async_error_raised_by_next_blocking_save(tmp_path):
    _native.set_fault("write", 1, "EIO", 1000)
    fastpersist.save_async({"w": torch.zeros(100_000)}, tmp_path / "e.pt")
    assert asyncsave.wait_for_path(tmp_path / "e.pt", timeout=120)  # failed; error not collected by anyone
    _native.clear_faults()
    with pytest.raises(OSError) as ei:
        fastpersist.save({"w": torch.zeros(10)}, tmp_path / "next.pt")
    assert ei.value.errno == 5 and "async save" in str(ei.value) and "e.pt" in str(ei.value)
    assert not (tmp_path / "next.pt").exists()  # raised before anything was written
    fastpersist.save({"w": torch.zeros(10)}, tmp_path / "next.pt")  # reported once only
    assert (tmp_path / "next.pt").exists()


def _run(code: str, **env) -> subprocess.CompletedProcess:
    e = dict(os.environ, **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, env=e)


def test_exit_with_pending_save_finishes_it(tmp_path):
    p = tmp_path / "exit.pt"
    r = _run(f"""
        import torch, fastpersist
        state = {{"w": torch.arange(8_000_000, dtype=torch.float32)}}
        fastpersist.save_async(state, {str(p)!r})
        state["w"].zero_()
        # no wait: the interpreter exits with the save pending
    """)
    assert r.returncode == 0, r.stderr
    assert torch.equal(torch.load(p)["w"], torch.arange(8_000_000, dtype=torch.float32))


def test_exit_with_failing_save_prints_error(tmp_path):
    p = tmp_path / "exitfail.pt"
    r = _run(f"""
        import torch, fastpersist
        fastpersist.save_async({{"w": torch.ones(1_000_000)}}, {str(p)!r})
    """, FASTPERSIST_FAULT="write:1:EIO:100000")
    assert "asynchronous save of" in r.stderr and "failed" in r.stderr, r.stderr
    assert r.returncode == 1, r.stderr  # as an uncaught exception (tests/test_exit_abort.py)
    assert not p.exists()


def test_concurrent_saves_and_loads_from_threads(tmp_path):
    seeds = {}
    for i in range(2):
        seeds[i] = {"w": torch.randn(50_000 + i)}
        fastpersist.save(seeds[i], tmp_path / f"seed{i}.pt")
    errors = []

    def saver(k):
        try:
            for r in range(4):
                s = {"w": torch.full((40_000 + r,), float(k * 10 + r)), "k": k}
                want = copy.deepcopy(s)
                fut = fastpersist.save_async(s, tmp_path / f"t{k}-{r}.pt", mode="snapshot")
                s["w"].zero_()
                fut.wait(timeout=60)
                got = fastpersist.load(tmp_path / f"t{k}-{r}.pt")
                assert torch.equal(got["w"], want["w"]) and got["k"] == k
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def loader(k):
        try:
            for r in range(6):
                i = (k + r) % 2
                assert torch.equal(fastpersist.load(tmp_path / f"seed{i}.pt")["w"], seeds[i]["w"])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=saver, args=(k,)) for k in range(3)]
    ts += [threading.Thread(target=loader, args=(k,)) for k in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not errors, errors


_RSS_SCRIPT = """
import resource, sys, torch, fastpersist
n = int(sys.argv[1]); limit = int(sys.argv[2]); out = sys.argv[3]
state = {f"t{i}": torch.ones(n // 16 // 4) for i in range(16)}
cfg = fastpersist.Config(async_staging_limit=limit)
fastpersist.save({"warm": torch.ones(10)}, out + "-warm.pt", config=cfg)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
for r in range(5):
    fastpersist.save_async(state, f"{out}-{r}.pt", config=cfg)
    for t in state.values():
        t.add_(1)
fastpersist.wait_all()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(base, peak)
"""

#: RSS allowed beyond the state and the staging limit: torch/native working memory
#: (the plan, the handle's write staging ring: queue_depth x chunk_size = 64 MiB).
RSS_MARGIN = 96 << 20


def _rss_check(tmp_path, state_bytes: int, limit: int) -> None:
    r = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(state_bytes), str(limit), str(tmp_path / "r")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    base, peak = map(int, r.stdout.split())
    # base already holds the state; the saves may add at most the pool and the margin
    assert peak - base <= limit + RSS_MARGIN, (base >> 20, peak >> 20)
    assert torch.load(tmp_path / "r-4.pt")["t0"][0].item() == 5.0


def test_peak_rss_back_to_back_saves_256m(tmp_path):
    _rss_check(tmp_path, 256 << 20, 64 << 20)


@pytest.mark.slow
def test_peak_rss_back_to_back_saves_1g(tmp_path):
    _rss_check(tmp_path, 1 << 30, 256 << 20)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        fastpersist.save_async({}, tmp_path / "x.pt", mode="eager")
    with pytest.raises(TypeError):
        import io

        fastpersist.save_async({}, io.BytesIO())


def test_bench_train_smoke(tmp_path):
    from fastpersist.bench.train_bench import plot_train, print_train_report, run_train_bench

    # fastpersist's own methods against torch.save (the peers: tests/test_train_bench.py)
    res = run_train_bench(str(tmp_path), steps=4, every=2, layers=1, d_model=32, heads=2, vocab=64, seq=8, batch=2,
                          progress=False, methods=["torch.save", "fastpersist.save", "async-snapshot", "async-lazy"])
    assert sorted(r.method for r in res.runs) == sorted(["none", "torch.save", "fastpersist.save", "async-snapshot",
                                                          "async-lazy"])
    assert all(r.error is None for r in res.runs), [r.error for r in res.runs]
    assert all(r.verified for r in res.runs if r.method != "none")
    import io

    buf = io.StringIO()
    print_train_report(res, buf)
    assert "async-lazy" in buf.getvalue()
    assert set(res.to_dict()["ratios_vs_torch_save"]) == {"fastpersist.save", "async-snapshot", "async-lazy"}
    plot_train(res, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0


def _thread_nice_values() -> dict[int, int]:
    """Nice value of every thread of this process (field 19 of /proc/self/task/TID/stat)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = int(fields[16])  # fields after the name start at field 3
    return out


def test_async_nice_lowers_only_the_background_threads(tmp_path):
    """Config.async_nice: the background writer's native threads run at that nice value,
    the caller keeps its own, and the file is still right."""
    state = {"w": torch.randn(1 << 16), "b": torch.arange(1000)}
    want = _reference_bytes(state, tmp_path, "n")
    before = _thread_nice_values()
    cfg = fastpersist.Config(async_nice=7)
    fut = fastpersist.save_async(state, tmp_path / "n.pt", config=cfg)
    assert fut.wait(60) is True
    after = _thread_nice_values()
    new_threads = {tid: nice for tid, nice in after.items() if tid not in before}
    assert 7 in new_threads.values(), new_threads
    assert after[threading.get_native_id()] == before[threading.get_native_id()]
    assert (tmp_path / "n.pt").read_bytes() == want


@pytest.mark.parametrize("bad", [-1, 20])
def test_async_nice_out_of_range_refused(bad, monkeypatch):
    with pytest.raises(ValueError, match="async_nice"):
        fastpersist.Config(async_nice=bad)
    monkeypatch.setenv("FASTPERSIST_ASYNC_NICE", str(bad))
    with pytest.raises(ValueError, match="FASTPERSIST_ASYNC_NICE"):
        fastpersist.Config.from_env()
