"""The temporary file and the commit of a collective save (:mod:`fastpersist.collectivesave`,
and the background part of ``save_async(group=...)``).

The group leader creates the temporary file (stale temporaries of killed saves are cleaned
first), preallocated to the final size (:func:`create_temp`). Only when every rank reported
success does each group leader fsync the file, rename it over the target and fsync the
directory (:func:`commit_agreed`). If any rank failed (exception, I/O error such as ENOSPC,
injected fault), every rank raises :class:`~fastpersist.errors.DistributedCheckpointError`
naming the failing rank(s) and their errors, the temporary files are removed, and the
previous checkpoint stays untouched. Objects the planner cannot lay out are saved by each
group leader alone with torch's writer (:func:`save_fallback`).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from fastpersist import _sys, pipeline
# commit's functions are called through the module (``commit.fsync_path(...)``): fault
# injection and tests replace them there, and the collective save must see that
from fastpersist import commit
from fastpersist.collectiveplan import Agreed, remove_temp
from fastpersist.coordinator import Coordinator, Local
from fastpersist.errors import DistributedCheckpointError

log = logging.getLogger(__name__)


def create_temp(final: str, size: int) -> str:
    """The write group leader's temporary file next to ``final``, preallocated to ``size``."""
    commit.clean_stale_temps(os.path.dirname(final))
    name = commit.temp_path_for(final)
    fd = _sys.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        _preallocate(fd, size)
    except BaseException:
        os.close(fd)
        remove_temp(name)
        raise
    os.close(fd)
    return name


def commit_agreed(co: Coordinator, agreed: Agreed, tmp: str, cfg: Any, loc: "Local") -> None:
    """Step 5: once every rank has written, each write group's leader puts its file in place.

    With one write group (a shared filesystem) that is fsync, rename, directory fsync.
    With several (node-local copies) the leaders first agree that every copy is
    durable, and each keeps a hard link to the previous file while renaming; if any
    leader's rename fails, the others put their previous file back, so the nodes never
    end with different checkpoints under the same name (a crash between the renames
    can still leave them different; the removed link is then a leftover temporary file).
    Raises :class:`DistributedCheckpointError` on every rank on failure."""
    final, directory = agreed.final, agreed.directory
    leader = agreed.leader == co.rank
    several = len(agreed.groups) > 1
    if several:
        if leader and cfg.fsync:
            loc.run(lambda: commit.fsync_path(tmp))
        ready = co.gather("ready", loc.status)
        try:
            co.check("ready", ready, local=loc.exc,
                     after="The temporary files were removed; the previous file at the path is untouched")
        except DistributedCheckpointError:
            if leader:
                remove_temp(tmp)
            raise
    state = {"renamed": False, "backup": None}

    def place() -> None:
        if cfg.fsync and not several:
            commit.fsync_path(tmp)
        commit.keep_mode(final, tmp)
        if several and os.path.exists(final):
            backup = commit.temp_path_for(final)
            try:
                os.link(final, backup)
                state["backup"] = backup
            except OSError as e:  # no hard links here: the previous file cannot be put back
                log.warning("%s: could not keep the previous %s while committing (%s); if another node's "
                            "commit fails, this node keeps the new file", co.what, final, e)
        _sys.rename(tmp, final)
        state["renamed"] = True
        if cfg.fsync:
            commit.fsync_dir_after_rename(final)  # its error says the new file is in place

    if leader:
        loc.run(place)
        if not state["renamed"]:
            remove_temp(tmp)
    committed = co.gather("commit", loc.status)
    failed = any(committed)
    after = "The temporary files were removed; the previous file at the path is untouched"
    if not several and any(v and v.startswith("DirectorySyncError") for v in committed):
        after = ("The new file is in place at the path (the previous one was replaced), but the fsync of its "
                 "directory failed, so the rename may not survive a crash; save again once the filesystem is healthy")
    if several and leader:
        backup = state["backup"]
        if failed and state["renamed"]:
            try:
                if backup is not None:
                    os.rename(backup, final)
                    after = f"Write groups {agreed.groups}: every group's previous file was put back"
                else:
                    after = (f"Write groups {agreed.groups}: this group's new file could not be rolled back "
                             "(no hard link of the previous one)")
                if cfg.fsync:
                    commit.fsync_dir(directory)
            except OSError as e:
                after = f"Write groups {agreed.groups}: putting the previous {final!r} back failed: {e}"
        elif backup is not None:
            remove_temp(backup)
    elif several and failed:
        after = f"Write groups {agreed.groups}: every group's previous file was put back"
    co.check("commit", committed, local=loc.exc, after=after)


def _preallocate(fd: int, size: int) -> None:
    """Give the temporary file its final size (blocks reserved where the filesystem can)."""
    if size <= 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (95, 22):  # EOPNOTSUPP, EINVAL: no fallocate here
            raise
        os.ftruncate(fd, size)


def save_fallback(co: Coordinator, obj: Any, final: Optional[str], cfg: Any, fmt: Optional[str], leader: bool,
                   loc: Local) -> None:
    """Objects the planner cannot lay out: each group leader saves alone with torch's writer."""

    if leader:
        loc.run(lambda: pipeline.save(obj, final, config=cfg, format=fmt))
    done = co.gather("commit", loc.status)
    co.check("commit", done, local=loc.exc)
