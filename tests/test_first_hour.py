"""What a new user types first (issue 38), run as typed, each in a fresh process where the
point is what ``import fastpersist`` alone gives."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import fastpersist
from subprocs import run_all  # tests/ is on sys.path


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


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastpersist", *args], capture_output=True, text=True, timeout=300)


def _cli_all(commands: list[tuple[str, ...]]) -> list[subprocess.CompletedProcess]:
    """:func:`_cli` of each command, side by side (independent commands only)."""
    return run_all([[sys.executable, "-m", "fastpersist", *c] for c in commands], capture_output=True, text=True,
                   timeout=300)


def test_info_describes_checkpoint_files_and_folders(tmp_path):
    """``fastpersist info FILE`` answered "benchmark directory ... does not exist"; it now
    describes the checkpoint: format, writer, tensors, bytes, dtypes, checksum state; every
    line within 100 columns, the machine lines included."""
    good = tmp_path / "good"  # three checkpoints, described one by one and as a folder
    good.mkdir()
    sd = {"w": torch.randn(64, 32), "b": torch.zeros(10, dtype=torch.bfloat16), "i": torch.arange(3)}
    torch.save(sd, good / "t.pt")
    fastpersist.save(sd, good / "f.pt")
    fastpersist.save(sd, good / "f.safetensors")
    want = {"t.pt": ("torch zip, written by torch.save", "OK"), "f.pt": ("torch zip, written by fastpersist", "OK"),
            "f.safetensors": ("safetensors, written by fastpersist", "OK")}
    # a damaged file
    from fastpersist.formats.zipindex import read_zip_index

    e = next(e for e in read_zip_index(good / "f.pt").entries if e.name.endswith("data/0"))
    raw = bytearray((good / "f.pt").read_bytes())
    raw[e.data_offset + 5] ^= 0xFF  # a tensor byte
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / "bad.pt").write_bytes(raw)
    # the commands read and write nothing in common: they run side by side
    runs = _cli_all([("info", str(good / name)) for name in want] + [
        ("info", "--json", str(good / "f.pt")), ("info", str(good)), ("info", str(tmp_path / "damaged" / "bad.pt"))])
    for (name, (fmt, status)), r in zip(want.items(), runs):
        assert r.returncode == 0, r.stdout + r.stderr
        lines = r.stdout.splitlines()
        assert lines[0] == f"Checkpoint : {good / name}"
        assert lines[1].startswith(f"Format     : {fmt};")
        assert "Tensors    : 3, 8.04 KiB" in lines, lines  # 8192 + 20 + 24 bytes
        assert any(ln.startswith("Dtypes     : float32 1 (8") for ln in lines), lines
        assert lines[-1].startswith(f"Checksums  : {status}")
        assert all(len(ln) <= 100 for ln in lines)
    r = runs[3]
    data = __import__("json").loads(r.stdout)["checkpoints"][0]
    assert (data["writer"], data["tensors"], data["status"]) == ("fastpersist", 3, "ok")
    assert data["dtypes"] == {"float32": [1, 8192], "bfloat16": [1, 20], "int64": [1, 24]}
    # a folder: the storage lines, then each checkpoint from its index (checksums only with --verify)
    r = runs[4]
    assert r.returncode == 0, r.stderr
    assert "Directory  :" in r.stdout and r.stdout.count("Checkpoint : ") == 3 and "not checked" in r.stdout
    assert all(len(ln) <= 100 for ln in r.stdout.splitlines()), [ln for ln in r.stdout.splitlines() if len(ln) > 100]
    # the damaged file: CORRUPT, exit status 1
    r = runs[5]
    assert r.returncode == 1 and "CORRUPT" in r.stdout, r.stdout + r.stderr


def test_info_describes_a_dcp_checkpoint(tmp_path):
    import torch.distributed.checkpoint as dcp

    from fastpersist.dcp import FastPersistWriter

    dcp.save({"w": torch.ones(4, 4), "step": 3}, storage_writer=FastPersistWriter(str(tmp_path / "c")), no_dist=True)
    r = _cli("info", str(tmp_path / "c"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "DCP directory, written by fastpersist" in r.stdout and "Tensors    : 1, 64 B" in r.stdout
    assert "Checksums  : OK" in r.stdout
