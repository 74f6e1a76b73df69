"""tools/compat (the upstream suites rerun with fastpersist substituted): the substitution
must reach every process a suite starts, or a "fastpersist" run tests stock code.

Each test runs the suite's own script on a stand-in for the upstream test tree: one test
module that starts a worker with multiprocessing's ``spawn`` (a fresh interpreter that loads
no pytest plugin, as DCP's 2-rank tests and Lightning's ``ddp_spawn`` Trainers do) and
checks, in the worker, what the upstream tests would get there.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict

COMPAT = Path(__file__).resolve().parent.parent / "tools" / "compat"

#: The stand-in test module: ``worker()`` runs CHECK in a spawned interpreter and writes
#: what it returns to a file; the test compares that with EXPECTED.
PROBE = '''
import multiprocessing
import os


def worker(out):
{check}
    with open(out, "w") as f:
        f.write(result)


def test_spawned_worker(tmp_path):
    out = tmp_path / "worker"
    process = multiprocessing.get_context("spawn").Process(target=worker, args=(str(out),))
    process.start()
    process.join(240)
    assert process.exitcode == 0
    assert out.read_text() == {expected!r}
'''


def _run_suite_script(tmp_path: Path, script: str, mode: str, files: Dict[str, str]) -> None:
    """Write ``files`` (relative path -> text) under SCRATCH, run ``tools/compat/SCRIPT``
    in ``mode`` on it and assert that every test of its junit file passed."""
    scratch = tmp_path / "scratch"
    for name, text in files.items():
        (scratch / name).parent.mkdir(parents=True, exist_ok=True)
        (scratch / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTPERSIST_COMPAT")}
    out = subprocess.run(["bash", str(COMPAT / script), str(scratch), mode], env=env,
                         capture_output=True, text=True, timeout=600)
    suite = script.split(".")[0]
    junit = scratch / "results" / f"{suite}-{mode}.xml"
    assert junit.exists(), out.stdout + out.stderr
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    failed = [c for c in cases if any(child.tag in ("failure", "error", "skipped") for child in c)]
    assert cases and not failed, out.stdout + out.stderr


def _probe(check: str, expected: str) -> str:
    return PROBE.format(check=textwrap.indent(textwrap.dedent(check), "    "), expected=expected)


def test_dcp_substitution_reaches_a_spawned_rank(tmp_path):
    """``dcp.sh fastpersist``: a spawned rank imports DCP's stock names as fastpersist's
    classes, as the upstream test module does in its 2-rank tests' ranks."""
    check = """
        from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
        from torch.distributed.checkpoint import _storage_utils, filesystem
        from fastpersist.dcp import FastPersistReader, FastPersistWriter
        result = str((FileSystemWriter is FastPersistWriter, FileSystemReader is FastPersistReader,
                      filesystem.FileSystemWriter is FastPersistWriter,
                      _storage_utils.FileSystemReader is FastPersistReader))
    """
    _run_suite_script(tmp_path, "dcp.sh", "fastpersist", {
        "dcp/test_file_system_checkpoint_cpu.py": _probe(check, str((True,) * 4)),
    })


def test_lightning_substitution_reaches_a_ddp_spawn_worker(tmp_path):
    """``lightning.sh fastpersist-sync``: in a spawned worker (where a ``ddp_spawn``
    Trainer's strategy makes its default CheckpointIO) the default is fastpersist's, with
    the mode's ``async_save``. Without the plugin in the worker it was Lightning's stock
    ``TorchCheckpointIO``."""
    check = """
        from lightning.pytorch.strategies import SingleDeviceStrategy
        io = SingleDeviceStrategy("cpu").checkpoint_io
        result = f"{type(io).__module__}.{type(io).__name__} async_save={getattr(io, 'async_save', None)}"
    """
    expected = "fastpersist.integrations.lightning.FastPersistCheckpointIO async_save=False"
    root = "lightning/tests/tests_pytorch/"
    _run_suite_script(tmp_path, "lightning.sh", "fastpersist-sync", {
        root + "conftest.py": "",
        root + "checkpointing/test_probe.py": _probe(check, expected),
        root + "plugins/test_checkpoint_io_plugin.py": "",
        root + "trainer/connectors/test_checkpoint_connector.py": "",
    })
