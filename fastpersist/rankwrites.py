"""One rank's files of a checkpoint directory that a framework writes one call at a time.

A framework that hands an adapter each file of a checkpoint separately and then asks it
to commit (DeepSpeed's ``CheckpointEngine``: ``makedirs``, ``save`` per file, ``commit``)
needs, per rank: each path redirected into the save's staging directory where the save is
staged (:class:`fastpersist.collectivedir.CollectiveDir`), the directories it wrote
remembered for their fsync, the background saves tracked, and a failed file kept for the
commit instead of raised (raising there would leave the other ranks waiting for this one
at the commit's exchange). :class:`RankWrites` holds that; :meth:`RankWrites.settle` ends
the rank's part: every background save settled, every directory fsynced, this rank's
outcome returned for the ranks to agree on (:func:`fastpersist.collectivedir.conclude`).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable, Optional

from fastpersist.collectivedir import CollectiveDir
from fastpersist.commit import fsync_dir, fsync_path, synced_later
from fastpersist.settle import PendingSaves, settle

__all__ = ["RankWrites"]

log = logging.getLogger(__name__)


class RankWrites:
    """This rank's files of the checkpoint being written (:meth:`begin` starts one)."""

    def __init__(self, logger: logging.Logger = log) -> None:
        self.logger = logger
        self.pending = PendingSaves()  #: the background saves not settled yet
        self.stage: Optional[CollectiveDir] = None  #: where the checkpoint stages, if it does
        self.dirs: set[str] = set()  #: the directories written into (absolute)
        self.error: Optional[BaseException] = None  #: the first failed file of this checkpoint
        self.unsynced: list[str] = []  #: files saved without their own fsyncs, fsynced by settle

    def begin(self, stage: Optional[CollectiveDir]) -> None:
        """Start a checkpoint, staged in ``stage`` (None: written in place)."""
        self.stage = stage
        self.dirs = set()
        self.error = None
        self.unsynced = []

    def makedirs(self, path: str, exist_ok: bool = False) -> str:
        """``os.makedirs`` of ``path`` (in the staging directory where it maps there: every
        rank makes the same one); returns the directory made."""
        staged = self.stage.redirect(path) if self.stage is not None else None
        os.makedirs(staged or path, exist_ok=exist_ok or staged is not None)
        self.dirs.add(os.path.abspath(staged or path))
        return staged or path

    def path(self, path: str) -> str:
        """Where the file ``path`` is written: the same relative path in the staging directory
        (its parent made: it exists in the directory being replaced, where the framework may
        not have made it again), or ``path``."""
        staged = self.stage.redirect(path) if self.stage is not None else None
        if staged is not None:
            os.makedirs(os.path.dirname(staged), exist_ok=True)
            path = staged
        self.dirs.add(os.path.dirname(os.path.abspath(path)))
        return path

    def write(self, path: str, save: Callable[[], Any]) -> None:
        """Run ``save()`` (which writes ``path``, or starts writing it: :meth:`track`); a
        failure is logged and kept for :meth:`settle`, not raised. A blocking fastpersist
        save of ``path`` skips its own fsyncs: :meth:`settle` fsyncs every such file, then
        the directories (concurrent journal commits of a checkpoint's files become one)."""
        try:
            with synced_later(path):
                save()
            self.unsynced.append(path)
        except Exception as e:  # noqa: BLE001 - returned by settle, agreed by every rank
            self.logger.error("fastpersist: saving %s failed: %s", path, e)
            if self.error is None:
                self.error = e

    def track(self, future: Any) -> None:
        """A background save of this checkpoint (:func:`fastpersist.save_async`'s future)."""
        self.pending.add(future)

    def fail(self, error: BaseException) -> None:
        """Fail this checkpoint at :meth:`settle` with ``error`` (unless a file failed first)."""
        if self.error is None:
            self.error = error

    def settle(self, what: str, also: Iterable[str] = ()) -> Optional[BaseException]:
        """End this rank's part: every background save settled (the first error kept, the
        others logged: :func:`fastpersist.settle.settle`), the directories written and those
        of ``also`` that exist fsynced. Returns this rank's error, or None."""
        first = [] if self.error is None else [self.error]
        self.error = None
        try:
            settle(self.pending.take(), errors=first, what=what, logger=self.logger)
            files, self.unsynced = self.unsynced, []
            for f in files:
                if os.path.isfile(f):
                    fsync_path(f)
            for d in sorted(self.dirs | {os.path.abspath(p) for p in also}, reverse=True):  # the deepest first
                if os.path.isdir(d):
                    fsync_dir(d)
        except BaseException as e:  # noqa: BLE001 - the rank's outcome, agreed by every rank
            return e
        return None
