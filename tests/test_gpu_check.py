"""tools/gpu_check.sh, the one-command GPU check, on this machine.

Without a CUDA device its GPU steps must say why they skip, and the steps that need
no GPU (env, ceiling) must run and write their logs and summaries: a check that
breaks as the code changes would waste the few minutes a GPU machine is lent.
On a GPU machine the script itself is the check (README, "GPU"); here only its
env and ceiling steps run, with a tiny size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.sh")


def _run(out, *args, timeout=240):
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", SCRIPT, str(out), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_cpu_run_skips_gpu_steps_and_runs_the_rest(tmp_path):
    steps = "env,ceiling" if torch.cuda.is_available() else "env,gpu-tests,ceiling,bench-save,bench-io,bench-train,stream"
    r = _run(tmp_path / "out", "--no-build", "--size", "8MiB", "--scratch", str(tmp_path / "scratch"),
             "--steps", steps)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    by = {s["step"]: s for s in summary}
    assert list(by) == steps.split(",")
    assert by["env"]["status"] == "PASS" and by["ceiling"]["status"] == "PASS"
    env_log = next(p for p in os.listdir(tmp_path / "out") if p.endswith("-env.log"))
    text = (tmp_path / "out" / env_log).read_text()
    assert "torch " in text and "cufile:" in text and "scratch:" in text
    ceiling = json.loads((tmp_path / "out" / "ceiling.json").read_text())
    assert ceiling["write_gbps"] > 0 and ceiling["read_gbps"] > 0
    assert not [p for p in os.listdir(tmp_path / "scratch") if p.startswith("fp-gpu-check")]
    if not torch.cuda.is_available():
        for name in ("gpu-tests", "bench-save", "bench-io", "bench-train", "stream"):
            assert by[name]["status"] == "SKIP" and by[name]["note"].startswith("no CUDA device"), by[name]
        assert "SKIP" in r.stdout and "no step failed" in r.stdout


def test_failing_step_fails_the_run_and_budget_skips(tmp_path):
    # --budget 0: every step is skipped for the budget, none runs, the run does not fail
    r = _run(tmp_path / "out", "--no-build", "--steps", "env,ceiling", "--budget", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("budget:") == 2
    # an unwritable scratch: ceiling's dd fails, the script says so and exits 1
    bad = tmp_path / "ro"
    bad.mkdir()
    (bad / "fp-gpu-check-dd.bin").mkdir()  # dd cannot open a directory for writing
    r = _run(tmp_path / "out2", "--no-build", "--steps", "ceiling", "--size", "1MiB", "--scratch", str(bad))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAIL" in (tmp_path / "out2" / "summary.txt").read_text()


@pytest.mark.parametrize("args", [[], ["out", "--steps", "nope"], ["out", "--bogus"]])
def test_usage_errors(tmp_path, args):
    r = subprocess.run(["bash", SCRIPT, *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
