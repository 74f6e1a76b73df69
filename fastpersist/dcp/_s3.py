"""The object-storage side of the DCP storage layer: a checkpoint under ``s3://bucket/prefix``.

A DCP checkpoint on S3 has the layout of a checkpoint directory, one object per file,
under ``prefix/``: ``prefix/__RANK_K.distcp`` (or ``prefix/__RANK_fpTOKEN_K.distcp``)
data objects and a ``prefix/.metadata`` object, the same bytes a local
``FastPersistWriter`` writes (items at multiples of 4096, CRC-32 per item in
``.metadata``). :class:`S3Checkpoint` does the requests: each data file is uploaded
by its rank as one multipart upload (parts in parallel, aborted on any failure:
:func:`fastpersist.s3upload.upload_plan`); ``.metadata`` is one ``PutObject`` (the
commit); reads are ranged GETs of exactly the items' byte ranges, in parallel.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from fastpersist import handles, s3client, s3upload
from fastpersist import config as config_mod
from fastpersist.plan import WritePlan
from fastpersist.s3url import S3Url, is_s3_url, parse_prefix

log = logging.getLogger("fastpersist.dcp")

#: Alignment of items in data objects: that of a local save on an ordinary filesystem,
#: so that the objects hold a local save's bytes.
ALIGNMENT = 4096
_CHUNK = 1 << 20


class S3Checkpoint:
    """The objects of one DCP checkpoint under ``s3://bucket/prefix`` (see the module
    docstring); ``config`` is a :class:`fastpersist.Config` (``s3_threads``,
    ``s3_part_size``, ``s3_timeout``) or None for the default."""

    def __init__(self, url: str, config: Any = None) -> None:
        u = parse_prefix(url)
        self.bucket = u.bucket
        self.prefix = u.key.strip("/")
        self.config = config
        #: the checkpoint's URL, without a trailing '/'
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def __getstate__(self) -> dict:
        return dict(self.__dict__)

    def _cfg(self) -> Any:
        return config_mod.resolve(self.config)

    def client(self) -> Any:
        cfg = self._cfg()
        return s3client.client(cfg.s3_threads + 2, cfg.s3_timeout)

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def object(self, name: str) -> S3Url:
        return S3Url(self.bucket, self.key(name))

    def name_of(self, name: str) -> str:
        """The URL of object ``name`` (for messages)."""
        return str(self.object(name))

    def _fail(self, e: BaseException, name: str, operation: str, saving: bool) -> BaseException:
        if not s3client.is_client_error(e):
            return e
        return s3client.store_error(e, self.name_of(name), operation, saving=saving)

    def size(self, name: str) -> Optional[int]:
        """The size of object ``name``; None when there is none."""
        try:
            return s3client.head(self.client(), self.bucket, self.key(name), self.name_of(name))[0]
        except s3client.ObjectNotFoundError:
            return None

    def exists(self, name: str) -> bool:
        return self.size(name) is not None

    def get(self, name: str) -> bytes:
        """The whole object ``name`` (small ones: ``.metadata``);
        :class:`~fastpersist.s3client.ObjectNotFoundError` when there is none."""
        try:
            r = self.client().get_object(Bucket=self.bucket, Key=self.key(name))
            return r["Body"].read()
        except Exception as e:  # noqa: BLE001 - named
            raise self._fail(e, name, "GetObject", False) from e

    def put(self, name: str, data: bytes) -> None:
        """One ``PutObject`` of ``data`` (with its ``Content-MD5``): the object appears
        whole or not at all."""
        md5 = base64.b64encode(hashlib.md5(data).digest()).decode()  # noqa: S324 - S3's Content-MD5
        try:
            self.client().put_object(Bucket=self.bucket, Key=self.key(name), Body=data, ContentMD5=md5,
                                     ContentLength=len(data), ContentType="application/octet-stream")
        except Exception as e:  # noqa: BLE001 - named
            raise self._fail(e, name, "PutObject", True) from e

    def upload(self, name: str, plan: WritePlan, threads: Optional[int] = None) -> list[int]:
        """Upload the file ``plan`` describes as object ``name`` (one multipart upload,
        aborted on failure); returns its CRC slots' CRC-32s."""
        cfg = self._cfg()
        n = threads or cfg.s3_threads
        return s3upload.upload_plan(plan, self.object(name), self.client(), handles.handle_for(cfg), threads=n,
                                    preferred_part=cfg.s3_part_size)

    def names(self) -> list[str]:
        """The names of the objects directly under the prefix."""
        c = self.client()
        base = f"{self.prefix}/" if self.prefix else ""
        out: list[str] = []
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base, "Delimiter": "/"}
        try:
            while True:
                r = c.list_objects_v2(**kwargs)
                out.extend(o["Key"][len(base):] for o in r.get("Contents", []))
                if not r.get("IsTruncated"):
                    return out
                kwargs["ContinuationToken"] = r["NextContinuationToken"]
        except Exception as e:  # noqa: BLE001 - named
            raise self._fail(e, "", "ListObjectsV2", False) from e

    def delete(self, names: list[str]) -> list[str]:
        """Delete objects ``names``; returns those deleted. Failures are logged."""
        done = []
        c = self.client()
        for name in names:
            try:
                c.delete_object(Bucket=self.bucket, Key=self.key(name))
                done.append(name)
            except Exception as e:  # noqa: BLE001 - cleanup: best effort
                log.warning("fastpersist.dcp: could not delete %s: %s", self.name_of(name), e)
        return done

    def read_ranges(self, ranges: list[tuple[str, int, int, int]], buf: memoryview) -> None:
        """Ranged GETs in parallel: ``(name, offset, length, place)`` puts bytes
        ``[offset, offset + length)`` of object ``name`` at ``buf[place:]``. Ranges
        larger than ``s3_part_size`` are cut into several GETs."""
        cfg = self._cfg()
        step = max(1, cfg.s3_part_size)
        jobs = []
        for name, off, n, at in ranges:
            for k in range(0, n, step):
                jobs.append((name, off + k, min(step, n - k), at + k))
        if not jobs:
            return
        c = self.client()
        workers = max(1, min(cfg.s3_threads, len(jobs)))
        with ThreadPoolExecutor(workers, thread_name_prefix="fastpersist-dcp-get") as pool:
            futures = [pool.submit(self._get_range, c, name, off, n, buf, at) for name, off, n, at in jobs]
            for f in futures:
                f.result()

    def _get_range(self, c: Any, name: str, off: int, n: int, buf: memoryview, at: int) -> None:
        try:
            r = c.get_object(Bucket=self.bucket, Key=self.key(name), Range=f"bytes={off}-{off + n - 1}")
            body = r["Body"]
            pos = 0
            try:
                while pos < n:
                    chunk = body.read(min(_CHUNK, n - pos))
                    if not chunk:
                        break
                    buf[at + pos:at + pos + len(chunk)] = chunk
                    pos += len(chunk)
            finally:
                body.close()
        except Exception as e:  # noqa: BLE001 - named
            raise self._fail(e, name, "GetObject", False) from e
        if pos != n:
            raise s3client.ObjectStoreError(
                f"GetObject of {self.name_of(name)} returned {pos} of the {n} bytes of range {off}-{off + n - 1} "
                "(the object is shorter than .metadata says, or the connection closed early)",
                self.name_of(name), "GetObject", "ShortRead")


def reset_target(layer: Any, checkpoint_id: Any, base_reset: Callable[[Any], None]) -> None:
    """``reset(checkpoint_id)`` of a storage layer (``FastPersistWriter``/``Reader``) that
    may target an ``s3://`` prefix. A URL points ``layer`` at that checkpoint's objects
    (``layer._s3``, ``layer.path``; ``base_reset(None)``, the stock class's ``reset``,
    resets the rest); a path points it at that directory (``base_reset(path)``); None
    keeps the target."""
    if checkpoint_id and is_s3_url(checkpoint_id):
        base_reset(None)
        layer._s3 = S3Checkpoint(os.fspath(checkpoint_id), layer.config)
        layer.path = layer._s3.url
        return
    if checkpoint_id:
        layer._s3 = None
    base_reset(checkpoint_id)
