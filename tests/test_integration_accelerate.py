"""Accelerate adapter (fastpersist.integrations.accelerate): save_state/load_state
round trips through fastpersist with total_limit retention, on 1 process (in this
process) and 2 processes (torch.distributed.run, gloo on CPU); the result loads
with stock Accelerate in a process that never imports fastpersist.

Proof that fastpersist wrote every file (not a fallback): spies on fastpersist.save
and fastpersist.load, and the bytes of every file of the checkpoint: torch zip
files carry fastpersist's O_DIRECT alignment in ``.storage_alignment`` (torch.save:
64; fastpersist: 4096 or the device's block size) and verify; ``.safetensors``
files carry fastpersist's per-tensor CRCs (``fastpersist.verify`` says "ok", where a
safetensors-written file is "unchecked").
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from functools import partial

import pytest

accelerate = pytest.importorskip("accelerate")
torch = pytest.importorskip("torch")

import fastpersist  # noqa: E402
from subprocs import side_by_side  # noqa: E402 (tests/ is on sys.path)

HERE = os.path.abspath(__file__)
EXPECTED_FILES = {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl"}


class Counter:
    """A custom object registered for checkpointing."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, sd: dict) -> None:
        self.value = sd["value"]


def _build(project_dir: str, total_limit: int = 2, auto: bool = True):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    torch.manual_seed(0)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=project_dir, automatic_checkpoint_naming=auto, total_limit=total_limit))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched, counter


def _train_step(acc, model, opt, sched, counter) -> None:
    loss = model(torch.randn(4, 8)).pow(2).mean()
    acc.backward(loss)
    opt.step()
    sched.step()
    opt.zero_grad()
    counter.value += 1


def _snapshot(acc, model, opt, sched, counter) -> dict:
    return {
        "model": {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()},
        "opt": copy.deepcopy(opt.state_dict()),
        "sched": copy.deepcopy(sched.state_dict()),
        "counter": counter.value,
    }


def _same(a, b, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}/{i}")
    else:
        assert a == b, (path, a, b)


def _spy(monkeypatch, log: list) -> None:
    real_save, real_load, real_load_model = fastpersist.save, fastpersist.load, fastpersist.load_model

    def save(obj, path, **kw):
        log.append(("save", os.path.basename(os.fspath(path)), kw.get("group") is not None))
        return real_save(obj, path, **kw)

    def load(path, *a, **kw):
        log.append(("load", os.path.basename(os.fspath(path)), False))
        return real_load(path, *a, **kw)

    def load_model(model, path, *a, **kw):  # the model's safetensors file
        log.append(("load", os.path.basename(os.fspath(path)), False))
        return real_load_model(model, path, *a, **kw)

    monkeypatch.setattr(fastpersist, "save", save)
    monkeypatch.setattr(fastpersist, "load", load)
    monkeypatch.setattr(fastpersist, "load_model", load_model)


def written_by_fastpersist(path: str) -> bool:
    """Whether the file's bytes show fastpersist's writer (see the module docstring)."""
    if fastpersist.verify(path).status != "ok":
        return False
    if path.endswith(".safetensors"):
        return True
    import zipfile

    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if n.endswith("/.storage_alignment")]
        return len(names) == 1 and int(z.read(names[0])) >= 4096


def _all_verified(directory: str) -> None:
    for name in os.listdir(directory):
        assert written_by_fastpersist(os.path.join(directory, name)), name


def test_automatic_naming_without_project_dir_fails_like_stock(fresh_accelerate, tmp_path):
    """automatic_checkpoint_naming with no project_dir: stock save_state raises (it joins
    None with "checkpoints") before writing anything, even with an output_dir given; with the
    plugin on it raises the same and writes nothing either (it once saved into output_dir)."""
    errors = []
    for plugin in (False, True):
        acc, *_ = _build(None, total_limit=2)
        if plugin:
            fresh_accelerate.enable(acc)
        out = tmp_path / f"out-{plugin}"
        with pytest.raises(TypeError) as ei:
            acc.save_state(str(out))
        errors.append(str(ei.value))
        assert not out.exists()
    assert errors[0] == errors[1]


def test_round_trip_with_retention(fresh_accelerate, monkeypatch, tmp_path):
    fpa = fresh_accelerate
    log: list = []
    _spy(monkeypatch, log)
    acc, model, opt, sched, counter = _build(str(tmp_path / "proj"), total_limit=2)
    fpa.enable(acc)
    assert fpa.is_enabled(acc)

    # Retention: at the moment an old checkpoint is deleted, the new one is complete and verified.
    import shutil

    real_rmtree = shutil.rmtree
    deletions = []

    def rmtree(path, *a, **kw):
        ckpts = tmp_path / "proj" / "checkpoints"
        newest = max(ckpts.iterdir(), key=lambda p: int(p.name.split("_")[-1]))
        assert EXPECTED_FILES <= set(os.listdir(newest)), "deleting before the new checkpoint is complete"
        _all_verified(str(newest))
        deletions.append((os.path.basename(path), newest.name))
        return real_rmtree(path, *a, **kw)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    for _ in range(3):
        _train_step(acc, model, opt, sched, counter)
        acc.save_state()
    assert deletions == [("checkpoint_0", "checkpoint_2")]
    ckpts = tmp_path / "proj" / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["checkpoint_1", "checkpoint_2"]
    newest = ckpts / "checkpoint_2"
    assert set(os.listdir(newest)) == EXPECTED_FILES
    _all_verified(str(newest))
    saved = [name for op, name, _ in log if op == "save"]
    assert sorted(saved) == sorted(list(EXPECTED_FILES) * 3)

    expected = _snapshot(acc, model, opt, sched, counter)
    rng_after_save = torch.rand(3)

    # Scramble everything, then load.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    _train_step(acc, model, opt, sched, counter)
    counter.value = -1
    log.clear()
    acc.load_state(str(newest))
    assert sorted(name for op, name, _ in log if op == "load") == sorted(EXPECTED_FILES)
    _same(expected, _snapshot(acc, model, opt, sched, counter))
    assert torch.equal(torch.rand(3), rng_after_save)  # RNG state restored through fastpersist.load

    # Stock Accelerate, in a process that never imports fastpersist, loads it.
    torch.save(expected["model"], tmp_path / "expected_model.pt")
    _stock_load(str(newest), str(tmp_path / "expected_model.pt"), counter=expected["counter"])

    # disable(): back to Accelerate's own writers.
    fpa.disable(acc)
    assert not fpa.is_enabled(acc)
    log.clear()
    plain = acc.save_state()  # automatic naming: checkpoints/checkpoint_3
    assert log == []
    assert os.path.basename(plain) == "checkpoint_3"
    assert not any(written_by_fastpersist(os.path.join(plain, n)) for n in os.listdir(plain))


def test_bin_weights_and_stock_checkpoint_loads(fresh_accelerate, monkeypatch, tmp_path):
    """safe_serialization=False writes pytorch_model.bin through fastpersist; a stock
    checkpoint loads through the adapter."""
    fpa = fresh_accelerate
    acc, model, opt, sched, counter = _build(str(tmp_path / "proj"), total_limit=None, auto=False)
    _train_step(acc, model, opt, sched, counter)
    acc.save_state(str(tmp_path / "stock"))  # not enabled yet: Accelerate's own files
    expected = _snapshot(acc, model, opt, sched, counter)
    fpa.enable(acc)
    acc.save_state(str(tmp_path / "bin"), safe_serialization=False)
    assert "pytorch_model.bin" in os.listdir(tmp_path / "bin")
    _all_verified(str(tmp_path / "bin"))
    for source in ("stock", "bin"):
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        acc.load_state(str(tmp_path / source))
        _same(expected, _snapshot(acc, model, opt, sched, counter))


def test_install_from_env_class_level(fresh_accelerate, monkeypatch, tmp_path):
    fpa = fresh_accelerate
    from accelerate import Accelerator

    original = Accelerator.save_state, Accelerator.load_state
    try:
        monkeypatch.setenv("FASTPERSIST_ACCELERATE", "0")
        monkeypatch.setenv("FASTPERSIST_PATCH_TORCH_SAVE", "1")
        assert fpa.install_from_env() is False  # FASTPERSIST_ACCELERATE=0 wins
        monkeypatch.setenv("FASTPERSIST_ACCELERATE", "maybe")
        with pytest.raises(ValueError, match="FASTPERSIST_ACCELERATE"):
            fpa.install_from_env()
        monkeypatch.setenv("FASTPERSIST_ACCELERATE", "1")
        assert fpa.install_from_env() is True
        assert fpa.install_from_env() is True  # idempotent
        acc, model, opt, sched, counter = _build(str(tmp_path / "proj"), auto=False)
        assert fpa.is_enabled(acc)
        acc.save_state(str(tmp_path / "ck"))
        _all_verified(str(tmp_path / "ck"))
        fpa.disable(acc)
        assert not fpa.is_enabled(acc)
    finally:
        Accelerator.save_state, Accelerator.load_state = original
        fpa._class_enabled = False


def test_env_switch_through_startup_hook(tmp_path):
    """FASTPERSIST_ACCELERATE=1 with no fastpersist code, where the start-up hook
    watches accelerate (it calls install_from_env when accelerate.accelerator loads)."""
    import importlib.util

    if importlib.util.find_spec("_fastpersist_startup") is None:
        pytest.skip("the start-up hook (fastpersist-startup.pth) is not installed in this environment")
    code = textwrap.dedent("""
        import sys
        from accelerate import Accelerator
        print(hasattr(Accelerator.save_state, "_fastpersist_original"))
    """)
    env = dict(os.environ, FASTPERSIST_ACCELERATE="1")
    env.pop("FASTPERSIST_PATCH_TORCH_SAVE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True", (out.stdout, out.stderr)


STOCK_LOAD = textwrap.dedent("""
    import sys, torch
    from accelerate import Accelerator
    ckpt, expected_path, counter_value = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    class Counter:
        value = 0
        def state_dict(self): return {"value": self.value}
        def load_state_dict(self, sd): self.value = sd["value"]
    counter = Counter()
    acc.register_for_checkpointing(counter)
    model, opt, sched = acc.prepare(model, opt, sched)
    acc.load_state(ckpt)
    expected = torch.load(expected_path)
    got = acc.unwrap_model(model).state_dict()
    assert all(torch.equal(expected[k], got[k]) for k in expected), "weights differ"
    assert counter.value == counter_value, counter.value
    assert len(opt.state_dict()["state"]) == 4
    assert "fastpersist" not in sys.modules, "fastpersist was imported"
    print("STOCK-OK")
""")


def _clean_env() -> dict:
    env = dict(os.environ)
    for var in ("FASTPERSIST_ACCELERATE", "FASTPERSIST_PATCH_TORCH_SAVE", "FASTPERSIST_DEEPSPEED"):
        env.pop(var, None)
    return env


def _stock_load(ckpt: str, expected_model: str, counter: int) -> None:
    out = subprocess.run([sys.executable, "-c", STOCK_LOAD, ckpt, expected_model, str(counter)],
                         env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "STOCK-OK" in out.stdout, out.stdout + out.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes(tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), HERE, "--worker", str(tmp_path)]
    env = _clean_env()
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-8000:]
    results = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]
    from fastpersist.replicated import group_save_available

    split = group_save_available()
    for rank, res in enumerate(results):
        saves = [(name, grouped) for op, name, grouped in res["log"] if op == "save"]
        # Replicated files (weights, optimizer): every rank takes part when the multi-rank save exists.
        for name in ("model.safetensors", "optimizer.bin"):
            if split:
                assert saves.count((name, True)) == 3, (rank, saves)
            elif rank == 0:
                assert saves.count((name, False)) == 3, (rank, saves)
        assert saves.count((f"random_states_{rank}.pkl", False)) == 3
        assert res["loaded_equal"] and res["rng_equal"], res
    ckpts = tmp_path / "proj" / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["checkpoint_1", "checkpoint_2"]
    names = set(os.listdir(ckpts / "checkpoint_2"))
    assert names == (EXPECTED_FILES | {"random_states_1.pkl"})
    _all_verified(str(ckpts / "checkpoint_2"))
    # Both ranks staged every save in the same hidden directory, committed once: none is left.
    assert _staging_leftovers(tmp_path / "proj") == [] and _staging_leftovers(tmp_path) == []
    # The fixed directory, saved twice (the second save replaced the first in one step).
    assert set(os.listdir(tmp_path / "fixed")) == (EXPECTED_FILES | {"random_states_1.pkl"})
    _all_verified(str(tmp_path / "fixed"))
    # A 1-process stock Accelerate loads the 2-process checkpoint.
    _stock_load(str(ckpts / "checkpoint_2"), str(tmp_path / "expected_model.pt"), counter=3)


def _worker(root: str) -> None:
    from fastpersist.integrations import accelerate as fpa

    log: list = []

    class _MP:  # a minimal monkeypatch for the spies
        def setattr(self, obj, name, value):
            setattr(obj, name, value)

    _spy(_MP(), log)
    os.chdir(root)
    acc, model, opt, sched, counter = _build(os.path.join(root, "proj"), total_limit=2)
    fpa.enable(acc)
    for _ in range(3):
        _train_step(acc, model, opt, sched, counter)
        acc.save_state()
    expected = _snapshot(acc, model, opt, sched, counter)
    if acc.is_main_process:
        torch.save(expected["model"], os.path.join(root, "expected_model.pt"))
    rng = torch.rand(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    _train_step(acc, model, opt, sched, counter)
    acc.load_state(os.path.join(root, "proj", "checkpoints", "checkpoint_2"))
    try:
        _same(expected, _snapshot(acc, model, opt, sched, counter))
        loaded_equal = True
    except AssertionError:
        loaded_equal = False
    res = {"log": log, "loaded_equal": loaded_equal, "rng_equal": bool(torch.equal(torch.rand(3), rng))}
    with open(os.path.join(root, "out", f"rank{acc.process_index}.json"), "w") as f:
        json.dump(res, f)
    # A fixed output_dir, written and then replaced (both ranks write into the same staging directory).
    acc.project_configuration.automatic_checkpoint_naming = False
    for _ in range(2):
        _train_step(acc, model, opt, sched, counter)
        acc.save_state(os.path.join(root, "fixed"))
    acc.wait_for_everyone()
    acc.end_training()


# ---------------------------------------------------------------- directory-level atomicity
# save_state writes a hidden staging directory and makes it visible in one step (rename, or
# RENAME_EXCHANGE for an existing output_dir): a SIGKILL, an error or a refused exchange part-way
# leaves the previous checkpoint exactly as it was.


def _staging_leftovers(directory) -> list:
    return sorted(n for n in os.listdir(directory) if n.startswith(".fastpersist-"))


def _hashes(directory) -> dict:
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def _run_killed_child(mode: str, root) -> None:
    """Run _kill_child in a subprocess: it saves step A, then blocks inside the next
    save_state (model.safetensors and optimizer.bin of step B written, scheduler.bin
    being written); SIGKILL it there."""
    from subprocess_kill import sigkill_when_blocked  # tests/ is on sys.path (rootdir conftest)

    sigkill_when_blocked([sys.executable, HERE, "--kill-child", mode, str(root)], str(root), _clean_env(), 300)


def _kill_child(mode: str, root: str) -> None:
    from fastpersist.integrations import accelerate as fpa

    auto = mode == "auto"
    acc, model, opt, sched, counter = _build(os.path.join(root, "proj"), total_limit=None, auto=auto)
    extra = Counter()  # step A has a second custom object (custom_checkpoint_1.pkl); step B will not
    acc.register_for_checkpointing(extra)
    fpa.enable(acc)
    target = None if auto else os.path.join(root, "fixed")
    _train_step(acc, model, opt, sched, counter)
    extra.value = 7
    where = acc.save_state(target)
    snap = _snapshot(acc, model, opt, sched, counter)
    snap["extra"] = extra.value
    torch.save(snap, os.path.join(root, "expected_a.pt"))
    with open(os.path.join(root, "a.json"), "w") as f:
        json.dump({"where": os.fspath(where), "hashes": _hashes(where)}, f)
    _train_step(acc, model, opt, sched, counter)
    real = fastpersist.save

    def save(obj, path, **kw):
        if os.path.basename(os.fspath(path)) == "scheduler.bin":
            open(os.path.join(root, "blocked"), "w").close()
            time.sleep(600)  # the parent SIGKILLs us here
        return real(obj, path, **kw)

    fastpersist.save = save
    acc.save_state(target)
    sys.exit(3)  # not reached


def _expected_a(root) -> dict:
    return torch.load(os.path.join(root, "expected_a.pt"), weights_only=False)


def test_sigkill_during_automatic_save_state(fresh_accelerate, tmp_path):
    """Automatic naming: a process killed while writing checkpoint_1 leaves no checkpoint_1;
    load_state() (no path) in another process resumes exactly from checkpoint_0, and the next
    save_state writes checkpoint_1 and removes the killed save's staging directory."""
    fpa = fresh_accelerate
    _run_killed_child("auto", tmp_path)
    ckpts = tmp_path / "proj" / "checkpoints"
    assert sorted(os.listdir(ckpts)) == ["checkpoint_0"]
    a = json.loads((tmp_path / "a.json").read_text())
    assert _hashes(ckpts / "checkpoint_0") == a["hashes"]
    from fastpersist import dircommit

    staged = _staging_leftovers(tmp_path / "proj")  # the killed save's half-written directory, hidden
    assert len(staged) == 1 and staged[0].startswith(dircommit.staging_name("checkpoint_1", "")), staged

    expected = _expected_a(tmp_path)
    acc, model, opt, sched, counter = _build(str(tmp_path / "proj"), total_limit=None)
    extra = Counter()
    acc.register_for_checkpointing(extra)
    fpa.enable(acc)
    _train_step(acc, model, opt, sched, counter)  # move away from step A
    acc.load_state()
    assert extra.value == expected.pop("extra") == 7
    _same(expected, _snapshot(acc, model, opt, sched, counter))

    # A new process counts saves from 0: a resuming user sets the next number (Accelerate's advice).
    acc.project_configuration.iteration = 1
    _train_step(acc, model, opt, sched, counter)
    where = acc.save_state()
    assert os.path.basename(where) == "checkpoint_1"
    assert sorted(os.listdir(ckpts)) == ["checkpoint_0", "checkpoint_1"]
    assert set(os.listdir(where)) == EXPECTED_FILES | {"custom_checkpoint_1.pkl"}
    _all_verified(str(where))
    assert _staging_leftovers(tmp_path / "proj") == []
    assert acc.save_iteration == 2


def test_sigkill_during_save_state_into_existing_directory(fresh_accelerate, tmp_path):
    """A fixed output_dir holding step A: a process killed while saving step B into it
    leaves exactly step A (every file, byte for byte, and the values); a complete save of
    step B then leaves exactly step B (A's custom_checkpoint_1.pkl, which B does not
    write, is gone) and no staging directory."""
    fpa = fresh_accelerate
    _run_killed_child("fixed", tmp_path)
    fixed = tmp_path / "fixed"
    a = json.loads((tmp_path / "a.json").read_text())
    assert "custom_checkpoint_1.pkl" in a["hashes"]
    assert _hashes(fixed) == a["hashes"]

    expected = _expected_a(tmp_path)
    acc, model, opt, sched, counter = _build(str(tmp_path / "proj"), total_limit=None, auto=False)
    extra = Counter()
    acc.register_for_checkpointing(extra)
    fpa.enable(acc)
    _train_step(acc, model, opt, sched, counter)
    acc.load_state(str(fixed))
    assert extra.value == expected.pop("extra") == 7
    _same(expected, _snapshot(acc, model, opt, sched, counter))

    # Step B, from an Accelerator with one custom object only.
    acc, model, opt, sched, counter = _build(str(tmp_path / "proj"), total_limit=None, auto=False)
    fpa.enable(acc)
    for _ in range(2):
        _train_step(acc, model, opt, sched, counter)
    where = acc.save_state(str(fixed))
    assert os.fspath(where) == str(fixed)
    want_b = _snapshot(acc, model, opt, sched, counter)
    assert set(os.listdir(fixed)) == EXPECTED_FILES
    _all_verified(str(fixed))
    assert _staging_leftovers(tmp_path) == []
    _train_step(acc, model, opt, sched, counter)
    acc.load_state(str(fixed))
    _same(want_b, _snapshot(acc, model, opt, sched, counter))


def _failing_save_leaves(monkeypatch, acc, fixed: str, name: str, before: dict) -> None:
    """save_state(fixed) with the save of the file ``name`` raising ENOSPC (the files
    before it written): the error reaches the caller, ``fixed`` holds ``before``
    (:func:`_hashes`) and no staging directory is left beside it."""
    real = fastpersist.save

    def save(obj, path, **kw):
        if os.path.basename(os.fspath(path)) == name:
            raise OSError(errno.ENOSPC, "injected", os.fspath(path))
        return real(obj, path, **kw)

    with monkeypatch.context() as m:
        m.setattr(fastpersist, "save", save)
        with pytest.raises(OSError, match="injected"):
            acc.save_state(fixed)
    assert _hashes(fixed) == before
    assert _staging_leftovers(os.path.dirname(fixed)) == []


def test_error_during_save_state_into_existing_directory(fresh_accelerate, monkeypatch, tmp_path):
    """An error part-way through a save into a directory holding step A: the directory is
    unchanged, nothing is left beside it, and iteration is not counted."""
    fpa = fresh_accelerate
    acc, model, opt, sched, counter = _build(str(tmp_path / "proj"), total_limit=None, auto=False)
    fpa.enable(acc)
    fixed = str(tmp_path / "fixed")
    _train_step(acc, model, opt, sched, counter)
    acc.save_state(fixed)
    before = _hashes(fixed)
    iteration = acc.save_iteration
    _train_step(acc, model, opt, sched, counter)
    _failing_save_leaves(monkeypatch, acc, fixed, "scheduler.bin", before)
    assert acc.save_iteration == iteration


def test_existing_directory_without_rename_exchange(fresh_accelerate, monkeypatch, tmp_path):
    """Where the filesystem refuses RENAME_EXCHANGE (EINVAL), the old directory is moved
    aside, the new one renamed in, the old one removed. A save killed between those two
    renames (simulated: only the moved-aside copy exists) is recovered by the next save,
    before it writes: here that save fails, and the directory holds step A again."""
    fpa = fresh_accelerate
    acc, model, opt, sched, counter = _build(str(tmp_path / "proj"), total_limit=None, auto=False)
    fpa.enable(acc)
    fixed = str(tmp_path / "fixed")
    _train_step(acc, model, opt, sched, counter)
    acc.save_state(fixed)
    with open(os.path.join(fixed, "custom_checkpoint_5.pkl"), "wb") as f:  # a stale checkpoint file
        f.write(b"stale")
    with open(os.path.join(fixed, "notes.txt"), "w") as f:  # not Accelerate's: kept
        f.write("user notes")

    calls = []

    def refuse(a, b):
        calls.append((a, b))
        raise OSError(errno.EINVAL, "Invalid argument", a, None, b)

    monkeypatch.setattr("fastpersist.dircommit.exchange_paths", refuse)
    _train_step(acc, model, opt, sched, counter)
    acc.save_state(fixed)
    assert len(calls) == 1
    want_b = _snapshot(acc, model, opt, sched, counter)
    assert set(os.listdir(fixed)) == EXPECTED_FILES | {"notes.txt"}
    assert open(os.path.join(fixed, "notes.txt")).read() == "user notes"
    assert _staging_leftovers(tmp_path) == []
    before = _hashes(fixed)

    # Killed between the two renames: no fixed/, its previous copy moved aside.
    os.rename(fixed, str(tmp_path / ".fastpersist-old-fixed-0123456789abcdef"))
    _train_step(acc, model, opt, sched, counter)
    _failing_save_leaves(monkeypatch, acc, fixed, "optimizer.bin", before)
    acc.load_state(fixed)
    _same(want_b, _snapshot(acc, model, opt, sched, counter))


def test_long_output_dir_name(fresh_accelerate, tmp_path):
    """An output_dir whose last component is 240 bytes (NAME_MAX is 255): the staging and
    old-copy names are shortened to fit, the save and an overwrite succeed, nothing is left."""
    fpa = fresh_accelerate
    acc, model, opt, sched, counter = _build(str(tmp_path / "proj"), total_limit=None, auto=False)
    fpa.enable(acc)
    fixed = str(tmp_path / ("d" * 240))
    _train_step(acc, model, opt, sched, counter)
    acc.save_state(fixed)
    _train_step(acc, model, opt, sched, counter)
    acc.save_state(fixed)
    want = _snapshot(acc, model, opt, sched, counter)
    assert set(os.listdir(fixed)) == EXPECTED_FILES
    assert _staging_leftovers(tmp_path) == []
    _train_step(acc, model, opt, sched, counter)
    acc.load_state(fixed)
    _same(want, _snapshot(acc, model, opt, sched, counter))


def test_previous_copy_that_cannot_be_removed_does_not_fail_the_save(fresh_accelerate, monkeypatch, tmp_path):
    """After the swap the new checkpoint is in place: a failure to remove the previous copy
    (an NFS .nfsXXXX file, a read-only subdirectory) is logged, save_state returns the new
    directory and counts it, and the next save_state removes the leftover."""
    import shutil

    fpa = fresh_accelerate
    acc, model, opt, sched, counter = _build(str(tmp_path / "proj"), total_limit=None, auto=False)
    fpa.enable(acc)
    fixed = str(tmp_path / "fixed")
    _train_step(acc, model, opt, sched, counter)
    acc.save_state(fixed)
    _train_step(acc, model, opt, sched, counter)
    real = shutil.rmtree

    def rmtree(path, *a, **kw):
        if ".fastpersist-" in os.path.basename(os.fspath(path)) and not kw.get("ignore_errors"):
            raise OSError(errno.EBUSY, "Device or resource busy (injected)", os.fspath(path))
        return real(path, *a, **kw)

    iteration = acc.save_iteration
    with monkeypatch.context() as m:
        m.setattr(shutil, "rmtree", rmtree)
        location = acc.save_state(fixed)
    assert os.path.abspath(os.fspath(location)) == os.path.abspath(fixed)
    assert acc.save_iteration == iteration + 1
    want = _snapshot(acc, model, opt, sched, counter)
    assert len(_staging_leftovers(tmp_path)) == 1  # the previous copy, under our name
    _train_step(acc, model, opt, sched, counter)
    acc.load_state(fixed)  # the new checkpoint is the one in place
    _same(want, _snapshot(acc, model, opt, sched, counter))
    _train_step(acc, model, opt, sched, counter)
    acc.save_state(fixed)
    assert _staging_leftovers(tmp_path) == []


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker(sys.argv[sys.argv.index("--worker") + 1])
    # Results written, every rank past wait_for_everyone: leave without finalizing the
    # interpreter, as tests/test_integration_deepspeed.py's 2-rank workers do. torch's gloo
    # worker thread (ProcessGroupGloo::runLoop) can free a tensor while Python finalizes and
    # abort the rank with "terminate called without an active exception" (issue 24 case 5,
    # torch's: docs/reliability.md). It did here once, in a CI run of session 13 (rank 1,
    # SIGABRT after its results were written); fastpersist's threads are not involved.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
elif __name__ == "__main__" and "--kill-child" in sys.argv:
    i = sys.argv.index("--kill-child")
    _kill_child(sys.argv[i + 1], sys.argv[i + 2])


# ---- issue 23 case 11: what an `accelerate launch --config_file x.yaml` user can write ----------

LAUNCHED = """
import os, sys, zipfile
import torch
from accelerate import Accelerator
acc = Accelerator(cpu=True)
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
out = sys.argv[1]
acc.save_state(out)
with zipfile.ZipFile(os.path.join(out, "optimizer.bin")) as z:
    names = [n for n in z.namelist() if n.endswith("/.storage_alignment")]
    print("ALIGNMENT", int(z.read(names[0])) if names else None)
"""

ACCELERATE_YAML = """compute_environment: LOCAL_MACHINE
distributed_type: 'NO'
mixed_precision: 'no'
num_machines: 1
num_processes: 1
use_cpu: true
"""


def _accelerate_launch(tmp_path, yaml_text: str, **env_extra: str) -> subprocess.CompletedProcess:
    # The `accelerate` console script is `python -m accelerate.commands.accelerate_cli` (this
    # interpreter's: a venv layered on another one may have no script of its own).
    (tmp_path / "cfg.yaml").write_text(yaml_text)
    (tmp_path / "train.py").write_text(LAUNCHED)
    env = {k: v for k, v in os.environ.items()
           if k not in ("FASTPERSIST_ACCELERATE", "FASTPERSIST_PATCH_TORCH_SAVE", "FASTPERSIST_DEEPSPEED")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", **env_extra)
    return subprocess.run([sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(tmp_path / "cfg.yaml"), str(tmp_path / "train.py"),
                           str(tmp_path / "ckpt")], env=env, capture_output=True, text=True, timeout=400,
                          cwd=str(tmp_path))


def test_accelerate_launch_config_file_and_the_variable(tmp_path):
    """The way README gives for ``accelerate launch --config_file``: the variable on the
    command line reaches the launched process; the yaml stays Accelerate's own."""
    import importlib.util

    if importlib.util.find_spec("_fastpersist_startup") is None:
        pytest.skip("the start-up hook (fastpersist-startup.pth) is not installed in this environment")
    (tmp_path / "fp").mkdir()
    (tmp_path / "stock").mkdir()
    out, stock = (f.result() for f in side_by_side([  # each in a folder of its own, side by side
        partial(_accelerate_launch, tmp_path / "fp", ACCELERATE_YAML, FASTPERSIST_ACCELERATE="1"),
        partial(_accelerate_launch, tmp_path / "stock", ACCELERATE_YAML)]))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "ALIGNMENT 4096" in out.stdout, out.stdout[-3000:]  # fastpersist wrote optimizer.bin
    assert stock.returncode == 0 and "ALIGNMENT 64" in stock.stdout, stock.stdout[-3000:] + stock.stderr[-3000:]


def test_accelerate_config_has_no_environment_section_and_readme_does_not_claim_one(tmp_path):
    """Accelerate 1.15 refuses unknown top-level keys of a config file (and has no key that
    sets the launched processes' environment for a local launch: ``tpu_env`` is for TPU
    pods), so README must not send users to an ``environment`` section."""
    pytest.importorskip("yaml")
    from accelerate.commands.config.config_args import ClusterConfig

    path = tmp_path / "env.yaml"
    path.write_text(ACCELERATE_YAML + "environment:\n  FASTPERSIST_ACCELERATE: '1'\n")
    with pytest.raises(ValueError, match="unknown keys"):
        ClusterConfig.from_yaml_file(str(path))
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md"),
                  encoding="utf-8").read()
    assert "`environment` section of `accelerate config`" not in readme
    assert "FASTPERSIST_ACCELERATE=1 accelerate launch --config_file" in readme
