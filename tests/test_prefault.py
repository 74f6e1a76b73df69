"""fastpersist.prefault: a second thread faults a load's new buffers in while the reads run."""

from __future__ import annotations

import errno
import resource

import torch

import fastpersist
from fastpersist import _native
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
