"""A ``.safetensors`` load sees one file even while saves replace it.

Every save replaces the file by rename. A reader that opens the path once for the
header and again for the data can pair the header of one file with the bytes of
the next: with ``checksum=False`` (or a file without fastpersist CRCs, e.g. one
written by the safetensors library) the load silently returns mixed tensors, with
checksums a false ``ChecksumError`` says an intact file is corrupt. Every
safetensors reader opens the path once and reads header and data through that
descriptor; these tests hold it to that (the deterministic ones fail on a reader
that opens the path twice).
"""

from __future__ import annotations

import os
import shutil
import threading
from typing import Any, Callable

import pytest
import torch

import fastpersist
from fastpersist.formats import mmapload
from fastpersist.formats import safetensors as fst
from fastpersist.formats.safetensors import header as fst_header
from fastpersist.formats.safetensors import load as fst_load

_native = pytest.importorskip("fastpersist._native", reason="native extension not built")


def state_a() -> dict[str, torch.Tensor]:
    return {"a": torch.full((300_000,), 1.0), "b": torch.full((300_000,), -2.0)}


def state_b() -> dict[str, torch.Tensor]:
    # another layout: other sizes, another dtype, one more tensor
    return {"a": torch.full((200_000,), 3.0, dtype=torch.float64), "b": torch.full((400_001,), -4.0),
            "c": torch.arange(1000, dtype=torch.int32)}


STATES = (state_a(), state_b())


def _write(state: dict[str, torch.Tensor], path: str, writer: str) -> None:
    if writer == "crc":
        fastpersist.save(state, path, config=fastpersist.Config(checksum=True, fsync=False))
    elif writer == "nocrc":
        fastpersist.save(state, path, config=fastpersist.Config(checksum=False, fsync=False))
    else:  # the safetensors library: no fastpersist CRCs, its own layout
        st = pytest.importorskip("safetensors.torch")
        st.save_file(state, path)


def _which(out: dict[str, torch.Tensor]) -> int:
    """The index of the state ``out`` equals exactly; fails if it equals neither."""
    for i, s in enumerate(STATES):
        if set(out) == set(s) and all(
            out[k].dtype == s[k].dtype and out[k].shape == s[k].shape and torch.equal(out[k], s[k]) for k in s
        ):
            return i
    shapes = {k: (tuple(v.shape), v.dtype, v.flatten()[:1].tolist(), v.flatten()[-1:].tolist()) for k, v in out.items()}
    raise AssertionError(f"the load returned neither saved state (mixed files?): {shapes}")


@pytest.fixture
def two_files(tmp_path: Any) -> Callable[[str], tuple[str, str, str]]:
    """``make(writer)``: (path, a, b): ``path`` holds state A; ``a``/``b`` are spare
    files of state A/B to rename over it."""

    def make(writer: str) -> tuple[str, str, str]:
        a = str(tmp_path / "a.src.safetensors")
        b = str(tmp_path / "b.src.safetensors")
        _write(STATES[0], a, writer)
        _write(STATES[1], b, writer)
        path = str(tmp_path / "m.safetensors")
        shutil.copyfile(a, path)
        return path, a, b

    return make


# ------------------------------------------------------------------ a renaming writer


def _replace_with(src: str, path: str, tag: str) -> None:
    """Atomically put a copy (a new inode) of ``src`` at ``path``, like a save does."""
    tmp = f"{path}.{tag}.tmp"
    os.link(src, tmp)  # a new name for an intact file; the rename makes it the path's file
    os.replace(tmp, path)


@pytest.mark.parametrize("writer", ["crc", "nocrc", "library"])
@pytest.mark.parametrize("how", ["load", "load-nochecksum", "mmap", "mmap-nochecksum", "verify"])
def test_load_while_the_file_is_replaced(two_files, writer, how):
    path, a, b = two_files(writer)
    stop = threading.Event()
    errors: list[BaseException] = []

    def rename_loop() -> None:
        k = 0
        while not stop.is_set():
            k += 1
            try:
                _replace_with(b if k % 2 else a, path, "w")
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                return

    checksum = "nochecksum" not in how
    cfg = fastpersist.Config(checksum=checksum)
    th = threading.Thread(target=rename_loop)
    th.start()
    seen = [0, 0]
    try:
        for _ in range(80):
            if how == "verify":
                res = fastpersist.verify(path, config=cfg)
                want = "ok" if writer == "crc" else "unchecked"
                assert res.status == want, res.problems
                assert fst.check_safetensors(path, _native.Handle()).problems == []
            else:
                out = fastpersist.load(path, config=cfg, mmap=how.startswith("mmap"))
                seen[_which(out)] += 1
    finally:
        stop.set()
        th.join()
    assert not errors, errors


# ------------------------------------------------------------------ the replace exactly between header and data


def _replace_after_header(monkeypatch, path: str, src: str) -> list[int]:
    """Make the next header read (by descriptor or by path) rename ``src`` over ``path``
    right after it returns; the returned list counts the replaces."""
    done: list[int] = []

    def wrap(orig: Callable[..., Any]) -> Callable[..., Any]:
        def header_then_replace(*args: Any, **kwargs: Any) -> Any:
            header = orig(*args, **kwargs)
            if not done:
                done.append(1)
                _replace_with(src, path, "det")
            return header

        return header_then_replace

    monkeypatch.setattr(fst_header, "read_header", wrap(fst_header.read_header))
    if hasattr(fst_header, "read_header_fd"):
        monkeypatch.setattr(fst_header, "read_header_fd", wrap(fst_header.read_header_fd))
    return done


@pytest.mark.parametrize("writer", ["crc", "nocrc", "library"])
@pytest.mark.parametrize("checksum", [True, False])
@pytest.mark.parametrize("mmap", [False, True])
def test_replace_between_header_and_data_load(two_files, monkeypatch, writer, checksum, mmap):
    path, a, b = two_files(writer)
    done = _replace_after_header(monkeypatch, path, b)
    out = fastpersist.load(path, config=fastpersist.Config(checksum=checksum), mmap=mmap)
    assert done, "the header read was not intercepted"
    assert _which(out) == 0
    # the path now holds B, and a new load sees B
    assert _which(fastpersist.load(path, config=fastpersist.Config(checksum=checksum), mmap=mmap)) == 1


@pytest.mark.parametrize("writer", ["crc", "nocrc", "library"])
@pytest.mark.parametrize("checksum", [True, False])
def test_replace_between_header_and_data_low_level(two_files, monkeypatch, writer, checksum):
    """``load_safetensors`` itself, with a plain native handle."""
    path, a, b = two_files(writer)
    done = _replace_after_header(monkeypatch, path, b)
    out = fst.load_safetensors(path, _native.Handle(), checksum=checksum)
    assert done
    assert _which(out) == 0


@pytest.mark.parametrize("writer", ["crc", "nocrc", "library"])
@pytest.mark.parametrize("checksum", [True, False])
def test_replace_between_header_and_data_ring(two_files, monkeypatch, writer, checksum):
    """The CUDA route of ``load_safetensors`` (every tensor through the ring), here
    with CPU destinations so that it runs without a GPU."""
    path, a, b = two_files(writer)
    orig = fst_load._load_via_ring
    routed: list[int] = []

    def on_cpu(path_: str, header: Any, handle: Any, device: torch.device, **kw: Any) -> Any:
        routed.append(1)
        return orig(path_, header, handle, torch.device("cpu"), **kw)

    monkeypatch.setattr(fst_load, "_load_via_ring", on_cpu)
    done = _replace_after_header(monkeypatch, path, b)
    out = fst.load_safetensors(path, _native.Handle(), device=torch.device("cuda"), checksum=checksum)
    assert done and routed
    assert _which(out) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("checksum", [True, False])
def test_replace_between_header_and_data_cuda(two_files, monkeypatch, checksum):
    path, a, b = two_files("nocrc")
    done = _replace_after_header(monkeypatch, path, b)
    out = fastpersist.load(path, map_location="cuda", config=fastpersist.Config(checksum=checksum))
    assert done
    assert _which({k: v.cpu() for k, v in out.items()}) == 0


@pytest.mark.parametrize("writer", ["crc", "nocrc"])
def test_replace_between_header_and_data_verify(two_files, monkeypatch, writer):
    path, a, b = two_files(writer)
    done = _replace_after_header(monkeypatch, path, b)
    res = fastpersist.verify(path)
    assert done
    assert res.status == ("ok" if writer == "crc" else "unchecked"), res.problems
    done.clear()
    _replace_with(a, path, "back")
    check = fst.check_safetensors(path, _native.Handle())
    assert done
    assert check.problems == [] and check.records == 2
    assert check.checked == (writer == "crc")


def test_mmap_reader_uses_one_descriptor(two_files, monkeypatch):
    """The checked mmap load is one of the readers held to this (it reads the header
    through the descriptor it maps)."""
    path, a, b = two_files("crc")
    done = _replace_after_header(monkeypatch, path, b)
    out = mmapload.load_safetensors_mmap(path, _native.Handle(), checksum=True)
    assert done
    assert _which(out) == 0


# ------------------------------------------------------------------ errors still name the user's path


@pytest.mark.parametrize("ring", [False, True])
@pytest.mark.parametrize("checksum", [True, False])
def test_read_errors_name_the_path_given(two_files, monkeypatch, checksum, ring):
    """The data is read through a descriptor; an error still names the path the user gave
    (``ring``: the CUDA route, with CPU destinations)."""
    path, a, b = two_files("crc")
    device = torch.device("cpu")
    if ring:
        orig_ring = fst_load._load_via_ring
        monkeypatch.setattr(fst_load, "_load_via_ring", lambda p, h, hd, d, **kw: orig_ring(p, h, hd, torch.device("cpu"), **kw))
        device = torch.device("cuda")
    monkeypatch.chdir(os.path.dirname(path))
    rel = os.path.basename(path)
    orig = fst_header.read_header_fd

    def header_then_truncate(*args: Any, **kwargs: Any) -> Any:
        header = orig(*args, **kwargs)
        os.truncate(rel, header.data_start + 16)  # shrunk in place after the header was read
        return header

    monkeypatch.setattr(fst_header, "read_header_fd", header_then_truncate)
    with pytest.raises(EOFError) as info:
        fst.load_safetensors(rel, _native.Handle(), device=device, checksum=checksum)
    msg = str(info.value)
    assert msg.startswith(rel) and "/proc/self/fd" not in msg
