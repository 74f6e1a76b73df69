"""A checkpoint directory that the ranks of a job write together and that appears in one step.

The Accelerate and DeepSpeed adapters write a checkpoint *directory* from every rank
(each rank its own files) and make it replace the previous one atomically. The steps,
built on :mod:`fastpersist.dircommit` (the staging and swap mechanics of one directory):

1. :meth:`CollectiveDir.plan` (every rank): the committers remove what killed saves
   left (:meth:`~fastpersist.dircommit.StagedDir.clean_leftovers`, run by the adapter
   before); rank 0 draws the save's token (16 hex digits) and every rank learns it, so
   every rank writes the same staging directory ``.fastpersist-staging-NAME-TOKEN``.
   A rank that sees a reason not to stage (different filesystems, a mount point, the
   working directory inside the target, a reason of the framework's) vetoes it: the
   save then writes in place (each file atomic, the directory not), logged as a
   warning. With ``existing_only`` a target no rank sees is not staged (written
   directly: a directory that no pointer names yet).
2. The framework writes its files; :meth:`CollectiveDir.redirect` maps a path in the
   target to the same relative path in the staging directory.
3. :meth:`CollectiveDir.agree` (every rank): each rank's outcome reaches every rank;
   if any failed, every rank raises (the failing one its own error) and the
   committers remove the staging directory: the target is untouched.
4. :meth:`CollectiveDir.commit` (every rank): rank 0 (a committer) swaps the staging
   directory in (:meth:`~fastpersist.dircommit.StagedDir.commit`: entries of the
   previous directory that are no checkpoint entries carried over, everything fsynced,
   ``renameat2(RENAME_EXCHANGE)`` or two renames, the previous copy removed) and its
   outcome reaches every rank; then, ``per_node``, every other committer (each node's
   local main process, whose disk may be its own) swaps its node's copy, and their
   outcomes reach every rank (on a shared filesystem the first swap took the staging
   directory away and the others find nothing to do). A failure raises on every rank,
   with the target as it was when the failure came before the swap.

So a save that raises on any rank, or a process killed part-way (SIGKILL, power
loss), leaves the previous directory exactly as it was.

The ranks talk through an :class:`Exchange`: :class:`WorldExchange` (the default
``torch.distributed`` group, :mod:`fastpersist.ranks`), or the framework's own
collectives (Accelerate's ``broadcast_object_list``/``gather_object``).
"""

from __future__ import annotations

import logging
import os
import secrets
from typing import Any, Callable, Optional, Protocol

from fastpersist import ranks
from fastpersist.dircommit import StagedDir, fsync_tree, rebase

__all__ = ["CollectiveDir", "Exchange", "ListExchange", "WorldExchange", "agree", "conclude", "describe",
           "failed_elsewhere"]

log = logging.getLogger(__name__)

#: builds the exception a rank raises when another rank failed:
#: ``elsewhere(failed ranks, the first failed rank's message)``
Elsewhere = Callable[[list[int], str], BaseException]


class Exchange(Protocol):
    """How the ranks of a save share small picklable values (every rank calls each method)."""

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value``, on every rank."""
        ...

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, on every rank, in rank order."""
        ...


class WorldExchange:
    """:class:`Exchange` over the default ``torch.distributed`` group (a world of one
    without it): ``all_gather_object`` for both calls."""

    def broadcast(self, value: Any) -> Any:
        return ranks.all_gather(value)[0]

    def gather(self, value: Any) -> list[Any]:
        return ranks.all_gather(value)


class ListExchange:
    """:class:`Exchange` over a framework's own object collectives, which take and return lists
    (Accelerate's ``broadcast_object_list`` and ``gather_object``): ``broadcast_list([value])``
    gives rank 0's in place of ``value``, ``gather_list([value])`` every rank's, in rank order."""

    def __init__(self, broadcast_list: Callable[[list], list], gather_list: Callable[[list], list]) -> None:
        self.broadcast_list = broadcast_list
        self.gather_list = gather_list

    def broadcast(self, value: Any) -> Any:
        return self.broadcast_list([value])[0]

    def gather(self, value: Any) -> list[Any]:
        return self.gather_list([value])


def describe(error: Optional[BaseException]) -> Optional[str]:
    """``"Type: message"`` of ``error``, or None: what a rank sends the others of its failure."""
    return None if error is None else f"{type(error).__name__}: {error}"


def failed_elsewhere(what: str, *, peer: str = "rank", after: str = "") -> Elsewhere:
    """An ``elsewhere`` for :func:`agree` and :class:`CollectiveDir`: ``RuntimeError("WHAT failed
    on another PEER: PEER(s) [N, ...]: MESSAGE; AFTER")`` (``after``: what the failure leaves)."""

    def elsewhere(failed: list[int], message: str) -> BaseException:
        tail = f"; {after}" if after else ""
        return RuntimeError(f"{what} failed on another {peer}: {peer}(s) {failed}: {message}{tail}")

    return elsewhere


def _raise(error: Optional[BaseException], messages: list[Optional[str]], elsewhere: Elsewhere) -> None:
    """Raise this rank's ``error``, else ``elsewhere(...)`` if another rank failed."""
    if error is not None:
        raise error
    failed = [r for r, m in enumerate(messages) if m is not None]
    if failed:
        raise elsewhere(failed, str(messages[failed[0]]))


def agree(error: Optional[BaseException], elsewhere: Elsewhere, *, exchange: Optional[Exchange] = None,
          value: Any = None) -> list[Any]:
    """Every rank calls this with its outcome (``error``, None for success): no rank goes on
    alone after a failure. Raises ``error`` on the rank that failed and ``elsewhere(failed
    ranks, first message)`` on the others; returns every rank's ``value`` when all succeeded."""
    outcomes = (exchange or WorldExchange()).gather((describe(error), value))
    _raise(error, [m for m, _v in outcomes], elsewhere)
    return [v for _m, v in outcomes]


class CollectiveDir:
    """One save of ``staged.final`` by every rank, through the staging directory of ``token``.

    Args:
        staged: the directory and where it stages (:class:`~fastpersist.dircommit.StagedDir`).
        token: the save's token, the same on every rank (:meth:`plan` draws it).
        committer: whether this rank swaps the staging directory in (rank 0, or each
            node's local main process where nodes have disks of their own).
        rank: this rank's index in ``exchange`` (rank 0 commits first).
        is_checkpoint_entry: ``(name) -> bool``, the entries of the target that belong
            to a checkpoint (the others are carried over: :func:`~fastpersist.dircommit.carry_over`).
        what: the checkpoint in the log (``"a DeepSpeed checkpoint"``).
        operation: the saving call in the log (``"save_checkpoint"``).
        logger: where to log (the adapter's logger).
        sync_tree: how the staging directory is fsynced before the swap.
        exchange: the ranks' transport (default :class:`WorldExchange`).
    """

    def __init__(self, staged: StagedDir, token: str, *, committer: bool, rank: int,
                 is_checkpoint_entry: Callable[[str], object], what: str, operation: str,
                 logger: logging.Logger = log, sync_tree: Callable[[str], None] = fsync_tree,
                 exchange: Optional[Exchange] = None) -> None:
        self.dir = staged
        self.target = staged.target
        self.token = token
        self.staging = staged.staging(token)
        self.old = staged.old(token)
        self.committer = committer
        self.rank = rank
        self.is_checkpoint_entry = is_checkpoint_entry
        self.what = what
        self.operation = operation
        self.logger = logger
        self.sync_tree = sync_tree
        self.exchange: Exchange = exchange or WorldExchange()
        self.used = False  #: whether this rank redirected a path (its files are staged)
        self.visible = False  #: whether rank 0's commit made the new directory the target

    @staticmethod
    def plan(staged: StagedDir, *, rank: int, committer: bool, exchange: Optional[Exchange] = None,
             check: bool = True, veto: Optional[str] = None, existing_only: bool = False,
             operation: str = "save", logger: logging.Logger = log) -> Optional[str]:
        """Every rank: the token of a staged save, or None where the save is not staged.

        ``check``: whether this rank looks for reasons not to stage
        (:meth:`~fastpersist.dircommit.StagedDir.why_not_staged`, after ``veto``, a reason of
        the framework's). With ``existing_only`` the ranks gather whether they see the target
        (none does: None, the save writes the new directory directly) and their reasons;
        without it rank 0's answer is broadcast. A reason is logged as a warning by the
        committers (rank 0 without ``existing_only``) and the save is not staged.
        """
        ex = exchange or WorldExchange()
        exists = os.path.lexists(staged.target) if existing_only else True
        why = (veto or staged.why_not_staged()) if check and exists else None
        token = secrets.token_hex(8) if rank == 0 else None
        if existing_only:
            votes = ex.gather((exists, why, token))
            if not any(v[0] for v in votes):
                return None
            why = next((v[1] for v in votes if v[1] is not None), None)
            warn = committer
        else:
            votes = [ex.broadcast((True, why, token))]
            why = votes[0][1]
            warn = rank == 0
        if why is not None:
            if warn:
                logger.warning("fastpersist: cannot stage this %s beside %s (%s): writing its files in place, "
                               "each atomic, the directory not", operation, staged.target, why)
            return None
        return votes[0][2]

    @classmethod
    def open(cls, staged: StagedDir, *, rank: int, committer: bool, is_checkpoint_entry: Callable[[str], object],
             what: str, operation: str, exchange: Optional[Exchange] = None, check: bool = True,
             veto: Optional[str] = None, existing_only: bool = False, fsync_after_restore: bool = False,
             logger: logging.Logger = log, sync_tree: Callable[[str], None] = fsync_tree) -> Optional[CollectiveDir]:
        """Every rank: the committers clean what killed saves left
        (:meth:`~fastpersist.dircommit.StagedDir.clean_leftovers`), then :meth:`plan`; the
        save's :class:`CollectiveDir`, or None where it is not staged (the other arguments:
        the constructor's and :meth:`plan`'s)."""
        if committer:
            staged.clean_leftovers(operation=operation, logger=logger, fsync_after_restore=fsync_after_restore)
        token = cls.plan(staged, rank=rank, committer=committer, exchange=exchange, check=check, veto=veto,
                         existing_only=existing_only, operation=operation, logger=logger)
        if token is None:
            return None
        return cls(staged, token, committer=committer, rank=rank, is_checkpoint_entry=is_checkpoint_entry, what=what,
                   operation=operation, logger=logger, sync_tree=sync_tree, exchange=exchange)

    def redirect(self, path: Any) -> Optional[str]:
        """The staging path for a path in the target (as the framework spells it: ``final``);
        None for any other path."""
        staged = rebase(path, os.path.abspath(self.dir.final), self.staging)
        if staged is not None:
            self.used = True
        return staged

    def discard(self) -> None:
        """Remove the staging directory (a failed or empty save; the target is untouched)."""
        if os.path.isdir(self.staging) and not os.path.islink(self.staging):
            self.logger.info("fastpersist: removing the staging directory %s (%s is untouched)",
                             self.staging, self.target)
            self.dir.discard(self.token)

    def agree(self, error: Optional[BaseException], elsewhere: Elsewhere) -> bool:
        """Every rank's outcome of writing its files (``error``: this rank's, or None). If any
        rank failed, the committers remove the staging directory and every rank raises
        (:func:`agree`). Returns whether any rank wrote into the staging directory."""
        outcomes = self.exchange.gather((describe(error), self.used))
        messages = [m for m, _u in outcomes]
        if any(m is not None for m in messages) and self.committer:
            self.discard()  # the target was never touched
        _raise(error, messages, elsewhere)
        return any(u for _m, u in outcomes)

    def _swap_here(self, missing_ok: bool) -> tuple[Optional[BaseException], bool]:
        """This committer's swap: ``(error, whether the new directory is the target)``."""
        if missing_ok and not os.path.isdir(self.staging):
            return None, False  # another node's commit took it (a shared filesystem)
        done: list[bool] = []
        try:
            self.dir.commit(self.token, self.is_checkpoint_entry, what=self.what, operation=self.operation,
                            logger=self.logger, on_visible=lambda: done.append(True), sync_tree=self.sync_tree)
        except BaseException as e:  # noqa: BLE001 - reported to every rank
            if not done:  # nothing visible changed: the previous directory stays
                self.logger.error("fastpersist: committing %s failed (%s); removing its staging directory",
                                  self.target, e)
                self.discard()
            return e, bool(done)
        return None, True

    def commit(self, elsewhere: Elsewhere, *, per_node: bool = False, missing_ok: bool = False) -> None:
        """Every rank: swap the staging directory in (rank 0; then, ``per_node``, every other
        committer), each phase's outcome reaching every rank. Raises this rank's error or
        ``elsewhere(failed ranks, message)``; :attr:`visible` says, on every rank, whether
        rank 0's swap made the new directory the target (also when raising). ``missing_ok``:
        rank 0 finds no staging directory without an error (its node wrote nothing of it);
        the other committers always may (the first swap took it, on a shared filesystem)."""
        error: Optional[BaseException] = None
        visible = False
        if self.rank == 0:
            error, visible = self._swap_here(missing_ok)
        message, self.visible = self.exchange.broadcast((describe(error), visible))
        if message is not None and error is None and self.committer:
            self.discard()
        _raise(error, [message], elsewhere)
        if not per_node:
            return
        error = None
        if self.committer and self.rank != 0:
            error = self._swap_here(True)[0]
        messages = self.exchange.gather(describe(error))
        if any(m is not None for m in messages) and error is None and self.committer:
            self.discard()
        _raise(error, messages, elsewhere)


def conclude(stage: Optional[CollectiveDir], error: Optional[BaseException], elsewhere: Elsewhere, *,
             exchange: Optional[Exchange] = None, per_node: bool = False, missing_ok: bool = False) -> None:
    """Every rank, after writing its files (``error``: this rank's failure, or None): without a
    ``stage``, :func:`agree`; with one, :meth:`CollectiveDir.agree`, then
    :meth:`CollectiveDir.commit` where any rank wrote into the staging directory, else the
    committers remove it (nothing of this save went into the target)."""
    if stage is None:
        agree(error, elsewhere, exchange=exchange)
    elif stage.agree(error, elsewhere):
        stage.commit(elsewhere, per_node=per_node, missing_ok=missing_ok)
    elif stage.committer:
        stage.discard()
