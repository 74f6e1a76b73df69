"""PieceCrcs: records' CRC-32s computed over pieces that arrive out of file order."""

from __future__ import annotations

import ctypes
import io
import random
import zlib

import torch

from fastpersist.formats.piececrc import PieceCrcs
from fastpersist.formats.zipindex import buffer_reader, parse_zip_index, read_central_directory


def _file() -> bytes:
    g = torch.Generator().manual_seed(1)
    obj = {"w": torch.randn(300, 200, generator=g), "small": [torch.randn(i + 1, generator=g) for i in range(40)],
           "e": torch.empty(0), "i": torch.arange(5000, dtype=torch.int16)}
    b = io.BytesIO()
    torch.save(obj, b)
    return b.getvalue()


def _pieces(size: int, piece: int, seed: int) -> list[tuple[int, int]]:
    out = [(a, min(size, a + piece)) for a in range(0, size, piece)]
    random.Random(seed).shuffle(out)
    return out


def _expected(data: bytes) -> dict[tuple[int, int], int]:
    index = parse_zip_index(buffer_reader(data), len(data))
    return {(e.data_offset, e.compressed_size): zlib.crc32(data[e.data_offset : e.data_offset + e.compressed_size])
            for e in index.entries if e.compressed_size}


def test_every_record_crc_whatever_the_arrival_order() -> None:
    data = _file()
    buf = ctypes.create_string_buffer(data, len(data))
    entries = read_central_directory(buffer_reader(data), len(data))[1]
    want = _expected(data)
    # pieces smaller than a local header, odd sizes that cut headers and records, one piece
    for piece, seed in ((17, 0), (4093, 1), (65536, 2), (len(data), 3)):
        crcs = PieceCrcs(entries, len(data), ctypes.addressof(buf))
        for a, b in _pieces(len(data), piece, seed):
            crcs.arrived(a, b)
        assert crcs.finish() == want, piece


def test_a_record_with_a_missing_piece_is_left_to_the_loader() -> None:
    data = _file()
    buf = ctypes.create_string_buffer(data, len(data))
    entries = read_central_directory(buffer_reader(data), len(data))[1]
    want = _expected(data)
    pieces = _pieces(len(data), 4096, 5)
    hole = pieces.pop()
    crcs = PieceCrcs(entries, len(data), ctypes.addressof(buf))
    for a, b in pieces:
        crcs.arrived(a, b)
    got = crcs.finish()
    assert got  # the others are there
    for (d, n), c in got.items():
        assert want[(d, n)] == c
        assert d + n <= hole[0] or d >= hole[1], "a record over the missing piece was reported"
    touching = [k for k in want if not (k[0] + k[1] <= hole[0] or k[0] >= hole[1])]
    assert touching and not set(touching) & set(got)
