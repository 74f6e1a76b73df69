"""``.metadata`` of a DCP checkpoint: sealing, safe unpickling, and the storage table's checks.

Shared by :class:`fastpersist.dcp.FastPersistReader` and ``fastpersist.verify`` so a
load and a verify refuse the same damage with the same words.

* **Seal.** :class:`fastpersist.dcp.FastPersistWriter` appends a 20-byte trailer to
  the pickle: ``b"FPDCPMD1"``, the CRC-32 of the pickle bytes (u32 LE) and their
  length (u64 LE). ``pickle.load`` stops at the pickle's STOP opcode and ignores
  what follows (documented Python behaviour), so DCP's stock reader reads the file
  unchanged; fastpersist checks the seal, so a flipped byte in ``.metadata`` (a
  chunk offset, a size, a storage offset) is an error instead of a load that puts
  bytes in the wrong place. Files without the trailer (stock writer, older
  fastpersist) are read unchecked.
* **Safe unpickling.** Only the classes a DCP ``.metadata`` is made of (DCP's own
  metadata classes, torch dtypes/sizes/layouts/memory formats, paths, builtin
  containers) are resolved; a pickle naming anything else is refused, never run.
* **Storage table.** Every record must name a file inside the checkpoint
  directory, carry non-negative integer offset and length, and no two records of
  one file may overlap (no writer, ours or DCP's, makes overlapping records; two
  entries over the same bytes would hand one item's bytes to another).
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zlib
from typing import Any, Optional

from fastpersist.errors import CheckpointFormatError

_DCP = "torch.distributed.checkpoint"
MAGIC = b"FPDCPMD1"
_TRAILER = struct.Struct("<8sIQ")
TRAILER_SIZE = _TRAILER.size

_PATHS = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}
_SAFE_BUILTINS = {"set", "frozenset", "tuple", "list", "dict", "int", "float", "str", "bytes", "bool", "slice"}

#: What to do, appended to every metadata / storage-table error.
ADVICE = ("restore the checkpoint directory from a good copy, or load an earlier checkpoint "
          "(`fastpersist verify DIR` lists every problem)")


class RefusedGlobal(pickle.UnpicklingError):
    """The pickle names a class or function that DCP metadata is not made of."""


class MetadataUnpickler(pickle.Unpickler):
    """Only the classes a DCP ``.metadata`` is made of."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == _DCP or module.startswith(_DCP + "."):
            obj = super().find_class(module, name)
            if isinstance(obj, type):  # dataclasses and enums, never functions
                return obj
        elif module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)) or obj is torch.Size:
                return obj
        elif (
            (module, name) in (("torch.serialization", "_get_layout"), ("collections", "OrderedDict"))
            or (module == "pathlib" and name in _PATHS)
            or (module == "builtins" and name in _SAFE_BUILTINS)
        ):
            return super().find_class(module, name)
        raise RefusedGlobal(f"{module}.{name} is not part of DCP checkpoint metadata")


def seal(data: bytes) -> bytes:
    """``data`` (a pickled ``Metadata``) with the fastpersist trailer appended."""
    return data + _TRAILER.pack(MAGIC, zlib.crc32(data) & 0xFFFFFFFF, len(data))


def unseal(raw: bytes, path: str) -> tuple[bytes, bool]:
    """The pickle bytes of a ``.metadata`` and whether a seal vouched for them.

    Raises ``CheckpointFormatError`` when the trailer is there but its CRC or length
    disagrees with the bytes before it."""
    if len(raw) < TRAILER_SIZE or raw[-TRAILER_SIZE:-TRAILER_SIZE + len(MAGIC)] != MAGIC:
        return raw, False
    _magic, crc, length = _TRAILER.unpack(raw[-TRAILER_SIZE:])
    body = raw[:-TRAILER_SIZE]
    if length != len(body):
        raise CheckpointFormatError(
            f"{path}: the fastpersist seal at offset {len(body)} records {length} bytes of metadata, the file has "
            f"{len(body)}: .metadata is truncated or was edited; {ADVICE}", path, len(body))
    got = zlib.crc32(body) & 0xFFFFFFFF
    if got != crc:
        raise CheckpointFormatError(
            f"{path}: CRC-32 of the metadata (bytes [0, {len(body)})) is {got:08x}, the seal at offset {len(body)} "
            f"records {crc:08x}: .metadata changed after it was written; {ADVICE}", path, 0)
    return body, True


def load_metadata(path: str) -> tuple[Any, bool]:
    """``(Metadata, sealed)`` from the file at ``path``; ``CheckpointFormatError`` naming
    the file for anything that is not sealed-and-intact or unsealed DCP metadata."""
    with open(path, "rb") as f:
        raw = f.read()
    return load_metadata_bytes(raw, path)


def load_metadata_bytes(raw: bytes, path: str) -> tuple[Any, bool]:
    """:func:`load_metadata` of a ``.metadata`` already read (an object fetched from a
    store); ``path`` names it in errors."""
    from torch.distributed.checkpoint.metadata import Metadata

    body, sealed = unseal(raw, path)
    try:
        md = MetadataUnpickler(io.BytesIO(body)).load()
    except RefusedGlobal as e:
        raise CheckpointFormatError(
            f"{path}: not DCP checkpoint metadata ({e}; refused, never run): if this checkpoint comes from a source "
            f"you trust and its planner stored other classes in its metadata, DCP's FileSystemReader unpickles it "
            f"without restrictions; otherwise {ADVICE}", path) from e
    except Exception as e:  # noqa: BLE001 - any malformed pickle is a verdict, not a crash
        raise CheckpointFormatError(f"{path}: not DCP checkpoint metadata ({type(e).__name__}: {e}); {ADVICE}",
                                    path) from e
    if not isinstance(md, Metadata) or not isinstance(getattr(md, "storage_data", None), dict):
        raise CheckpointFormatError(
            f"{path}: not DCP checkpoint metadata (a {type(md).__name__} without a storage_data table); {ADVICE}",
            path)
    why = _malformed(md)
    if why:
        raise CheckpointFormatError(f"{path}: malformed DCP checkpoint metadata ({why}); {ADVICE}", path)
    return md, sealed


def _missing_fields(obj: Any) -> list[str]:
    import dataclasses

    if not dataclasses.is_dataclass(obj):
        return []
    return [f.name for f in dataclasses.fields(obj) if not hasattr(obj, f.name)]


def _malformed(md: Any) -> Optional[str]:
    """What makes an unpickled ``Metadata`` unusable (fields lost to a damaged name,
    wrong types, chunks outside their tensor), or None. DCP's planner would fail on
    these with a bare ``AttributeError``/``TypeError`` or place chunks wrongly."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    def sizes(v: Any) -> bool:
        return isinstance(v, (torch.Size, tuple, list)) and all(type(x) is int and x >= 0 for x in v)

    if _missing_fields(md):
        return f"Metadata without {', '.join(_missing_fields(md))}"
    if not isinstance(md.state_dict_metadata, dict):
        return "state_dict_metadata is not a dict"
    for fqn, meta in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            return f"state_dict_metadata key {fqn!r} is not a string"
        if isinstance(meta, BytesStorageMetadata):
            continue
        if not isinstance(meta, TensorStorageMetadata) and type(meta).__module__.startswith(_DCP):
            continue  # a kind of entry this code does not know (a newer DCP): DCP's planner judges it
        if not isinstance(meta, TensorStorageMetadata) or _missing_fields(meta):
            return f"{fqn}: a {type(meta).__name__} {_missing_fields(meta) or ''} in state_dict_metadata"
        props = meta.properties
        if not isinstance(props, TensorProperties) or _missing_fields(props) or not isinstance(props.dtype,
                                                                                               torch.dtype):
            return f"{fqn}: tensor properties {props!r}"
        if not sizes(meta.size) or not isinstance(meta.chunks, list):
            return f"{fqn}: size {meta.size!r}, chunks {type(meta.chunks).__name__}"
        for c in meta.chunks:
            if (not isinstance(c, ChunkStorageMetadata) or _missing_fields(c) or not sizes(c.offsets)
                    or not sizes(c.sizes) or len(c.offsets) != len(meta.size) or len(c.sizes) != len(meta.size)
                    or any(o + n > d for o, n, d in zip(c.offsets, c.sizes, meta.size))):
                return f"{fqn}: chunk {c!r} outside the tensor's size {tuple(meta.size)}"
    for index, info in md.storage_data.items():
        if not isinstance(index, MetadataIndex) or _missing_fields(index) or not isinstance(index.fqn, str):
            return f"storage_data key {index!r}"
        if not isinstance(info, _StorageInfo) or _missing_fields(info):
            return f"storage record {info!r} of {item_name(index)}"
    have = {(k.fqn, tuple(k.offset) if k.offset is not None else None) for k in md.storage_data}
    for fqn, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            wanted = [(fqn, tuple(c.offsets)) for c in meta.chunks]
        elif isinstance(meta, BytesStorageMetadata):
            wanted = [(fqn, None)]
        else:
            continue
        for key in wanted:
            if key not in have:
                return f"no storage record for {key[0]}{'@' + str(key[1]) if key[1] else ''}"
    return None


def item_name(index: Any) -> str:
    """``fqn`` or ``fqn@offsets`` for messages."""
    fqn = getattr(index, "fqn", str(index))
    offset = getattr(index, "offset", None)
    return f"{fqn}@{tuple(offset)}" if offset is not None and len(offset) else str(fqn)


def inside(rel: Any) -> bool:
    """Whether a record's ``relative_path`` names a file inside the checkpoint directory."""
    if not isinstance(rel, str) or not rel or "\0" in rel or os.path.isabs(rel):
        return False
    parts = rel.replace("\\", "/").split("/")
    return ".." not in parts


def table_problems(storage_data: dict, where: str) -> list[tuple[Any, Optional[str], Optional[int], str]]:
    """``(index, relative path, offset, message)`` for every record that names no file inside
    the directory, has a non-integer or negative offset/length, or overlaps another
    record of its file. ``where`` names the metadata file in messages."""
    out: list[tuple[Any, Optional[str], Optional[int], str]] = []
    per_file: dict[str, list[tuple[int, int, Any]]] = {}
    for index, info in storage_data.items():
        rel = getattr(info, "relative_path", None)
        off, n = getattr(info, "offset", None), getattr(info, "length", None)
        if not inside(rel):
            out.append((index, None, None, f"{where}: item {item_name(index)} names no file inside the checkpoint "
                                     f"({rel!r})"))
            continue
        if type(off) is not int or type(n) is not int or off < 0 or n < 0:
            out.append((index, rel, None, f"{where}: item {item_name(index)} in {rel} has offset {off!r} and length {n!r} "
                                   f"(non-negative integers expected)"))
            continue
        per_file.setdefault(rel, []).append((off, n, index))
    for rel, recs in sorted(per_file.items()):
        recs.sort(key=lambda r: (r[0], r[1]))
        end, holder = 0, None  # the furthest end so far and the record reaching it
        for off, n, index in recs:
            if n and off < end:
                out.append((index, rel, off, f"{where}: item {item_name(index)} at [{off}, {off + n}) of {rel} overlaps "
                                      f"item {item_name(holder[2])} at [{holder[0]}, {holder[0] + holder[1]})"))
            elif off + n > end:
                end, holder = off + n, (off, n, index)
    return out
