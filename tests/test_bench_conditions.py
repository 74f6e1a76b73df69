"""bench save's first-run defaults and its account of the run (issue 38, items 1 and 2):
the size it picks, the plan it prints before it starts, and whether the machine was quiet."""

from __future__ import annotations

import os

import pytest

from fastpersist.bench import conditions
from fastpersist.bench.conditions import AUTO_SIZE_MAX, AUTO_SIZE_MIN, Conditions, auto_size, plan_line


def test_auto_size_is_the_first_run_default_where_memory_and_disk_allow(tmp_path, monkeypatch):
    monkeypatch.setattr(conditions, "available_memory", lambda: 64 << 30)
    size, why = auto_size(str(tmp_path))
    st = os.statvfs(tmp_path)
    if st.f_bavail * st.f_frsize >= conditions.DISK_FACTOR * AUTO_SIZE_MAX:
        assert (size, why) == (AUTO_SIZE_MAX, "the default for a first run")


@pytest.mark.parametrize("mem,want", [(1 << 30, 384 << 20), (2 << 30, AUTO_SIZE_MAX),
                                      (100 << 20, AUTO_SIZE_MIN)])
def test_auto_size_fits_the_free_memory(tmp_path, monkeypatch, mem, want):
    """The state is at most free memory / 2.5 (the run's measured peak per state byte), in 64 MiB steps."""
    monkeypatch.setattr(conditions, "available_memory", lambda: mem)
    size, why = auto_size(str(tmp_path))
    st = os.statvfs(tmp_path)
    if st.f_bavail * st.f_frsize < conditions.DISK_FACTOR * want:
        pytest.skip("the disk here is shorter than the memory case")
    assert size == want and size % (64 << 20) == 0
    if size < AUTO_SIZE_MAX:
        assert "of memory free" in why


def test_auto_size_fits_the_free_disk(tmp_path, monkeypatch):
    class Small:
        f_bavail, f_frsize = (1 << 30) // 4096, 4096  # 1 GiB free

    monkeypatch.setattr(conditions, "available_memory", lambda: 64 << 30)
    monkeypatch.setattr(conditions.os, "statvfs", lambda d: Small)
    size, why = auto_size(str(tmp_path))
    assert size == 128 << 20 and "of disk free in" in why  # 1 GiB / 6, down to 64 MiB steps


def test_plan_line_says_size_memory_disk_and_time():
    line = plan_line(512 << 20, "the default for a first run", 4, 3, True)
    assert line.startswith("Plan       : a 512.00 MiB state (the default for a first run; --size to choose)")
    assert "3 rounds of 4 methods and fio" in line and "1.25 GiB of memory" in line and "3.00 GiB of disk" in line
    assert "at 2 GB/s" in line and "at 0.5 GB/s" in line


def test_conditions_name_a_busy_machine_and_memory_bound_loads():
    c = Conditions(cpus=2, load_before=3.5, busy_before=1.6)
    c.after(fresh_memory_gbps=1.1, read_ceiling_gbps=1.6)
    lines = c.lines()
    assert lines[0].startswith("Conditions : NOT QUIET: other work kept 1.6 cores busy at the start; load average "
                               "3.50 on 2 usable cores")
    assert lines[1].startswith("Cold loads : limited by new memory") and "1.10 GB/s" in lines[1]
    # a load average left by work that just ended (the install) is not "busy": the CPU sample decides
    quiet = Conditions(cpus=2, load_before=1.1, busy_before=0.05)
    quiet.after(fresh_memory_gbps=3.0, read_ceiling_gbps=1.6)
    assert quiet.lines() == [quiet.lines()[0]] and "quiet at the start" in quiet.lines()[0]
    assert quiet.to_dict()["busy"] is False and c.to_dict()["memory_bound_loads"] is True
    assert Conditions(cpus=2, load_before=1.5).busy  # no CPU sample: the load average decides


def test_busy_cores_sees_a_busy_core():
    import subprocess
    import sys

    from fastpersist.bench.conditions import busy_cores

    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert busy_cores(1.0) >= 0.6
    finally:
        burner.kill()
        burner.wait()


def test_cli_prints_the_plan_first_and_the_conditions(tmp_path, capsys):
    from fastpersist.cli import main

    assert main(["bench", "save", "--dir", str(tmp_path), "--size", "8MiB", "--repeat", "1", "--peers", "torch",
                 "--load-process", "same", "--no-plot", "--no-progress", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("Plan       : a 8.00 MiB state, 1 round of 2 methods;")
    assert any(line.startswith("Conditions : ") for line in out)
    import json

    data = json.loads((tmp_path / "r.json").read_text())
    assert set(data["conditions"]) >= {"cpus", "load_before", "busy_before", "load_after", "busy", "memory_bound_loads"}
