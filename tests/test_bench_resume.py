"""fastpersist bench resume: each scenario runs in fresh processes, checks the restored
values (a wrong restore fails the benchmark) and reports both methods."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("lightning")
pytest.importorskip("safetensors")


def test_bench_resume_runs_every_scenario(tmp_path) -> None:
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "fastpersist", "bench", "resume", "--dir", str(tmp_path),
                           "--size", "64MiB", "--repeat", "1", "--json", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["size"] == 64 << 20 and data["layers"] == 1
    rows = {r["scenario"]: r for r in data["rows"]}
    assert set(rows) == {"lightning", "load_model", "load_state_dict"}
    for r in rows.values():
        assert len(r["fastpersist"]) == len(r["stock"]) == 1 and min(r["fastpersist"] + r["stock"]) > 0
    assert len(rows["lightning"]["fastpersist_fit"]) == 1
    assert "x stock" in proc.stdout
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("fp-bench-resume-")]  # scratch removed


def test_bench_resume_rejects_unknown_scenarios(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "fastpersist", "bench", "resume", "--dir", str(tmp_path),
                           "--scenarios", "nope"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "nope" in proc.stderr
