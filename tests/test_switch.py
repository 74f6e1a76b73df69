"""FASTPERSIST_PATCH_TORCH_SAVE=1 with no code change: the start-up hook installed with
the package (``fastpersist-startup.pth`` -> ``_fastpersist_startup``) patches
``torch.save``/``torch.load`` right after ``import torch`` in a process that never
imports fastpersist, and costs no torch import when the variable is unset.

Proof that fastpersist wrote the file: its ``.storage_alignment`` record says 4096
(``torch.save`` writes 64) and every payload starts at a multiple of 4096.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastpersist.integrations import _startup

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("_fastpersist_startup") is None,
    reason="start-up hook not installed (source tree without pip install)",
)

CHILD = r"""
import json, struct, sys, zipfile
import torch
path = sys.argv[1]
torch.save({"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)}, path)
with open(path, "rb") as f, zipfile.ZipFile(f) as z:
    record = [z.read(n).decode() for n in z.namelist() if n.endswith(".storage_alignment")]
    mods = []
    for info in z.infolist():
        if "/data/" in info.filename and not info.filename.endswith("serialization_id"):
            f.seek(info.header_offset)
            n, e = struct.unpack("<HH", f.read(30)[26:30])
            mods.append((info.header_offset + 30 + n + e) % 4096)
back = torch.load(path)
assert torch.equal(back["w"], torch.arange(1000, dtype=torch.float32))
imported = sorted(m for m in sys.modules if m == "fastpersist" or m.startswith("fastpersist."))
print(json.dumps({"record": record, "mods": mods, "fastpersist_imported": bool(imported),
                  "patched": hasattr(torch.save, "_fastpersist_original"),
                  "hook": sys.modules["_fastpersist_startup"].state if "_fastpersist_startup" in sys.modules else None}))
"""


def run_child(tmp_path: Path, **env: str) -> dict:
    full = {k: v for k, v in os.environ.items() if not k.startswith("FASTPERSIST_")}
    full.update(env)
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "x.pt")], env=full, capture_output=True,
                       text=True, timeout=180, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_switch_patches_torch_save_without_importing_fastpersist(tmp_path: Path) -> None:
    out = run_child(tmp_path, FASTPERSIST_PATCH_TORCH_SAVE="1")
    assert out["patched"] and out["hook"]["torch_patched"] and not out["hook"]["errors"], out
    assert out["record"] == ["4096"] and set(out["mods"]) == {0}, out
    # the child never imported fastpersist itself: the hook did, after torch
    assert out["fastpersist_imported"]


@pytest.mark.parametrize("value", [None, "0", "off"])
def test_switch_off_leaves_torch_alone(tmp_path: Path, value: str) -> None:
    out = run_child(tmp_path, **({} if value is None else {"FASTPERSIST_PATCH_TORCH_SAVE": value}))
    assert not out["patched"] and not out["fastpersist_imported"], out
    assert out["record"] == ["64"], out  # torch's own writer


def test_startup_costs_no_torch_import() -> None:
    """With the variable unset (and set), interpreter start-up imports no torch and no fastpersist."""
    for env in ({}, {"FASTPERSIST_PATCH_TORCH_SAVE": "1"}):
        full = {k: v for k, v in os.environ.items() if not k.startswith("FASTPERSIST_")}
        full.update(env)
        r = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], env=full, capture_output=True,
                           text=True, timeout=60)
        names = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
        assert "_fastpersist_startup" in names, names
        assert not [n for n in names if n in ("torch", "fastpersist", "lightning", "typing")], names


def test_hook_table_matches_config_parser() -> None:
    from fastpersist.config import _FALSE, _TRUE

    assert set(_startup._TRUE) == set(_TRUE) and set(_startup._FALSE) == set(_FALSE)


def _pth_child(tmp_path: Path, **env: str) -> "subprocess.CompletedProcess[str]":
    """An interpreter without site-packages that processes only our .pth file, whose
    module ``_fastpersist_startup`` is then missing (as after deleting an editable checkout)."""
    import shutil
    import subprocess
    import sys

    site_dir = tmp_path / "site"
    site_dir.mkdir(exist_ok=True)
    shutil.copy(Path(__file__).resolve().parents[1] / "integrations" / "fastpersist-startup.pth", site_dir)
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("FASTPERSIST_")}
    child_env.update(env)
    return subprocess.run(
        [sys.executable, "-S", "-c", f"import site; site.addsitedir({str(site_dir)!r}); print('alive')"],
        capture_output=True, text=True, env=child_env, timeout=60,
    )


def test_missing_hook_module_is_silent_without_a_switch(tmp_path: Path) -> None:
    got = _pth_child(tmp_path)
    assert got.returncode == 0 and got.stdout.strip() == "alive"
    assert got.stderr == ""  # no traceback from site at every interpreter start


def test_missing_hook_module_says_so_when_a_switch_is_on(tmp_path: Path) -> None:
    got = _pth_child(tmp_path, FASTPERSIST_PATCH_TORCH_SAVE="1")
    assert got.returncode == 0 and got.stdout.strip() == "alive"
    assert "start-up hook did not load" in got.stderr and "_fastpersist_startup" in got.stderr
    assert "Traceback" not in got.stderr
