"""The safetensors format: planner, loader and verifier.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of
JSON (``{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets"}}``,
which may end in spaces), then the tensors' bytes back to back, without holes,
``data_offsets`` being relative to the end of the header.

What fastpersist adds, within the format:

* the header is padded with spaces so that the data section starts at a multiple
  of the O_DIRECT alignment (4096 or the device's block size). The tensors stay
  back to back, as the format requires, so only the first tensor is aligned;
* when checksums are on, every tensor's entry carries one more key,
  ``"fastpersist.crc32"``: the CRC-32 of its bytes (8 lowercase hex digits). The
  native writer fills them in while it streams the data (``PATCH_HEX8`` patches), so
  the file is written in one pass. The first entry (in data order) also carries
  ``"fastpersist.header_crc32"``, a CRC-32 of the header's meaning (tensor names,
  dtypes, shapes, offsets and the whole ``__metadata__``; :func:`entries_header_crc32`),
  so a changed header is detected too. safetensors (its Rust ``TensorInfo`` has no
  ``deny_unknown_fields``), huggingface_hub, torch's DCP HF reader and every reader
  that picks ``dtype``/``shape``/``data_offsets`` by name ignore the extra keys, and
  ``__metadata__`` stays exactly the caller's: ``safe_open(...).metadata()`` returns
  what ``safetensors.torch.save_file`` would have written (``None`` without metadata),
  so transformers' check of ``metadata["format"]`` sees the caller's metadata only.
  A file with no tensors has no entry to carry checksums: it is "unchecked".

Files written by earlier fastpersist versions kept the CRCs in ``__metadata__``
(``"fastpersist.crc32"``: comma-separated, data order; ``"fastpersist.header_crc32"``);
they are still read and verified (:data:`CRC_METADATA_KEY`).
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence, Union

import torch

from fastpersist import _native
from fastpersist._sys import pread_full
from fastpersist.cudaload import RingItem, ring_read
from fastpersist.cudastage import DeviceSources
from fastpersist.errors import CheckpointFormatError, ChecksumError, FastPersistError
from fastpersist.formats.base import PATCH_HEX8, WritePlan
from fastpersist.io import pinned_empty, plan_read, reader_handle, record_read, staging_auto

__all__ = [
    "ENTRY_CRC_KEY",
    "ENTRY_HEADER_CRC_KEY",
    "SafetensorsInputError",
    "UnsupportedDtypeError",
    "MetaTensorError",
    "entries_header_crc32",
    "CRC_METADATA_KEY",
    "HEADER_CRC_METADATA_KEY",
    "DTYPE_CODES",
    "SafetensorsFormatError",
    "SafetensorsHeader",
    "TensorEntry",
    "load_safetensors",
    "plan_safetensors",
    "read_header",
    "verify_safetensors",
    "check_safetensors",
    "SafetensorsCheck",
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


#: ``__metadata__`` of a ``.safetensors`` file fastpersist.save writes when the caller gives none:
#: what transformers' ``save_pretrained`` and Accelerate's ``save`` write (transformers 4.x
#: refuses files whose metadata has no known ``format``; Accelerate warns on files without metadata).
DEFAULT_SAFETENSORS_METADATA = {"format": "pt"}


def safetensors_metadata(metadata: Optional[dict]) -> dict:
    """The ``__metadata__`` :func:`fastpersist.save` writes for ``metadata``: the caller's
    entries, with ``"format": "pt"`` added unless they set ``"format"`` themselves.

    Anything but None or a dict is returned as it is, for the planner to refuse with
    safetensors' error at the point safetensors checks it (after the tensors).
    """
    if metadata is not None and not isinstance(metadata, dict):
        return metadata  # type: ignore[return-value]
    out = dict(DEFAULT_SAFETENSORS_METADATA)
    out.update(metadata or {})
    return out


def header_crc32(entries: dict[str, tuple[str, list[int], list[int]]], metadata: Optional[dict[str, str]]) -> int:
    """Legacy header CRC (``__metadata__[HEADER_CRC_METADATA_KEY]``): CRC-32 of a canonical JSON of ``name -> (dtype, shape, data_offsets)`` and the
    metadata entries other than fastpersist's own: whitespace and key order do not
    count, every value torch would see does."""
    import zlib

    meta = {k: v for k, v in (metadata or {}).items() if k not in _RESERVED_KEYS}
    tensors = {name: [dtype, list(shape), list(offsets)] for name, (dtype, shape, offsets) in entries.items()}
    text = json.dumps({"m": meta, "t": tensors}, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return zlib.crc32(text.encode("ascii"))

def entries_header_crc32(entries: dict[str, tuple[str, list[int], list[int]]], metadata: Optional[dict[str, str]]) -> int:
    """CRC-32 of a canonical JSON of ``name -> (dtype, shape, data_offsets)`` and the
    whole ``__metadata__`` (``None`` and ``{}`` differ): whitespace and key order do not
    count, every value a reader would see does. fastpersist's own entry keys are not
    part of it (they are checked on their own)."""
    import zlib

    tensors = {name: [dtype, list(shape), list(offsets)] for name, (dtype, shape, offsets) in entries.items()}
    text = json.dumps({"m": metadata, "t": tensors}, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return zlib.crc32(text.encode("ascii"))


#: Largest header safetensors accepts (bytes of JSON).
MAX_HEADER_SIZE = 100_000_000

_LEN = struct.Struct("<Q")

# (code, torch dtype attribute, bits per element); the order is the order in which
# safetensors writes tensors of different dtypes (its dtype enum, descending).
_DTYPE_TABLE: tuple[tuple[str, str, int], ...] = (
    ("U64", "uint64", 64),
    ("I64", "int64", 64),
    ("F64", "float64", 64),
    ("C64", "complex64", 64),
    ("F32", "float32", 32),
    ("U32", "uint32", 32),
    ("I32", "int32", 32),
    ("BF16", "bfloat16", 16),
    ("F16", "float16", 16),
    ("U16", "uint16", 16),
    ("I16", "int16", 16),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz", 8),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz", 8),
    ("F8_E8M0", "float8_e8m0fnu", 8),
    ("F8_E4M3", "float8_e4m3fn", 8),
    ("F8_E5M2", "float8_e5m2", 8),
    ("I8", "int8", 8),
    ("U8", "uint8", 8),
    ("F4", "float4_e2m1fn_x2", 4),  # torch packs two values per element; header counts values
    ("BOOL", "bool", 8),
)

#: torch dtype -> safetensors dtype code, for the dtypes this torch build has.
DTYPE_CODES: dict[torch.dtype, str] = {}
_CODE_TO_DTYPE: dict[str, torch.dtype] = {}
_CODE_BITS: dict[str, int] = {}
_CODE_RANK: dict[str, int] = {}
for _rank, (_code, _attr, _bits) in enumerate(_DTYPE_TABLE):
    _dt = getattr(torch, _attr, None)
    if isinstance(_dt, torch.dtype):
        DTYPE_CODES[_dt] = _code
        _CODE_TO_DTYPE[_code] = _dt
        _CODE_BITS[_code] = _bits
        _CODE_RANK[_code] = _rank
del _rank, _code, _attr, _bits, _dt

_PACKED = "F4"  # the one sub-byte dtype: header shape's last dim is twice torch's


try:  # the exception safetensors raises for invalid files, devices, 0-d float4 ...
    from safetensors import SafetensorError as _StockError
except ImportError:  # safetensors is optional: a stand-in with the same role

    class _StockError(Exception):  # type: ignore[no-redef]
        """Stands for ``safetensors.SafetensorError`` when safetensors is not installed."""


class SafetensorsFormatError(CheckpointFormatError, _StockError):
    """A file is not a valid safetensors file; ``path`` names it. Also a
    ``safetensors.SafetensorError`` (what safetensors raises for the same file) when
    safetensors is installed, and a ``ValueError``."""

    def __init__(self, message: str, path: Optional[str] = None, offset: Optional[int] = None) -> None:
        super().__init__(message, path, offset)


class SafetensorsInputError(ValueError, TypeError):
    """``tensors`` is not a dict: ``ValueError`` as safetensors raises it, and the
    ``TypeError`` earlier fastpersist versions raised."""


class UnsupportedDtypeError(ValueError, KeyError):
    """A tensor's dtype has no safetensors code: a ``ValueError``, and the ``KeyError``
    safetensors raises (its dtype table lookup) for the same tensor."""

    def __str__(self) -> str:  # not KeyError's repr() of the message
        return str(self.args[0]) if self.args else ""


class MetaTensorError(NotImplementedError, ValueError):
    """A meta tensor has no bytes to save: ``NotImplementedError`` (a ``RuntimeError``)
    as torch's copy out of a meta tensor raises inside safetensors, and a ``ValueError``."""


class SafetensorsValueError(ValueError, _StockError):
    """An argument safetensors refuses with ``SafetensorError`` (a 0-d float4 tensor, an
    unknown device or backend); also a ``ValueError``."""


class _Reader(Protocol):
    def read(self, target: Union[str, int], extents: Sequence[tuple[int, int, int, int]], nslots: int = 0) -> list[int]:
        ...


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
        return _CODE_TO_DTYPE[self.dtype]

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """The shape of the torch tensor (F4: last dim halved, two values per element)."""
        if self.dtype == _PACKED and self.shape:
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
            return [_hex8(self.entry_crcs.get(e.name)) for e in self.tensors]
        if not self.legacy:
            return None
        assert self.metadata is not None
        text = self.metadata[CRC_METADATA_KEY]
        if text == "":
            return []
        return [_hex8(item) for item in text.split(",")]


def _hex8(item: Any) -> Optional[int]:
    ok = isinstance(item, str) and len(item) == 8 and all(c in "0123456789abcdef" for c in item)
    return int(item, 16) if ok else None


# ---------------------------------------------------------------------------
# Planning a write.


def _check_inputs(tensors: Any) -> None:
    """safetensors' first checks, in its order: a dict, of tensors, dense."""
    if not isinstance(tensors, dict):
        raise SafetensorsInputError(f"Expected a dict of [str, torch.Tensor] but received {type(tensors)}")
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"Key `{name}` is invalid, expected torch.Tensor but received {type(value)}")
    sparse = [name for name, value in tensors.items() if value.layout != torch.strided]
    if sparse:
        raise ValueError(
            f"You are trying to save a sparse tensors: `{sparse}` which this library does not support."
            " You can make it a dense tensor before saving with `.to_dense()` but be aware this might"
            " make a much larger file than needed."
        )


def _check_names(tensors: dict[Any, torch.Tensor]) -> None:
    """Tensor names: str (safetensors' ``TypeError`` otherwise), never ``__metadata__``."""
    for name in tensors:
        if not isinstance(name, str):
            raise TypeError(f"argument 'tensor_dict': safetensors tensor names must be str, got "
                            f"{type(name).__name__} {name!r}")
        if name == "__metadata__":
            # safetensors writes such a file, and then cannot read it back
            raise ValueError("'__metadata__' is reserved by the safetensors format and cannot name a tensor")


def check_metadata(metadata: Any) -> None:
    """safetensors' rule for ``metadata``: None or a dict of str to str.

    Raises:
        TypeError: anything else (as safetensors raises it).
    """
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise TypeError(f"argument 'metadata': metadata must be a dict of str to str or None, "
                            f"not {type(metadata).__name__}")
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"argument 'metadata': metadata must map str to str; got {key!r}: {value!r}")


def _find_shared(tensors: dict[str, torch.Tensor]) -> list[list[str]]:
    """Groups of >= 2 names whose bytes overlap in the same storage."""
    by_storage: dict[tuple[Any, int], list[tuple[int, int, str]]] = {}
    for name, t in tensors.items():
        if t.device.type == "meta":
            continue
        nbytes = t.numel() * t.element_size()
        storage = t.untyped_storage()
        if nbytes == 0 or storage.data_ptr() == 0:
            continue
        by_storage.setdefault((t.device, storage.data_ptr()), []).append((t.data_ptr(), t.data_ptr() + nbytes, name))
    groups: list[list[str]] = []
    for spans in by_storage.values():
        spans.sort()
        current: list[str] = []
        stop = -1
        for begin, end, name in spans:
            if current and begin < stop:
                current.append(name)
            else:
                if len(current) > 1:
                    groups.append(sorted(current))
                current = [name]
            stop = max(stop, end)
        if len(current) > 1:
            groups.append(sorted(current))
    return groups


def _covers_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is its storage's whole extent (the one name of a shared group that can stand for it)."""
    return t.data_ptr() == t.untyped_storage().data_ptr() and \
        t.numel() * t.element_size() == t.untyped_storage().nbytes()


def duplicate_names(state_dict: dict[str, torch.Tensor], preferred: Any = ()) -> dict[str, list[str]]:
    """For every group of names sharing bytes in ``state_dict`` (a model's tied weights),
    the name kept and the others, as ``safetensors.torch.save_model``/``load_model``
    choose them: among the names covering the whole storage, the first in sorted order
    of those in ``preferred`` (the names a file holds), else the first of all.

    Raises:
        RuntimeError: no name of a group covers its whole storage (safetensors' refusal).
    """
    preferred = set(preferred)
    out: dict[str, list[str]] = {}
    for group in _find_shared(state_dict):
        complete = sorted(n for n in group if _covers_storage(state_dict[n]))
        if not complete:
            raise RuntimeError(
                f"tensors {group} share memory and none of them covers the whole storage: no name can stand for "
                "the others (safetensors refuses such a model too; see "
                "https://huggingface.co/docs/safetensors/torch_shared_tensors)")
        keep = next((n for n in complete if n in preferred), complete[0])
        out[keep] = [n for n in group if n != keep]
    return out


def _prepare(name: str, t: torch.Tensor, keep_device: Any = None) -> torch.Tensor:
    """Validate one tensor and return a CPU tensor whose memory holds exactly its bytes
    (a tensor on its own device when ``keep_device(storage)`` says so: a device source)."""
    # safetensors' order: contiguity, then the copy to CPU (torch refuses meta tensors),
    # then its dtype table
    if not t.is_contiguous():
        raise ValueError(
            f"You are trying to save a non contiguous tensor: `{name}`, which safetensors does not allow. "
            "If it is a view of another tensor, save the full tensor and slice it after loading; "
            "otherwise call `.contiguous()` on it before saving."
        )
    if t.device.type == "meta":
        raise MetaTensorError(f"Cannot copy out of meta tensor; no data! (tensor `{name}` is on the meta device "
                              "and has no data to save)")
    if t.dtype not in DTYPE_CODES:
        supported = ", ".join(str(d).replace("torch.", "") for d in DTYPE_CODES)
        raise UnsupportedDtypeError(
            f"Tensor `{name}` has dtype {t.dtype}, which safetensors cannot store (supported: {supported})")
    t = t.detach()
    if t.device.type != "cpu" and not (keep_device is not None and keep_device(t.untyped_storage())):
        t = t.to("cpu")  # staged; the native writer reads host memory
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def _header_shape(code: str, t: torch.Tensor) -> list[int]:
    shape = list(t.shape)
    if code == _PACKED:
        if not shape:
            raise SafetensorsValueError("a 0-d float4_e2m1fn_x2 tensor cannot be stored in safetensors "
                                       "(two values per byte)")
        shape[-1] *= 2
    return shape


def plan_safetensors(
    tensors: dict[str, torch.Tensor],
    metadata: Optional[dict[str, str]] = None,
    alignment: int = 4096,
    *,
    checksum: bool = True,
    device_sources: Any = None,
) -> WritePlan:
    """Lay out a safetensors file for the native writer, copying no tensor bytes.

    Validation matches ``safetensors.torch.save_file`` (same checks, same order, same
    exception types): a dict of str to dense, contiguous tensors; tensors that share
    memory are refused (save one of them, or use ``safetensors.torch.save_model``);
    ``metadata`` maps str to str. Non-CPU tensors are copied to CPU first.

    Args:
        tensors: name -> tensor.
        metadata: the file's ``__metadata__``, written exactly as given (``None``: no
            ``__metadata__``, as ``save_file`` does; ``fastpersist.save`` passes
            ``{"format": "pt"}`` by default, see :func:`safetensors_metadata`).
        alignment: the data section starts at a multiple of ``lcm(alignment, 8)``.
        checksum: record a CRC-32 per tensor in its entry (:data:`ENTRY_CRC_KEY`) and
            one of the header in the first entry (:data:`ENTRY_HEADER_CRC_KEY`).
        device_sources: a predicate on storages (e.g.
            :func:`fastpersist.cudastage.is_cuda_storage`): tensors it accepts are not
            copied to CPU but recorded in a :class:`fastpersist.cudastage.DeviceSources`
            (in ``keepalive``); such a plan must be written by
            :func:`fastpersist.cudastage.stream_plan`.

    Returns:
        A :class:`~fastpersist.formats.base.WritePlan` whose crc slots are the
        non-empty tensors in data order (``slot_names``).

    Raises:
        ValueError, TypeError, NotImplementedError, KeyError: invalid input, as
            safetensors raises them (see :class:`SafetensorsInputError`,
            :class:`UnsupportedDtypeError`, :class:`MetaTensorError`).
        RuntimeError: tensors share memory.
    """
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"alignment must be a positive int, not {alignment!r}")
    _check_inputs(tensors)
    shared = _find_shared(tensors)
    if shared:
        raise RuntimeError(
            f"Some tensors share memory, this would duplicate them on disk and they would no longer share after "
            f"loading: {shared}. Save only one of each group (and rebuild the others after loading), or use "
            "`safetensors.torch.save_model`, which drops the duplicates. "
            "More information at https://huggingface.co/docs/safetensors/torch_shared_tensors"
        )

    prepared = {name: _prepare(name, t, device_sources) for name, t in tensors.items()}
    _check_names(tensors)
    check_metadata(metadata)
    sources: Any = None
    if device_sources is not None:
        sources = DeviceSources()
    order = sorted(prepared, key=lambda n: (_CODE_RANK[DTYPE_CODES[prepared[n].dtype]], n))

    entries: dict[str, Any] = {}
    layout: list[tuple[str, torch.Tensor, int, int]] = []  # name, tensor, begin, nbytes
    offset = 0
    for name in order:
        t = prepared[name]
        code = DTYPE_CODES[t.dtype]
        nbytes = t.numel() * t.element_size()
        entries[name] = {"dtype": code, "shape": _header_shape(code, t), "data_offsets": [offset, offset + nbytes]}
        layout.append((name, t, offset, nbytes))
        offset += nbytes
    data_size = offset

    # The JSON, member by member, so that the byte position of each CRC placeholder is known.
    def dumps(value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")

    members: list[bytes] = []
    if metadata is not None:
        members.append(b'"__metadata__":' + dumps(dict(metadata)))
    header_crc = b""
    if checksum and entries:
        crc = entries_header_crc32({n: (e["dtype"], e["shape"], e["data_offsets"]) for n, e in entries.items()},
                                   None if metadata is None else dict(metadata))
        header_crc = dumps(ENTRY_HEADER_CRC_KEY) + b':"' + f"{crc:08x}".encode() + b'"'
    crc_at: dict[str, int] = {}  # name -> offset of its 8 placeholder digits in the JSON text
    position = 1  # after "{"
    for index, name in enumerate(order):
        member = dumps(name) + b":" + dumps(entries[name])[:-1]  # without the closing "}"
        if checksum:
            member += b"," + dumps(ENTRY_CRC_KEY) + b':"'
            crc_at[name] = position + sum(len(m) + 1 for m in members) + len(member)
            member += b'00000000"'
            if index == 0:
                member += b"," + header_crc
        members.append(member + b"}")
    text = b"{" + b",".join(members) + b"}"

    unit = alignment * 8 // math.gcd(alignment, 8)
    data_start = -(-(_LEN.size + len(text)) // unit) * unit
    header_len = data_start - _LEN.size
    header = bytearray(_LEN.pack(header_len) + text + b" " * (header_len - len(text)))
    header_t = torch.frombuffer(header, dtype=torch.uint8)

    extents: list[tuple[int, int, int, int]] = [(0, header_t.data_ptr(), data_start, -1)]
    patches: list[tuple[int, int, int]] = []
    slot_names: list[str] = []
    for name, t, begin, nbytes in layout:
        if nbytes == 0:
            continue  # its CRC is 0: the placeholder already says 00000000
        slot = len(slot_names) if checksum else -1
        ptr = t.data_ptr()
        if sources is not None and device_sources(t.untyped_storage()):
            ptr = sources.add(t.reshape(-1).view(torch.uint8))
        extents.append((data_start + begin, ptr, nbytes, slot))
        if checksum:
            patches.append((_LEN.size + crc_at[name], slot, PATCH_HEX8))
            slot_names.append(name)

    return WritePlan(
        extents=extents,
        patches=patches,
        nslots=len(slot_names),
        file_size=data_start + data_size,
        keepalive=[header, header_t, prepared] + ([sources] if sources is not None and len(sources) else []),
        slot_names=slot_names,
    )


# ---------------------------------------------------------------------------
# Reading a header.


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

    data_start = _LEN.size + len(header_json)
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
        if code not in _CODE_TO_DTYPE:
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
        bits = math.prod(shape) * _CODE_BITS[code]
        if bits % 8 or bits // 8 != end - begin or (code == _PACKED and (not shape or shape[-1] % 2)):
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
        if file_size < _LEN.size:
            raise SafetensorsFormatError(
                f"{path}: not a valid safetensors file: {file_size} bytes, shorter than the 8-byte header length", path
            )
        (length,) = _LEN.unpack(f.read(_LEN.size))
        if length > MAX_HEADER_SIZE or _LEN.size + length > file_size:
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
    if file_size < _LEN.size:
        raise SafetensorsFormatError(
            f"{path}: not a valid safetensors file: {file_size} bytes, shorter than the 8-byte header length", path
        )
    (length,) = _LEN.unpack(pread_full(fd, _LEN.size, 0, path).ljust(_LEN.size, b"\0"))
    if length > MAX_HEADER_SIZE or _LEN.size + length > file_size:
        raise SafetensorsFormatError(
            f"{path}: not a valid safetensors file: header length {length} is larger than "
            f"{'the file' if length <= MAX_HEADER_SIZE else 'the 100 MB limit'} ({file_size} bytes)",
            path,
        )
    raw = pread_full(fd, length, _LEN.size, path)
    if len(raw) != length:
        raise SafetensorsFormatError(f"{path}: the file shrank while its header was read", path)
    return parse_header(path, raw, file_size)


# ---------------------------------------------------------------------------
# Loading and verifying.


def data_extents(header: SafetensorsHeader, ptr_of: Any) -> tuple[list[tuple[int, int, int, int]], list[TensorEntry]]:
    extents = []
    slots = []
    for entry in header.tensors:
        if entry.nbytes:
            start = header.data_start + entry.begin
            extents.append((start, ptr_of(start), entry.nbytes, len(slots)))
            slots.append(entry)
    return extents, slots


def crc_problems(header: SafetensorsHeader, slots: list[TensorEntry], crcs: Sequence[int]) -> list[tuple[str, str]]:
    """``(record, message)`` for every recorded CRC-32 that does not match (record: tensor name)."""
    recorded = header.crcs
    assert recorded is not None
    if len(recorded) != len(header.tensors):
        return [
            (
                CRC_METADATA_KEY,
                f"{header.path}: {CRC_METADATA_KEY} lists {len(recorded)} checksums for {len(header.tensors)} "
                "tensors; the header was altered after fastpersist wrote it",
            )
        ]
    expected = {e.name: r for e, r in zip(header.tensors, recorded)}
    problems: list[tuple[str, str]] = []
    meta = header.metadata or {}
    altered = "it was altered after fastpersist wrote it"
    meaning = {e.name: (e.dtype, list(e.shape), [e.begin, e.end]) for e in header.tensors}
    want_h: Any = None
    if not header.legacy:
        if len(header.entry_header_crcs) != 1:
            problems.append((ENTRY_HEADER_CRC_KEY, f"{header.path}: {len(header.entry_header_crcs)} tensor entries "
                             f"carry {ENTRY_HEADER_CRC_KEY} where fastpersist writes it in one; the header was "
                             "altered after fastpersist wrote it"))
        else:
            want_h = header.entry_header_crcs[0][1]
            got_h = entries_header_crc32(meaning, header.metadata)
    elif HEADER_CRC_METADATA_KEY in meta:
        want_h = meta[HEADER_CRC_METADATA_KEY]
        got_h = header_crc32(meaning, meta)
    if want_h is not None and want_h != f"{got_h:08x}":
        problems.append(
            (
                ENTRY_HEADER_CRC_KEY if not header.legacy else HEADER_CRC_METADATA_KEY,
                f"{header.path}: the header (tensor names, dtypes, shapes, offsets or metadata) does not match "
                f"its recorded CRC-32 ({got_h:08x}, recorded {str(want_h)[:8]!r}); {altered}",
            )
        )
    for entry in header.tensors:
        if expected[entry.name] is None:
            what = "has no recorded checksum (other tensors have one)" if not header.legacy and \
                entry.name not in header.entry_crcs else "recorded checksum is not 8 hex digits"
            problems.append((entry.name, f"{header.path}: tensor {entry.name!r}: {what}"))
        elif entry.nbytes == 0 and expected[entry.name] != 0:
            problems.append(
                (entry.name, f"{header.path}: tensor {entry.name!r} is empty but its recorded CRC-32 is not 00000000")
            )
    for entry, actual in zip(slots, crcs):
        want = expected[entry.name]
        if want is not None and actual != want:
            problems.append(
                (
                    entry.name,
                    f"{header.path}: tensor {entry.name!r}: CRC-32 of its bytes is {actual:08x}, recorded {want:08x} "
                    f"(file bytes {header.data_start + entry.begin}..{header.data_start + entry.end})",
                )
            )
    return problems


def _host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """A page-aligned uint8 tensor of at least ``nbytes`` (rounded up to 4096) bytes."""
    size = max(4096, -(-nbytes // 4096) * 4096)
    if pinned:
        return pinned_empty(size)

    return torch.frombuffer(_native.PinnedBuffer(size, 4096, lock=False), dtype=torch.uint8)


def load_safetensors(
    path: Union[str, os.PathLike],
    handle: _Reader,
    device: Union[str, int, torch.device] = "cpu",
    *,
    checksum: bool = True,
) -> dict[str, torch.Tensor]:
    """Load every tensor of a safetensors file, like ``safetensors.torch.load_file``.

    The file is read with one native read into one page-aligned host buffer; on CPU
    each returned tensor is a separate storage over its bytes in that buffer (the
    buffer lives as long as any of them). CUDA devices: the tensors' bytes go through
    the bounded page-locked ring of :mod:`fastpersist.cudaload` straight into device
    memory (:func:`_load_via_ring`). Other devices get copies (``.to(device)``).

    Args:
        path: the file.
        handle: a ``fastpersist._native.Handle`` (or anything with its ``read``).
        device: where the tensors go.
        checksum: if the file carries fastpersist CRC-32s, check them while reading.

    Raises:
        SafetensorsFormatError: the file is not valid safetensors (names the path).
        ChecksumError: a tensor's bytes do not match the CRC-32 recorded at save time.
        OSError, EOFError: reading failed.
    """
    path = os.fspath(path)
    # One descriptor for the header and the data: a save that renames a new file over
    # ``path`` meanwhile cannot pair this header with another file's bytes.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        header = read_header_fd(fd, path)
        device = torch.device(device) if not isinstance(device, torch.device) else device
        if device.type == "cuda" and hasattr(handle, "read_async"):
            return _load_via_ring(path, header, handle, device, checksum=checksum, fd=fd)
        base = _host_buffer(header.file_size, pinned=device.type != "cpu")
        base_ptr = base.data_ptr()

        check = checksum and header.crcs is not None
        extents, slots = data_extents(header, lambda off: base_ptr + off)
        reader, plan = _plan_reader(fd, header.file_size, handle)
        started = time.perf_counter()
        if check:
            read_extents = [(0, base_ptr, header.data_start, -1)] + extents
            crcs = _read_fd(reader, fd, path, read_extents, len(slots))
            problems = crc_problems(header, slots, crcs)
            if problems:
                raise checksum_error(path, problems)
        else:
            _read_fd(reader, fd, path, [(0, base_ptr, header.file_size, -1)], 0)
        if plan is not None:
            record_read(plan, header.file_size, time.perf_counter() - started)
    finally:
        os.close(fd)

    try:
        return _tensors(header, base, device)
    except (RuntimeError, TypeError, ValueError, OverflowError) as exc:
        raise SafetensorsFormatError(f"{path}: cannot make tensors of the header's dtypes and shapes ({exc})", path) from exc


def _read_fd(reader: Any, fd: int, path: str, extents: Sequence[tuple[int, int, int, int]], nslots: int) -> list[int]:
    """``reader.read`` through the load's descriptor ``fd``; errors name ``path`` (the
    native engine would name the descriptor's target, possibly ``... (deleted)``)."""
    try:
        return reader.read(fd, extents, nslots)
    except (EOFError, OSError) as e:
        raise _naming(e, path) from e


def _naming(e: BaseException, path: str) -> BaseException:
    """A read error through a descriptor of ``path``, naming ``path``."""
    if isinstance(e, EOFError):
        return EOFError(f"{path}: the file is shorter than its header says (truncated, or rewritten in place "
                        f"while loading): {e}")
    if isinstance(e, OSError) and e.errno is not None and e.filename != path:
        return type(e)(e.errno, e.strerror or str(e), path)
    return e


def checksum_error(path: str, problems: list[tuple[str, str]]) -> ChecksumError:
    """The error for ``(tensor name, message)`` CRC mismatches of ``path``."""
    return ChecksumError(
        f"{path}: checksum mismatch, the file is corrupt (restore it from a good copy, or pass "
        "checksum=False to read the bytes anyway):\n" + "\n".join(msg for _, msg in problems),
        path,
        [name for name, _ in problems],
    )


def _load_via_ring(path: str, header: SafetensorsHeader, handle: Any, device: torch.device, *,
                   checksum: bool, fd: Optional[int] = None) -> dict[str, torch.Tensor]:
    """Every tensor read through :func:`fastpersist.cudaload.ring_read` into its own
    ``device`` tensor (CRC-32s checked from the host windows when the file has them),
    no host copy of the file. Used for CUDA devices; works for any device (docs/gpu.md).

    ``fd``: the descriptor ``header`` was read through (:func:`load_safetensors`), so
    the data comes from the same file even if ``path`` is replaced meanwhile; None:
    ``path`` is opened here (callers that read ``header`` themselves)."""
    check = checksum and header.crcs is not None
    entries = sorted((e for e in header.tensors if e.nbytes), key=lambda e: e.begin)
    items = [RingItem(header.data_start + e.begin, header.data_start + e.begin, e.nbytes,
                      torch.empty(e.nbytes, dtype=torch.uint8, device=device)) for e in entries]
    own = fd is None
    rfd = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if fd is None else fd
    try:
        ring_read(rfd, handle, items, checksum=check)
    except (EOFError, OSError) as e:
        raise _naming(e, path) from e
    finally:
        if own:
            os.close(rfd)
    if check:
        by_name = {e.name: it.crc for e, it in zip(entries, items)}
        _extents, slots = data_extents(header, lambda off: 0)
        problems = crc_problems(header, slots, [by_name[e.name] for e in slots])
        if problems:
            raise checksum_error(path, problems)
    raw = {e.name: it.dest for e, it in zip(entries, items)}
    out: dict[str, torch.Tensor] = {}
    try:
        for e in header.tensors:
            if e.nbytes == 0:
                out[e.name] = torch.empty(e.torch_shape, dtype=e.torch_dtype, device=device)
            else:
                out[e.name] = raw[e.name].view(e.torch_dtype).view(e.torch_shape)
    except (RuntimeError, TypeError, ValueError, OverflowError) as exc:
        raise SafetensorsFormatError(f"{path}: cannot make tensors of the header's dtypes and shapes ({exc})", path) from exc
    return out


def _plan_reader(fd: int, nbytes: int, handle: Any) -> tuple[Any, Any]:
    """The handle a load of the file open as ``fd`` reads with (``handle`` itself, or a
    pooled one reading the way :func:`fastpersist.io.plan_read` chose) and the plan
    (None: ``handle`` as it is)."""
    mode = getattr(handle, "read_mode", None)
    if mode is None or not hasattr(handle, "stage_reads"):
        return handle, None  # a stand-in reader (tests): read with it as it is
    plan = plan_read(fd, nbytes, read_mode=mode, direct=handle.direct, stage=handle.stage_reads,
                     stage_auto=staging_auto(handle))
    if plan.direct == handle.direct and plan.stage == handle.stage_reads:
        return handle, plan
    return reader_handle(handle, plan), plan


def _tensors(header: SafetensorsHeader, base: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    buffer = base.numpy()
    for entry in header.tensors:
        dtype = entry.torch_dtype
        start = header.data_start + entry.begin
        if entry.nbytes == 0:
            tensor = torch.empty(entry.torch_shape, dtype=dtype)
        elif device.type == "cpu" and start % dtype.itemsize == 0:
            # its own storage over its bytes: saving one loaded tensor saves only its bytes
            tensor = torch.frombuffer(buffer, dtype=dtype, count=entry.nbytes // dtype.itemsize, offset=start)
        else:
            raw = base[start : start + entry.nbytes]
            if start % dtype.itemsize:
                raw = raw.clone()  # misaligned for its dtype (possible in files from other writers)
            tensor = raw.view(dtype)
        tensor = tensor.view(entry.torch_shape)
        out[entry.name] = tensor if device.type == "cpu" else tensor.to(device)
    return out


@dataclass
class SafetensorsCheck:
    """What :func:`check_safetensors` found. ``checked`` is false when the file has
    no fastpersist CRCs (only its structure was validated, its bytes were not)."""

    problems: list[str]
    records: int = 0  #: tensors in the header
    nbytes: int = 0  #: payload bytes checksummed (0 when unchecked)
    checked: bool = False


def check_safetensors(path: Union[str, os.PathLike], handle: _Reader) -> SafetensorsCheck:
    """Validate a safetensors file's structure and, if it carries fastpersist CRCs,
    every tensor's bytes.

    Raises:
        OSError, EOFError: the file cannot be read (bad content never raises).
    """
    path = os.fspath(path)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # one descriptor: header and bytes of one file
    try:
        try:
            header = read_header_fd(fd, path)
        except SafetensorsFormatError as exc:
            return SafetensorsCheck([str(exc)], checked=True)
        records = len(header.tensors)
        if header.crcs is None:
            return SafetensorsCheck([], records=records, checked=False)
        extents, slots = data_extents(header, lambda off: 0)
        crcs = _read_fd(handle, fd, path, extents, len(slots)) if extents else []
    finally:
        os.close(fd)
    problems = [msg for _, msg in crc_problems(header, slots, crcs)]
    return SafetensorsCheck(problems, records=records, nbytes=sum(e.nbytes for e in slots), checked=True)


def verify_safetensors(path: Union[str, os.PathLike], handle: _Reader) -> list[str]:
    """Check a safetensors file; return the problems found (empty: none).

    Always checks the structure (header length, JSON, dtypes, shapes, offsets, no
    holes or overlaps, file size). If fastpersist recorded CRC-32s, every tensor's
    bytes are read (one native read, discarded after checksumming) and compared,
    naming each tensor that differs. Files written by other tools carry no
    checksums: only their structure can be checked, and an empty list then does
    not vouch for the bytes (see :func:`check_safetensors`, :func:`has_checksums`).

    Raises:
        OSError, EOFError: the file cannot be read.
    """
    return check_safetensors(path, handle).problems


def has_checksums(path: Union[str, os.PathLike]) -> bool:
    """Whether the file's header carries fastpersist CRC-32s (else verify checks structure only)."""
    return read_header(path).crcs is not None
