"""``fastpersist verify s3://bucket/prefix`` of a ``torch.distributed.checkpoint`` (DCP)
checkpoint on object storage, with no file written.

A DCP checkpoint under a prefix is one object per file (``prefix/.metadata`` or the
rank-local ``prefix/__N.metadata``, and the ``prefix/*.distcp`` data objects:
:mod:`fastpersist.dcp`). The checks are those of a local directory
(:mod:`fastpersist.formats.dcpverify`); only how the files are read differs
(:class:`S3Source`): the metadata objects are fetched whole, and each data object
the metadata references is fetched with concurrent ranged GETs
(:func:`fastpersist.s3download.fetch`) with every record's CRC-32 computed as its
bytes arrive. Of each record only its first and last 64 KiB are kept (its header,
pickle and zip directory, which the kind checks read); the pages of the rest are given
back once checksummed, so memory holds at most 128 KiB per record, not the payloads.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from typing import Any, Iterator, Optional, Sequence

from fastpersist import _native, s3client, s3download
from fastpersist import config as config_mod
from fastpersist.formats.base import VerifyResult
from fastpersist.formats.dcpverify import OpenedFile, verify_source
from fastpersist.s3url import S3Url, parse_prefix

#: Bytes kept at each end of a record (the kind checks read its header, pickle and zip directory there).
KEEP = 64 << 10
_READ = 16 << 20


def _is_metadata(name: str) -> bool:
    return name == ".metadata" or (name.startswith("__") and name.endswith(".metadata"))


def _pieces(offset: int, length: int) -> list[tuple[int, int, bool]]:
    """The spans of one record for the fetch: ``(offset, length, droppable)``."""
    if length <= 2 * KEEP:
        return [(offset, length, False)]
    return [(offset, KEEP, False), (offset + KEEP, length - 2 * KEEP, True), (offset + length - KEEP, KEEP, False)]


class S3Source:
    """The objects of a DCP checkpoint under ``s3://bucket/prefix``, read for
    :func:`fastpersist.formats.dcpverify.verify_source`."""

    def __init__(self, url: S3Url, config: Any = None) -> None:
        self.url = url
        self.cfg = config_mod.resolve(config)
        self.prefix = url.key.rstrip("/")
        self.name = f"s3://{url.bucket}/{self.prefix}" if self.prefix else f"s3://{url.bucket}"
        n = self.cfg.s3_threads
        self.client = s3client.client(n + 2, self.cfg.s3_timeout)
        self._names: Optional[list[str]] = None

    def object(self, rel: str) -> S3Url:
        return S3Url(self.url.bucket, f"{self.prefix}/{rel}" if self.prefix else rel)

    def names(self) -> list[str]:
        """The names of the objects directly under the prefix."""
        if self._names is None:
            base = f"{self.prefix}/" if self.prefix else ""
            out: list[str] = []
            kwargs: dict[str, Any] = {"Bucket": self.url.bucket, "Prefix": base, "Delimiter": "/"}
            try:
                while True:
                    r = self.client.list_objects_v2(**kwargs)
                    out.extend(o["Key"][len(base):] for o in r.get("Contents", []))
                    if not r.get("IsTruncated"):
                        break
                    kwargs["ContinuationToken"] = r["NextContinuationToken"]
            except Exception as e:  # noqa: BLE001 - named
                if not s3client.is_client_error(e):
                    raise
                raise s3client.store_error(e, self.name, "ListObjectsV2", saving=False) from e
            self._names = [n for n in out if n]
        return self._names

    def metadata_names(self) -> list[str]:
        names = self.names()
        if ".metadata" in names:
            return [".metadata"]
        return sorted(n for n in names if _is_metadata(n))

    def read(self, rel: str) -> bytes:
        u = self.object(rel)
        try:
            return self.client.get_object(Bucket=u.bucket, Key=u.key)["Body"].read()
        except Exception as e:  # noqa: BLE001 - named
            if not s3client.is_client_error(e):
                raise
            raise s3client.store_error(e, str(u), "GetObject", saving=False) from e

    def path(self, rel: str) -> str:
        return str(self.object(rel))

    @contextlib.contextmanager
    def open(self, rel: str, spans: Sequence[tuple[int, int]], read: bool) -> Iterator[Optional[OpenedFile]]:
        def spans_of(_read_at: Any, size: int) -> list[tuple[int, int, bool]]:
            inside = sorted((o, n) for o, n in spans if n > 0 and 0 <= o and o + n <= size)
            return [p for o, n in inside for p in _pieces(o, n)]

        try:
            got = s3download.fetch(self.object(rel), self.client, threads=self.cfg.s3_threads,
                                   range_size=self.cfg.s3_part_size, spans_of=spans_of, discard=True)
        except s3client.ObjectNotFoundError:
            yield None
            return
        with got:
            known = got.crcs or {}

            def crc_of(offset: int, length: int) -> int:
                if length == 0:
                    return 0
                crc = None
                pieces = _pieces(offset, length)
                if all((o, n) in known for o, n, _d in pieces):
                    for o, n, _d in pieces:
                        crc = known[(o, n)] if crc is None else _native.crc32_combine(crc, known[(o, n)], n)
                    return int(crc or 0)
                # spans the fetch could not checksum as they arrived (records that overlap):
                # nothing was given back then, so the bytes are all in the memfd
                if got.discarded:
                    raise RuntimeError(f"{self.path(rel)}: no CRC-32 computed for the record at [{offset}, "
                                       f"{offset + length}) and its pages were given back (a fastpersist bug)")
                c = 0
                for at in range(offset, offset + length, _READ):
                    c = zlib.crc32(os.pread(got.fd, min(_READ, offset + length - at), at), c)
                return c

            def crcs(items: Sequence[tuple[int, int]]) -> list[int]:
                return [crc_of(o, n) for o, n in items]

            yield OpenedFile(got.size, got.fd, crcs)


def is_checkpoint(url: S3Url, config: Any = None) -> bool:
    """Whether a DCP checkpoint's metadata (or a data object) lies directly under the
    prefix ``url.key``."""
    names = S3Source(url, config).names()
    return any(_is_metadata(n) or (n.startswith("__") and n.endswith(".distcp")) for n in names)


def verify(target: Any, *, config: Any = None) -> VerifyResult:
    """:func:`fastpersist.verify` of the DCP checkpoint under the prefix ``target``."""
    return verify_source(S3Source(parse_prefix(target), config))
