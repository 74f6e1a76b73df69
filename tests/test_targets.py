"""Save targets (issue 9, item 6): devices, FIFOs, write-protected files, unwritable
directories, and names up to NAME_MAX bytes."""

from __future__ import annotations

import errno
import os
import stat
import threading

import pytest
import torch

import fastpersist
from fastpersist.commit import TMP_MARKER, UnsupportedTargetError, temp_path_for

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def _state() -> dict:
    return {"w": torch.arange(64, dtype=torch.float32), "step": 3}


def _leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if TMP_MARKER in p.name)


@pytest.fixture
def patched():
    with fastpersist.patch_torch_save():
        yield


class _FifoReader(threading.Thread):
    """Reads a FIFO to the end (a writer's open blocks until a reader is there)."""

    def __init__(self, path) -> None:
        super().__init__(daemon=True)
        self.path, self.data = path, None

    def run(self) -> None:
        with open(self.path, "rb") as f:
            self.data = f.read()


def _unblock_fifo(path) -> None:
    """Open the FIFO for writing once so a reader thread still blocked in open() returns."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return  # no reader waiting
    os.close(fd)


# ---- non-regular targets ---------------------------------------------------------


def test_save_to_fifo_is_refused(tmp_path):
    fifo = tmp_path / "pipe.pt"
    os.mkfifo(fifo)
    with pytest.raises(UnsupportedTargetError) as info:
        fastpersist.save(_state(), fifo)
    e = info.value
    assert isinstance(e, OSError) and e.errno == errno.EINVAL and e.filename == str(fifo)
    assert "FIFO" in str(e) and "torch.save" in str(e)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert _leftovers(tmp_path) == []


def test_save_to_dev_null_is_refused_and_leaves_it_a_device():
    with pytest.raises(UnsupportedTargetError, match="character device"):
        fastpersist.save(_state(), "/dev/null")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_save_through_symlink_to_device_is_refused(tmp_path):
    link = tmp_path / "ckpt.pt"
    link.symlink_to("/dev/null")
    with pytest.raises(UnsupportedTargetError):
        fastpersist.save(_state(), link)
    assert link.is_symlink() and stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_patched_torch_save_writes_into_dev_null(patched):
    torch.save(_state(), "/dev/null")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_patched_torch_save_writes_into_fifo(patched, tmp_path):
    fifo = tmp_path / "pipe.pt"
    os.mkfifo(fifo)
    reader = _FifoReader(fifo)
    reader.start()
    try:
        torch.save(_state(), fifo)
    finally:
        reader.join(30)
        if reader.is_alive():
            _unblock_fifo(fifo)
    assert not reader.is_alive()
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    # what went through the pipe is exactly what torch.save writes
    import io

    got = torch.load(io.BytesIO(reader.data))
    assert torch.equal(got["w"], _state()["w"]) and got["step"] == 3
    assert _leftovers(tmp_path) == []


# ---- permissions -------------------------------------------------------------------


@pytest.mark.skipif(IS_ROOT, reason="root bypasses file permissions (and so does torch.save)")
def test_write_protected_file_raises_like_torch(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"old": 1}, path)
    os.chmod(path, 0o444)
    before = path.read_bytes()
    with pytest.raises(PermissionError):
        torch.save(_state(), path)  # stock torch
    with pytest.raises(PermissionError) as info:
        fastpersist.save(_state(), path)
    assert info.value.errno == errno.EACCES and info.value.filename == str(path)
    assert "write-protected" in str(info.value) and "untouched" in str(info.value)
    assert path.read_bytes() == before
    assert _leftovers(tmp_path) == []


def test_write_protected_file_without_access(tmp_path, monkeypatch):
    """The same check as a non-root user sees it, whoever runs the test."""
    path = tmp_path / "ckpt.pt"
    fastpersist.save({"old": 1}, path)
    os.chmod(path, 0o444)
    before = path.read_bytes()
    real_access = os.access

    def access(p, mode, **kw):
        if os.fspath(p) == str(path) and mode & os.W_OK:
            return False
        return real_access(p, mode, **kw)

    monkeypatch.setattr(os, "access", access)
    monkeypatch.setattr(os, "supports_effective_ids", os.supports_effective_ids | {access})
    with pytest.raises(PermissionError) as info:
        fastpersist.save(_state(), path)
    assert info.value.errno == errno.EACCES and "write-protected" in str(info.value)
    assert path.read_bytes() == before and stat.S_IMODE(os.stat(path).st_mode) == 0o444


@pytest.mark.skipif(not IS_ROOT, reason="as root, torch.save writes over a 0444 file")
def test_write_protected_file_as_root_is_replaced_like_torch(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"old": 1}, path)
    os.chmod(path, 0o444)
    torch.save({"old": 2}, path)  # stock torch succeeds as root
    fastpersist.save(_state(), path)
    assert torch.equal(torch.load(path)["w"], _state()["w"])
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o444  # the mode is kept, as torch's "wb" keeps it


def test_unwritable_directory_is_a_clear_error(tmp_path, monkeypatch):
    directory = tmp_path / "ro"
    directory.mkdir()
    real_access = os.access

    def access(p, mode, **kw):
        if os.fspath(p) == str(directory) and mode & os.W_OK:
            return False
        return real_access(p, mode, **kw)

    monkeypatch.setattr(os, "access", access)
    monkeypatch.setattr(os, "supports_effective_ids", os.supports_effective_ids | {access})
    with pytest.raises(PermissionError) as info:
        fastpersist.save(_state(), directory / "ckpt.pt")
    assert info.value.errno == errno.EACCES and info.value.filename == str(directory)
    assert "temporary" in str(info.value)
    assert list(directory.iterdir()) == []


@pytest.mark.skipif(IS_ROOT, reason="root may create files in a 0555 directory")
def test_unwritable_directory_real(tmp_path):
    directory = tmp_path / "ro"
    directory.mkdir()
    os.chmod(directory, 0o555)
    try:
        with pytest.raises(PermissionError):
            fastpersist.save(_state(), directory / "ckpt.pt")
    finally:
        os.chmod(directory, 0o755)


def test_patched_torch_save_writes_in_place_when_directory_refuses_new_files(patched, tmp_path, monkeypatch):
    directory = tmp_path / "ro"
    directory.mkdir()
    path = directory / "ckpt.pt"
    path.write_bytes(b"old")
    real_access = os.access

    def access(p, mode, **kw):
        if os.fspath(p) == str(directory) and mode & os.W_OK:
            return False
        return real_access(p, mode, **kw)

    monkeypatch.setattr(os, "access", access)
    monkeypatch.setattr(os, "supports_effective_ids", os.supports_effective_ids | {access})
    ino = os.stat(path).st_ino
    torch.save(_state(), path)  # torch's own save, writing into the file
    assert os.stat(path).st_ino == ino
    assert torch.equal(torch.load(path)["w"], _state()["w"])


# ---- long names ----------------------------------------------------------------


def _name(nbytes: int, char: str) -> str:
    """A file name of exactly ``nbytes`` UTF-8 bytes ending in ``.pt``, made of ``char`` and padding."""
    body = nbytes - 3
    n = body // len(char.encode())
    name = char * n + "x" * (body - n * len(char.encode())) + ".pt"
    assert len(name.encode()) == nbytes
    return name


@pytest.mark.parametrize("nbytes", [200, 233, 240, 254, 255])
@pytest.mark.parametrize("char", ["a", "é", "€", "😀"], ids=["ascii", "utf8-2", "utf8-3", "utf8-4"])
def test_long_names_save_and_load(tmp_path, nbytes, char):
    path = tmp_path / _name(nbytes, char)
    state = _state()
    torch.save(state, path)  # torch accepts the name
    fastpersist.save(state, path)
    got = fastpersist.load(path)
    assert torch.equal(got["w"], state["w"]) and got["step"] == 3
    assert torch.equal(torch.load(path)["w"], state["w"])
    assert fastpersist.verify(path).ok
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


@pytest.mark.parametrize("nbytes", [233, 255])
def test_long_names_safetensors(tmp_path, nbytes):
    from safetensors.torch import load_file

    path = tmp_path / ("s" * (nbytes - len(".safetensors")) + ".safetensors")
    assert len(path.name.encode()) == nbytes
    fastpersist.save({"w": torch.ones(10)}, path)
    assert torch.equal(load_file(path)["w"], torch.ones(10))


def test_temp_name_fits_and_is_cut_at_a_character_boundary(tmp_path):
    # temporary names hold a hash of the final name, not the name itself (issue 23 case 4)
    name = _name(255, "😀")
    tmp = os.path.basename(temp_path_for(str(tmp_path / name)))
    raw = tmp.encode()
    assert len(raw) <= os.pathconf(tmp_path, "PC_NAME_MAX")
    assert tmp.startswith(TMP_MARKER) and "😀" not in tmp
    short = os.path.basename(temp_path_for(str(tmp_path / "ckpt.pt")))
    assert short.startswith(TMP_MARKER) and "ckpt" not in short


def test_read_only_filesystem_is_a_clear_error(tmp_path, monkeypatch):
    from fastpersist import commit

    path = tmp_path / "ckpt.pt"
    monkeypatch.setattr(commit, "_read_only_fs", lambda directory: True)
    with pytest.raises(OSError) as info:
        fastpersist.save(_state(), path)
    assert info.value.errno == errno.EROFS and info.value.filename == str(path)
    assert not path.exists() and _leftovers(tmp_path) == []
