"""Saves, loads and verifies of ``s3://bucket/key`` targets (direct mode).

The same stages as a local save with another write and commit: the format plans the
file exactly as for a local save (same bytes, same 4096-byte alignment of the
payloads), :mod:`fastpersist.s3upload` streams it into one multipart upload and
completes it (the commit). Loads and verifies fetch the object with parallel ranged
GETs into anonymous memory (:mod:`fastpersist.s3download`) and hand it to the same
loaders and verifiers as a local file. Loads check the CRC-32s as the bytes arrive
(:mod:`fastpersist.s3check`); where every one matched, the loader does not read the
object again to check it; otherwise it checks as for a local file and names the error.

Needs the ``s3`` extra (boto3); see docs/objectstore.md for configuration.
"""

from __future__ import annotations

import io as pyio
import logging
import os
from typing import Any, Optional

import torch

from fastpersist import _compat, handles, s3check, s3client, s3dcpverify, s3download, s3upload
from fastpersist import config as config_mod
from fastpersist.errors import UnsupportedLayoutError
from fastpersist.formats import registry, safetensors
from fastpersist.formats.base import VerifyResult
from fastpersist.plan import WritePlan
from fastpersist.s3url import S3Url, is_s3_url, parse, parse_prefix

log = logging.getLogger("fastpersist.s3")

__all__ = ["ALIGNMENT", "describe", "fetch", "fetch_for_reading", "is_s3_url", "load", "load_file", "load_with_etag",
           "name_url_in_error", "plan_for", "save", "save_file", "stage", "upload_staged", "verify"]

#: Payload alignment of objects: what a local save uses on an ordinary filesystem, so
#: that the object's bytes equal those of a local save.
ALIGNMENT = 4096


def _bytes_plan(data: bytes) -> WritePlan:
    buf = bytearray(data)
    t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    return WritePlan([(0, t.data_ptr(), len(buf), -1)] if buf else [], [], 0, len(buf), keepalive=[buf, t])


def plan_for(obj: Any, url: S3Url, cfg: Any, format: Optional[str], metadata: Optional[dict]) -> WritePlan:
    """The file's byte layout, as a local save of ``obj`` to a file named like the key
    would write it (torch's own writer, aligned, where the planner cannot lay it out)."""
    fmt = registry.format_for(url.key, format)
    if metadata is not None and fmt is not registry.SAFETENSORS:
        raise TypeError(f"metadata= is for safetensors files; {url} is saved in torch's format")
    assert fmt.plan is not None
    try:
        return fmt.plan(obj, ALIGNMENT, cfg, metadata=metadata, target=str(url))
    except UnsupportedLayoutError as e:
        if fmt is not registry.TORCH:
            raise
        log.debug("fast torch layout not possible for %s (%s); laying it out with torch's writer", url, e)
        out = pyio.BytesIO()
        with _compat.save_storage_alignment(ALIGNMENT, required=False):
            torch.serialization.save(obj, out)
        return _bytes_plan(out.getbuffer().tobytes())


def save(obj: Any, target: Any, *, config: Any = None, format: Optional[str] = None,
         metadata: Optional[dict] = None) -> None:
    """Blocking save of ``obj`` to the ``s3://`` URL ``target`` (one multipart upload)."""
    url = parse(target)
    cfg = config_mod.resolve(config)
    _upload(plan_for(obj, url, cfg, format, metadata), url, cfg)


def _upload(plan: WritePlan, url: S3Url, cfg: Any) -> None:
    n = cfg.s3_threads
    s3upload.upload_plan(plan, url, s3client.client(n + 2, cfg.s3_timeout), handles.handle_for(cfg), threads=n,
                         preferred_part=cfg.s3_part_size)


def save_file(tensors: dict, target: Any, metadata: Optional[dict], *, config: Any = None) -> None:
    """:func:`fastpersist.save_file` to an ``s3://`` URL: a safetensors object whose
    ``__metadata__`` is exactly ``metadata``, as ``safetensors.torch.save_file`` writes."""
    url = parse(target)
    cfg = config_mod.resolve(config)
    _upload(safetensors.plan_safetensors(tensors, metadata, ALIGNMENT, checksum=cfg.checksum), url, cfg)


def load_file(target: Any, device: Any, *, config: Any = None) -> dict:
    """:func:`fastpersist.load_file` of an ``s3://`` URL: every tensor on ``device`` (on
    the CPU, views of the fetched memory)."""
    url = parse(target)
    got, cfg = fetch_for_reading(url, config=config)
    with got:
        try:
            return registry.load_safetensors_file(got.path, device, cfg, _cpu_target(device))
        except Exception as e:  # noqa: BLE001 - re-raised, naming the URL
            name_url_in_error(e, got.path, str(url))
            raise


def stage(obj: Any, target: Any, *, config: Any = None, format: Optional[str] = None,
          metadata: Optional[dict] = None) -> tuple[S3Url, list[s3upload.StagedPart]]:
    """An async save's capture: the whole file staged in memory (CRC fields filled);
    ``obj`` may change afterwards."""
    url = parse(target)
    cfg = config_mod.resolve(config)
    plan = plan_for(obj, url, cfg, format, metadata)
    return url, s3upload.stage_all(plan, handles.handle_for(cfg), cfg.s3_part_size)


def upload_staged(url: S3Url, parts: list[s3upload.StagedPart], *, config: Any = None) -> None:
    """Upload what :func:`stage` captured (an async save's background half)."""
    cfg = config_mod.resolve(config)
    n = cfg.s3_threads
    s3upload.upload_parts(parts, url, s3client.client(n + 2, cfg.s3_timeout), threads=n)


def fetch(target: Any, *, config: Any = None, crcs: bool = False, discard: bool = False) -> s3download.Fetched:
    """The object at ``target`` in anonymous memory (see :mod:`fastpersist.s3download`);
    with ``crcs``, every record's CRC-32 computed as its bytes arrive
    (:attr:`~fastpersist.s3download.Fetched.crcs`); with ``discard`` too, the payloads'
    pages given back once checksummed (for verifies)."""
    url = parse(target)
    cfg = config_mod.resolve(config)
    n = cfg.s3_threads
    spans_of, at_end = s3check.spans(_kind(url)) if crcs else (None, True)
    return s3download.fetch(url, s3client.client(n + 2, cfg.s3_timeout), threads=n, range_size=cfg.s3_part_size,
                            spans_of=spans_of, index_at_end=at_end, discard=discard and crcs)


def _kind(url: S3Url) -> str:
    return "safetensors" if registry.format_for(url.key) is registry.SAFETENSORS else "torch"


def fetch_for_reading(target: Any, *, config: Any = None) -> tuple[s3download.Fetched, Any]:
    """``(fetched, config)``: the object in anonymous memory, its CRC-32s checked as the
    bytes arrived, and the configuration its reader should use: ``checksum`` off when
    every record's CRC-32 was already compared (the reader need not pass over the bytes
    again), else as given (the reader checks, and names what is wrong).

    Raises:
        ChecksumError: a record's bytes differ from its recorded CRC-32 (naming the URL),
            found before any reader ran.
        ObjectStoreError: a GET failed for good, or the object was replaced meanwhile.
    """
    url = parse(target)
    cfg = config_mod.resolve(config)
    got = fetch(url, config=cfg, crcs=cfg.checksum)
    try:
        if cfg.checksum and s3check.check(_kind(url), got.fd, str(url), got.size, got.crcs):
            cfg = cfg.replace(checksum=False)
    except BaseException:
        got.close()
        raise
    return got, cfg


def _cpu_target(map_location: Any) -> bool:
    if map_location is None:
        return True
    if isinstance(map_location, (str, torch.device)):
        try:
            return torch.device(map_location).type == "cpu"
        except (RuntimeError, TypeError, ValueError):
            return False
    return False


def load(target: Any, req: registry.LoadRequest, *, config: Any = None) -> Any:
    """``torch.load`` semantics for an object: fetched, then loaded by its format's
    loader. Onto the CPU (and unless ``mmap=False``) the tensors are views of the
    fetched memory (the loaders' mmap path: no copy)."""
    return load_with_etag(target, req, config=config)[0]


def load_with_etag(target: Any, req: registry.LoadRequest, *, config: Any = None) -> tuple[Any, str]:
    """:func:`load`, and the ETag of the object version it read (every ranged GET was
    pinned to it): a collective load compares the ranks' ETags."""
    url = parse(target)
    fmt = registry.format_for(url.key)
    assert fmt.load is not None
    got, cfg = fetch_for_reading(url, config=config)
    with got:
        mmap = req.mmap
        if mmap is None and _cpu_target(req.map_location):
            mmap = True
        local = registry.LoadRequest(got.path, req.map_location, req.pickle_module, req.weights_only, mmap,
                                     req.pickle_load_args)
        try:
            return fmt.load(got.path, cfg, local), got.etag
        except Exception as e:  # noqa: BLE001 - re-raised, naming the URL
            name_url_in_error(e, got.path, str(url))
            raise


def name_url_in_error(e: BaseException, local: str, url: str) -> None:
    """Make a loader's error name the URL instead of the memfd's path."""
    if getattr(e, "path", None) == local:
        try:
            e.path = url  # type: ignore[attr-defined]
        except AttributeError:
            pass
    if getattr(e, "filename", None) == local:
        e.filename = url  # type: ignore[attr-defined]
    if e.args and isinstance(e.args[0], str) and local in e.args[0]:
        e.args = (e.args[0].replace(local, url),) + tuple(e.args[1:])


def verify(target: Any, *, config: Any = None) -> VerifyResult:
    """:func:`fastpersist.verify` of an object, with no file on disk: the object is
    fetched with every record's CRC-32 computed as its bytes arrive, and each payload's
    pages are given back once checksummed, so memory holds the index and the small
    records, not the payloads; the format's verifier then checks the structure and
    compares those CRC-32s. Where the download could not compute them all (an index
    that does not parse, an odd layout), the object is fetched whole into memory and
    verified as a file.

    A prefix under which a ``torch.distributed.checkpoint`` checkpoint lies
    (``prefix/.metadata`` and its data objects; ``s3://bucket/prefix`` or
    ``s3://bucket/prefix/``) is verified as a DCP directory is
    (:mod:`fastpersist.s3dcpverify`)."""
    cfg = config_mod.resolve(config)
    if isinstance(target, (str, os.PathLike)) and os.fspath(target).endswith("/"):
        return s3dcpverify.verify(target, config=cfg)
    url = parse(target)
    try:
        return _verify_object(url, cfg)
    except s3client.ObjectNotFoundError:
        if s3dcpverify.is_checkpoint(url, cfg):
            return s3dcpverify.verify(f"{url}/", config=cfg)
        raise


def _verify_object(url: S3Url, cfg: Any) -> VerifyResult:
    fmt = registry.format_for(url.key)
    with fetch(url, config=cfg, crcs=True, discard=True) as got:
        result = None
        if got.discarded and got.crcs is not None:
            try:
                result = fmt.verify(got.path, s3check.KnownCrcs(got.crcs))
            except s3check.NotKnown as e:
                log.debug("%s: verify needs bytes the streamed check dropped (%s); fetching it whole", url, e)
        if result is not None:
            return _named(result, got.path, str(url))
    with fetch(url, config=cfg) as got:
        return _named(fmt.verify(got.path, handles.handle_for(cfg, read=True)), got.path, str(url))


def _named(result: VerifyResult, local: str, name: str) -> VerifyResult:
    result.path = name
    result.problems = [p.replace(local, name) for p in result.problems]
    result.notes = [p.replace(local, name) for p in result.notes]
    return result


def describe(target: Any, *, clean: bool = False) -> dict:
    """What ``fastpersist info s3://bucket/prefix`` reports: the client and its settings
    (endpoint, region, addressing, retries; never the secrets), whether the bucket
    answers, and the incomplete multipart uploads under the prefix (left by killed
    saves); with ``clean``, those are aborted."""
    url = parse_prefix(target)
    cfg = config_mod.get_default()
    n = cfg.s3_threads
    c = s3client.client(n + 2, cfg.s3_timeout)
    bc = c.meta.config
    out: dict[str, Any] = {
        "url": f"s3://{url.bucket}/{url.key}",
        "client": s3client.client_version(),
        "endpoint": c.meta.endpoint_url,
        "region": c.meta.region_name,
        "addressing_style": (bc.s3 or {}).get("addressing_style", "auto"),
        "retries": bc.retries,
        "threads": n,
        "part_bytes": cfg.s3_part_size,
    }
    try:
        c.head_bucket(Bucket=url.bucket)
        out["bucket"] = "reachable"
    except Exception as e:  # noqa: BLE001 - reported, not raised
        if not s3client.is_client_error(e):
            raise
        out["bucket"] = str(s3client.store_error(e, out["url"], "HeadBucket", saving=False))
        return out
    uploads: list[dict] = []
    kwargs: dict[str, Any] = {"Bucket": url.bucket, "Prefix": url.key}
    while True:
        r = c.list_multipart_uploads(**kwargs)
        uploads.extend({"key": u["Key"], "upload_id": u["UploadId"], "initiated": str(u.get("Initiated", ""))}
                       for u in r.get("Uploads", []))
        if not r.get("IsTruncated"):
            break
        kwargs["KeyMarker"], kwargs["UploadIdMarker"] = r.get("NextKeyMarker"), r.get("NextUploadIdMarker")
    if clean:
        for u in uploads:
            u["aborted"] = s3upload.abort_uploads(c, S3Url(url.bucket, u["key"]), [u["upload_id"]]) == 1
    out["incomplete_uploads"] = uploads
    return out
