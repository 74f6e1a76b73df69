"""The journal of the tiered mode (:mod:`fastpersist.s3tier`): where each ``s3://`` URL's
local copy lives, and what is known of it, in files of the local directory.

``<local_dir>/<bucket>/<key>`` is the local copy of ``s3://bucket/key``;
``<local_dir>/.fastpersist-tier/<hash>.json`` its entry (written atomically: temporary
file, fsync, rename, directory fsync) and ``<hash>.lock`` the lock its drain holds
(``flock``: released by the kernel when the holder dies, so the next start can tell a
drain that was killed from one that is running in another process).

An entry holds the URL, ``seq`` (when it was last saved: the order retention keeps),
``pending`` (a save was made that is not yet confirmed in the store), ``durable`` (the
signature of the local file whose bytes the store was confirmed to hold, and the
object's ETag, or None), ``error`` (the last drain's) and ``evicted`` (the local copy was
removed by retention). A file's signature is its size, modification time, inode and
change time: a file saved again, or written in place, has another.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
from typing import Any, Optional

from fastpersist.commit import fsync_dir, write_and_replace
from fastpersist.s3url import S3Url

__all__ = ["JOURNAL_DIR", "Owner", "entries", "entry_path", "local_path", "new_entry", "read", "remove", "signature", "write"]

#: The journal's folder inside the local directory (bucket names cannot start with a dot).
JOURNAL_DIR = ".fastpersist-tier"

#: Serialises this process's reads-modify-writes of entries.
lock = threading.RLock()


def local_path(url: S3Url, root: str) -> str:
    """``<root>/<bucket>/<key>``; ``ValueError`` for a key that is no plain relative path
    (``..``, ``.``, empty components: two keys would share a local file, or it would lie
    outside ``root``)."""
    base = os.path.join(root, url.bucket)
    path = os.path.normpath(os.path.join(base, url.key))
    if os.path.relpath(path, base) != url.key or url.key.startswith("/"):
        raise ValueError(f"{url}: the tiered mode keeps a local copy at <s3_local_dir>/bucket/key, and this key is "
                         "not a plain relative path (empty, '.' or '..' components); use another key, or direct "
                         "mode (config s3_local_dir=None)")
    return path


def _name(url: S3Url) -> str:
    return hashlib.sha256(str(url).encode()).hexdigest()[:32]


def entry_path(root: str, url: S3Url) -> str:
    """The entry file of ``url``."""
    return os.path.join(root, JOURNAL_DIR, _name(url) + ".json")


def signature(st: os.stat_result) -> list[int]:
    """What identifies one version of a local file: size, mtime, inode, ctime (ns)."""
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]


def read(root: str, url: S3Url) -> Optional[dict]:
    """``url``'s entry, or None."""
    try:
        with open(entry_path(root, url)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def write(root: str, entry: dict) -> None:
    """Replace ``entry``'s file atomically and durably."""
    d = os.path.join(root, JOURNAL_DIR)
    os.makedirs(d, exist_ok=True)
    final = os.path.join(d, _name(S3Url(entry["bucket"], entry["key"])) + ".json")
    tmp = f"{final}.tmp-{os.getpid()}-{threading.get_ident()}"
    # outside fault injection, as it always was (injected faults count the checkpoint's own calls)
    write_and_replace(tmp, final, json.dumps(entry).encode(), exclusive=False, faults=False)
    fsync_dir(d)


def remove(root: str, url: S3Url) -> None:
    """Drop ``url``'s entry (and its lock file)."""
    for p in (entry_path(root, url), entry_path(root, url)[:-5] + ".lock"):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def entries(root: str) -> list[dict]:
    """Every entry of the local directory ``root``."""
    d = os.path.join(root, JOURNAL_DIR)
    out = []
    try:
        names = sorted(os.listdir(d))
    except FileNotFoundError:
        return []
    for n in names:
        if n.endswith(".json"):
            try:
                with open(os.path.join(d, n)) as f:
                    out.append(json.load(f))
            except (FileNotFoundError, ValueError):
                continue
    return out


class Owner:
    """The ``flock`` of URLs whose drain this process owns, counted (several saves of one
    URL may be queued); a lock held by another live process is refused, one whose
    process died is free."""

    def __init__(self) -> None:
        self.held: dict[str, list[int]] = {}  # lock path -> [fd, count]

    def reset(self) -> None:
        """In a forked child: the parent's locks are the parent's."""
        self.held = {}

    def take(self, root: str, url: S3Url, *, wait: bool = False) -> bool:
        """Take (or count once more) ``url``'s lock; False when another process holds it."""
        path = entry_path(root, url)[:-5] + ".lock"
        with lock:
            h = self.held.get(path)
            if h is not None:
                h[1] += 1
                return True
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                os.close(fd)
                return False
            self.held[path] = [fd, 1]
            return True

    def owns(self, root: str, url: S3Url) -> bool:
        with lock:
            return entry_path(root, url)[:-5] + ".lock" in self.held

    def give(self, root: str, url: S3Url) -> None:
        """Count one release; the last one unlocks."""
        path = entry_path(root, url)[:-5] + ".lock"
        with lock:
            h = self.held.get(path)
            if h is None:
                return
            h[1] -= 1
            if h[1] <= 0:
                del self.held[path]
                os.close(h[0])  # releases the flock


def new_entry(url: S3Url, local: str) -> dict[str, Any]:
    """A fresh entry for ``url`` (nothing durable yet)."""
    return {"url": str(url), "bucket": url.bucket, "key": url.key, "local": local, "seq": 0, "pending": False,
            "durable": None, "error": None, "evicted": False}
