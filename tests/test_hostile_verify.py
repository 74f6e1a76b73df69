"""Adversarial inputs for ``fastpersist.verify`` on torch zip files (issue 9, items 8 and 9).

The property, for every input: ``verify`` never says OK for a file that stock
``torch.load(path, weights_only=False)`` rejects or whose loaded result differs
from what was saved (tensors compared bytewise with dtype and shape), and it
never raises anything but ``CheckpointFormatError`` / ``OSError``. An OK that
comes with a ``StorageLocationWarning`` (intact bytes, storages tagged with a
location this machine cannot restore) is held to ``torch.load(...,
map_location="cpu")``, and plain ``torch.load`` must then reject the file. The zip index
parser raises only ``ZipFormatError`` (with path and offset) for bad bytes.

``torch.load`` runs only on inputs ``verify`` calls OK: a rejected file's pickle
is never executed.

Run as a script (``python tests/test_hostile_verify.py``) it prints the table
of families: inputs tried, clean, not clean.
"""

from __future__ import annotations

import io
import os
import struct
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import pytest
import torch

import fastpersist
from fastpersist.errors import CheckpointFormatError, ZipFormatError
from fastpersist.formats.torchverify import StorageLocationWarning
from fastpersist.formats.zipindex import buffer_reader, parse_zip_index

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    given = None


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 4, generator=g),
        "b": torch.arange(5, dtype=torch.int16),
        "e": torch.empty(0),
        "step": 7,
        "name": "run",
    }


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return (
            isinstance(got, torch.Tensor)
            and got.dtype == want.dtype
            and got.shape == want.shape
            and got.stride() == want.stride()
            and bytes(got.contiguous().view(torch.uint8).reshape(-1).numpy())
            == bytes(want.contiguous().view(torch.uint8).reshape(-1).numpy())
        )
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    if isinstance(want, (list, tuple)):
        return type(got) is type(want) and len(got) == len(want) and all(_same(a, b) for a, b in zip(got, want))
    return type(got) is type(want) and got == want


class Tally:
    """Counts of one family: inputs tried, clean, and the first few failures."""

    def __init__(self, family: str) -> None:
        self.family = family
        self.tried = 0
        self.bad: list[str] = []

    @property
    def clean(self) -> int:
        return self.tried - len(self.bad)

    def row(self) -> str:
        return f"| {self.family} | {self.tried} | {self.clean} | {len(self.bad)} |"


def check_verify(path: str, want: Any, label: str, tally: Tally) -> None:
    """One input: verify's answer against torch.load's."""
    tally.tried += 1
    try:
        with warnings.catch_warnings(record=True) as notes:
            warnings.simplefilter("always", StorageLocationWarning)
            res = fastpersist.verify(path)
    except (CheckpointFormatError, OSError):
        return  # a clear error is allowed
    except Exception as exc:  # noqa: BLE001 - the property: nothing else escapes
        tally.bad.append(f"{label}: verify raised {type(exc).__name__}: {exc}")
        return
    if not res.ok:
        return
    located = any(issubclass(n.category, StorageLocationWarning) for n in notes)
    if located:
        try:
            torch.load(path, weights_only=False)
        except Exception:  # noqa: BLE001 - what the note says
            pass
        else:
            tally.bad.append(f"{label}: verify noted unrestorable locations but torch.load restored them")
    try:
        got = torch.load(path, weights_only=False, **({"map_location": "cpu"} if located else {}))
    except Exception as exc:  # noqa: BLE001
        tally.bad.append(f"{label}: verify OK but torch.load raised {type(exc).__name__}: {str(exc)[:80]}")
        return
    if not _same(got, want):
        tally.bad.append(f"{label}: verify OK but torch.load returned other values")


def check_parser(raw: bytes, label: str, tally: Tally) -> None:
    """The zip index parser raises ZipFormatError (nothing else) for bad bytes."""
    tally.tried += 1
    try:
        parse_zip_index(buffer_reader(raw), len(raw), "mem.pt")
    except ZipFormatError as exc:
        if exc.path != "mem.pt" or exc.offset is None:
            tally.bad.append(f"{label}: ZipFormatError without path/offset: {exc}")
    except Exception as exc:  # noqa: BLE001
        tally.bad.append(f"{label}: parser raised {type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------- inputs


def _saved(kind: str, directory: str) -> bytes:
    path = os.path.join(directory, f"src-{kind}.pt")
    if kind == "fastpersist":
        fastpersist.save(_state(), path)
    else:
        torch.save(_state(), path)
    return Path(path).read_bytes()


def structure_offsets(raw: bytes) -> list[int]:
    """Every byte of a file except tensor payloads and zero padding: local headers,
    small records (data.pkl, version, ...), descriptors, central directory, end records."""
    index = parse_zip_index(buffer_reader(raw), len(raw), "src")
    payload = set()
    for e in index.entries:
        if "/data/" in e.name:
            payload.update(range(e.data_offset, e.data_end))
    zero_pad = set()
    for e in index.entries:  # padding lives in the local extra field before aligned payloads
        name_end = e.header_offset + 30 + len(e.name.encode())
        zero_pad.update(range(name_end + 4, e.data_offset))
    return [i for i in range(len(raw)) if i not in payload and i not in zero_pad]


def _rebuild(raw: bytes, edit: Callable[[str, bytes], Optional[tuple[str, bytes]]], method: int = zipfile.ZIP_STORED) -> bytes:
    """A re-zipped copy (valid CRCs) with ``edit(name, data)`` applied to each record."""
    src = zipfile.ZipFile(io.BytesIO(raw))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", method) as z:
        for info in src.infolist():
            r = edit(info.filename, src.read(info.filename))
            if r is not None:
                z.writestr(r[0], r[1])
    return out.getvalue()


def _cd_entries(raw: bytes) -> list[tuple[int, int]]:
    index = parse_zip_index(buffer_reader(raw), len(raw), "src")
    return [(e.cd_offset, e.header_offset) for e in index.entries]


def _put(raw: bytes, at: int, fmt: str, value: int) -> bytes:
    b = bytearray(raw)
    struct.pack_into(fmt, b, at, value)
    return bytes(b)


def listed_cases(raw: bytes) -> Iterable[tuple[str, bytes]]:
    """The cases named in issue 9 item 8 and 9, on one saved file."""
    index = parse_zip_index(buffer_reader(raw), len(raw), "src")
    eocd = index.eocd_offset
    # encryption and other unsupported flags, in the central directory and local headers
    for e in index.entries:
        for bit in (0x0001, 0x0040, 0x2000):
            cd_flags = struct.unpack_from("<H", raw, e.cd_offset + 8)[0]
            yield f"cd flag {bit:#x} {e.name}", _put(raw, e.cd_offset + 8, "<H", cd_flags | bit)
            loc_flags = struct.unpack_from("<H", raw, e.header_offset + 6)[0]
            both = _put(raw, e.header_offset + 6, "<H", loc_flags | bit)
            yield f"both flags {bit:#x} {e.name}", _put(both, e.cd_offset + 8, "<H", cd_flags | bit)
        # external attributes: directory bit
        yield f"dir attr {e.name}", _put(raw, e.cd_offset + 38, "<L", 0x10)
        # renamed entries: central directory only, local only, both
        nlen = len(e.name.encode())
        renamed = e.name[:-1] + ("X" if e.name[-1] != "X" else "Y")
        new = renamed.encode()
        cd_name, loc_name = e.cd_offset + 46, e.header_offset + 30
        b = bytearray(raw)
        b[cd_name : cd_name + nlen] = new
        yield f"rename cd {e.name}", bytes(b)
        b2 = bytearray(raw)
        b2[loc_name : loc_name + nlen] = new
        yield f"rename local {e.name}", bytes(b2)
        b[loc_name : loc_name + nlen] = new
        yield f"rename both {e.name}", bytes(b)
        # bad UTF-8 in the name (flag 0x800 set by both writers)
        b3 = bytearray(raw)
        b3[cd_name + nlen - 1] = 0xFF
        yield f"bad utf8 {e.name}", bytes(b3)
        # disk number start
        for v in (1, 220, 0xFFFF):
            yield f"cd disk {v} {e.name}", _put(raw, e.cd_offset + 34, "<H", v)
        # lying sizes / offsets in the central directory and the local header
        for field, at, fmt in (("csize", 20, "<L"), ("usize", 24, "<L"), ("hoff", 42, "<L")):
            orig = struct.unpack_from(fmt, raw, e.cd_offset + at)[0]
            for v in {0, orig + 1, max(orig - 1, 0), orig + 64, 0xFFFFFFFF} - {orig}:
                yield f"cd {field}={v} {e.name}", _put(raw, e.cd_offset + at, fmt, v)
        for field, at, fmt in (("method", 8, "<H"), ("nlen", 26, "<H"), ("xlen", 28, "<H"), ("csize", 18, "<L")):
            orig = struct.unpack_from(fmt, raw, e.header_offset + at)[0]
            for v in {0, 8, orig + 1, max(orig - 1, 0), 0xFFFF} - {orig}:
                yield f"local {field}={v} {e.name}", _put(raw, e.header_offset + at, fmt, v)
        for v in (8, 12, 99):
            yield f"cd method={v} {e.name}", _put(raw, e.cd_offset + 10, "<H", v)
    # two entries pointing at the same local header (aliasing)
    if len(index.entries) >= 2:
        a, b_ = index.entries[0], index.entries[1]
        yield "alias hoff", _put(raw, b_.cd_offset + 42, "<L", a.header_offset)
    # end records: disk numbers, entry counts, directory size and offset
    for off, name in ((4, "disk"), (6, "cd disk")):
        for v in (1, 220, 0xFFFF):
            yield f"eocd {name}={v}", _put(raw, eocd + off, "<H", v)
    n = len(index.entries)
    for off, name in ((8, "n_disk"), (10, "n_total")):
        for v in (0, n - 1, n + 1):
            yield f"eocd {name}={v}", _put(raw, eocd + off, "<H", v)
    for off, name in ((12, "cd size"), (16, "cd offset")):
        orig = struct.unpack_from("<L", raw, eocd + off)[0]
        for v in (0, orig + 1, orig - 1, 0xFFFFFFFF):
            yield f"eocd {name}={v}", _put(raw, eocd + off, "<L", v)
    if index.zip64:
        z64 = raw.rfind(b"PK\x06\x06")
        loc = raw.rfind(b"PK\x06\x07")
        for off, name in ((16, "disk"), (20, "cd disk")):
            for v in (1, 220):
                yield f"zip64 {name}={v}", _put(raw, z64 + off, "<L", v)
        for off, name in ((24, "n_disk"), (32, "n_total")):
            for v in (0, n - 1, n + 1, 1 << 40):
                yield f"zip64 {name}={v}", _put(raw, z64 + off, "<Q", v)
                both = _put(raw, z64 + off, "<Q", v)
                yield f"zip64+eocd {name}={v}", _put(both, eocd + (8 if name == "n_disk" else 10), "<H", v & 0xFFFF)
        for off, name in ((40, "cd size"), (48, "cd offset")):
            orig = struct.unpack_from("<Q", raw, z64 + off)[0]
            for v in (0, orig + 1, orig - 1, 1 << 40):
                yield f"zip64 {name}={v}", _put(raw, z64 + off, "<Q", v)
        yield "zip64 locator disks=0", _put(raw, loc + 16, "<L", 0)
        yield "zip64 locator disks=2", _put(raw, loc + 16, "<L", 2)
        yield "zip64 locator disk=1", _put(raw, loc + 4, "<L", 1)
    # whole-file shapes
    empty = io.BytesIO()
    zipfile.ZipFile(empty, "w").close()
    yield "empty zip", empty.getvalue()
    yield "eocd only", raw[eocd:]
    yield "eocd only (fresh)", b"PK\x05\x06" + b"\0" * 18
    yield "zip of text files", _zip({"readme.txt": b"hello\n", "notes/a.txt": b"x" * 100})
    yield "zip of text files in a folder", _zip({"archive/data.pkl": b"not a pickle", "archive/version": b"3\n"})
    yield "torch records, text pickle", _rebuild(raw, lambda n, d: (n, b"hello" if n.endswith("data.pkl") else d))
    yield "empty file", b""
    yield "garbage", b"\x00" * 64
    yield "PK garbage", b"PK\x03\x04" + b"\x00" * 60
    # records torch needs, each missing (a valid zip otherwise)
    for e in index.entries:
        short = e.name.split("/", 1)[1]
        yield f"missing {short}", _rebuild(raw, lambda n, d, s=e.name: None if n == s else (n, d))
    # pickle claims: storage record shorter / longer than data.pkl says
    for e in index.entries:
        if "/data/" in e.name:
            yield f"short {e.name}", _rebuild(raw, lambda n, d, s=e.name: (n, d[:-1] if n == s else d))
            yield f"long {e.name}", _rebuild(raw, lambda n, d, s=e.name: (n, d + b"\0" * 8 if n == s else d))
    yield "version 0", _rebuild(raw, lambda n, d: (n, b"0\n" if n.endswith("/version") else d))
    yield "version 99", _rebuild(raw, lambda n, d: (n, b"99\n" if n.endswith("/version") else d))
    yield "version x", _rebuild(raw, lambda n, d: (n, b"x\n" if n.endswith("/version") else d))
    yield "byteorder middle", _rebuild(raw, lambda n, d: (n, b"middle" if n.endswith("byteorder") else d))
    yield "outside the archive folder", _rebuild(raw, lambda n, d: ("zz/" + n.split("/", 1)[1] if n.endswith("byteorder") else n, d))
    yield "no archive folder", _rebuild(raw, lambda n, d: (n.split("/", 1)[1], d))
    # a valid torch file re-zipped: deflate (verify may check it, but only correctly)
    yield "deflated", _rebuild(raw, lambda n, d: (n, d), zipfile.ZIP_DEFLATED)
    deflated = bytearray(_rebuild(raw, lambda n, d: (n, d), zipfile.ZIP_DEFLATED))
    di = parse_zip_index(buffer_reader(bytes(deflated)), len(deflated), "d")
    for e in di.entries:
        if e.method == 8 and e.compressed_size > 2:
            d2 = bytearray(deflated)
            d2[e.data_offset + e.compressed_size // 2] ^= 0x55
            yield f"deflated flip {e.name}", bytes(d2)
    # trailing and leading bytes
    yield "trailing bytes", raw + b"\0" * 7
    yield "leading bytes", b"\0" * 7 + raw


def _zip(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return out.getvalue()


# --------------------------------------------------------------------------- families


def run_family(family: str, inputs: Iterable[tuple[str, bytes]], directory: str, parser: bool = True) -> tuple[Tally, Tally]:
    """Every input through verify (and the zip index parser); returns (verify, parser) tallies."""
    want = _state()
    tv, tp = Tally(family), Tally(family + " (parser)")
    path = os.path.join(directory, "in.pt")
    for label, raw in inputs:
        with open(path, "wb") as f:
            f.write(raw)
        check_verify(path, want, label, tv)
        if parser:
            check_parser(raw, label, tp)
    return tv, tp


def families(kind: str, directory: str) -> dict[str, Callable[[], Iterable[tuple[str, bytes]]]]:
    raw = _saved(kind, directory)
    offsets = structure_offsets(raw)

    def truncations() -> Iterable[tuple[str, bytes]]:
        # every offset of the structure (headers, small records, directory, end
        # records) and its neighbours; payloads and zero padding every 61st byte
        cuts = set(range(0, len(raw), 61)) | {len(raw) - 1}
        for i in offsets:
            cuts.update((i, i + 1))
        for n in sorted(c for c in cuts if c < len(raw)):
            yield f"truncated to {n}", raw[:n]

    def flips() -> Iterable[tuple[str, bytes]]:
        for i in offsets:
            for x in (0xFF, 0x01):
                b = bytearray(raw)
                b[i] ^= x
                yield f"byte {i} ^ {x:#x}", bytes(b)

    def listed() -> Iterable[tuple[str, bytes]]:
        return listed_cases(raw)

    return {f"{kind}: truncation": truncations, f"{kind}: flips": flips, f"{kind}: listed/lying": listed}


@pytest.fixture(scope="module")
def workdir() -> Iterable[str]:
    with tempfile.TemporaryDirectory() as d:
        yield d


@pytest.mark.parametrize("kind", ["fastpersist", "torch"])
@pytest.mark.parametrize("family", ["truncation", "flips", "listed/lying"])
def test_verify_never_ok_wrongly(kind: str, family: str, workdir: str) -> None:
    gen = families(kind, workdir)[f"{kind}: {family}"]
    tv, tp = run_family(family, gen(), workdir)
    assert tv.tried > 10
    assert not tv.bad, f"{len(tv.bad)} of {tv.tried} not clean:\n" + "\n".join(tv.bad[:20])
    assert not tp.bad, f"{len(tp.bad)} of {tp.tried} not clean:\n" + "\n".join(tp.bad[:20])


@pytest.mark.parametrize("kind", ["fastpersist", "torch"])
def test_untouched_files_verify_ok(kind: str, workdir: str) -> None:
    path = os.path.join(workdir, f"src-{kind}.pt")
    _saved(kind, workdir)
    res = fastpersist.verify(path)
    assert res.ok and res.status == "ok" and res.bytes > 0, res.problems


def test_listed_cases_are_not_ok(workdir: str) -> None:
    """Each case issue 9 names is reported (not OK), never raised."""
    raw = _saved("fastpersist", workdir)
    cases = dict(listed_cases(raw))
    path = os.path.join(workdir, "case.pt")
    for label in ["empty zip", "eocd only", "eocd only (fresh)", "zip of text files", "zip of text files in a folder",
                  "torch records, text pickle", "missing data.pkl", "missing data/0", "missing version",
                  "short archive/data/0", "long archive/data/0", "version 0", "version 99", "byteorder middle",
                  "outside the archive folder", "no archive folder", "empty file", "garbage", "PK garbage",
                  "cd flag 0x1 archive/data/0", "both flags 0x1 archive/data.pkl", "eocd disk=220",
                  "zip64 n_total=8", "zip64 n_disk=10", "zip64+eocd n_total=8", "zip64+eocd n_total=0", "rename cd archive/data.pkl", "rename both archive/data/0",
                  "bad utf8 archive/data.pkl", "alias hoff", "cd disk 220 archive/data/0",
                  "dir attr archive/data.pkl"]:
        Path(path).write_bytes(cases[label])
        res = fastpersist.verify(path)
        assert not res.ok and res.status == "corrupt" and res.problems, label
        assert all(isinstance(p, str) and p for p in res.problems), label


def test_deflated_torch_file_is_checked_over_inflated_bytes(workdir: str) -> None:
    raw = _saved("torch", workdir)
    path = os.path.join(workdir, "deflated.pt")
    Path(path).write_bytes(_rebuild(raw, lambda n, d: (n, d), zipfile.ZIP_DEFLATED))
    res = fastpersist.verify(path)
    assert res.ok, res.problems
    assert _same(torch.load(path, weights_only=False), _state())


def test_errors_name_the_path_and_offset(workdir: str) -> None:
    raw = _saved("fastpersist", workdir)
    for label, bad in [("truncated by one byte", raw[:-1]), ("bad utf8", dict(listed_cases(raw))["bad utf8 archive/data.pkl"])]:
        with pytest.raises(ZipFormatError) as info:
            parse_zip_index(buffer_reader(bad), len(bad), "/some/ckpt.pt")
        assert info.value.path == "/some/ckpt.pt" and info.value.offset is not None, label
        assert "/some/ckpt.pt" in str(info.value), label


@pytest.mark.parametrize("tag", ["foo", "cuda:99", "cpu:0"])
def test_unrestorable_location_ok_with_note(tmp_path: Path, monkeypatch: Any, tag: str) -> None:
    """CRC-valid storages tagged with a location this machine cannot restore: verify OK
    with a note, which the property holds to torch.load with and without map_location."""
    import torch.serialization as ts

    path = tmp_path / "tagged.pt"
    with monkeypatch.context() as m:
        m.setattr(ts, "location_tag", lambda storage: tag)
        torch.save(_state(), path)
    with pytest.warns(StorageLocationWarning):
        assert fastpersist.verify(path).ok
    tally = Tally("location")
    check_verify(str(path), _state(), tag, tally)
    assert tally.tried == 1 and not tally.bad, tally.bad


def test_legacy_file_is_unchecked(tmp_path: Path) -> None:
    path = tmp_path / "legacy.pt"
    torch.save({"a": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    res = fastpersist.verify(path)
    assert not res.ok and res.status == "unchecked" and not res.checked and res.bytes == 0


def test_cli_exit_codes(tmp_path: Path, capsys: Any) -> None:
    from fastpersist.cli import main

    good = tmp_path / "good.pt"
    fastpersist.save(_state(), good)
    assert main(["verify", str(good)]) == 0
    assert capsys.readouterr().out.startswith("OK")
    raw = good.read_bytes()
    cases = dict(listed_cases(raw))
    for label in ["bad utf8 archive/data.pkl", "eocd disk=220", "empty zip"]:
        bad = tmp_path / "bad.pt"
        bad.write_bytes(cases[label])
        assert main(["verify", str(bad)]) == 1, label
        out = capsys.readouterr()
        assert out.out.startswith("FAILED") and "Traceback" not in out.out + out.err, label
    trunc = tmp_path / "trunc.pt"
    trunc.write_bytes(raw[:-1])
    assert main(["verify", str(trunc)]) == 1
    assert capsys.readouterr().out.startswith("FAILED")
    legacy = tmp_path / "legacy.pt"
    torch.save({"a": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    assert main(["verify", str(legacy)]) == 3
    assert capsys.readouterr().out.startswith("UNCHECKED")


if given is not None:

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def test_random_overwrites_of_structure(data: Any) -> None:
        """Random multi-byte overwrites of header bytes: the same property as the byte families."""
        with tempfile.TemporaryDirectory() as d:
            raw = _CACHE.get("raw") or _CACHE.setdefault("raw", _saved("torch", d))
            offsets = _CACHE.get("offsets") or _CACHE.setdefault("offsets", structure_offsets(raw))
            b = bytearray(raw)
            for _ in range(data.draw(st.integers(1, 4))):
                at = data.draw(st.sampled_from(offsets))
                chunk = data.draw(st.binary(min_size=1, max_size=8))
                b[at : at + len(chunk)] = chunk
                b = b[: len(raw)] if len(b) > len(raw) else b
            tv, tp = run_family("random", [("random", bytes(b))], d)
            assert not tv.bad and not tp.bad, tv.bad + tp.bad

    _CACHE: dict[str, Any] = {}


if __name__ == "__main__":  # the closing note's table
    print("| family | tried | clean | not clean |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for kind in ("fastpersist", "torch"):
            for family, gen in families(kind, d).items():
                tv, tp = run_family(family, gen(), d)
                print(tv.row())
                print(tp.row())
                for line in (tv.bad + tp.bad)[:3]:
                    print("    e.g.", line[:160])


@pytest.mark.parametrize("edit", ["bigger size", "offset past the end", "stride past the end"])
def test_tensor_view_larger_than_its_storage_is_reported(tmp_path: Path, edit: str) -> None:
    """A pickle (its CRC rewritten to match) that builds a tensor view reaching past its storage:
    torch.load refuses the file, so verify must not call it intact (found by the reader fuzz)."""
    path = str(tmp_path / "v.pt")
    fastpersist.save({"a": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, path)
    raw = Path(path).read_bytes()
    # the pickle's size (3, 4), stride (4, 1) and offset 0 as torch.save writes them: BININT1 each
    old = b"K\x00K\x03K\x04\x86q"
    new = {"bigger size": b"K\x00K\x04K\x04\x86q", "offset past the end": b"K\x01K\x03K\x04\x86q",
           "stride past the end": None}[edit]

    def change(name: str, data: bytes) -> Optional[tuple[str, bytes]]:
        if not name.endswith("data.pkl"):
            return name, data
        if new is None:
            i = data.index(b"K\x04K\x01\x86q")  # the stride (4, 1) -> (5, 1)
            return name, data[:i] + b"K\x05K\x01\x86q" + data[i + 6:]
        assert old in data, data
        return name, data.replace(old, new, 1)

    bad = str(tmp_path / "bad.pt")
    Path(bad).write_bytes(_rebuild(raw, change))
    with pytest.raises(RuntimeError, match="out of bounds|not resizable|size"):
        torch.load(bad, weights_only=True)
    res = fastpersist.verify(bad)
    assert not res.ok and any("needs" in p and "storage '0'" in p for p in res.problems), res
    assert fastpersist.verify(path).ok  # the original view fits exactly
