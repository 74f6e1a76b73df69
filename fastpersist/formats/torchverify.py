"""Verify a ``torch.save`` zip checkpoint without loading it.

:func:`check_torch` answers two questions about a file:

* **Is it a loadable torch checkpoint?** The zip index is parsed strictly
  (:mod:`fastpersist.formats.zipindex`: encryption, other disks, entry counts,
  names, local headers, extents, overlaps), then the records torch's reader
  needs are looked up the way it looks them up: every entry under one archive
  folder, ``data.pkl``, a ``version`` it accepts, a sane ``byteorder``, and every
  storage that ``data.pkl`` references present as ``data/<key>`` with exactly
  the bytes the pickle claims, and every tensor view it builds inside its storage
  (found by one dry run of the pickle with inert stand-ins for every global,
  :func:`references_and_views`: nothing imported or executed).
* **Are its bytes the ones written?** Every record's CRC-32 is computed (stored
  records natively, read-and-discard extents with CRC slots; deflated records
  inflated with :mod:`zlib`) and compared with the central directory; data
  descriptors and local headers must repeat it.

A file with no CRCs at all (the legacy, pre-zip ``torch.save`` format) is
reported as *unchecked* (:attr:`TorchCheck.checked` false), not as intact.

**Storage locations.** Every storage carries the location tag it was saved from
(``'cpu'``, ``'cuda:3'``, ...), which ``torch.load`` without ``map_location``
restores it to. A tag this machine cannot restore (``'cuda:7'`` with fewer
GPUs, ``'cuda:0'`` without CUDA, ``'mps'`` off a Mac, a tag no registered
backend knows such as ``'foo'``, a tag that is not a string) is a **note**, not
a problem: the bytes are intact and ``torch.load(path, map_location=...)`` loads
them, but a plain ``torch.load(path)`` on this machine raises. Notes are in
:attr:`TorchCheck.notes` and are issued as :class:`StorageLocationWarning`; they
do not change the verdict (a file whose bytes check out is still ``"ok"``) and
are dropped when the file has problems (a damaged pickle's tags mean nothing).
The check asks each deserializer torch has registered
(``torch.serialization._package_registry``, third-party backends included)
about the tag with a stand-in storage, so the verdict is torch's own
(``_validate_device``'s availability and device-count checks) and nothing is
allocated, moved, or initialised on a device.
"""

from __future__ import annotations

import functools
import io
import os
import re
import stat
import sys
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any, Optional

from fastpersist._inputs import special_file_error
from fastpersist.errors import ZipFormatError
from fastpersist.formats.picklescan import ONE, DryUnpickler, StandIn, global_ref
from fastpersist.formats.zipindex import ZipEntry, ZipIndex, buffer_reader, fd_reader, parse_zip_index

#: The first bytes of a legacy (``_use_new_zipfile_serialization=False``) torch file:
#: protocol 2 and the magic number ``0x1950a86a20f9469cfc6c`` as a LONG1.
_LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19."
_LOCAL_SIG = b"PK\x03\x04"
#: What ``std::stoull`` (torch's version parser) accepts: optional space and sign, digits.
_VERSION_RE = re.compile(rb"\A[ \t\n\v\f\r]*([+-]?)([0-9]+)")
#: Largest record read into memory to parse it (data.pkl, version, byteorder).
_MAX_SMALL_RECORD = 1 << 30


class StorageLocationWarning(UserWarning):
    """A storage's location tag cannot be restored on this machine without
    ``map_location`` (the file itself is intact)."""


@dataclass
class TorchCheck:
    """What ``check_torch`` looked at.

    ``checked`` is false when the file carries no checksums to compare (a legacy
    torch file): then ``problems`` says so and nothing was verified. ``notes``
    are findings that do not make the file corrupt (storage locations this
    machine cannot restore without ``map_location``).
    """

    problems: list[str]
    records: int = 0
    nbytes: int = 0
    checked: bool = True
    notes: list[str] = field(default_factory=list)


class _ProbeStorage:
    """Stands in for a storage when asking torch's deserializers about a location:
    every method returns the probe itself, so nothing is allocated or moved."""

    def nbytes(self) -> int:
        return 0

    def size(self) -> int:
        return 0

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: self


@functools.lru_cache(maxsize=256)
def _location_trouble(location: str) -> Optional[str]:
    """Why ``torch.load`` without ``map_location`` cannot restore a storage tagged
    ``location`` on this machine (torch's words where it has them), or None."""
    import torch
    from torch import serialization as ts

    for _prio, _tagger, fn in getattr(ts, "_package_registry", []):
        try:
            result = fn(_ProbeStorage(), location)
        except Exception as e:  # noqa: BLE001 - a deserializer's refusal is the answer
            return f"{type(e).__name__}: {str(e).split('. ')[0]}"
        if result is not None:
            if location.startswith("mps") and not torch.backends.mps.is_available():
                return "MPS is not available on this machine"
            return None
    return "no deserializer torch has registered accepts this location"


def location_note(location: Any) -> Optional[str]:
    """A note for a storage ``location`` tag this machine cannot restore, or None."""
    if not isinstance(location, str):
        return f"location tag {location!r} is not a device string"
    why = _location_trouble(location)
    return None if why is None else f"location tag {location!r}: {why}"


def _native_read(handle: Any, path: str, extents: list[tuple[int, int, int, int]], nslots: int) -> list[int]:
    """``handle.read`` whose ``OSError`` always names ``path``."""
    try:
        return handle.read(path, extents, nslots)
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise type(e)(e.errno, e.strerror or str(e), path) from e


def _stored_extents(index: ZipIndex) -> tuple[list[tuple[int, int, int, int]], list[ZipEntry]]:
    """Read-and-discard extents, one CRC slot per non-empty stored record."""
    records = sorted(
        (e for e in index.entries if e.compressed_size > 0 and e.method == 0), key=lambda e: e.data_offset
    )
    return [(e.data_offset, 0, e.compressed_size, slot) for slot, e in enumerate(records)], records


def crc_mismatch(e: ZipEntry, crc: int) -> str:
    return (
        f"{e.name}: CRC-32 mismatch (computed {crc:08x}, recorded {e.crc32:08x}) "
        f"in bytes [{e.data_offset}, {e.data_end})"
    )


def _inflate(read_at: Any, e: ZipEntry, sink: Any) -> None:
    """Inflate a deflated record in steps, passing each piece of output to ``sink``.

    Raises:
        ZipFormatError: the data is not valid deflate data of exactly
            ``uncompressed_size`` bytes.
    """
    step = 1 << 20
    d = zlib.decompressobj(-15)
    produced = 0
    pos = e.data_offset
    end = e.data_end

    def feed(chunk: bytes) -> None:
        nonlocal produced
        while chunk:
            try:
                out = d.decompress(chunk, step)
            except zlib.error as exc:
                raise ZipFormatError(f"{e.name}: deflate data is corrupt ({exc})", offset=e.data_offset) from None
            produced += len(out)
            if produced > e.uncompressed_size:
                break
            sink(out)
            chunk = d.unconsumed_tail

    while pos < end and not d.eof and produced <= e.uncompressed_size:
        chunk = read_at(pos, min(step, end - pos))
        if not chunk:
            break
        pos += len(chunk)
        feed(chunk)
    if produced != e.uncompressed_size or not d.eof:
        raise ZipFormatError(
            f"{e.name}: deflate data holds {produced}{'' if d.eof else '+'} bytes, the central directory says "
            f"{e.uncompressed_size}",
            offset=e.data_offset,
        )


def _inflated_crc(read_at: Any, e: ZipEntry) -> int:
    crc = 0

    def sink(b: bytes) -> None:
        nonlocal crc
        crc = zlib.crc32(b, crc)

    _inflate(read_at, e, sink)
    return crc


def _record_bytes(read_at: Any, e: ZipEntry) -> bytes:
    if e.uncompressed_size > _MAX_SMALL_RECORD:
        raise ZipFormatError(f"{e.name}: {e.uncompressed_size} bytes, too large to parse", offset=e.data_offset)
    if e.method == 8:
        parts: list[bytes] = []
        _inflate(read_at, e, parts.append)
        return b"".join(parts)
    return read_at(e.data_offset, e.compressed_size)


@functools.lru_cache(maxsize=None)
def max_file_format_version() -> int:
    """The newest archive ``version`` this torch's reader accepts (probed once)."""
    import zipfile

    import torch

    best = 10  # torch 2.x
    for v in range(best + 1, 64):
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            z.writestr("a/version", f"{v}\n")
        try:
            torch._C.PyTorchFileReader(io.BytesIO(buf.getvalue()))
        except Exception:  # noqa: BLE001 - torch's refusal is RuntimeError; anything else ends the probe too
            break
        best = v
    return best


def element_size(module: str, name: str) -> Optional[int]:
    """Bytes per element of the storage class ``module.name`` (``torch.FloatStorage``...),
    looked up in an already imported torch module (nothing is imported or called); None if unknown."""
    import torch

    if not (module == "torch" or module.startswith("torch.")) or not name.endswith("Storage") or not name.isidentifier():
        return None
    mod = sys.modules.get(module)  # only modules torch has already imported: nothing new is imported
    cls = getattr(mod, name, None) if mod is not None else None
    if cls is None:
        return None
    if cls is torch.UntypedStorage:
        return 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated
        dtype = getattr(cls, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        return None
    return torch._utils._element_size(dtype)


View = tuple[str, int, tuple[int, ...], tuple[int, ...]]


def storage_references(pickle_bytes: bytes) -> list[tuple[str, str, int, Any]]:
    """``(key, storage class "module name", numel, location)`` of every persistent id
    a torch pickle references, from the dry run of :mod:`fastpersist.formats.picklescan`
    (nothing is imported or executed).

    Raises:
        ValueError: the pickle cannot be run, or a persistent id is not a
            ``('storage', <class>, key, location, numel)`` tuple torch can load.
    """
    return references_and_views(pickle_bytes)[0]


class _StorageMark(StandIn):
    """What a persistent id resolves to in the dry run: an inert stand-in that knows its key."""

    def __new__(cls, pid: Any) -> "_StorageMark":
        mark = object.__new__(cls)
        mark.key = pid[2] if isinstance(pid, tuple) and len(pid) == 5 and isinstance(pid[2], str) else None
        return mark


def references_and_views(pickle_bytes: bytes) -> tuple[list[tuple[str, str, int, Any]], list[View]]:
    """One dry run of a torch pickle (nothing imported or executed): its storage references
    (as :func:`storage_references`) and ``(storage key, storage_offset, size, stride)`` of every
    ``torch._utils._rebuild_tensor_v2`` call whose arguments are plain non-negative ints
    (calls with other arguments are left out: torch decides those).

    Raises:
        ValueError: as :func:`storage_references`.
    """
    views: list[View] = []

    def plain(xs: Any) -> bool:
        return isinstance(xs, tuple) and all(type(x) is int and x >= 0 for x in xs)

    class _Rebuild(StandIn):
        def __new__(cls, *args: Any, **_kwargs: Any) -> Any:
            if (len(args) >= 4 and isinstance(args[0], _StorageMark) and args[0].key is not None
                    and type(args[1]) is int and args[1] >= 0 and plain(args[2]) and plain(args[3])
                    and len(args[2]) == len(args[3])):
                views.append((args[0].key, args[1], args[2], args[3]))
            return ONE

    class _Views(DryUnpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (str(module), str(name)) == ("torch._utils", "_rebuild_tensor_v2"):
                return _Rebuild
            return super().find_class(module, name)

        def persistent_load(self, pid: Any) -> Any:
            super().persistent_load(pid)
            return _StorageMark(pid)

    dry = _Views(pickle_bytes)
    try:
        dry.load()
    except Exception as e:  # noqa: BLE001 - any failure means "not understood"
        raise ValueError(f"{type(e).__name__}: {e}") from e
    return [storage_ref(pid) for pid in dry.pids], views


def _view_nbytes(offset: int, size: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    """Bytes of storage a view needs, as torch computes it when it sets the storage
    (``at::detail::computeStorageNbytes``): 0 if any dimension is empty."""
    last = 0
    for n, st in zip(size, stride):
        if n == 0:
            return 0
        last += st * (n - 1)
    return (offset + last + 1) * itemsize


def storage_ref(pid: Any) -> tuple[str, str, int, Any]:
    cls = global_ref(pid[1]) if isinstance(pid, tuple) and len(pid) == 5 else None
    if (
        cls is not None
        and pid[0] == "storage"
        and isinstance(pid[2], str)
        and isinstance(pid[4], int)
        and not isinstance(pid[4], bool)
    ):
        return pid[2], f"{cls[0]} {cls[1]}", pid[4], pid[3]
    shown = tuple("?" if isinstance(x, StandIn) or global_ref(x) else x for x in pid) if isinstance(pid, tuple) else pid
    raise ValueError(f"a persistent id is not a ('storage', type, key, location, numel) tuple: {shown!r}")


def _structure_problems(path: str, index: ZipIndex, read_at: Any, notes: Optional[list[str]] = None) -> list[str]:
    """Whether torch's reader would find every record it needs (see the module docstring);
    storage locations this machine cannot restore are appended to ``notes``."""
    entries = index.entries
    if not entries:
        return [f"{path}: the archive has no records (an empty zip is not a torch checkpoint)"]
    first = entries[0].name
    if "/" not in first:
        return [f"{path}: record {first!r} is not in an archive folder (torch needs <folder>/data.pkl, ...)"]
    prefix = first.split("/", 1)[0] + "/"
    problems = [
        f"{path}: record {e.name!r} is outside the archive folder {prefix!r} (torch refuses such archives)"
        for e in entries
        if not e.name.startswith(prefix)
    ]
    by_short = {e.name[len(prefix) :]: e for e in entries if e.name.startswith(prefix)}
    # torch files have no directory entries; torch's reader refuses to extract any
    # record marked as one (it reads .storage_alignment, .data/serialization_id, ...)
    problems += [f"{e.name}: marked as a directory (torch cannot read it)" for e in entries if e.is_directory]

    def record(short: str, required: bool) -> Optional[bytes]:
        e = by_short.get(short)
        if e is None:
            if required:
                problems.append(f"{path}: record {prefix}{short} is missing (torch needs it)")
            return None
        if e.is_directory:
            return None
        try:
            return _record_bytes(read_at, e)
        except ZipFormatError as exc:
            problems.append(str(exc))
            return None

    vshort = ".data/version" if ".data/version" in by_short else "version"
    version = record(vshort, True)
    if version is not None:
        m = _VERSION_RE.match(version)
        top = max_file_format_version()
        if m is None:
            problems.append(f"{prefix}{vshort}: holds {version[:20]!r}, not a version number")
        else:
            v = int(m.group(2)) * (-1 if m.group(1) == b"-" else 1)
            if not 1 <= v <= top:
                problems.append(f"{prefix}{vshort}: format version {v} is not one torch reads (1 to {top})")
    order = record("byteorder", False)
    if order is not None and order not in (b"little", b"big"):
        problems.append(f"{prefix}byteorder: holds {order[:20]!r}, not 'little' or 'big'")
    pickles = ["data.pkl"] + (["constants.pkl"] if "constants.pkl" in by_short else [])
    seen: dict[str, int] = {}
    itemsize: dict[str, int] = {}
    for pkl_name in pickles:
        pkl = record(pkl_name, True)
        if pkl is None:
            continue
        try:
            refs, views = references_and_views(pkl)
        except ValueError as exc:
            problems.append(f"{prefix}{pkl_name}: cannot be parsed as a pickle ({exc})")
            continue
        unrestorable: dict[str, list[str]] = {}
        for key, _cls, _numel, loc in refs:
            note = location_note(loc)
            if note is not None:
                unrestorable.setdefault(note, []).append(key)
        for note, keys in unrestorable.items():
            if notes is not None:
                notes.append(f"{path}: {len(keys)} storage(s) of {prefix}{pkl_name} ({', '.join(keys[:5])}"
                             f"{', ...' if len(keys) > 5 else ''}) have {note}; the bytes are intact, but torch.load "
                             f"without map_location cannot restore them on this machine: pass map_location (for "
                             f"example map_location='cpu')")
        for key, cls, numel, _loc in refs:
            size = element_size(*cls.split(" ", 1)) if " " in cls else None
            if size is None:
                problems.append(f"{prefix}{pkl_name}: references storage {key!r} of unknown type {cls!r}")
                continue
            if numel < 0:
                problems.append(f"{prefix}{pkl_name}: claims {numel} elements for storage {key!r}")
                continue
            nbytes = numel * size
            if key in seen:  # torch loads a key once, with the size of its first reference
                continue
            seen[key] = nbytes
            itemsize[key] = size
            e = by_short.get(f"data/{key}")
            if e is None:
                problems.append(f"{path}: record {prefix}data/{key} is missing (storage {key!r} of {prefix}{pkl_name})")
            elif e.is_directory:
                pass  # reported above
            elif e.uncompressed_size != nbytes:
                problems.append(
                    f"{e.name}: holds {e.uncompressed_size} bytes but {prefix}{pkl_name} claims "
                    f"{nbytes} ({numel} x {size}-byte elements of {cls.split(' ')[-1]})"
                )
        # every tensor view must fit its storage (torch refuses to build one that does not)
        for key, offset, vsize, vstride in views:
            if key not in seen:
                continue
            need = _view_nbytes(offset, vsize, vstride, itemsize[key])
            if need > seen[key]:
                problems.append(
                    f"{prefix}{pkl_name}: a tensor of size {list(vsize)}, stride {list(vstride)} at offset {offset} "
                    f"needs {need} bytes of storage {key!r}, which has {seen[key]}")
    return problems


def verify_torch(path: str, handle: Any) -> list[str]:
    """Problems found in the torch zip file at ``path`` (empty list: every record checks out)."""
    return check_torch(path, handle).problems


def check_torch(path: str, handle: Any) -> TorchCheck:
    """Check that ``path`` is a loadable torch zip checkpoint whose records match their CRCs.

    Never raises for bad content (every problem is in ``problems``); ``OSError`` for I/O.
    """
    # O_NONBLOCK: a FIFO put at the path after verify's stat must not block the open
    # (it has no effect on the reads of a regular file).
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise special_file_error(path, st.st_mode, "verify")
        size = st.st_size
        read_at = fd_reader(fd, path)
        head = read_at(0, len(_LEGACY_MAGIC))
        if size == 0:
            return TorchCheck([f"{path}: the file is empty"])
        if head[:4] != _LOCAL_SIG:
            if head == _LEGACY_MAGIC:
                return TorchCheck(
                    [f"{path}: not a zip archive (legacy torch.save format); it has no checksums to verify"],
                    checked=False,
                )
            return TorchCheck([f"{path}: not a torch checkpoint (it does not start with a zip local header)"])
        try:
            index = parse_zip_index(read_at, size, path)
        except ZipFormatError as e:
            return TorchCheck([str(e)])
        notes: list[str] = []
        problems = _structure_problems(path, index, read_at, notes)
        for e in index.entries:
            stored = []
            for off in e.crc_field_offsets[1:]:
                raw = read_at(off, 4)
                stored.append(int.from_bytes(raw, "little") if len(raw) == 4 else -1)
            if e.descriptor_offset is not None and stored and stored[0] != e.crc32:
                problems.append(
                    f"{e.name}: data descriptor CRC {stored[0]:08x} differs from central directory {e.crc32:08x}"
                )
            if e.descriptor_offset is None and stored and stored[0] != e.crc32:
                problems.append(
                    f"{e.name}: local header CRC {stored[0]:08x} differs from central directory {e.crc32:08x}"
                )
            if e.uncompressed_size == 0 and e.crc32 != 0:
                problems.append(f"{e.name}: empty record with non-zero CRC {e.crc32:08x}")
            if e.method == 8:  # deflated (valid for torch.load): CRC over the inflated bytes
                try:
                    crc = _inflated_crc(read_at, e)
                except ZipFormatError as exc:
                    problems.append(str(exc))
                else:
                    if crc != e.crc32:
                        problems.append(crc_mismatch(e, crc))
    finally:
        os.close(fd)
    extents, records = _stored_extents(index)
    crcs = _native_read(handle, path, extents, len(records)) if extents else []
    # A recorded CRC of 0 is torch's "none computed" (set_crc32_options(False), skip_data()):
    # such records cannot be checked (fastpersist.formats.crcpolicy, rule 1).
    no_crc = [e.name for e, crc in zip(records, crcs) if e.crc32 == 0 and crc != 0]
    problems += [crc_mismatch(e, crc) for e, crc in zip(records, crcs) if crc != e.crc32 and e.crc32 != 0]
    if problems:
        notes = []  # a damaged file's tags are not worth a note: the file is corrupt
    for note in notes:
        warnings.warn(note, StorageLocationWarning, stacklevel=3)
    if no_crc and not problems:
        return TorchCheck(
            [f"{path}: {len(no_crc)} of {len(records)} records carry no CRC-32 (0 recorded, as torch writes "
             f"with set_crc32_options(False) or under skip_data(): {', '.join(no_crc[:3])}"
             f"{', ...' if len(no_crc) > 3 else ''}); their bytes cannot be checked"],
            records=len(index.entries), nbytes=sum(e.compressed_size for e in index.entries), checked=False)
    return TorchCheck(problems, records=len(index.entries), nbytes=sum(e.compressed_size for e in index.entries),
                      notes=notes)


def read_index_from_bytes(data: bytes, path: str = "<buffer>") -> ZipIndex:
    """Parse a zip index from bytes in memory (tests, tools)."""
    return parse_zip_index(buffer_reader(data), len(data), path)
