"""``fastpersist bench sweep`` at tiny sizes: the table, the JSON, the busy process, the cleanup."""

from __future__ import annotations

import json
import os

from fastpersist import cli
from fastpersist.bench import sweep_bench


def test_sweep_runs_and_reports(tmp_path, capsys):
    d = tmp_path / "bench"
    out = tmp_path / "sweep.json"
    rc = cli.main(["bench", "sweep", "--dir", str(d), "--sizes", "64KiB,256KiB", "--rounds", "1", "--busy",
                   "--json", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "torch.save+fsync" in text and "load reads :" in text and "1 CPU-bound" in text
    rows = [ln for ln in text.splitlines() if "KiB |" in ln]
    assert len(rows) == 2
    data = json.loads(out.read_text())
    assert data["busy"] == 1 and data["rounds"] == 1
    assert [s["nbytes"] for s in data["sizes"]] == [64 << 10, 256 << 10]
    for s in data["sizes"]:
        for op in ("save", "load"):
            assert all(len(s[op][m]) == 1 and min(s[op][m]) > 0 for m in ("torch", "fastpersist"))
        assert s["save_speedup"] > 0 and s["load_speedup"] > 0
    assert os.listdir(d) == []  # the sweep's files are removed


def test_default_sizes_fit_the_machine(tmp_path):
    sizes = sweep_bench.default_sizes(str(tmp_path))
    assert sizes and sizes == sorted(sizes) and sizes[0] == 1 << 20 and sizes[-1] <= 2 << 30
