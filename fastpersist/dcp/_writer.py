"""``FastPersistWriter``: DCP's ``FileSystemWriter`` with fastpersist moving the bytes."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import re
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Union

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from fastpersist import _compat, _native, _sys
from fastpersist.commit import (clean_stale_temps, fsync_dir, fsync_dir_after_rename, temp_path_for,
                                write_and_replace)
from fastpersist.config import get_default
from fastpersist.dcp._layout import FileLayout, item_crcs, plan_file, stock_tensor
from fastpersist.dcp._s3 import ALIGNMENT as S3_ALIGNMENT
from fastpersist.dcp._s3 import S3Checkpoint, reset_target
from fastpersist.formats.dcpmetadata import load_metadata, load_metadata_bytes, seal
from fastpersist.handles import alignment_for
from fastpersist.plan import WritePlan
from fastpersist.s3url import is_s3_url

log = logging.getLogger("fastpersist.dcp")

PathLike = Union[str, "os.PathLike[str]"]
_SUFFIX = ".distcp"
_METADATA = ".metadata"

#: Data files this writer (and DCP's stock writer) names: ``__RANK_K.distcp`` (the first save
#: into a directory holding no checkpoint, as stock) and ``__RANK_fpTOKEN_K.distcp`` (a save
#: into a directory that holds one: TOKEN, 12 hex digits, is drawn once per save by the
#: coordinator). Garbage collection after a save removes unreferenced files of these two
#: shapes only; any other file in the directory is never touched.
_DATA_RE = re.compile(r"__(?P<rank>[0-9]+)_(?:fp(?P<token>[0-9a-f]{12})_)?(?P<k>[0-9]+)\.distcp")
_RANK_METADATA_RE = re.compile(r"__[0-9]+\.metadata")


def _is_metadata_name(name: str) -> bool:
    return name == _METADATA or _RANK_METADATA_RE.fullmatch(name) is not None


def _holds_checkpoint(directory: str) -> bool:
    """Whether ``directory`` holds a DCP metadata file (``.metadata`` or ``__N.metadata``)."""
    try:
        return any(_is_metadata_name(n) for n in os.listdir(directory))
    except FileNotFoundError:
        return False


def _prefix(rank: int, token: Union[str, None]) -> Any:
    """The ``_StoragePrefix`` of ``rank``'s data files in one save: files are ``PREFIX{k}.distcp``
    (the stock writer, when this one falls back to it, names them the same way)."""
    from torch.distributed.checkpoint import filesystem as fsmod

    return fsmod._StoragePrefix(f"__{rank}_" if token is None else f"__{rank}_fp{token}_")


def _new_token(directory: str) -> Union[str, None]:
    """None (stock names) when ``directory`` holds no checkpoint that a save could damage,
    else a token unique to this save, so that no file of the present checkpoint is touched."""
    return secrets.token_hex(6) if _holds_checkpoint(directory) else None


def _item_size(item: Any) -> int:
    if item.tensor_data is None:
        return 0
    n = 1
    for s in item.tensor_data.size:
        n *= s
    return n * item.tensor_data.properties.dtype.itemsize


def _buckets(items: list[Any], bins: int) -> list[list[Any]]:
    """Stock's split: bytes items round robin, tensors largest first to the lightest bin."""
    if bins <= 1:
        return [list(items)]
    out: list[list[Any]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensors = sorted((i for i in items if i.type != WriteItemType.BYTE_IO), key=_item_size, reverse=True)
    for k, wi in enumerate(byte_items):
        out[k % bins].append(wi)
    for wi in tensors:
        k = min(range(bins), key=sizes.__getitem__)
        out[k].append(wi)
        sizes[k] += _item_size(wi)
    return out


_handles: dict[tuple, Any] = {}
_handles_lock = threading.Lock()


def _forget_handles_in_child() -> None:
    """A forked child starts with no cached handles and a fresh lock (a parent thread may
    have held the old one at the fork), as ``fastpersist.api`` does for its own cache."""
    global _handles_lock
    _handles_lock = threading.Lock()
    _handles.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_handles_in_child)


def _shared_handle(kwargs: dict) -> Any:
    """One native handle per distinct setting in this process (see ``FastPersistWriter._get_handle``)."""
    key = tuple(sorted(kwargs.items()))
    with _handles_lock:
        h = _handles.get(key)
        if h is None:
            h = _handles[key] = _native.Handle(**kwargs)
        return h


class FastPersistWriter(FileSystemWriter):
    """A ``torch.distributed.checkpoint`` storage writer: a drop-in replacement for
    ``FileSystemWriter`` whose ``.distcp`` files are written by fastpersist's native
    engine (aligned O_DIRECT writes, many in flight) and checksummed.

    ``dcp.save(state, storage_writer=FastPersistWriter(path))``, ``dcp.async_save``
    likewise. Accepts ``FileSystemWriter``'s keyword arguments
    (``single_file_per_rank``, ``thread_count``, ``sync_files``, ``overwrite``,
    ``cache_staged_state_dict``, ...); ``config`` is a :class:`fastpersist.Config`
    for the I/O settings (default: ``fastpersist.config.get_default()``).

    The directory it writes is a stock DCP checkpoint: ``FileSystemReader`` (with no
    fastpersist installed) loads it. Differences that the stock reader cannot see:
    items are placed at aligned offsets (zero padding between them), and each item's
    ``_StorageInfo`` in ``.metadata`` carries a CRC-32 of its bytes
    (``fastpersist_crc32``), which :class:`FastPersistReader` and
    ``fastpersist.verify`` check.

    Commit (saving into a directory that already holds a checkpoint, the usual case of a
    ``latest`` directory, never touches that checkpoint until the new one is durable):

    1. Names. A save into a directory without a DCP metadata file names its data files
       as stock does (``__RANK_K.distcp``). A save into a directory holding one draws a
       token (12 random hex digits, once per save, on the coordinator; carried to every
       rank in its plan's ``storage_data``) and names them ``__RANK_fpTOKEN_K.distcp``:
       no file the present ``.metadata`` references is written, renamed over or removed.
    2. Data. Each rank writes its files under temporary names, fsyncs them, renames
       them to their names and fsyncs the directory before reporting success.
    3. Publish. Only after every rank succeeded does the coordinator write the new
       ``.metadata`` (temporary file, fsync, rename over the old ``.metadata``,
       directory fsync). Until that rename the previous ``.metadata`` and its files
       are in place and load exactly as before: an I/O error, a full disk, an
       exception, a killed process or a failed rank leaves the previous checkpoint.
    4. Garbage. After the rename the coordinator removes the data files of those two
       name shapes that the new ``.metadata`` does not reference (the previous save's,
       leftovers of saves that did not finish); files referenced by another metadata
       file in the directory (``__N.metadata`` of rank-local saves) and files of any
       other name are kept. A failure there is logged, never raised: the save has
       already committed. (Temporary files of writers that died are removed when a save
       starts, once their writer is known to be gone: ``fastpersist.commit``.)

    ``path`` may be an ``s3://bucket/prefix`` URL: each rank uploads each of its data
    files as one object (a multipart upload, parts in parallel, aborted on failure), and
    the coordinator commits by putting the ``.metadata`` object last; the same steps,
    with "rename" read as "complete the upload" (docs/dcp.md, "Object storage").

    ``overwrite=False`` raises when the directory holds a checkpoint, as stock. With
    ``use_collectives=False`` each rank does all four steps for its own ``__RANK.metadata``
    and files. Two saves into one directory at the same time are not supported (as with
    stock DCP): wait for an ``async_save`` before starting the next save there.

    With stream transforms (``_extensions``) or ``serialization_format=SAFETENSORS``,
    or on a torch whose DCP internals differ from what this class knows
    (``fastpersist._compat``'s ``dcp_storage_layer``), it writes exactly as
    ``FileSystemWriter`` does, and says why in a log message.
    """

    def __init__(self, path: PathLike, *, config: Any = None, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.config = config
        self._handle: Any = None
        #: the checkpoint's objects when ``path`` is an ``s3://`` URL (None: a directory)
        self._s3: Union[S3Checkpoint, None] = None
        if is_s3_url(path):
            self._s3 = S3Checkpoint(os.fspath(path), config)
            self.path = self._s3.url

    def reset(self, checkpoint_id: Union[PathLike, None] = None) -> None:
        reset_target(self, checkpoint_id, super().reset)

    def __getstate__(self) -> dict:  # the native handle stays in this process
        state = dict(self.__dict__)
        state["_handle"] = None
        return state

    # ------------------------------------------------------------------ helpers

    def _fast(self) -> bool:
        why = self._stock_reason()
        if why:
            log.info("fastpersist.dcp: writing %s with DCP's FileSystemWriter: %s", self.path, why)
            return False
        return True

    def _stock_reason(self) -> Union[str, None]:
        """Why the stock writer must write this save (None: fastpersist writes it)."""
        why = None
        if not _compat.ok("dcp_storage_layer"):
            why = f"dcp_storage_layer unavailable ({_compat.status('dcp_storage_layer').reason})"
        elif getattr(self.transforms, "extensions", ()):
            why = "stream transforms (_extensions) are applied by the stock writer"
        elif self.serialization_format != SerializationFormat.TORCH_SAVE:
            why = f"serialization_format={self.serialization_format} is written by the stock writer"
        return why

    def _get_handle(self, nfiles: int) -> Any:
        """A native handle for these settings, shared by every writer of this process (its
        staging buffers are allocated and faulted in once, not at every save). Safe to share:
        :meth:`_write_files` waits on its own futures only."""
        cfg = self.config if self.config is not None else get_default()
        kwargs = cfg.handle_kwargs()
        kwargs["max_async"] = max(int(kwargs.get("max_async", 1)), min(nfiles, max(1, self.thread_count)))
        return _shared_handle(kwargs)

    def _dir(self) -> str:
        return os.fsdecode(os.fspath(self.path))

    def _metadata_name(self) -> str:
        if not self.use_collectives and self.rank is not None:
            return f"__{self.rank}{_METADATA}"
        return _METADATA

    def _drop_old_metadata(self) -> None:
        """Remove an existing ``.metadata`` before this save replaces any data file: only on a
        torch whose DCP internals this class does not know (the stock writer then overwrites
        the data files in place, and an old ``.metadata`` must not describe new bytes)."""
        path = os.path.join(self._dir(), self._metadata_name())
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        if self.sync_files:
            fsync_dir(self._dir())
        log.info("fastpersist.dcp: removed the previous checkpoint's %s before overwriting it", path)

    def _rank_local(self) -> bool:
        return not self.use_collectives and self.rank is not None

    # ------------------------------------------------------------------ StorageWriter

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self._s3 is not None:
            return self._s3_local_plan(plan)
        plan = super().prepare_local_plan(plan)  # mkdir, overwrite check, rank prefix
        if self._rank_local():  # no coordinator: each rank owns its metadata and names its files
            clean_stale_temps(self._dir())
            if not _compat.ok("dcp_storage_layer"):
                self._drop_old_metadata()
            else:
                plan = dataclasses.replace(plan, storage_data=_prefix(self.rank, _new_token(self._dir())))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs on the coordinator after every rank's local plan and before any write_data
        # (rank-local saves: on each rank, with the plan prepare_local_plan named).
        if self._s3 is not None:
            if self._rank_local():
                return plans
            token = secrets.token_hex(6) if self._s3.exists(_METADATA) else None
            return [dataclasses.replace(plan, storage_data=_prefix(i, token))
                    if plan.storage_data is None else plan for i, plan in enumerate(plans)]
        if not _compat.ok("dcp_storage_layer"):
            self._drop_old_metadata()
            clean_stale_temps(self._dir())
            return super().prepare_global_plan(plans)
        if self._rank_local():
            return super().prepare_global_plan(plans)
        clean_stale_temps(self._dir())
        # One token for the whole save, carried to every rank by its plan's storage_data.
        token = _new_token(self._dir())
        return [dataclasses.replace(plan, storage_data=_prefix(i, token))
                if plan.storage_data is None else plan for i, plan in enumerate(plans)]

    def _layouts(self, plan: SavePlan, planner: SavePlanner, alignment: int) -> list[tuple[str, FileLayout]]:
        """``(file name, layout)`` of each data file of this rank's ``plan``."""
        prefix = plan.storage_data.prefix
        if self.single_file_per_rank:
            groups = [b for b in _buckets(plan.items, self.thread_count) if b]
        else:
            groups = [[item] for item in plan.items]
        out = []
        for k, group in enumerate(groups):
            entries = []
            # stock order: bytes items first, then tensors
            for wi in [i for i in group if i.type == WriteItemType.BYTE_IO] + [
                i for i in group if i.type != WriteItemType.BYTE_IO
            ]:
                data = planner.resolve_data(wi)
                if wi.type != WriteItemType.BYTE_IO:
                    data = stock_tensor(data)
                entries.append((wi.index, data))
            out.append((f"{prefix}{k}{_SUFFIX}", plan_file(entries, alignment)))
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self._s3 is not None:
            results = self._s3_write(plan, planner)
        else:
            if not self._fast():
                return super().write_data(plan, planner)
            directory = self._dir()
            files: list[tuple[str, str, str, FileLayout]] = []  # (name, final, tmp, layout)
            for name, lay in self._layouts(plan, planner, alignment_for(directory)):
                final = os.path.join(directory, name)
                files.append((name, final, temp_path_for(final), lay))
            results = self._write_files(files)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_files(self, files: list[tuple[str, str, str, FileLayout]]) -> list[WriteResult]:
        handle = self._get_handle(len(files))
        futures: list[Any] = []
        try:
            for _name, _final, tmp, lay in files:
                futures.append(handle.write_async(tmp, lay.extents, lay.patches, lay.nslots,
                                                  truncate=True, fsync=self.sync_files))
            slot_crcs = [f.result() for f in futures]
            for _name, final, tmp, _lay in files:
                _sys.rename(tmp, final)
        except BaseException:
            for f in futures:  # every op finished before its temporary file is removed
                f.wait()
            for _name, _final, tmp, _lay in files:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            raise
        if self.sync_files and files:
            fsync_dir(self._dir())
        return _results([(name, lay) for name, _final, _tmp, lay in files], slot_crcs)

    # ------------------------------------------------------------------ s3://

    def _s3_local_plan(self, plan: SavePlan) -> SavePlan:
        assert self._s3 is not None
        why = self._stock_reason()
        if why:
            raise ValueError(f"fastpersist.dcp: {self.path}: {why}, which cannot write to object storage: save to a "
                             "local directory, or without that option")
        if not self.overwrite and self._s3.exists(self._metadata_name() if self._rank_local() else _METADATA):
            raise RuntimeError(f"Checkpoint already exists at {self.path} and self.overwrite=False.")
        if self._rank_local():
            token = secrets.token_hex(6) if self._s3.exists(self._metadata_name()) else None
            plan = dataclasses.replace(plan, storage_data=_prefix(self.rank, token))
        return plan

    def _s3_write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """Upload this rank's data files, one object each (files in parallel, each a
        multipart upload with parts in parallel). On failure the objects already complete
        are deleted (best effort: the next committed save removes what is left) and the
        error is raised; no ``.metadata`` is written, so no checkpoint names them."""
        store = self._s3
        assert store is not None
        files = self._layouts(plan, planner, S3_ALIGNMENT)
        if not files:
            return []
        cfg = self.config if self.config is not None else get_default()
        workers = max(1, min(len(files), self.thread_count))
        threads = max(2, cfg.s3_threads // workers)
        with ThreadPoolExecutor(workers, thread_name_prefix="fastpersist-dcp-put") as pool:
            futures = [pool.submit(store.upload, name, WritePlan(lay.extents, lay.patches, lay.nslots, lay.size,
                                                                 lay.keepalive), threads)
                       for name, lay in files]
            errors = [f.exception() for f in futures]
        failed = [e for e in errors if e is not None]
        if failed:
            done = [name for (name, _lay), e in zip(files, errors) if e is None]
            store.delete(done)
            raise failed[0]
        return _results(files, [f.result() for f in futures])

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if not _compat.ok("dcp_storage_layer"):
            return super().finish(metadata, results)
        from torch.distributed.checkpoint import filesystem as fsmod

        metadata.version = getattr(fsmod, "CURRENT_DCP_VERSION", metadata.version)
        storage_md = {}
        for wr_list in results:
            storage_md.update({wr.index: wr.storage_data for wr in wr_list})
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        data = seal(pickle.dumps(metadata))  # stock pickle.load ignores the trailer
        if self._s3 is not None:
            self._s3.put(self._metadata_name(), data)  # the commit: the object appears whole or not at all
            try:
                self._s3_collect_garbage(metadata)
            except Exception as e:  # noqa: BLE001 - leftovers cost space, not correctness
                log.warning("fastpersist.dcp: %s: could not remove the previous checkpoint's data objects: %s",
                            self.path, e)
            return
        directory = self._dir()
        final = os.path.join(directory, self._metadata_name())
        write_and_replace(temp_path_for(final), final, data, fsync=self.sync_files)
        if self.sync_files:
            fsync_dir_after_rename(final)  # its error says the new .metadata is in place
        # The new checkpoint is committed: what follows never fails the save.
        try:
            self._collect_garbage(metadata)
        except Exception as e:  # noqa: BLE001 - leftovers cost space, not correctness
            log.warning("fastpersist.dcp: %s: could not remove the previous checkpoint's data files: %s",
                        directory, e)

    def _s3_collect_garbage(self, metadata: Metadata) -> None:
        """:meth:`_collect_garbage` of the objects under the prefix."""
        store = self._s3
        assert store is not None
        names = store.names()
        removable = self._unreferenced(metadata, names, lambda n: load_metadata_bytes(store.get(n), store.name_of(n)))
        removed = store.delete(removable)
        if removed:
            log.info("fastpersist.dcp: %s: removed %d data object(s) no checkpoint references: %s", self.path,
                     len(removed), ", ".join(sorted(removed)))

    def _unreferenced(self, metadata: Metadata, names: list[str], read: Any) -> list[str]:
        """The data files among ``names`` that no metadata file references (see
        :meth:`_collect_garbage`); ``read(name)`` loads another metadata file. Empty when
        one of those cannot be read."""
        mine = self._metadata_name()
        keep = {os.path.normpath(info.relative_path) for info in metadata.storage_data.values()}
        for n in names:
            if n == mine or not _is_metadata_name(n):
                continue
            try:
                other, _sealed = read(n)
            except FileNotFoundError:
                continue
            except Exception as e:  # noqa: BLE001
                log.warning("fastpersist.dcp: %s: %s is unreadable (%s), so which data files it uses is unknown: "
                            "no data file removed", self.path, n, e)
                return []
            keep.update(os.path.normpath(str(getattr(i, "relative_path", ""))) for i in other.storage_data.values())
        out = []
        for n in names:
            m = _DATA_RE.fullmatch(n)
            if m is None or n in keep:
                continue
            if self._rank_local() and int(m["rank"]) != self.rank:
                continue
            out.append(n)
        return out

    def _collect_garbage(self, metadata: Metadata) -> None:
        """Remove the data files that the ``.metadata`` just published does not reference:
        the previous checkpoint's, and those of saves that did not finish (killed, failed on
        some rank). Only files named as this writer and DCP's stock writer name data files
        (``__RANK_K.distcp``, ``__RANK_fpTOKEN_K.distcp``); a rank-local save
        (``use_collectives=False``) only its own rank's. Files that another metadata file in
        the directory (``.metadata`` / ``__N.metadata`` of another kind of save) references
        stay; if one of those cannot be read, nothing is removed."""
        directory = self._dir()
        names = os.listdir(directory)
        removed = []
        for n in self._unreferenced(metadata, names, lambda n: load_metadata(os.path.join(directory, n))):
            try:
                os.unlink(os.path.join(directory, n))
            except FileNotFoundError:
                continue
            removed.append(n)
        if removed:
            if self.sync_files:
                fsync_dir(directory)
            log.info("fastpersist.dcp: %s: removed %d data file(s) no checkpoint references: %s", directory,
                     len(removed), ", ".join(sorted(removed)))


def _results(files: list[tuple[str, FileLayout]], slot_crcs: list[list[int]]) -> list[WriteResult]:
    """DCP's write results of ``files``: each item's ``_StorageInfo`` with its CRC-32."""
    results: list[WriteResult] = []
    for crcs, (name, lay) in zip(slot_crcs, files):
        for item, crc in zip(lay.items, item_crcs(lay, crcs)):
            info = _compat.dcp_storage_info(name, item.offset, item.length, crc)
            results.append(WriteResult(index=item.index, size_in_bytes=item.length, storage_data=info))
    return results
