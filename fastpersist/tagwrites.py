"""A run's checkpoint tag directory (``SAVE_DIR/TAG``) that every rank writes one file per call, then commits.

A framework that keeps its checkpoints as tag directories of one run directory, with a
pointer file naming the newest (DeepSpeed's ``save_dir/TAG`` and ``save_dir/latest``), and
that hands the adapter each file separately before asking it to commit (its
``CheckpointEngine``: ``create``, ``makedirs``, ``save`` per file, ``commit``) goes through
:class:`TagWrites`, one per rank:

- :meth:`TagWrites.open` (every rank): where the tag directory exists on some rank, it is
  staged (:class:`fastpersist.collectivedir.CollectiveDir`: rank 0's token, a reason of
  any rank not to stage writing in place); a new tag, which no pointer names yet, is
  written directly;
- :meth:`TagWrites.save`: one file through fastpersist, where :class:`RankWrites` puts
  it, blocking, in the background, or written by the ranks of a group together (a
  replica they all hold: :func:`fastpersist.replicated.save_replicated`); a failure is
  held for the commit;
- :meth:`TagWrites.commit` (every rank): every save settled and fsynced, the ranks'
  outcomes agreed, the staging directory swapped in
  (:func:`fastpersist.collectivedir.conclude`), and only then the pointer file written
  (atomic and durable), so that it never names a tag that is not whole;
- :meth:`TagWrites.abandon`: the framework's save raised before its commit. A commit
  that comes later (deferred: DeepSpeed's decoupled engine commits at the next step
  boundary) fails then; any other is forgotten.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Iterator, Optional

from fastpersist.collectivedir import CollectiveDir, conclude, failed_elsewhere
from fastpersist.commit import write_small_file
from fastpersist.dircommit import StagedDir
from fastpersist.ranks import global_rank, world_size
from fastpersist.rankwrites import RankWrites
from fastpersist.replicated import save_replicated

__all__ = ["TagWrites", "tag_dir"]

log = logging.getLogger(__name__)


def tag_dir(save_dir: Any, tag: Any) -> str:
    """The tag directory ``SAVE_DIR/TAG``, absolute."""
    return os.path.abspath(os.path.join(os.fspath(save_dir), str(tag)))


class TagWrites(RankWrites):
    """This rank's files of the tag directory being written (:meth:`open` starts one).
    ``is_checkpoint_entry``, ``what``, ``operation``: as
    :class:`~fastpersist.collectivedir.CollectiveDir`'s (the framework's entries, in a
    directory saved again; the checkpoint and the saving call, in the errors);
    ``is_replica(name)``: whether the file ``name`` holds a replica that every rank of a
    :meth:`save`'s ``group`` has (default: every file)."""

    def __init__(self, *, is_checkpoint_entry: Callable[[str], object], what: str, operation: str,
                 is_replica: Callable[[str], object] = lambda name: True, logger: logging.Logger = log) -> None:
        super().__init__(logger)
        self.is_replica = is_replica
        self.is_checkpoint_entry = is_checkpoint_entry
        self.what = what
        self.operation = operation
        self.key: Optional[tuple[str, str]] = None  #: (save_dir, tag) of the tag directory being written
        self.uncommitted: Any = None  #: the framework's handle of the tag directory opened, not committed yet
        self.node_local = False  #: whether it is written on each node's own disk (committed per node)
        #: the running save call's own wish for the pointer (:meth:`asking_pointer`)
        self.asked_pointer: Optional[bool] = None
        self._pointer_key: Optional[tuple[str, str]] = None  # (save_dir, tag) whose commit writes the pointer

    @contextlib.contextmanager
    def asking_pointer(self, wanted: Optional[bool]) -> Iterator[None]:
        """Within the block, the commit of a tag directory :meth:`open` starts updates the pointer
        where ``wanted`` is true (even where the commit's ``update_pointer`` is false): a wrapper
        of the framework's save call that tells the framework not to write the pointer itself (in
        place, not atomically) says here what its own caller asked for."""
        self.asked_pointer = wanted
        try:
            yield
        finally:
            self.asked_pointer = None

    def open(self, save_dir: Any, tag: Any, *, rank: Optional[int] = None, node_local: bool = False,
             local_rank: int = 0, veto: Optional[str] = None, handle: Any = None) -> None:
        """Every rank: start writing ``SAVE_DIR/TAG``, staged where the directory exists on
        some rank and no rank gives a reason not to (``veto``: this rank's). ``rank``: this
        rank's in the default group (None: :func:`fastpersist.ranks.global_rank`); rank 0
        swaps the staging directory in, or, ``node_local`` (each node's own disk), every
        node's ``local_rank`` 0. ``handle``: the framework's record of this save,
        :attr:`uncommitted` until :meth:`commit`; its commit updates the pointer file where
        :meth:`asking_pointer` asks for it."""
        rank = global_rank() if rank is None else rank
        self.uncommitted = handle
        self.node_local = node_local
        committer = local_rank == 0 if node_local else rank == 0
        self.begin(None)
        self.key = (os.fspath(save_dir), str(tag))
        self._pointer_key = self.key if self.asked_pointer else None
        self.begin(CollectiveDir.open(
            StagedDir(tag_dir(save_dir, tag)), rank=rank, committer=committer, veto=veto, existing_only=True,
            is_checkpoint_entry=self.is_checkpoint_entry, what=self.what, operation=self.operation,
            logger=self.logger))

    def save(self, obj: Any, path: str, *, save: Callable[..., Any], save_async: Optional[Callable[..., Any]] = None,
             group: Any = None, config: Any = None, format: str = "torch") -> None:
        """Write ``obj`` to the file ``path`` (where :meth:`RankWrites.path` puts it): with
        ``group`` and a replica file (``is_replica``), by the ranks of the group together (the
        group's rank 0 the writer); else in
        the background with ``save_async`` given (tracked: settled by :meth:`commit`); else
        with ``save`` (``fastpersist.save``). A failure is held for :meth:`commit`."""
        path = self.path(path)
        group = group if group is not None and self.is_replica(os.path.basename(path)) else None
        self.write(path, lambda: self._save(obj, path, save, save_async, group, config, format))

    def _save(self, obj: Any, path: str, save: Callable[..., Any], save_async: Optional[Callable[..., Any]],
              group: Any, config: Any, format: str) -> None:
        if group is not None:
            import torch.distributed as dist

            save_replicated(obj, path, group=group, writer=dist.get_rank(group) == 0, format=format, config=config,
                            save=save)
        elif save_async is not None:
            self.track(save_async(obj, path, config=config, format=format))
        else:
            save(obj, path, config=config, format=format)

    def drop(self) -> None:
        """Forget the tag directory being written, uncommitted (its staging directory goes with
        the next save into the tag)."""
        self.uncommitted = None
        self.key = self._pointer_key = None
        self.begin(None)

    def abandon(self, error: BaseException, *, deferred: bool) -> None:
        """The framework's save raised ``error`` before its commit: :meth:`drop`, or, where its
        commit is ``deferred`` (comes later) and still to come, that commit raises ``error``."""
        if not deferred:
            self.drop()
        elif self.uncommitted is not None:
            self.fail(error)

    def commit(self, save_dir: Any, tag: Any, *, rank: Optional[int] = None, pointer: str = "latest",
               update_pointer: bool = True) -> None:
        """Every rank: end the save of ``SAVE_DIR/TAG``: every save settled and fsynced
        (:meth:`RankWrites.settle`), the ranks' outcomes agreed, the staging directory swapped
        in (node-local: by each node's committer; with no file of this save in it, it is
        removed); then, ``update_pointer`` or where :meth:`open` asked for it, rank 0 replaces the
        file ``SAVE_DIR/POINTER`` by one holding the tag (atomically). A failure on any rank
        raises on every rank, the pointer not updated."""
        rank = global_rank() if rank is None else rank
        if self._pointer_key == (os.fspath(save_dir), str(tag)):
            update_pointer, self._pointer_key = True, None
        per_node = self.node_local and world_size() > 1
        self.uncommitted = None
        stage = self.stage if self.key == (os.fspath(save_dir), str(tag)) else None
        # every pending save settles (none may still rename files of this tag afterwards), then fsyncs
        error = self.settle(f"checkpoint {tag!r}", also=(tag_dir(save_dir, tag), save_dir))
        self.begin(None)
        elsewhere = failed_elsewhere(f"checkpoint {tag!r} in {save_dir!r}", after=f"{pointer!r} was not updated")
        conclude(stage, error, elsewhere, per_node=per_node, missing_ok=True)
        if update_pointer and rank == 0:
            write_small_file(os.path.join(save_dir, pointer), str(tag).encode())
