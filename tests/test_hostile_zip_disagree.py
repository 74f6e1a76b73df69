"""A zip whose central directory and local headers disagree (issue 24, case 6).

The property: a file that our own zip index calls inconsistent (``verify`` reports it
corrupt) is refused by every reader with :class:`CheckpointFormatError` (or
``ChecksumError``); it is never handed to ``torch.load``, which believes the central
directory alone. A central directory that says "deflated" over a record whose local
header says "stored" made torch.load return heap memory it never filled.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

import fastpersist
from fastpersist.errors import CheckpointFormatError, ChecksumError
from fastpersist.formats.zipindex import ZipEntry, read_zip_index

REFUSED = (CheckpointFormatError, ChecksumError)


def _state() -> dict:
    return {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "i": torch.arange(5), "step": 7}


def _put(buf: bytearray, at: int, fmt: str, value: int) -> None:
    buf[at : at + struct.calcsize(fmt)] = struct.pack(fmt, value)


# Each lie edits one record: (name, edit(buf, entry)). Offsets are those of APPNOTE 4.3.7
# (local header) and 4.3.12 (central directory header).
Edit = Callable[[bytearray, ZipEntry], None]
LIES: dict[str, Edit] = {
    "cd-deflated-local-stored": lambda b, e: _put(b, e.cd_offset + 10, "<H", 8),
    "cd-bzip2-local-stored": lambda b, e: _put(b, e.cd_offset + 10, "<H", 12),
    "cd-encrypted-local-not": lambda b, e: _put(b, e.cd_offset + 8, "<H", 1),
    "cd-descriptor-flag-local-not": lambda b, e: _put(b, e.cd_offset + 8, "<H", 8),
    "local-descriptor-flag-cd-not": lambda b, e: _put(b, e.header_offset + 6, "<H", 8),
    "local-crc-differs": lambda b, e: _put(b, e.header_offset + 14, "<I", e.crc32 ^ 0x5A5A),
    "local-csize-differs": lambda b, e: _put(b, e.header_offset + 18, "<I", e.compressed_size + 1),
    "local-usize-differs": lambda b, e: _put(b, e.header_offset + 22, "<I", e.uncompressed_size + 7),
    "local-name-differs": lambda b, e: b.__setitem__(e.header_offset + 30 + len(e.name) - 1,
                                                     (b[e.header_offset + 30 + len(e.name) - 1] ^ 0x01)),
    "cd-usize-differs": lambda b, e: _put(b, e.cd_offset + 24, "<I", e.uncompressed_size + 4),
    "cd-offset-points-elsewhere": lambda b, e: _put(b, e.cd_offset + 42, "<I", e.header_offset + 1),
}


def _cases(raw: bytes, src: Path) -> Iterator[tuple[str, bytes]]:
    for e in read_zip_index(src).entries:
        for lie, edit in LIES.items():
            bad = bytearray(raw)
            edit(bad, e)
            if bytes(bad) != raw:
                yield f"{lie}:{e.name}", bytes(bad)


@pytest.fixture(scope="module", params=["fastpersist", "torch"])
def original(request, tmp_path_factory) -> tuple[Path, bytes]:
    p = tmp_path_factory.mktemp("orig") / "c.pt"
    (fastpersist.save if request.param == "fastpersist" else torch.save)(_state(), p)
    return p, p.read_bytes()


def _read_all(p: Path) -> None:
    """fastpersist.open() reads lazily: each tensor's local header is checked when it is read."""
    with fastpersist.open(p) as f:
        f.get_many(list(f.keys()))


def _refused(call: Callable[[], object]) -> str:
    try:
        call()
    except REFUSED as e:
        return f"refused ({type(e).__name__})"
    except Exception as e:  # noqa: BLE001 - reported below
        return f"other error {type(e).__name__}: {e}"
    return "loaded"


def test_verify_and_load_agree_on_inconsistent_indexes(original, tmp_path: Path) -> None:
    """Every record, every kind of directory/local-header disagreement: verify reports
    the file corrupt, and load (both unpicklers, mmap, checksums off) and reading every
    tensor through open() refuse it."""
    src, raw = original
    p = tmp_path / "bad.pt"
    wrong: list[str] = []
    tried = 0
    for label, bad in _cases(raw, src):
        p.write_bytes(bad)
        res = fastpersist.verify(p)
        if res.ok:
            wrong.append(f"{label}: verify ok")
            continue
        tried += 1
        calls = {
            "load": lambda: fastpersist.load(p, weights_only=False),
            "load(weights_only)": lambda: fastpersist.load(p, weights_only=True),
            "load(mmap)": lambda: fastpersist.load(p, weights_only=True, mmap=True),
            "load(checksum off)": lambda: fastpersist.load(p, config=fastpersist.Config(checksum=False)),
            "open+get_many": lambda: _read_all(p),
        }
        for what, call in calls.items():
            got = _refused(call)
            if not got.startswith("refused"):
                wrong.append(f"{label}: {what} {got}")
    assert tried > 0
    assert not wrong, f"{len(wrong)} of {tried} inconsistent files not refused:\n" + "\n".join(wrong[:40])


def test_cd_deflated_local_stored_is_a_format_error(original, tmp_path: Path) -> None:
    """The issue's case: the directory says deflated, the local header stored."""
    src, raw = original
    e = next(e for e in read_zip_index(src).entries if e.name.endswith("data/0"))
    bad = bytearray(raw)
    _put(bad, e.cd_offset + 10, "<H", 8)
    p = tmp_path / "bad.pt"
    p.write_bytes(bad)
    assert not fastpersist.verify(p).ok
    for weights_only in (False, True):
        with pytest.raises(CheckpointFormatError, match="method"):
            fastpersist.load(p, weights_only=weights_only)
