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
_BATCH_BYTES = 256 << 20
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
        per_file: dict[str, dict[Any, list[Any]]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            per_file.setdefault(info.relative_path, {}).setdefault(req.storage_index, []).append(req)
        for relative_path, by_index in per_file.items():
            self._read_file(relative_path, by_index, planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_file(self, relative_path: str, by_index: dict[Any, list[Any]], planner: LoadPlanner) -> None:
        path = os.path.join(os.fsdecode(os.fspath(self.path)), relative_path)
        order = sorted(by_index, key=lambda idx: self.storage_data[idx].offset)
        batch: list[Any] = []
        nbytes = 0
        for idx in order:
            n = _align_up(self.storage_data[idx].length)
            if batch and nbytes + n > _BATCH_BYTES:
                self._read_batch(path, batch, by_index, planner)
                batch, nbytes = [], 0
            batch.append(idx)
            nbytes += n
        if batch:
            self._read_batch(path, batch, by_index, planner)

    def _read_batch(self, path: str, batch: list[Any], by_index: dict[Any, list[Any]], planner: LoadPlanner) -> None:
        from fastpersist import _native

        places = []
        total = 0
        for idx in batch:
            places.append(total)
            total += _align_up(max(1, self.storage_data[idx].length))
        buf = _native.PinnedBuffer(max(total, _ALIGN), _ALIGN, False)
        mem = memoryview(buf)
        extents = []
        end = -1
        for slot, (idx, at) in enumerate(zip(batch, places)):
            info = self.storage_data[idx]
            if info.offset < end:  # items overlap: not a file any writer of ours or DCP's made
                raise CheckpointFormatError(f"{path}: item {item_name(idx)} overlaps the previous item", path,
                                            info.offset)
            end = info.offset + info.length
            if info.length:
                extents.append((info.offset, buf.ptr + at, info.length, slot))
        try:
            crcs = self._get_handle().read(path, extents, len(batch)) if extents else [0] * len(batch)
        except EOFError as e:
            raise CheckpointFormatError(f"{path} is shorter than .metadata says ({e})", path) from e
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
        for idx, at in zip(batch, places):
            raw = mem[at : at + self.storage_data[idx].length]
            for req in by_index[idx]:
                self._deliver(req, raw, planner)

    @staticmethod
    def _deliver(req: Any, raw: memoryview, planner: LoadPlanner) -> None:
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(bytes(raw)))
            return
        tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        tensor = narrow(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CheckpointFormatError(
                f"item {item_name(req.storage_index)}: stored shape {tuple(tensor.size())} does not match the "
                f"requested {tuple(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(req, target)
