"""``FastPersistReader``: DCP's ``FileSystemReader`` with fastpersist reading the bytes."""

from __future__ import annotations

import io
import logging
import os
from typing import Any, Union

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from fastpersist import _compat
from fastpersist.errors import ChecksumError, CheckpointFormatError

log = logging.getLogger("fastpersist.dcp")

PathLike = Union[str, "os.PathLike[str]"]
#: Bytes read per native call (items larger than this are read alone).
_BATCH_BYTES = 64 << 20
_ALIGN = 4096


def _align_up(x: int, a: int = _ALIGN) -> int:
    return (x + a - 1) // a * a


def item_name(index: Any) -> str:
    """``fqn`` or ``fqn@offsets`` for messages."""
    fqn = getattr(index, "fqn", str(index))
    offset = getattr(index, "offset", None)
    return f"{fqn}@{tuple(offset)}" if offset is not None and len(offset) else str(fqn)


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


class FastPersistReader(FileSystemReader):
    """A ``torch.distributed.checkpoint`` storage reader: a drop-in replacement for
    ``FileSystemReader`` that reads each rank's items with fastpersist's native engine
    (parallel reads into aligned buffers) and checks the CRC-32 that
    :class:`FastPersistWriter` recorded for every item (``ChecksumError`` naming the
    file and the item on a mismatch). Checkpoints written by the stock writer load
    too, unchecked (they carry no checksums). Resharding (loading with another world
    size or other shardings) is DCP's planner's work, as with the stock reader.

    Items with stream transforms (``_extensions``), or a torch whose DCP internals
    differ from what this class knows, are read by ``FileSystemReader`` itself.
    """

    def __init__(self, path: PathLike, *, config: Any = None, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.config = config
        self._handle: Any = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_handle"] = None
        return state

    def _get_handle(self) -> Any:
        if self._handle is None:
            from fastpersist import _native
            from fastpersist.config import get_default

            cfg = self.config if self.config is not None else get_default()
            self._handle = _native.Handle(**cfg.handle_kwargs(read=True))
        return self._handle

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not _compat.ok("dcp_storage_layer") or any(
            getattr(self.storage_data[r.storage_index], "transform_descriptors", None) for r in plan.items
        ):
            log.info("fastpersist.dcp: reading %s with DCP's FileSystemReader", self.path)
            return super().read_data(plan, planner)
        by_index: dict[Any, list[Any]] = {}
        for req in plan.items:
            by_index.setdefault(req.storage_index, []).append(req)
        batches = self._batches(by_index)
        if batches:
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
            path = os.path.join(root, rel)
            idxs.sort(key=lambda i: (self.storage_data[i].offset, self.storage_data[i].length))
            batch: list[Any] = []
            places: list[int] = []
            total = 0
            end = -1
            for idx in idxs:
                info = self.storage_data[idx]
                if info.offset < end:  # items overlap: not a file any writer of ours or DCP's made
                    raise CheckpointFormatError(f"{path}: item {item_name(idx)} overlaps the previous item",
                                                path, info.offset)
                end = info.offset + info.length
                n = _align_up(max(1, info.length))
                if batch and total + n > _BATCH_BYTES:
                    out.append((path, batch, places, total))
                    batch, places, total = [], [], 0
                batch.append(idx)
                places.append(total)
                total += n
            if batch:
                out.append((path, batch, places, total))
        return out

    def _pipeline(self, batches: list[tuple[str, list[Any], list[int], int]], by_index: dict[Any, list[Any]],
                  planner: LoadPlanner) -> None:
        """Read batch k+1 (native, in the background) while batch k is checked and handed
        to the planner; two aligned buffers, reused."""
        from fastpersist import _native

        handle = self._get_handle()
        size = max(max(b[3] for b in batches), _ALIGN)
        bufs = [_native.PinnedBuffer(size, _ALIGN, False) for _ in range(min(2, len(batches)))]

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
                except EOFError as e:
                    raise CheckpointFormatError(f"{path} is shorter than .metadata says ({e})", path) from e
                if k + 1 < len(batches):
                    pending = submit(k + 1)
                self._check(path, batch, crcs)
                mem = memoryview(bufs[k % len(bufs)])
                for idx, at in zip(batch, places):
                    raw = mem[at : at + self.storage_data[idx].length]
                    for req in by_index[idx]:
                        self._deliver(req, raw, planner)
        finally:
            if handle.pending():
                try:
                    handle.wait()
                except Exception:  # noqa: BLE001 - the error already propagating is the one to report
                    pass

    def _check(self, path: str, batch: list[Any], crcs: list[int]) -> None:
        bad = [
            item_name(idx)
            for idx, crc in zip(batch, crcs)
            if (want := _compat.dcp_storage_crc(self.storage_data[idx])) is not None and want != crc
        ]
        if bad:
            raise ChecksumError(
                f"{path}: CRC-32 mismatch in {len(bad)} item(s) ({', '.join(bad[:5])}"
                f"{', ...' if len(bad) > 5 else ''}): the file changed after it was written",
                path,
                bad,
            )

    @staticmethod
    def _deliver(req: Any, raw: memoryview, planner: LoadPlanner) -> None:
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(bytes(raw)))
            return
        tensor = torch.load(_MemoryFile(raw), map_location="cpu", weights_only=True)
        tensor = narrow(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CheckpointFormatError(
                f"item {item_name(req.storage_index)}: stored shape {tuple(tensor.size())} does not match the "
                f"requested {tuple(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(req, target)
