"""Staged reads (``Handle(stage_reads=True)``, ``Config.read_staging``): every chunk
lands in a staging buffer and is copied out. The bytes and the CRC-32s must be exactly
those of the zero-copy path, for any extent layout, and faults must surface the same way."""

from __future__ import annotations

import errno
import random
import zlib

import pytest
import torch

import fastpersist
import fastpersist.io as fio
from fastpersist import _native
from fastpersist.errors import ChecksumError
from fastpersist.testing import inject_fault

KiB = 1024
CHUNK = 64 * KiB
CPU_ENGINES = [e for e in fio.available_engines() if e != "cufile"]


def _file(tmp_path, n: int, seed: int = 0):
    data = random.Random(seed).randbytes(n)
    path = tmp_path / f"src-{seed}-{n}.bin"
    path.write_bytes(data)
    return path, data


def _layouts(n: int, rng: random.Random) -> list[list[tuple[int, int]]]:
    """(file offset, length) lists: whole file, aligned pieces, odd pieces with gaps
    (small gaps are read through, large ones skipped), many tiny extents."""
    whole = [(0, n)]
    aligned = [(o, min(4 * KiB * 5, n - o)) for o in range(0, n, 4 * KiB * 5)]
    odd, pos = [], 17
    while pos < n:
        ln = min(rng.randrange(1, 3 * CHUNK), n - pos)
        odd.append((pos, ln))
        pos += ln + rng.choice([0, 0, 1, 4095, 2 << 20])
    tiny = [(o, 100) for o in range(5, n - 100, 977)][:300]
    return [whole, aligned, odd, tiny]


def _read(h, path, layout, dest_offset: int) -> tuple[bytes, list[int]]:
    """Read ``layout`` into one aligned buffer (extent i at its file offset plus
    ``dest_offset``, so a 0 offset lets whole chunks go straight to the destination)
    with one CRC slot per extent; returns the buffer's bytes and the CRCs."""
    end = max(o + n for o, n in layout)
    buf = _native.PinnedBuffer(end + dest_offset + 4096, 4096, False)
    extents = [(o, buf.ptr + dest_offset + o, n, i) for i, (o, n) in enumerate(layout)]
    crcs = h.read(str(path), extents, len(layout))
    return bytes(memoryview(buf))[dest_offset : dest_offset + end], crcs


@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("dest_offset", [0, 64], ids=["aligned-dest", "unaligned-dest"])
def test_staged_reads_equal_zero_copy_reads(tmp_path, engine, direct, dest_offset) -> None:
    n = 5 * CHUNK + 3 * 4096 + 123
    path, data = _file(tmp_path, n, 1)
    rng = random.Random(7)
    staged = _native.Handle(engine, CHUNK, 4, 2, direct, 2, True)
    plain = _native.Handle(engine, CHUNK, 4, 2, direct, 2, False)
    assert staged.stage_reads and not plain.stage_reads
    for layout in _layouts(n, rng):
        got_s, crc_s = _read(staged, path, layout, dest_offset)
        got_p, crc_p = _read(plain, path, layout, dest_offset)
        assert crc_s == crc_p == [zlib.crc32(data[o : o + ln]) for o, ln in layout]
        for o, ln in layout:
            assert got_s[o : o + ln] == data[o : o + ln] == got_p[o : o + ln]


@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_staged_read_past_end_of_file_is_an_eof_error(tmp_path, engine) -> None:
    path, _ = _file(tmp_path, 3 * CHUNK, 2)
    h = _native.Handle(engine, CHUNK, 4, 2, True, 2, True)
    buf = _native.PinnedBuffer(4 * CHUNK, 4096, False)
    with pytest.raises(EOFError, match=str(path)):
        h.read(str(path), [(0, buf.ptr, 4 * CHUNK, -1)], 0)


@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("name,code", [("EIO", errno.EIO), ("ENOSPC", errno.ENOSPC)])
@pytest.mark.parametrize("nth", [1, 4])
def test_staged_read_errno_names_path_and_handle_stays_usable(tmp_path, engine, name, code, nth) -> None:
    n = 6 * CHUNK
    path, data = _file(tmp_path, n, 3)
    h = fio.IOHandle(engine=engine, block_size=CHUNK, queue_depth=4, stage_reads=True)
    assert h.stage_reads
    dst = torch.empty(n, dtype=torch.uint8)
    with inject_fault("read", nth, name) as fault:
        with pytest.raises(OSError) as ei:
            h.pread(dst, path, 0)
    assert fault.hits == 1
    assert ei.value.errno == code and ei.value.filename == str(path)
    h.pread(dst, path, 0)
    assert fio.as_bytes(dst).numpy().tobytes() == data


@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("action,count", [("short", 1), ("short", 7), ("eintr", 5)])
def test_staged_read_retries_keep_bytes_exact(tmp_path, engine, action, count) -> None:
    n = 6 * CHUNK + 999
    path, data = _file(tmp_path, n, 4)
    h = fio.IOHandle(engine=engine, block_size=CHUNK, queue_depth=4, stage_reads=True)
    dst = torch.empty(n, dtype=torch.uint8)
    with inject_fault("read", 2, action, count) as fault:
        h.pread(dst, path, 0)
    assert fault.hits == count
    assert fio.as_bytes(dst).numpy().tobytes() == data


def test_iohandle_from_config_resolves_read_staging() -> None:
    assert fio.IOHandle.from_config(fastpersist.Config(read_staging="on")).stage_reads is True
    assert fio.IOHandle.from_config(fastpersist.Config(read_staging="off")).stage_reads is False
    assert fio.IOHandle().stage_reads is False


@pytest.mark.parametrize("mode", ["on", "off"])
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_load_and_verify_in_both_modes(tmp_path, mode, suffix) -> None:
    """Same tensors as torch.load in either mode, and a flipped payload byte is
    reported by load's checksums and by verify in either mode."""
    g = torch.Generator().manual_seed(5)
    state = {f"t{i}": torch.randn(1000 + 4099 * i, generator=g) for i in range(12)}
    state["h"] = torch.randn(7, 3, generator=g).to(torch.bfloat16)
    cfg = fastpersist.Config(read_staging=mode, chunk_size=64 * KiB)
    path = tmp_path / f"s{suffix}"
    fastpersist.save(state, path, config=cfg)
    got = fastpersist.load(path, config=cfg)
    assert set(got) == set(state)
    for k, v in state.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    if suffix == ".pt":
        ref = torch.load(path, weights_only=True)
        assert all(torch.equal(ref[k], got[k]) for k in state)
    raw = bytearray(path.read_bytes())
    needle = state["t5"][100:108].numpy().tobytes()
    at = raw.find(needle)
    assert at > 0
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))
    assert not fastpersist.verify(path, config=cfg).ok
    with pytest.raises(ChecksumError):
        fastpersist.load(path, config=cfg)
