"""DeepSpeed adapter (fastpersist.integrations.deepspeed): the checkpoint engine at
every ZeRO stage that DeepSpeed runs on CPU (0, 1, 2 and 3, gloo), 1 process and
2 processes.

Each run trains the same tiny model twice, once with DeepSpeed's own checkpoint
engine and once with fastpersist's, saves both, and checks: every file of the two
checkpoints holds the same objects; fastpersist wrote its files (spy on
``fastpersist.save``, and the bytes: ``.storage_alignment`` of 4096 or more in the
zip, where torch.save writes 64, and ``fastpersist.verify``); ``latest`` appears only
after commit; ``load_checkpoint`` through the engine restores the state. Then stock
DeepSpeed in a process that never imports fastpersist loads the checkpoint, and
DeepSpeed's ``zero_to_fp32.py`` (the copy saved beside it, unchanged) converts it.

DeepSpeed runs in subprocesses (``DS_ACCELERATOR=cpu``): its global state (process
groups, accelerator) does not survive several engines with different settings in
one pytest process. On CPU DeepSpeed builds one small communication op with the
C++ compiler at first use (cached in ~/.cache/torch_extensions).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install deepspeed)")
torch = pytest.importorskip("torch")

HERE = os.path.abspath(__file__)
STAGES = [0, 1, 2, 3]  # all four run on CPU with DeepSpeed 0.19 (gloo, torch Adam)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    for var in ("FASTPERSIST_DEEPSPEED", "FASTPERSIST_PATCH_TORCH_SAVE", "FASTPERSIST_ACCELERATE"):
        env.pop(var, None)
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def _run(cmd: list, env: dict, cwd: str, timeout: int = 500) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert out.returncode == 0, out.stdout[-4000:] + "\n" + out.stderr[-8000:]
    return out


def _stock_checks(root: str, stage: int, ckpt: str) -> None:
    """Stock DeepSpeed and zero_to_fp32.py, in a process without fastpersist."""
    out = _run([sys.executable, "-c", STOCK_LOAD, root, str(stage), ckpt, str(_free_port())], _env(), root)
    assert "STOCK-OK" in out.stdout, out.stdout[-3000:]


@pytest.mark.parametrize("stage", STAGES)
def test_one_process(stage, tmp_path):
    root = str(tmp_path)
    _run([sys.executable, HERE, "--worker", "single", str(stage), root, str(_free_port())], _env(), root)
    res = json.loads((tmp_path / "rank0.json").read_text())
    _check_results(res, stage, world=1)
    _stock_checks(root, stage, os.path.join(root, "fp"))


@pytest.mark.parametrize("stage", [1, 3])
def test_two_processes(stage, tmp_path):
    root = str(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), HERE, "--worker", "multi", str(stage), root, "0"]
    _run(cmd, _env(), root)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for res in results:
        _check_results(res, stage, world=2)
    from fastpersist.integrations._replicated import group_save_available

    for rank, res in enumerate(results):
        saves = {name: grouped for name, grouped in res["saves"]}
        # ZeRO partitions: each rank writes its own, alone.
        assert saves[f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"] is False
        if stage < 3 and group_save_available():
            assert saves["mp_rank_00_model_states.pt"] is True  # replicated: both ranks write it together
        if stage == 3:
            assert saves[f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"] is False
    _stock_checks(root, stage, os.path.join(root, "fp"))


def test_env_switch_through_startup_hook(tmp_path):
    """FASTPERSIST_DEEPSPEED=1 and no fastpersist code, where the start-up hook calls
    install_from_env() when deepspeed.runtime.engine loads."""
    import importlib.util

    if importlib.util.find_spec("_fastpersist_startup") is None:
        pytest.skip("the start-up hook (fastpersist-startup.pth) is not installed in this environment")
    code = "from deepspeed.runtime.engine import DeepSpeedEngine as E; " \
           "print(hasattr(E._configure_checkpointing, '_fastpersist_original'))"
    out = _run([sys.executable, "-c", code], _env(FASTPERSIST_DEEPSPEED="1"), str(tmp_path))
    assert out.stdout.strip().splitlines()[-1:] == ["True"], (out.stdout, out.stderr)


def test_env_parsing(monkeypatch):
    from fastpersist.integrations import deepspeed as fpd

    monkeypatch.delenv("FASTPERSIST_DEEPSPEED", raising=False)
    monkeypatch.delenv("FASTPERSIST_PATCH_TORCH_SAVE", raising=False)
    assert fpd.env_enabled() is False
    monkeypatch.setenv("FASTPERSIST_PATCH_TORCH_SAVE", "1")
    assert fpd.env_enabled() is True
    monkeypatch.setenv("FASTPERSIST_DEEPSPEED", "off")
    assert fpd.env_enabled() is False
    monkeypatch.setenv("FASTPERSIST_DEEPSPEED", "2")
    with pytest.raises(ValueError, match="FASTPERSIST_DEEPSPEED"):
        fpd.env_enabled()


def _check_results(res: dict, stage: int, world: int) -> None:
    assert res["engine"] == "FastPersistCheckpointEngine"
    assert res["same_as_stock"], res
    assert res["files"] and all(res["written_by_fastpersist"].values()), res["written_by_fastpersist"]
    if world == 1:
        assert set(res["files"]) <= {name for name, _ in res["saves"]}
    assert res["latest_after_commit"], res
    assert res["loaded_equal"], res
    if "decoupled" in res:
        assert res["decoupled"] == {"latest_before_step": False, "latest_after_step": True, "same_as_stock": True,
                                    "written_by_fastpersist": True}, res["decoupled"]


STOCK_LOAD = textwrap.dedent("""
    import os, runpy, sys, torch
    root, stage, ckpt, port = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    sys.path.insert(0, os.path.dirname(root))
    expected = torch.load(os.path.join(root, "expected_fp32.pt"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    cfg = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    assert type(engine.checkpoint_engine).__name__ == "TorchCheckpointEngine"
    world = int(open(os.path.join(root, "world")).read())
    if world == 1:  # (a 2-rank ZeRO checkpoint needs 2 ranks or elastic_checkpoint to load)
        path, client = engine.load_checkpoint(ckpt)
        assert path is not None and client["marker"] == 42, client
        if stage == 3:
            import deepspeed as ds
            with ds.zero.GatheredParameters(list(engine.module.parameters())):
                got = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        else:
            got = engine.module.state_dict()
        assert all(torch.equal(got[k].float(), expected[k]) for k in expected), "weights differ"
    # every file loads with plain torch.load
    tag = open(os.path.join(ckpt, "latest")).read()
    for name in os.listdir(os.path.join(ckpt, tag)):
        torch.load(os.path.join(ckpt, tag, name), weights_only=False)
    if stage > 0:
        out = os.path.join(root, "fp32_out")
        sys.argv = ["zero_to_fp32.py", ckpt, out]
        runpy.run_path(os.path.join(ckpt, "zero_to_fp32.py"), run_name="__main__")
        sd = torch.load(os.path.join(out, "pytorch_model.bin"))
        assert sd.keys() == expected.keys(), (sd.keys(), expected.keys())
        assert all(torch.equal(sd[k], expected[k]) for k in expected), "zero_to_fp32 output differs"
    assert "fastpersist" not in sys.modules, "fastpersist was imported"
    print("STOCK-OK")
""")


# ------------------------------------------------------------------ worker side


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if a is None or type(a).__module__ == "builtins":
        return a == b
    return type(a) is type(b)  # DeepSpeed config objects and the like: same kind


def _written_by_fastpersist(path: str) -> bool:
    import zipfile

    import fastpersist

    if fastpersist.verify(path).status != "ok":
        return False
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if n.endswith("/.storage_alignment")]
        return len(names) == 1 and int(z.read(names[0])) >= 4096


def _worker(mode: str, stage: int, root: str, port: str) -> None:
    import shutil

    import deepspeed
    import deepspeed.comm as dist

    import fastpersist
    from fastpersist.integrations import deepspeed as fpd

    if mode == "single":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    saves: list = []
    real_save = fastpersist.save

    def spy(obj, path, **kw):
        saves.append((os.path.basename(os.fspath(path)), kw.get("group") is not None))
        return real_save(obj, path, **kw)

    fastpersist.save = spy

    def engine():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        cfg = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
               "zero_optimization": {"stage": stage}}
        eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        return eng

    def train(eng, steps=3):
        torch.manual_seed(100 + rank)
        for _ in range(steps):
            loss = eng(torch.randn(4 // world, 8)).pow(2).mean()
            eng.backward(loss)
            eng.step()

    def full_weights(eng):
        if stage == 3:
            with deepspeed.zero.GatheredParameters(list(eng.module.parameters())):
                return {k: v.detach().clone() for k, v in eng.module.state_dict().items()}
        return {k: v.detach().clone() for k, v in eng.module.state_dict().items()}

    def clone(x):
        if isinstance(x, torch.Tensor):
            return x.detach().clone()
        if isinstance(x, dict):
            return {k: clone(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(clone(v) for v in x)
        return x

    def optim_state(eng):
        return clone(eng.optimizer.state_dict())

    dirs = {k: os.path.join(root, k) for k in ("stock", "fp", "dec")}
    # Stock DeepSpeed engine.
    stock = engine()
    train(stock)
    stock.save_checkpoint(dirs["stock"], client_state={"marker": 42})
    expected = full_weights(stock)
    if rank == 0:
        torch.save(expected, os.path.join(root, "expected_fp32.pt"))
        with open(os.path.join(root, "world"), "w") as f:
            f.write(str(world))
    stock.destroy()

    # fastpersist: enable() before initialize (multi), install_from_env (stage 0), enable(engine) otherwise.
    if mode == "multi":
        fpd.enable()
    elif stage == 0:
        os.environ["FASTPERSIST_DEEPSPEED"] = "1"
        assert fpd.install_from_env() is True
    eng = engine()
    if mode == "single" and stage != 0:
        fpd.enable(eng)
    res: dict = {"engine": type(eng.checkpoint_engine).__name__}
    train(eng)
    # latest must not exist before commit: record at commit time.
    ce = eng.checkpoint_engine
    seen = {}
    real_commit = ce.commit

    def commit(info):
        seen["latest_before"] = os.path.exists(os.path.join(info.save_dir, "latest"))
        ok = real_commit(info)
        seen["latest_after"] = open(os.path.join(info.save_dir, "latest")).read() if rank == 0 else info.tag
        return ok

    ce.commit = commit
    eng.save_checkpoint(dirs["fp"], client_state={"marker": 42})
    res["latest_after_commit"] = seen == {"latest_before": False, "latest_after": "global_step3"}
    res["saves"] = list(saves)
    tag = "global_step3"
    files = sorted(os.listdir(os.path.join(dirs["fp"], tag)))
    res["files"] = files
    res["written_by_fastpersist"] = {f: _written_by_fastpersist(os.path.join(dirs["fp"], tag, f)) for f in files}
    same = sorted(os.listdir(os.path.join(dirs["stock"], tag))) == files
    for f in files:
        a = torch.load(os.path.join(dirs["stock"], tag, f), weights_only=False)
        b = torch.load(os.path.join(dirs["fp"], tag, f), weights_only=False)
        same = same and _same(a, b)
    res["same_as_stock"] = same
    want_weights, want_optim = full_weights(eng), optim_state(eng)
    eng.destroy()

    # Load through the engine into a fresh one (fastpersist engine), compare.
    fresh = engine()
    fpd.enable(fresh)
    path, client = fresh.load_checkpoint(dirs["fp"])
    res["loaded_equal"] = (path is not None and client.get("marker") == 42 and _same(want_weights, full_weights(fresh))
                           and _same(want_optim, optim_state(fresh)))

    # Decoupled (background writes, commit at the next step boundary).
    if mode == "single" and hasattr(fastpersist, "save_async"):
        dec = engine()
        fpd.enable(dec, decoupled=True)
        train(dec)
        dec.save_checkpoint(dirs["dec"], client_state={"marker": 42})
        d = {"latest_before_step": os.path.exists(os.path.join(dirs["dec"], "latest"))}
        train(dec, steps=1)  # DeepSpeed commits the decoupled checkpoint before this step's update
        d["latest_after_step"] = os.path.exists(os.path.join(dirs["dec"], "latest"))
        dfiles = sorted(os.listdir(os.path.join(dirs["dec"], tag)))
        d["same_as_stock"] = dfiles == files and all(
            _same(torch.load(os.path.join(dirs["stock"], tag, f), weights_only=False),
                  torch.load(os.path.join(dirs["dec"], tag, f), weights_only=False)) for f in files)
        d["written_by_fastpersist"] = all(_written_by_fastpersist(os.path.join(dirs["dec"], tag, f)) for f in dfiles)
        res["decoupled"] = d
        dec.destroy()
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    shutil.rmtree(dirs["dec"], ignore_errors=True) if rank == 0 else None


if __name__ == "__main__" and "--worker" in sys.argv:
    i = sys.argv.index("--worker")
    _worker(sys.argv[i + 1], int(sys.argv[i + 2]), sys.argv[i + 3], sys.argv[i + 4])


DECOUPLED_COMMIT_FAILURE = r"""
import os, sys, time, types
import torch
from fastpersist import asyncsave
from fastpersist.integrations.deepspeed import FastPersistCheckpointEngine

root = sys.argv[1]
tag_dir = os.path.join(root, "step1")
os.makedirs(tag_dir)
real = asyncsave._finish
def finish(job):
    if job.future.path.endswith("bad.pt"):
        os.remove(job.tmp)  # its rename fails (ENOENT)
    else:
        time.sleep(0.5)  # still pending when the first one has failed
    real(job)
asyncsave._finish = finish
eng = FastPersistCheckpointEngine(None, decoupled=True)
info = types.SimpleNamespace(save_dir=root, tag="step1", save_latest=True)
eng.create(info)
eng.save({"w": torch.zeros(4)}, os.path.join(tag_dir, "bad.pt"))
eng.save({"w": torch.ones(4)}, os.path.join(tag_dir, "good.pt"))
try:
    eng.commit(info)
except OSError as e:
    print("RAISED", type(e).__name__, "bad.pt" in str(e))
print("GOOD-SETTLED", os.path.exists(os.path.join(tag_dir, "good.pt")), asyncsave._jobs == type(asyncsave._jobs)())
print("LATEST", os.path.exists(os.path.join(root, "latest")))
"""


def test_decoupled_commit_waits_for_every_save_before_raising(tmp_path):
    """A failed decoupled save makes commit raise, but only after every other pending save of the
    checkpoint settled (none renames files of the tag after commit reported), and 'latest' stays."""
    out = _run([sys.executable, "-c", DECOUPLED_COMMIT_FAILURE, str(tmp_path)], _env(), str(tmp_path))
    assert "RAISED FileNotFoundError True" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "GOOD-SETTLED True True" in out.stdout, out.stdout
    assert "LATEST False" in out.stdout, out.stdout
