"""The DLIO benchmark's PyTorch checkpoint workload through the switch (issue 27).

DLIO writes each checkpoint file with ``with open(name, "wb") as f: torch.save(state, f)``.
With ``FASTPERSIST_PATCH_TORCH_SAVE=1`` those files must be fastpersist's (byte for
byte what ``fastpersist.save`` writes to a path) and load with stock ``torch.load``.

Skipped unless ``dlio_benchmark`` and ``mpi4py`` (with an MPI library it can load)
import in this environment and ``mpirun`` is on PATH (``pip install dlio-benchmark
mpi4py mpich``; docs/benchmarks.md). DLIO 2.0.0 imports tensorflow and DALI at module
level even for ``framework: pytorch``; where they are not installed, the run gets a
stand-in module (in a ``sitecustomize`` of its own) that raises on any use, which the
PyTorch checkpoint path never makes.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fastpersist

PROBE = "import dlio_benchmark.main, mpi4py; from mpi4py import MPI; MPI.Get_library_version()"

STUB = '''
import importlib.abc, importlib.machinery, sys, types
class _Stub:
    def __init__(self, name): self._name = name
    def __getattr__(self, a):
        if a.startswith("__"): raise AttributeError(a)
        return _Stub(self._name + "." + a)
    def __call__(self, *a, **k): raise RuntimeError(self._name + " is a stand-in: not installed")
    def __mro_entries__(self, bases): return (object,)
class _Mod(types.ModuleType):
    def __getattr__(self, a):
        if a.startswith("__"): raise AttributeError(a)
        return _Stub(self.__name__ + "." + a)
class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ROOTS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec):
        m = _Mod(spec.name); m.__path__ = []; return m
    def exec_module(self, module): pass
if ROOTS:
    sys.meta_path.insert(0, _Finder())
'''

WORKLOAD = """
model: fp_dlio_tiny
framework: pytorch
workflow: {{generate_data: False, train: True, checkpoint: True}}
dataset:
  data_folder: {data}
  format: npz
  num_files_train: 2
  num_samples_per_file: 2
  record_length: 64
  record_length_stdev: 0
reader: {{data_loader: pytorch, batch_size: 1, read_threads: 1}}
train: {{epochs: 1, computation_time: 0.0}}
checkpoint:
  checkpoint_folder: {ckpt}
  steps_between_checkpoints: 1
  type: all_ranks
  model_size: 300000
  optimization_groups: [100000]
  num_layers: 2
  layer_parameters: [20000]
"""


def _missing_roots(env: dict) -> list[str]:
    roots = []
    for mod in ("tensorflow", "nvidia.dali"):
        r = subprocess.run([sys.executable, "-c", f"import {mod}"], env=env, capture_output=True)
        if r.returncode != 0:
            roots.append(mod.split(".")[0])
    return roots


def _dlio_env(tmp_path: Path) -> dict:
    env = dict(os.environ)
    if shutil.which("mpirun", path=env.get("PATH")) is None:
        pytest.skip("no mpirun on PATH (pip install mpich)")
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        if "dlio_benchmark" in r.stderr and "No module named" in r.stderr and "tensorflow" not in r.stderr:
            pytest.skip("dlio-benchmark is not installed")
        if "mpi4py" in r.stderr and "No module named" in r.stderr:
            pytest.skip("mpi4py is not installed")
        if "MPI library" in r.stderr:
            pytest.skip("mpi4py cannot load an MPI library")
    roots = _missing_roots(env)
    if roots:
        stub = tmp_path / "stub"
        stub.mkdir()
        (stub / "sitecustomize.py").write_text(f"ROOTS = {tuple(roots)!r}\n" + textwrap.dedent(STUB))
        env["PYTHONPATH"] = os.pathsep.join([str(stub)] + [p for p in [env.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        pytest.skip(f"DLIO or MPI not usable here: {r.stderr.strip().splitlines()[-1:]}")
    return env


def _run_dlio(env: dict, conf: Path, out: Path, *overrides: str) -> None:
    cmd = ["mpirun", "-n", "2", sys.executable, "-m", "dlio_benchmark.main", "--config-dir", str(conf),
           "workload=fp_dlio_tiny", f"hydra.run.dir={out}", *overrides]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_dlio_checkpoints_through_the_switch(tmp_path: Path) -> None:
    env = _dlio_env(tmp_path)
    data, ckpt, conf = tmp_path / "data", tmp_path / "ckpt", tmp_path / "conf"
    (conf / "workload").mkdir(parents=True)
    (conf / "workload" / "fp_dlio_tiny.yaml").write_text(WORKLOAD.format(data=data, ckpt=ckpt))
    _run_dlio(env, conf, tmp_path / "gen", "++workload.workflow.generate_data=True",
              "++workload.workflow.train=False", "++workload.workflow.checkpoint=False")
    env["FASTPERSIST_PATCH_TORCH_SAVE"] = "1"
    _run_dlio(env, conf, tmp_path / "run")

    def zeros(n: int) -> torch.Tensor:  # DLIO's tensors: torch.randint(high=1, dtype=int8)
        return torch.zeros(n, dtype=torch.int8)

    states = {
        "model": {"a": zeros(300000)},
        "optimizer": {"0": {"a": zeros(100000), "b": zeros(100000)}, "combined": zeros(100000)},
        "layer": {"0": zeros(20000)},
    }
    files = sorted(glob.glob(str(ckpt / "*.pt")))
    # 2 ranks x 2 steps x (model + optimizer + 2 layers)
    assert len(files) == 16, files
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    expected = {}
    for kind, state in states.items():
        fastpersist.save(state, ref_dir / f"{kind}.pt")
        expected[kind] = (ref_dir / f"{kind}.pt").read_bytes()
    for f in files:
        kind = os.path.basename(f).split("-")[0]
        assert Path(f).read_bytes() == expected[kind], f
        _assert_same(torch.serialization.load(f, weights_only=True), states[kind])


def _assert_same(a: object, b: object) -> None:
    if isinstance(b, dict):
        assert isinstance(a, dict) and a.keys() == b.keys()
        for k in b:
            _assert_same(a[k], b[k])
    else:
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and torch.equal(a, b)
