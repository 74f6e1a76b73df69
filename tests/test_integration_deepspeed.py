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
from functools import partial

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install deepspeed)")
torch = pytest.importorskip("torch")

from subprocs import free_ports, side_by_side  # noqa: E402 (tests/ is on sys.path)

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


def _stock_checks(root: str, stage: int, ckpt: str, port: int = 0) -> None:
    """Stock DeepSpeed and zero_to_fp32.py, in a process without fastpersist."""
    out = _run([sys.executable, "-c", STOCK_LOAD, root, str(stage), ckpt, str(port or _free_port())], _env(), root)
    assert "STOCK-OK" in out.stdout, out.stdout[-3000:]


def _one_process(stage: int, root: str, ports: tuple[int, int]) -> dict:
    """The single-process worker of ``stage`` in ``root``, then the stock checks of its checkpoint;
    the worker's results."""
    _run([sys.executable, HERE, "--worker", "single", str(stage), root, str(ports[0])], _env(), root)
    with open(os.path.join(root, "rank0.json")) as f:
        res = json.load(f)
    _stock_checks(root, stage, os.path.join(root, "fp"), ports[1])
    return res


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory) -> dict:
    """:func:`_one_process` of every stage, each in a folder of its own, side by side (a DeepSpeed
    start is seconds of imports); ``one_process_runs[stage].result()``."""
    ports = free_ports(2 * len(STAGES))
    calls = [partial(_one_process, stage, str(tmp_path_factory.mktemp(f"stage{stage}")), tuple(ports[2 * i:2 * i + 2]))
             for i, stage in enumerate(STAGES)]
    return dict(zip(STAGES, side_by_side(calls)))


@pytest.mark.parametrize("stage", STAGES)
def test_one_process(stage, one_process_runs):
    _check_results(one_process_runs[stage].result(), stage, world=1)


@pytest.mark.parametrize("stage", [1, 3])
def test_two_processes(stage, tmp_path):
    root = str(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), HERE, "--worker", "multi", str(stage), root, "0"]
    _run(cmd, _env(), root)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for res in results:
        _check_results(res, stage, world=2)
    from fastpersist.replicated import group_save_available

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


def _clone(x):
    """A deep copy of the tensors in nested dicts/lists/tuples (other leaves as they are)."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    return x


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

    def optim_state(eng):
        return _clone(eng.optimizer.state_dict())

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
    # The results are written and every rank passed the last barrier: leave without
    # finalizing the interpreter. torch's gloo worker thread (ProcessGroupGloo::runLoop) can
    # free a tensor while Python finalizes; taking the GIL then ends the thread with a forced
    # unwind and std::terminate aborts the rank ("terminate called without an active
    # exception", issue 24 case 5: torch's, pytorch/pytorch PR 179291; backtrace in
    # docs/reliability.md). fastpersist's own threads were not involved.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


DECOUPLED_COMMIT_FAILURE = r"""
import os, sys, threading, types
import torch
from fastpersist import asyncsave
from fastpersist.integrations.deepspeed import FastPersistCheckpointEngine

root = sys.argv[1]
tag_dir = os.path.join(root, "step1")
real = asyncsave._finish
real_wait = asyncsave.SaveFuture.wait
bad_seen = threading.Event()
both_started = threading.Event()
def wait(self, timeout=None):
    try:
        return real_wait(self, timeout)
    finally:
        if self.path.endswith("bad.pt"):
            bad_seen.set()  # commit has collected the failed save's error
def finish(job):
    if job.future.path.endswith("bad.pt"):
        # Fails only once good.pt's save started: a save_async raises an earlier failure
        # nobody collected yet, so failing sooner would fail good.pt's save itself.
        assert both_started.wait(120)
        os.remove(job.tmp)  # its rename fails (ENOENT)
    else:
        assert bad_seen.wait(120)  # still pending when commit has seen the first one fail
    real(job)
asyncsave.SaveFuture.wait = wait
asyncsave._finish = finish
eng = FastPersistCheckpointEngine(None, decoupled=True)
info = types.SimpleNamespace(save_dir=root, tag="step1", save_latest=True)
eng.create(info)
eng.makedirs(tag_dir, exist_ok=True)  # as DeepSpeed does (a new tag: written in place)
eng.save({"w": torch.zeros(4)}, os.path.join(tag_dir, "bad.pt"))
eng.save({"w": torch.ones(4)}, os.path.join(tag_dir, "good.pt"))
both_started.set()
try:
    eng.commit(info)
except OSError as e:
    print("RAISED", type(e).__name__, "bad.pt" in str(e))
print("GOOD-SETTLED", os.path.exists(os.path.join(tag_dir, "good.pt")), asyncsave.pending_paths() == [])
print("LATEST", os.path.exists(os.path.join(root, "latest")))
"""


def test_decoupled_commit_waits_for_every_save_before_raising(tmp_path):
    """A failed decoupled save makes commit raise, but only after every other pending save of the
    checkpoint settled (none renames files of the tag after commit reported), and 'latest' stays."""
    out = _run([sys.executable, "-c", DECOUPLED_COMMIT_FAILURE, str(tmp_path)], _env(), str(tmp_path))
    assert "RAISED FileNotFoundError True" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "GOOD-SETTLED True True" in out.stdout, out.stdout
    assert "LATEST False" in out.stdout, out.stdout


# ------------------------------------------------------------------ saving again into an existing tag
# A save under a tag whose directory exists (a fixed tag; Lightning's DeepSpeedStrategy, whose tag is
# always "checkpoint") is staged beside it and swapped in at commit: a SIGKILL or an error part-way
# leaves the previous checkpoint exactly as it was, and a complete save leaves exactly its own files.

STALE = "zero_pp_rank_7_mp_rank_00_optim_states.pt"  # a partition of another world size: stale in B


def _tree_hashes(directory) -> dict:
    import hashlib

    out = {}
    for base, _dirs, files in os.walk(directory):
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _leftovers(directory) -> list:
    return sorted(n for n in os.listdir(directory) if n.startswith(".fastpersist-"))


def _run_killed(root: str, route: str, port: int = 0) -> None:
    """Run the 'kill' child: it saves A, then blocks inside the next save into the same tag (the
    model-states file of B written, the ZeRO partition about to be); SIGKILL it there."""
    from subprocess_kill import sigkill_when_blocked  # tests/ is on sys.path (rootdir conftest)

    sigkill_when_blocked([sys.executable, HERE, "--overwrite", "kill", route, root, str(port or _free_port())], root,
                         _env(), 400)


def _ckpt_of(root: str, route: str) -> tuple:
    """(save_dir, tag) of the route: engine.save_checkpoint(tag='last'), or Lightning's strategy."""
    return (os.path.join(root, "last.ckpt"), "checkpoint") if route == "lightning" else (os.path.join(root, "ck"), "last")


def _killed_then_resumed(route: str, root: str, ports: tuple) -> dict:
    """The 'kill' child of ``route`` in ``root``; what it left (the tag's file hashes, ``latest``,
    the hidden staging names), then the 'resume' child's results."""
    _run_killed(root, route, ports[0])
    save_dir, tag = _ckpt_of(root, route)
    with open(os.path.join(save_dir, "latest")) as f:
        left = {"hashes": _tree_hashes(os.path.join(save_dir, tag)), "latest": f.read(),
                "staged": _leftovers(save_dir)}  # the killed save's files, hidden; the next save removes them
    _run([sys.executable, HERE, "--overwrite", "resume", route, root, str(ports[1])], _env(), root)
    with open(os.path.join(root, "resume.json")) as f:
        left["resume"] = json.load(f)
    return left


@pytest.fixture(scope="module")
def overwrite_routes(tmp_path_factory) -> dict:
    """:func:`_killed_then_resumed` of each route (Lightning's where it is installed), each in a
    folder of its own, side by side; ``overwrite_routes[route]`` is (folder, future)."""
    import importlib.util

    routes = ["engine"] + (["lightning"] if importlib.util.find_spec("lightning") is not None else [])
    roots = [str(tmp_path_factory.mktemp(f"overwrite-{r}")) for r in routes]
    ports = free_ports(2 * len(routes))
    calls = [partial(_killed_then_resumed, r, root, tuple(ports[2 * i:2 * i + 2]))
             for i, (r, root) in enumerate(zip(routes, roots))]
    return dict(zip(routes, zip(roots, side_by_side(calls))))


@pytest.mark.parametrize("route", ["engine", "lightning"])
def test_sigkill_during_save_into_existing_tag(route, overwrite_routes):
    """Two saves under one tag (a fixed tag; or Lightning's DeepSpeedStrategy.save_checkpoint, tag
    'checkpoint'), the second SIGKILLed part-way: the tag directory holds exactly the first save's
    files, byte for byte; load_checkpoint restores the first save's values; the next save under the
    tag succeeds, leaves no staging directory and loads back."""
    if route == "lightning":
        pytest.importorskip("lightning", reason="lightning is not installed")
    root, fut = overwrite_routes[route]
    left = fut.result()
    _save_dir, tag = _ckpt_of(root, route)
    with open(os.path.join(root, "a.json")) as f:
        a = json.load(f)
    assert left["hashes"] == a["hashes"]
    assert left["latest"] == tag
    from fastpersist import dircommit

    staged = left["staged"]
    assert len(staged) == 1 and staged[0].startswith(dircommit.staging_name(tag, "")), staged
    res = left["resume"]
    assert res == {"loaded_a": True, "leftovers_after": [], "files": a["files"], "loaded_c": True,
                   "hashes_changed": True}, res


class BlockWhilePickled:
    """Pickled inside a save (its temporary file open): says so with the file ``root/blocked``,
    then sleeps until the test SIGKILLs the process."""

    def __init__(self, root: str) -> None:
        self.root = root

    def __reduce__(self):
        import time

        open(os.path.join(self.root, "blocked"), "w").close()
        time.sleep(600)
        return (str, ("",))  # not reached


def test_sigkill_during_save_into_new_tag_leaves_no_temp_behind(tmp_path):
    """Issue 33, case 3: a save_checkpoint into a new tag SIGKILLed while writing its ZeRO file
    left global_step2/.fp-tmp-... that no later save (into other tags) removed. The next
    save_checkpoint, into another tag, removes it; 'latest' named the previous tag meanwhile."""
    from subprocess_kill import sigkill_when_blocked  # tests/ is on sys.path (rootdir conftest)

    root = str(tmp_path)
    sigkill_when_blocked([sys.executable, HERE, "--overwrite", "kill-new", "engine", root, str(_free_port())],
                         root, _env(), 400)
    _run([sys.executable, HERE, "--overwrite", "resume-new", "engine", root, str(_free_port())], _env(), root)
    res = json.loads((tmp_path / "resume-new.json").read_text())
    assert len(res["temps_before"]) == 1, res
    assert res == {"temps_before": res["temps_before"], "latest_before": "global_step1", "temps_after": [],
                   "latest_after": "global_step3"}, res


def test_error_during_save_into_existing_tag(tmp_path):
    """An ENOSPC on one file of the second save under a tag: save_checkpoint raises it, the tag
    directory holds exactly the first save's files, no staging directory is left, load_checkpoint
    restores the first save; the next save succeeds."""
    root = str(tmp_path)
    _run([sys.executable, HERE, "--overwrite", "error", "engine", root, str(_free_port())], _env(), root)
    res = json.loads((tmp_path / "error.json").read_text())
    assert res == {"raised": "ENOSPC", "unchanged": True, "leftovers": [], "latest": "last", "loaded_a": True,
                   "after_c": {"leftovers": [], "loaded_c": True}}, res


def test_overwrite_leaves_exactly_the_new_save(tmp_path):
    """A complete second save under a tag: the directory holds exactly its files (a stale partition
    of the first is gone; a user's file is kept), no staging directory; load_checkpoint restores it.
    Decoupled: until the commit at the next step the tag directory is still the first save."""
    root = str(tmp_path)
    _run([sys.executable, HERE, "--overwrite", "overwrite", "engine", root, str(_free_port())], _env(), root)
    res = json.loads((tmp_path / "overwrite.json").read_text())
    assert res["files_b"] == ["mp_rank_00_model_states.pt", "notes.txt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert res["notes"] == "user notes" and res["leftovers_b"] == [] and res["loaded_b"], res
    assert res["16bit"] == {"tag_dir_kept": True, "leftovers": [], "model": True}, res["16bit"]
    assert res["decoupled"] == {"before_commit_is_a": True, "staged": True, "after_commit_changed": True,
                                "leftovers": [], "loaded": True}, res["decoupled"]


def test_latest_replaced_atomically_once_after_the_commit(tmp_path):
    """``latest`` is replaced (a new file renamed over it) once per save, after the tag directory is
    committed, never rewritten in place: with every file write failing from the commit's return on
    (as a process killed there), the save succeeds and ``latest`` names the new tag, where DeepSpeed's
    own rewrite (truncate, then write) would leave it empty. A hard link to the previous ``latest``
    keeps the previous tag. ``save_latest=False`` (by position or keyword) and a failed save leave it
    untouched. Decoupled: ``latest`` names a tag only from that tag's commit on (the next step, the
    next save, ``destroy``). The bytes are those of a stock DeepSpeed save (no newline)."""
    root = str(tmp_path)
    _run([sys.executable, HERE, "--overwrite", "latest", "engine", root, str(_free_port())], _env(), root)
    res = json.loads((tmp_path / "latest.json").read_text())
    assert res["stock"] == ["TorchCheckpointEngine", "t1"], res
    assert res["same_bytes"] is True, res
    assert res["t2"] == {"result": "ok", "seen": [["before", "t1"], ["after", "t2"]], "latest": "t2",
                         "old_file": "t1", "new_inode": True}, res["t2"]
    assert res["failed"] == "ENOSPC", res
    assert res["kept"] == {"latest": "t2", "same_inode": True, "tags": ["t1", "t2", "t3", "t4", "t5"]}, res["kept"]
    assert res["decoupled"] == {"written": None, "step": "ok", "seen": [["before", None], ["after", "t1"]],
                                "same_bytes": True, "t2": ["t1", True], "t3": "t1", "t4": "t3",
                                "destroyed": "t4"}, res["decoupled"]


def test_two_processes_error_then_overwrite(tmp_path):
    """2 ranks (gloo), ZeRO-1, fixed tag: an ENOSPC on rank 1's partition of the second save makes
    both ranks raise, the tag directory stays the first save; a third save replaces it (a stale
    partition of another world size is gone) and both ranks load it back."""
    root = str(tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), HERE, "--overwrite", "multi", "engine", root, "0"]
    _run(cmd, _env(), root, timeout=400)
    for rank in range(2):
        res = json.loads((tmp_path / f"multi{rank}.json").read_text())
        assert res == {"raised": "OSError ENOSPC" if rank == 1 else "RuntimeError [1]", "unchanged": True,
                       "leftovers": [], "loaded_a": True, "files_c": ["mp_rank_00_model_states.pt",
                                                                       "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                                                       "zero_pp_rank_1_mp_rank_00_optim_states.pt"],
                       "leftovers_c": [], "loaded_c": True}, (rank, res)


def _overwrite_worker(mode: str, route: str, root: str, port: str) -> None:
    import datetime
    import errno

    import deepspeed
    import deepspeed.comm as dist

    import fastpersist
    from fastpersist import dircommit
    from fastpersist.integrations import deepspeed as fpd

    if mode != "multi":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=90))
    rank, world = dist.get_rank(), dist.get_world_size()
    save_dir, tag = _ckpt_of(root, route)
    tag_dir = os.path.join(save_dir, tag)

    def engine(stage=1, decoupled=False, fast=True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        cfg = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
               "zero_optimization": {"stage": stage}}
        eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        if fast:
            fpd.enable(eng, decoupled=decoupled)
        return eng

    def train(eng, steps=1, seed=0):
        torch.manual_seed(100 + 10 * seed + rank)
        for _ in range(steps):
            loss = eng(torch.randn(4 // world, 8)).pow(2).mean()
            eng.backward(loss)
            eng.step()

    def state(eng):
        return _clone({"weights": eng.module.state_dict(), "optim": eng.optimizer.state_dict()})

    def save(eng, marker, where=None):
        sd, tg = (save_dir, tag) if where is None else where
        if route == "lightning":
            from lightning.pytorch.strategies import DeepSpeedStrategy

            class Strategy:  # what DeepSpeedStrategy.save_checkpoint reads of itself (it needs CUDA to run whole)
                deepspeed_engine = eng
                zero_stage_3 = False
                _multi_device = False
                is_global_zero = True
                exclude_frozen_parameters = False

                @staticmethod
                def broadcast(obj, src=0):
                    return obj

            ckpt = {"epoch": 0, "global_step": eng.global_steps, "state_dict": {}, "optimizer_states": [],
                    "marker": marker}
            DeepSpeedStrategy.save_checkpoint(Strategy(), ckpt, sd)
        else:
            eng.save_checkpoint(sd, tag=tg, client_state={"marker": marker})

    def loads(want, marker, stage=1, where=None):
        sd, tg = (save_dir, tag) if where is None else where
        fresh = engine(stage)
        train(fresh, seed=9)  # move away from the saved state
        path, client = fresh.load_checkpoint(sd, tag=None if where is None else tg)
        ok = path is not None and client.get("marker") == marker and _same(want, state(fresh))
        fresh.destroy()
        return ok

    def fail_at(name, on_rank=0):
        real = fastpersist.save

        def failing(obj, path, **kw):
            if os.path.basename(os.fspath(path)) == name and rank == on_rank:
                raise OSError(errno.ENOSPC, "No space left on device (injected)", os.fspath(path))
            return real(obj, path, **kw)

        fastpersist.save = failing
        return lambda: setattr(fastpersist, "save", real)

    out: dict = {}
    zero_file = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    if mode == "kill":
        eng = engine()
        train(eng, 2)
        save(eng, "A")
        torch.save(state(eng), os.path.join(root, "expected_a.pt"))
        hashes = _tree_hashes(tag_dir)
        with open(os.path.join(root, "a.json"), "w") as f:
            json.dump({"hashes": hashes, "files": sorted(hashes)}, f)
        train(eng, seed=1)
        real = fastpersist.save

        def blocking(obj, path, **kw):
            if os.path.basename(os.fspath(path)) == zero_file:
                open(os.path.join(root, "blocked"), "w").close()
                import time
                time.sleep(600)  # the parent SIGKILLs us here
            return real(obj, path, **kw)

        fastpersist.save = blocking
        save(eng, "B")
        sys.exit(3)  # not reached
    elif mode == "kill-new":  # SIGKILLed inside the write of a file into a new tag's directory
        eng = engine()
        train(eng, 2)
        save(eng, "A", where=(save_dir, "global_step1"))
        train(eng, seed=1)
        real = fastpersist.save

        def blocking(obj, path, **kw):
            if os.path.basename(os.fspath(path)) == zero_file:
                obj = {"state": obj, "blocker": BlockWhilePickled(root)}  # blocks with the temp file open
            return real(obj, path, **kw)

        fastpersist.save = blocking
        save(eng, "B", where=(save_dir, "global_step2"))
        sys.exit(3)  # not reached
    elif mode == "resume-new":
        from fastpersist.commit import TMP_MARKER

        def temps():
            return sorted(n for n in os.listdir(os.path.join(save_dir, "global_step2")) if TMP_MARKER in n)

        out["temps_before"] = temps()
        out["latest_before"] = open(os.path.join(save_dir, "latest")).read()
        eng = engine()
        eng.load_checkpoint(save_dir)
        train(eng, seed=2)
        save(eng, "C", where=(save_dir, "global_step3"))
        out["temps_after"] = temps()
        out["latest_after"] = open(os.path.join(save_dir, "latest")).read()
    elif mode == "resume":
        want_a = torch.load(os.path.join(root, "expected_a.pt"), weights_only=False)
        out["loaded_a"] = loads(want_a, "A")
        before = _tree_hashes(tag_dir)
        eng = engine()
        eng.load_checkpoint(save_dir)
        train(eng, seed=2)
        save(eng, "C")
        want_c = state(eng)
        out["leftovers_after"] = _leftovers(save_dir)
        out["files"] = sorted(_tree_hashes(tag_dir))
        out["hashes_changed"] = all(before[k] != v for k, v in _tree_hashes(tag_dir).items())
        out["loaded_c"] = loads(want_c, "C")
    elif mode == "error":
        eng = engine()
        train(eng, 2)
        save(eng, "A")
        want_a, before = state(eng), _tree_hashes(tag_dir)
        train(eng, seed=1)
        undo = fail_at(zero_file)
        try:
            save(eng, "B")
            out["raised"] = None
        except OSError as e:
            out["raised"] = errno.errorcode.get(e.errno)
        undo()
        out["unchanged"] = _tree_hashes(tag_dir) == before
        out["leftovers"] = _leftovers(save_dir)
        out["latest"] = open(os.path.join(save_dir, "latest")).read()
        out["loaded_a"] = loads(want_a, "A")
        train(eng, seed=2)
        save(eng, "C")
        want_c = state(eng)
        out["after_c"] = {"leftovers": _leftovers(save_dir), "loaded_c": loads(want_c, "C")}
    elif mode == "overwrite":
        eng = engine(stage=1)
        train(eng, 2)
        save(eng, "A")
        with open(os.path.join(tag_dir, "notes.txt"), "w") as f:
            f.write("user notes")
        with open(os.path.join(tag_dir, STALE), "wb") as f:  # as if a 8-rank run had saved here before
            f.write(b"stale partition")
        eng.destroy()
        eng = engine(stage=1)
        train(eng, 3, seed=1)
        save(eng, "B")
        want_b = state(eng)
        out["files_b"] = sorted(os.listdir(tag_dir))
        out["notes"] = open(os.path.join(tag_dir, "notes.txt")).read()
        out["leftovers_b"] = _leftovers(save_dir)
        out["loaded_b"] = loads(want_b, "B")
        # save_16bit_model writes beside the tag directories (its tag, global_stepN, names none of
        # its files): an existing global_stepN directory there is left alone.
        s16 = os.path.join(root, "s16")
        eng.save_checkpoint(s16)
        step_dir = os.path.join(s16, f"global_step{eng.global_steps}")
        before = _tree_hashes(step_dir)
        eng.save_16bit_model(s16)
        out["16bit"] = {"tag_dir_kept": _tree_hashes(step_dir) == before, "leftovers": _leftovers(s16),
                        "model": os.path.isfile(os.path.join(s16, "pytorch_model.bin"))}
        eng.destroy()
        # Decoupled: background writes, commit (and the swap) at the next step boundary.
        dec_dir = os.path.join(root, "dec")
        dec = engine(stage=1, decoupled=True)
        train(dec, 2)
        dec.save_checkpoint(dec_dir, tag="last", client_state={"marker": "A"})
        train(dec, seed=1)  # commits A
        a_hashes = _tree_hashes(os.path.join(dec_dir, "last"))
        train(dec, seed=2)
        dec.save_checkpoint(dec_dir, tag="last", client_state={"marker": "B"})
        want = state(dec)
        for fut in list(dec.checkpoint_engine._pending):
            fut.wait()  # the files are written; not committed yet
        d = {"before_commit_is_a": _tree_hashes(os.path.join(dec_dir, "last")) == a_hashes,
             "staged": any(n.startswith(dircommit.staging_name("last", "")) for n in os.listdir(dec_dir))}
        train(dec, seed=3)  # DeepSpeed commits the decoupled checkpoint before this step's update
        after = _tree_hashes(os.path.join(dec_dir, "last"))
        d["after_commit_changed"] = sorted(after) == sorted(a_hashes) and all(a_hashes[k] != after[k] for k in after)
        d["leftovers"] = _leftovers(dec_dir)
        dec.destroy()
        d["loaded"] = loads(want, "B", where=(dec_dir, None))
        out["decoupled"] = d
    elif mode == "latest":
        _latest_checks(out, root, engine, train, fail_at, zero_file)
    elif mode == "multi":
        eng = engine()
        train(eng, 2)
        save(eng, "A")
        dist.barrier()
        if rank == 0:
            with open(os.path.join(tag_dir, STALE), "wb") as f:
                f.write(b"stale partition")
        dist.barrier()
        want_a, before = state(eng), _tree_hashes(tag_dir)
        train(eng, seed=1)
        undo = fail_at(zero_file, on_rank=1)
        try:
            save(eng, "B")
            out["raised"] = None
        except OSError as e:
            out["raised"] = f"OSError {errno.errorcode.get(e.errno)}"
        except RuntimeError as e:
            out["raised"] = "RuntimeError [1]" if "rank(s) [1]" in str(e) else repr(e)
        undo()
        dist.barrier()
        out["unchanged"] = _tree_hashes(tag_dir) == before
        out["leftovers"] = _leftovers(save_dir)
        out["loaded_a"] = loads(want_a, "A")
        train(eng, seed=2)
        save(eng, "C")
        want_c = state(eng)
        dist.barrier()
        out["files_c"] = sorted(os.listdir(tag_dir))
        out["leftovers_c"] = _leftovers(save_dir)
        out["loaded_c"] = loads(want_c, "C")
    name = f"{mode}{rank}.json" if mode == "multi" else f"{mode}.json"
    with open(os.path.join(root, name), "w") as f:
        json.dump(out, f)


def _latest_checks(out: dict, root: str, engine, train, fail_at, zero_file: str) -> None:  # noqa: ANN001
    """The ``latest`` mode of :func:`_overwrite_worker`: what ``latest`` holds around each commit,
    non-decoupled and decoupled, where every file write after a commit fails (as if the process
    died there): a rewrite of ``latest`` in place would leave it empty."""
    import contextlib
    import errno
    import resource
    import signal

    def latest(save_dir):
        path = os.path.join(save_dir, "latest")
        return open(path).read() if os.path.exists(path) else None

    def raw(save_dir):
        with open(os.path.join(save_dir, "latest"), "rb") as f:
            return f.read()

    def inode(path):
        return os.stat(path).st_ino

    def attempt(call):
        try:
            call()
            return "ok"
        except OSError as e:
            return errno.errorcode.get(e.errno, repr(e))

    @contextlib.contextmanager
    def writes_fail_after_commit(eng, seen):
        """From the return of the checkpoint engine's commit on, every write to a file fails
        (RLIMIT_FSIZE 0: EFBIG; SIGXFSZ ignored); ``seen``: ``latest`` before and after each commit."""
        ce = eng.checkpoint_engine
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

        def commit(info):
            seen.append(["before", latest(info.save_dir)])
            ok = type(ce).commit(ce, info)
            seen.append(["after", latest(info.save_dir)])
            resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
            return ok

        ce.commit = commit
        old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, old)
            del ce.commit

    stock = engine(fast=False)  # DeepSpeed's own checkpoint engine: the bytes of its `latest`
    train(stock)
    stock.save_checkpoint(os.path.join(root, "stock"), tag="t1")
    stock_bytes = raw(os.path.join(root, "stock"))
    out["stock"] = [type(stock.checkpoint_engine).__name__, stock_bytes.decode("latin-1")]
    stock.destroy()

    fp = os.path.join(root, "fp")
    eng = engine()
    train(eng)
    eng.save_checkpoint(fp, tag="t1")
    out["same_bytes"] = raw(fp) == stock_bytes
    os.link(os.path.join(fp, "latest"), os.path.join(fp, "latest.t1"))  # the file `latest` was before the save
    train(eng, seed=1)
    seen: list = []
    with writes_fail_after_commit(eng, seen):
        result = attempt(lambda: eng.save_checkpoint(fp, tag="t2"))
    out["t2"] = {"result": result, "seen": seen, "latest": latest(fp),
                 "old_file": open(os.path.join(fp, "latest.t1")).read(),
                 "new_inode": inode(os.path.join(fp, "latest")) != inode(os.path.join(fp, "latest.t1"))}
    before = inode(os.path.join(fp, "latest"))
    eng.save_checkpoint(fp, "t3", {}, False)  # save_latest=False by position
    eng.save_checkpoint(fp, tag="t4", save_latest=False)
    undo = fail_at(zero_file)
    out["failed"] = attempt(lambda: eng.save_checkpoint(fp, tag="t5"))
    undo()
    out["kept"] = {"latest": latest(fp), "same_inode": inode(os.path.join(fp, "latest")) == before,
                   "tags": sorted(n for n in os.listdir(fp) if n.startswith("t"))}
    eng.destroy()

    dec_dir = os.path.join(root, "dec")
    dec = engine(decoupled=True)
    train(dec)
    d: dict = {}
    seen = []
    with writes_fail_after_commit(dec, seen):
        dec.save_checkpoint(dec_dir, tag="t1")
        for fut in list(dec.checkpoint_engine._pending):
            fut.wait()  # its files are written; not committed yet
        d["written"] = latest(dec_dir)
        d["step"] = attempt(lambda: train(dec, seed=1))  # DeepSpeed commits t1 before this step's update
    d["seen"] = seen
    d["same_bytes"] = raw(dec_dir) == stock_bytes
    before = inode(os.path.join(dec_dir, "latest"))
    dec.save_checkpoint(dec_dir, tag="t2", save_latest=False)
    train(dec, seed=2)
    d["t2"] = [latest(dec_dir), inode(os.path.join(dec_dir, "latest")) == before]
    dec.save_checkpoint(dec_dir, tag="t3")
    d["t3"] = latest(dec_dir)
    dec.save_checkpoint(dec_dir, tag="t4")  # commits t3 first
    d["t4"] = latest(dec_dir)
    dec.destroy()  # commits t4
    d["destroyed"] = latest(dec_dir)
    out["decoupled"] = d


if __name__ == "__main__" and "--overwrite" in sys.argv:
    i = sys.argv.index("--overwrite")
    _overwrite_worker(*sys.argv[i + 1:i + 5])
    # The results are written and every rank passed the last barrier: leave without
    # finalizing the interpreter. torch's gloo worker thread (ProcessGroupGloo::runLoop) can
    # free a tensor while Python finalizes; taking the GIL then ends the thread with a forced
    # unwind and std::terminate aborts the rank ("terminate called without an active
    # exception", issue 24 case 5: torch's, pytorch/pytorch PR 179291; backtrace in
    # docs/reliability.md). fastpersist's own threads were not involved.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


NO_EXCHANGE = r"""
import errno, json, os, sys, types
import torch
import fastpersist
from fastpersist.integrations import deepspeed as fpd

root = sys.argv[1]
tag_dir = os.path.join(root, "last")
calls = []
A, B = "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"

def refuse(a, b):
    calls.append((a, b))
    raise OSError(errno.EINVAL, "Invalid argument", a, None, b)

fastpersist.dircommit.exchange_paths = refuse
eng = fpd.FastPersistCheckpointEngine(None)

def save(value, names):
    # what DeepSpeed's save_checkpoint does with its checkpoint engine (one rank)
    info = types.SimpleNamespace(save_dir=root, tag="last", save_latest=True)
    eng.create(info)
    eng.makedirs(tag_dir, exist_ok=True)
    for name in names:
        eng.save({"w": torch.full((4,), value)}, os.path.join(tag_dir, name))
    eng.commit(info)

def state():
    return {n: fastpersist.load(os.path.join(tag_dir, n))["w"][0].item() for n in sorted(os.listdir(tag_dir))}

def leftovers():
    return sorted(n for n in os.listdir(root) if n.startswith(".fastpersist-"))

out = {}
save(1.0, [A, B])
save(2.0, [A])  # B (a partition the new save does not write) goes with the old copy
out["fallback"] = {"calls": len(calls), "state": state(), "leftovers": leftovers()}
# Killed between the two renames: no tag directory, its previous copy moved aside.
os.rename(tag_dir, os.path.join(root, ".fastpersist-old-last-0123456789abcdef"))
real = fastpersist.save
def failing(obj, path, **kw):
    raise OSError(errno.ENOSPC, "injected", os.fspath(path))
fastpersist.save = failing
try:
    save(3.0, [A])
    out["raised"] = False
except OSError as e:
    out["raised"] = e.errno == errno.ENOSPC
fastpersist.save = real
out["recovered"] = {"state": state(), "leftovers": leftovers(), "latest": open(os.path.join(root, "latest")).read()}
print("RESULT", json.dumps(out, sort_keys=True))
"""


def test_existing_tag_without_rename_exchange(tmp_path):
    """Where the filesystem refuses RENAME_EXCHANGE (EINVAL), the previous tag directory is moved
    aside, the new one renamed in, the old one removed. A save killed between the two renames
    (simulated: only the moved-aside copy exists) is recovered by the next save into the tag, before
    it writes: here that save fails, and the tag directory holds the previous checkpoint again."""
    out = _run([sys.executable, "-c", NO_EXCHANGE, str(tmp_path)], _env(), str(tmp_path))
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, out.stdout + out.stderr[-3000:]
    res = json.loads(line[-1][len("RESULT "):])
    assert res == {"fallback": {"calls": 1, "state": {"mp_rank_00_model_states.pt": 2.0}, "leftovers": []},
                   "raised": True, "recovered": {"state": {"mp_rank_00_model_states.pt": 2.0}, "leftovers": [],
                                                 "latest": "last"}}, res
