"""Reads from object storage: an object fetched with concurrent ranged GETs into
anonymous memory, for the loaders and verifiers that read files.

The object's bytes land in a ``memfd`` (an anonymous, memory-backed file: nothing is
written to a disk, nothing is left behind), whose pages are mapped once and filled by
``threads`` ranged GETs in parallel, each pinned to the ETag the first request saw
(``If-Match``), so an object replaced during the load fails the load instead of
mixing two checkpoints. The loaders then read that descriptor as they read a local
file: with ``mmap`` their tensors are views of these same pages (no further copy);
the CRC-32s are checked as for a local file.
"""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastpersist import s3client
from fastpersist.s3url import S3Url

MiB = 1 << 20
#: Bytes per ranged GET (docs/objectstore.md has the measurement).
DEFAULT_RANGE = 16 * MiB
_CHUNK = 1 * MiB


@dataclass
class Fetched:
    """An object's bytes in anonymous memory: ``fd`` (a memfd, readable as a file at
    :attr:`path`), its ``size`` and ``etag``. Close it when done (the pages stay as
    long as a mapping of them does)."""

    url: str
    fd: int
    size: int
    etag: str

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


def _get_range(client: Any, url: S3Url, name: str, etag: str, view: memoryview, lo: int, hi: int) -> None:
    try:
        r = client.get_object(Bucket=url.bucket, Key=url.key, Range=f"bytes={lo}-{hi - 1}", IfMatch=etag)
        body = r["Body"]
        pos = lo
        try:
            while pos < hi:
                chunk = body.read(min(_CHUNK, hi - pos))
                if not chunk:
                    break
                view[pos:pos + len(chunk)] = chunk
                pos += len(chunk)
        finally:
            body.close()
    except Exception as e:  # noqa: BLE001 - named below
        if not s3client.is_client_error(e):
            raise
        if s3client.error_code(e) in ("PreconditionFailed", "412"):
            raise s3client.ObjectStoreError(
                f"GetObject of {name} failed: the object was replaced while it was being read; load it again",
                name, "GetObject", "PreconditionFailed") from e
        raise s3client.store_error(e, name, "GetObject", saving=False) from e
    if pos != hi:
        raise s3client.ObjectStoreError(
            f"GetObject of {name} returned {pos - lo} of the {hi - lo} bytes of range {lo}-{hi - 1} (object "
            "shorter than its HeadObject said, or the connection closed early); load it again",
            name, "GetObject", "ShortRead")


def fetch(url: S3Url, client: Any, *, threads: int = 8, range_size: int = DEFAULT_RANGE) -> Fetched:
    """The whole object ``url`` in a memfd (see the module docstring)."""
    name = str(url)
    size, etag = s3client.head(client, url.bucket, url.key, name)
    fd = os.memfd_create("fastpersist-s3", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        if size:
            with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
                view = memoryview(mm)
                try:
                    ranges = [(lo, min(size, lo + range_size)) for lo in range(0, size, range_size)]
                    with ThreadPoolExecutor(max(1, min(threads, len(ranges))),
                                            thread_name_prefix="fastpersist-s3-get") as pool:
                        futures = [pool.submit(_get_range, client, url, name, etag, view, lo, hi) for lo, hi in ranges]
                        for f in futures:
                            f.result()
                finally:
                    view.release()
    except BaseException:
        os.close(fd)
        raise
    return Fetched(name, fd, size, etag)
