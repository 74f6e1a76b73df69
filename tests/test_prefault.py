"""fastpersist.prefault: a second thread faults a load's new buffers in while the reads run."""

from __future__ import annotations

import errno
import resource

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
    big = _native.PinnedBuffer(16 * STEP, 4096, False)
    p = Prefaulter([big])
    p.close()  # at most one more step after the stop
    assert p.populated < big.nbytes or p.populated == big.nbytes
    assert p._thread is None


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


def _vm_flags(ptr: int) -> set[str]:
    """VmFlags of the mapping of this process that holds address ``ptr``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {ptr:#x}")


def test_choose_pages_follows_the_setting(monkeypatch):
    from fastpersist import prefault

    for value, huge in (("off", False), ("on", True), ("auto", prefault.free_page_reporter() is None)):
        monkeypatch.setenv(prefault.HUGE_PAGES_ENV, value)
        prefault.forget_huge_pages()
        try:
            assert prefault.huge_pages()[0] is huge
            buf = prefault.choose_pages(_native.PinnedBuffer(8 << 20, 4096, False))
            flags = _vm_flags(buf.ptr)
            assert ("nh" in flags) is (not huge)
            assert ("hg" in flags) is huge  # the native buffer's own advice stays where huge pages are kept
        finally:
            prefault.forget_huge_pages()
    monkeypatch.setenv(prefault.HUGE_PAGES_ENV, "sometimes")
    try:
        with pytest.raises(ValueError, match="FASTPERSIST_LOAD_HUGE_PAGES"):
            prefault.huge_pages()
    finally:
        monkeypatch.delenv(prefault.HUGE_PAGES_ENV)
        prefault.forget_huge_pages()


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
