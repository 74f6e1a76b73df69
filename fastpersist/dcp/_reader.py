"""``FastPersistReader``: DCP's ``FileSystemReader`` with fastpersist reading the bytes."""

from __future__ import annotations

import ctypes
import errno
import io
import logging
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Union

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from fastpersist import _compat, _native
from fastpersist.prefault import choose_pages
from fastpersist.config import get_default
from fastpersist.dcp._s3 import S3Checkpoint, reset_target
from fastpersist.errors import CheckpointFormatError, ChecksumError, FastPersistError
from fastpersist.formats.dcpmetadata import (ADVICE, inside, item_name, load_metadata, load_metadata_bytes,
                                             table_problems)
from fastpersist.formats.zipindex import buffer_reader, parse_zip_index
from fastpersist.s3url import is_s3_url

log = logging.getLogger("fastpersist.dcp")

PathLike = Union[str, "os.PathLike[str]"]
#: Bytes read per native call (items larger than this are read alone).
_BATCH_BYTES = 64 << 20
_ALIGN = 4096


def _align_up(x: int, a: int = _ALIGN) -> int:
    return (x + a - 1) // a * a


def _bare_tensor(raw: memoryview) -> bool:
    """Whether ``raw`` is a torch.save'd bare tensor (read with ``skip_data``: no payload copied)."""
    if bytes(raw[:4]) != b"PK\x03\x04":
        return False
    try:
        with torch.serialization.skip_data():
            return isinstance(torch.load(io.BytesIO(bytes(raw)), map_location="cpu", weights_only=True), torch.Tensor)
    except Exception:  # noqa: BLE001 - not loadable weights-only: not a bare tensor; load_bytes decides
        return False


def narrow(t: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (off, n) in enumerate(zip(offsets, lengths)):
        if off != 0 or n != t.size(dim):
            t = t.narrow(dim, off, n)
    return t


class _MemoryFile(io.RawIOBase):
    """A read-only, seekable file over a memoryview: ``torch.load`` reads records from it
    with ``readinto`` (one copy into each storage; ``io.BytesIO`` would copy the item first)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), len(self._view) - self._pos))
        memoryview(b).cast("B")[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n


def _has_rank_metadata(directory: str) -> bool:
    """Whether ``directory`` holds per-rank metadata (``__RANK.metadata``, written by saves
    without collectives)."""
    try:
        return any(n.startswith("__") and n.endswith(".metadata") for n in os.listdir(directory))
    except OSError:
        return False


def _called_by_dcp_load() -> bool:
    """Whether ``read_metadata``'s caller is the metadata step of torch's ``dcp.load``
    (``state_dict_loader._load_state_dict``'s ``local_step``), which always calls
    ``set_up_storage_reader`` next. Any other caller gets the error from ``read_metadata``."""
    import sys

    caller = sys._getframe(2)  # 0: this function, 1: read_metadata, 2: its caller
    return (caller.f_code.co_name == "local_step"
            and caller.f_globals.get("__name__") == "torch.distributed.checkpoint.state_dict_loader")


class FastPersistReader(FileSystemReader):
    """A ``torch.distributed.checkpoint`` storage reader: a drop-in replacement for
    ``FileSystemReader`` that reads each rank's items with fastpersist's native engine
    (parallel reads into aligned buffers) and checks the CRC-32 that
    :class:`FastPersistWriter` recorded for every item (``ChecksumError`` naming the
    file and the item on a mismatch). Checkpoints written by the stock writer load
    too, unchecked (they carry no checksums). Resharding (loading with another world
    size or other shardings) is DCP's planner's work, as with the stock reader.

    Damaged or hostile directories give the saved values, stock's values (a stock
    checkpoint carries nothing to check), or a clear error naming file, item and
    offset: ``.metadata`` is read with a restricted unpickler and its seal checked,
    the storage table is validated on every rank (paths inside the directory,
    integer ranges, no overlapping records), and each file's size is checked before
    any buffer is sized (see docs/dcp.md, "Damaged checkpoints").

    Items with stream transforms (``_extensions``), or a torch whose DCP internals
    differ from what this class knows, are read by ``FileSystemReader`` itself.

    ``path`` may be an ``s3://bucket/prefix`` URL (a checkpoint :class:`FastPersistWriter`
    wrote there, or any DCP checkpoint laid out as a directory under that prefix): the
    ``.metadata`` object is fetched and checked as a local one, and each rank reads
    exactly its items' byte ranges with ranged GETs in parallel (docs/dcp.md).
    """

    def __init__(self, path: PathLike, *, config: Any = None, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.config = config
        self._handle: Any = None
        #: the error of a .metadata that could not be read, kept for set_up_storage_reader (see read_metadata)
        self._metadata_error: Any = None
        #: the checkpoint's objects when ``path`` is an ``s3://`` URL (None: a directory)
        self._s3: Optional[S3Checkpoint] = None
        if is_s3_url(path):
            self._s3 = S3Checkpoint(os.fspath(path), config)
            self.path = self._s3.url

    def reset(self, checkpoint_id: Optional[PathLike] = None) -> None:
        reset_target(self, checkpoint_id, super().reset)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_handle"] = None
        return state

    def _get_handle(self) -> Any:
        if self._handle is None:
            cfg = self.config if self.config is not None else get_default()
            self._handle = _native.Handle(**cfg.handle_kwargs(read=True))
        return self._handle

    # ------------------------------------------------------------------ StorageReader

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """Stock ``read_metadata``, with the restricted unpickler and the seal check of
        :mod:`fastpersist.formats.dcpmetadata`: damaged or foreign metadata is a
        ``CheckpointFormatError`` naming the file, never unpickled code."""
        if not _compat.ok("dcp_storage_layer"):
            return super().read_metadata(*args, **kwargs)
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        store = self._s3
        read: Callable[[], Any]
        if store is not None:
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            path = store.name_of(name)
            read = lambda: load_metadata_bytes(store.get(name), path)  # noqa: E731
        else:
            if hasattr(self, "_get_metadata_path"):
                path = os.fsdecode(os.fspath(self._get_metadata_path(rank)))
            else:  # a torch without the helper: its naming
                path = os.path.join(os.fsdecode(os.fspath(self.path)),
                                    ".metadata" if rank is None else f"__{rank}.metadata")
            read = lambda: load_metadata(path)  # noqa: E731
        self._metadata_error = None
        try:
            metadata, _sealed = read()
        except (CheckpointFormatError, OSError) as e:
            # A missing file, or a damaged global .metadata beside per-rank ones, goes to
            # DCP as stock's would: DCP then tries the per-rank __RANK.metadata.
            if isinstance(e, FileNotFoundError) or not _called_by_dcp_load() or (
                    rank is None and store is None and _has_rank_metadata(os.path.dirname(path))):
                raise
            # dcp.load catches whatever read_metadata raises and reports only its text,
            # inside AssertionError("metadata is None; ..."). Handed an empty Metadata
            # instead, it calls set_up_storage_reader next, outside any handler: the error
            # is raised there, so it keeps its class (CheckpointException.failures[rank]
            # with a process group, raised as it is without one).
            from torch.distributed.checkpoint.metadata import Metadata

            self._metadata_error = e
            return Metadata(state_dict_metadata={})
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._metadata_error is not None:
            err, self._metadata_error = self._metadata_error, None
            raise err
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        if not isinstance(self.storage_data, dict):
            raise CheckpointFormatError(f"{self.path}: .metadata has no storage_data table; {ADVICE}", str(self.path))
        problems = table_problems(self.storage_data, os.path.join(os.fsdecode(os.fspath(self.path)), ".metadata"))
        unchecked = [i for i, info in self.storage_data.items() if _compat.dcp_storage_crc(info) is None]
        if unchecked and len(unchecked) < len(self.storage_data):  # no writer leaves some items without a CRC
            problems.append((unchecked[0], None, None,
                             f"{self.path}/.metadata: {len(unchecked)} of {len(self.storage_data)} items have no "
                             f"CRC-32 (first: {item_name(unchecked[0])}), the others have one: the metadata was "
                             f"edited"))
        if problems:
            _index, rel, off, msg = problems[0]
            more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
            raise CheckpointFormatError(f"{msg}{more}: .metadata does not describe a valid checkpoint; {ADVICE}",
                                        os.path.join(os.fsdecode(os.fspath(self.path)), rel or ".metadata"), off)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not _compat.ok("dcp_storage_layer") or any(
            getattr(self.storage_data[r.storage_index], "transform_descriptors", None) for r in plan.items
        ):
            if self._s3 is not None:
                raise ValueError(f"fastpersist.dcp: {self.path}: items with stream transforms (_extensions) cannot "
                                 "be read from object storage by fastpersist: copy the checkpoint to a local "
                                 "directory and read it with FileSystemReader")
            log.info("fastpersist.dcp: reading %s with DCP's FileSystemReader", self.path)
            return super().read_data(plan, planner)
        by_index: dict[Any, list[Any]] = {}
        for req in plan.items:
            by_index.setdefault(req.storage_index, []).append(req)
        batches = self._batches(by_index)
        if batches and self._s3 is not None:
            self._s3_pipeline(batches, by_index, planner)
        elif batches:
            self._pipeline(batches, by_index, planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _batches(self, by_index: dict[Any, list[Any]]) -> list[tuple[str, list[Any], list[int], int]]:
        """``(path, items, buffer offsets, buffer bytes)`` per read: items of one file in
        offset order, up to :data:`_BATCH_BYTES` (a larger item alone)."""
        root = os.fsdecode(os.fspath(self.path))
        per_file: dict[str, list[Any]] = {}
        for idx in by_index:
            per_file.setdefault(self.storage_data[idx].relative_path, []).append(idx)
        out = []
        for rel, idxs in per_file.items():
            path = self._s3.name_of(rel) if self._s3 is not None else os.path.join(root, rel)
            if not inside(rel):
                raise CheckpointFormatError(f"{root}/.metadata: item {item_name(idxs[0])} names no file inside the "
                                            f"checkpoint ({rel!r}); {ADVICE}", path)
            try:
                size = self._size(rel, path)
            except FileNotFoundError:
                raise FileNotFoundError(
                    errno.ENOENT, f"missing file of the checkpoint: .metadata stores {len(idxs)} item(s) to load in it "
                    f"({', '.join(item_name(i) for i in idxs[:3])}{', ...' if len(idxs) > 3 else ''}); the "
                    f"directory is incomplete: copy the whole checkpoint directory, or {ADVICE}", path) from None
            idxs.sort(key=lambda i: (self.storage_data[i].offset, self.storage_data[i].length))
            batch: list[Any] = []
            places: list[int] = []
            total = 0
            end = 0
            for idx in idxs:
                info = self.storage_data[idx]
                off, n = info.offset, info.length
                if type(off) is not int or type(n) is not int or off < 0 or n < 0:
                    raise CheckpointFormatError(f"{path}: .metadata gives item {item_name(idx)} offset {off!r} and "
                                                f"length {n!r}; {ADVICE}", path)
                if off + n > size:
                    raise CheckpointFormatError(
                        f"{path}: .metadata places item {item_name(idx)} at [{off}, {off + n}), the file has {size} "
                        f"bytes: the file is truncated (an interrupted copy?) or .metadata belongs to another "
                        f"checkpoint; {ADVICE}", path, off)
                if n and off < end:  # not a file any writer of ours or DCP's made
                    raise CheckpointFormatError(f"{path}: item {item_name(idx)} at [{off}, {off + n}) overlaps the "
                                                f"previous item (ending at {end}); {ADVICE}", path, off)
                end = max(end, off + n)
                n = _align_up(max(1, n))
                if batch and total + n > _BATCH_BYTES:
                    out.append((path, batch, places, total))
                    batch, places, total = [], [], 0
                batch.append(idx)
                places.append(total)
                total += n
            if batch:
                out.append((path, batch, places, total))
        return out

    def _size(self, rel: str, path: str) -> int:
        """The size of data file ``rel`` (at ``path``); ``FileNotFoundError`` when missing."""
        if self._s3 is None:
            return os.stat(path).st_size
        size = self._s3.size(rel)
        if size is None:
            raise FileNotFoundError(errno.ENOENT, "no such object", path)
        return size

    def _s3_pipeline(self, batches: list[tuple[str, list[Any], list[int], int]], by_index: dict[Any, list[Any]],
                     planner: LoadPlanner) -> None:
        """:meth:`_pipeline` from object storage: the items of batch k+1 are fetched (ranged
        GETs of exactly their bytes, in parallel) while batch k is checked and handed over."""
        store = self._s3
        assert store is not None

        def fetch(k: int) -> bytearray:
            _path, batch, places, total = batches[k]
            buf = bytearray(total)
            ranges = [(self.storage_data[idx].relative_path, self.storage_data[idx].offset,
                       self.storage_data[idx].length, at) for idx, at in zip(batch, places)]
            store.read_ranges(ranges, memoryview(buf))
            return buf

        with ThreadPoolExecutor(1, thread_name_prefix="fastpersist-dcp-ahead") as ahead:
            pending = ahead.submit(fetch, 0)
            try:
                for k, (path, batch, places, _total) in enumerate(batches):
                    buf = pending.result()
                    if k + 1 < len(batches):
                        pending = ahead.submit(fetch, k + 1)
                    mem = memoryview(buf)
                    lengths = [self.storage_data[idx].length for idx in batch]
                    self._check(path, batch, [zlib.crc32(mem[at:at + n]) & 0xFFFFFFFF
                                              for at, n in zip(places, lengths)])
                    ptr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf)) if buf else 0
                    self._check_zip_crcs(self._get_handle(), path, batch, places, ptr, mem, by_index)
                    for idx, at, n in zip(batch, places, lengths):
                        raw = mem[at:at + n]
                        for req in by_index[idx]:
                            self._deliver(req, raw, planner, path, self.storage_data[idx])
            finally:
                pending.cancel()

    def _pipeline(self, batches: list[tuple[str, list[Any], list[int], int]], by_index: dict[Any, list[Any]],
                  planner: LoadPlanner) -> None:
        """Read batch k+1 (native, in the background) while batch k is checked and handed
        to the planner; two aligned buffers, reused."""
        handle = self._get_handle()
        size = max(max(b[3] for b in batches), _ALIGN)
        bufs = [choose_pages(_native.PinnedBuffer(size, _ALIGN, False)) for _ in range(min(2, len(batches)))]

        def submit(k: int) -> int:
            path, batch, places, _total = batches[k]
            buf = bufs[k % len(bufs)]
            extents = [(self.storage_data[idx].offset, buf.ptr + at, self.storage_data[idx].length, slot)
                       for slot, (idx, at) in enumerate(zip(batch, places)) if self.storage_data[idx].length]
            return handle.submit_read(path, extents, len(batch))

        try:
            pending = submit(0)
            for k, (path, batch, places, _total) in enumerate(batches):
                try:
                    crcs = dict(handle.wait())[pending]
                except EOFError as e:  # shrank since _batches looked at its size
                    raise CheckpointFormatError(f"{path} is shorter than .metadata says ({e}); {ADVICE}", path) from e
                if k + 1 < len(batches):
                    pending = submit(k + 1)
                self._check(path, batch, crcs)
                mem = memoryview(bufs[k % len(bufs)])
                self._check_zip_crcs(handle, path, batch, places, bufs[k % len(bufs)].ptr, mem, by_index)
                for idx, at in zip(batch, places):
                    raw = mem[at : at + self.storage_data[idx].length]
                    for req in by_index[idx]:
                        self._deliver(req, raw, planner, path, self.storage_data[idx])
        finally:
            if handle.pending():
                try:
                    handle.wait()
                except Exception:  # noqa: BLE001 - the error already propagating is the one to report
                    pass

    def _check(self, path: str, batch: list[Any], crcs: list[int]) -> None:
        bad = []
        for idx, crc in zip(batch, crcs):
            info = self.storage_data[idx]
            want = _compat.dcp_storage_crc(info)
            if want is not None and want != crc:
                bad.append((idx, info, crc, want))
        if bad:
            idx, info, crc, want = bad[0]
            names = [item_name(b[0]) for b in bad]
            err = ChecksumError(
                f"{path}: CRC-32 mismatch in {len(bad)} item(s) ({', '.join(names[:5])}{', ...' if len(bad) > 5 else ''}"
                f"); first: {names[0]} at [{info.offset}, {info.offset + info.length}) has CRC-32 {crc:08x}, "
                f".metadata records {want:08x}: the file was damaged after it was written, or .metadata belongs to "
                f"another checkpoint; {ADVICE}",
                path,
                names,
            )
            err.offset = info.offset  # type: ignore[attr-defined]
            raise err

    def _check_zip_crcs(self, handle: Any, path: str, batch: list[Any], places: list[int], ptr: int,
                        mem: memoryview, by_index: dict[Any, list[Any]]) -> None:
        """Tensor items without a fastpersist CRC (stock checkpoints) are whole torch zips
        that carry a CRC-32 per record, which torch's reader does not compare: compare
        them (on the handle's threads), so flipped tensor bytes are a ``ChecksumError``
        instead of other values. An item whose zip index cannot be parsed is left to
        ``torch.load`` (torch's verdict)."""
        todo: list[tuple[Any, Any, Any]] = []
        ranges: list[tuple[int, int]] = []
        for idx, at in zip(batch, places):
            info = self.storage_data[idx]
            if (_compat.dcp_storage_crc(info) is not None or not info.length
                    or all(r.type == LoadItemType.BYTE_IO for r in by_index[idx])):
                continue
            try:
                zindex = parse_zip_index(buffer_reader(mem[at : at + info.length]), info.length, path)
            except Exception:  # noqa: BLE001 - not a zip we can read: torch.load decides
                continue
            for e in zindex.entries:
                if e.method == 0 and e.compressed_size and e.data_offset + e.compressed_size <= info.length:
                    todo.append((idx, info, e))
                    ranges.append((ptr + at + e.data_offset, e.compressed_size))
        if not ranges:
            return
        bad = [(idx, info, e, crc) for (idx, info, e), crc in zip(todo, handle.crc32_ranges(ranges)) if crc != e.crc32]
        if bad:
            idx, info, e, crc = bad[0]
            names = list(dict.fromkeys(item_name(b[0]) for b in bad))
            err = ChecksumError(
                f"{path}: item {names[0]} at [{info.offset}, {info.offset + info.length}): record {e.name} (bytes "
                f"[{info.offset + e.data_offset}, {info.offset + e.data_offset + e.compressed_size}) of the file) has "
                f"CRC-32 {crc:08x}, the item's zip records {e.crc32:08x}: the file was damaged after it was written"
                f"{f' ({len(names)} items damaged: ' + ', '.join(names[:5]) + ')' if len(names) > 1 else ''}; "
                f"{ADVICE}", path, names)
            err.offset = info.offset + e.data_offset  # type: ignore[attr-defined]
            raise err

    @staticmethod
    def _deliver(req: Any, raw: memoryview, planner: LoadPlanner, path: str = "?", info: Any = None) -> None:
        where = (f"{path}: item {item_name(req.storage_index)}"
                 + (f" at [{info.offset}, {info.offset + info.length})" if info is not None else ""))
        off = getattr(info, "offset", None)
        if req.type == LoadItemType.BYTE_IO:
            if _bare_tensor(raw):  # DCP stores every tensor as a tensor item: a record swapped in .metadata
                raise CheckpointFormatError(f"{where}: a bytes item whose record holds a bare tensor, as a tensor "
                                            f"item's does: .metadata's records were swapped or edited; {ADVICE}",
                                            path, off)
            try:
                planner.load_bytes(req, io.BytesIO(bytes(raw)))
            except FastPersistError:
                raise
            except Exception as e:  # noqa: BLE001 - torch.load of damaged bytes raises anything
                raise CheckpointFormatError(f"{where}: loading the bytes item failed ({type(e).__name__}: {e}); "
                                            f"{ADVICE}", path, off) from e
            return
        try:
            tensor = torch.load(_MemoryFile(raw), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch.load of damaged bytes raises anything
            raise CheckpointFormatError(f"{where} is not a tensor saved by torch.save ({type(e).__name__}: {e}); "
                                        f"{ADVICE}", path, off) from e
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointFormatError(f"{where} holds a {type(tensor).__name__}, not a tensor; {ADVICE}", path, off)
        try:
            tensor = narrow(tensor, req.storage_offsets, req.lengths)
        except (RuntimeError, IndexError, ValueError) as e:
            raise CheckpointFormatError(
                f"{where}: the stored tensor of shape {tuple(tensor.size())} does not hold the chunk .metadata "
                f"describes (offsets {tuple(req.storage_offsets)}, lengths {tuple(req.lengths)}); {ADVICE}",
                path, off) from e
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CheckpointFormatError(
                f"{where}: stored shape {tuple(tensor.size())} does not match the requested "
                f"{tuple(target.size())}; {ADVICE}", path, off)
        target.copy_(tensor)
        planner.commit_tensor(req, target)
