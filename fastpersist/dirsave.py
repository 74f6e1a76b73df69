"""A framework's one call that writes a whole checkpoint directory from every rank, made atomic.

Where one framework call writes a checkpoint directory from every process (Accelerate's
``save_state``), :func:`save_directory` runs the steps of :mod:`fastpersist.collectivedir`
around it: the committers clean what killed saves left, the ranks agree on a staging
directory (or on writing in place, where a rank sees a reason not to stage: logged as a
warning), the call writes into the staging directory, a failure on any rank removes it and
raises on every rank, the committer swaps it in, and once it is durable rank 0 runs
``after`` (the retention of older checkpoints: :mod:`fastpersist.retention`).

:class:`CheckpointDir` says where the staging directory goes: beside the checkpoint, or
one level up where the checkpoint's parent is a directory the framework lists and parses
(Accelerate's ``checkpoints/``: every entry read as a checkpoint number).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import shutil
from typing import Any, Callable, Optional

from fastpersist.collectivedir import CollectiveDir, Exchange, agree, failed_elsewhere
from fastpersist.commit import fsync_dir, synced_later
from fastpersist.dircommit import StagedDir, fsync_tree_and_parent, rebase

__all__ = ["CheckpointDir", "relocate", "save_directory"]

log = logging.getLogger(__name__)


class CheckpointDir(StagedDir):
    """The checkpoint directory ``final``, staged beside itself, or one level up where its
    parent is ``listed`` (a directory whose every entry the framework parses as a
    checkpoint, so that no staging directory may appear there).

    ``siblings(name)``: whether ``name`` is another checkpoint of ``listed`` (the
    framework's naming), whose leftovers in the staging parent the cleanup gives back
    there (a killed fallback commit's moved-aside directory)."""

    def __init__(self, final: str, *, listed: Optional[str] = None,
                 siblings: Optional[Callable[[str], object]] = None) -> None:
        parent = os.path.dirname(os.path.realpath(final))
        up = listed is not None and parent == os.path.realpath(listed)
        super().__init__(final, os.path.dirname(parent) if up else parent)
        self.siblings = siblings

    def clean_leftovers(self, *, operation: str, logger: logging.Logger, fsync_after_restore: bool,
                        restore_other: Optional[Callable[[str], Optional[str]]] = None) -> None:
        """:meth:`fastpersist.dircommit.StagedDir.clean_leftovers`, giving the leftovers of
        the other checkpoints (``siblings``) back to the parent."""

        def restore_sibling(name: str) -> Optional[str]:
            if self.siblings is not None and self.siblings(name):
                return os.path.join(self.parent, name)
            return None if restore_other is None else restore_other(name)

        super().clean_leftovers(operation=operation, logger=logger, fsync_after_restore=fsync_after_restore,
                                restore_other=restore_sibling)


def relocate(location: Any, staging: str, final: str) -> Any:
    """``location`` (a path the framework returned, ``str`` or ``pathlib.Path``) with the
    staging directory replaced by the final one; other paths unchanged."""
    moved = rebase(os.fspath(location), staging, final)
    path = os.fspath(location) if moved is None else moved
    return pathlib.Path(path) if isinstance(location, pathlib.PurePath) else path


def _barrier(exchange: Exchange) -> None:
    exchange.gather(None)


def save_directory(staged: StagedDir, write: Callable[[Optional[str]], Any], *, rank: int, committer: bool,
                   exchange: Exchange, is_checkpoint_entry: Callable[[str], object], what: str, operation: str,
                   peer: str = "rank", per_node: bool = False, remove_new_on_failure: bool = False,
                   after: Optional[Callable[[str], None]] = None, rollback: Callable[[], None] = lambda: None,
                   logger: logging.Logger = log) -> Any:
    """Every rank: run ``write`` so that the directory ``staged.final`` appears in one step.

    Args:
        staged: the directory and where it stages (:class:`CheckpointDir`).
        write: the framework's call: ``write(staging)`` writes this rank's files into the
            staging directory; ``write(None)`` writes them in place (where the framework
            puts them: the save is not staged). Its return value is returned, with the
            staging directory replaced by ``final`` (:func:`relocate`).
        rank: this rank's index in ``exchange``; rank 0 draws the token, checks whether
            the save can be staged and runs ``after``.
        committer: whether this rank swaps the staging directory in (rank 0, or with
            ``per_node`` each node's local main process).
        is_checkpoint_entry, what, operation: as :class:`~fastpersist.collectivedir.CollectiveDir`.
        peer: what the errors call the other processes.
        remove_new_on_failure: a save that writes in place and fails removes the directory
            if it did not exist before (a partial checkpoint the framework would resume from).
        after: ``after(path)``, run by rank 0 once the new directory is durable, before
            every rank returns (retention).
        rollback: run on every rank when the save raises before the new directory became
            visible (the framework's counters go back).

    A failure on any rank raises on every rank (its own error there, ``RuntimeError``
    naming the failed ranks elsewhere); the previous directory stays as it was.
    """

    elsewhere = failed_elsewhere(f"fastpersist: {operation} of {staged.final}", peer=peer)
    stage = CollectiveDir.open(staged, rank=rank, committer=committer, exchange=exchange, check=rank == 0,
                               is_checkpoint_entry=is_checkpoint_entry, what=what, operation=operation,
                               fsync_after_restore=True, logger=logger, sync_tree=fsync_tree_and_parent)
    new = not os.path.exists(staged.final)
    error: Optional[BaseException] = None
    location: Any = None
    try:
        if stage is not None and committer and not per_node:
            # This process alone swaps the staging directory in, after it fsynced the whole
            # tree: its own files skip their fsyncs (one journal commit for the directory,
            # not two per file). Other processes' files keep theirs (on a shared filesystem
            # another client's fsync need not cover them).
            with synced_later(stage.staging):
                location = write(stage.staging)
        else:
            location = write(None if stage is None else stage.staging)
    except BaseException as e:  # noqa: BLE001 - every rank learns of it below
        error = e
    try:
        if stage is not None:
            stage.agree(error, elsewhere)  # a failure: the committers removed the staging directory
            stage.commit(elsewhere, per_node=per_node)
        else:
            agree(error, elsewhere, exchange=exchange)
    except BaseException:
        if stage is None or not stage.visible:
            rollback()
        if stage is None and error is not None and new and remove_new_on_failure and rank == 0:
            _remove_partial(staged.final, operation, logger)
        raise
    durable = staged.target if stage is not None else os.fspath(location)
    if rank == 0:
        if stage is None:
            fsync_tree_and_parent(durable)
        if after is not None:
            after(durable)
    _barrier(exchange)
    return location if stage is None else relocate(location, stage.staging, staged.final)


def _remove_partial(directory: str, operation: str, logger: logging.Logger) -> None:
    """A new checkpoint directory a failed in-place save left part-written: removed."""
    if not os.path.isdir(directory):
        return
    logger.error("fastpersist: %s failed; removing the incomplete %s (the previous checkpoints are untouched)",
                 operation, directory)
    shutil.rmtree(directory, ignore_errors=True)
    with contextlib.suppress(OSError):
        fsync_dir(os.path.dirname(directory))
