"""The commit of a save to object storage: one S3 multipart upload of a planned file.

The file's bytes come from the format's :class:`~fastpersist.plan.WritePlan`, the same
plan a local save writes: its byte range is cut into parts (:func:`part_size`), each
part copied from the plan's sources into a staging buffer of its own on the native
handle's threads (CRC-32s of the payload pieces computed during the copy, GIL
released), and uploaded while later parts are being staged (``threads`` uploads in
flight, at most ``threads + 2`` staged parts in memory). A part holding a CRC field
whose payload comes later (a safetensors header) waits, staged, until those bytes have
been copied; then its fields are filled in and it goes too.

Commit: the object appears under its key only when ``CompleteMultipartUpload``
succeeds. On any error (a request that failed after botocore's retries, an interrupt,
an error of ours) the upload is aborted and the previous object under the key stays.
A process killed mid-upload leaves an incomplete multipart upload (never an object):
the next successful save to the same key aborts the uploads of that key that existed
when it started (:func:`stale_uploads`, :func:`abort_uploads`: one writer per key at a
time, as for a local file); a bucket lifecycle rule
(``AbortIncompleteMultipartUpload``) cleans the rest (docs/objectstore.md).
"""

from __future__ import annotations

import base64
import ctypes
import hashlib
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

from fastpersist import _native, s3client
from fastpersist.plan import WritePlan, patch_bytes
from fastpersist.s3url import S3Url

log = logging.getLogger("fastpersist.s3")

MiB = 1 << 20
#: S3's rules: every part but the last at least 5 MiB, at most 10,000 parts, 5 GiB each.
MIN_PART = 5 * MiB
MAX_PARTS = 10_000
MAX_PART = 5 << 30
#: The part size fastpersist prefers (docs/objectstore.md has the measurement).
DEFAULT_PART = 16 * MiB


def part_size(file_size: int, preferred: int = DEFAULT_PART) -> int:
    """The part size for a file of ``file_size`` bytes: ``preferred`` (at least 5 MiB),
    grown in whole MiB when the file would need more than 10,000 parts."""
    if file_size < 0:
        raise ValueError(f"file size must be >= 0, got {file_size}")
    size = max(MIN_PART, preferred)
    need = -(-file_size // MAX_PARTS)
    if need > size:
        size = -(-need // MiB) * MiB
    if size > MAX_PART:
        raise ValueError(f"a file of {file_size} bytes needs parts over S3's 5 GiB limit")
    return size


@dataclass
class StagedPart:
    """One part's bytes, copied from the plan."""

    number: int  # 1-based part number
    lo: int
    data: bytearray


def _address(buf: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf)) if buf else 0


class PartStager:
    """Cuts a plan into staged parts in file order, folding CRC-32s per slot, and fills
    a part's CRC fields once every payload byte of those fields' slots was copied."""

    def __init__(self, plan: WritePlan, psize: int, handle: Any) -> None:
        self.plan = plan
        self.psize = psize
        self.handle = handle
        self.nparts = max(1, -(-plan.file_size // psize))
        self.crc: dict[int, tuple[int, int]] = {}
        slot_end = [0] * plan.nslots
        for off, _ptr, n, slot in plan.extents:
            if slot >= 0 and n:
                slot_end[slot] = max(slot_end[slot], off + n)
        self.slot_end = slot_end
        self.patches: dict[int, list[tuple[int, int, int]]] = {}
        for off, slot, kind in plan.patches:
            width = len(patch_bytes(kind, 0))
            for p in range(off // psize, (off + width - 1) // psize + 1):
                self.patches.setdefault(p, []).append((off, slot, kind))
        self.copied = 0
        self._k = 0
        self._k_off = 0

    def need(self, index: int) -> int:
        """File offset up to which bytes must be copied before part ``index`` can go."""
        return max((self.slot_end[slot] for _o, slot, _k in self.patches.get(index, ())), default=0)

    def stage(self, index: int) -> StagedPart:
        """Copy part ``index`` (0-based, in order) from the plan's sources."""
        lo = index * self.psize
        hi = min(self.plan.file_size, lo + self.psize)
        buf = bytearray(hi - lo)
        base = _address(buf)
        ranges: list[tuple[int, int, int]] = []
        slots: list[tuple[int, int]] = []
        ext = self.plan.extents
        pos = lo
        while self._k < len(ext) and pos < hi:
            off, ptr, n, slot = ext[self._k]
            start = off + self._k_off
            if start != pos:
                raise ValueError(f"the plan has a gap or overlap at file offset {pos} (extent at {start})")
            take = min(n - self._k_off, hi - pos)
            if take:
                ranges.append((base + pos - lo, ptr + self._k_off, take))
                slots.append((slot, take))
            pos += take
            self._k_off += take
            if self._k_off == n:
                self._k, self._k_off = self._k + 1, 0
        if pos != hi:
            raise ValueError(f"the plan covers {pos} of the {hi} bytes of part {index + 1}")
        crcs = self.handle.copy_ranges(ranges, True) if ranges else []  # GIL released
        for (slot, n), c in zip(slots, crcs):
            if slot < 0:
                continue
            if slot in self.crc:
                prev, have = self.crc[slot]
                self.crc[slot] = (_native.crc32_combine(prev, c, n), have + n)
            else:
                self.crc[slot] = (c, n)
        self.copied = hi
        return StagedPart(index + 1, lo, buf)

    def ready(self, part: StagedPart) -> bool:
        return self.need(part.number - 1) <= self.copied

    def fill_crcs(self, part: StagedPart) -> None:
        """Write the CRC fields that fall in ``part`` (its slots are all copied)."""
        hi = part.lo + len(part.data)
        for off, slot, kind in self.patches.get(part.number - 1, ()):
            field = patch_bytes(kind, self.crc.get(slot, (0, 0))[0])
            a, b = max(off, part.lo), min(off + len(field), hi)
            part.data[a - part.lo:b - part.lo] = field[a - off:b - off]


class MultipartUpload:
    """One multipart upload of ``url``: parts uploaded on ``threads`` threads, then
    completed; :meth:`abort` on any failure."""

    def __init__(self, client: Any, url: S3Url, threads: int) -> None:
        self.client = client
        self.url = url
        self.name = str(url)
        self.threads = max(1, threads)
        self.upload_id: Optional[str] = None
        self.etags: dict[int, str] = {}
        #: The object's ETag as ``CompleteMultipartUpload`` answered it.
        self.etag = ""
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="fastpersist-s3-put")
        self._futures: list[Future] = []
        self._slots = threading.BoundedSemaphore(self.threads + 2)

    def _call(self, operation: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except Exception as e:  # noqa: BLE001 - named below
            if not s3client.is_client_error(e):
                raise
            raise s3client.store_error(e, self.name, operation, saving=True) from e

    def create(self) -> None:
        r = self._call("CreateMultipartUpload", self.client.create_multipart_upload, Bucket=self.url.bucket,
                       Key=self.url.key, ContentType="application/octet-stream")
        self.upload_id = r["UploadId"]

    def take_slot(self) -> None:
        """Wait until fewer than ``threads + 2`` staged parts are in flight; raise the
        first failed upload's error at once."""
        while not self._slots.acquire(timeout=0.5):
            self.check()
        self.check()

    def give_slot(self) -> None:
        self._slots.release()

    def check(self) -> None:
        for f in list(self._futures):
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]

    def submit(self, part: StagedPart, holds_slot: bool) -> None:
        self._futures.append(self._pool.submit(self._put, part, holds_slot))

    def _put(self, part: StagedPart, holds_slot: bool) -> None:
        try:
            md5 = base64.b64encode(hashlib.md5(part.data).digest()).decode()  # noqa: S324 - S3's Content-MD5
            r = self._call("UploadPart", self.client.upload_part, Bucket=self.url.bucket, Key=self.url.key,
                           UploadId=self.upload_id, PartNumber=part.number, Body=part.data,
                           ContentLength=len(part.data), ContentMD5=md5)
            with self._lock:
                self.etags[part.number] = r["ETag"]
        finally:
            part.data = bytearray()
            if holds_slot:
                self._slots.release()

    def wait_parts(self) -> None:
        for f in self._futures:
            f.result()

    def complete(self) -> None:
        parts = [{"PartNumber": n, "ETag": self.etags[n]} for n in sorted(self.etags)]
        r = self._call("CompleteMultipartUpload", self.client.complete_multipart_upload, Bucket=self.url.bucket,
                       Key=self.url.key, UploadId=self.upload_id, MultipartUpload={"Parts": parts})
        self.etag = str(r.get("ETag", ""))
        self._pool.shutdown(wait=True)

    def stop(self) -> None:
        """Stop uploading: queued parts are dropped and the parts in flight waited for
        (the upload itself stays: a collective save's other ranks may own it)."""
        for f in self._futures:
            f.cancel()
        self._pool.shutdown(wait=True)

    def abort(self) -> None:
        """Stop uploading (queued parts are dropped), wait for the parts in flight, abort
        the upload. Never raises: a failed abort is logged (the lifecycle rule or the
        next save's cleanup removes the upload)."""
        self.stop()
        if self.upload_id is None:
            return
        try:
            self.client.abort_multipart_upload(Bucket=self.url.bucket, Key=self.url.key, UploadId=self.upload_id)
        except Exception as e:  # noqa: BLE001 - the original error is what the caller sees
            log.warning("could not abort the multipart upload %s of %s (%s); the next save to this key or a "
                        "lifecycle rule removes it", self.upload_id, self.name, e)


def upload_plan(plan: WritePlan, url: S3Url, client: Any, handle: Any, *, threads: int = 8,
                preferred_part: int = DEFAULT_PART) -> list[int]:
    """Upload the file ``plan`` describes to ``url`` as one multipart upload (see the
    module docstring); blocks until the object is complete, or raises (upload aborted).
    Returns the CRC-32 of every CRC slot of the plan (what its CRC fields hold)."""
    stager = PartStager(plan, part_size(plan.file_size, preferred_part), handle)
    held: list[StagedPart] = []

    def send(up: MultipartUpload) -> None:
        for i in range(stager.nparts):
            up.take_slot()
            try:
                part = stager.stage(i)
            except BaseException:
                up.give_slot()
                raise
            if stager.ready(part):
                stager.fill_crcs(part)
                up.submit(part, holds_slot=True)
            else:
                up.give_slot()  # a held part waits outside the in-flight bound
                held.append(part)
            for h in [h for h in held if stager.ready(h)]:
                held.remove(h)
                stager.fill_crcs(h)
                up.submit(h, holds_slot=False)
        if held:
            raise AssertionError(f"CRC fields of parts {[h.number for h in held]} never became ready")

    _upload(client, url, threads, send)
    return [stager.crc.get(slot, (0, 0))[0] for slot in range(plan.nslots)]


def _upload(client: Any, url: S3Url, threads: int, send: Callable[["MultipartUpload"], None]) -> MultipartUpload:
    """One multipart upload: create it, ``send(up)`` its parts, wait for them and complete
    it; on any error abort it and raise. Afterwards the key's uploads left by killed saves
    (listed before this one began) are aborted. Returns the completed upload."""
    up = MultipartUpload(client, url, threads)
    stale = stale_uploads(client, url)
    try:
        up.create()
        send(up)
        up.wait_parts()
        up.complete()
    except BaseException:
        up.abort()
        raise
    abort_uploads(client, url, stale)
    return up


def stage_all(plan: WritePlan, handle: Any, preferred_part: int = DEFAULT_PART) -> list[StagedPart]:
    """Every part of ``plan``, staged and with its CRC fields filled (an async save's
    snapshot: after this, no byte of the plan's sources is read again)."""
    stager = PartStager(plan, part_size(plan.file_size, preferred_part), handle)
    parts = [stager.stage(i) for i in range(stager.nparts)]
    for p in parts:
        stager.fill_crcs(p)
    return parts


def upload_parts(parts: list[StagedPart], url: S3Url, client: Any, *, threads: int = 8) -> None:
    """Upload already staged ``parts`` (from :func:`stage_all`) as one multipart upload."""

    def send(up: MultipartUpload) -> None:
        for part in parts:
            up.take_slot()
            up.submit(part, holds_slot=True)

    _upload(client, url, threads, send)


def upload_file(fd: int, size: int, url: S3Url, client: Any, *, threads: int = 8, preferred_part: int = DEFAULT_PART,
                before_complete: Optional[Callable[[], None]] = None) -> MultipartUpload:
    """Upload ``size`` bytes of the open file ``fd`` (from offset 0) to ``url`` as one
    multipart upload (the drain of the tiered mode, :mod:`fastpersist.s3tier`): parts
    read with ``pread`` as upload slots free up (at most ``threads + 2`` parts in
    memory), each sent with its Content-MD5. ``before_complete`` runs once every part
    is stored and before the commit; an error it raises aborts the upload. Returns the
    completed upload (its :attr:`~MultipartUpload.etag`)."""
    psize = part_size(size, preferred_part)
    nparts = max(1, -(-size // psize))

    def send(up: MultipartUpload) -> None:
        for i in range(nparts):
            lo = i * psize
            n = min(size, lo + psize) - lo
            up.take_slot()
            try:
                data = bytearray(n)
                view, got = memoryview(data), 0
                while got < n:
                    k = os.preadv(fd, [view[got:]], lo + got)  # GIL released
                    if k <= 0:
                        raise OSError(f"short read of the local copy for {url}: {got} of {n} bytes at offset {lo} "
                                      "(the file shrank during the upload)")
                    got += k
                view.release()
            except BaseException:
                up.give_slot()
                raise
            up.submit(StagedPart(i + 1, lo, data), holds_slot=True)
        up.wait_parts()
        if before_complete is not None:
            before_complete()

    return _upload(client, url, threads, send)


def list_uploads(client: Any, url: S3Url) -> list[dict]:
    """The incomplete multipart uploads of exactly ``url``'s key."""
    out: list[dict] = []
    kwargs: dict[str, Any] = {"Bucket": url.bucket, "Prefix": url.key}
    while True:
        r = client.list_multipart_uploads(**kwargs)
        out.extend(u for u in r.get("Uploads", []) if u.get("Key") == url.key)
        if not r.get("IsTruncated"):
            return out
        kwargs["KeyMarker"] = r.get("NextKeyMarker")
        kwargs["UploadIdMarker"] = r.get("NextUploadIdMarker")


def stale_uploads(client: Any, url: S3Url) -> list[str]:
    """The ids of the incomplete uploads of ``url``'s key that exist now (before a save
    creates its own); an empty list when they cannot be listed (logged)."""
    try:
        return [u["UploadId"] for u in list_uploads(client, url)]
    except Exception as e:  # noqa: BLE001 - cleanup is best effort
        log.warning("could not list the multipart uploads of %s (%s): stale ones stay until a later save or a "
                    "lifecycle rule", url, e)
        return []


def abort_uploads(client: Any, url: S3Url, upload_ids: list[str]) -> int:
    """Abort ``upload_ids`` of ``url``'s key (left by killed saves); returns how many went.
    Failures are logged, never raised."""
    n = 0
    for upload_id in upload_ids:
        try:
            client.abort_multipart_upload(Bucket=url.bucket, Key=url.key, UploadId=upload_id)
            n += 1
        except Exception as e:  # noqa: BLE001 - cleanup is best effort
            log.warning("could not abort the stale multipart upload %s of %s: %s", upload_id, url, e)
    if n:
        log.info("aborted %d stale multipart upload(s) of %s", n, url)
    return n
