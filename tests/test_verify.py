"""fastpersist.verify: every byte checksummed, damage reported by record name."""

from __future__ import annotations

import pytest
import torch

import fastpersist
from fastpersist.formats.zipindex import read_zip_index


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def _entry(path, suffix: str):
    return next(e for e in read_zip_index(path).entries if e.name.endswith(suffix))


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "ckpt.pt"
    state = {"w": torch.randn(300, 7), "b": torch.arange(11), "empty": torch.empty(0), "step": 5}
    fastpersist.save(state, path)
    return path


def test_untouched_file_is_ok(ckpt):
    res = fastpersist.verify(ckpt)
    assert res.ok and bool(res) and res.problems == []
    assert res.format == "torch"
    index = read_zip_index(ckpt)
    assert res.records == len(index.entries)
    assert res.bytes == sum(e.compressed_size for e in index.entries) > 300 * 7 * 4


@pytest.mark.parametrize("where", [0, 0.5, -1])
def test_flipped_payload_byte_names_record(ckpt, where):
    e = _entry(ckpt, "data/0")
    offset = e.data_offset + (int(e.compressed_size * where) if where >= 0 else e.compressed_size - 1)
    _flip(ckpt, offset)
    res = fastpersist.verify(ckpt)
    assert not res.ok
    assert len(res.problems) == 1 and res.problems[0].startswith(e.name), res.problems


def test_flipped_pickle_byte(ckpt):
    e = _entry(ckpt, "data.pkl")
    _flip(ckpt, e.data_offset + e.compressed_size // 2)
    res = fastpersist.verify(ckpt)
    assert not res.ok and any(p.startswith(e.name) for p in res.problems), res.problems


def test_flipped_small_record(ckpt):
    e = _entry(ckpt, "byteorder")
    _flip(ckpt, e.data_offset)
    res = fastpersist.verify(ckpt)
    assert not res.ok and {p.split(":")[0] for p in res.problems} == {e.name}, res.problems


def test_damaged_crc_fields(ckpt):
    e = _entry(ckpt, "data/1")
    _flip(ckpt, e.descriptor_crc_offset)
    res = fastpersist.verify(ckpt)
    assert not res.ok and "data descriptor" in " ".join(res.problems)


def test_damaged_central_directory_crc(ckpt):
    e = _entry(ckpt, "data/1")
    _flip(ckpt, e.cd_crc_offset + 1)
    res = fastpersist.verify(ckpt)
    assert not res.ok and all(p.startswith(e.name) for p in res.problems) and res.problems


def test_truncated_file(ckpt):
    size = ckpt.stat().st_size
    with open(ckpt, "r+b") as f:
        f.truncate(size - 100)
    res = fastpersist.verify(ckpt)
    assert not res.ok and str(ckpt) in res.problems[0]


def test_plain_torch_save_file_verifies(tmp_path):
    path = tmp_path / "plain.pt"
    torch.save({"a": torch.randn(50)}, path)
    assert fastpersist.verify(path).ok
    e = _entry(path, "data/0")
    _flip(path, e.data_offset + 3)
    assert not fastpersist.verify(path).ok


def test_legacy_file_is_reported(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"a": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    res = fastpersist.verify(path)
    assert not res.ok and "legacy" in res.problems[0]


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        fastpersist.verify(tmp_path / "nope.pt")


def test_safetensors_payload_flip(tmp_path):
    st = pytest.importorskip("fastpersist.formats.safetensors")
    path = tmp_path / "w.safetensors"
    fastpersist.save({"alpha": torch.randn(64), "beta": torch.arange(100, dtype=torch.int64)}, path)
    assert fastpersist.verify(path).ok
    header = st.read_header(path)
    beta = next(t for t in header.tensors if t.name == "beta")
    _flip(path, header.data_start + beta.begin + 17)
    res = fastpersist.verify(path)
    assert not res.ok and res.format == "safetensors"
    assert len(res.problems) == 1 and "beta" in res.problems[0]
