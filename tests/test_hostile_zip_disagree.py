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
from fastpersist.errors import CheckpointFormatError, ChecksumError, ZipFormatError
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


def _both_say(raw: bytes, src: Path, method: int) -> tuple[bytes, str]:
    """The data record's method set to ``method`` in its local header and its directory
    entry alike: a file at one with itself, whose bytes are still the stored ones."""
    e = next(e for e in read_zip_index(src).entries if e.name.endswith("data/0"))
    bad = bytearray(raw)
    _put(bad, e.header_offset + 8, "<H", method)
    _put(bad, e.cd_offset + 10, "<H", method)
    return bytes(bad), e.name


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))


def _stream(tmp_path: Path, writer: str, method: int) -> None:
    """stream_weights over a model's file whose first record is marked compressed."""
    src = tmp_path / "model.pt"
    (fastpersist.save if writer == "fastpersist" else torch.save)(_Blocks().state_dict(), src)
    bad, _name = _both_say(src.read_bytes(), src, method)
    src.write_bytes(bad)
    fastpersist.stream_weights(_Blocks(), src)


@pytest.mark.parametrize("method", [8, 12])
def test_record_marked_compressed_everywhere_is_refused_on_every_load_path(original, tmp_path: Path,
                                                                           method: int) -> None:
    """Issue 33, case 1: a record that says deflated (or bzip2) in both headers. torch.load
    returned heap memory for it (different values on every load); every fastpersist load
    path refuses it with a ZipFormatError that names the record, and verify reports it."""
    src, raw = original
    bad, name = _both_say(raw, src, method)
    p = tmp_path / "bad.pt"
    p.write_bytes(bad)
    assert not fastpersist.verify(p).ok
    target = {"w": torch.zeros(2, 3), "i": torch.zeros(5, dtype=torch.int64), "step": 0}
    calls = {
        "load": lambda: fastpersist.load(p, weights_only=False),
        "load(weights_only)": lambda: fastpersist.load(p, weights_only=True),
        "load(mmap)": lambda: fastpersist.load(p, weights_only=True, mmap=True),
        "load(checksum off)": lambda: fastpersist.load(p, config=fastpersist.Config(checksum=False)),
        "load(map_location=cpu)": lambda: fastpersist.load(p, map_location="cpu", weights_only=True),
        "load_state_dict": lambda: fastpersist.load_state_dict(target, p),
        "open+get_many": lambda: _read_all(p),
    }
    for what, call in calls.items():
        with pytest.raises(ZipFormatError, match=f"'{name}'.*compress.*method {method}") as info:
            call()
        assert info.value.path == str(p), what
    for writer in ("torch", "fastpersist"):
        with pytest.raises(ZipFormatError, match=f"data/0'.*compress.*method {method}"):
            _stream(tmp_path, writer, method)
    fastpersist.patch_torch_save()
    try:
        with pytest.raises(Exception, match=f"'{name}'.*compress"):
            torch.load(p, weights_only=True)  # the switch's torch.load
    finally:
        fastpersist.unpatch_torch_save()


@pytest.mark.parametrize("lie", ["truncated-stream", "longer", "shorter", "crc"])
def test_deflated_records_that_do_not_inflate_to_their_bytes_are_refused(tmp_path: Path, lie: str) -> None:
    """A genuinely deflated file (repacked by a zip tool) loads as torch loads it
    (tests/test_load_safety.py); one whose deflated record does not inflate to exactly its
    recorded size and CRC-32 is refused, on the plain and the mmap path."""
    import zipfile

    src = tmp_path / "c.pt"
    torch.save({"w": torch.arange(50_000, dtype=torch.float32) % 5}, src)
    p = tmp_path / "deflated.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(p, "w", compression=zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))
    assert torch.equal(fastpersist.load(p, weights_only=True)["w"], torch.load(src)["w"])
    e = next(e for e in read_zip_index(p).entries if e.name.endswith("data/0"))
    raw = bytearray(p.read_bytes())
    if lie == "truncated-stream":  # the stream's last bytes replaced: no end-of-stream marker
        raw[e.data_offset + e.compressed_size - 4 : e.data_offset + e.compressed_size] = b"\0\0\0\0"
    elif lie == "longer":  # both headers say fewer bytes than the stream inflates to
        for at in (e.header_offset + 22, e.cd_offset + 24):
            _put(raw, at, "<I", e.uncompressed_size - 4)
    elif lie == "shorter":
        for at in (e.header_offset + 22, e.cd_offset + 24):
            _put(raw, at, "<I", e.uncompressed_size + 4)
    else:
        for at in (e.header_offset + 14, e.cd_offset + 16):
            _put(raw, at, "<I", e.crc32 ^ 1)
    p.write_bytes(raw)
    for mmap in (False, True):
        with pytest.raises(ZipFormatError, match=f"'{e.name}'.*compressed.*inflate"):
            fastpersist.load(p, weights_only=True, mmap=mmap)
