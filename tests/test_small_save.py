"""Small saves: a write of up to 32 MiB runs on the calling thread (issue 35).

The native writer computes such a write's CRCs first, then writes its chunks in file
order, each from the caller's memory or through one staging buffer with its CRC patches
applied (the unaligned head and tail through the page cache, the aligned chunks with
O_DIRECT), with no engine threads and no hand-off to the pool. These tests hold it
to what the ring path writes (byte for byte), to torch.load (bit-exact round trips at
the sizes around the threshold), and to the fault guarantees (an I/O error raises an
OSError naming errno and path and keeps the previous checkpoint; short writes and EINTR
are retried). The staging buffers take the page size ``prefault.staging_huge_pages()`` gives.
"""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch

import fastpersist
from fastpersist import _native, io, prefault
from fastpersist.commit import TMP_MARKER

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _no_faults():
    yield
    _native.clear_faults()


def _state(nbytes: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    per = max(nbytes // 8 // 4, 1)
    state = {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(7)}
    state["ids"] = torch.arange(per, dtype=torch.int64)
    state["half"] = torch.randn(333, generator=g).half()  # an odd size: unaligned tail
    state["step"] = 7
    return state


def _same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert torch.equal(got[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)), k
        else:
            assert got[k] == v, k


@pytest.mark.parametrize("nbytes", [64, 256 << 10, 1 * MiB, 9 * MiB, 31 * MiB, 40 * MiB])
def test_small_saves_load_back_bit_exact(tmp_path, nbytes):
    state = _state(nbytes, seed=nbytes)
    path = tmp_path / "small.pt"
    fastpersist.save(state, path)
    _same(torch.load(path, weights_only=True), state)
    _same(fastpersist.load(path), state)
    assert fastpersist.verify(path).ok
    assert [p.name for p in tmp_path.iterdir() if TMP_MARKER in p.name] == []


def _extents(buf: torch.Tensor, start: int, cuts: list[int]) -> tuple[list, list]:
    """Write extents over ``buf`` from file offset ``start``, cut at ``cuts``; slot 0 covers
    the pieces after the first, whose CRC is patched into the first piece (u32) and into the
    last (hex): a header placed before the data it checksums, and a trailer after it."""
    base = buf.data_ptr()
    bounds = [0, *cuts, buf.numel()]
    ext = [(start + lo, base + lo, hi - lo, -1 if i == 0 or i == len(bounds) - 2 else 0)
           for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]
    patches = [(start + 8, 0, 0), (start + bounds[-2] + 4, 0, 1)]
    return ext, patches


@pytest.mark.parametrize("start,length", [(s, n) for s in (0, 1000, 4096, 5000) for n in (700, 4096 * 3 + 17, 3 * MiB + 123)]
                         + [(0, 33 * MiB + 5), (1000, 33 * MiB + 5)])
def test_the_inline_write_writes_what_the_ring_path_writes(tmp_path, start, length):
    """Up to 32 MiB the write runs inline (every chunk size), above it through the ring:
    the same bytes and CRCs either way, patches before and after their data included."""
    g = torch.Generator().manual_seed(length + start)
    buf = torch.randint(0, 256, (length,), dtype=torch.uint8, generator=g)
    cuts = [64, 64 + length // 3, length - 40]
    ext, patches = _extents(buf, start, cuts)
    crc = zlib.crc32(buf[64:length - 40].numpy().tobytes())
    want = bytearray(b"\xab" * start) + bytearray(buf.numpy().tobytes())
    want[start + 8:start + 12] = crc.to_bytes(4, "little")
    want[start + length - 40 + 4:start + length - 40 + 12] = f"{crc:08x}".encode()
    for name, chunk in (("8MiB", 8 * MiB), ("64KiB", 64 << 10)):
        path = tmp_path / f"{name}.bin"
        path.write_bytes(b"\xab" * start)
        h = _native.Handle("auto", chunk, 4, 2, True, 1)
        assert h.write(str(path), ext, patches, 1, truncate=False, fsync=True) == [crc], name
        assert path.read_bytes() == bytes(want), name


@pytest.fixture
def previous(tmp_path):
    path = tmp_path / "ckpt.pt"
    old = _state(MiB, seed=1)
    fastpersist.save(old, path)
    digest, ino = hashlib.sha256(path.read_bytes()).hexdigest(), os.stat(path).st_ino
    yield path
    _native.clear_faults()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest, "previous checkpoint modified"
    assert os.stat(path).st_ino == ino, "previous checkpoint replaced"
    _same(torch.load(path, weights_only=True), old)
    assert [p.name for p in tmp_path.iterdir() if TMP_MARKER in p.name] == []


@pytest.mark.parametrize("action,code", [("EIO", errno.EIO), ("ENOSPC", errno.ENOSPC)])
@pytest.mark.parametrize("nth", [1, 2])
def test_a_failed_small_write_raises_and_keeps_the_previous_checkpoint(previous, action, code, nth):
    _native.set_fault("write", nth, action)
    with pytest.raises(OSError) as info:
        fastpersist.save(_state(MiB, seed=2), previous)
    assert _native.fault_hits() == 1
    assert info.value.errno == code and info.value.filename == str(previous)
    assert TMP_MARKER in str(info.value)


def test_a_failed_small_fsync_raises_and_keeps_the_previous_checkpoint(previous):
    _native.set_fault("fsync", 1, "EIO")
    with pytest.raises(OSError) as info:
        fastpersist.save(_state(MiB, seed=2), previous)
    assert _native.fault_hits() == 1
    assert info.value.errno == errno.EIO and info.value.filename == str(previous)


@pytest.mark.parametrize("action,nth,count", [("short", 1, 1), ("short", 1, 3), ("eintr", 1, 2), ("eintr", 2, 1)])
def test_short_and_interrupted_small_writes_are_exact(tmp_path, action, nth, count):
    state = _state(MiB, seed=3)
    fastpersist.save(state, tmp_path / "ref.pt")
    _native.set_fault("write", nth, action, count)
    fastpersist.save(state, tmp_path / "x.pt")
    assert _native.fault_hits() == count
    _native.clear_faults()
    assert (tmp_path / "x.pt").read_bytes() == (tmp_path / "ref.pt").read_bytes()


def test_staging_buffers_take_the_page_size_the_setting_gives(monkeypatch):
    io.native_module()
    assert _native.staging_huge_pages() is prefault.staging_huge_pages()
    for value, huge in (("", True), ("auto", True), ("on", True), ("off", False), ("0", False)):
        monkeypatch.setenv(prefault.HUGE_PAGES_ENV, value)
        assert prefault.staging_huge_pages() is huge, value


_SMAPS_CHILD = textwrap.dedent(
    """
    import sys, torch, fastpersist
    fastpersist.save({"w": torch.randn(1 << 18), "b": torch.randn(77)}, sys.argv[1])
    flags, size = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            if line.startswith("Size:"):
                size = int(line.split()[1])
            elif line.startswith("VmFlags:") and size == 8192:
                flags.append(line.split()[1:])
    print(" ".join(sorted({"hg" if "hg" in f else "nh" if "nh" in f else "-" for f in flags})))
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs /proc/self/smaps")
@pytest.mark.parametrize("setting,flag", [("off", "nh"), ("auto", "hg")])
def test_a_save_staging_buffer_is_advised_as_the_setting_says(tmp_path, setting, flag):
    env = dict(os.environ, **{prefault.HUGE_PAGES_ENV: setting})
    out = subprocess.run([sys.executable, "-c", _SMAPS_CHILD, str(tmp_path / "a.pt")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert flag in out.stdout.split(), out.stdout  # the kept 8 MiB staging buffer of the save


# The fault matrix's states are small enough for the inline path now: the ring (fills on the
# pool, writes on the engine's threads) keeps its own fault tests here, above 32 MiB.

def _ring_cfg() -> fastpersist.Config:
    return fastpersist.Config(chunk_size=1 * MiB, queue_depth=4, threads=2)


@pytest.mark.parametrize("action,code,nth", [("EIO", errno.EIO, 3), ("ENOSPC", errno.ENOSPC, 20)])
def test_a_failed_ring_write_raises_and_keeps_the_previous_checkpoint(previous, action, code, nth):
    _native.set_fault("write", nth, action)
    with pytest.raises(OSError) as info:
        fastpersist.save(_state(40 * MiB, seed=4), previous, config=_ring_cfg())
    assert _native.fault_hits() == 1
    assert info.value.errno == code and info.value.filename == str(previous)


@pytest.mark.parametrize("action,nth,count", [("short", 2, 3), ("eintr", 5, 4)])
def test_short_and_interrupted_ring_writes_are_exact(tmp_path, action, nth, count):
    state = _state(40 * MiB, seed=5)
    fastpersist.save(state, tmp_path / "ref.pt", config=_ring_cfg())
    _native.set_fault("write", nth, action, count)
    fastpersist.save(state, tmp_path / "x.pt", config=_ring_cfg())
    assert _native.fault_hits() == count
    _native.clear_faults()
    assert (tmp_path / "x.pt").read_bytes() == (tmp_path / "ref.pt").read_bytes()
    _same(torch.load(tmp_path / "x.pt", weights_only=True), state)
