"""Folder checkpoints on object storage: many objects under one prefix, committed by a
manifest object written last.

Frameworks that save a *folder* (Accelerate's ``save_state``, DeepSpeed's tag
directories) need, on object storage, a commit that readers can trust: S3 has no
directory and no rename. Here every file of the folder is uploaded as its own object,
``s3://bucket/prefix/FOLDER/RELPATH`` (each one a multipart upload that appears whole
or not at all), and then the commit object ``FOLDER/.fastpersist-manifest.json`` is
written, listing every object with its size and ETag. Readers (:func:`download`,
:func:`read_manifest`) refuse a folder without its manifest, and a folder whose objects
no longer match it (size or ETag changed since the commit).

A save into a folder that holds a committed checkpoint first deletes that manifest
(the folder reads as uncommitted from then until the new manifest is written), so a
failed save never leaves a folder that loads as a mix of two checkpoints; the previous
checkpoint in *another* folder (Accelerate's ``checkpoint_N-1``, DeepSpeed's previous
tag) is never touched. Leftovers of a failed or killed save (its objects, its
incomplete multipart uploads) are removed by the next save into the same folder: its
objects are overwritten or deleted at its commit, the incomplete uploads under the
folder aborted when it begins.

The adapters stage the framework's own folder in a local temporary directory (in
``TMPDIR``) and hand it to :func:`save` or, with several processes, to
:func:`begin` / :func:`upload_files` / :func:`commit`.
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import shutil
from typing import Any, Callable, Iterable, Optional

from fastpersist import handles, s3client, s3download, s3upload
from fastpersist import config as config_mod
from fastpersist.plan import WritePlan
from fastpersist.s3url import S3Url, is_s3_url, parse, parse_prefix

__all__ = ["MANIFEST", "UncommittedFolderError", "begin", "commit", "delete", "delete_object", "download", "folder_url",
           "get_small", "is_committed", "is_s3_url", "join", "put_small", "read_manifest", "save",
           "upload_files"]

log = logging.getLogger("fastpersist.s3")

#: The commit object of a folder, relative to the folder.
MANIFEST = ".fastpersist-manifest.json"
_FORMAT = "fastpersist-s3-folder"
_VERSION = 1


class UncommittedFolderError(s3client.ObjectNotFoundError):
    """A folder on object storage without its commit object (never committed, or a save
    into it failed or is running), or whose objects changed since the commit."""


def folder_url(target: Any) -> S3Url:
    """``S3Url`` of a folder: ``s3://bucket/prefix`` (no trailing slash in the key)."""
    url = target if isinstance(target, S3Url) else parse_prefix(target)
    key = url.key.rstrip("/")
    if not key:
        raise ValueError(f"{target!r} names a bucket: give a folder, s3://{url.bucket}/PREFIX")
    return S3Url(url.bucket, key)


def join(target: Any, *parts: str) -> str:
    """``s3://bucket/prefix/part/...`` (one slash between the parts)."""
    url = folder_url(target)
    rest = "/".join(p.strip("/") for p in parts if p.strip("/"))
    return f"s3://{url.bucket}/{url.key}/{rest}" if rest else str(url)


def _client(cfg: Any) -> Any:
    return s3client.client(cfg.s3_threads + 2, cfg.s3_timeout)


def _call(operation: str, url: str, fn: Callable[..., Any], saving: bool, **kwargs: Any) -> Any:
    try:
        return fn(**kwargs)
    except Exception as e:  # noqa: BLE001 - named below
        if not s3client.is_client_error(e):
            raise
        raise s3client.store_error(e, url, operation, saving=saving) from e


def _list(c: Any, url: S3Url) -> dict[str, dict]:
    """Every object under the folder: relative key -> ``{"size", "etag"}``."""
    out: dict[str, dict] = {}
    prefix = url.key + "/"
    kwargs: dict[str, Any] = {"Bucket": url.bucket, "Prefix": prefix}
    while True:
        r = _call("ListObjectsV2", str(url), c.list_objects_v2, False, **kwargs)
        for o in r.get("Contents", []):
            if o["Key"].endswith("/"):  # a "directory" marker (filesystem-backed stores list them)
                continue
            out[o["Key"][len(prefix):]] = {"size": int(o["Size"]), "etag": str(o.get("ETag", ""))}
        if not r.get("IsTruncated"):
            return out
        kwargs["ContinuationToken"] = r["NextContinuationToken"]


def _delete_keys(c: Any, url: S3Url, rels: Iterable[str]) -> None:
    # One DeleteObject per key: DeleteObjects needs a Content-MD5 that some stores
    # (s3proxy) insist on and recent botocore no longer sends; checkpoints have few files.
    for rel in rels:
        key = f"{url.key}/{rel}"
        _call("DeleteObject", f"s3://{url.bucket}/{key}", c.delete_object, True, Bucket=url.bucket, Key=key)


def put_small(target: Any, data: bytes, *, config: Any = None) -> str:
    """Write a small object in one request (``PutObject``: whole or not at all); returns
    its ETag."""
    url = parse(target)
    c = _client(config_mod.resolve(config))
    r = _call("PutObject", str(url), c.put_object, True, Bucket=url.bucket, Key=url.key, Body=data,
              ContentType="application/octet-stream")
    return str(r.get("ETag", ""))


def get_small(target: Any, *, config: Any = None) -> bytes:
    """The bytes of a small object (``ObjectNotFoundError`` when there is none)."""
    url = parse(target)
    c = _client(config_mod.resolve(config))
    r = _call("GetObject", str(url), c.get_object, False, Bucket=url.bucket, Key=url.key)
    return r["Body"].read()


def delete_object(target: Any, *, config: Any = None) -> None:
    """Delete one object (no error when there is none, as S3's ``DeleteObject``)."""
    url = parse(target)
    c = _client(config_mod.resolve(config))
    _call("DeleteObject", str(url), c.delete_object, True, Bucket=url.bucket, Key=url.key)


def read_manifest(target: Any, *, config: Any = None) -> dict:
    """The commit object of the folder ``target``: ``{"files": {relpath: {"size", "etag"}},
    ...}``; :class:`UncommittedFolderError` when the folder has none."""
    url = folder_url(target)
    try:
        raw = get_small(f"{url}/{MANIFEST}", config=config)
    except s3client.ObjectNotFoundError as e:
        if e.code == "NoSuchBucket":
            raise
        raise UncommittedFolderError(
            f"{url} holds no committed checkpoint: its commit object {MANIFEST} is missing (never saved there, or "
            "the save into it failed, was killed, or is still running). Load another checkpoint, or save again "
            "into this folder", str(url), "GetObject", "NoSuchKey") from e
    try:
        manifest = json.loads(raw)
        if manifest.get("format") != _FORMAT or not isinstance(manifest.get("files"), dict):
            raise ValueError("not a fastpersist folder manifest")
    except ValueError as e:
        raise UncommittedFolderError(f"{url}/{MANIFEST} is not a fastpersist folder manifest ({e}); the folder "
                                     "cannot be trusted", str(url), "GetObject", "BadManifest") from e
    return manifest


def is_committed(target: Any, *, config: Any = None) -> bool:
    """Whether the folder ``target`` has its commit object."""
    try:
        read_manifest(target, config=config)
        return True
    except UncommittedFolderError:
        return False


def begin(target: Any, *, config: Any = None) -> None:
    """Start a save into the folder ``target`` (one process, before any file is uploaded):
    its commit object is deleted, so the folder reads as uncommitted until :func:`commit`,
    and the incomplete multipart uploads under it (left by killed saves) are aborted."""
    url = folder_url(target)
    c = _client(config_mod.resolve(config))
    _call("DeleteObject", f"{url}/{MANIFEST}", c.delete_object, True, Bucket=url.bucket, Key=f"{url.key}/{MANIFEST}")
    kwargs: dict[str, Any] = {"Bucket": url.bucket, "Prefix": url.key + "/"}
    stale: list[tuple[str, str]] = []
    while True:
        r = _call("ListMultipartUploads", str(url), c.list_multipart_uploads, True, **kwargs)
        stale.extend((u["Key"], u["UploadId"]) for u in r.get("Uploads", []))
        if not r.get("IsTruncated"):
            break
        kwargs["KeyMarker"], kwargs["UploadIdMarker"] = r.get("NextKeyMarker"), r.get("NextUploadIdMarker")
    for key, upload_id in stale:
        s3upload.abort_uploads(c, S3Url(url.bucket, key), [upload_id])


def _file_plan(path: str) -> WritePlan:
    """The plan of an existing local file's bytes (mapped, copy-on-write: never modified)."""
    size = os.path.getsize(path)
    if size == 0:
        return WritePlan([], [], 0, 0)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    buf = (ctypes.c_char * size).from_buffer(m)
    return WritePlan([(0, ctypes.addressof(buf), size, -1)], [], 0, size, keepalive=[buf, m])


def _upload_file(path: str, url: S3Url, cfg: Any, c: Any) -> dict:
    plan = _file_plan(path)
    mapped = [k for k in plan.keepalive if isinstance(k, mmap.mmap)]
    try:
        s3upload.upload_plan(plan, url, c, handles.handle_for(cfg), threads=cfg.s3_threads,
                             preferred_part=cfg.s3_part_size)
    finally:
        plan.keepalive.clear()  # the ctypes view first: a mapping with views cannot close
        del plan
        for m in mapped:
            m.close()
    size, etag = s3client.head(c, url.bucket, url.key, str(url))
    return {"size": size, "etag": etag}


def upload_files(local_dir: Any, target: Any, *, config: Any = None) -> dict[str, dict]:
    """Upload every file under ``local_dir`` to the folder ``target`` (same relative
    paths, one object each); returns ``{relpath: {"size", "etag"}}`` for :func:`commit`."""
    url = folder_url(target)
    cfg = config_mod.resolve(config)
    c = _client(cfg)
    root = os.fspath(local_dir)
    out: dict[str, dict] = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in sorted(files):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            if rel == MANIFEST:
                continue
            out[rel] = _upload_file(path, S3Url(url.bucket, f"{url.key}/{rel}"), cfg, c)
    return out


def commit(target: Any, files: dict[str, dict], *, owns: Optional[Callable[[str], bool]] = None,
           extra: Optional[dict] = None, config: Any = None) -> dict:
    """Commit the folder ``target``: write its manifest listing ``files`` (what
    :func:`upload_files` returned, merged over every process), then delete the objects
    under the folder that it does not list and that ``owns(relpath)`` claims (default:
    all; leftovers of failed saves and stale files of the previous checkpoint). Returns
    the manifest."""
    url = folder_url(target)
    c = _client(config_mod.resolve(config))
    present = _list(c, url)
    for rel, entry in files.items():  # what the manifest lists is what is there
        got = present.get(rel)
        if got is None or got["size"] != entry["size"] or got["etag"] != entry["etag"]:
            raise UncommittedFolderError(
                f"cannot commit {url}: {rel} is {'missing' if got is None else 'not the object uploaded'} "
                "(another writer in this folder?); the folder stays uncommitted", str(url), "Commit", "Changed")
    manifest = {"format": _FORMAT, "version": _VERSION, "files": dict(sorted(files.items()))}
    if extra:
        manifest["extra"] = extra
    put_small(f"{url}/{MANIFEST}", json.dumps(manifest, indent=1).encode(), config=config)
    claims = owns or (lambda _rel: True)
    stale = [rel for rel in present if rel not in files and rel != MANIFEST and claims(rel)]
    if stale:
        try:
            _delete_keys(c, url, stale)
        except s3client.ObjectStoreError as e:  # the commit stands; leftovers go at the next save
            log.warning("committed %s, but could not delete %d stale object(s) under it: %s", url, len(stale), e)
    return manifest


def save(local_dir: Any, target: Any, *, owns: Optional[Callable[[str], bool]] = None,
         extra: Optional[dict] = None, config: Any = None) -> dict:
    """Upload the local folder ``local_dir`` to the folder ``target`` and commit it
    (:func:`begin`, :func:`upload_files`, :func:`commit` in one process)."""
    begin(target, config=config)
    return commit(target, upload_files(local_dir, target, config=config), owns=owns, extra=extra, config=config)


def download(target: Any, local_dir: Any, *, only: Optional[Callable[[str], bool]] = None,
             config: Any = None) -> dict:
    """Copy the committed folder ``target`` into ``local_dir`` (the files its manifest
    lists; with ``only``, those for which ``only(relpath)`` is true); every object must
    still be the one committed (its ETag), else :class:`UncommittedFolderError`.
    Returns the manifest."""
    url = folder_url(target)
    cfg = config_mod.resolve(config)
    manifest = read_manifest(url, config=cfg)
    c = _client(cfg)
    root = os.fspath(local_dir)
    for rel, entry in manifest["files"].items():
        if only is not None and not only(rel):
            continue
        obj = S3Url(url.bucket, f"{url.key}/{rel}")
        dest = os.path.join(root, *rel.split("/"))
        if os.path.commonpath([os.path.abspath(dest), os.path.abspath(root)]) != os.path.abspath(root):
            raise UncommittedFolderError(f"{url}/{MANIFEST} lists {rel!r}, outside the folder", str(url),
                                         "GetObject", "BadManifest")
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        try:
            got = s3download.fetch(obj, c, threads=cfg.s3_threads, range_size=cfg.s3_part_size)
        except s3client.ObjectNotFoundError as e:
            raise UncommittedFolderError(f"{url} is damaged: {rel}, listed in its commit object, is missing",
                                         str(url), "GetObject", "NoSuchKey") from e
        with got:
            if got.size != entry["size"] or got.etag != entry["etag"]:
                raise UncommittedFolderError(
                    f"{url} changed after its commit: {rel} is not the object committed (size {got.size}, "
                    f"ETag {got.etag}; committed {entry['size']}, {entry['etag']}); another save into this folder "
                    "is running or failed", str(url), "GetObject", "Changed")
            with open(got.path, "rb") as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
    return manifest


def delete(target: Any, *, config: Any = None) -> None:
    """Delete the folder ``target``: its commit object first (so a deletion cut short
    leaves an uncommitted folder, never a partial one that loads), then every object
    under it."""
    url = folder_url(target)
    c = _client(config_mod.resolve(config))
    _call("DeleteObject", f"{url}/{MANIFEST}", c.delete_object, True, Bucket=url.bucket, Key=f"{url.key}/{MANIFEST}")
    rest = list(_list(c, url))
    if rest:
        _delete_keys(c, url, rest)

