"""Adversarial files for ``fastpersist.load`` (issue 9): truncations at every offset,
every header, directory and pickle byte flipped, lying fields.

The property, for every input: ``load`` returns exactly the saved values or raises
a clear error (``CheckpointFormatError``, ``ChecksumError``, or torch's own error
for files it hands to torch); never other values, never a raw ``struct.error``,
``KeyError``, ``UnicodeDecodeError`` or ``RecursionError``.
"""

from __future__ import annotations

import pickle
import struct
import zipfile

import pytest
import torch

import fastpersist
from fastpersist.errors import CheckpointFormatError, ChecksumError
from fastpersist.formats.zipindex import read_zip_index

CLEAR = (CheckpointFormatError, ChecksumError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError,
         OSError, AssertionError, TypeError, AttributeError, ImportError, pickle.UnpicklingError)
RAW = (KeyError, struct.error, UnicodeDecodeError, RecursionError, IndexError)


def saved() -> dict:
    return {
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.tensor([1, 0, 1], dtype=torch.bool),
        "h": torch.arange(5, dtype=torch.bfloat16),
        "e": torch.empty(0),
        "step": 7,
        "name": "run",
    }


def same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
                and a.contiguous().view(-1).view(torch.uint8).tolist() == b.contiguous().view(-1).view(torch.uint8).tolist())
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


def _torch_raises(path, exc_type, weights_only: bool, **kw) -> bool:
    """Whether stock torch.load raises ``exc_type`` for the file too (e.g. a file whose
    zip signature is broken goes to torch's legacy reader, whose weights-only unpickler
    raises IndexError): then that is torch's result, not ours."""
    try:
        torch.load(path, weights_only=weights_only, **kw)
    except exc_type:
        return True
    except Exception:  # noqa: BLE001 - another error: not the same answer
        return False
    return False


def check(path, want, **kw) -> str:
    """'ok' (the saved values) or 'error' (a clear one); fails the test otherwise. Both
    load paths answer: ``weights_only=False`` (pickle dry run first, then the read) and
    the default weights-only load (the bulk read starts before the pickle is parsed,
    torchload._load_fast); both must give the saved values or a clear error."""
    outcome = None
    for weights_only in (False, True):
        try:
            got = fastpersist.load(path, weights_only=weights_only, **kw)
        except RAW as e:
            if not _torch_raises(path, type(e), weights_only, **kw):  # torch's own answer for a file handed to it
                pytest.fail(f"{path} (weights_only={weights_only}): raw {type(e).__name__}: {e}")
            outcome = outcome or "error"
            continue
        except CLEAR as e:
            assert not isinstance(e, RAW)
            outcome = outcome or "error"
            continue
        assert same(got, want), f"{path} (weights_only={weights_only}): load returned other values than were saved"
        outcome = "ok" if outcome in (None, "ok") else outcome
    return outcome


@pytest.fixture(scope="module", params=["fastpersist", "torch"])
def original(request, tmp_path_factory):
    p = tmp_path_factory.mktemp("orig") / "c.pt"
    (fastpersist.save if request.param == "fastpersist" else torch.save)(saved(), p)
    return request.param, p.read_bytes()


def header_offsets(data: bytes, path) -> list[int]:
    """Every byte of every local header, data descriptor, the pickle and the directory
    (padding inside extra fields excluded: it carries nothing)."""
    idx = read_zip_index(path)
    out: set[int] = set(range(idx.cd_offset, len(data)))
    for e in idx.entries:
        name_end = e.header_offset + 30 + len(e.name.encode())
        out.update(range(e.header_offset, min(name_end + 8, e.data_offset)))
        if e.descriptor_offset is not None:
            out.update(range(e.descriptor_offset, e.descriptor_offset + e.descriptor_size))
        if e.name.endswith("data.pkl") or not e.name.split("/")[-2:-1] == ["data"]:
            out.update(range(e.data_offset, e.data_end))
    return sorted(out)


def test_truncated_at_every_offset(original, tmp_path):
    writer, data = original
    p = tmp_path / "t.pt"
    want = saved()
    counts = {"ok": 0, "error": 0}
    step = 1 if len(data) < 4000 else 13  # fastpersist files are ~20 KB of mostly padding
    for n in range(0, len(data), step):
        p.write_bytes(data[:n])
        counts[check(p, want)] += 1
    assert counts["ok"] == 0  # no truncated file holds the whole checkpoint


def test_every_header_byte_flipped(original, tmp_path):
    writer, data = original
    src = tmp_path / "src.pt"
    src.write_bytes(data)
    p = tmp_path / "f.pt"
    want = saved()
    counts = {"ok": 0, "error": 0}
    for off in header_offsets(data, src):
        for x in (0xFF, 0x01):
            bad = bytearray(data)
            bad[off] ^= x
            p.write_bytes(bad)
            counts[check(p, want)] += 1
    assert counts["error"] > 0


def payload_flips(original, tmp_path):
    """Yield the path of a copy of the file with one payload byte flipped, for every byte of
    every storage record (the file is rewritten between yields)."""
    _writer, data = original
    src = tmp_path / "src.pt"
    src.write_bytes(data)
    p = tmp_path / "f.pt"
    for e in read_zip_index(src).entries:
        if "/data/" not in e.name or e.compressed_size == 0:
            continue
        for off in range(e.data_offset, e.data_end):
            bad = bytearray(data)
            bad[off] ^= 0x10
            p.write_bytes(bad)
            yield p


def test_every_payload_byte_flipped_is_caught(original, tmp_path):
    for p in payload_flips(original, tmp_path):
        with pytest.raises(ChecksumError):
            fastpersist.load(p)


@pytest.mark.parametrize("field,width", [(18, 4), (22, 4), (20, 4), (24, 4), (42, 4), (28, 2), (30, 2), (8, 2),
                                         (10, 2), (34, 2)])
@pytest.mark.parametrize("value", [0, 1, 0xFFFFFFFF, 0x7FFFFFFF, 4096])
def test_lying_central_directory_fields(original, tmp_path, field, width, value):
    """Sizes, offsets, name/extra lengths, method and disk number of each record, set to lies."""
    writer, data = original
    src = tmp_path / "src.pt"
    src.write_bytes(data)
    p = tmp_path / "f.pt"
    want = saved()
    for e in read_zip_index(src).entries:
        bad = bytearray(data)
        bad[e.cd_offset + field : e.cd_offset + field + width] = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "little")
        p.write_bytes(bad)
        check(p, want)


@pytest.mark.parametrize("field,width", [(4, 2), (6, 2), (8, 2), (10, 2), (12, 4), (16, 4), (20, 4)])
@pytest.mark.parametrize("value", [0, 1, 0xFFFF, 0xFFFFFFFF])
def test_lying_end_record_fields(original, tmp_path, field, width, value):
    writer, data = original
    src = tmp_path / "src.pt"
    src.write_bytes(data)
    idx = read_zip_index(src)
    bad = bytearray(data)
    at = idx.eocd_offset + field
    bad[at : at + width] = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "little")
    p = tmp_path / "f.pt"
    p.write_bytes(bad)
    check(p, saved())
