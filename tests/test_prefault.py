"""fastpersist.prefault: a second thread faults a load's new buffers in while the reads run."""

from __future__ import annotations

import errno
import resource
import threading

import pytest
import torch

import fastpersist
from fastpersist import _native
from fastpersist.errors import ChecksumError
from fastpersist.formats import torchload
from fastpersist.prefault import STEP, Prefaulter


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_populates_every_page_so_first_writes_do_not_fault():
    buf = _native.PinnedBuffer(3 * STEP + (5 << 20), 4096, False)  # new memory: no page present yet
    p = Prefaulter([buf])
    p._thread.join()
    assert p.error is None and p.populated == buf.nbytes
    warm = torch.frombuffer(_native.PinnedBuffer(1 << 20, 4096, False), dtype=torch.uint8)
    warm.fill_(1)  # torch's own first-use faults, not counted below
    t = torch.frombuffer(buf, dtype=torch.uint8)
    before = _minflt()
    t.fill_(7)  # 101 MiB: 25,856 pages of 4 KiB (51 of 2 MiB with THP); populated ones do not fault
    assert _minflt() - before < 5
    p.close()
    fresh = torch.frombuffer(_native.PinnedBuffer(64 << 20, 4096, False), dtype=torch.uint8)
    before = _minflt()
    fresh.fill_(7)
    assert _minflt() - before >= 16  # the control: unpopulated memory faults on first write (32 x 2 MiB or more)


def test_close_stops_early_and_a_refused_call_stops_the_thread():
    class Gone:
        ptr, nbytes = 4096, STEP  # not mapped: madvise refuses (ENOMEM)

    p = Prefaulter([Gone()])
    p._thread.join()
    assert p.error == errno.ENOMEM and p.populated == 0
    p.close()


def test_close_stops_after_the_step_in_flight(monkeypatch):
    from fastpersist import prefault

    real = prefault._madvise()
    started, release = threading.Event(), threading.Event()

    def held(ptr, n, advice):  # the first step waits until the test lets it go
        if not started.is_set():
            started.set()
            assert release.wait(30)
        return real(ptr, n, advice)

    monkeypatch.setattr(prefault, "_madvise", lambda: held)
    big = _native.PinnedBuffer(16 * STEP, 4096, False)
    p = Prefaulter([big])
    assert started.wait(30)
    closer = threading.Thread(target=p.close)
    closer.start()
    assert p._stop.wait(30)  # close asked the thread to stop while its first step runs
    release.set()
    closer.join(30)
    assert not closer.is_alive() and p._thread is None
    assert p.populated == STEP and p.error is None  # the step in flight finished, no other began


def test_loads_prefault_their_buffers_and_return_the_saved_values(tmp_path, monkeypatch):
    sd = {f"w{i}": torch.randn(1 << 20) for i in range(8)}  # 32 MiB, over PREFAULT_MIN
    p = tmp_path / "a.pt"
    fastpersist.save(sd, p)
    made = []
    real = torchload.Prefaulter

    def spy(buffers):
        pf = real(buffers)
        made.append((pf, sum(b.nbytes for b in buffers)))
        return pf

    monkeypatch.setattr(torchload, "Prefaulter", spy)
    out = fastpersist.load(p, weights_only=True)
    assert all(torch.equal(out[k], v) for k, v in sd.items())
    assert len(made) == 1 and made[0][1] >= 32 << 20 and made[0][0]._thread is None  # closed by the load


# ---- the page size of fresh load buffers (prefault.huge_pages / choose_pages) ----------------


def _fake_virtio(root, name: str, device: str, features: str) -> None:
    d = root / "bus" / "virtio" / "devices" / name
    d.mkdir(parents=True)
    (d / "device").write_text(device + "\n")
    (d / "features").write_text(features + "\n")


def test_free_page_reporter_reads_the_balloons_feature_bit(tmp_path):
    from fastpersist.prefault import free_page_reporter

    assert free_page_reporter(str(tmp_path)) is None  # no virtio devices, no Hyper-V balloon
    _fake_virtio(tmp_path, "virtio0", "0x0002", "1" * 64)  # a block device: never a reporter
    _fake_virtio(tmp_path, "virtio1", "0x0005", "0110001" + "0" * 57)  # a balloon without bit 5
    assert free_page_reporter(str(tmp_path)) is None
    _fake_virtio(tmp_path, "virtio2", "0x0005", "0110010" + "0" * 57)  # bit 5: free page reporting
    assert free_page_reporter(str(tmp_path)) == "virtio-balloon free page reporting"
    hv = tmp_path / "hv"
    (hv / "module" / "hv_balloon").mkdir(parents=True)
    assert free_page_reporter(str(hv)) == "Hyper-V balloon (hv_balloon)"


def _smaps_field(ptr: int, field: str) -> list[str]:
    """The values of ``field`` in /proc/self/smaps for the mapping that holds address ``ptr``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == field + ":":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {ptr:#x}")


def _vm_flags(ptr: int) -> set[str]:
    """VmFlags of the mapping of this process that holds address ``ptr``."""
    return set(_smaps_field(ptr, "VmFlags"))


class _Evidence:
    """A FreeWatch's injected source and clock: ``free`` bytes in large free blocks at ``now``."""

    def __init__(self, free: int = 10 << 30) -> None:
        self.free, self.now = free, 100.0

    def watch(self, **kw):
        from fastpersist.prefault import FreeWatch

        return FreeWatch(lambda: self.free, clock=lambda: self.now, window=1.0, thread=False, **kw)


@pytest.fixture
def per_load(monkeypatch):
    """The per-load rule (as on a VM with free page reporting) with injected evidence."""
    from fastpersist import prefault

    monkeypatch.delenv(prefault.HUGE_PAGES_ENV, raising=False)
    monkeypatch.setattr(prefault, "free_page_reporter", lambda sysfs="/sys": "virtio-balloon free page reporting")
    prefault.forget_huge_pages()
    ev = _Evidence()
    watch = ev.watch()
    watch.sample()  # the history starts here
    prefault.set_free_watch(watch)
    try:
        assert prefault.huge_pages()[0] is None
        yield ev
    finally:
        prefault.forget_huge_pages()


def test_choose_pages_follows_the_setting(monkeypatch):
    from fastpersist import prefault

    reporting = prefault.free_page_reporter() is not None
    for value, huge in (("off", False), ("on", True), ("auto", None if reporting else True)):
        monkeypatch.setenv(prefault.HUGE_PAGES_ENV, value)
        prefault.forget_huge_pages()
        prefault.set_free_watch(_Evidence().watch())  # per load: nothing freed lately (fresh memory)
        try:
            assert prefault.huge_pages()[0] is huge
            buf = prefault.choose_pages(_native.PinnedBuffer(8 << 20, 4096, False))
            flags = _vm_flags(buf.ptr)
            assert ("nh" in flags) is (not huge)
            assert ("hg" in flags) is bool(huge)  # the native buffer's own advice stays where huge pages are kept
        finally:
            prefault.forget_huge_pages()
    monkeypatch.setenv(prefault.HUGE_PAGES_ENV, "sometimes")
    try:
        with pytest.raises(ValueError, match="FASTPERSIST_LOAD_HUGE_PAGES"):
            prefault.huge_pages()
    finally:
        monkeypatch.delenv(prefault.HUGE_PAGES_ENV)
        prefault.forget_huge_pages()


def test_large_free_bytes_and_the_reporting_order_come_from_the_kernel(tmp_path):
    from fastpersist.prefault import large_free_bytes, reporting_order

    info = tmp_path / "buddyinfo"
    info.write_text("Node 0, zone   DMA    0   0   0   0  0  0  0  0  1  1   3 \n"
                    "Node 0, zone DMA32  985 425 126 125 78 58 38 19 11 20 723 \n")
    assert large_free_bytes(9, str(info)) == (1 * 2 + 3 * 4 + 20 * 2 + 723 * 4) << 20
    assert large_free_bytes(10, str(info)) == (3 + 723) * 4 << 20
    assert large_free_bytes(9, str(tmp_path / "none")) is None
    assert large_free_bytes(9) is None or large_free_bytes(9) >= 0  # this machine's, readable or not
    assert reporting_order(str(tmp_path)) == 9  # no page_reporting module: the default, 2 MiB
    d = tmp_path / "module" / "page_reporting" / "parameters"
    d.mkdir(parents=True)
    (d / "page_reporting_order").write_text("10\n")
    assert reporting_order(str(tmp_path)) == 10


def test_free_watch_gives_out_memory_freed_in_the_last_second_once():
    ev = _Evidence()
    w = ev.watch()
    assert w.claim(1 << 30) == 0  # no history (a fresh process's first load): 4 KiB pages
    ev.now += 0.3
    ev.free += 1 << 30  # 1 GiB freed in large blocks
    w.sample()
    ev.now += 0.5
    assert w.recent() == 1 << 30
    assert w.claim(256 << 20) == 256 << 20
    assert w.claim(1 << 30) == 768 << 20  # what the first buffer took is not given out again
    assert w.claim(64 << 20) == 0
    ev.now += 2.0  # that memory was freed long enough ago for the balloon to report it
    w.sample()
    assert w.claim(1 << 30) == 0
    ev.free -= 3 << 30  # taken (by someone else's huge pages)...
    w.sample()
    ev.now += 0.4
    ev.free += (100 << 20) + 12345  # ...and some freed again: the growth from the low counts
    assert w.claim(1 << 30) == 100 << 20  # in 2 MiB steps, rounded down
    ev.now += 1.5
    ev.free = None  # unreadable: no evidence
    assert w.claim(1 << 30) == 0 and w.recent() == 0


def test_free_watch_samples_on_its_thread_and_ends_when_idle():
    import threading

    from fastpersist.prefault import FreeWatch

    now = [0.0]
    reads = []
    sampled = threading.Event()

    def read():
        reads.append(now[0])
        if len(reads) >= 5:
            sampled.set()
        return 1 << 30

    w = FreeWatch(read, clock=lambda: now[0], period=0.001, idle=10.0)
    assert not w.running()
    w.claim(8 << 20)  # starts the thread
    assert w.running()
    assert sampled.wait(30)
    t = w._thread
    now[0] = 11.0  # idle longer than ``idle``: the thread ends by itself
    t.join(30)
    assert not t.is_alive() and not w.running()
    w.claim(8 << 20)  # a later load starts it again
    assert w.running()
    w.close()
    assert not w.running()


def _smaps_kib(ptr: int, field: str) -> int:
    """``field`` (kB) of the mapping of this process that holds ``ptr``."""
    return int(_smaps_field(ptr, field)[0])


def test_choose_pages_per_load_gives_huge_pages_as_far_as_memory_was_freed_lately(per_load):
    from fastpersist import prefault

    fresh = prefault.choose_pages(_native.PinnedBuffer(8 << 20, 4096, False))  # nothing freed lately
    assert "nh" in _vm_flags(fresh.ptr) and "nh" in _vm_flags(fresh.ptr + (6 << 20))
    torch.frombuffer(fresh, dtype=torch.uint8).fill_(1)
    assert _smaps_kib(fresh.ptr, "AnonHugePages") == 0  # 4 KiB pages, whatever the kernel has free
    per_load.now += 0.2
    per_load.free += 12 << 20  # 12 MiB freed in large blocks
    recent = prefault.choose_pages(_native.PinnedBuffer(8 << 20, 4096, False))
    flags = _vm_flags(recent.ptr)
    assert "hg" in flags and "nh" not in flags and "nh" not in _vm_flags(recent.ptr + (6 << 20))
    split = prefault.choose_pages(_native.PinnedBuffer(8 << 20, 4096, False))  # 4 MiB of evidence left
    assert "nh" not in _vm_flags(split.ptr) and "nh" in _vm_flags(split.ptr + (4 << 20))
    torch.frombuffer(split, dtype=torch.uint8).fill_(2)
    assert _smaps_kib(split.ptr + (4 << 20), "AnonHugePages") == 0
    assert "nh" in _vm_flags(prefault.choose_pages(_native.PinnedBuffer(8 << 20, 4096, False)).ptr)  # none left
    assert bytes(split)[:8] == b"\x02" * 8 and bytes(fresh)[-8:] == b"\x01" * 8


def test_loads_with_buffers_split_between_page_sizes_are_bit_exact(tmp_path, per_load):
    g = torch.Generator().manual_seed(2)
    state = {"big": torch.randn(6 << 20, generator=g), "mid": torch.randn(3 << 18, generator=g),
             "small": torch.arange(100, dtype=torch.int16)}
    path = tmp_path / "s.pt"
    fastpersist.save(state, path)
    per_load.now += 0.5
    per_load.free += 10 << 20  # less than the 24 MiB tensor's buffer
    out = fastpersist.load(path, weights_only=True)
    assert out.keys() == state.keys() and all(torch.equal(out[k], state[k]) for k in state)
    big = out["big"].data_ptr()
    assert "nh" not in _vm_flags(big) and "nh" in _vm_flags(big + (20 << 20))


@pytest.mark.parametrize("value", ["off", "on"])
def test_cold_loads_are_bit_exact_and_checked_with_either_page_size(tmp_path, monkeypatch, value):
    from fastpersist import prefault

    monkeypatch.setenv(prefault.HUGE_PAGES_ENV, value)
    prefault.forget_huge_pages()
    try:
        g = torch.Generator().manual_seed(1)
        state = {"big": torch.randn(6 << 20, generator=g), "mid": torch.randn(3 << 18, generator=g),
                 "small": torch.arange(100, dtype=torch.int16)}
        path = tmp_path / "c.pt"
        fastpersist.save(state, path)
        out = fastpersist.load(path, weights_only=True)
        assert out.keys() == state.keys() and all(torch.equal(out[k], state[k]) for k in state)
        assert ("nh" in _vm_flags(out["big"].data_ptr())) is (value == "off")
        with fastpersist.open(path) as f:  # the lazy reader's buffers too
            assert torch.equal(f.get("big"), state["big"])
        raw = bytearray(path.read_bytes())
        at = raw.find(state["big"][: 1 << 10].numpy().tobytes()) + 4096
        raw[at] ^= 0x40
        path.write_bytes(bytes(raw))
        with pytest.raises(ChecksumError):
            fastpersist.load(path, weights_only=True)
    finally:
        prefault.forget_huge_pages()


def test_a_forked_child_starts_without_the_parents_history(per_load):
    import os

    from fastpersist import prefault

    assert prefault._watch is not None
    pid = os.fork()
    if pid == 0:  # the child: no watch (its thread is the parent's), a fresh one at its first load
        os._exit(0 if prefault._watch is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("raw", ["on", "OFF", "auto", "1", "no", "yes", "sometimes", "2"])
def test_the_documented_variable_accepts_what_prefault_accepts(monkeypatch, raw):
    """docs/config.md's FASTPERSIST_LOAD_HUGE_PAGES (fastpersist.config's parser) and the rule
    that reads it (prefault.huge_pages) accept and refuse the same values, to the same choice."""
    from fastpersist import config as fpconfig
    from fastpersist import prefault

    (var,) = [v for v in fpconfig.ENV_VARS if v.name == prefault.HUGE_PAGES_ENV]
    monkeypatch.setenv(prefault.HUGE_PAGES_ENV, raw)
    prefault.forget_huge_pages()
    try:
        try:
            documented = var.parse(var.name, raw)
        except ValueError:
            with pytest.raises(ValueError):
                prefault.huge_pages()
            return
        chosen = prefault.huge_pages()[0]
        assert {"on": True, "off": False}.get(documented, chosen) is chosen
    finally:
        monkeypatch.delenv(prefault.HUGE_PAGES_ENV)
        prefault.forget_huge_pages()
