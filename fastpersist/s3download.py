"""Reads from object storage: an object fetched with concurrent ranged GETs into
anonymous memory, for the loaders and verifiers that read files.

The object's bytes land in a ``memfd`` (an anonymous, memory-backed file: nothing is
written to a disk, nothing is left behind), whose pages are mapped once and filled by
``threads`` ranged GETs in parallel, each pinned to the ETag the first request saw
(``If-Match``), so an object replaced during the load fails the load instead of
mixing two checkpoints. The loaders then read that descriptor as they read a local
file: with ``mmap`` their tensors are views of these same pages (no further copy).

What makes it fast:

* **One copy, without the GIL.** Each GET's body is read by the HTTP connection's own
  ``readinto`` into a 1 MiB buffer of the thread's, which stays in the cache, then
  copied into the mapped pages with ``memmove`` (GIL released). botocore's
  ``read(amt)`` makes a new ``bytes`` object per chunk, and the copy into the mapping
  held the GIL. Reading the socket straight into the memfd's fresh pages was slower
  still: each page is then faulted in inside the socket's receive path. Faulting the
  pages in ahead (:mod:`fastpersist.prefault`, on a second thread or on the GET
  thread) did not pay on the reference VM either: measured, not adopted
  (``tools/s3_load_profile.py``).
* **CRC-32s as the bytes arrive.** With ``spans_of`` (the caller's parser of the
  format's index), the index is fetched first (a small window at the end of a zip
  file, at the start of a safetensors file), then every record's bytes are
  checksummed on the GET thread that received them, 1 MiB at a time while they are
  still in the cache (the native CRC releases the GIL); :attr:`Fetched.crcs` holds the
  result, and the loader does not read the object a second time to check it.

A GET that fails midway through its body (a reset, a read timeout, a body shorter
than its range) is resumed from the first missing byte, still pinned to the ETag, up
to the client's number of attempts; then it raises :class:`ObjectStoreError`.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from fastpersist import _native, s3client
from fastpersist.s3url import S3Url

MiB = 1 << 20
#: Bytes per ranged GET (docs/objectstore.md has the measurement).
DEFAULT_RANGE = 16 * MiB
#: Bytes read (and checksummed) at a time by a GET thread.
_CHUNK = 1 * MiB
#: Bytes fetched first to find the index (zip: at the end; safetensors: at the start).
INDEX_WINDOW = 1 * MiB

#: ``read_at(offset, length) -> bytes`` of the object (fetched on demand).
ReadAt = Callable[[int, int], bytes]
#: ``spans_of(read_at, size)``: the byte ranges to checksum, ``(offset, length, droppable)``
#: (droppable: a payload whose bytes nothing but its CRC needs, for ``discard`` fetches), or None.
SpansOf = Callable[[ReadAt, int], Optional[Sequence[tuple[int, int, bool]]]]
_PAGE = mmap.PAGESIZE


@dataclass
class Fetched:
    """An object's bytes in anonymous memory: ``fd`` (a memfd, readable as a file at
    :attr:`path`), its ``size`` and ``etag``, and ``crcs``: the CRC-32 of every span
    ``spans_of`` named, by ``(offset, length)`` (None when none was asked for or the
    index could not be parsed). Close it when done (the pages stay as long as a
    mapping of them does)."""

    url: str
    fd: int
    size: int
    etag: str
    crcs: Optional[dict[tuple[int, int], int]] = None
    #: whether the droppable spans' pages were given back after their CRCs (``discard``)
    discarded: bool = False

    @property
    def path(self) -> str:
        """A path the file readers open (this process only)."""
        return f"/proc/self/fd/{self.fd}"

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Fetched":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _Crcs:
    """CRC-32 pieces of the spans, as the GET threads compute them."""

    base: int  #: address of the mapping
    spans: list[tuple[int, int]]  #: sorted, non-overlapping (offset, length)
    #: per span: whether its pages may be dropped once checksummed (``discard`` fetches)
    drop: list[bool] = field(default_factory=list)
    #: ``punch(lo, hi)``: give back the pages of ``[lo, hi)`` (page-aligned)
    punch: Optional[Callable[[int, int], None]] = None
    starts: list[int] = field(default_factory=list)
    pieces: list[list[tuple[int, int, int]]] = field(default_factory=list)  #: per span: (offset, crc, length)

    def __post_init__(self) -> None:
        self.starts = [s for s, _n in self.spans]
        self.pieces = [[] for _ in self.spans]
        if not self.drop:
            self.drop = [False] * len(self.spans)

    def add(self, lo: int, hi: int) -> None:
        """Checksum the bytes ``[lo, hi)``, which just arrived, span by span."""
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
        while i < len(self.spans):
            s, n = self.spans[i]
            if s >= hi:
                break
            a, b = max(s, lo), min(s + n, hi)
            if a < b:
                self.pieces[i].append((a, _native.crc32(self.base + a, b - a), b - a))  # GIL released
                if self.punch is not None and self.drop[i]:
                    pa, pb = -(-a // _PAGE) * _PAGE, b // _PAGE * _PAGE  # whole pages of this span only
                    if pa < pb:
                        self.punch(pa, pb)
            i += 1

    def result(self) -> dict[tuple[int, int], int]:
        """The CRC-32 of every span whose bytes all arrived."""
        out: dict[tuple[int, int], int] = {}
        for (s, n), pieces in zip(self.spans, self.pieces):
            crc, pos = 0, s
            for a, c, m in sorted(pieces):
                if a != pos:
                    break
                crc = _native.crc32_combine(crc, c, m) if pos > s else c
                pos += m
            if pos == s + n:
                out[(s, n)] = crc
        return out


def _fast_reader(body: Any) -> Optional[tuple[Callable[[memoryview], int], Any]]:
    """``(readinto, urllib3 response)`` of the HTTP response under botocore's plain
    ``StreamingBody`` (a length-delimited, unencoded body), or None (then ``read(amt)``)."""
    if type(body).__name__ != "StreamingBody":  # a checksum-validating body: keep its checks
        return None
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if fp is None or not hasattr(fp, "readinto") or getattr(fp, "chunked", True) or getattr(fp, "length", None) is None:
        return None
    headers = getattr(raw, "headers", None) or {}
    if headers.get("content-encoding") not in (None, "", "identity"):
        return None
    return fp.readinto, raw


def _read_body(body: Any, view: memoryview, pos: int, hi: int, crcs: Optional[_Crcs], base: int) -> int:
    """Read the GET's body into ``view[pos:hi]`` (the mapping at address ``base``);
    returns where it stopped."""
    fast = _fast_reader(body)
    bounce = (ctypes.c_char * _CHUNK)() if fast is not None else None
    try:
        while pos < hi:
            end = min(hi, pos + _CHUNK)
            if bounce is not None:
                assert fast is not None
                with memoryview(bounce).cast("B") as bv:
                    n = fast[0](bv[:end - pos])
                if n:
                    ctypes.memmove(base + pos, bounce, n)  # GIL released
            else:
                chunk = body.read(end - pos)
                n = len(chunk)
                view[pos:pos + n] = chunk
            if not n:
                break
            if crcs is not None:
                crcs.add(pos, pos + n)
            pos += n
    finally:
        # Closed, as botocore's own readers leave it: handing the connection back to the
        # pool after a read behind urllib3's back measured no faster (docs/objectstore.md).
        body.close()
    return pos


def _get_range(client: Any, url: S3Url, name: str, etag: str, view: memoryview, base: int, lo: int, hi: int,
               crcs: Optional[_Crcs] = None, attempts: int = 0) -> None:
    """``[lo, hi)`` of the object into ``view`` (the mapping at address ``base``),
    resumed where a body broke off."""
    attempts = attempts or s3client.max_attempts()
    pos, tries, last = lo, 0, None
    while pos < hi:
        tries += 1
        try:
            r = client.get_object(Bucket=url.bucket, Key=url.key, Range=f"bytes={pos}-{hi - 1}", IfMatch=etag)
        except Exception as e:  # noqa: BLE001 - named below (botocore has retried it already)
            if not s3client.is_client_error(e):
                raise
            if s3client.error_code(e) in ("PreconditionFailed", "412"):
                raise s3client.ObjectStoreError(
                    f"GetObject of {name} failed: the object was replaced while it was being read; load it again",
                    name, "GetObject", "PreconditionFailed") from e
            raise s3client.store_error(e, name, "GetObject", saving=False) from e
        length = r.get("ContentLength")
        if length is not None and int(length) != hi - pos:
            r["Body"].close()
            raise s3client.ObjectStoreError(
                f"GetObject of {name} answered {length} bytes for the {hi - pos}-byte range {pos}-{hi - 1} (the "
                "object is shorter than its HeadObject said, or the store ignored the range); load it again",
                name, "GetObject", "ShortRead")
        start = pos
        try:
            pos = _read_body(r["Body"], view, pos, hi, crcs, base)
        except (OSError, ValueError) as e:  # reset, timeout, closed connection: resumed below
            last = e
        except Exception as e:  # noqa: BLE001 - botocore's/urllib3's wrappers of the same
            if not s3client.is_client_error(e):
                raise
            last = e
        if pos < hi:
            if tries >= attempts:
                code = type(last).__name__ if last is not None else "ShortRead"
                raise s3client.ObjectStoreError(
                    f"GetObject of {name} returned {pos - lo} of the {hi - lo} bytes of range {lo}-{hi - 1} after "
                    f"{tries} attempt(s) (the connection closed early{f': {last}' if last else ''}); load it again",
                    name, "GetObject", code) from last
            if pos == start:
                time.sleep(min(2.0, 0.05 * 2 ** tries))  # backoff only when nothing arrived


def _mapping_address(mm: mmap.mmap) -> int:
    obj = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(obj)
    finally:
        del obj


class _Windows:
    """The index's bytes, fetched on demand into the mapping (``read_at``), and which
    byte ranges are there already."""

    def __init__(self, client: Any, url: S3Url, name: str, etag: str, view: memoryview, base: int, size: int) -> None:
        self.client, self.url, self.name, self.etag, self.view, self.size = client, url, name, etag, view, size
        self.base = base
        self.have: list[tuple[int, int]] = []

    def fetch(self, lo: int, hi: int) -> None:
        lo, hi = max(0, lo), min(self.size, hi)
        for a, b in self._missing(lo, hi):
            _get_range(self.client, self.url, self.name, self.etag, self.view, self.base, a, b)
            self.have.append((a, b))
            self.have.sort()

    def _missing(self, lo: int, hi: int) -> list[tuple[int, int]]:
        out, pos = [], lo
        for a, b in self.have:
            if b <= pos or a >= hi:
                continue
            if a > pos:
                out.append((pos, a))
            pos = max(pos, b)
        if pos < hi:
            out.append((pos, hi))
        return out

    def read_at(self, offset: int, length: int) -> bytes:
        offset, end = max(0, offset), min(self.size, offset + max(0, length))
        if offset >= end:
            return b""
        self.fetch(offset, end)
        return bytes(self.view[offset:end])

    def gaps(self) -> list[tuple[int, int]]:
        return self._missing(0, self.size)


def fetch(url: S3Url, client: Any, *, threads: int = 8, range_size: int = DEFAULT_RANGE,
          spans_of: Optional[SpansOf] = None, index_at_end: bool = True, discard: bool = False) -> Fetched:
    """The whole object ``url`` in a memfd (see the module docstring). With
    ``spans_of``, the index window (the last :data:`INDEX_WINDOW` bytes, or the first
    ones without ``index_at_end``) is fetched first and ``spans_of(read_at, size)``
    names the byte ranges whose CRC-32s are computed as they arrive
    (:attr:`Fetched.crcs`); an exception other than the store's in ``spans_of`` only
    turns that off (the loader then finds what is wrong). With ``discard`` (for verifies),
    the pages of the droppable spans are given back as soon as their CRC-32s are
    computed (``MADV_REMOVE``), so that the memfd holds the index and the small records,
    not the payloads: :attr:`Fetched.discarded` says whether that happened (only when
    ``spans_of`` named the spans)."""
    name = str(url)
    size, etag = s3client.head(client, url.bucket, url.key, name)
    fd = os.memfd_create("fastpersist-s3", os.MFD_CLOEXEC)
    crc_map: Optional[dict[tuple[int, int], int]] = None
    discarded = False
    try:
        os.ftruncate(fd, size)
        if size:
            with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
                base = _mapping_address(mm)
                view = memoryview(mm)
                punch = (lambda lo, hi: mm.madvise(mmap.MADV_REMOVE, lo, hi - lo)) if discard else None
                try:
                    crc_map, discarded = _fill(client, url, name, etag, view, base, size, threads, range_size,
                                               spans_of, index_at_end, punch)
                finally:
                    view.release()
    except BaseException:
        os.close(fd)
        raise
    return Fetched(name, fd, size, etag, crc_map, discarded)


def _fill(client: Any, url: S3Url, name: str, etag: str, view: memoryview, base: int, size: int, threads: int,
          range_size: int, spans_of: Optional[SpansOf], index_at_end: bool,
          punch: Optional[Callable[[int, int], None]]) -> tuple[Optional[dict[tuple[int, int], int]], bool]:
    windows = _Windows(client, url, name, etag, view, base, size)
    crcs: Optional[_Crcs] = None
    spans: Optional[Sequence[tuple[int, int, bool]]] = None
    if spans_of is not None:
        if index_at_end:
            windows.fetch(size - INDEX_WINDOW, size)
        else:
            windows.fetch(0, INDEX_WINDOW)
        try:
            spans = spans_of(windows.read_at, size)
        except s3client.ObjectStoreError:
            raise
        except Exception:  # noqa: BLE001 - a malformed index: the loader names it
            spans = None
        if spans is not None:
            ordered = sorted((int(s), int(n), bool(d)) for s, n, d in spans if n > 0)
            if all(a + n <= b for (a, n, _d), (b, _m, _e) in zip(ordered, ordered[1:])) and \
                    all(0 <= s and s + n <= size for s, n, _d in ordered):
                crcs = _Crcs(base, [(s, n) for s, n, _d in ordered], [d for _s, _n, d in ordered])
                for a, b in windows.have:  # what arrived already (kept: the index is read again)
                    crcs.add(a, b)
                crcs.punch = punch
    ranges = [(lo, min(hi, lo + range_size)) for a, hi in windows.gaps() for lo in range(a, hi, range_size)]
    if ranges:
        attempts = s3client.max_attempts()
        stop = threading.Event()

        def job(lo: int, hi: int) -> None:
            if not stop.is_set():
                _get_range(client, url, name, etag, view, base, lo, hi, crcs, attempts)

        with ThreadPoolExecutor(max(1, min(threads, len(ranges))), thread_name_prefix="fastpersist-s3-get") as pool:
            futures = [pool.submit(job, lo, hi) for lo, hi in ranges]
            try:
                for f in futures:
                    f.result()
            except BaseException:
                stop.set()  # the queued ranges are not started
                raise
    spans_crcs = None if crcs is None else crcs.result()
    if spans_crcs is not None:
        spans_crcs.update({(int(s), 0): 0 for s, n, _d in (spans or ()) if n == 0})
    return spans_crcs, crcs is not None and crcs.punch is not None
