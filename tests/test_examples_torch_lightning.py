"""The plain-PyTorch switch example and the Lightning example run with no arguments."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(script: str, tmp_path: Path) -> str:
    r = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert r.stdout.strip().splitlines()[-1] == "OK", r.stdout
    return r.stdout


@pytest.mark.skipif(importlib.util.find_spec("_fastpersist_startup") is None,
                    reason="start-up hook not installed (source tree without pip install)")
def test_plain_torch_switch_example(tmp_path: Path) -> None:
    out = run("plain_torch_switch.py", tmp_path)
    assert "storage alignment 4096, patched=True" in out and "storage alignment 64, patched=False" in out


def test_lightning_example(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    out = run("lightning_fastpersist.py", tmp_path)
    assert "resumed from last.ckpt" in out and "stock TorchCheckpointIO + fsync" in out
