"""The tiered mode of ``s3://`` URLs: saves land on a local disk, a background drain
copies them to object storage, loads read the best tier.

On when ``Config.s3_local_dir`` (``FASTPERSIST_S3_LOCAL_DIR``) names a directory. A save
of ``obj`` to ``s3://bucket/key`` then writes ``<s3_local_dir>/bucket/key`` with the
ordinary local save (atomic, O_DIRECT: the caller returns at disk speed) and queues a
*drain*: a background thread uploads that file as one multipart upload (parts read
from the file, ``s3_threads`` in flight, each with its Content-MD5; aborted on any
error), checks before completing that the file did not change while it was read,
then confirms the object (``HeadObject``: its size, and the ETag the completion
answered) and only then records it durable in the journal
(:mod:`fastpersist.s3journal`). :class:`DrainFuture` (``SaveFuture.wait_durable()``,
:func:`wait_durable`) says when.

A drain killed with its process resumes at the next start: the next tiered save or
load of the process (or ``fastpersist drain``) finds the entries still pending whose
lock nobody holds and drains them again from the local file, aborting the killed
upload (the key's stale uploads). Retention (``s3_keep_local``, ``s3_keep_remote``)
runs after each drain. Loads (:func:`local_copy`) read the local copy when the journal
vouches for it.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from fastpersist import bgjobs, pending, s3client, s3journal, s3upload
from fastpersist.errors import ChecksumError, CheckpointFormatError, DirectorySyncError, ObjectStoreError
from fastpersist.s3url import S3Url, is_s3_url, parse

log = logging.getLogger("fastpersist.s3")

__all__ = ["DrainFuture", "LocalCopy", "Ticket", "abandon", "begin", "enabled", "enqueue", "local_copy", "local_error",
           "local_root", "read_best", "recover", "save_through", "status", "wait_durable"]


class DrainFuture(bgjobs.JobFuture):
    """The drain of one tiered save to the store: done once the object is confirmed
    and recorded durable (or the drain failed: the local copy stays). ``wait()``
    blocks until durable (True; False when ``timeout`` seconds passed first) and raises
    the drain's error (or the local save's) if it failed."""

    def __init__(self, url: str, local: str) -> None:
        super().__init__(_drains)
        self.url = url
        self.local = local

    @property
    def label(self) -> str:
        return self.url

    def describe(self) -> str:
        return f"drain of {self.local} to {self.url}"

    def durable(self) -> bool:
        """Whether the object is confirmed in the store."""
        return self._succeeded()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._exc else "durable")
        return f"DrainFuture({self.url!r}, {state})"


@dataclass
class Ticket:
    """A tiered save in progress: its URL, local directory, local path and config."""

    url: S3Url
    root: str
    local: str
    cfg: Any
    was_pending: bool = False


@dataclass
class LocalCopy:
    """The local copy a tiered read may use: ``path``; ``durable``: the store holds the
    same bytes (a read that fails locally may go to the store)."""

    path: str
    durable: bool


@dataclass(eq=False)
class _Drain:
    """One queued drain: ``wait_local()`` first (an async save's commit), then the upload."""

    ticket: Ticket
    future: DrainFuture
    wait_local: Optional[Callable[[], None]]


# ---- process-wide state (reset in a forked child) ---------------------------------

_drains = bgjobs.JobBoard(lambda job: _run(job), "fastpersist-s3-drain", bgjobs.Wording(
    noun="drain(s) to object storage", collect_by="SaveFuture.wait_durable(), fastpersist.wait_durable()",
    kept="their local copies are kept and they are drained at the next start (or by `fastpersist drain`)",
    failed_note="; the local copy is kept and is drained again at the next start (or by `fastpersist drain`)",
    announce_wait=True))
_owner = s3journal.Owner()
_recovered: set[str] = set()
_queued: dict[str, int] = {}  # url -> drains queued or running in this process (under _drains.lock)


def _reset_in_child() -> None:
    global _recovered, _queued
    _owner.reset()
    _recovered, _queued = set(), {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)


def local_root(cfg: Any) -> Optional[str]:
    """The tiered mode's local directory (absolute), or None (direct mode)."""
    d = getattr(cfg, "s3_local_dir", None)
    return os.path.abspath(d) if d else None


def enabled(cfg: Any) -> bool:
    """Whether ``cfg`` turns the tiered mode on."""
    return local_root(cfg) is not None


# ---- saves -------------------------------------------------------------------------


def begin(target: Any, cfg: Any) -> Ticket:
    """Start a tiered save of ``target``: the local path to write (its folders made),
    the URL's lock taken and its entry marked pending before anything is written, so
    that a kill from here on leaves an entry the next start drains."""
    url = parse(target)
    root = local_root(cfg)
    assert root is not None
    local = s3journal.local_path(url, root)
    _ensure_recovered(root, cfg)
    if not _owner.take(root, url):
        raise ObjectStoreError(
            f"{url}: another process is draining this URL from the local directory {root} (one writer per key, as "
            "for a local file); wait for it, or save to another key", str(url), "TieredSave", "Busy")
    try:
        os.makedirs(os.path.dirname(local), exist_ok=True)
        with s3journal.lock:
            entry = s3journal.read(root, url) or s3journal.new_entry(url, os.path.relpath(local, root))
            t = Ticket(url, root, local, cfg, bool(entry["pending"]))
            entry.update(pending=True, seq=time.time_ns(), evicted=False)
            s3journal.write(root, entry)
    except OSError as e:
        _owner.give(root, url)
        if e.errno is None:
            raise
        raise type(e)(e.errno, f"tiered save of {url}: the journal entry in {root} could not be written "
                      f"({e.strerror or e}); nothing was saved, the previous checkpoint is untouched",
                      e.filename) from e
    except BaseException:
        _owner.give(root, url)
        raise
    return t


def abandon(t: Ticket, keep_pending: bool = False) -> None:
    """The local save of ``t`` failed: nothing to drain (its entry is as before; with
    ``keep_pending``, a new local file may be in place: the next start drains it)."""
    try:
        if not keep_pending:
            _unmark(t)
    finally:
        _owner.give(t.root, t.url)


def _unmark(t: Ticket) -> None:
    try:
        with s3journal.lock:
            entry = s3journal.read(t.root, t.url)
            if entry is not None and not t.was_pending and not _queued.get(str(t.url)):
                entry["pending"] = False
                s3journal.write(t.root, entry)
    except OSError as e:  # the entry stays pending: the next start compares the file and finds nothing new
        log.warning("tiered save of %s: could not update the journal after the failed local save (%s)", t.url, e)


def local_error(e: BaseException, t: Ticket) -> BaseException:
    """The local save's error of a tiered save, naming the URL too (same type and errno)."""
    if not isinstance(e, OSError) or e.errno is None or isinstance(e, (ObjectStoreError, DirectorySyncError)):
        return e
    hint = f"; free space in {t.root} or turn the tiered mode off (s3_local_dir=None)" if e.errno == errno.ENOSPC else ""
    try:
        return type(e)(e.errno, f"tiered save of {t.url}: the local copy could not be written ({e.strerror or e}); "
                       f"nothing was queued for upload, the previous checkpoint (local and remote) is untouched{hint}",
                       t.local)
    except TypeError:  # an OSError subclass with a constructor of its own
        return e


def enqueue(t: Ticket, wait_local: Optional[Callable[[], None]] = None) -> DrainFuture:
    """Queue the drain of ``t``'s local file (after ``wait_local()`` returns: an async
    save's commit; it raises the local save's error). Takes over ``t``'s lock."""
    f = DrainFuture(str(t.url), t.local)
    with _drains.lock:
        _queued[str(t.url)] = _queued.get(str(t.url), 0) + 1
    _drains.submit(_Drain(t, f, wait_local))
    return f


def _run(job: _Drain) -> None:
    """The drain thread's work on one drain (in call order)."""
    t = job.ticket
    exc: Optional[BaseException] = None
    local_failed = False
    try:
        if job.wait_local is not None:
            try:
                job.wait_local()
            except BaseException:  # the local save's error: reported by its future
                local_failed = True
                raise
        _drain(t)
    except BaseException as e:  # noqa: BLE001 - the future's error
        exc = e
    with _drains.lock:
        n = _queued.get(str(t.url), 1) - 1
        if n:
            _queued[str(t.url)] = n
        else:
            _queued.pop(str(t.url), None)
    if local_failed:
        if not isinstance(exc, DirectorySyncError):  # that one: the new file is in place, left pending
            _unmark(t)
    elif exc is not None:
        _note_failure(t, exc)
    _owner.give(t.root, t.url)
    if exc is None:  # before the future says durable: its waiter sees the tiers as retention leaves them
        try:
            _retain(t.root, t.url, t.cfg)
        except Exception as e:  # noqa: BLE001 - retention is best effort, never fails a drain
            log.warning("tiered mode: retention after the drain of %s failed: %s", t.url, e)
    _drains.settle(job, exc, report_at_exit=not local_failed)


def _note_failure(t: Ticket, exc: BaseException) -> None:
    log.error("tiered mode: the drain of %s to %s failed (%s: %s); the local copy is kept and the drain is retried "
              "at the next start or by `fastpersist drain`", t.local, t.url, type(exc).__name__, exc)
    try:
        with s3journal.lock:
            entry = s3journal.read(t.root, t.url)
            if entry is not None:
                entry["error"] = f"{type(exc).__name__}: {exc}"
                s3journal.write(t.root, entry)
    except OSError as e:
        log.warning("tiered mode: could not record the failed drain of %s (%s)", t.url, e)


def _client(cfg: Any) -> Any:
    return s3client.client(cfg.s3_threads + 2, cfg.s3_timeout)


def _drain(t: Ticket) -> None:
    """Upload the local file of ``t``, confirm it, record it durable."""
    fd = os.open(t.local, os.O_RDONLY | os.O_CLOEXEC)
    try:
        sig = s3journal.signature(os.fstat(fd))
        entry = s3journal.read(t.root, t.url)
        if entry is not None and entry.get("durable") and entry["durable"]["sig"] == sig:
            etag = entry["durable"]["etag"]  # these bytes are in the store already
        else:
            etag = _upload(fd, sig, t)
    finally:
        os.close(fd)
    with s3journal.lock:
        entry = s3journal.read(t.root, t.url) or s3journal.new_entry(t.url, os.path.relpath(t.local, t.root))
        entry["durable"] = {"sig": sig, "etag": etag}
        entry["error"] = None
        with _drains.lock:
            later = _queued.get(str(t.url), 0) > 1  # a newer save of the URL is queued behind this one
        try:
            current = s3journal.signature(os.stat(t.local))
        except FileNotFoundError:
            current = None
        entry["pending"] = later or current != sig
        s3journal.write(t.root, entry)


def _upload(fd: int, sig: list[int], t: Ticket) -> str:
    name = str(t.url)

    def unchanged() -> None:
        now = s3journal.signature(os.fstat(fd))
        if now != sig:
            raise ObjectStoreError(
                f"drain of {t.local} to {name}: the local file changed while it was uploaded (size, mtime or ctime); "
                "upload aborted, nothing marked durable", name, "TieredDrain", "LocalFileChanged")

    c = _client(t.cfg)
    up = s3upload.upload_file(fd, sig[0], t.url, c, threads=t.cfg.s3_threads, preferred_part=t.cfg.s3_part_size,
                              before_complete=unchanged)
    size, etag = s3client.head(c, t.url.bucket, t.url.key, name)
    if size != sig[0] or (up.etag and etag != up.etag):
        raise ObjectStoreError(
            f"drain of {t.local} to {name}: the store holds {size} bytes with ETag {etag} after the upload, not the "
            f"{sig[0]} bytes of ETag {up.etag} it completed (another writer?); not marked durable, the local copy is "
            "kept", name, "HeadObject", "Mismatch")
    return etag


# ---- waiting, exit -----------------------------------------------------------------


def wait_durable(target: Any = None, timeout: Optional[float] = None) -> bool:
    """Wait until every tiered save of this process so far (``target``: those of one
    ``s3://`` URL) is durable in the store; False when ``timeout`` seconds passed first.
    Raises the first drain error not yet collected (the local copies stay)."""
    want = str(parse(target)) if target is not None else None

    def mine(f: Any) -> bool:
        return want is None or f.url == want

    end = None if timeout is None else time.monotonic() + timeout
    for job in _drains.snapshot():
        left = None if end is None else max(0.0, end - time.monotonic())
        if mine(job.future) and not job.future._event.wait(left):
            return False
    _drains.raise_uncollected(mine)
    return True


# At exit: wait for the drains still running (said on stderr); report failures nobody
# collected on stderr, with exit status 1. The drain's uploads run on
# ThreadPoolExecutors: this runs before concurrent.futures' exit hook.
bgjobs.at_shutdown(_drains.finish_at_exit)


# ---- recovery ----------------------------------------------------------------------


def _ensure_recovered(root: str, cfg: Any) -> None:
    if root in _recovered:
        return
    _recovered.add(root)
    try:
        recover(root, cfg)
    except Exception as e:  # noqa: BLE001 - a save or load must not fail for this
        log.warning("tiered mode: could not resume the pending drains of %s: %s", root, e)


def recover(root: str, cfg: Any) -> list[DrainFuture]:
    """Queue the drains left pending in ``root`` by processes that ended (killed, or a
    drain that failed): the entries marked pending whose lock nobody holds. A local file
    already durable (same signature) is only unmarked; a missing one is reported."""
    out = []
    _recovered.add(root)
    for entry in s3journal.entries(root):
        if not entry.get("pending"):
            continue
        url = S3Url(entry["bucket"], entry["key"])
        if _owner.owns(root, url) or not _owner.take(root, url):
            continue  # this process's own, or another live process drains it
        local = os.path.join(root, entry["local"])
        try:
            sig = s3journal.signature(os.stat(local))
        except FileNotFoundError:
            sig = None
        durable = entry.get("durable")
        if sig is not None and not (durable and durable["sig"] == sig):
            log.info("tiered mode: resuming the drain of %s to %s", local, url)
            out.append(enqueue(Ticket(url, root, local, cfg, True)))
            continue
        with s3journal.lock:
            entry["pending"] = False
            if sig is None:
                entry["error"] = "the local copy was gone before it was drained"
                log.warning("tiered mode: %s was pending a drain to %s but is gone; nothing to upload", local, url)
            s3journal.write(root, entry)
        _owner.give(root, url)
    return out


# ---- retention ---------------------------------------------------------------------


def _group(key: str) -> str:
    return key.rsplit("/", 1)[0] if "/" in key else ""


def _retain(root: str, url: S3Url, cfg: Any) -> None:
    """Keep the newest ``s3_keep_local`` local copies and ``s3_keep_remote`` objects of
    ``url``'s bucket and key prefix (0: all). A local copy goes only once durable; an
    object goes (with its local copy and entry) only if the store still holds what the
    tier uploaded; the newest durable checkpoint always stays."""
    keep_local, keep_remote = cfg.s3_keep_local, cfg.s3_keep_remote
    if not keep_local and not keep_remote:
        return
    with s3journal.lock:
        group = [e for e in s3journal.entries(root)
                 if e["bucket"] == url.bucket and _group(e["key"]) == _group(url.key)]
    group.sort(key=lambda e: e["seq"], reverse=True)
    if keep_remote:
        durable = [e for e in group if e.get("durable")]
        for e in durable[keep_remote:]:
            _drop_remote(root, e, cfg)
    if keep_local:
        with_local = [e for e in group if not e.get("evicted") and os.path.exists(os.path.join(root, e["local"]))]
        for e in with_local[keep_local:]:
            _evict_local(root, e)


def _locked(root: str, e: dict) -> Optional[S3Url]:
    url = S3Url(e["bucket"], e["key"])
    if _owner.owns(root, url) or not _owner.take(root, url):
        return None
    return url


def _evict_local(root: str, e: dict) -> None:
    url = _locked(root, e)
    if url is None:
        return
    try:
        with s3journal.lock:
            e = s3journal.read(root, url) or e
            local = os.path.join(root, e["local"])
            durable = e.get("durable")
            try:
                sig = s3journal.signature(os.stat(local))
            except FileNotFoundError:
                return
            if e.get("pending") or not durable or durable["sig"] != sig:
                return  # not (or not this version) in the store: kept
            os.unlink(local)
            e["evicted"] = True
            s3journal.write(root, e)
            log.info("tiered mode: removed the local copy %s (durable in %s)", local, url)
    finally:
        _owner.give(root, url)


def _drop_remote(root: str, e: dict, cfg: Any) -> None:
    url = _locked(root, e)
    if url is None:
        return
    try:
        e = s3journal.read(root, url) or e
        if e.get("pending") or not e.get("durable"):
            return
        c = _client(cfg)
        try:
            _size, etag = s3client.head(c, url.bucket, url.key, str(url))
        except s3client.ObjectNotFoundError:
            etag = None
        if etag == e["durable"]["etag"]:
            c.delete_object(Bucket=url.bucket, Key=url.key)
            log.info("tiered mode: deleted %s (older than the newest %d)", url, cfg.s3_keep_remote)
        with s3journal.lock:
            local = os.path.join(root, e["local"])
            try:
                if s3journal.signature(os.stat(local)) == e["durable"]["sig"]:
                    os.unlink(local)
            except FileNotFoundError:
                pass
            s3journal.remove(root, url)
    finally:
        _owner.give(root, url)


# ---- loads -------------------------------------------------------------------------


def local_copy(target: Any, cfg: Any) -> Optional[LocalCopy]:
    """The local copy a load of ``target`` should read, or None (read the object).

    It is used when the journal has an entry for the URL and the file at its local path
    is the version the entry names: the newest save when one is pending (not yet in the
    store), else the durable version, whose object must still carry the ETag recorded
    at the drain (one ``HeadObject``; a store that cannot be reached leaves the local
    copy in use). The read itself then checks every record's CRC-32 as any load does."""
    root = local_root(cfg)
    if root is None or not is_s3_url(target):
        return None
    url = parse(target)
    local = s3journal.local_path(url, root)
    _ensure_recovered(root, cfg)
    pending.wait_before_reading(local)
    entry = s3journal.read(root, url)
    if entry is None:
        return None
    try:
        sig = s3journal.signature(os.stat(local))
    except FileNotFoundError:
        return None
    durable = entry.get("durable")
    same = bool(durable) and durable["sig"] == sig
    if entry.get("pending") and not same:
        return LocalCopy(local, False)
    if not same:
        return None
    try:
        _size, etag = s3client.head(_client(cfg), url.bucket, url.key, str(url))
    except s3client.ObjectNotFoundError:
        return LocalCopy(local, False)
    except ObjectStoreError as e:
        log.warning("tiered mode: %s cannot be checked (%s); reading the local copy %s", url, e, local)
        return LocalCopy(local, True)
    return LocalCopy(local, True) if etag == durable["etag"] else None


def status(root: str) -> list[dict]:
    """The journal's entries of ``root`` (``fastpersist drain`` prints them)."""
    out = []
    for e in sorted(s3journal.entries(root), key=lambda e: e["seq"]):
        state = "pending" if e.get("pending") else ("durable" if e.get("durable") else "local")
        out.append({"url": e["url"], "state": state, "local": None if e.get("evicted") else e["local"],
                    "error": e.get("error")})
    return out



# ---- the entry points' halves (pipeline, asyncsave, loadinto) -------------------------


def save_through(target: Any, cfg: Any, write_local: Callable[[str], Any]) -> DrainFuture:
    """A blocking tiered save: ``write_local(local_path)`` (the ordinary local save),
    then the drain queued. On a local failure nothing is queued and the error names the
    URL (the previous checkpoint stays, in both tiers)."""
    t = begin(target, cfg)
    try:
        write_local(t.local)
    except BaseException as e:
        abandon(t, keep_pending=isinstance(e, DirectorySyncError))  # that one: the new file is in place
        err = local_error(e, t)
        if err is e:
            raise
        raise err from e
    return enqueue(t)


def read_best(target: Any, cfg: Any, read_local: Callable[[str], Any], read_remote: Callable[[], Any]) -> Any:
    """``read_local(path)`` of the local copy :func:`local_copy` chooses, else
    ``read_remote()``. A local read that fails as damaged or unreadable (format or
    checksum error, ``OSError``) goes to the store when the store holds the same
    checkpoint (a warning says so); otherwise its error is raised."""
    copy = local_copy(target, cfg)
    if copy is None:
        return read_remote()
    try:
        return read_local(copy.path)
    except (CheckpointFormatError, ChecksumError, OSError) as e:
        if not copy.durable:
            raise
        log.warning("tiered mode: the local copy %s of %s cannot be read (%s: %s); reading the object instead",
                    copy.path, target, type(e).__name__, e)
    return read_remote()
