"""Asynchronous saves: :func:`save_async`, :func:`wait_all`, :func:`guard`.

``save_async(obj, path)`` returns a :class:`SaveFuture` as soon as the state is
captured; the bytes go to the disk on native threads (no GIL) while training
goes on. The file at ``path`` ends up byte for byte what ``fastpersist.save``
would have written at the moment of the call, however the tensors change
afterwards. Two ways to capture the state:

``mode="snapshot"`` (default)
    The planned file (headers, pickle and every tensor byte, CUDA tensors
    included) is copied at call time into a pool of page-locked host memory of
    ``Config.async_staging_limit`` bytes (``FASTPERSIST_ASYNC_STAGING_LIMIT``,
    default 1 GiB), allocated on first use and reused by later saves. The call
    costs one plain memory copy of the state: the CRC-32s the file's CRC fields
    need are computed afterwards from the staged copy on a background thread,
    and those fields written before the commit. A save larger than the pool, or one
    issued while an earlier save still occupies it, waits inside the call for
    earlier windows to reach the disk: page-locked memory never exceeds the limit.
    CUDA tensors are not copied by the call itself: their D2H copies into the
    windows are *queued* on a side stream (ordered after the current stream), the
    current stream then waits for them on the GPU, and each window reaches the
    disk once its copies are done (:mod:`fastpersist.cudastage`, docs/gpu.md).
    With ``mode="lazy"`` CUDA tensors are copied to host memory at call time.

``mode="lazy"``
    The call returns after planning, without copying the large tensors: a
    feeder thread then copies the file, window by window, from the live
    tensors into the same staging pool (CRC-32s computed during the copy) and
    each window is written as soon as it is full. For this to be safe, every
    optimizer whose ``step`` modifies those tensors must be under
    :func:`guard`: its step pre-hook makes sure pending lazy saves have
    consumed every tensor that step would modify (its parameters and its
    state) by copying, at full priority on the training's thread, whatever the
    feeder has not reached yet. A tensor counts as consumed once copied into
    the pool, not once on disk: the guard waits for a memory copy of the rest,
    not for the disk (with a pool smaller than the state it also waits for
    windows to drain). The save decides tensor by tensor: bytes inside a
    parameter or state tensor of a guarded optimizer, from 256 KiB up, are read
    live by the feeder; everything else (buffers that ``forward`` mutates such
    as BatchNorm running statistics, counters, small tensors, tensors of
    unguarded optimizers, the pickle) is copied at call time into private
    memory (at most ``async_staging_limit`` bytes, else ``LazySaveError``).
    With no optimizer guarded, ``lazy`` refuses (``LazySaveError``) instead of
    risking a torn checkpoint. The guard trusts that a guarded optimizer's
    tensors change only inside its ``step``. (``save_async(group=...)`` with
    ``lazy`` still writes each rank's slice straight from the live tensors and
    its guard waits for that write.)

Background priority: the background copies and writes run on a native handle of
their own whose threads run at the nice value ``Config.async_nice`` (``FASTPERSIST_ASYNC_NICE``, 0-19,
default 0: same priority as the training); copies made inside the call or inside
the guard (the training waits for them) use the ordinary full-priority handle.
A higher value lets CPU-bound training take the cores first; the save then
progresses in the gaps, and a lazy save's guard finishes the copy at full speed.

Commit and errors: the file appears under ``path`` only when complete (temporary
file, fsync, rename, directory fsync, as ``fastpersist.save``); a failed save
removes its temporary file and leaves the previous checkpoint intact. Its error is
raised by ``SaveFuture.wait()``/``exception()``, or else by the next
``save_async()`` or ``wait_all()``. At interpreter exit pending saves are finished;
an error nobody collected is printed on stderr and the process exits with status 1
(as with an uncaught exception; :mod:`fastpersist.bgjobs` keeps the saves and their errors). (``os._exit`` and fatal
signals skip this: the previous checkpoint then stays.) A failed save stops its
background work (CRC thread, writes in flight) before its error is reported, and no
thread takes the GIL back from a native call once the interpreter's exit has begun
(it waits there until the process ends: ``native/bindings/module.cpp``).

Pickling (the layout plan) runs on the caller's thread at call time, with the
process's cyclic GC paused only for that planning. Saves queue in call order.

Collective async saves (``save_async(obj, path, group=g)``)
    Every rank of ``g`` calls it with the same object, in the same order relative to
    its other collective calls (as for ``fastpersist.save(..., group=g)``). The file is
    the one ``fastpersist.save(obj, path, group=g)`` writes: byte-identical to a
    1-rank save, each rank writing its own slice. At call time, on the caller's
    thread, the ranks agree on the plan and on who shares the target, the write
    group leader creates the temporary file (collectives on a gloo side group, as the
    blocking collective save), and each rank captures *its slice only*: ``snapshot``
    copies it into the staging pool (CRC-32s computed during the copy) and starts its
    writes; ``lazy`` writes it from the live tensors under the guards, its CRC-32s
    computed at call time from the bytes the write will read. Errors up to here are
    raised by ``save_async`` on every rank (nothing written). The rest runs on the
    finisher thread: the ranks exchange the partial CRC-32s, each fills the CRC fields
    of its slice once its writes are done and fsyncs, and the write group leaders
    commit once every rank reported success. Those exchanges go through the process
    group's rendezvous store, never through collectives: the caller's thread is
    meanwhile free to run collectives of its own (training's all-reduces) on any
    group, and collectives issued from two threads on one group can pair up
    differently on different ranks and deadlock. A failure on any rank (I/O error,
    killed rank, ``Config.dist_timeout`` passed) fails every rank's future with the
    same :class:`~fastpersist.distributed.DistributedCheckpointError` (a
    ``DistributedTimeoutError`` naming the missing ranks), the temporary file is
    removed and the previous checkpoint stays. ``wait()``, ``wait_all()`` and the
    exit handling are those of 1-rank saves; at exit every rank waits for its pending
    collective saves, which need the other ranks alive (a rank gone makes them fail
    after the timeout, printed on stderr). Objects only torch's writer can lay out
    are saved at call time (the future is done on return).
"""

from __future__ import annotations

import atexit
import io
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any, Optional, Union

import torch

from fastpersist import _sys, asyncstage, bgjobs, cudastage, handles, objectstore, pending, s3collective, s3tier
from fastpersist import config as config_mod
from fastpersist import collectivecommit, collectiveplan, coordinator
from fastpersist import io as fpio
from fastpersist._inputs import is_path
from fastpersist.asyncstage import (
    BackgroundCrc,
    LazyFeed,
    copy_private,
    optimizer_ranges,
    owner_of,
    snapshot_plan,
)
from fastpersist.commit import (
    clean_stale_temps,
    fsync_dir_after_rename,
    fsync_path,
    keep_mode,
    remove_quietly,
    resolve_target,
    temp_path_for,
)
from fastpersist.errors import DirectorySyncError, UnsupportedLayoutError
from fastpersist.formats import registry, split
from fastpersist.plan import WritePlan

log = logging.getLogger(__name__)

__all__ = ["LazySaveError", "SaveFuture", "guard", "pending_paths", "save_async", "wait_all", "wait_for_dir",
           "wait_for_path"]

MODES = ("snapshot", "lazy")
#: Lazy saves copy tensors smaller than this at call time, even guarded ones.
LAZY_COPY_BELOW = 256 << 10


class LazySaveError(RuntimeError):
    """A ``mode="lazy"`` save cannot be made safe (no guarded optimizer, or too much to copy)."""


class SaveFuture(bgjobs.JobFuture):
    """The outcome of one :func:`save_async`: ``wait(timeout)`` blocks until the file is
    committed (True; False when ``timeout`` seconds passed first) and raises the save's
    error if it failed; ``exception(timeout)`` returns it (counts as collected)."""

    def __init__(self, path: str, mode: str) -> None:
        super().__init__(_saves)
        self.path = path
        self.mode = mode
        #: Tiered mode (``s3_local_dir``): the drain of the local copy to the store.
        self.drain: Optional[s3tier.DrainFuture] = None

    @property
    def label(self) -> str:
        return self.path

    def describe(self) -> str:
        return f"asynchronous save of {self.path!r}"

    def wait_durable(self, timeout: Optional[float] = None) -> bool:
        """Block until the checkpoint is durable where it was sent: for a tiered save of
        an ``s3://`` URL, until the drain has confirmed the object in the store (the
        local copy is committed before); otherwise as :meth:`wait`. True when durable,
        False when ``timeout`` seconds passed first; raises the local save's or the
        drain's error."""
        if self.drain is None:
            return self.wait(timeout)
        try:
            return self.drain.wait(timeout)
        except BaseException as e:
            if e is self._exc:
                self._mark_collected()
            raise

    def durable(self) -> bool:
        """Whether :meth:`wait_durable` would return True at once."""
        if self.drain is None:
            return self._succeeded()
        return self.drain.durable()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._exc else "done")
        return f"SaveFuture({self.path!r}, mode={self.mode!r}, {state})"


class _Job:
    def __init__(self, future: SaveFuture, tmp: str, fsync: bool) -> None:
        self.future = future
        self.tmp = tmp
        self.fsync = fsync
        self.writes: list[Any] = []  # native Futures, file order
        self.keepalive: Any = None
        self.owners: list["weakref.ref[Any]"] = []  # guarded optimizers whose tensors are written live
        self.collective: Optional[Any] = None  # save_async(group=): the background commit (see _GroupCommit)
        self.feed: Optional[LazyFeed] = None  # 1-rank lazy saves: the background copy into the pool
        self.plan: Optional[WritePlan] = None  # with ``feed``: its patches are written at the end
        self.crc: Optional[BackgroundCrc] = None  # 1-rank snapshots: the CRC-32s, computed in the background
        self.fields: Optional[tuple[list[Any], int, int]] = None  # with ``crc``: (patches, nslots, file size)

    def consumed(self) -> None:
        """Wait (GIL released) until the writes no longer read their sources."""
        if self.feed is not None:
            self.feed.done.wait()
            return
        for f in self.writes:
            f.wait()

    def release(self) -> None:
        """The guard's wait: for a lazy save with a feed, copy what is left now instead of
        waiting for it to reach the disk; else as :meth:`consumed`."""
        if self.feed is not None:
            self.feed.release()
        else:
            self.consumed()


# ---- process-wide state (reset in a forked child) ---------------------------------

# The pending saves (_Job, call order) and their errors. _finish is looked up at each
# job (tests wrap it). _saves.lock also guards _io_handles.
_saves = bgjobs.JobBoard(lambda job: _finish(job), "fastpersist-async-save", bgjobs.Wording(
    noun="asynchronous save(s)", collect_by="SaveFuture.wait(), wait_all(), the next save",
    kept="the previous files at those paths are intact"))
_guards: "weakref.WeakKeyDictionary[Any, Guard]" = weakref.WeakKeyDictionary()


def _reset_in_child() -> None:
    """A forked child inherits none of the parent's native handles (rebuilt at first use)."""
    _io_handles.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)


def _submit(job: _Job) -> None:
    """Make ``job`` pending (readers and guards see it), then queue its commit."""
    _saves.add(job)
    _enqueue(job)


def _enqueue(job: _Job) -> None:
    _saves.start(job)


def before_blocking_save(final: str) -> None:
    """Called by every blocking save (``fastpersist.save``, collective or not, and the
    ``torch.save`` switch) before it writes ``final``.

    1. Waits for this process's pending async saves to the same file: they were
       called earlier, so their finisher would otherwise rename the older state over
       the newer file once the blocking save returned.
    2. Raises the first async save error nobody has collected yet (as ``save_async``
       does), so a failure surfaces at the next save instead of only at exit; nothing
       has been written when it raises.
    """
    same = [j.future for j in _saves.snapshot() if j.future.path == final]
    for f in same:
        f._event.wait()
    _saves.raise_uncollected()


# ---- pending paths: what other readers in this process must wait for ----------------


def _key(path: Any) -> str:
    """The comparable form of a final path (symbolic links of the directory resolved)."""
    return os.path.realpath(os.path.abspath(os.fsdecode(os.fspath(path))))


def pending_paths() -> list[str]:
    """The final paths of this process's async saves that have not finished yet
    (committed or failed), in call order. A path is listed from the moment
    :func:`save_async` is called until its file is in place (or the save failed)."""
    return [j.future.path for j in _saves.snapshot() if not j.future.done()]


def _pending_futures(match: Any) -> list[SaveFuture]:
    return [j.future for j in _saves.snapshot() if not j.future.done() and match(_key(j.future.path))]


def wait_for_path(path: Any, timeout: Optional[float] = None) -> bool:
    """Wait until no async save of this process is pending for ``path``.

    For code that reads, tests or lists ``path`` (``fastpersist.load``/``verify``/
    ``open`` call it, and the Lightning adapter calls it where Lightning checks
    a checkpoint path): once it returns, the file at ``path`` is the one the
    latest ``save_async`` wrote, or, if that save failed, what was there before.
    A failed save's error is not raised here: it stays for the saver's ``wait()``,
    the next save or :func:`wait_all`. Returns at once when nothing is pending for
    ``path``; False if ``timeout`` seconds passed first.
    """
    if not _saves.pending:
        return True
    key = _key(path)
    for f in _pending_futures(lambda k: k == key):
        if not f._event.wait(timeout):
            return False
    return True


def wait_for_dir(directory: Any, timeout: Optional[float] = None) -> bool:
    """Wait until no async save of this process is pending for a file in ``directory``
    or below it (for code that lists a checkpoint directory). As :func:`wait_for_path`."""
    if not _saves.pending:
        return True
    top = _key(directory).rstrip(os.sep) + os.sep
    for f in _pending_futures(lambda k: k.startswith(top)):
        if not f._event.wait(timeout):
            return False
    return True


_io_handles: dict[tuple, Any] = {}


def _io_handle(cfg: Any) -> Any:
    """The native handle whose threads write async saves in the background.

    A handle of its own (one per I/O setting and nice value), not the one of blocking
    saves and of the copies made inside calls: a psync write occupies a worker thread
    for as long as the disk takes, and a copy the training waits for (the snapshot
    inside the call, the lazy guard) must not queue behind it. With a nice value above
    0 (``Config.async_nice``, ``FASTPERSIST_ASYNC_NICE``) it is built on a short-lived thread that first lowered its
    own priority: Linux threads inherit
    their creator's nice value, so the handle's worker and I/O threads run at that
    priority and yield the CPUs to the training's threads, while copies made inside
    the ``save_async`` call (the training waits for them) stay on the ordinary,
    full-priority handle. (A forked child rebuilds a handle's threads at first use,
    at the priority of the thread using it.)
    """
    nice = cfg.async_nice
    kwargs = cfg.handle_kwargs(read=False)
    key = (tuple(sorted(kwargs.items())), nice, os.getpid())
    with _saves.lock:
        h = _io_handles.get(key)
    if h is not None:
        return h
    box: dict[str, Any] = {}

    def build() -> None:
        try:
            if nice:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except OSError as e:  # pragma: no cover - not allowed here: full priority then
            log.debug("fastpersist: cannot lower the async writer threads' priority (%s)", e)
        try:
            box["h"] = fpio.native_module().Handle(**kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["e"] = e

    t = threading.Thread(target=build, name="fastpersist-async-handle", daemon=True)
    t.start()
    t.join()
    if "e" in box:
        raise box["e"]
    with _saves.lock:
        h = _io_handles.setdefault(key, box["h"])
    return h


# ---- background commit ---------------------------------------------------------------


def _naming(final: str, tmp: str, e: BaseException) -> BaseException:
    if isinstance(e, OSError) and e.errno is not None and not isinstance(e, DirectorySyncError):
        err = type(e)(e.errno, f"{e.strerror or e} (async save of {final!r} via temporary file {tmp!r}; "
                      "the previous file at this path is untouched)", final)
        err.__cause__ = e
        return err
    return e


def _finish(job: _Job) -> None:
    fut = job.future
    exc: Optional[BaseException] = None
    if job.collective is not None:
        try:
            job.collective.run(job)
        except BaseException as e:  # noqa: BLE001 - the same error on every rank's future
            exc = e
        _settle(job, exc)
        return
    try:
        job.consumed()
        if job.feed is not None and job.feed.exc is not None:
            for f in job.writes:
                f.wait()
            raise job.feed.exc
        for f in job.writes:
            f.result()
        if job.crc is not None and job.fields is not None:  # the CRC fields, now that every CRC is known
            job.crc.done.wait()
            if job.crc.exc is not None:
                raise job.crc.exc
            patches, nslots, size = job.fields
            if patches:
                asyncstage.patch_slice(job.tmp, patches, job.crc.crcs(nslots), 0, size, False)
        job.keepalive = None
        if job.feed is not None and job.plan is not None:  # the CRC fields, now that every CRC is known
            asyncstage.patch_slice(job.tmp, job.plan.patches, job.feed.crcs(job.plan.nslots), 0, job.plan.file_size, False)
            job.plan = None
        if job.fsync:
            fsync_path(job.tmp)
        keep_mode(fut.path, job.tmp)
        _sys.rename(job.tmp, fut.path)
        if job.fsync:
            fsync_dir_after_rename(fut.path)  # its error says the new file is in place
    except BaseException as e:  # noqa: BLE001 - reported through the future
        _stop_background(job)
        remove_quietly(job.tmp)
        exc = _naming(fut.path, job.tmp, e)
    _settle(job, exc)


def _stop_background(job: _Job) -> None:
    """After a failure, before the temporary file goes and the error is reported: wait
    until nothing of the job runs any more. The other writes may still be in flight
    (one that opens the temporary file after its removal would create it again), and
    the CRC thread may still be reading the staging windows (for nothing: it is told
    to stop). A future that is done thus has no thread of its own left in native code,
    so the exit handling that waits for it leaves none there either (issue 33)."""
    if job.feed is not None:
        job.feed.done.wait()  # the feeder submits no more writes
    crc = job.crc if job.crc is not None else (job.feed.crc if job.feed is not None else None)
    if crc is not None:
        crc.abort()
    for f in list(job.writes):
        f.wait()  # GIL released
    if crc is not None:
        crc.done.wait()


def _settle(job: _Job, exc: Optional[BaseException]) -> None:
    job.keepalive = None
    job.collective = None
    _saves.settle(job, exc)


# ---- planning ----------------------------------------------------------------------


def _bytes_plan(obj: Any) -> WritePlan:
    """torch's own writer into memory: for objects the fast planner cannot lay out."""
    bio = io.BytesIO()
    torch.save(obj, bio)
    data = torch.frombuffer(bytearray(bio.getbuffer()), dtype=torch.uint8)
    n = data.numel()
    return WritePlan(extents=[(0, data.data_ptr(), n, -1)] if n else [], patches=[], nslots=0,
                     file_size=n, keepalive=[data])


def _plan(obj: Any, final: str, fmt: str, align: int, cfg: Any, device_sources: Any = None,
          metadata: Optional[dict] = None) -> WritePlan:
    """The save's plan; ``device_sources`` (snapshots): CUDA storages recorded, not
    copied, for :func:`fastpersist.cudastage.stream_plan` (see docs/gpu.md)."""
    plan = registry.FORMATS[fmt].plan
    assert plan is not None
    try:
        return plan(obj, align, cfg, metadata=metadata, device_sources=device_sources, target=final)
    except UnsupportedLayoutError as e:  # torch's format only
        log.debug("fast torch layout not possible for %s (%s); pickling with torch's writer", final, e)
        return _bytes_plan(obj)


def _lazy_split(plan: WritePlan, limit: int, final: str) -> tuple[Any, list[Any]]:
    """Which extents a lazy save writes live; returns (keep predicate, owning optimizers)."""
    optimizers = [o for o in list(_guards.keys()) if _guards.get(o) is not None]
    if not optimizers:
        raise LazySaveError(
            f"save_async({final!r}, mode='lazy') needs fastpersist.guard(optimizer) on the optimizer(s) "
            "whose step modifies the saved tensors, so that step waits until the save has read them; "
            "none is registered. Call fastpersist.guard(optimizer) once after creating it, or use mode='snapshot'."
        )
    starts, ranges = optimizer_ranges(optimizers)
    owners: set[int] = set()

    def keep(e: tuple[int, int, int, int]) -> bool:
        if e[2] < LAZY_COPY_BELOW:
            return False
        i = owner_of(starts, ranges, e[1], e[2])
        if i is None:
            return False
        owners.add(i)
        return True

    copied = sum(e[2] for e in plan.extents if not keep(e))
    if copied > limit:
        raise LazySaveError(
            f"save_async({final!r}, mode='lazy') would copy {copied} bytes at call time (tensors no guarded "
            f"optimizer owns: buffers, frozen weights, tensors of unguarded optimizers), more than "
            f"async_staging_limit={limit}; guard the optimizer that owns them, raise the limit, or use mode='snapshot'"
        )
    return keep, [weakref.ref(optimizers[i]) for i in sorted(owners)]


# ---- public API ----------------------------------------------------------------------

PathLike = Union[str, "os.PathLike[str]"]


def save_async(
    obj: Any,
    path: PathLike,
    *,
    mode: str = "snapshot",
    config: Any = None,
    format: Optional[str] = None,
    group: Any = None,
    metadata: Optional[dict] = None,
) -> SaveFuture:
    """Save ``obj`` to ``path`` like :func:`fastpersist.save`, in the background.

    With ``group`` (a ``torch.distributed`` process group), every rank of the group
    calls it with the same object, in the same order as its other collective calls:
    the ranks write one file together as ``fastpersist.save(obj, path, group=group)``
    does, and each rank's future completes when the group's commit is done (see
    "Collective async saves" in the module docstring).

    Returns once the state is captured (see the module docstring for ``mode``):
    the file will hold exactly the bytes of ``obj`` at this moment. Raises the
    error of an earlier async save that nobody collected, before starting.
    ``metadata``: for ``.safetensors`` files, as :func:`fastpersist.save`'s.

    Raises:
        LazySaveError: ``mode="lazy"`` without a :func:`guard`-ed optimizer, or
            with more than ``async_staging_limit`` bytes to copy.
        ValueError, TypeError: bad arguments, as :func:`fastpersist.save`.
        fastpersist.distributed.DistributedCheckpointError: with ``group``, a rank
            failed before the state was captured (planning, different states,
            no guard for ``lazy``...), raised on every rank; nothing was written.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if not is_path(path):
        raise TypeError(f"fastpersist.save_async writes to a file path (str or os.PathLike), got {type(path).__name__}")
    cfg = config_mod.resolve(config)
    if metadata is not None and (group is not None or registry.format_for(os.fspath(path), format).name != "safetensors"):
        raise TypeError("metadata= is for safetensors files saved without group= (as fastpersist.save)")
    _saves.finish_in_multiprocessing_children()  # a fork child of multiprocessing skips atexit
    if objectstore.is_s3_url(path):
        if group is not None:
            import torch.distributed as dist

            coordinator.check_group(group)
            if dist.get_world_size(group) > 1:  # collective saves to object storage go direct
                return _save_async_s3_group(obj, path, mode, cfg, format, group)
        if s3tier.enabled(cfg):
            return _save_async_tiered(obj, path, mode, cfg, format, metadata)
        return _save_async_s3(obj, path, mode, cfg, format, metadata)
    if group is not None:
        import torch.distributed as dist

        coordinator.check_group(group)
        if dist.get_world_size(group) > 1:
            return _save_async_group(obj, path, mode, cfg, format, group)
    _saves.raise_uncollected()
    final = resolve_target(path)
    fmt = registry.format_for(final, format).name
    if mode == "lazy" and not list(_guards.keys()):
        _lazy_split(WritePlan([], [], 0, 0), cfg.async_staging_limit, final)  # raises: no guard
    align = handles.alignment_for(os.path.dirname(final))
    handle = handles.handle_for(cfg)  # copies inside the call: full priority
    writer = _io_handle(cfg)  # background writes
    fut = SaveFuture(final, mode)
    with asyncstage.capture_lock():
        # snapshot: CUDA storages become device sources, D2H-copied through the pool
        # (fastpersist.cudastage); lazy: staged to host memory at planning (= call) time
        device = cudastage.is_cuda_storage if mode == "snapshot" else None
        plan = _plan(obj, final, fmt, align, cfg, device, metadata)  # GC paused inside, restored on return
        if mode == "lazy":
            keep, owners = _lazy_split(plan, cfg.async_staging_limit, final)
            for j in _saves.snapshot():  # a lazy save queues behind earlier saves (their captures finish first)
                j.release()
        clean_stale_temps(os.path.dirname(final))
        tmp = temp_path_for(final)
        job = _Job(fut, tmp, cfg.fsync)
        try:
            os.close(_sys.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666))
            if mode == "snapshot" and cudastage.device_sources_of(plan) is not None:
                pool = asyncstage.shared_pool(cfg.async_staging_limit)
                streamed, job.crc = cudastage.stream_plan(
                    plan, pool, handle, lambda off, ptr, n: writer.write_async(tmp, [(off, ptr, n, -1)], truncate=False)
                )
                job.writes = [streamed]
                job.fields = (list(plan.patches), plan.nslots, plan.file_size)
                job.keepalive = pool
            elif mode == "snapshot":
                pool = asyncstage.shared_pool(cfg.async_staging_limit)
                job.writes, job.crc = snapshot_plan(
                    plan, pool, handle, lambda off, ptr, n: writer.write_async(tmp, [(off, ptr, n, -1)], truncate=False)
                )
                job.fields = (list(plan.patches), plan.nslots, plan.file_size)
                job.keepalive = pool
            else:
                extents, private, _n = copy_private(plan, handle, keep)
                job.owners = owners
                pool = asyncstage.shared_pool(cfg.async_staging_limit)
                feed = LazyFeed(extents, pool, writer, handle,
                                lambda off, ptr, n: writer.write_async(tmp, [(off, ptr, n, -1)], truncate=False))
                job.feed, job.plan = feed, plan
                job.writes = feed.futures  # filled as the feed goes
                job.keepalive = (plan, private, obj, pool)
                feed.start()
        except BaseException as e:
            for f in job.writes:
                f.wait()
            remove_quietly(tmp)
            raise _naming(final, tmp, e) from e
        _submit(job)
    del plan
    return fut


class _GroupCommit:
    """The background part of one ``save_async(group=...)`` on one rank (finisher thread).

    Exchanges go through the rendezvous store only (``coordinator.StoreCoordinator``):
    the finisher thread must not run collectives on a process group the caller's thread
    may be using at the same moment (their order would differ between ranks and the
    collectives would pair up wrongly or hang). Steps, each ending with every rank's
    status: ``crc`` (the capture's outcome and the slice's partial CRC-32s), ``write``
    (the slice is on disk with its CRC fields, fsynced), then the commit of
    ``collectivecommit.commit_agreed``. Any rank's failure raises the same
    :class:`~fastpersist.distributed.DistributedCheckpointError` on every rank.
    """

    def __init__(self, co: Any, agreed: Any, lo: int, hi: int, tmp: str, temps: list[Any], cfg: Any) -> None:
        self.co = co
        self.agreed = agreed
        self.lo, self.hi = lo, hi
        self.tmp = tmp
        self.temps = temps
        self.cfg = cfg
        self.partial: Optional[dict[int, tuple[int, int]]] = None
        self.local: Optional[BaseException] = None

    def run(self, job: _Job) -> None:
        co, agreed = self.co, self.agreed
        plan = agreed.layout.plan
        loc = coordinator.Local()
        loc.exc = self.local
        try:
            info = co.gather("crc", (loc.status, self.partial))
            co.check("crc", [v[0] for v in info], local=loc.exc, after="Nothing was written under the final name")
            crcs = split.combine_crcs([info[r][1] for r in agreed.mygroup], plan.nslots)

            def write() -> None:
                try:
                    job.consumed()
                    for f in job.writes:
                        f.result()
                    asyncstage.patch_slice(self.tmp, plan.patches, crcs, self.lo, self.hi, self.cfg.fsync)
                except OSError as e:
                    raise _naming(agreed.final, self.tmp, e) from e

            loc.run(write)
            job.keepalive = None
            wrote = co.gather("write", loc.status)
            co.check("write", wrote, local=loc.exc,
                     after="The temporary files were removed; the previous file at the path is untouched")
            collectivecommit.commit_agreed(co, agreed, self.tmp, self.cfg, loc)
        except BaseException:
            for f in job.writes:  # nothing may read the sources or the staging windows any more
                f.wait()
            for t in self.temps:
                collectiveplan.remove_temp(t)
            raise
        finally:
            co.finish()


def _save_async_group(obj: Any, path: PathLike, mode: str, cfg: Any, format: Optional[str], group: Any) -> SaveFuture:
    """``save_async(..., group=group)`` with more than one rank (see the module docstring)."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    what = f"fastpersist.save_async({os.fsdecode(os.fspath(path))!r}, mode={mode!r}) over {size} ranks"
    co = coordinator.Coordinator(group, cfg.dist_timeout, what)  # the caller's thread: the collective steps
    bg = coordinator.StoreCoordinator(group, cfg.dist_timeout, what)  # the finisher thread: store exchanges only
    loc = coordinator.Local()
    try:
        _saves.raise_uncollected()  # reported at the plan step, so that every rank stops there
    except BaseException as e:  # noqa: BLE001
        loc.exc = e
    if bg.store is None:
        loc.run(_no_store)
    if mode == "lazy" and not list(_guards.keys()):
        loc.run(lambda: _lazy_split(WritePlan([], [], 0, 0), cfg.async_staging_limit, os.fspath(path)))
    try:
        with asyncstage.capture_lock():
            agreed = collectiveplan.agree(co, obj, path, cfg, format, loc)  # raises on every rank; nothing written
            fut = SaveFuture(agreed.final, mode)
            leader = agreed.leader == co.rank
            if agreed.fallback:  # torch's writer: the group leaders save at call time
                log.debug("%s: the object needs torch's writer; saved at call time", what)
                collectivecommit.save_fallback(co, obj, agreed.final, cfg, agreed.fmt, leader, loc)
                fut._event.set()
                return fut
            plan = agreed.layout.plan
            lo, hi = agreed.bounds(co.rank)
            extents = split.clip(plan.extents, lo, hi)
            tmp = loc.run(lambda: collectivecommit.create_temp(agreed.final, plan.file_size)) if leader else None
            try:
                created = co.gather("create", (loc.status, tmp))
            except BaseException:  # a rank died: nobody else knows this leader's file
                collectiveplan.remove_temp(tmp)
                raise
            temps = [created[g[0]][1] for g in agreed.groups]
            tmp = created[agreed.leader][1]
            try:
                co.check("create", [v[0] for v in created], local=loc.exc, after="Nothing was written")
            except BaseException:
                for t in temps:
                    collectiveplan.remove_temp(t)
                raise
            handle = handles.handle_for(cfg)  # copies inside the call: full priority
            writer = _io_handle(cfg)  # background writes
            job = _Job(fut, tmp, cfg.fsync)
            commit = _GroupCommit(bg, agreed, lo, hi, tmp, temps, cfg)

            def capture() -> None:
                if mode == "snapshot":
                    pool = asyncstage.shared_pool(cfg.async_staging_limit)
                    job.keepalive = pool
                    commit.partial, job.writes = asyncstage.snapshot_slice(
                        extents, pool, handle,
                        lambda off, ptr, n: writer.write_async(tmp, [(off, ptr, n, -1)], truncate=False))
                else:
                    mine = WritePlan(extents, [], 0, plan.file_size)
                    keep, owners = _lazy_split(mine, cfg.async_staging_limit, agreed.final)
                    for j in _saves.snapshot():  # a lazy save queues behind earlier saves
                        j.consumed()
                    out, private, _n = copy_private(mine, handle, keep)
                    commit.partial = split.partial_crcs(handle, out)  # the bytes the write will read
                    job.owners = owners
                    job.keepalive = (plan, private, obj)
                    plain = [(o, p, n, -1) for o, p, n, _slot in out]  # CRCs: computed above, patched later
                    job.writes = [writer.write_async(tmp, plain, [], 0, truncate=False)] if plain else []

            loc.run(capture)  # a failure here reaches every rank's future through the first exchange
            commit.local = loc.exc
            job.collective = commit
            _submit(job)
            return fut
    finally:
        co.finish()


def _no_store() -> None:
    raise RuntimeError(
        "save_async(group=...) needs torch.distributed's rendezvous store (the default process group's), "
        "which this torch does not expose (fastpersist._compat.report()['default_store']); "
        "use fastpersist.save(obj, path, group=...) instead")


class _S3Upload:
    """The background half of an async save to an ``s3://`` URL: the upload of the parts
    staged at the call (run by the finisher, as a group save's commit is)."""

    def __init__(self, url: Any, parts: list[Any], cfg: Any) -> None:
        self.url = url
        self.parts = parts
        self.cfg = cfg

    def run(self, job: _Job) -> None:
        parts, self.parts = self.parts, []
        objectstore.upload_staged(self.url, parts, config=self.cfg)


def _save_async_s3(obj: Any, path: PathLike, mode: str, cfg: Any, format: Optional[str],
                   metadata: Optional[dict]) -> SaveFuture:
    """An async save to an object store: the whole file staged in memory at the call
    (its bytes are those of this moment, in either mode), uploaded in the background as
    one multipart upload; the object appears when the upload completes."""
    _saves.raise_uncollected()
    name = os.fspath(path)
    fut = SaveFuture(name, mode)
    with asyncstage.capture_lock():
        url, parts = objectstore.stage(obj, path, config=cfg, format=format, metadata=metadata)
    job = _Job(fut, "", cfg.fsync)
    job.collective = _S3Upload(url, parts, cfg)
    _submit(job)
    return fut


def _save_async_tiered(obj: Any, path: PathLike, mode: str, cfg: Any, format: Optional[str],
                       metadata: Optional[dict]) -> SaveFuture:
    """An async save to an ``s3://`` URL in the tiered mode: the ordinary async save of
    the local copy (the future's path), its drain queued behind its commit
    (``SaveFuture.drain``)."""
    t = s3tier.begin(path, cfg)
    try:
        fut = save_async(obj, t.local, mode=mode, config=cfg, format=format, metadata=metadata)
    except BaseException as e:
        s3tier.abandon(t)
        err = s3tier.local_error(e, t)
        if err is e:
            raise
        raise err from e

    def committed() -> None:  # the local save's outcome, without collecting its error (its future reports it)
        fut._event.wait()
        if fut._exc is not None:
            raise fut._exc

    fut.drain = s3tier.enqueue(t, committed)
    return fut


def _save_async_s3_group(obj: Any, path: PathLike, mode: str, cfg: Any, format: Optional[str],
                         group: Any) -> SaveFuture:
    """``save_async(url, group=group)`` with more than one rank: agreement, the upload's
    creation and the copy of this rank's parts happen at the call (collectives on the
    caller's thread; every rank raises the same error there); the parts' upload, the
    exchange of their ETags and the completion in the background
    (:mod:`fastpersist.s3collective`)."""
    fut = SaveFuture(os.fspath(path), mode)
    with asyncstage.capture_lock():  # an uncollected async error is reported to every rank at the plan step
        upload = s3collective.start_async(obj, path, group=group, config=cfg, format=format, before=_saves.raise_uncollected)
    if upload is None:  # torch's writer: uploaded at the call
        fut._event.set()
        return fut
    job = _Job(fut, "", cfg.fsync)
    job.collective = upload
    _submit(job)
    return fut


def wait_all(timeout: Optional[float] = None) -> bool:
    """Wait for every pending async save; raise the first error not yet collected.
    Returns False if ``timeout`` seconds passed first."""
    for j in _saves.snapshot():
        if not j.future._event.wait(timeout):
            return False
    _saves.raise_uncollected()
    return True


class Guard:
    """What :func:`guard` returns: ``remove()`` (or use as a context manager) to unhook."""

    def __init__(self, optimizer: Any) -> None:
        self._opt = weakref.ref(optimizer)
        #: Seconds this optimizer's ``step`` spent blocked in the guard so far (all saves).
        self.waited_s = 0.0
        #: How many ``step`` calls found a pending lazy save to wait for.
        self.waits = 0
        self._hook = optimizer.register_step_pre_hook(_pre_step)

    def remove(self) -> None:
        self._hook.remove()
        opt = self._opt()
        if opt is not None and _guards.get(opt) is self:
            del _guards[opt]

    def __enter__(self) -> "Guard":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _pre_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    jobs = [j for j in _saves.snapshot() if any(r() is optimizer for r in j.owners)]
    if not jobs:
        return None
    t0 = time.perf_counter()
    for j in jobs:
        j.release()  # GIL released
    g = _guards.get(optimizer)
    if g is not None:
        g.waited_s += time.perf_counter() - t0
        g.waits += 1
    return None


def guard(optimizer: Any) -> Guard:
    """Let ``save_async(..., mode="lazy")`` write ``optimizer``'s tensors live.

    Registers a ``register_step_pre_hook`` on ``optimizer``: each ``step()`` first
    waits until every pending lazy save has consumed the parameters and state
    tensors of this optimizer (it does not wait for fsync or the rename). Call
    once per optimizer; calling again returns the same guard.
    """
    g = _guards.get(optimizer)
    if g is None:
        g = _guards[optimizer] = Guard(optimizer)
    return g


# At exit pending saves are finished and the errors nobody collected printed, with exit
# status 1 (bgjobs.JobBoard.finish_at_exit). An atexit hook: it runs before the native
# exit gate closes (registered when the extension was loaded, earlier).
atexit.register(_saves.finish_at_exit, True)


def _finish_uploads_at_shutdown() -> None:
    """Async saves to ``s3://`` URLs upload on ThreadPoolExecutors, which refuse new work
    once the interpreter's shutdown has begun: wait for them in that earlier phase."""
    uploads = [j.future for j in _saves.snapshot()
               if j.collective is not None and not isinstance(j.collective, _GroupCommit)]
    try:
        for f in uploads:
            f._event.wait()
    except KeyboardInterrupt:  # the atexit hook reports what is left
        pass


bgjobs.at_shutdown(_finish_uploads_at_shutdown)


# Readers and blocking saves below this layer wait for these saves through fastpersist.pending.
pending.register(sys.modules[__name__])  # type: ignore[arg-type]
