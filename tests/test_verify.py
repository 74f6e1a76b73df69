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


# ---- storage location tags (a note, not a corruption) --------------------------------


def _save_tagged(path, tag, monkeypatch) -> dict:
    """torch.save with every storage tagged ``tag`` (as if saved on another machine)."""
    import torch.serialization as ts

    state = {"w": torch.arange(6.0), "b": torch.ones(2, dtype=torch.int64)}
    with monkeypatch.context() as m:
        m.setattr(ts, "location_tag", lambda storage: tag)
        torch.save(state, path)
    return state


def _unrestorable_cuda() -> str:
    return f"cuda:{torch.cuda.device_count() + 3}" if torch.cuda.is_available() else "cuda:7"


@pytest.mark.parametrize("tag", ["cuda", "foo", "cpu:0", "cuda:abc"])
def test_unrestorable_location_is_a_note(tmp_path, monkeypatch, tag):
    from fastpersist.formats.torchverify import StorageLocationWarning, check_torch

    if tag == "cuda":
        tag = _unrestorable_cuda()
    path = tmp_path / "tagged.pt"
    state = _save_tagged(path, tag, monkeypatch)
    with pytest.raises(RuntimeError):  # what the note warns about
        torch.load(path)
    loaded = torch.load(path, map_location="cpu")
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    with pytest.warns(StorageLocationWarning, match=repr(tag)) as rec:
        res = fastpersist.verify(path)
    assert res.ok and res.status == "ok" and res.problems == []  # intact bytes: not corrupt
    assert len(res.notes) == 1 and "map_location" in res.notes[0]
    msg = str(rec[0].message)
    assert str(path) in msg and "map_location" in msg and "2 storage(s)" in msg
    from fastpersist import _native

    with pytest.warns(StorageLocationWarning):
        check = check_torch(str(path), _native.Handle())
    assert len(check.notes) == 1 and not check.problems


def test_restorable_locations_give_no_note(tmp_path, monkeypatch):
    import warnings

    from fastpersist.formats.torchverify import location_note

    assert location_note("cpu") is None and location_note("meta") is None
    if torch.cuda.is_available():
        assert location_note("cuda:0") is None and location_note("cuda") is None
    else:
        assert "is_available() is False" in location_note("cuda:0")
    assert "not a device string" in location_note(5)
    path = tmp_path / "cpu.pt"
    _save_tagged(path, "cpu", monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = fastpersist.verify(path)
    assert res.ok and res.notes == []


def test_cli_verify_reports_the_location_note(tmp_path, monkeypatch, capsys):
    """Exit 0 (intact), the note as a warning (stderr outside pytest)."""
    from fastpersist.cli import main
    from fastpersist.formats.torchverify import StorageLocationWarning

    path = tmp_path / "foo.pt"
    _save_tagged(path, "foo", monkeypatch)
    with pytest.warns(StorageLocationWarning, match="'foo'.*map_location"):
        assert main(["verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK:")
    assert "  note: " in out and "'foo'" in out and "map_location" in out
