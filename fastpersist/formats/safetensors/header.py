"""The safetensors header: its keys, its parse and validation, and the CRC-32s of its meaning.

A safetensors file starts with an 8-byte little-endian length ``N`` and ``N`` bytes of
JSON: ``{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets"}}``
(which may end in spaces). :func:`parse_header` validates it as safetensors does
(dtypes, shapes, offsets, no holes or overlaps, the file's size) and returns a
:class:`SafetensorsHeader`; :func:`read_header` and :func:`read_header_fd` read it
from a path or from an open descriptor. The keys fastpersist adds to the entries (and,
in files of earlier versions, to ``__metadata__``) are defined here, with the CRC-32s
of the header's meaning they carry.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from fastpersist._sys import pread_full
from fastpersist.formats.safetensors.dtypes import CODE_BITS, CODE_TO_DTYPE, PACKED
from fastpersist.formats.safetensors.errors import SafetensorsFormatError

__all__ = [
    "CRC_METADATA_KEY",
    "ENTRY_CRC_KEY",
    "ENTRY_HEADER_CRC_KEY",
    "HEADER_CRC_METADATA_KEY",
    "LENGTH",
    "MAX_HEADER_SIZE",
    "SafetensorsHeader",
    "TensorEntry",
    "entries_header_crc32",
    "header_crc32",
    "hex8",
    "parse_header",
    "read_header",
    "read_header_fd",
]

#: Key of a tensor's entry holding the CRC-32 of its bytes (8 lowercase hex digits).
ENTRY_CRC_KEY = "fastpersist.crc32"
#: Key of the first entry (data order) holding :func:`entries_header_crc32` of the header.
ENTRY_HEADER_CRC_KEY = "fastpersist.header_crc32"

#: Legacy (files of earlier fastpersist versions): ``__metadata__`` key holding the
#: per-tensor CRC-32s, comma-separated, in data order.
CRC_METADATA_KEY = "fastpersist.crc32"
#: ``__metadata__`` key holding a CRC-32 of the header's meaning (see :func:`header_crc32`):
#: tensor names, dtypes, shapes, offsets and the other metadata entries.
HEADER_CRC_METADATA_KEY = "fastpersist.header_crc32"
_RESERVED_KEYS = (CRC_METADATA_KEY, HEADER_CRC_METADATA_KEY)



def header_crc32(entries: dict[str, tuple[str, list[int], list[int]]], metadata: Optional[dict[str, str]]) -> int:
    """Legacy header CRC (``__metadata__[HEADER_CRC_METADATA_KEY]``): CRC-32 of a canonical JSON of ``name -> (dtype, shape, data_offsets)`` and the
    metadata entries other than fastpersist's own: whitespace and key order do not
    count, every value torch would see does."""
    meta = {k: v for k, v in (metadata or {}).items() if k not in _RESERVED_KEYS}
    tensors = {name: [dtype, list(shape), list(offsets)] for name, (dtype, shape, offsets) in entries.items()}
    text = json.dumps({"m": meta, "t": tensors}, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return zlib.crc32(text.encode("ascii"))


def entries_header_crc32(entries: dict[str, tuple[str, list[int], list[int]]], metadata: Optional[dict[str, str]]) -> int:
    """CRC-32 of a canonical JSON of ``name -> (dtype, shape, data_offsets)`` and the
    whole ``__metadata__`` (``None`` and ``{}`` differ): whitespace and key order do not
    count, every value a reader would see does. fastpersist's own entry keys are not
    part of it (they are checked on their own)."""
    tensors = {name: [dtype, list(shape), list(offsets)] for name, (dtype, shape, offsets) in entries.items()}
    text = json.dumps({"m": metadata, "t": tensors}, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return zlib.crc32(text.encode("ascii"))



#: Largest header safetensors accepts (bytes of JSON).
MAX_HEADER_SIZE = 100_000_000

#: The 8-byte little-endian header length that starts every safetensors file.
LENGTH = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header. ``begin``/``end`` are relative to the data start."""

    name: str
    dtype: str  # safetensors code, e.g. "F32"
    shape: tuple[int, ...]  # as in the header (F4: number of 4-bit values)
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self) -> torch.dtype:
        return CODE_TO_DTYPE[self.dtype]

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """The shape of the torch tensor (F4: last dim halved, two values per element)."""
        if self.dtype == PACKED and self.shape:
            return self.shape[:-1] + (self.shape[-1] // 2,)
        return self.shape


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed and validated safetensors header."""

    path: str
    tensors: tuple[TensorEntry, ...]  # in data order (by ``begin``)
    metadata: Optional[dict[str, str]]
    data_start: int  # file offset of the first data byte: 8 + header length
    file_size: int
    #: name -> the raw value of its entry's :data:`ENTRY_CRC_KEY` (absent names: no such key)
    entry_crcs: dict[str, Any] = field(default_factory=dict)
    #: the raw values of :data:`ENTRY_HEADER_CRC_KEY` found in entries (name, value)
    entry_header_crcs: tuple[tuple[str, Any], ...] = ()

    @property
    def legacy(self) -> bool:
        """The CRCs are in ``__metadata__`` (files of earlier fastpersist versions, which
        wrote both legacy keys). Not when the tensors' entries carry fastpersist keys, nor
        for a caller's metadata that happens to use one of those names (checksums off)."""
        return not self.entry_crcs and not self.entry_header_crcs and self.metadata is not None \
            and CRC_METADATA_KEY in self.metadata and HEADER_CRC_METADATA_KEY in self.metadata

    @property
    def crcs(self) -> Optional[list[Optional[int]]]:
        """CRC-32 per tensor (data order) recorded by fastpersist, ``None`` if absent.

        An entry is ``None`` if it is missing or cannot be parsed; a legacy list may
        have the wrong length in a damaged file (see :func:`verify_safetensors`).
        """
        if self.entry_crcs or self.entry_header_crcs:
            return [hex8(self.entry_crcs.get(e.name)) for e in self.tensors]
        if not self.legacy:
            return None
        assert self.metadata is not None
        text = self.metadata[CRC_METADATA_KEY]
        if text == "":
            return []
        return [hex8(item) for item in text.split(",")]


def hex8(item: Any) -> Optional[int]:
    """The value of a recorded CRC-32 (8 lowercase hex digits), or None if ``item`` is not one."""
    ok = isinstance(item, str) and len(item) == 8 and all(c in "0123456789abcdef" for c in item)
    return int(item, 16) if ok else None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        for text in (key, value) if isinstance(value, str) else (key,):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate escape ("\\ud800"): not a Unicode string
                raise ValueError(f"string {text!r} is not valid Unicode") from None
        out[key] = value
    return out


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _INT64_MAX


#: Largest dimension, element count or offset: torch sizes are int64.
_INT64_MAX = (1 << 63) - 1


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_header(path: str, header_json: bytes, file_size: int) -> SafetensorsHeader:
    """Validate the JSON header of a safetensors file of ``file_size`` bytes.

    Raises:
        SafetensorsFormatError: naming ``path`` and what is wrong.
    """

    def bad(what: str) -> SafetensorsFormatError:
        return SafetensorsFormatError(f"{path}: not a valid safetensors file: {what}", path)

    data_start = LENGTH.size + len(header_json)
    try:
        text = header_json.decode("utf-8")
        # "-0" parses as a float (as serde_json, safetensors' parser, reads it): never a valid size
        head = json.loads(
            text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant,
            parse_int=lambda t: -0.0 if t == "-0" else int(t),
        )
    except RecursionError:
        raise bad("the header JSON is nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad(f"the header is not valid UTF-8 JSON ({exc})") from None
    if not isinstance(head, dict):
        raise bad("the header is not a JSON object")

    metadata = head.pop("__metadata__", None)
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())
    ):
        raise bad("__metadata__ is not an object of strings")

    entries: list[TensorEntry] = []
    entry_crcs: dict[str, Any] = {}
    entry_header_crcs: list[tuple[str, Any]] = []
    for name, info in head.items():
        if not isinstance(info, dict):
            raise bad(f"the entry of tensor {name!r} is not an object")
        code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if code not in CODE_TO_DTYPE:
            raise bad(f"tensor {name!r} has an unknown or unsupported dtype {code!r}")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise bad(f"tensor {name!r} has an invalid shape {shape!r}")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
            raise bad(f"tensor {name!r} has invalid data_offsets {offsets!r}")
        begin, end = offsets
        if end < begin:
            raise bad(f"tensor {name!r} has data_offsets {offsets} that end before they begin")
        if math.prod(d for d in shape if d) > _INT64_MAX:
            raise bad(f"tensor {name!r} has shape {shape} whose element count overflows 64 bits")
        bits = math.prod(shape) * CODE_BITS[code]
        if bits % 8 or bits // 8 != end - begin or (code == PACKED and (not shape or shape[-1] % 2)):
            raise bad(f"tensor {name!r}: {code} of shape {shape} does not fill data_offsets {offsets}")
        entries.append(TensorEntry(name, code, tuple(shape), begin, end))
        if ENTRY_CRC_KEY in info:
            entry_crcs[name] = info[ENTRY_CRC_KEY]
        if ENTRY_HEADER_CRC_KEY in info:
            entry_header_crcs.append((name, info[ENTRY_HEADER_CRC_KEY]))

    entries.sort(key=lambda e: (e.begin, e.end))
    expected = 0
    for entry in entries:
        if entry.begin != expected:
            kind = "a hole" if entry.begin > expected else "an overlap"
            raise bad(f"tensor {entry.name!r} starts at data offset {entry.begin}, leaving {kind} after offset {expected}")
        expected = entry.end
    if data_start + expected != file_size:
        raise bad(
            f"the tensors end at byte {data_start + expected} but the file has {file_size} bytes "
            "(truncated, or trailing bytes)"
        )
    return SafetensorsHeader(path, tuple(entries), metadata, data_start, file_size, entry_crcs,
                             tuple(entry_header_crcs))


def read_header(path: Union[str, os.PathLike]) -> SafetensorsHeader:
    """Read and validate the header of the safetensors file at ``path`` (buffered I/O).

    Raises:
        SafetensorsFormatError: not a valid safetensors file (message names the path).
        OSError: the file cannot be opened or read.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        if file_size < LENGTH.size:
            raise SafetensorsFormatError(
                f"{path}: not a valid safetensors file: {file_size} bytes, shorter than the 8-byte header length", path
            )
        (length,) = LENGTH.unpack(f.read(LENGTH.size))
        if length > MAX_HEADER_SIZE or LENGTH.size + length > file_size:
            raise SafetensorsFormatError(
                f"{path}: not a valid safetensors file: header length {length} is larger than "
                f"{'the file' if length <= MAX_HEADER_SIZE else 'the 100 MB limit'} ({file_size} bytes)",
                path,
            )
        header_json = f.read(length)
    if len(header_json) != length:
        raise SafetensorsFormatError(f"{path}: the file shrank while its header was read", path)
    return parse_header(path, header_json, file_size)


def read_header_fd(fd: int, path: str) -> SafetensorsHeader:
    """:func:`read_header` through an open descriptor (``pread``; the file is not
    reopened, so the header is the one of the inode behind ``fd``); ``path`` names the
    file in errors. Used by the checked mmap load (:mod:`fastpersist.formats.mmapload`).

    Raises:
        SafetensorsFormatError: not a valid safetensors file (message names the path).
        OSError: the file cannot be read.
    """
    file_size = os.fstat(fd).st_size
    if file_size < LENGTH.size:
        raise SafetensorsFormatError(
            f"{path}: not a valid safetensors file: {file_size} bytes, shorter than the 8-byte header length", path
        )
    (length,) = LENGTH.unpack(pread_full(fd, LENGTH.size, 0, path).ljust(LENGTH.size, b"\0"))
    if length > MAX_HEADER_SIZE or LENGTH.size + length > file_size:
        raise SafetensorsFormatError(
            f"{path}: not a valid safetensors file: header length {length} is larger than "
            f"{'the file' if length <= MAX_HEADER_SIZE else 'the 100 MB limit'} ({file_size} bytes)",
            path,
        )
    raw = pread_full(fd, length, LENGTH.size, path)
    if len(raw) != length:
        raise SafetensorsFormatError(f"{path}: the file shrank while its header was read", path)
    return parse_header(path, raw, file_size)
