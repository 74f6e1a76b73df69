"""What a new user types first (issue 38), run as typed, each in a fresh process where the
point is what ``import fastpersist`` alone gives."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import fastpersist


def _fresh(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_documented_accelerate_enable_after_import_fastpersist_alone():
    """README: ``fastpersist.integrations.accelerate.enable(accelerator)``; it failed with
    AttributeError: module 'fastpersist' has no attribute 'integrations'."""
    pytest.importorskip("accelerate")
    out = _fresh(
        "import sys, fastpersist, accelerate\n"
        "assert 'fastpersist.integrations.accelerate' not in sys.modules\n"
        "accelerator = accelerate.Accelerator(cpu=True)\n"
        "fastpersist.integrations.accelerate.enable(accelerator)\n"
        "print(fastpersist.integrations.accelerate.is_enabled(accelerator))\n")
    assert out.split() == ["True"]


def test_documented_deepspeed_and_lightning_names_resolve_after_import_fastpersist_alone():
    out = _fresh(
        "import sys, fastpersist\n"
        "print('lightning' in sys.modules, 'deepspeed' in sys.modules)\n"  # nothing imported yet
        "print(callable(fastpersist.integrations.deepspeed.enable),\n"
        "      fastpersist.integrations.lightning.FastPersistCheckpointIO.__name__,\n"
        "      fastpersist.dcp.FastPersistWriter.__name__)\n"
        "try:\n"
        "    fastpersist.integrations.nope\n"
        "except AttributeError as e:\n"
        "    print('AttributeError', e)\n")
    lines = out.splitlines()
    assert lines[0] == "False False"
    assert lines[1] == "True FastPersistCheckpointIO FastPersistWriter"
    assert lines[2].startswith("AttributeError") and "nope" in lines[2]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("writer", ["torch", "fastpersist"])
def test_load_model_of_a_torch_file_loads_it(tmp_path, writer):
    """``fastpersist.load_model(model, "x.pt")`` answered with a safetensors header error
    (a torch zip read as safetensors); a torch state-dict file now loads."""
    src = _model()
    p = tmp_path / "x.pt"
    (torch.save if writer == "torch" else fastpersist.save)(src.state_dict(), p)
    dst = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    assert fastpersist.load_model(dst, str(p)) == (set(), [])
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v)
    wrong = torch.nn.Linear(4, 8)
    with pytest.raises(RuntimeError, match="Missing|Unexpected|missing|unexpected"):
        fastpersist.load_model(wrong, str(p))


def test_load_model_of_a_training_checkpoint_names_load_state_dict(tmp_path):
    p = tmp_path / "epoch=0.ckpt"
    torch.save({"state_dict": _model().state_dict(), "epoch": 0}, p)
    with pytest.raises(ValueError, match=r"load_state_dict\(model, path, key='state_dict'\)"):
        fastpersist.load_model(_model(), str(p))
    out = fastpersist.load_state_dict(_model(), p, key="state_dict")  # what the message says works
    assert not out.missing_keys and not out.unexpected_keys
