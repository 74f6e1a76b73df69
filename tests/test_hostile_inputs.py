"""verify, load and open pointed at what is not a checkpoint file (issue 24, case 7).

A FIFO with no writer made ``verify`` (function and CLI), ``load`` and ``open`` block
in ``open()`` forever; a symbolic-link loop made ``verify`` say "No such file" where
the OS says ELOOP. Each now raises at once an ``OSError`` carrying an errno.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fastpersist

CALLS = textwrap.dedent("""
    import sys, fastpersist
    path, which = sys.argv[1], sys.argv[2]
    call = {"verify": fastpersist.verify, "load": fastpersist.load, "open": fastpersist.open}[which]
    try:
        call(path)
    except OSError as e:
        print("ERRNO", e.errno, e.filename)
    else:
        print("NO ERROR")
""")


@pytest.mark.parametrize("which", ["verify", "load", "open"])
def test_fifo_without_writer_is_refused_at_once(tmp_path: Path, which: str) -> None:
    """In a child process with a time limit, so that a regression fails instead of hanging the suite."""
    fifo = tmp_path / "ckpt.pt"
    os.mkfifo(fifo)
    out = subprocess.run([sys.executable, "-c", CALLS, str(fifo), which], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["ERRNO", str(errno.ESPIPE), str(fifo)], (out.stdout, out.stderr[-2000:])


def test_cli_verify_fifo_exits_2_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "ckpt.pt"
    os.mkfifo(fifo)
    out = subprocess.run([sys.executable, "-m", "fastpersist", "verify", str(fifo)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "FIFO" in out.stderr and str(fifo) in out.stderr, out.stderr


def test_symlink_loop_is_eloop(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    a.symlink_to(b)
    b.symlink_to(a)
    for call in (fastpersist.verify, fastpersist.load, fastpersist.open):
        with pytest.raises(OSError) as info:
            call(a)
        assert info.value.errno == errno.ELOOP, (call.__name__, info.value)
    out = subprocess.run([sys.executable, "-m", "fastpersist", "verify", str(a)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "symbolic links" in out.stderr, (out.returncode, out.stderr)


def test_missing_file_is_still_enoent(tmp_path: Path) -> None:
    for call in (fastpersist.verify, fastpersist.open):
        with pytest.raises(FileNotFoundError):
            call(tmp_path / "none.pt")
    dangling = tmp_path / "d.pt"
    dangling.symlink_to(tmp_path / "gone.pt")
    with pytest.raises(FileNotFoundError):
        fastpersist.verify(dangling)


def test_socket_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.pt"
    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(path))
        for call in (fastpersist.verify, fastpersist.load, fastpersist.open):
            with pytest.raises(OSError) as info:
                call(path)
            assert info.value.errno == errno.ESPIPE and "socket" in str(info.value), info.value
    finally:
        s.close()


@pytest.mark.parametrize("device", ["/dev/null", "/dev/zero"])
def test_character_device_is_refused(device: str) -> None:
    """/dev/null used to verify as "the file is empty" (a corrupt checkpoint); /dev/zero
    read zeros without end."""
    if not os.path.exists(device):
        pytest.skip(f"no {device}")
    for call in (fastpersist.verify, fastpersist.load, fastpersist.open):
        with pytest.raises(OSError) as info:
            call(device)
        assert info.value.errno == errno.ENODEV and "character device" in str(info.value), info.value


def test_directory_where_a_file_is_expected(tmp_path: Path) -> None:
    d = tmp_path / "ckpt.pt"
    d.mkdir()
    with pytest.raises(IsADirectoryError):
        fastpersist.open(d)
    with pytest.raises(IsADirectoryError):  # torch.load's own error, as before
        fastpersist.load(d)
    assert fastpersist.verify(d).status == "corrupt"  # a directory is taken for a DCP checkpoint: not one


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_permission_denied_is_eacces(tmp_path: Path) -> None:
    p = tmp_path / "c.pt"
    fastpersist.save({"w": torch.ones(2)}, p)
    p.chmod(0)
    for call in (fastpersist.verify, fastpersist.load, fastpersist.open):
        with pytest.raises(PermissionError):
            call(p)
