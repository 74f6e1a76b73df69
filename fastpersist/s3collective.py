"""Collective saves and loads of replicated state to and from ``s3://`` URLs.

``fastpersist.save(obj, "s3://bucket/key", group=g)`` (and ``save_async``) is one S3
multipart upload written by every rank of ``g`` together, the object byte-identical to
what ``fastpersist.save(obj, "s3://bucket/key")`` uploads from one process (and to a
local save's file):

1. **Plan and agree** (as :mod:`fastpersist.distributed`): every rank plans the object
   (same bytes and alignment as a direct-mode upload), hashes the plan and the CRC-32 of
   every tensor's bytes, and the ranks exchange the hashes and the URL. Different URLs,
   layouts or tensor values raise the same error on every rank before any request
   (:class:`~fastpersist.distributed.ReplicasDifferError` for different states). The
   agreed CRC-32s fill the file's CRC fields, so every part can be uploaded as soon as it
   is copied.
2. **Create.** Rank 0 creates the multipart upload (after listing the key's incomplete
   uploads left by killed saves) and sends its ``UploadId`` to the group.
3. **Parts.** The file is cut into parts of ``s3_part_size`` (S3's rules:
   :func:`fastpersist.s3upload.part_size`), and the parts into one contiguous run per
   rank: rank ``r`` uploads parts ``[r * n // size, (r + 1) * n // size)``, so every
   boundary between ranks is a part boundary and every part but the last is at least
   5 MiB. Each rank copies its parts from its own tensors and uploads them,
   ``s3_threads`` in flight, and reports its parts' ETags.
4. **Commit.** When every rank reported success, rank 0 completes the upload with all
   ETags: the object appears under its key whole. Then it aborts the stale uploads it
   listed in step 2.

Any rank's failure (an exception, a request that failed after retries, a rank that
died: the exchanges' timeouts and verdicts are :class:`~fastpersist.coordinator.Coordinator`'s)
raises :class:`~fastpersist.distributed.DistributedCheckpointError` on every rank, and
the upload is aborted (by rank 0; by the survivors when rank 0 is the rank that died):
no object appears, the previous object under the key is untouched, no parts stay.

A collective load (``load(url, group=g)``) has every rank fetch the whole object with
its own ranged GETs (docs/objectstore.md says why) and then compare the ETags they
read: ranks never return different versions of an object replaced meanwhile.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from typing import Any, Callable, Iterator, Optional

import torch.distributed as dist

from fastpersist import collectiveplan, handles, objectstore, pending, pipeline, s3client, s3upload
from fastpersist import config as config_mod
from fastpersist.coordinator import Coordinator, Local, StoreCoordinator, check_group, collective, operation_name
from fastpersist.errors import DistributedCheckpointError, ReplicasDifferError, UnsupportedLayoutError
from fastpersist.formats import registry, split
from fastpersist.plan import WritePlan, patch_bytes
from fastpersist.s3url import S3Url, parse

log = logging.getLogger("fastpersist.s3")

__all__ = ["GroupUpload", "load", "part_runs", "save", "start_async"]


def part_runs(nparts: int, size: int) -> list[tuple[int, int]]:
    """The 0-based part indices ``[a, b)`` each of ``size`` ranks uploads: contiguous,
    as even as possible, covering ``[0, nparts)`` (a rank may get none)."""
    return [(r * nparts // size, (r + 1) * nparts // size) for r in range(size)]


class _Agreed:
    """What the ranks agreed on: the URL, the plan and its CRC slots' values (None:
    the object needs torch's own writer, rank 0 uploads it alone)."""

    def __init__(self, url: S3Url, layout: Optional[split.Layout], crcs: Optional[list[int]]) -> None:
        self.url = url
        self.layout = layout
        self.crcs = crcs


def _plan(obj: Any, url: S3Url, cfg: Any, format: Optional[str]) -> tuple[Optional[split.Layout]]:
    fmt = registry.format_for(url.key, format)
    assert fmt.plan is not None
    try:
        return (split.Layout(fmt.plan(obj, objectstore.ALIGNMENT, cfg, target=str(url)), fmt.name),)
    except UnsupportedLayoutError as e:
        if fmt is not registry.TORCH:
            raise
        log.debug("fast torch layout not possible for %s (%s): rank 0 uploads torch's writer's bytes", url, e)
        return (None,)


def _agree(co: Coordinator, obj: Any, target: Any, cfg: Any, format: Optional[str], loc: Local) -> _Agreed:
    """Step 1 of the module docstring; raises on every rank (nothing uploaded)."""
    url = loc.run(lambda: parse(target))
    planned = loc.run(lambda: _plan(obj, url, cfg, format)) if url is not None else None
    layout = planned[0] if planned else None
    digest = loc.run(lambda: split.plan_digest(layout)) if layout is not None else None
    values = loc.run(lambda: collectiveplan.value_crcs(layout, cfg)) if layout is not None else None
    vdigest = collectiveplan.values_digest(values) if values is not None else None
    info = co.gather("plan", (loc.status, planned is not None and layout is None, digest, str(url), vdigest))
    co.check("plan", [v[0] for v in info], local=loc.exc, after="Nothing was uploaded")
    urls = [v[3] for v in info]
    if len(set(urls)) > 1:
        each = "; ".join(f"{co.name(r)}: {u!r}" for r, u in enumerate(urls))
        raise DistributedCheckpointError(
            f"{co.what}: the ranks passed different URLs, nothing was uploaded ({each}). A collective save writes "
            "one object that every rank names; save without group= to write one object per rank",
            {r: f"URL {u!r}" for r, u in enumerate(urls) if u != urls[0]})
    fallback = [v[1] for v in info]
    why = ""
    if any(fallback) and not all(fallback):
        bad = [co.name(r) for r, f in enumerate(fallback) if f]
        why = (f"{', '.join(bad)} cannot lay the object out for a split upload (torch's writer needed) and the "
               "others can")
    if why or len({v[2] for v in info}) > 1:
        records = co.gather("plan-records", split.plan_records(layout) if layout is not None else [])
        why = why or split.first_difference(records) or "the plans' digests differ"
        raise ReplicasDifferError(
            f"{co.what}: the ranks do not hold the same state, nothing was uploaded: {why}. A replicated save needs "
            "every rank to pass the same object (same keys, shapes, dtypes and Python values)", why)
    if len({v[4] for v in info}) > 1:
        every = co.gather("values", values)
        assert layout is not None
        why = collectiveplan.first_value_difference(co, obj, layout, every)
        raise ReplicasDifferError(
            f"{co.what}: the ranks hold the same layout but different tensor values, nothing was uploaded: {why}. "
            "A replicated save writes one state; make the replicas equal (e.g. broadcast from rank 0) or save from "
            "one rank without group=", why)
    assert url is not None
    crcs = collectiveplan.slot_crcs(layout, values) if layout is not None and values is not None else None
    return _Agreed(url, layout, crcs)


def _address(buf: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf)) if buf else 0


def _stage_part(plan: WritePlan, crcs: list[int], index: int, psize: int, handle: Any) -> s3upload.StagedPart:
    """Part ``index`` (0-based) copied from the plan's sources, its CRC fields filled
    with the agreed CRC-32s."""
    lo = index * psize
    hi = min(plan.file_size, lo + psize)
    buf = bytearray(hi - lo)
    base = _address(buf)
    ranges = [(base + off - lo, ptr, n) for off, ptr, n, _slot in split.clip(plan.extents, lo, hi) if n]
    if ranges:
        handle.copy_ranges(ranges, False)  # GIL released
    for off, slot, kind in plan.patches:
        field = patch_bytes(kind, crcs[slot])
        a, b = max(off, lo), min(off + len(field), hi)
        if a < b:
            buf[a - lo:b - lo] = field[a - off:b - off]
    return s3upload.StagedPart(index + 1, lo, buf)


class GroupUpload:
    """One rank's share of a collective upload (steps 2-4 of the module docstring).

    Built on the caller's thread (agreement and creation are collective); its parts are
    then sent by :meth:`send` (blocking save) or staged at once by :meth:`stage` and
    sent in the background by :meth:`run` (``save_async(group=)``, whose exchanges go
    through the rendezvous store: ``bg``)."""

    def __init__(self, co: Coordinator, agreed: _Agreed, cfg: Any) -> None:
        self.co = co
        self.agreed = agreed
        self.cfg = cfg
        self.url = agreed.url
        n = cfg.s3_threads
        self.client = s3client.client(n + 2, cfg.s3_timeout)
        self.up = s3upload.MultipartUpload(self.client, self.url, n)
        assert agreed.layout is not None and agreed.crcs is not None
        self.plan = agreed.layout.plan
        self.psize = s3upload.part_size(self.plan.file_size, cfg.s3_part_size)
        nparts = max(1, -(-self.plan.file_size // self.psize))
        self.first, self.end = part_runs(nparts, co.size)[co.rank]
        self.nparts = nparts
        self.stale: list[str] = []
        self.completed = False
        self.staged: list[s3upload.StagedPart] = []
        self.bg: Optional[Coordinator] = None

    @property
    def leader(self) -> bool:
        return self.co.rank == 0

    def create(self, loc: Local) -> None:
        """Step 2 (collective): rank 0 creates the upload; every rank learns its id."""
        if self.leader:
            self.stale = s3upload.stale_uploads(self.client, self.url)
            loc.run(self.up.create)
        made = self.co.gather("create", (loc.status, self.up.upload_id))
        self.up.upload_id = made[0][1]
        self.co.check("create", [v[0] for v in made], local=loc.exc, after="Nothing was uploaded")

    def _parts(self) -> Any:
        handle = handles.handle_for(self.cfg)
        assert self.agreed.crcs is not None
        for i in range(self.first, self.end):
            yield lambda i=i: _stage_part(self.plan, self.agreed.crcs, i, self.psize, handle)

    def send(self) -> None:
        """Copy and upload this rank's parts (``s3_threads`` in flight); wait for them."""
        up = self.up
        for make in self._parts():
            up.take_slot()
            try:
                part = make()
            except BaseException:
                up.give_slot()
                raise
            up.submit(part, holds_slot=True)
        up.wait_parts()

    def stage(self) -> None:
        """Copy this rank's parts into memory now (an async save's capture)."""
        self.staged = [make() for make in self._parts()]

    def send_staged(self) -> None:
        up = self.up
        parts, self.staged = self.staged, []
        for part in parts:
            up.take_slot()
            up.submit(part, holds_slot=True)
        up.wait_parts()

    def finish(self, co: Coordinator, loc: Local) -> None:
        """Steps 3-4 after this rank's parts went: exchange the ETags, rank 0 completes."""
        if loc.exc is not None:
            self.up.stop()
        sent = co.gather("parts", (loc.status, None if loc.exc else dict(self.up.etags)))
        co.check("parts", [v[0] for v in sent], local=loc.exc,
                 after="The multipart upload was aborted; the previous object under the key is untouched")
        if self.leader:
            etags: dict[int, str] = {}
            for v in sent:
                etags.update(v[1])
            if sorted(etags) != list(range(1, self.nparts + 1)):  # pragma: no cover - a bug of ours
                loc.run(lambda: _raise(AssertionError(f"parts {sorted(etags)} of {self.nparts} were uploaded")))
            else:
                self.up.etags = etags
                loc.run(self.up.complete)
                self.completed = loc.exc is None
        committed = co.gather("commit", loc.status)
        co.check("commit", committed, local=loc.exc,
                 after="The multipart upload was aborted; the previous object under the key is untouched")
        if self.leader:
            s3upload.abort_uploads(self.client, self.url, self.stale)

    def fail(self, exc: BaseException) -> None:
        """On any error: stop this rank's parts; rank 0 aborts the upload (the survivors
        do when rank 0 is missing). Never raises."""
        self.up.stop()
        self.staged = []
        if self.completed or self.up.upload_id is None:
            return
        missing = getattr(exc, "missing", None) or []
        if self.leader or 0 in missing:
            self.up.abort()

    @contextlib.contextmanager
    def aborted_on_error(self) -> Iterator[None]:
        """Around steps of this upload: an error in them fails the upload (:meth:`fail`:
        this rank's parts stopped, the upload aborted) before it propagates."""
        try:
            yield
        except BaseException as e:
            self.fail(e)
            raise

    def run(self, job: Any) -> None:
        """The background half of ``save_async(group=)``: send the staged parts, then
        exchange through the store (``bg``) and commit."""
        co = self.bg
        assert co is not None
        loc = Local()
        try:
            with self.aborted_on_error():
                loc.run(self.send_staged)
                self.finish(co, loc)
        finally:
            co.finish()


def _raise(e: BaseException) -> None:
    raise e


def save(obj: Any, target: Any, *, group: Any, config: Any = None, format: Optional[str] = None) -> None:
    """Collective :func:`fastpersist.save` to an ``s3://`` URL (see the module docstring)."""
    check_group(group)
    cfg = config_mod.resolve(config)
    if dist.get_world_size(group) == 1:
        pipeline.save(obj, target, config=cfg, format=format)
        return
    with collective("save", target, group, cfg.dist_timeout) as co:
        loc = Local()
        loc.run(lambda: pending.before_blocking_save(os.fspath(target)))
        agreed = _agree(co, obj, target, cfg, format, loc)
        if agreed.layout is None:
            _save_alone(co, obj, agreed.url, cfg, format, loc)
            return
        gu = GroupUpload(co, agreed, cfg)
        with gu.aborted_on_error():
            gu.create(loc)
            loc.run(gu.send)
            gu.finish(co, loc)


def _save_alone(co: Coordinator, obj: Any, url: S3Url, cfg: Any, format: Optional[str], loc: Local) -> None:
    """Objects only torch's writer can lay out: rank 0 uploads them alone."""
    if co.rank == 0:
        loc.run(lambda: objectstore.save(obj, url, config=cfg, format=format))
    co.check("commit", co.gather("commit", loc.status), local=loc.exc)


def start_async(obj: Any, target: Any, *, group: Any, config: Any = None, format: Optional[str] = None,
                before: Optional[Callable[[], None]] = None) -> Optional[GroupUpload]:
    """The call-time half of ``save_async(obj, url, group=group)``: agree, create the
    upload and copy this rank's parts into memory (the object may change afterwards).
    Returns the :class:`GroupUpload` whose :meth:`~GroupUpload.run` the async saves'
    background thread calls, or None when the object needed torch's writer and rank 0
    already uploaded it. Raises on every rank (nothing left behind) on failure, including
    an error ``before()`` raises on any rank (reported at the plan step)."""
    cfg = config_mod.resolve(config)
    what = operation_name("save_async", target, group)
    co = Coordinator(group, cfg.dist_timeout, what)  # the caller's thread: the collective steps
    bg = StoreCoordinator(group, cfg.dist_timeout, what)  # the background thread: store exchanges only
    try:
        loc = Local()
        if before is not None:
            loc.run(before)
        if bg.store is None:
            loc.run(lambda: _raise(RuntimeError(
                "save_async(group=...) needs torch.distributed's rendezvous store, which this torch does not "
                "expose; use fastpersist.save(obj, url, group=...) instead")))
        agreed = _agree(co, obj, target, cfg, format, loc)
        if agreed.layout is None:
            _save_alone(co, obj, agreed.url, cfg, format, loc)
            bg.finish()
            return None
        gu = GroupUpload(co, agreed, cfg)
        gu.bg = bg
        try:
            with gu.aborted_on_error():
                gu.create(loc)
                loc.run(gu.stage)
                staged = co.gather("stage", loc.status)
                co.check("stage", staged, local=loc.exc,
                         after="The multipart upload was aborted; the previous object under the key is untouched")
        except BaseException:
            bg.finish()
            raise
        return gu
    finally:
        co.finish()


def load(target: Any, map_location: Any = None, pickle_module: Any = None, *, group: Any,
         weights_only: Optional[bool] = None, mmap: Optional[bool] = None, config: Any = None,
         **pickle_load_args: Any) -> Any:
    """Collective :func:`fastpersist.load` of an ``s3://`` URL: every rank fetches and
    loads the object itself; the ranks then compare the ETags they read and raise
    :class:`~fastpersist.distributed.DistributedCheckpointError` on every rank if the
    object was replaced between their reads."""
    check_group(group)
    cfg = config_mod.resolve(config)
    if dist.get_world_size(group) == 1:
        return pipeline.load(target, map_location, pickle_module, weights_only=weights_only, mmap=mmap, config=cfg,
                             **pickle_load_args)
    with collective("load", target, group, cfg.dist_timeout) as co:
        loc = Local()

        def one() -> tuple[Any, str]:
            pending.wait_before_reading(target)
            req = registry.LoadRequest(target, map_location, pickle_module, weights_only, mmap, dict(pickle_load_args))
            return objectstore.load_with_etag(target, req, config=cfg)

        got = loc.run(one)
        info = co.gather("load", (loc.status, got[1] if got else None))
        co.check("load", [v[0] for v in info], local=loc.exc)
        etags = [v[1] for v in info]
        if len(set(etags)) > 1:
            each = ", ".join(f"{co.name(r)}: {e}" for r, e in enumerate(etags))
            raise DistributedCheckpointError(
                f"{co.what}: the object was replaced while the ranks were reading it (ETags {each}); load it again")
        assert got is not None
        return got[0]
