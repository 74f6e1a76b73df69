"""Without CUDA tensors, fastpersist never initialises CUDA (issue 14).

Each check runs in a fresh interpreter (CUDA's state is per process and pytest's
may already have touched it) and ends with ``torch.cuda.is_initialized()``.
Initialising CUDA costs hundreds of milliseconds and GPU memory on GPU machines,
and breaks forked data-loader workers, so importing fastpersist, choosing an
engine, saving and loading CPU state must not do it, on CPU-only machines and on
GPU machines alike.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    d = sys.argv[1]
    steps = {}
    def step(name):
        steps[name] = torch.cuda.is_initialized()
    import fastpersist, fastpersist.io
    step("import")
    h = fastpersist.io.IOHandle(engine="auto")
    step("engine auto")
    fastpersist.io.cufile_status(); fastpersist.io.available_engines()
    fastpersist.io.gpu_path(d)
    step("cufile status / gpu_path")
    sd = {"w": torch.randn(64, 64), "b": torch.arange(10), "h": torch.ones(3).half(), "n": {"x": 1}}
    p = os.path.join(d, "a.pt")
    fastpersist.save(sd, p)
    step("save")
    out = fastpersist.load(p, weights_only=True)
    assert torch.equal(out["w"], sd["w"])
    fastpersist.load(p, map_location="cpu", weights_only=True)
    fastpersist.load(p, map_location={"cpu": "cpu"}, weights_only=True)
    fastpersist.load(p, map_location=lambda s, loc: s, weights_only=True)
    step("load")
    s = os.path.join(d, "a.safetensors")
    fastpersist.save({"w": sd["w"]}, s)
    fastpersist.load(s)
    step("safetensors")
    fastpersist.save_async(sd, os.path.join(d, "b.pt")).wait()
    fastpersist.save_async({"w": sd["w"]}, os.path.join(d, "b.safetensors")).wait()
    step("save_async")
    fastpersist.verify(p)
    step("verify")
    print("RESULT " + json.dumps(steps))
    """
)


def _run(tmp_path, script: str, *args: str) -> dict:
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path), *args], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_no_cuda_initialisation_without_cuda_tensors(tmp_path):
    steps = _run(tmp_path, _SCRIPT)
    assert steps and not any(steps.values()), steps


def test_no_cuda_initialisation_in_info(tmp_path):
    script = textwrap.dedent(
        """
        import sys, json, contextlib, io, torch
        from fastpersist import cli
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            cli.main(["info", "--dir", sys.argv[1]])
        print(buf.getvalue())
        print("RESULT " + json.dumps({"info": torch.cuda.is_initialized()}))
        """
    )
    import torch

    steps = _run(tmp_path, script)
    if torch.cuda.is_available():
        pytest.skip("info names the GPU (torch.cuda.get_device_name) on machines that have one")
    assert steps == {"info": False}
