"""DeepSpeed turned on from its own JSON config (issue 23 case 12): a top-level
``"fastpersist"`` key, read by fastpersist's start-up hook, which wraps
``DeepSpeedEngine._configure_checkpointing``.

Each check runs a real DeepSpeed engine on CPU (``DS_ACCELERATOR=cpu``, gloo, one
process) in a subprocess whose script never imports fastpersist: the JSON file given
to ``deepspeed.initialize(config=path)`` is all the user writes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from functools import partial

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install deepspeed)")
pytest.importorskip("torch")

from subprocs import free_ports, side_by_side  # noqa: E402 (tests/ is on sys.path)

if importlib.util.find_spec("_fastpersist_startup") is None:  # pragma: no cover - source checkout
    pytest.skip("the start-up hook (fastpersist-startup.pth) is not installed in this environment",
                allow_module_level=True)

SCRIPT = textwrap.dedent("""
    import json, os, sys, zipfile
    import torch
    cfg_path, save_dir, port = sys.argv[1], sys.argv[2], sys.argv[3]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    try:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg_path)
    except ValueError as e:
        print("RESULT " + json.dumps({"error": str(e)}))
        sys.exit(0)
    out = {"engine": type(engine.checkpoint_engine).__name__,
           "fastpersist_imported": "fastpersist" in sys.modules}
    loss = engine(torch.randn(4, 8)).sum()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(save_dir, tag="t1")
    path = os.path.join(save_dir, "t1", "mp_rank_00_model_states.pt")
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if n.endswith("/.storage_alignment")]
        out["alignment"] = int(z.read(names[0])) if names else None
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    with torch.no_grad():
        for p in engine.module.parameters():
            p.zero_()
    engine.load_checkpoint(save_dir, tag="t1")
    out["restored"] = all(torch.equal(before[k], v) for k, v in engine.module.state_dict().items())
    print("RESULT " + json.dumps(out))
""")


def _run(d, port: int, section, **env_extra: str) -> dict:
    cfg = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_optimization": {"stage": 1}}
    if section is not None:
        cfg["fastpersist"] = section
    cfg_path = d / "ds_config.json"
    cfg_path.write_text(json.dumps(cfg))
    env = {k: v for k, v in os.environ.items()
           if k not in ("FASTPERSIST_DEEPSPEED", "FASTPERSIST_PATCH_TORCH_SAVE", "FASTPERSIST_ACCELERATE")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **env_extra)
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(cfg_path), str(d / "ckpt"), str(port)],
                         env=env, capture_output=True, text=True, timeout=400, cwd=str(d))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, out.stdout[-3000:] + out.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT "):])


#: the engines of the tests below: (config's "fastpersist" section, extra environment)
RUNS: dict[str, tuple] = {
    "on": ({"enabled": True}, {}),
    "true": (True, {}),
    "no key": (None, {}),
    "off over env": ({"enabled": False}, {"FASTPERSIST_DEEPSPEED": "1"}),
    "unknown field": ({"enabled": True, "decouple": True}, {}),
}


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict:
    """Every engine of :data:`RUNS`, each in a process and a folder of its own, run side by side
    (a DeepSpeed start is seconds of imports); ``engines[name].result()`` is the run's
    outcome, or raises its failure."""
    ports = free_ports(len(RUNS))
    calls = [partial(_run, tmp_path_factory.mktemp("ds"), port, section, **env)
             for port, (section, env) in zip(ports, RUNS.values())]
    return dict(zip(RUNS, side_by_side(calls)))


def test_config_key_turns_fastpersist_on(engines):
    res = engines["on"].result()
    assert res["engine"] == "FastPersistCheckpointEngine", res
    assert res["alignment"] == 4096, res  # written by fastpersist (torch.save writes 64)
    assert res["restored"] is True, res


def test_config_key_true_shorthand_and_no_key_is_stock(engines):
    assert engines["true"].result()["engine"] == "FastPersistCheckpointEngine"
    res = engines["no key"].result()
    assert res["engine"] == "TorchCheckpointEngine", res
    assert res["fastpersist_imported"] is False, res  # the hook costs nothing without the key
    assert res["alignment"] == 64, res


def test_config_key_false_wins_over_env_variable(engines):
    res = engines["off over env"].result()
    assert res["engine"] == "TorchCheckpointEngine", res


def test_config_key_unknown_field_raises(engines):
    res = engines["unknown field"].result()
    assert "unknown key" in res.get("error", "") and "decouple" in res["error"], res


def test_config_settings_parsing():
    from fastpersist.integrations import deepspeed as fpd

    assert fpd.config_settings({"train_batch_size": 1}) is None
    s = fpd.config_settings({"fastpersist": {"decoupled": True, "config": {"threads": 2}}})
    assert s is not None and s["enabled"] is True and s["decoupled"] is True and s["split_replicated"] is True
    assert s["config"].threads == 2
    assert fpd.config_settings({"fastpersist": False})["enabled"] is False
    for bad in ("yes", {"enabled": "yes"}, {"config": 3}, {"config": {"no_such_field": 1}}):
        with pytest.raises(ValueError, match="fastpersist"):
            fpd.config_settings({"fastpersist": bad})
