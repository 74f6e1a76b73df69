"""The Accelerate and DeepSpeed examples run with no arguments, in a scratch directory."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

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


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate is not installed")
def test_accelerate_example(tmp_path):
    out = _run("accelerate_fastpersist.py", tmp_path)
    assert "checkpoints kept: ['checkpoint_1', 'checkpoint_2']" in out
    assert "weights equal" in out and "stock Accelerate + fsync" in out and "fastpersist" in out


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_example(tmp_path):
    out = _run("deepspeed_fastpersist.py", tmp_path, DS_ACCELERATOR="cpu")
    assert "weights equal" in out and "stock TorchCheckpointEngine + fsync" in out
    assert "FastPersistCheckpointEngine" in out and "decoupled" in out
