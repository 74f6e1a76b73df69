"""Leftover temporary files of killed saves (issue 9, item 7): a later save into the
same directory removes those whose writer is certainly gone, never one still being
written (here or on another machine), and ``fastpersist info --dir`` lists them."""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import fastpersist
from fastpersist import commit
from fastpersist.cli import main
from fastpersist.commit import FOREIGN_TMP_GRACE_S, TMP_MARKER, clean_stale_temps, scan_temps, temp_path_for
from test_atomic import start_big_save

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="owner checks need Linux /proc")


def _leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if TMP_MARKER in p.name)


def _make(directory, name: str, size: int = 10, age: float = 0.0) -> str:
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.write(b"x" * size)
    if age:
        t = time.time() - age
        os.utime(path, (t, t))
    return path


def _own_fields() -> tuple[str, str]:
    host, start = commit.process_identity()
    assert host != commit.UNKNOWN_HOST and start != "0"
    return host, start


def _save_other(directory) -> None:
    """A save of another checkpoint into the same directory (this is what triggers cleanup)."""
    fastpersist.save({"other": torch.ones(4)}, os.path.join(directory, "other.pt"))


# ---- a real SIGKILL mid-save ---------------------------------------------------------

@pytest.mark.slow
def test_sigkill_leftover_is_removed_by_next_save(tmp_path):
    path = tmp_path / "ckpt.pt"
    fastpersist.save({"old": torch.arange(1000), "step": 1}, path)
    before = path.read_bytes()
    child, temp = start_big_save(path)
    try:
        assert f"{TMP_MARKER}{commit.name_hash('ckpt.pt')}-{child.pid}-" in temp
        # while the writer runs, its file is live and survives a save next to it
        [t] = scan_temps(str(tmp_path))
        assert (t.state, t.removable, t.pid) == ("live", False, child.pid)
        os.kill(child.pid, signal.SIGKILL)
        # not reaped yet: a zombie cannot write any more, so its file is already stale
        deadline = time.monotonic() + 30
        while scan_temps(str(tmp_path))[0].state != "stale" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert scan_temps(str(tmp_path))[0].state == "stale"
        assert child.wait(60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    [t] = scan_temps(str(tmp_path))
    assert (t.state, t.removable, t.pid) == ("stale", True, child.pid) and t.size > (8 << 20)
    assert "exited" in t.reason

    _save_other(tmp_path)  # a save of anything in that directory cleans up
    assert _leftovers(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "other.pt"]
    assert path.read_bytes() == before  # the previous checkpoint is untouched and loadable
    got = fastpersist.load(path)
    assert torch.equal(got["old"], torch.arange(1000)) and got["step"] == 1
    assert torch.equal(torch.load(path)["old"], torch.arange(1000))


# ---- live writers are never touched ----------------------------------------------


def test_own_live_temp_is_kept(tmp_path):
    tmp = temp_path_for(str(tmp_path / "ckpt.pt"))
    _make(tmp_path, os.path.basename(tmp), age=10 * FOREIGN_TMP_GRACE_S)  # even if old
    [t] = scan_temps(str(tmp_path))
    assert (t.state, t.removable, t.pid) == ("live", False, os.getpid())
    _save_other(tmp_path)
    assert os.path.exists(tmp)
    assert clean_stale_temps(str(tmp_path)) == []
    assert os.path.exists(tmp)


_SLEEPER = textwrap.dedent(
    """
    import sys, time
    from fastpersist.commit import temp_path_for
    tmp = temp_path_for(sys.argv[1])
    with open(tmp, "wb") as f:
        f.write(b"partial")
    print(tmp, flush=True)
    time.sleep(600)
    """
)


def test_sleeping_child_temp_is_kept_until_it_dies(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", _SLEEPER, str(tmp_path / "ckpt.pt")],
                             stdout=subprocess.PIPE, text=True)
    try:
        tmp = child.stdout.readline().strip()
        assert tmp and os.path.exists(tmp)
        _save_other(tmp_path)
        assert os.path.exists(tmp)
        [t] = scan_temps(str(tmp_path))
        assert (t.state, t.pid) == ("live", child.pid)
    finally:
        child.kill()
        child.wait()
    _save_other(tmp_path)
    assert not os.path.exists(tmp)


def test_reused_pid_is_stale(tmp_path):
    host, start = _own_fields()
    other_start = format(int(start, 16) + 1, "x")
    name = f".ckpt.pt{TMP_MARKER}{os.getpid()}-{host}-{other_start}-0123abcd"
    _make(tmp_path, name)
    [t] = scan_temps(str(tmp_path))
    assert (t.state, t.removable) == ("stale", True) and "reused" in t.reason
    _save_other(tmp_path)
    assert _leftovers(tmp_path) == []


def test_dead_pid_same_boot_is_stale(tmp_path):
    host, _ = _own_fields()
    pid = _dead_pid()
    name = f".ckpt.pt{TMP_MARKER}{pid}-{host}-1234-0123abcd"
    _make(tmp_path, name)  # young: the owner check needs no grace period
    _save_other(tmp_path)
    assert _leftovers(tmp_path) == []


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ---- other machines, boots, namespaces, releases: the mtime rule -----------------


@pytest.mark.parametrize("host", ["abcdef0123", commit.UNKNOWN_HOST])
def test_foreign_young_kept_old_removed(tmp_path, host):
    if host == commit.process_identity()[0]:
        pytest.skip("collides with this machine's tag")
    pid = os.getpid()  # whatever the pid: on another machine it says nothing about our processes
    young = _make(tmp_path, f".a.pt{TMP_MARKER}{pid}-{host}-99-0123abcd", age=FOREIGN_TMP_GRACE_S - 120)
    old = _make(tmp_path, f".b.pt{TMP_MARKER}{pid}-{host}-99-4567abcd", age=FOREIGN_TMP_GRACE_S + 120)
    states = {os.path.basename(t.path): (t.state, t.removable) for t in scan_temps(str(tmp_path))}
    assert states == {os.path.basename(young): ("foreign", False), os.path.basename(old): ("foreign", True)}
    _save_other(tmp_path)
    assert os.path.exists(young) and not os.path.exists(old)


def test_old_release_names_follow_the_mtime_rule(tmp_path):
    dead = _dead_pid()
    young = _make(tmp_path, f".a.pt{TMP_MARKER}{dead}-0123abcd", age=60)
    old = _make(tmp_path, f".b.pt{TMP_MARKER}{dead}-4567abcd", age=FOREIGN_TMP_GRACE_S + 60)
    _save_other(tmp_path)
    assert os.path.exists(young) and not os.path.exists(old)


def test_other_users_files_follow_the_mtime_rule(tmp_path, monkeypatch):
    """Another user's processes may be invisible in /proc (hidepid): their files wait for the grace period."""
    host, _ = _own_fields()
    name = f".ckpt.pt{TMP_MARKER}{_dead_pid()}-{host}-1234-0123abcd"
    path = _make(tmp_path, name)
    uid = os.stat(path).st_uid
    monkeypatch.setattr(os, "geteuid", lambda: uid + 1)
    [t] = scan_temps(str(tmp_path))
    assert (t.state, t.removable) == ("foreign", False) and "another user" in t.reason


def test_without_proc_identity_only_the_mtime_rule(tmp_path, monkeypatch):
    monkeypatch.setattr(commit, "_identity_cache", {os.getpid(): (commit.UNKNOWN_HOST, "0")})
    tmp = temp_path_for(str(tmp_path / "ckpt.pt"))
    assert f"-{commit.UNKNOWN_HOST}-0-" in os.path.basename(tmp)
    _make(tmp_path, os.path.basename(tmp))
    dead = _make(tmp_path, f".x.pt{TMP_MARKER}{_dead_pid()}-{commit.UNKNOWN_HOST}-0-0123abcd")
    assert all(not t.removable for t in scan_temps(str(tmp_path)))
    clean_stale_temps(str(tmp_path))
    assert os.path.exists(tmp) and os.path.exists(dead)


# ---- only our files, never through links ---------------------------------------------


def test_only_exact_regular_files_are_removed(tmp_path):
    host, _ = _own_fields()
    dead = _dead_pid()
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "precious.pt"
    target.write_bytes(b"keep me")
    keep = [
        f"ckpt.pt{TMP_MARKER}{dead}-{host}-1234-0123abcd",  # no leading dot
        f".ckpt.pt{TMP_MARKER}{dead}-{host}-1234-0123abcd.bak",  # trailing text
        f".ckpt.pt{TMP_MARKER}{dead}-{host}-1234-0123ABCD",  # not our hex
        f".ckpt.pt{TMP_MARKER}{dead}-0123abcdz",
        "notes.txt",
    ]
    for name in keep:
        _make(tmp_path, name, age=FOREIGN_TMP_GRACE_S * 2)
    link = tmp_path / f".link.pt{TMP_MARKER}{dead}-{host}-1234-0123abcd"
    link.symlink_to(target)
    os.utime(link, (0, 0), follow_symlinks=False)
    directory = tmp_path / f".dir.pt{TMP_MARKER}{dead}-{host}-1234-0123abcd"
    directory.mkdir()
    assert scan_temps(str(tmp_path)) == []
    _save_other(tmp_path)
    for name in keep:
        assert (tmp_path / name).exists(), name
    assert link.is_symlink() and directory.is_dir() and target.read_bytes() == b"keep me"


def test_cleanup_never_raises(tmp_path, monkeypatch):
    assert clean_stale_temps(str(tmp_path / "missing")) == []

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(commit, "scan_temps", broken)
    assert clean_stale_temps(str(tmp_path)) == []
    _save_other(tmp_path)  # a save is not disturbed by a failing cleanup
    assert (tmp_path / "other.pt").exists()


def test_names_round_trip_through_the_pattern(tmp_path):
    for name in ["ckpt.pt", "a" * 250 + ".pt", "é" * 126 + ".pt", "x.fp-tmp-1-deadbeef.pt", "new\nline.pt"]:
        tmp = os.path.basename(temp_path_for(str(tmp_path / name)))
        m = commit._TMP_RE.fullmatch(tmp)
        assert m and m["hash"] == commit.name_hash(name), tmp


# ---- issue 23 case 4: no part of the final name in a temporary name -----------------

_LISTING_NAMES = ["hpc_ckpt_2.ckpt", "last.ckpt", "epoch=3-step=40.ckpt", "checkpoint_7", "global_step12",
                  "latest", "model.safetensors", "last-v1.ckpt"]


@pytest.mark.parametrize("final", _LISTING_NAMES)
def test_temp_name_holds_no_part_of_the_final_name(tmp_path, final):
    tmp = os.path.basename(temp_path_for(str(tmp_path / final)))
    assert re.fullmatch(r"\.fp-tmp-[0-9a-f-]+", tmp), tmp  # only hex digits and dashes after the marker
    for part in re.split(r"[^A-Za-z_=]+", final):
        if len(part) > 1:
            assert part not in tmp, (part, tmp)
    assert not tmp.endswith((".ckpt", ".pt", ".safetensors", ".bin"))


def test_lightning_hpc_listing_ignores_an_in_flight_temp(tmp_path):
    """Lightning's HPC resume takes the largest N of every name containing ``hpc_ckpt_``: a
    temporary file of ``hpc_ckpt_2.ckpt`` next to a complete ``hpc_ckpt_1.ckpt`` must not count."""
    pytest.importorskip("lightning")
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    fastpersist.save({"step": 1}, tmp_path / "hpc_ckpt_1.ckpt")
    _make(tmp_path, os.path.basename(temp_path_for(str(tmp_path / "hpc_ckpt_2.ckpt"))), size=100)
    newest = _CheckpointConnector._CheckpointConnector__max_ckpt_version_in_folder(str(tmp_path), "hpc_ckpt_")
    assert newest == 1


def test_temps_for_finds_leftovers_of_one_final_name(tmp_path):
    host, _ = _own_fields()
    dead = _dead_pid()
    mine = _make(tmp_path, f"{TMP_MARKER}{commit.name_hash('a.pt')}-{dead}-{host}-1234-0123abcd")
    other = _make(tmp_path, f"{TMP_MARKER}{commit.name_hash('b.pt')}-{dead}-{host}-1234-4567abcd")
    legacy = _make(tmp_path, f".a.pt{TMP_MARKER}{dead}-{host}-1234-89abcdef")  # an earlier release's name
    found = {t.path for t in commit.temps_for(str(tmp_path / "a.pt"))}
    assert found == {mine, legacy}
    assert {t.path for t in commit.temps_for(str(tmp_path / "b.pt"))} == {other}
    assert sorted(clean_stale_temps(str(tmp_path))) == sorted([mine, other, legacy])  # all dead: all removed


# ---- fastpersist info --dir -------------------------------------------------------


def _populate(tmp_path) -> dict:
    host, _ = _own_fields()
    live = temp_path_for(str(tmp_path / "live.pt"))
    _make(tmp_path, os.path.basename(live), size=1000)
    stale = _make(tmp_path, f".stale.pt{TMP_MARKER}{_dead_pid()}-{host}-1234-0123abcd", size=2000)
    young = _make(tmp_path, f".young.pt{TMP_MARKER}4242-abcdef0123-99-0123abcd", size=3000, age=60)
    old = _make(tmp_path, f".old.pt{TMP_MARKER}4343-abcdef0123-99-0123abcd", size=4000,
                age=FOREIGN_TMP_GRACE_S + 60)
    return {"live": live, "stale": stale, "young": young, "old": old}


def test_info_lists_leftovers(tmp_path, capsys):
    if commit.process_identity()[0] == "abcdef0123":
        pytest.skip("collides with this machine's tag")
    files = _populate(tmp_path)
    assert main(["info", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Temp files : 4 leftovers" in out and "2 removed by the next save" in out
    lines = out.splitlines()

    def detail(path):
        i = lines.index("  " + os.path.basename(path))
        return lines[i + 1]

    assert f"pid {os.getpid()}, live, kept" in detail(files["live"])
    assert "stale, next save removes it" in detail(files["stale"]) and "exited" in detail(files["stale"])
    assert "pid 4242, foreign, kept" in detail(files["young"])
    assert "pid 4343, foreign, next save removes it" in detail(files["old"])
    assert all(os.path.exists(p) for p in files.values())  # listing removes nothing


def test_info_json_and_clean(tmp_path, capsys):
    if commit.process_identity()[0] == "abcdef0123":
        pytest.skip("collides with this machine's tag")
    files = _populate(tmp_path)
    assert main(["info", "--dir", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    by_path = {t["path"]: t for t in data["temp_files"]}
    assert set(by_path) == set(files.values())
    assert (by_path[files["live"]]["state"], by_path[files["live"]]["removed_by_next_save"]) == ("live", False)
    assert by_path[files["live"]]["pid"] == os.getpid() and by_path[files["live"]]["size"] == 1000
    assert (by_path[files["stale"]]["state"], by_path[files["stale"]]["removed_by_next_save"]) == ("stale", True)
    assert by_path[files["young"]]["removed_by_next_save"] is False
    assert by_path[files["old"]]["removed_by_next_save"] is True

    assert main(["info", "--dir", str(tmp_path), "--clean"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # info wraps its lines at 100 columns
    assert "2 removed now (--clean)" in out
    assert os.path.exists(files["live"]) and os.path.exists(files["young"])
    assert not os.path.exists(files["stale"]) and not os.path.exists(files["old"])


def test_info_without_leftovers(tmp_path, capsys):
    assert main(["info", "--dir", str(tmp_path)]) == 0
    assert "Temp files : none" in capsys.readouterr().out


# ---- temps in a checkpoint root's subdirectories (issue 33, case 3) ------------------


def test_clean_below_removes_dead_temps_one_level_down_only(tmp_path):
    """A save killed while writing a directory of its own (a new DeepSpeed tag) left its temp
    there; the adapters' cleanup of the checkpoint root removes it, keeps a live process's,
    does not go two levels down or through a symbolic link."""
    host, start = _own_fields()
    dead = f".ckpt.pt{TMP_MARKER}{_dead_pid()}-{host}-1234-0123abcd"
    for d in ("global_step1", "global_step2/sub", "elsewhere"):
        (tmp_path / "root" / d).mkdir(parents=True)
    root = tmp_path / "root"
    gone = [_make(root, dead), _make(root / "global_step1", dead)]
    kept = [_make(root / "global_step2" / "sub", dead), _make(root / "elsewhere", "notes.txt")]
    live = commit.temp_path_for(str(root / "global_step2" / "x.pt"))
    kept.append(_make(root / "global_step2", os.path.basename(live)))
    target = tmp_path / "outside"
    target.mkdir()
    kept.append(_make(target, dead))
    os.symlink(target, root / "linked", target_is_directory=True)
    removed = commit.clean_stale_temps_below(str(root))
    assert sorted(removed) == sorted(gone)
    assert all(not os.path.exists(p) for p in gone) and all(os.path.exists(p) for p in kept)
    assert commit.clean_stale_temps_below(str(tmp_path / "missing")) == []


def test_staged_dir_cleanup_reaches_sibling_checkpoint_dirs(tmp_path):
    """What the DeepSpeed and Accelerate adapters run at every save (StagedDir.clean_leftovers):
    a dead save's temp inside a sibling checkpoint directory is removed."""
    import logging

    from fastpersist.dircommit import StagedDir

    host, _ = _own_fields()
    dead = f".mp_rank_00_model_states.pt{TMP_MARKER}{_dead_pid()}-{host}-1234-0123abcd"
    (tmp_path / "global_step33").mkdir()
    left = _make(tmp_path / "global_step33", dead, size=1 << 20)
    StagedDir(str(tmp_path / "global_step34")).clean_leftovers(
        operation="save_checkpoint", logger=logging.getLogger("test"), fsync_after_restore=False)
    assert not os.path.exists(left)
