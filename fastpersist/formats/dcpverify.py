"""``fastpersist.verify`` for a ``torch.distributed.checkpoint`` (DCP) directory.

A directory holding ``.metadata`` (or DCP's rank-local ``__N.metadata`` files,
written with ``use_collectives=False``) is a DCP checkpoint. Checked:

* ``.metadata`` unpickles with a restricted unpickler (DCP's own metadata
  classes, torch dtypes/sizes/layouts, paths: nothing that runs code) into a
  ``Metadata`` with a ``storage_data`` table, and when it carries fastpersist's
  seal (a CRC-32 of the pickle, see :mod:`fastpersist.formats.dcpmetadata`) the seal
  matches: the checks are those :class:`fastpersist.dcp.FastPersistReader` makes
  before loading, with the same messages;
* the metadata is well formed (every field of DCP's classes present, dtypes,
  sizes, chunks inside their tensor) and every tensor chunk and bytes entry of
  ``state_dict_metadata`` has a storage record; every record names an existing file in the directory and a byte
  range inside it, not overlapping another record's;
* every record holds what its item needs, as the reader checks when it delivers
  it: a tensor chunk's record is a torch.save'd tensor of the item's dtype and chunk
  shape (read with ``skip_data``: the header and pickle only), a bytes item's record
  is not a bare tensor (records swapped in ``.metadata`` and resealed pass the seal
  and every CRC-32: only this tells);
* every record's bytes are read (natively, not kept) and their CRC-32 compared
  with the one :class:`fastpersist.dcp.FastPersistWriter` recorded on it.

A checkpoint written by DCP's stock ``FileSystemWriter`` carries no checksums: it
is ``"unchecked"`` when its structure is sound (its bytes are not read).

The checks read the checkpoint through a :class:`DcpSource`: :class:`DirectorySource`
for a directory; :mod:`fastpersist.s3dcpverify` gives one for a checkpoint under an
``s3://`` prefix (the same checks, with no file written).

Only the files the metadata references are looked at. Data files it does not
reference (``__RANK_fpTOKEN_K.distcp`` of a save into this directory that failed
or was killed before its ``.metadata`` replaced the previous one, or temporary
files of a killed writer) are not part of the checkpoint: they are neither read
nor reported, and the next save that commits removes them
(:class:`fastpersist.dcp.FastPersistWriter`).
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Optional, Protocol, Sequence

from fastpersist import _compat
from fastpersist.errors import CheckpointFormatError
from fastpersist.formats.base import VerifyResult
from fastpersist.formats.dcpmetadata import (ADVICE, MetadataUnpickler, item_name, load_metadata_bytes,
                                             table_problems)

_MetadataUnpickler = MetadataUnpickler  # the name this module used to define


@dataclass
class DcpCheck:
    records: int = 0
    nbytes: int = 0
    checked: bool = False
    problems: list[str] = field(default_factory=list)


_name = item_name


def looks_like_dcp(directory: str) -> bool:
    """Whether ``directory`` holds a DCP ``.metadata``, ``__N.metadata`` or ``.distcp``
    file (what ``fastpersist verify DIR`` accepts: a damaged checkpoint too)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return False
    return any(n == ".metadata" or (n.startswith("__") and n.endswith((".metadata", ".distcp"))) for n in names)


def metadata_files(directory: str) -> list[str]:
    """``.metadata``, else the rank-local ``__N.metadata`` files; [] when neither exists."""
    main = os.path.join(directory, ".metadata")
    if os.path.isfile(main):
        return [main]
    return sorted(glob.glob(os.path.join(glob.escape(directory), "__*.metadata")))


@dataclass
class OpenedFile:
    """A data file of the checkpoint, opened for the checks."""

    size: int  #: its length in bytes
    fd: int  #: a descriptor readable with ``os.pread``: the kind checks read records' headers through it
    #: ``crcs(spans)``: the CRC-32 of each ``(offset, length)`` span (its bytes are read, not kept)
    crcs: Callable[[Sequence[tuple[int, int]]], list[int]]


class DcpSource(Protocol):
    """Where a DCP checkpoint's files are read from."""

    #: the checkpoint's name in messages (a directory, an ``s3://`` URL)
    name: str

    def metadata_names(self) -> list[str]:
        """``.metadata``, else the rank-local ``__N.metadata`` names; [] when neither exists."""

    def read(self, rel: str) -> bytes:
        """The whole of the (small) file ``rel``."""

    def path(self, rel: str) -> str:
        """``rel``'s name in messages."""

    def open(self, rel: str, spans: Sequence[tuple[int, int]], read: bool) -> ContextManager[Optional[OpenedFile]]:
        """The data file ``rel``, or None when it does not exist. ``spans`` are the
        records the checks will look at (inside the file); ``read``: their CRC-32s will be
        asked for."""


class DirectorySource:
    """A DCP checkpoint in a local directory, read with ``handle`` (a native handle)."""

    def __init__(self, directory: str, handle: Any) -> None:
        self.name = directory
        self.handle = handle

    def metadata_names(self) -> list[str]:
        return [os.path.basename(p) for p in metadata_files(self.name)]

    def read(self, rel: str) -> bytes:
        with open(self.path(rel), "rb") as f:
            return f.read()

    def path(self, rel: str) -> str:
        return os.path.join(self.name, rel)

    @contextlib.contextmanager
    def open(self, rel: str, spans: Sequence[tuple[int, int]], read: bool) -> Iterator[Optional[OpenedFile]]:
        path = self.path(rel)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            yield None
            return
        try:
            def crcs(spans: Sequence[tuple[int, int]]) -> list[int]:
                extents = [(off, 0, n, slot) for slot, (off, n) in enumerate(spans) if n]
                return list(self.handle.read(path, extents, len(spans))) if extents else [0] * len(spans)

            yield OpenedFile(os.fstat(fd).st_size, fd, crcs)
        finally:
            os.close(fd)


def _load_metadata(source: DcpSource, rel: str, check: DcpCheck) -> Any:
    path = source.path(rel)
    try:
        md, _sealed = load_metadata_bytes(source.read(rel), path)
    except CheckpointFormatError as e:
        check.problems.append(str(e))
        return None
    return md


def check_dcp(directory: str, handle: Any) -> DcpCheck:
    """Check the DCP checkpoint in ``directory`` (see the module docstring)."""
    return check_source(DirectorySource(directory, handle))


def check_source(source: DcpSource) -> DcpCheck:
    """Check the DCP checkpoint ``source`` reads (see the module docstring)."""
    check = DcpCheck()
    files = source.metadata_names()
    if not files:
        check.problems.append(f"{source.name}: no .metadata: not a DCP checkpoint, or a save that did not finish "
                              f"(.metadata is written last); nothing here can be loaded; {ADVICE}")
        return check
    per_file: dict[str, list[tuple[Any, Any, Any]]] = {}
    with_crc = without_crc = 0
    for rel in files:
        md = _load_metadata(source, rel, check)
        if md is None:
            continue
        bad = table_problems(md.storage_data, source.path(rel))
        check.problems.extend(p[3] for p in bad)
        skip = {id(p[0]) for p in bad}
        kinds = _expected_kinds(md)
        for index, info in md.storage_data.items():
            if _compat.dcp_storage_crc(info) is None:
                without_crc += 1
            else:
                with_crc += 1
            if id(index) not in skip:
                per_file.setdefault(info.relative_path, []).append((index, info, kinds.get(index)))
    check.records = with_crc + without_crc
    if with_crc and without_crc:
        check.problems.append(f"{source.name}: {without_crc} of {check.records} items have no CRC-32")
    for rel, items in sorted(per_file.items()):
        _check_file(source, rel, items, check, read=with_crc > 0)
    check.checked = with_crc > 0
    return check


def _expected_kinds(md: Any) -> dict[Any, Any]:
    """What each storage record must hold, from ``state_dict_metadata``: for a tensor
    chunk ``(dtype, chunk sizes)``, for a bytes item ``None``; keyed by MetadataIndex."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    out: dict[Any, Any] = {}
    for fqn, item in (getattr(md, "state_dict_metadata", None) or {}).items():
        if isinstance(item, TensorStorageMetadata):
            for chunk in item.chunks:
                out[MetadataIndex(fqn, chunk.offsets)] = (item.properties.dtype, tuple(chunk.sizes))
        elif isinstance(item, BytesStorageMetadata):
            out[MetadataIndex(fqn)] = None
    return out


class _RangeFile(io.RawIOBase):
    """The bytes ``[offset, offset + length)`` of an open file, as a seekable file object
    (torch.load of one item without reading the rest of the file)."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self.fd, self.base, self.length, self.pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence] + offset
        return self.pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        data = os.pread(self.fd, n, self.base + self.pos) if n else b""
        b[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _kind_problem(path: str, fd: int, index: Any, info: Any, want: Any) -> Optional[str]:
    """Whether the record ``info`` holds what its item needs, checked as the reader does
    when it delivers it (:meth:`fastpersist.dcp.FastPersistReader._deliver`): a tensor item's
    record is a torch.save'd tensor of the item's dtype and chunk shape (its bytes are not
    read: ``skip_data``); a bytes item's record is no such tensor of another item. None: fine."""
    import torch

    where = f"{path}: item {_name(index)} at [{info.offset}, {info.offset + info.length})"
    try:
        with torch.serialization.skip_data():
            obj = torch.load(_RangeFile(fd, info.offset, info.length), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch.load of damaged bytes raises anything
        if want is None:
            return None  # a bytes item may hold any pickle (weights_only=False at load): its CRC speaks for it
        return f"{where} is not a tensor saved by torch.save ({type(e).__name__}: {e}); {ADVICE}"
    if want is None:
        if isinstance(obj, torch.Tensor):
            return (f"{where}: a bytes item whose record holds a bare tensor ({obj.dtype}, {tuple(obj.shape)}), "
                    f"as a tensor item's does: .metadata's records were swapped or edited; {ADVICE}")
        return None
    dtype, sizes = want
    if not isinstance(obj, torch.Tensor):
        return f"{where} holds a {type(obj).__name__}, not a tensor; {ADVICE}"
    if obj.dtype != dtype or tuple(obj.shape) != sizes:
        return (f"{where} holds a tensor of {obj.dtype} and shape {tuple(obj.shape)}, .metadata describes "
                f"{dtype} and shape {sizes}: the record belongs to another item; {ADVICE}")
    return None


def _check_file(source: DcpSource, rel: str, items: list[tuple[Any, Any, Any]], check: DcpCheck,
                read: bool) -> None:
    path = source.path(rel)
    ordered = sorted(items, key=lambda it: (it[1].offset, it[1].length))
    with source.open(rel, [(info.offset, info.length) for _i, info, _k in ordered], read) as f:
        if f is None:
            check.problems.append(f"{path}: missing ({len(items)} items of the checkpoint are stored in it); {ADVICE}")
            return
        good = []
        kinds = {}
        for index, info, kind in ordered:
            off, n = info.offset, info.length
            if off + n > f.size:
                check.problems.append(f"{path}: item {_name(index)} at [{off}, {off + n}) lies outside the file "
                                      f"({f.size} bytes): truncated, or .metadata belongs to another checkpoint")
                continue
            good.append((index, info))
            kinds[id(index)] = kind
        for index, info in good:
            problem = _kind_problem(path, f.fd, index, info, kinds[id(index)])
            if problem is not None:
                check.problems.append(problem)
        if not read or not good:
            return
        try:
            crcs = f.crcs([(info.offset, info.length) for _i, info in good])
        except EOFError as e:
            check.problems.append(f"{path}: shorter than its items ({e})")
            return
    for (index, info), crc in zip(good, crcs):
        want = _compat.dcp_storage_crc(info)
        if want is None:
            continue
        check.nbytes += info.length
        if want != crc:
            check.problems.append(f"{path}: item {_name(index)} at offset {info.offset} ({info.length} bytes): "
                                  f"CRC-32 {crc:08x}, recorded {want:08x}: damaged after it was written, or "
                                  f".metadata belongs to another checkpoint")


def verify_dcp(directory: str, handle: Any) -> Any:
    """``fastpersist.verify`` of a directory: a :class:`fastpersist.api.VerifyResult`."""
    return verify_source(DirectorySource(directory, handle))


def verify_source(source: DcpSource) -> Any:
    """``fastpersist.verify`` of the DCP checkpoint ``source`` reads: a
    :class:`fastpersist.api.VerifyResult` named ``source.name``."""
    c = check_source(source)
    if c.problems:
        status = "corrupt"
    elif c.checked:
        status = "ok"
    else:
        status = "unchecked"
    problems = list(c.problems)
    if status == "unchecked":
        problems = [f"{source.name}: DCP checkpoint without fastpersist checksums (written by DCP's FileSystemWriter): "
                    f"its structure is valid ({c.records} items), its bytes cannot be checked"]
    return VerifyResult(ok=status == "ok", path=source.name, format="dcp", records=c.records,
                        bytes=c.nbytes if status != "unchecked" else 0, problems=problems, status=status)
