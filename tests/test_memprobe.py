"""The fresh-memory probe printed in every benchmark header (fastpersist.memprobe)."""

from __future__ import annotations

import sys

import pytest

from fastpersist import memprobe
from fastpersist.machine import collect_machine_info

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")


@linux_only
def test_probe_measures_rates_and_round_trips() -> None:
    r = memprobe.probe_fresh_memory(8 << 20, threads=2)
    if r.error and "POPULATE" in r.error:
        pytest.skip(f"kernel without MADV_POPULATE_WRITE: {r.error}")
    assert r.error is None
    assert r.threads == 2 and r.probe_bytes == 8 << 20
    for v in (r.fresh_gbps_1, r.fresh_gbps_n, r.resident_gbps):
        assert v is not None and v > 0
    again = memprobe.FreshMemory(**r.to_dict())
    assert again == r
    text = r.summary()
    assert f"{r.fresh_gbps_1:.2f} GB/s (1 thread;" in text and "2 threads" in text


def test_probe_rounds_odd_sizes_to_whole_pages_per_thread() -> None:
    r = memprobe.probe_fresh_memory(3 * 4096 + 17, threads=3)
    assert r.probe_bytes % (3 * 4096) == 0 and r.probe_bytes > 0


def test_probe_failure_is_reported_not_raised(monkeypatch) -> None:
    class FailingLibc:
        def madvise(self, *_args: object) -> int:
            return -1

    monkeypatch.setattr(memprobe, "_libc", FailingLibc)
    r = memprobe.probe_fresh_memory(1 << 20, threads=1)
    assert r.fresh_gbps_1 is None and r.error and "MADV_POPULATE_WRITE" in r.error
    assert r.summary().startswith("not measured (")


def test_page_reporting_order_parsed(monkeypatch, tmp_path) -> None:
    f = tmp_path / "order"
    f.write_text("9\n")
    monkeypatch.setattr(memprobe, "_REPORTING_ORDER", str(f))
    assert memprobe.page_reporting_order() == 9
    probed = memprobe.FreshMemory(1, error="x", page_reporting_order=9)
    assert "free page reporting on (order 9" in probed.summary(verbose=True)
    assert "page reporting" not in probed.summary()  # expert detail only with --verbose (and in the JSON)
    monkeypatch.setattr(memprobe, "_REPORTING_ORDER", str(tmp_path / "absent"))
    assert memprobe.page_reporting_order() is None


def test_machine_header_carries_the_probe(tmp_path) -> None:
    info = collect_machine_info(str(tmp_path))
    assert info.fresh_memory is not None
    assert any(line.startswith("New memory : ") for line in info.summary_lines())
    quiet = collect_machine_info(str(tmp_path), probe_memory=False)
    assert quiet.fresh_memory is None
    assert not any(line.startswith("New memory") for line in quiet.summary_lines())
