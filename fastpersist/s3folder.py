"""Folder checkpoints on object storage: many objects under one prefix, committed by a
manifest object written last.

Frameworks that save a *folder* (Accelerate's ``save_state``, DeepSpeed's tag
directories) need, on object storage, a commit that readers can trust: S3 has no
directory and no rename. Every save into the folder ``s3://bucket/prefix/FOLDER`` is a
*generation* of its own: each file is uploaded as one object under a fresh prefix,
``FOLDER/.fastpersist-gen-TOKEN/RELPATH`` (each a multipart upload that appears whole or
not at all), and then the commit object ``FOLDER/.fastpersist-manifest.json`` is written
(one ``PutObject``: the old manifest or the new one, never a mix), naming every object
of the generation with its key (relative to the folder), size and ETag. Readers
(:func:`download`, :func:`read_manifest`) follow the manifest and refuse a folder
without one, or whose objects no longer match it (size or ETag changed since the commit).

So a save into a folder that holds a committed checkpoint (a fixed Accelerate
``output_dir``, a reused DeepSpeed tag) never touches that checkpoint until its own
manifest is in: a save that fails or is killed leaves the previous checkpoint loadable.
After the new manifest is written, :func:`commit` deletes the objects the previous
manifest named and the leftovers of failed saves (objects under other generation
prefixes of the folder); the next :func:`begin` aborts the incomplete multipart uploads
a killed save left. Objects of another folder (one nested in this one: a prefix with a
manifest of its own, or anything under a ``.fastpersist-`` name that is not this
folder's) are never deleted.

Folders committed by the first format (manifest version 1: objects directly at
``FOLDER/RELPATH``) still load, and a save into one keeps them loadable until its
manifest is in; then the objects the old manifest named are deleted.

The adapters stage the framework's own folder in a local temporary directory (in
``TMPDIR``) and hand it to :func:`save` or, with several processes, to
:func:`begin` (one process; its generation token is shared with the others) /
:func:`upload_files` (every process) / :func:`commit` (one process).
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import re
import secrets
import shutil
import time
from typing import Any, Callable, Iterable, Optional

from fastpersist import handles, s3client, s3download, s3upload
from fastpersist import config as config_mod
from fastpersist.plan import WritePlan
from fastpersist.s3url import S3Url, is_s3_url, parse, parse_prefix

__all__ = ["GENERATION_PREFIX", "MANIFEST", "UncommittedFolderError", "begin", "commit", "delete", "delete_object",
           "discard", "download", "folder_url", "get_small", "is_committed", "is_s3_url", "join", "local_files", "object_url",
           "put_small", "read_manifest", "save", "upload_files"]

log = logging.getLogger("fastpersist.s3")

#: The commit object of a folder, relative to the folder.
MANIFEST = ".fastpersist-manifest.json"
#: The objects of one save live under ``FOLDER/GENERATION_PREFIX + TOKEN/``.
GENERATION_PREFIX = ".fastpersist-gen-"
_FORMAT = "fastpersist-s3-folder"
_VERSION = 2
_TOKEN = re.compile(r"[0-9a-z]+")
_OURS = ".fastpersist-"  # a key component starting with it is fastpersist's (a manifest, a generation)


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


def _generation_dir(generation: str) -> str:
    if not isinstance(generation, str) or not _TOKEN.fullmatch(generation):
        raise ValueError(f"{generation!r} is not a generation token of fastpersist.s3folder.begin")
    return GENERATION_PREFIX + generation


def _safe_rel(rel: Any) -> bool:
    """A relative key without empty, ``.`` or ``..`` components (stays in the folder)."""
    return isinstance(rel, str) and bool(rel) and all(p not in ("", ".", "..") for p in rel.split("/"))


def _ours(rel: str) -> bool:
    return any(p.startswith(_OURS) for p in rel.split("/"))


def _entry_key(rel: str, entry: dict) -> str:
    """The key, relative to the folder, of the object a manifest entry names (version 1
    manifests: the file's own path)."""
    return entry.get("key", rel)


def read_manifest(target: Any, *, config: Any = None) -> dict:
    """The commit object of the folder ``target``: ``{"files": {relpath: {"key", "size",
    "etag"}}, ...}`` (``key`` relative to the folder; manifests of the first format have
    none: the object is at ``relpath``); :class:`UncommittedFolderError` when the folder
    has none."""
    url = folder_url(target)
    try:
        raw = get_small(f"{url}/{MANIFEST}", config=config)
    except s3client.ObjectNotFoundError as e:
        if e.code == "NoSuchBucket":
            raise
        raise UncommittedFolderError(
            f"{url} holds no committed checkpoint: its commit object {MANIFEST} is missing (never saved there, or "
            "the first save into it failed, was killed, or is still running). Load another checkpoint, or save "
            "again into this folder", str(url), "GetObject", "NoSuchKey") from e
    try:
        manifest = json.loads(raw)
        if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT or \
                not isinstance(manifest.get("files"), dict):
            raise ValueError("not a fastpersist folder manifest")
        if manifest.get("version") not in (1, _VERSION):
            raise ValueError(f"version {manifest.get('version')!r}; this fastpersist reads versions 1 and "
                             f"{_VERSION} (upgrade fastpersist)")
        for rel, entry in manifest["files"].items():
            if not isinstance(entry, dict) or not _safe_rel(rel) or not _safe_rel(_entry_key(rel, entry)):
                raise ValueError(f"bad entry {rel!r}: {entry!r}")
    except ValueError as e:
        raise UncommittedFolderError(f"{url}/{MANIFEST} is not a fastpersist folder manifest ({e}); the folder "
                                     "cannot be trusted", str(url), "GetObject", "BadManifest") from e
    return manifest


def object_url(target: Any, manifest: dict, relpath: str) -> str:
    """``s3://`` URL of the object that holds the file ``relpath`` of the committed folder
    ``target`` (``manifest``: what :func:`read_manifest` returned), for stock readers."""
    return join(target, _entry_key(relpath, manifest["files"][relpath]))


def is_committed(target: Any, *, config: Any = None) -> bool:
    """Whether the folder ``target`` has its commit object."""
    try:
        read_manifest(target, config=config)
        return True
    except UncommittedFolderError:
        return False


def _claimed(owns: Optional[Callable[[str], bool]]) -> Callable[[str], bool]:
    """Objects outside the generations (files of the first format) that a save may clean:
    those ``owns`` claims (default: all), never fastpersist's own names (another folder's
    manifest or generations)."""
    claims = owns or (lambda _rel: True)
    return lambda rel: not _ours(rel) and claims(rel)


def begin(target: Any, *, owns: Optional[Callable[[str], bool]] = None, config: Any = None) -> str:
    """Start a save into the folder ``target`` (one process, before any file is
    uploaded): the incomplete multipart uploads under the folder's generations (left by
    killed saves; those of first-format files: where ``owns`` claims them) are aborted.
    The committed checkpoint in the folder, if any, is not touched. Returns the new
    save's generation token, for :func:`upload_files` (every process) and :func:`commit`."""
    url = folder_url(target)
    c = _client(config_mod.resolve(config))
    claimed = _claimed(owns)
    prefix = url.key + "/"
    kwargs: dict[str, Any] = {"Bucket": url.bucket, "Prefix": prefix}
    stale: list[tuple[str, str]] = []
    while True:
        r = _call("ListMultipartUploads", str(url), c.list_multipart_uploads, True, **kwargs)
        for u in r.get("Uploads", []):
            rel = u["Key"][len(prefix):]
            if rel.startswith(GENERATION_PREFIX) or claimed(rel):
                stale.append((u["Key"], u["UploadId"]))
        if not r.get("IsTruncated"):
            break
        kwargs["KeyMarker"], kwargs["UploadIdMarker"] = r.get("NextKeyMarker"), r.get("NextUploadIdMarker")
    for key, upload_id in stale:
        s3upload.abort_uploads(c, S3Url(url.bucket, key), [upload_id])
    # time-ordered (a listing shows the generations in the order of their saves), unique
    return f"{time.time_ns():016x}{secrets.token_hex(6)}"


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


def local_files(local_dir: Any) -> list[str]:
    """The files under ``local_dir`` that :func:`upload_files` uploads: their relative paths
    (``/``-separated), sorted."""
    root = os.fspath(local_dir)
    rels = (os.path.relpath(os.path.join(d, n), root).replace(os.sep, "/") for d, _s, fs in os.walk(root) for n in fs)
    return sorted(rel for rel in rels if rel != MANIFEST)


def upload_files(local_dir: Any, target: Any, *, generation: str, only: Optional[Callable[[str], bool]] = None,
                 config: Any = None) -> dict[str, dict]:
    """Upload every file under ``local_dir`` (with ``only``, those for which ``only(relpath)``
    is true) into the generation ``generation`` (from :func:`begin`) of the folder
    ``target``, one object each at ``FOLDER/.fastpersist-gen-TOKEN/RELPATH``; returns
    ``{relpath: {"key", "size", "etag"}}`` for :func:`commit` (``key`` relative to the
    folder)."""
    url = folder_url(target)
    gen_dir = _generation_dir(generation)
    cfg = config_mod.resolve(config)
    c = _client(cfg)
    root = os.fspath(local_dir)
    out: dict[str, dict] = {}
    for rel in local_files(root):
        if only is None or only(rel):
            key = f"{gen_dir}/{rel}"
            path = os.path.join(root, *rel.split("/"))
            out[rel] = {"key": key, **_upload_file(path, S3Url(url.bucket, f"{url.key}/{key}"), cfg, c)}
    return out


def _previous(url: S3Url, config: Any) -> Optional[dict]:
    """The folder's manifest before a commit replaces it (None: none, or unreadable)."""
    try:
        return read_manifest(url, config=config)
    except UncommittedFolderError:
        return None


def commit(target: Any, files: dict[str, dict], *, generation: str, owns: Optional[Callable[[str], bool]] = None,
           extra: Optional[dict] = None, config: Any = None) -> dict:
    """Commit the generation ``generation`` of the folder ``target``: check that every
    object of ``files`` (what :func:`upload_files` returned, merged over every process)
    is there as uploaded, write the folder's manifest naming them (one ``PutObject``:
    the commit), then delete the objects the previous manifest named, the other
    generations' objects (leftovers of failed saves) and, of the objects outside any
    generation (files of the first format), the unlisted ones ``owns(relpath)`` claims
    (default: all). Returns the manifest."""
    url = folder_url(target)
    gen_dir = _generation_dir(generation)
    c = _client(config_mod.resolve(config))
    present = _list(c, url)
    for rel, entry in files.items():  # what the manifest lists is what is there
        key = entry.get("key")
        if key != f"{gen_dir}/{rel}":
            raise ValueError(f"cannot commit {url}: {rel} is not an object of generation {generation} ({key!r})")
        got = present.get(key)
        if got is None or got["size"] != entry["size"] or got["etag"] != entry["etag"]:
            raise UncommittedFolderError(
                f"cannot commit {url}: {rel} is {'missing' if got is None else 'not the object uploaded'} "
                "(another writer in this folder?); the folder keeps its previous commit", str(url), "Commit",
                "Changed")
    previous = _previous(url, config)
    manifest = {"format": _FORMAT, "version": _VERSION, "generation": generation,
                "files": {rel: {"key": e["key"], "size": e["size"], "etag": e["etag"]}
                          for rel, e in sorted(files.items())}}
    if extra:
        manifest["extra"] = extra
    put_small(f"{url}/{MANIFEST}", json.dumps(manifest, indent=1).encode(), config=config)
    keep = {e["key"] for e in files.values()} | {MANIFEST}
    stale = set()
    if previous is not None:
        stale |= {_entry_key(rel, e) for rel, e in previous["files"].items()} & set(present)
    stale |= {rel for rel in present if rel.startswith(GENERATION_PREFIX)}
    nested = [rel[:-len(MANIFEST)] for rel in present if rel.endswith("/" + MANIFEST)]  # other folders inside
    claimed = _claimed(owns)
    stale |= {rel for rel in present if claimed(rel) and not any(rel.startswith(n) for n in nested)}
    stale -= keep
    if stale:
        try:
            _delete_keys(c, url, sorted(stale))
        except s3client.ObjectStoreError as e:  # the commit stands; leftovers go at the next save
            log.warning("committed %s, but could not delete %d object(s) of its previous checkpoint or failed "
                        "saves: %s", url, len(stale), e)
    return manifest


def discard(target: Any, generation: str, *, config: Any = None) -> None:
    """Delete the objects of the uncommitted generation ``generation`` of the folder
    ``target`` (a save that failed; best effort: what is left goes at the next commit)."""
    url = folder_url(target)
    gen_dir = _generation_dir(generation)
    c = _client(config_mod.resolve(config))
    sub = S3Url(url.bucket, f"{url.key}/{gen_dir}")
    _delete_keys(c, url, [f"{gen_dir}/{rel}" for rel in _list(c, sub)])


def save(local_dir: Any, target: Any, *, owns: Optional[Callable[[str], bool]] = None,
         extra: Optional[dict] = None, config: Any = None) -> dict:
    """Upload the local folder ``local_dir`` to the folder ``target`` and commit it
    (:func:`begin`, :func:`upload_files`, :func:`commit` in one process). On failure the
    folder's previous commit stands and this save's objects are deleted (best effort)."""
    generation = begin(target, owns=owns, config=config)
    try:
        files = upload_files(local_dir, target, generation=generation, config=config)
    except BaseException:
        try:
            discard(target, generation, config=config)
        except Exception as e:  # noqa: BLE001 - the upload's error is the one to raise
            log.warning("could not delete the objects of the failed save into %s: %s", target, e)
        raise
    return commit(target, files, generation=generation, owns=owns, extra=extra, config=config)


def download(target: Any, local_dir: Any, *, only: Optional[Callable[[str], bool]] = None,
             config: Any = None) -> dict:
    """Copy the committed folder ``target`` into ``local_dir`` (the files its manifest
    lists, from the objects it names; with ``only``, those for which ``only(relpath)`` is
    true); every object must still be the one committed (its size and ETag), else
    :class:`UncommittedFolderError`. Returns the manifest."""
    url = folder_url(target)
    cfg = config_mod.resolve(config)
    manifest = read_manifest(url, config=cfg)
    c = _client(cfg)
    root = os.fspath(local_dir)
    for rel, entry in manifest["files"].items():
        if only is not None and not only(rel):
            continue
        obj = S3Url(url.bucket, f"{url.key}/{_entry_key(rel, entry)}")
        dest = os.path.join(root, *rel.split("/"))
        if os.path.commonpath([os.path.abspath(dest), os.path.abspath(root)]) != os.path.abspath(root):
            raise UncommittedFolderError(f"{url}/{MANIFEST} lists {rel!r}, outside the folder", str(url),
                                         "GetObject", "BadManifest")
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        try:
            got = s3download.fetch(obj, c, threads=cfg.s3_threads, range_size=cfg.s3_part_size)
        except s3client.ObjectNotFoundError as e:
            raise UncommittedFolderError(f"{url}: {rel}, listed in its commit object, is missing ({obj}): a newer "
                                         "save into the folder committed and replaced it (load again), or the "
                                         "object was deleted", str(url), "GetObject", "NoSuchKey") from e
        with got:
            if got.size != entry["size"] or got.etag != entry["etag"]:
                raise UncommittedFolderError(
                    f"{url} changed after its commit: {rel} ({obj}) is not the object committed (size {got.size}, "
                    f"ETag {got.etag}; committed {entry['size']}, {entry['etag']}); another writer changed it",
                    str(url), "GetObject", "Changed")
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
