"""The Accelerate and DeepSpeed examples run with no arguments, in a scratch directory."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from functools import partial

import pytest

from subprocs import side_by_side  # tests/ is on sys.path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, tmp_path, **env_extra: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_extra)
    for var in ("FASTPERSIST_ACCELERATE", "FASTPERSIST_DEEPSPEED", "FASTPERSIST_PATCH_TORCH_SAVE"):
        env.pop(var, None)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert os.listdir(tmp_path) == [], "the example left files in the working directory"
    return out.stdout


#: per framework: its example and the extra environment it runs with
EXAMPLES = {"accelerate": ("accelerate_fastpersist.py", {}),
            "deepspeed": ("deepspeed_fastpersist.py", {"DS_ACCELERATOR": "cpu"})}


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory) -> dict:
    """The example of each installed framework, in a scratch directory of its own, side by side
    (each is seconds of imports); ``example_runs[name].result()`` is its output or raises its failure."""
    names = [n for n in EXAMPLES if importlib.util.find_spec(n) is not None]
    calls = [partial(_run, EXAMPLES[n][0], tmp_path_factory.mktemp(n), **EXAMPLES[n][1]) for n in names]
    return dict(zip(names, side_by_side(calls)))


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate is not installed")
def test_accelerate_example(example_runs):
    out = example_runs["accelerate"].result()
    assert "checkpoints kept: ['checkpoint_1', 'checkpoint_2']" in out
    assert "weights equal" in out and "stock Accelerate + fsync" in out and "fastpersist" in out


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_example(example_runs):
    out = example_runs["deepspeed"].result()
    assert "weights equal" in out and "stock TorchCheckpointEngine + fsync" in out
    assert "FastPersistCheckpointEngine" in out and "decoupled" in out
