"""Atomic commit under injected I/O faults and SIGKILL: the previous checkpoint always survives."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import zipfile

import pytest
import torch

import fastpersist
from fastpersist import _native
from fastpersist.commit import TMP_MARKER, atomic_write

ENGINES = [e for e in _native.available_engines() if e in ("aio", "psync")]
CHUNK = 64 << 10


def _config(engine: str) -> fastpersist.Config:
    # small chunks: the ~1 MiB state below takes a few dozen write calls
    return fastpersist.Config(engine=engine, chunk_size=CHUNK, queue_depth=4, threads=2)


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 1000, generator=g), "b": torch.randn(1000, generator=g), "step": seed}


def _leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if TMP_MARKER in p.name)


@pytest.fixture
def previous(tmp_path):
    """A good checkpoint already at the target path; checks it is untouched afterwards."""
    path = tmp_path / "ckpt.pt"
    old = _state(1)
    fastpersist.save(old, path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    yield path
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, "previous checkpoint modified"
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
    got = fastpersist.load(path)
    assert torch.equal(got["w"], old["w"]) and got["step"] == 1
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("action,code", [("EIO", errno.EIO), ("ENOSPC", errno.ENOSPC)])
@pytest.mark.parametrize("nth", [1, 3, 9])
def test_write_errors_keep_previous(previous, engine, action, code, nth):
    _native.set_fault("write", nth, action)
    with pytest.raises(OSError) as info:
        fastpersist.save(_state(2), previous, config=_config(engine))
    assert _native.fault_hits() >= 1
    assert info.value.errno == code
    assert info.value.filename == str(previous)
    assert TMP_MARKER in str(info.value)  # the message also names the temporary file


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("action,code", [("EIO", errno.EIO), ("ENOSPC", errno.ENOSPC)])
def test_fsync_error_keeps_previous(previous, engine, action, code):
    _native.set_fault("fsync", 1, action)
    with pytest.raises(OSError) as info:
        fastpersist.save(_state(2), previous, config=_config(engine))
    assert _native.fault_hits() == 1
    assert info.value.errno == code and info.value.filename == str(previous)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
@pytest.mark.parametrize("how", ["save", "save_async"])
def test_directory_fsync_failure_after_the_rename_says_the_new_file_is_in_place(tmp_path, monkeypatch, suffix, how):
    """The rename happened, then the directory's fsync failed: the error must not claim the previous
    file is untouched (it was replaced); it says the new file is in place but may not survive a crash."""
    from fastpersist import commit
    from fastpersist.errors import DirectorySyncError

    path = tmp_path / f"ckpt{suffix}"
    fastpersist.save({"w": torch.zeros(8)}, path)
    new = {"w": torch.arange(8, dtype=torch.float32)}

    def failing(directory):
        raise OSError(errno.EIO, "Input/output error", directory)

    monkeypatch.setattr(commit, "fsync_dir", failing)
    with pytest.raises(DirectorySyncError) as info:
        if how == "save":
            fastpersist.save(new, path, config=fastpersist.Config(fsync=True))
        else:
            fastpersist.save_async(new, path, config=fastpersist.Config(fsync=True)).wait(60)
    e = info.value
    assert isinstance(e, OSError) and e.errno == errno.EIO and e.filename == str(path)
    assert "the new file is in place" in str(e) and "untouched" not in str(e), str(e)
    monkeypatch.undo()
    assert torch.equal(fastpersist.load(path, weights_only=True)["w"], new["w"])
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("engine", ENGINES)
def test_open_error(previous, engine):
    _native.set_fault("open", 1, "EACCES")
    with pytest.raises(PermissionError):
        fastpersist.save(_state(2), previous, config=_config(engine))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("action,count", [("short", 1), ("short", 4), ("eintr", 1), ("eintr", 5)])
@pytest.mark.parametrize("nth", [1, 5])
def test_short_and_eintr_writes_recover(tmp_path, engine, action, count, nth, assert_same):
    path = tmp_path / "ckpt.pt"
    new = _state(3)
    _native.set_fault("write", nth, action, count)
    fastpersist.save(new, path, config=_config(engine))
    assert _native.fault_hits() >= 1
    _native.clear_faults()
    assert fastpersist.verify(path).ok
    assert_same(torch.load(path), new)
    assert torch.equal(torch.load(path)["w"], new["w"])
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("action", ["short", "eintr"])
def test_short_and_eintr_reads_recover(tmp_path, engine, action):
    path = tmp_path / "ckpt.pt"
    new = _state(4)
    fastpersist.save(new, path)
    _native.set_fault("read", 1, action, 3)
    got = fastpersist.load(path, config=_config(engine))
    assert _native.fault_hits() >= 1
    assert torch.equal(got["w"], new["w"])


@pytest.mark.parametrize("engine", ENGINES)
def test_read_error_raises(tmp_path, engine):
    path = tmp_path / "ckpt.pt"
    fastpersist.save(_state(5), path)
    _native.set_fault("read", 2, "EIO")
    with pytest.raises(OSError) as info:
        fastpersist.load(path, config=_config(engine))
    assert info.value.errno == errno.EIO and info.value.filename == str(path)
    _native.set_fault("read", 1, "EIO")
    with pytest.raises(OSError):
        fastpersist.verify(path, config=_config(engine))


def test_failure_in_writer_callback_removes_temp(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"old")
    seen = []

    def writer(tmp: str) -> None:
        seen.append(tmp)
        with open(tmp, "wb") as f:
            f.write(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, writer)
    assert path.read_bytes() == b"old"
    assert os.path.dirname(seen[0]) == str(tmp_path) and not os.path.exists(seen[0])


def test_atomic_write_result_and_durability(tmp_path):
    path = tmp_path / "y.bin"
    assert atomic_write(path, lambda tmp: open(tmp, "wb").write(b"abc")) == 3
    assert path.read_bytes() == b"abc"
    assert _leftovers(tmp_path) == []


_CHILD = textwrap.dedent(
    """
    import sys, torch, fastpersist
    state = {"big": torch.full((50 * 1024 * 1024,), 7.0), "step": 2}   # 200 MiB
    cfg = fastpersist.Config(chunk_size=256 << 10, queue_depth=2, threads=1, fsync=True)
    print("ready", flush=True)
    fastpersist.save(state, sys.argv[1], config=cfg)
    print("saved", flush=True)
    """
)


def start_big_save(path) -> tuple[subprocess.Popen, str]:
    """Start a child process saving 200 MiB to ``path``; return it once its temporary
    file beside ``path`` holds more than 8 MiB (the save is under way), with that name."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and child.poll() is None:
        names = _leftovers(path.parent)
        if names and os.path.getsize(path.parent / names[0]) > (8 << 20):
            return child, names[0]
        time.sleep(0.0005)
    child.kill()
    child.wait()
    raise AssertionError(f"no temporary file seen in time (child exit {child.poll()})")


@pytest.mark.slow
def test_sigkill_mid_save_keeps_previous(tmp_path):
    path = tmp_path / "ckpt.pt"
    fastpersist.save({"old": torch.arange(1000), "step": 1}, path)
    before = path.read_bytes()
    stat_before = os.stat(path)
    child, temp = start_big_save(path)
    try:
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    st = os.stat(path)
    assert (st.st_ino, st.st_mtime_ns, st.st_size) == (stat_before.st_ino, stat_before.st_mtime_ns, stat_before.st_size)
    assert path.read_bytes() == before
    got = torch.load(path)
    assert torch.equal(got["old"], torch.arange(1000)) and got["step"] == 1
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(["ckpt.pt", temp]), names  # only the dead writer's temporary file beside it


# ---- commit.write_and_replace (DCP's .metadata, the tiered mode's journal entries)


def test_write_and_replace_replaces_and_honours_the_umask(tmp_path):
    from fastpersist.commit import write_and_replace

    final, tmp = tmp_path / "f.bin", tmp_path / "f.bin.tmp"
    final.write_bytes(b"old")
    old = os.umask(0o027)
    try:
        write_and_replace(str(tmp), str(final), b"new bytes" * 1000)
    finally:
        os.umask(old)
    assert final.read_bytes() == b"new bytes" * 1000
    assert final.stat().st_mode & 0o777 == 0o640
    assert not tmp.exists()


@pytest.mark.parametrize("op", ["open", "write", "fsync", "rename"])
def test_write_and_replace_fault_keeps_previous_and_removes_temp(tmp_path, op):
    from fastpersist.commit import write_and_replace
    from fastpersist.testing import inject_fault

    final, tmp = tmp_path / "f.bin", tmp_path / "f.bin.tmp"
    final.write_bytes(b"old")
    with inject_fault(op, 1, "EIO") as fault, pytest.raises(OSError) as info:
        write_and_replace(str(tmp), str(final), b"new")
    assert info.value.errno == errno.EIO and fault.hits == 1
    assert final.read_bytes() == b"old"
    assert not tmp.exists()


def test_write_and_replace_without_faults_is_not_counted(tmp_path):
    """faults=False (the journal): an injected fault neither fails nor counts the calls."""
    from fastpersist.commit import write_and_replace
    from fastpersist.testing import inject_fault

    final, tmp = tmp_path / "f.bin", tmp_path / "f.bin.tmp"
    tmp.write_bytes(b"a leftover longer than the new bytes")  # exclusive=False: truncated, not refused
    with inject_fault("write", 1, "EIO") as fault:
        write_and_replace(str(tmp), str(final), b"new", exclusive=False, faults=False)
    assert fault.hits == 0
    assert final.read_bytes() == b"new"
