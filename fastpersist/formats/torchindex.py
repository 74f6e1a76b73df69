"""The tensor index of a checkpoint file, built without reading any tensor bytes,
and the native reads of chosen records (what :func:`fastpersist.open` and
:func:`fastpersist.load_state_dict` are built on).

Tensor names
    A torch file holds one pickled object. Every tensor in it reachable through
    dicts (any ``Mapping``: ``dict``, ``OrderedDict``), lists and tuples is named
    by its path: the keys and indices on the way, formatted with ``str()`` and
    joined with ``"."``. ``{"model": {"fc.weight": t}, "opt": [t2]}`` gives
    ``"model.fc.weight"`` and ``"opt.0"``; a bare tensor saved alone is ``""``.
    For a ``Module.state_dict()`` these are exactly its keys. Tensors inside other
    objects are not named. Two paths that format to the same name (``{"a.b": t,
    "a": {"b": u}}``) make that name *ambiguous*: it is listed once and asking for
    it raises :class:`AmbiguousNameError`. A ``.safetensors`` file's names are its
    tensor names.

How the torch index is built (no payload read)
    The records come from the zip central directory (``torchload.LoadState.index``, with
    its checks: local-header positions, records inside the data area, no overlap).
    ``data.pkl`` is read (CRC-checked) and unpickled by torch's own ``_load`` with
    the weights-only unpickler, as ``fastpersist.load(weights_only=True)`` does,
    through a reader whose ``get_storage_from_record`` checks that the record exists
    and holds exactly the bytes the pickle claims, and returns a *meta* storage of
    that size, remembering which record it stands for. The result is the file's
    object with meta tensors in it; each tensor's dtype, shape, strides and
    storage offset are checked to lie inside its record.

What a read checks
    Only the records asked for are read (one native parallel read through the
    file's descriptor): for torch files each record's local header is compared with
    the central directory, and with checksums on every record read has its CRC-32
    compared (the whole record is read for that, unwanted bytes discarded by the
    engine); safetensors files written by fastpersist carry per-tensor CRC-32s and a
    header CRC-32, which are checked the same way. Records not asked for are never
    read, so their corruption is not noticed (``fastpersist.verify`` checks every byte).
"""

from __future__ import annotations

import gc
import math
import os
import pickle
import stat
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch

from fastpersist import _compat, _native
from fastpersist.prefault import choose_pages
from fastpersist._sys import pread_full
from fastpersist.errors import CheckpointFormatError, ChecksumError, FastPersistError, UnsupportedLayoutError
from fastpersist.formats import safetensors as st
from fastpersist.formats import torchload
from fastpersist.formats.torchload import HeaderMismatch, Reader
from fastpersist.formats.torchload import bad as zbad
from fastpersist.readpolicy import borrow_reader, depth_auto, plan_read, staging_auto

__all__ = [
    "AmbiguousNameError",
    "CheckpointFile",
    "Piece",
    "TensorInfo",
    "open_checkpoint",
]


class AmbiguousNameError(FastPersistError, KeyError):
    """Two tensors of the file format to the same dotted name (see the module docstring)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor of a checkpoint lies, from the file's index alone.

    ``record`` is the record holding the tensor's storage (``"data/3"`` in a torch
    file, the tensor's own name in a safetensors file); ``record_offset`` and
    ``record_nbytes`` are where that record's bytes lie in the file. The tensor is
    ``shape``/``stride`` elements of ``dtype`` starting ``storage_offset`` elements
    into the record; several tensors may share a record (views, tied weights).
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    record: str
    record_offset: int
    record_nbytes: int
    requires_grad: bool = False
    parameter: bool = False  #: saved as an ``nn.Parameter``

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's elements (not of its record)."""
        return self.numel * self.dtype.itemsize

    @property
    def contiguous(self) -> bool:
        """Whether the elements lie densely in C order (then they are ``nbytes`` bytes
        from :attr:`file_offset`)."""
        expected = 1
        for size, stride in reversed(list(zip(self.shape, self.stride))):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    @property
    def byte_offset(self) -> int:
        """Offset of the tensor's first element inside its record."""
        return self.storage_offset * self.dtype.itemsize

    @property
    def file_offset(self) -> int:
        """File offset of the tensor's first element."""
        return self.record_offset + self.byte_offset


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, start + length)`` of a record go to host address ``ptr``."""

    start: int
    length: int
    ptr: int


@dataclass
class _Rec:
    """One readable record: data extent, expected CRC-32, local header (torch)."""

    name: str
    offset: int
    size: int
    crc: Optional[int]
    header_offset: Optional[int] = None  # torch: the local header's position
    native: Any = None  # torch: torchload._Record


def pack_arenas(records: Sequence[_Rec]) -> list[tuple[int, list[tuple[_Rec, int]]]]:
    """``records`` (in file order, each under ``torchload.OWN_BUFFER_MIN``) packed into
    arenas of at most ``torchload.ARENA_MAX`` bytes each (buffers below 4 MiB come from
    the heap, larger ones are mapped afresh; see there), in order: each arena's size and
    its records with their positions in it, each position congruent to the record's file
    offset modulo 64."""
    arenas: list[tuple[int, list[tuple[_Rec, int]]]] = []
    placed: list[tuple[_Rec, int]] = []
    size = 0
    for r in records:
        pos = size + (r.offset - size) % 64
        if placed and pos + r.size > torchload.ARENA_MAX:
            arenas.append((size, placed))
            size, placed, pos = 0, [], r.offset % 64
        placed.append((r, pos))
        size = pos + r.size
    if placed:
        arenas.append((size, placed))
    return arenas


def bad(path: str, offset: Optional[int], what: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"{path}: not a loadable checkpoint: {what}", path, offset)


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


_PAGE = 4096


# --------------------------------------------------------------------------- the file


class CheckpointFile:
    """One open checkpoint: its descriptor, its records, its tensor index.

    Built by :func:`open_checkpoint`; reads go through :meth:`read` (native, only the
    records asked for) or :meth:`read_records` (into fresh buffers).
    """

    def __init__(self, path: str, fd: int, size: int, fmt: str, checksum: bool) -> None:
        self.path = path
        self.fd = fd
        self.size = size
        self.format = fmt
        self.checksum = checksum
        self.records: dict[str, _Rec] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self.ambiguous: dict[str, list[tuple[Any, ...]]] = {}
        self.paths: dict[str, tuple[Any, ...]] = {}  #: name -> the keys leading to the tensor
        self.obj: Any = None  #: torch: the unpickled object, meta tensors in it
        self.meta_ids: dict[int, str] = {}  #: id(meta tensor in ``obj``) -> name
        self.metadata: Optional[dict[str, str]] = None  #: safetensors ``__metadata__``
        self.native_order = True
        self._load: Any = None  # torch: torchload.LoadState
        self._readers: dict[tuple[bool, bool], Any] = {}  # handles reading another way than the caller's
        self.last_arenas: list[tuple[int, int]] = []  #: address and size of each arena :meth:`read_records` last used

    # -- index lookups ---------------------------------------------------------

    def info(self, name: str) -> TensorInfo:
        if name in self.ambiguous:
            raise AmbiguousNameError(
                f"{self.path}: the name {name!r} stands for {len(self.ambiguous[name])} tensors "
                f"(paths {self.ambiguous[name]}); rename the keys so that no two format to the same dotted name"
            )
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r} in this checkpoint") from None

    # -- reading ---------------------------------------------------------------

    def read(self, wants: dict[str, list[Piece]], handle: Any, *, into_existing: bool = False) -> None:
        """See :meth:`_read`; when a local header shows that the record offsets predicted
        from the central directory are wrong (odd writers), the index is rebuilt from
        every local header and the read repeated (pieces are relative to records).
        ``into_existing``: the pieces point into memory that is already in use (a live
        model's tensors), which ``read_mode="auto"`` records apart from loads into new memory."""
        try:
            self._read(wants, handle, into_existing)
        except HeaderMismatch:
            self._reindex_exact()
            try:
                self._read(wants, handle, into_existing)
            except HeaderMismatch as e:
                raise bad(self.path, None, f"the local header of {e} disagrees with the central directory") from None

    def _reindex_exact(self) -> None:
        import dataclasses

        load = torchload.LoadState(self.path, self.fd, self.size, self.checksum, False)
        load.index(exact=True)
        self._load = load
        for r in load.records:
            if r.short in self.records:
                old = self.records[r.short]
                if old.size != r.size:
                    raise bad(self.path, r.data_offset, f"record {r.short!r} changed size on a second look")
                self.records[r.short] = _Rec(r.short, r.data_offset, r.size, r.entry.crc32, r.entry.header_offset, r)
        for name, info in list(self.tensors.items()):
            self.tensors[name] = dataclasses.replace(info, record_offset=self.records[info.record].offset)

    def _read(self, wants: dict[str, list[Piece]], handle: Any, into_existing: bool = False) -> None:
        """Read the given records, record ``name`` -> pieces (sorted, disjoint, inside
        the record), with one native read; check local headers and CRC-32s.

        Bytes of a record that no piece wants are read and discarded when its CRC-32
        is checked, not read otherwise.

        Raises:
            CheckpointFormatError: a local header disagrees, or the file ends early.
            ChecksumError: a record read does not match its CRC-32.
            OSError: an I/O error (path, offset, errno).
        """
        recs = sorted((self.records[n] for n in wants), key=lambda r: r.offset)
        headers = 0
        for r in recs:
            if r.header_offset is not None:
                headers += r.offset - r.header_offset
        head_buf = torch.empty(max(headers, 1), dtype=torch.uint8)
        head_ptr = head_buf.data_ptr()
        extents: list[tuple[int, int, int, int]] = []
        slots: list[_Rec] = []
        hpos: dict[str, int] = {}
        pos = 0
        for r in recs:
            if r.size == 0:
                continue
            if r.header_offset is not None and r.offset > r.header_offset:
                extents.append((r.header_offset, head_ptr + pos, r.offset - r.header_offset, -1))
                hpos[r.name] = pos
                pos += r.offset - r.header_offset
            check = self.checksum and r.crc is not None
            slot = len(slots) if check else -1
            if check:
                slots.append(r)
            cur = 0
            for p in wants[r.name]:
                if p.start < cur or p.start + p.length > r.size or p.length <= 0:
                    raise ValueError(f"bad read piece {p} for record {r.name!r} of {r.size} bytes")
                if p.start > cur and check:
                    extents.append((r.offset + cur, 0, p.start - cur, slot))
                extents.append((r.offset + p.start, p.ptr, p.length, slot))
                cur = p.start + p.length
            if cur < r.size and check:
                extents.append((r.offset + cur, 0, r.size - cur, slot))
        if not extents:
            return
        nbytes = sum(e[2] for e in extents)
        reader = self._reader(handle, nbytes, into_existing)
        try:
            crcs = reader.read(self.fd, extents, len(slots))
        except EOFError as e:
            raise bad(self.path, None, f"the file is shorter than its index says (truncated, or rewritten in "
                       f"place while reading): {e}") from e
        except OSError as e:
            if e.filename is None and e.errno is not None:
                raise type(e)(e.errno, f"{e.strerror or e} (reading {self.path!r})", self.path) from e
            raise
        if self._load is not None:
            view = memoryview(head_buf.numpy())
            for r in recs:
                if r.name in hpos:
                    p = hpos[r.name]
                    self._load.check_header(r.native, view[p : p + r.offset - r.header_offset])
        problems = [
            f"{r.name}: CRC-32 mismatch (computed {crc:08x}, recorded {r.crc:08x}) in bytes "
            f"[{r.offset}, {r.offset + r.size})"
            for r, crc in zip(slots, crcs)
            if crc != r.crc
        ]
        if problems:
            raise ChecksumError(
                f"{self.path}: {len(problems)} record(s) do not match their checksum (the file is corrupt; "
                "restore it from a good copy): " + "; ".join(problems[:5])
                + (f"; ... and {len(problems) - 5} more" if len(problems) > 5 else ""),
                path=self.path,
                records=[p.split(":", 1)[0] for p in problems],
            )

    def _reader(self, handle: Any, nbytes: int, into_existing: bool = False) -> Any:
        """The handle to read ``nbytes`` with: ``handle``, or one reading the way
        :func:`fastpersist.readpolicy.plan_read` chooses for this file (``Config.read_mode``:
        page cache or O_DIRECT, from the filesystem and the page cache), kept for this
        file's next reads."""
        mode = getattr(handle, "read_mode", None)
        if mode is None or not hasattr(handle, "stage_reads"):
            return handle
        plan = plan_read(self.fd, nbytes, read_mode=mode, direct=handle.direct, stage=handle.stage_reads,
                         stage_auto=staging_auto(handle), into_existing=into_existing,
                         depth_auto=depth_auto(handle))
        if plan.fits(handle):
            return handle
        key = (plan.direct, plan.stage, plan.depth)
        reader = self._readers.get(key)
        if reader is None:
            reader = self._readers[key] = borrow_reader(handle, plan)
        return reader

    def read_records(self, names: Iterable[str], handle: Any) -> dict[str, torch.Tensor]:
        """The bytes of the given records, each as a uint8 CPU tensor with a storage of
        its own: over a buffer of its own (records of ``torchload.OWN_BUFFER_MIN`` and
        more) or over one of the arenas the smaller ones share (:func:`pack_arenas`)."""
        recs = sorted({n: self.records[n] for n in names}.values(), key=lambda r: r.offset)
        out: dict[str, torch.Tensor] = {}
        wants: dict[str, list[Piece]] = {}
        small: list[_Rec] = []
        for r in recs:
            if r.size == 0:
                out[r.name] = torch.empty(0, dtype=torch.uint8)
            elif r.size >= torchload.OWN_BUFFER_MIN:
                lead = r.offset % _PAGE
                buf = choose_pages(_native.PinnedBuffer(_round_up(lead + r.size, _PAGE), _PAGE, False))
                out[r.name] = torch.frombuffer(buf, dtype=torch.uint8, count=r.size, offset=lead)
                wants[r.name] = [Piece(0, r.size, buf.ptr + lead)]
            else:
                small.append(r)
        arenas: list[tuple[int, int]] = []
        for size, placed in pack_arenas(small):
            arena = choose_pages(_native.PinnedBuffer(_round_up(size, _PAGE), _PAGE, False))
            arenas.append((arena.ptr, size))
            for r, pos in placed:
                # a storage of its own over the arena bytes (the arena lives while any does)
                out[r.name] = torch.frombuffer(arena, dtype=torch.uint8, count=r.size, offset=pos)
                wants[r.name] = [Piece(0, r.size, arena.ptr + pos)]
        self.last_arenas = arenas
        self.read(wants, handle)
        return out

    def tensor_from_record(self, info: TensorInfo, record: torch.Tensor) -> torch.Tensor:
        """The tensor ``info`` describes, over ``record``'s storage (no copy)."""
        if info.dtype.itemsize and record.data_ptr() % info.dtype.itemsize and record.numel():
            record = record.clone()  # misaligned for its dtype (safetensors from other writers)
        t = torch.empty(0, dtype=info.dtype).set_(record.untyped_storage(), info.storage_offset, info.shape,
                                                  info.stride)
        if info.parameter:
            t = torch.nn.Parameter(t, requires_grad=info.requires_grad)
        elif info.requires_grad:
            t.requires_grad_(True)
        return t

    # -- structure -------------------------------------------------------------

    def rebuild(self, obj: Any, replace: Callable[[torch.Tensor], Any]) -> Any:
        """A copy of ``obj`` (part of :attr:`obj`) with every meta tensor replaced by
        ``replace(tensor)``; dicts keep their type and ``_metadata``, lists and
        tuples are copied, other objects are kept as they are."""
        if isinstance(obj, torch.Tensor):
            return replace(obj)
        if isinstance(obj, Mapping):
            items = [(k, self.rebuild(v, replace)) for k, v in obj.items()]
            try:
                new = type(obj)(items)
            except TypeError:
                new = dict(items)
            meta = getattr(obj, "_metadata", None)
            if meta is not None:
                try:
                    new._metadata = meta  # type: ignore[attr-defined]
                except AttributeError:
                    pass
            return new
        if isinstance(obj, list):
            return [self.rebuild(v, replace) for v in obj]
        if isinstance(obj, tuple) and type(obj) is tuple:
            return tuple(self.rebuild(v, replace) for v in obj)
        return obj

    def tensors_under(self, key: Any) -> tuple[Any, dict[str, TensorInfo], list[str]]:
        """The sub-object at ``key`` (see :meth:`select`), its tensors by name relative
        to it, and the relative names that are ambiguous."""
        if self.format != "torch":
            if key is not None:
                raise ValueError(f"{self.path}: key= selects part of a torch checkpoint; safetensors files are flat")
            return None, dict(self.tensors), list(self.ambiguous)
        obj, prefix = self.select(key)
        found: dict[str, TensorInfo] = {}
        ambiguous: list[str] = []
        stack = [obj]
        while stack:
            o = stack.pop()
            if isinstance(o, torch.Tensor):
                name = self.meta_ids.get(id(o))
                if name is None:
                    continue
                rel = name[len(prefix):]
                if name in self.ambiguous:
                    if rel not in ambiguous:
                        ambiguous.append(rel)
                else:
                    found[rel] = self.tensors[name]
            elif isinstance(o, Mapping):
                stack.extend(reversed(list(o.values())))
            elif isinstance(o, (list, tuple)):
                stack.extend(reversed(list(o)))
        return obj, found, ambiguous

    def select(self, key: Any) -> tuple[Any, str]:
        """The sub-object at ``key`` and the name prefix of its tensors (``"k."``).

        ``key`` is a dict key of the top-level object (``"state_dict"``), a dotted
        path of keys (``"model.encoder"``), or a tuple of keys for keys that are not
        strings or contain dots.
        """
        if self.format != "torch":
            raise ValueError(f"{self.path}: key= selects part of a torch checkpoint; safetensors files are flat")
        if key is None or key == ():
            return self.obj, ""
        parts: Sequence[Any] = key if isinstance(key, tuple) else (key,)
        obj = self.obj
        names: list[str] = []
        for part in parts:
            obj, used = step(obj, part, self.path, key)
            names.extend(used)
        return obj, ".".join(names) + "."


def step(obj: Any, part: Any, path: str, key: Any) -> tuple[Any, list[str]]:
    if isinstance(obj, Mapping) and part in obj:
        return obj[part], [str(part)]
    if isinstance(part, str) and "." in part:
        names: list[str] = []
        for p in part.split("."):
            obj, used = step(obj, p, path, key)
            names.extend(used)
        return obj, names
    if isinstance(obj, (list, tuple)) and isinstance(part, (int, str)):
        try:
            return obj[int(part)], [str(part)]
        except (ValueError, IndexError):
            pass
    if isinstance(obj, Mapping) and isinstance(part, str):
        for k in obj:  # an int key written as a string
            if str(k) == part:
                return obj[k], [part]
    raise KeyError(f"{path}: key={key!r}: the checkpoint has no entry {part!r} "
                   f"(available: {_available(obj)})")


def _available(obj: Any) -> str:
    if isinstance(obj, Mapping):
        keys = list(obj)
        return ", ".join(repr(k) for k in keys[:20]) + (" ..." if len(keys) > 20 else "")
    if isinstance(obj, (list, tuple)):
        return f"indices 0..{len(obj) - 1}"
    return f"a {type(obj).__name__}, not a container"


# --------------------------------------------------------------------------- opening


#: Containers nested deeper than this are refused (a hostile pickle can nest without end).
MAX_DEPTH = 1000


def tensor_leaves(obj: Any, keys: tuple[Any, ...] = (), depth: int = 0) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    """Every tensor in ``obj`` with the keys leading to it: mapping keys and list/tuple
    indices, in iteration order (the walk behind :func:`tensor_name`'s names).

    Raises:
        RecursionError: containers nested deeper than :data:`MAX_DEPTH`.
    """
    if depth > MAX_DEPTH:
        raise RecursionError(f"nested deeper than {MAX_DEPTH} containers")
    if isinstance(obj, torch.Tensor):
        yield keys, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from tensor_leaves(v, keys + (k,), depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensor_leaves(v, keys + (i,), depth + 1)


def tensor_name(keys: Sequence[Any]) -> str:
    """A tensor's name: its keys joined with ``"."`` (``""`` for a bare tensor)."""
    return ".".join(str(k) for k in keys)


def open_checkpoint(path: str, *, checksum: bool = True) -> CheckpointFile:
    """Open ``path`` and build its tensor index (no tensor bytes read).

    The format is chosen by content: a zip file is a torch checkpoint, anything
    whose first 8 bytes are a plausible safetensors header length followed by
    ``{`` is a safetensors file.

    Raises:
        UnsupportedLayoutError: a torch file this index cannot describe (legacy
            non-zip format, compressed or encrypted records, TorchScript, tensors
            whose storages torch's unpickler does not ask our reader for); the caller
            goes through ``torch.load``.
        CheckpointFormatError: a malformed file (names the path and what is wrong).
        ChecksumError: the pickle or the safetensors header does not match its CRC-32.
        pickle.UnpicklingError: the pickle holds something ``weights_only`` refuses.
        OSError: the file cannot be opened or read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsupportedLayoutError(f"{path}: not a regular file")
        magic = pread_full(fd, 9, 0, path)
        if magic[:4] == b"PK\x03\x04":
            f = CheckpointFile(path, fd, st.st_size, "torch", checksum)
            _index_torch(f)
        elif len(magic) == 9 and magic[8:9] == b"{" or path.endswith(".safetensors"):
            f = CheckpointFile(path, fd, st.st_size, "safetensors", checksum)
            _index_safetensors(f)
        else:
            raise UnsupportedLayoutError(f"{path}: not a zip file (legacy torch format?) nor safetensors")
        return f
    except BaseException:
        os.close(fd)
        raise


def _index_safetensors(f: CheckpointFile) -> None:
    if f.size < 8:
        raise st.SafetensorsFormatError(f"{f.path}: not a valid safetensors file: {f.size} bytes, shorter than "
                                        "the 8-byte header length", f.path)
    (length,) = struct.unpack("<Q", pread_full(f.fd, 8, 0, f.path).ljust(8, b"\0"))
    if length > st.MAX_HEADER_SIZE or 8 + length > f.size:
        raise st.SafetensorsFormatError(f"{f.path}: not a valid safetensors file: header length {length} does not "
                                        f"fit the file ({f.size} bytes) or the 100 MB limit", f.path)
    raw = pread_full(f.fd, length, 8, f.path)
    if len(raw) != length:
        raise st.SafetensorsFormatError(f"{f.path}: the file shrank while its header was read", f.path)
    header = st.parse_header(f.path, raw, f.size)
    f.metadata = header.metadata
    crcs = header.crcs if f.checksum else None
    if crcs is not None:
        problems = st.crc_problems(header, [], [])  # header CRC, CRC list length, empty tensors
        if problems:
            raise ChecksumError(f"{f.path}: checksum mismatch, the file is corrupt: "
                                + "; ".join(m for _, m in problems), f.path, [n for n, _ in problems])
    for i, e in enumerate(header.tensors):
        crc = crcs[i] if crcs is not None else None
        f.records[e.name] = _Rec(e.name, header.data_start + e.begin, e.nbytes, crc)
        shape = e.torch_shape
        stride = tuple(math.prod(shape[j + 1:]) for j in range(len(shape)))
        f.tensors[e.name] = TensorInfo(e.name, e.torch_dtype, tuple(shape), stride, 0, e.name,
                                       header.data_start + e.begin, e.nbytes)
        f.paths[e.name] = (e.name,)


class _IndexReader:
    """torch's ``_load`` reader over our index: records as torchload reads them, storages
    as meta tensors of the claimed (checked) size, remembered by record."""

    def __init__(self, f: CheckpointFile, load: Any) -> None:
        self._inner = Reader(load)
        self._load = load
        self.storages: dict[int, tuple[str, torch.Tensor]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def has_record(self, name: str) -> bool:
        return self._inner.has_record(name)

    def get_record(self, name: str) -> bytes:
        return self._inner.get_record(name)

    def get_storage_from_record(self, name: str, nbytes: int, _storage_type: Any) -> torch.Tensor:
        r = self._load.record(name)
        if nbytes != r.size:
            raise zbad(self._load.path, r.data_offset, f"record {r.entry.name!r} holds {r.size} bytes but the "
                       f"pickle claims a storage of {nbytes} bytes")
        t = torch.empty(nbytes, dtype=torch.uint8, device="meta")
        self.storages[t.untyped_storage()._cdata] = (name, t)
        return t


def _index_torch(f: CheckpointFile) -> None:
    """Records from the central directory with predicted data offsets; if a local header
    shows the prediction wrong (odd writers), again from every local header."""
    try:
        _index_torch_once(f, exact=False)
    except torchload.HeaderMismatch:
        f.records.clear()
        f.tensors.clear()
        f.ambiguous.clear()
        f.paths.clear()
        f.meta_ids.clear()
        try:
            _index_torch_once(f, exact=True)
        except torchload.HeaderMismatch as e:
            raise bad(f.path, None, f"the local header of {e} disagrees with the central directory") from None


def _index_torch_once(f: CheckpointFile, exact: bool) -> None:
    private_load = _compat.private_load()  # UnsupportedLayoutError when torch's _load changed
    if not _compat.ok("weights_only_unpickler"):
        raise UnsupportedLayoutError("torch's weights-only unpickler is not usable here")
    load = torchload.LoadState(f.path, f.fd, f.size, f.checksum, False)
    load.index(exact)
    load.read_small(load.record("data.pkl"))
    f._load = load
    order = load.by_short.get("byteorder")
    f.native_order = order is None or load.read_small(order) == sys.byteorder.encode()
    if not f.native_order:
        raise UnsupportedLayoutError("records in the other byte order")
    load.check_unread_headers(storages=False)  # the index must agree with itself (storages: when read)
    reader = _IndexReader(f, load)
    # The unpickler allocates several tracked objects per tensor; cyclic collections in
    # the middle would walk them again and again (as in torchload).
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        obj = private_load(reader, "cpu", _compat.weights_only_unpickler(), weights_only=True, encoding="utf-8")
    except (CheckpointFormatError, ChecksumError, UnsupportedLayoutError, OSError):
        raise
    except torchload.HeaderMismatch:
        raise
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(
            f"{f.path}: the pickle holds something weights_only loading refuses ({e}); fastpersist.open and "
            "fastpersist.load_state_dict read only what torch.load(weights_only=True) accepts (allow more with "
            "torch.serialization.add_safe_globals)"
        ) from e
    except Exception as e:  # noqa: BLE001 - a rebuild that needs the bytes (quantized, sparse ...) or a bad pickle
        raise UnsupportedLayoutError(
            f"{f.path}: its object cannot be rebuilt without reading tensor bytes ({type(e).__name__}: {e})"
        ) from e
    finally:
        if gc_was_on:
            gc.enable()
    # A tensor of the pickle that reaches beyond its record grows the meta storage it was
    # set on, where torch.load raises "Trying to resize storage that is not resizable"
    # for the whole file, also when the tensor is not in the result (a dict key set
    # twice: the later value wins, the earlier tensor was still built). The index would
    # otherwise describe the surviving tensors of a file torch refuses.
    for record, t in reader.storages.values():
        grown = t.untyped_storage().nbytes()
        if grown != t.numel():
            r = load.record(record)
            raise bad(f.path, r.data_offset, f"a tensor of the pickle reaches beyond its record {r.entry.name!r} of "
                       f"{t.numel()} bytes (to byte {grown}); torch.load refuses the file")
    f.obj = obj
    for r in load.records:
        if r.short.startswith("data/"):
            f.records[r.short] = _Rec(r.short, r.data_offset, r.size, r.entry.crc32, r.entry.header_offset, r)
    seen: dict[str, tuple[Any, ...]] = {}

    def add(t: torch.Tensor, keys: tuple[Any, ...]) -> None:
        name = tensor_name(keys)
        if t.layout != torch.strided or t.is_quantized or type(t) not in (torch.Tensor, torch.nn.Parameter) \
                or t.is_nested:
            raise UnsupportedLayoutError(f"tensor {name!r} is a {type(t).__name__} of layout {t.layout}")
        if t.device.type != "meta":
            raise UnsupportedLayoutError(f"tensor {name!r} was not built over a storage of the file")
        hit = reader.storages.get(t.untyped_storage()._cdata)
        if hit is None:
            raise UnsupportedLayoutError(f"tensor {name!r} does not lie in a storage record")
        record = hit[0]
        rec = f.records[record]
        f.meta_ids[id(t)] = name
        info = TensorInfo(name, t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(), record, rec.offset,
                          rec.size, t.requires_grad, isinstance(t, torch.nn.Parameter))
        _check_bounds(f.path, info)
        if name in seen or name in f.ambiguous:
            f.ambiguous.setdefault(name, [seen.pop(name)] if name in seen else []).append(keys)
            f.tensors.pop(name, None)
            return
        seen[name] = keys
        f.tensors[name] = info
        f.paths[name] = keys

    try:
        for keys, t in tensor_leaves(obj):
            add(t, keys)
    except RecursionError as e:
        raise bad(f.path, None, "the object is nested too deeply") from e


def _check_bounds(path: str, info: TensorInfo) -> None:
    size = info.dtype.itemsize
    if info.storage_offset < 0 or any(s < 0 for s in info.stride):
        raise bad(path, info.record_offset, f"tensor {info.name!r} has a negative offset or stride")
    if info.numel == 0:
        return
    last = info.storage_offset + sum((n - 1) * s for n, s in zip(info.shape, info.stride))
    if (last + 1) * size > info.record_nbytes:
        raise bad(path, info.record_offset, f"tensor {info.name!r} ({info.dtype}, shape {list(info.shape)}, "
                   f"offset {info.storage_offset}) reaches beyond its record {info.record!r} of "
                   f"{info.record_nbytes} bytes")


# helpers used by the readers on top

def close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
