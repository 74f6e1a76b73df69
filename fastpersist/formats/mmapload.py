"""Checked ``mmap=True`` loads: tensors backed by a private mapping of the file, whose
bytes were compared with the file's CRC-32s first.

``torch.load(path, mmap=True)`` maps the file and hands out tensors over the
mapping: no private copy, pages shared with the page cache, nothing read until
touched. Nothing is checked either: a flipped payload byte comes back as another
value. :func:`load_torch_mmap` keeps the mapping and adds the check.

One inode
    The path is opened once (``O_RDONLY | O_CLOEXEC``). The index is parsed and the
    records are checksummed through a read-only mapping of that descriptor, and
    torch then loads ``/proc/self/fd/<fd>``: the inode that was checked, even if a
    save renames a new file over the path meanwhile. The descriptor is closed after
    torch returns (its mapping holds its own reference to the file).

What is checked (torch zip files)
    The whole zip index (:func:`fastpersist.formats.zipindex.parse_zip_index`: end
    records, central directory, every local header against it, data inside the
    file, no overlaps), the archive folder and ``data.pkl``; every record that is
    not a storage (``data.pkl``, ``byteorder``, ``version`` ...) has its CRC-32
    compared before the pickle is looked at; every storage the pickle refers to
    (found by the dry run of :mod:`fastpersist.formats.picklescan`, which runs no
    code of the file) exists and holds exactly the bytes every reference claims
    (torch's mmap path slices the mapping by the pickle's sizes without checking
    them), and its CRC-32 matches the central directory's. ``torch.save`` records
    carry CRC-32s too, so its files are checked as well. Records the pickle does not
    name are not read (torch does not read them either).

What it costs
    The pages the index parse reads (local headers, data descriptors, the small
    records) are asked for at once (``MADV_WILLNEED``) after the central directory
    is read, so a cold file costs one round of reads, not one per record. The CRC
    pass touches every referenced payload page once (read from the disk if it is
    not cached; the pages then sit in the page cache, where torch's own mapping
    finds them), on the native handle's threads (``Handle.crc32_ranges``: records
    are cut into 4 MiB pieces the threads checksum side by side, faulting pages in
    parallel, GIL released). With ``checksum=False`` only the
    index and the pickle are read: the load stays as lazy as torch's.

What it cannot protect against
    A file modified *in place* (not renamed over) after the check: a mapping shows
    the file's current pages, and a file truncated under a mapping raises SIGBUS on
    access, as with ``torch.load(mmap=True)`` itself.

Anything outside what this reader supports (not a regular file, not a zip file,
compressed or encrypted records, TorchScript, meta/fake/skip-data loads,
``calculate_storage_offsets``) raises :class:`UnsupportedLayoutError`: the
caller hands the path to ``torch.load`` unchanged.

:func:`load_safetensors_mmap` does the same for ``.safetensors`` files onto the
CPU: one private mapping of the file (``torch.UntypedStorage.from_file``, as
``safetensors.torch.load_file`` does), a tensor per entry over its bytes, checked
against fastpersist's CRC-32s when the file carries them.
"""

from __future__ import annotations

import ctypes
import logging
import mmap as _mmap
import os
import stat
import struct
from typing import Any, Callable, Optional, Sequence

import torch

from fastpersist.errors import UnsupportedLayoutError, ZipFormatError
from fastpersist.formats import crcpolicy, torchload
from fastpersist.formats.picklescan import scan_pickle
from fastpersist.formats.safetensors import header as stheader
from fastpersist.formats.safetensors.crc import checksum_error, crc_problems, data_extents
from fastpersist.formats.safetensors.errors import SafetensorsFormatError
from fastpersist.formats.torchverify import crc_mismatch, element_size, storage_ref
from fastpersist.formats.zipindex import (
    CentralEntry,
    ZipEntry,
    check_deflated,
    parse_zip_index,
    pread_full,
    read_central_directory,
)
from fastpersist.io import libc_handle

log = logging.getLogger(__name__)

_PAGE = 4096
_FLAG_ENCRYPTED = 0x0001

__all__ = ["crc32_mapped", "load_torch_mmap", "load_safetensors_mmap"]


# --------------------------------------------------------------------------- CRC-32 over a mapping


def crc32_mapped(handle: Any, base: int, ranges: Sequence[tuple[int, int]]) -> list[int]:
    """CRC-32 of each ``(offset, length)`` range of the memory at address ``base``, on
    ``handle``'s threads (``Handle.crc32_ranges``: large ranges cut into pieces that the
    threads checksum, and fault in, side by side; GIL released)."""
    return handle.crc32_ranges([(base + off, n) for off, n in ranges])


class _Mapping:
    """A read-only shared mapping of a whole file (libc ``mmap``: its address is what
    the native CRC needs), unmapped by :meth:`close`."""

    def __init__(self, fd: int, size: int) -> None:
        self.libc = libc_handle()
        if self.libc is None:
            raise UnsupportedLayoutError("no libc to map the file with")
        self.size = size
        addr = self.libc.mmap(None, ctypes.c_size_t(size), _mmap.PROT_READ, _mmap.MAP_SHARED, fd, ctypes.c_long(0))
        if addr in (None, ctypes.c_void_p(-1).value):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
        self.addr: int = addr

    def read_at(self, offset: int, length: int) -> bytes:
        """``zipindex.ReadAt`` over the mapping (fewer bytes past the end of the file)."""
        length = max(0, min(length, self.size - offset))
        return ctypes.string_at(self.addr + offset, length) if length and offset >= 0 else b""

    def willneed(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Start reading the pages of ``(offset, length)`` ranges (``MADV_WILLNEED``:
        asynchronous readahead, many reads in flight) before they are touched."""
        for off, n in ranges:
            start = off - off % _PAGE
            end = min(off + n, self.size)
            if end > start:
                _madvise(self.libc, self.addr + start, end - start, _mmap.MADV_WILLNEED)

    def close(self) -> None:
        if self.addr:
            self.libc.munmap(ctypes.c_void_p(self.addr), ctypes.c_size_t(self.size))
            self.addr = 0


def _madvise(libc: Any, addr: int, length: int, advice: int) -> None:
    try:
        libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), ctypes.c_int(advice))
    except (AttributeError, OSError):  # advice only
        pass


# --------------------------------------------------------------------------- torch zip files


def _open_regular(path: str) -> tuple[int, int]:
    """``(fd, size)`` of ``path`` opened read-only; UnsupportedLayoutError when it is not a
    regular file or ``/proc/self/fd`` cannot name the descriptor."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsupportedLayoutError("not a regular file")
        if not os.path.exists(_fd_path(fd)):
            raise UnsupportedLayoutError("/proc/self/fd is not available")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _fd_path(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


def _shared_mapping() -> bool:
    """Whether torch's mmap load maps the file shared (``set_default_mmap_options(MAP_SHARED)``)."""
    get = getattr(torch.serialization, "get_default_mmap_options", None)
    shared = getattr(_mmap, "MAP_SHARED", None)
    return get is not None and shared is not None and get() == shared


def _check_supported(map_location: Any) -> None:
    if torchload.meta_or_fake(map_location):
        raise UnsupportedLayoutError("meta or fake-tensor load")
    if getattr(torch.serialization._serialization_tls, "skip_data", False):
        raise UnsupportedLayoutError("torch.serialization.skip_data is active")
    try:
        from torch.utils.serialization import config

        if getattr(config.load, "calculate_storage_offsets", False):
            # torch would then compute storage offsets itself instead of reading them
            # from the local headers that were checked
            raise UnsupportedLayoutError("torch.utils.serialization.config.load.calculate_storage_offsets is on")
    except ImportError:
        pass


def load_torch_mmap(
    path: str,
    map_location: Any,
    pickle_module: Any,
    *,
    weights_only: Optional[bool],
    handle: Any,
    checksum: bool = True,
    **pickle_load_args: Any,
) -> Any:
    """``torch.load(path, map_location, pickle_module, weights_only=..., mmap=True, ...)``
    with the file checked first (see the module docstring). The arguments go to torch
    as given, so its resolution of ``weights_only`` and its errors are unchanged.

    Raises:
        UnsupportedLayoutError: not something this reader checks; the caller hands the
            path to ``torch.load``.
        ZipFormatError: the file is inconsistent (names the path, the record, the offset).
        ChecksumError: a record's bytes do not match their CRC-32 (names the records and
            their byte ranges).
        OSError: the file cannot be opened or mapped.
    """
    _check_supported(map_location)
    fd, size = _open_regular(path)
    try:
        if pread_full(fd, 4, 0, path) != b"PK\x03\x04":  # a short read must not pass for "not a zip"
            raise UnsupportedLayoutError("not a zip file (legacy torch format?)")
        mapping = _Mapping(fd, size)
        try:
            _check_zip(path, mapping, handle, checksum=checksum)
        finally:
            mapping.close()
        if _shared_mapping():
            # torch maps the file writable and shared: the program may change it in place
            crcpolicy.release(fd, path)
        return torch.serialization.load(_fd_path(fd), map_location, pickle_module, weights_only=weights_only,
                                        mmap=True, **pickle_load_args)
    finally:
        os.close(fd)


def _check_zip(path: str, mapping: _Mapping, handle: Any, *, checksum: bool) -> None:
    """Everything torch's mmap load relies on, checked through ``mapping`` (see the module
    docstring); returns only when the file may be handed to torch."""
    try:
        _prefetch_headers(mapping, *read_central_directory(mapping.read_at, mapping.size, path))
        index = parse_zip_index(mapping.read_at, mapping.size, path)
    except ZipFormatError:
        raise
    except (ValueError, UnicodeDecodeError, struct.error) as e:  # defensive: the parser raises ZipFormatError
        raise torchload.bad(path, None, f"unreadable zip index ({e})") from e
    if not index.entries:
        raise torchload.bad(path, index.cd_offset, "the archive has no records")
    for e in index.entries:
        if e.is_directory:  # miniz would not extract it: torch then reads memory it never filled
            raise torchload.bad(path, e.header_offset, f"record {e.name!r} is marked as a directory (external "
                                 f"attributes {e.external_attr:#x}): torch's reader cannot read its bytes")
        if e.flags & _FLAG_ENCRYPTED:
            raise UnsupportedLayoutError(f"encrypted record {e.name!r}")
        if e.method != 0:  # to torch.load, once it is known to inflate to its recorded bytes
            check_deflated(mapping.read_at, path, index.entries)
            raise UnsupportedLayoutError(f"compressed record {e.name!r} (method {e.method})")
    prefix = torchload.record_prefix(path, index.entries)  # type: ignore[arg-type]  # needs .name and .cd_offset only
    by_short = {e.name[len(prefix):]: e for e in index.entries if e.name.startswith(prefix)}
    if "constants.pkl" in by_short:
        raise UnsupportedLayoutError("TorchScript archive")

    # The records that are not storages (the pickle first of all) before the pickle is read.
    def ours() -> bool:
        sid = index.find(crcpolicy.SERIALIZATION_ID)
        raw = mapping.read_at(sid.data_offset, sid.compressed_size) if sid is not None else None
        return crcpolicy.written_by_fastpersist(index.entries, raw)

    small = [e for short, e in by_short.items() if not short.startswith("data/")]
    pkl_entry = by_short["data.pkl"]
    pkl = mapping.read_at(pkl_entry.data_offset, pkl_entry.compressed_size)
    if checksum:
        _compare(path, small, crc32_mapped(handle, mapping.addr, [(e.data_offset, e.compressed_size) for e in small]),
                 ours, False)

    wanted = _referenced(path, pkl, by_short)
    if wanted is None:
        if not checksum:
            raise UnsupportedLayoutError("the pickle's storages cannot be worked out without running it")
        log.debug("%s: the pickle's storages are not known; checking every storage record", path)
        wanted = [e for short, e in by_short.items() if short.startswith("data/")]
    if not checksum:
        return
    records = sorted((e for e in wanted if e.compressed_size > 0), key=lambda e: e.data_offset)
    # No MADV_WILLNEED over the payloads: on a 1 GiB file the call spent 0.4-0.6 s
    # queueing reads before the first CRC and saved nothing overall (docs/experiments/
    # mmap_load.py); the threads' faults read ahead on their own. MADV_POPULATE_READ per
    # piece before its CRC was slower too (1 GiB cold, 6 interleaved rounds:
    # 0.83 s against 0.63 s without it).
    ranges = [(e.data_offset, e.compressed_size) for e in records]
    _compare(path, records, crc32_mapped(handle, mapping.addr, ranges), ours, True)


def _prefetch_headers(mapping: _Mapping, cd_off: int, entries: Sequence[CentralEntry]) -> None:
    """Ask for every page the index parse will read (local headers, the data descriptors
    before them, the small records) at once: on a cold file the parse then waits for
    one round of reads instead of one read per record (a 64-record file: 0.6 s -> 0.1 s)."""
    ranges = [(max(0, cd_off - 24), 24)]
    for e in entries:
        head = 30 + len(e.name.encode("utf-8"))
        if "/data/" in e.name or e.name.startswith("data/"):
            ranges.append((max(0, e.header_offset - 24), head + 24))
        else:  # data.pkl, byteorder ...: read right after the parse
            ranges.append((max(0, e.header_offset - 24), head + 24 + _PAGE + e.compressed_size))
    mapping.willneed(ranges)


def _referenced(path: str, pkl: bytes, by_short: dict[str, ZipEntry]) -> Optional[list[ZipEntry]]:
    """The storage records the pickle refers to, each present and exactly as large as
    every reference to it claims; None when the pickle cannot be worked out (then torch
    answers for it)."""
    scan = scan_pickle(pkl)
    if scan.error is not None:
        return None
    out: dict[str, ZipEntry] = {}
    for pid in scan.pids:
        try:
            key, cls, numel, _location = storage_ref(pid)
        except ValueError:
            return None
        size = element_size(*cls.split(" ", 1))
        if size is None:
            return None
        e = by_short.get(f"data/{key}")
        if e is None:
            raise torchload.bad(path, None, f"record 'data/{key}' is missing (the pickle refers to it)")
        if numel < 0 or numel * size != e.compressed_size:
            raise torchload.bad(path, e.data_offset, f"record {e.name!r} holds {e.compressed_size} bytes but the "
                                 f"pickle claims a storage of {numel * size} bytes")
        out[key] = e
    return list(out.values())


def _compare(path: str, records: Sequence[ZipEntry], crcs: Sequence[int], ours: Callable[[], bool],
             storages: bool) -> None:
    """CRC-32s against the recorded ones, by :mod:`fastpersist.formats.crcpolicy`'s rule
    (0 recorded: none; a mismatch raises only in a file fastpersist wrote: ``ours()``)."""
    problems = [crc_mismatch(e, c) for e, c in zip(records, crcs) if c != e.crc32 and not crcpolicy.no_crc(e.crc32)]
    if problems:
        crcpolicy.mismatch(path, problems, ours, storages)


# --------------------------------------------------------------------------- safetensors


def load_safetensors_mmap(path: str, handle: Any, *, checksum: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file as a CPU tensor over a private (copy-on-write)
    mapping of the file, like ``safetensors.torch.load_file``; with ``checksum`` and
    fastpersist CRC-32s in the file, every tensor's bytes (and the header) are checked
    over that mapping before anything is returned. Each tensor has a storage of its own
    over its bytes (all of them keep the one mapping alive). A tensor whose offset is
    misaligned for its dtype (possible in files of other writers) is copied.

    Raises:
        SafetensorsFormatError: the file is not valid safetensors (names the path).
        ChecksumError: a tensor's bytes do not match the CRC-32 recorded at save time.
        OSError: the file cannot be opened or mapped.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        header = stheader.read_header_fd(fd, path)
        if not os.path.exists(_fd_path(fd)):
            raise OSError(f"{path}: /proc/self/fd is not available to map the file")
        storage = torch.UntypedStorage.from_file(_fd_path(fd), False, header.file_size)
    finally:
        os.close(fd)  # the mapping keeps the file
    if checksum and header.crcs is not None:
        _extents, slots = data_extents(header, lambda off: 0)
        ranges = [(header.data_start + e.begin, e.nbytes) for e in slots]
        problems = crc_problems(header, slots, crc32_mapped(handle, storage.data_ptr(), ranges))
        if problems:
            raise checksum_error(path, problems)
    out: dict[str, torch.Tensor] = {}
    try:
        for e in header.tensors:
            dtype = e.torch_dtype
            start = header.data_start + e.begin
            if e.nbytes == 0:
                out[e.name] = torch.empty(e.torch_shape, dtype=dtype)
                continue
            raw = torch.empty(0, dtype=torch.uint8).set_(storage[start : start + e.nbytes])
            if start % dtype.itemsize:
                raw = raw.clone()  # misaligned for its dtype
            out[e.name] = raw.view(dtype).view(e.torch_shape)
    except (RuntimeError, TypeError, ValueError, OverflowError) as exc:
        raise SafetensorsFormatError(f"{path}: cannot make tensors of the header's dtypes and shapes ({exc})",
                                        path) from exc
    return out

