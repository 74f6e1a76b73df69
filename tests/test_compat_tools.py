"""tools/compat (the upstream suites rerun with fastpersist substituted): the substitution
must reach every process a suite starts, or a "fastpersist" run tests stock code."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

COMPAT = Path(__file__).resolve().parent.parent / "tools" / "compat"


def test_dcp_substitution_reaches_a_fresh_interpreter(tmp_path):
    """DCP's 2-rank tests spawn their ranks (multiprocessing ``spawn``: fresh interpreters
    that load no pytest plugin). With the PYTHONPATH ``tools/compat/dcp.sh`` sets in its
    ``fastpersist`` mode, such an interpreter imports the stock names as fastpersist's
    classes, as the upstream test module does."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(COMPAT / "dcp_spawn"), str(COMPAT)] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    code = textwrap.dedent("""
        from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
        from torch.distributed.checkpoint import _storage_utils, filesystem
        from fastpersist.dcp import FastPersistReader, FastPersistWriter
        assert FileSystemWriter is FastPersistWriter and FileSystemReader is FastPersistReader
        assert filesystem.FileSystemWriter is FastPersistWriter and _storage_utils.FileSystemReader is FastPersistReader
        print("substituted")
    """)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "substituted", out.stderr
