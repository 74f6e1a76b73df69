"""The native bulk copy with its CRC-32 (native/src/copy.cpp), as every save, staged
load and async snapshot uses it: bytes and CRCs equal a plain copy and zlib for
lengths around the streaming threshold and its 64-byte steps, at unaligned source
and destination addresses, with the streaming stores on (default) and off
(``FASTPERSIST_COPY=plain``, read once per process, so checked in a child)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import zlib

import pytest
import torch

_native = pytest.importorskip("fastpersist._native", reason="native extension not built")

STREAM_MIN = 256 << 10  # kStreamMin in native/include/fastpersist/copy.hpp


def _cases() -> list[tuple[int, int, int]]:
    rng = random.Random(7)
    lengths = [0, 1, 15, 16, 63, 64, 65, 4095, STREAM_MIN - 1, STREAM_MIN, STREAM_MIN + 1,
               STREAM_MIN + 63, 2 * STREAM_MIN + 17, (4 << 20) + 5, (9 << 20) - 3]
    return [(n, rng.randrange(64), rng.randrange(64)) for n in lengths]


def check_copies() -> None:
    h = _native.Handle(threads=2)
    src_buf = torch.randint(0, 256, ((10 << 20) + 128,), dtype=torch.uint8)
    for n, so, do in _cases():
        dst_buf = torch.full(((10 << 20) + 128,), 0xA5, dtype=torch.uint8)
        src = src_buf[so:so + n]
        dst = dst_buf[do:do + n]
        (crc,) = h.copy_ranges([(dst.data_ptr(), src.data_ptr(), n)], crc=True)
        assert torch.equal(dst, src), (n, so, do)
        assert crc == zlib.crc32(src.numpy().tobytes()), (n, so, do)
        # nothing written around the destination
        assert bool((dst_buf[:do] == 0xA5).all()) and bool((dst_buf[do + n:] == 0xA5).all()), (n, so, do)
        if n:
            dst_buf[do:do + n] = 0
            assert h.copy_ranges([(dst.data_ptr(), src.data_ptr(), n)]) == [0]  # no CRC asked
            assert torch.equal(dst, src)


def test_streaming_copy_bytes_and_crcs() -> None:
    check_copies()


def test_plain_copy_bytes_and_crcs() -> None:
    code = "import sys; sys.path.insert(0, sys.argv[1]); import test_copy; test_copy.check_copies()"
    env = dict(os.environ, FASTPERSIST_COPY="plain")
    r = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_saves_and_loads_are_the_same_with_either_copy(tmp_path) -> None:
    """A save and a staged load through each copy mode write and read the same bytes."""
    code = (
        "import sys, torch, fastpersist\n"
        "st = {'a': torch.arange(3 << 18, dtype=torch.float32), 'b': torch.ones(1000, dtype=torch.float64)}\n"
        "fastpersist.save(st, sys.argv[1])\n"
        "got = fastpersist.load(sys.argv[1], config=fastpersist.Config(read_mode='direct', read_staging='on'))\n"
        "assert all(torch.equal(got[k], st[k]) for k in st)\n"
    )
    paths = []
    for mode in ("plain", "stream"):
        env = dict(os.environ)
        env.pop("FASTPERSIST_COPY", None)
        if mode == "plain":
            env["FASTPERSIST_COPY"] = "plain"
        p = str(tmp_path / f"{mode}.pt")
        r = subprocess.run([sys.executable, "-c", code, p], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        paths.append(p)
    with open(paths[0], "rb") as a, open(paths[1], "rb") as b:
        assert a.read() == b.read()
