"""Adversarial safetensors inputs (issue 9, items 8 and 9).

For every input: ``fastpersist.load`` returns exactly what
``safetensors.torch.load_file`` returns (names, dtypes, shapes, bytes) or raises
``CheckpointFormatError`` (``ChecksumError`` where fastpersist CRCs disagree);
``verify`` never says OK for a file ``load_file`` rejects or reads differently
from what was saved, and never raises for bad content.

Run as a script it prints the table of families (tried, clean, not clean).
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

import pytest
import torch

import fastpersist
from fastpersist.errors import CheckpointFormatError, ChecksumError

safetensors_torch = pytest.importorskip("safetensors.torch")


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(3, 4, generator=g),
        "b": torch.arange(5, dtype=torch.int16),
        "e": torch.empty(0, 2),
        "h": torch.ones(2, dtype=torch.bfloat16),
    }


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    if got.keys() != want.keys():
        return False
    for k in want:
        a, b = got[k], want[k]
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if bytes(a.contiguous().view(torch.uint8).reshape(-1).numpy()) != bytes(
            b.contiguous().view(torch.uint8).reshape(-1).numpy()
        ):
            return False
    return True


class Tally:
    def __init__(self, family: str) -> None:
        self.family = family
        self.tried = 0
        self.bad: list[str] = []

    def row(self) -> str:
        return f"| {self.family} | {self.tried} | {self.tried - len(self.bad)} | {len(self.bad)} |"


def check(path: str, label: str, tl: Tally, tv: Tally) -> None:
    """``load`` against ``load_file``; ``verify`` against ``load_file`` and the saved state."""
    try:
        theirs: Any = safetensors_torch.load_file(path)
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types
        theirs = exc
    tl.tried += 1
    try:
        ours = fastpersist.load(path)
    except (CheckpointFormatError, ChecksumError):
        pass
    except Exception as exc:  # noqa: BLE001
        tl.bad.append(f"{label}: load raised {type(exc).__name__}: {str(exc)[:100]}")
    else:
        if isinstance(theirs, Exception):
            tl.bad.append(f"{label}: load returned tensors, load_file raised {type(theirs).__name__}")
        elif not _same(ours, theirs):
            tl.bad.append(f"{label}: load returned other tensors than load_file")
    tv.tried += 1
    try:
        res = fastpersist.verify(path)
    except (CheckpointFormatError, OSError):
        return
    except Exception as exc:  # noqa: BLE001
        tv.bad.append(f"{label}: verify raised {type(exc).__name__}: {exc}")
        return
    if res.ok and (isinstance(theirs, Exception) or not _same(theirs, _state())):
        tv.bad.append(f"{label}: verify OK but load_file {'raised' if isinstance(theirs, Exception) else 'differs'}")


def _saved(kind: str, directory: str) -> bytes:
    path = os.path.join(directory, f"src-{kind}.safetensors")
    if kind == "fastpersist":
        fastpersist.save(_state(), path)
    else:
        safetensors_torch.save_file(_state(), path)
    return Path(path).read_bytes()


def _file(header: Any, data: bytes = b"", pad: bytes = b"") -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += pad
    return struct.pack("<Q", len(text)) + text + data


def _header(raw: bytes) -> tuple[dict[str, Any], bytes]:
    n = struct.unpack_from("<Q", raw)[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def lying_cases(raw: bytes) -> Iterable[tuple[str, bytes]]:
    head, data = _header(raw)
    names = [k for k in head if k != "__metadata__"]

    def edited(fn: Callable[[dict[str, Any]], None], d: bytes = data) -> bytes:
        h = json.loads(json.dumps(head))
        fn(h)
        return _file(h, d)

    for name in names:
        b, e = head[name]["data_offsets"]
        for off in ([b, e + 1], [b + 1, e], [e, b], [0, e - b], [b, b], [-1, e], [b, 2**64], [b, 2**63 - 1],
                    [b, 1.0 * e], [str(b), e], [b], None):
            yield f"{name} offsets {off}", edited(lambda h, o=off, n=name: h[n].__setitem__("data_offsets", o))
        for shape in ([2**63, 0], [0, 2**63], [2**62, 2**62, 0], [2**64], [-1], [1.5], ["2"], [True], None, 3,
                      [2**31, 2**31, 2**2], [10**30]):
            yield f"{name} shape {shape}", edited(lambda h, s=shape, n=name: h[n].__setitem__("shape", s))
        for dtype in ("F33", "f32", "", None, 5, "I64", "U8", "BOOL"):
            yield f"{name} dtype {dtype}", edited(lambda h, t=dtype, n=name: h[n].__setitem__("dtype", t))
        yield f"{name} not an object", edited(lambda h, n=name: h.__setitem__(n, [1, 2]))
    if len(names) >= 2:
        a, b_ = names[0], names[1]
        yield "overlap", edited(lambda h: h[b_].__setitem__("data_offsets", h[a]["data_offsets"]))
    yield "non-dict JSON", _file(b"[1, 2, 3]", data)
    yield "JSON string", _file(b'"x"', data)
    yield "nested 100000", _file(b"[" * 100000 + b"]" * 100000, data)
    yield "nested dict 50000", _file(b'{"a":' * 50000 + b"1" + b"}" * 50000, data)
    yield "nested metadata", _file(b'{"__metadata__":' + b'{"a":' * 5000 + b'"x"' + b"}" * 5001, data)
    yield "NaN", _file(b'{"x": NaN}', data)
    yield "-0 shape", _file(b'{"t":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}}')
    yield "lone surrogate", _file(b'{"__metadata__":{"k":"\\ud800"}}')
    yield "duplicate key", _file(b'{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                                 b'"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\x01")
    yield "metadata not strings", edited(lambda h: h.__setitem__("__metadata__", {"a": 1}))
    yield "trailing NUL in header", _file(json.dumps(head).encode() + b"\x00", data)
    yield "trailing bytes", raw + b"\x00" * 8
    n = struct.unpack_from("<Q", raw)[0]
    for v in (0, 1, n - 1, n + 1, len(raw) - 8, len(raw), 2**63, 2**64 - 1, 100_000_001):
        yield f"header length {v}", struct.pack("<Q", v) + raw[8:]
    yield "empty file", b""
    yield "7 bytes", raw[:7]


def families(kind: str, directory: str) -> dict[str, Callable[[], Iterable[tuple[str, bytes]]]]:
    raw = _saved(kind, directory)
    n = struct.unpack_from("<Q", raw)[0]
    text_end = 8 + len(raw[8 : 8 + n].rstrip(b" "))

    def truncations() -> Iterable[tuple[str, bytes]]:
        cuts = set(range(0, text_end + 2)) | set(range(text_end, len(raw), 97)) | {len(raw) - 1}
        for c in sorted(c for c in cuts if c < len(raw)):
            yield f"truncated to {c}", raw[:c]

    def flips() -> Iterable[tuple[str, bytes]]:
        for i in list(range(text_end)) + list(range(text_end, 8 + n, 257)):
            for x in (0xFF, 0x01, 0x10):
                b = bytearray(raw)
                b[i] ^= x
                yield f"byte {i} ^ {x:#x}", bytes(b)

    return {
        f"{kind}: truncation": truncations,
        f"{kind}: header flips": flips,
        f"{kind}: lying fields": lambda: lying_cases(raw),
    }


def run_family(inputs: Iterable[tuple[str, bytes]], directory: str, family: str) -> tuple[Tally, Tally]:
    tl, tv = Tally(family + " (load)"), Tally(family + " (verify)")
    path = os.path.join(directory, "in.safetensors")
    for label, raw in inputs:
        Path(path).write_bytes(raw)
        check(path, label, tl, tv)
    return tl, tv


@pytest.fixture(scope="module")
def workdir() -> Iterable[str]:
    with tempfile.TemporaryDirectory() as d:
        yield d


@pytest.mark.parametrize("kind", ["fastpersist", "safetensors"])
@pytest.mark.parametrize("family", ["truncation", "header flips", "lying fields"])
def test_load_and_verify_properties(kind: str, family: str, workdir: str) -> None:
    tl, tv = run_family(families(kind, workdir)[f"{kind}: {family}"](), workdir, family)
    assert tl.tried > 10
    assert not tl.bad, f"{len(tl.bad)} of {tl.tried}:\n" + "\n".join(tl.bad[:20])
    assert not tv.bad, f"{len(tv.bad)} of {tv.tried}:\n" + "\n".join(tv.bad[:20])


def test_stock_file_is_unchecked(workdir: str) -> None:
    """A safetensors file without fastpersist CRCs: ok False, status 'unchecked', 0 bytes checked."""
    _saved("safetensors", workdir)
    res = fastpersist.verify(os.path.join(workdir, "src-safetensors.safetensors"))
    assert not res.ok and res.status == "unchecked" and not res.checked
    assert res.bytes == 0 and res.records == 4 and "no fastpersist checksums" in res.problems[0]


def test_fastpersist_file_is_ok(workdir: str) -> None:
    _saved("fastpersist", workdir)
    res = fastpersist.verify(os.path.join(workdir, "src-fastpersist.safetensors"))
    assert res.ok and res.status == "ok" and res.bytes > 0


@pytest.mark.parametrize("label", ["nested 100000", "w shape [2**63, 0]", "non-dict JSON", "overlap",
                                   "header length 18446744073709551615", "w dtype F33", "w offsets [0, 49]"])
def test_named_cases_raise_format_error_with_path(label: str, workdir: str) -> None:
    raw = _saved("safetensors", workdir)
    cases = dict(lying_cases(raw))
    key = label.replace("2**63", str(2**63))
    if key not in cases:
        key = next(k for k in cases if k.startswith(label.split(" [")[0]))
    path = os.path.join(workdir, "named.safetensors")
    Path(path).write_bytes(cases[key])
    with pytest.raises(CheckpointFormatError) as info:
        fastpersist.load(path)
    assert path in str(info.value) and info.value.path == path
    res = fastpersist.verify(path)
    assert not res.ok and res.status == "corrupt"


def test_cli_exit_codes(workdir: str, capsys: Any) -> None:
    from fastpersist.cli import main

    _saved("safetensors", workdir)
    _saved("fastpersist", workdir)
    assert main(["verify", os.path.join(workdir, "src-safetensors.safetensors")]) == 3
    assert capsys.readouterr().out.startswith("UNCHECKED")
    assert main(["verify", os.path.join(workdir, "src-fastpersist.safetensors")]) == 0
    bad = os.path.join(workdir, "bad.safetensors")
    Path(bad).write_bytes(_file(b"[" * 100000 + b"]" * 100000))
    assert main(["verify", bad]) == 1


if __name__ == "__main__":
    print("| family | tried | clean | not clean |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for kind in ("fastpersist", "safetensors"):
            for family, gen in families(kind, d).items():
                tl, tv = run_family(gen(), d, family)
                print(tl.row())
                print(tv.row())
                for line in (tl.bad + tv.bad)[:3]:
                    print("    e.g.", line[:160])
