"""The native CRC-32 against zlib: every code path (table, PCLMUL, VPCLMUL where the
CPU has them), every length around their block sizes, unaligned starts, chaining."""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest

_native = pytest.importorskip("fastpersist._native", reason="native extension not built")

RNG = random.Random(1234)
DATA = np.frombuffer(RNG.randbytes(3 << 20), dtype=np.uint8).copy()
BASE = DATA.ctypes.data


def _check(off: int, n: int, seed: int) -> None:
    got = _native.crc32(BASE + off, n, seed)
    assert got == zlib.crc32(DATA[off : off + n].tobytes(), seed), (off, n, seed)


def test_every_length_up_to_2100_bytes_at_unaligned_starts() -> None:
    # 2100 covers the table path (< 128), PCLMUL (>= 128) and VPCLMUL (>= 512) with
    # every remainder of their 16/64/256-byte steps.
    for n in range(2100):
        _check(RNG.randrange(64), n, RNG.randrange(1 << 32))


def test_large_random_lengths_and_offsets() -> None:
    for _ in range(200):
        off = RNG.randrange(4096)
        _check(off, RNG.randrange(len(DATA) - off), RNG.randrange(1 << 32))


def test_chaining_and_combine_match_one_pass() -> None:
    n = len(DATA)
    whole = zlib.crc32(DATA.tobytes())
    for cut in (1, 255, 256, 4097, n // 2 + 3, n - 1):
        first = _native.crc32(BASE, cut)
        assert _native.crc32(BASE + cut, n - cut, first) == whole
        second = _native.crc32(BASE + cut, n - cut)
        assert _native.crc32_combine(first, second, n - cut) == whole


def test_crc32_many_matches_zlib_per_range():
    """``crc32_many``: one CRC-32 per (ptr, length) range, in order, equal to zlib's,
    empty ranges included; bad input raises instead of reading anywhere."""
    import zlib

    import pytest
    import torch

    from fastpersist import _native

    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    p = data.data_ptr()
    raw = data.numpy().tobytes()
    ranges = [(p, 0), (p, 1), (p + 7, 4096), (p + 100, (1 << 20) - 100), (p, 1 << 20)]
    want = [zlib.crc32(raw[o - p:o - p + n]) for o, n in ranges]
    assert _native.crc32_many(ranges) == want
    assert _native.crc32_many([]) == []
    with pytest.raises((TypeError, ValueError)):
        _native.crc32_many([(p,)])
