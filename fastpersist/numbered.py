"""Checkpoints numbered in one folder (``FOLDER/checkpoint_0``, ``checkpoint_1``, ...), the newest kept.

A framework that names its checkpoints itself by a counter and keeps the newest ``N``
(Accelerate's ``automatic_checkpoint_naming``: ``project_dir/checkpoints/checkpoint_<save_iteration>``,
``total_limit``) has three rules that :class:`NumberedDirs` holds for the adapter:

- :meth:`NumberedDirs.claim`: where checkpoint number ``n`` goes, refused before anything
  is written when it exists already; the folder is one the framework lists and parses
  (every entry a checkpoint number), so the checkpoint stages one level up
  (:class:`fastpersist.dirsave.CheckpointDir`), and the leftovers of its siblings a
  killed save left there go back into the folder;
- :meth:`NumberedDirs.retention`: the oldest deleted only once the new checkpoint is
  durable (:func:`fastpersist.retention.prune`), run by
  :func:`fastpersist.dirsave.save_directory`'s ``after``.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Callable, Optional

from fastpersist import retention
from fastpersist.dirsave import CheckpointDir

__all__ = ["NumberedDirs", "checkpoint_dir"]

log = logging.getLogger(__name__)


class NumberedDirs:
    """The checkpoints ``FOLDER/PREFIX<n>`` (``n`` a decimal number), at most ``limit`` of them
    kept (None: all)."""

    def __init__(self, folder: str, *, prefix: str = "checkpoint_", limit: Optional[int] = None) -> None:
        self.folder = os.fspath(folder)
        self.prefix = prefix
        self.limit = limit
        self._name = re.compile(re.escape(prefix) + r"[0-9]+")

    def is_member(self, name: str) -> bool:
        """Whether the entry ``name`` is one of these checkpoints (the framework's naming)."""
        return self._name.fullmatch(name) is not None

    def path(self, number: int) -> str:
        """The path of checkpoint ``number``."""
        return os.path.join(self.folder, f"{self.prefix}{number}")

    def claim(self, number: int, *, counter: str = "the checkpoint number") -> CheckpointDir:
        """Checkpoint ``number``, to be saved now: the folder made, and its
        :class:`~fastpersist.dirsave.CheckpointDir` staged one level up from the folder.
        ``ValueError`` when it exists already (nothing written); ``counter``: the setting
        that chose the number, named in the error as the one to change."""
        os.makedirs(self.folder, exist_ok=True)
        final = self.path(number)
        if os.path.exists(final):
            raise ValueError(f"Checkpoint directory {final} ({number}) already exists. Please manually override "
                             f"`{counter}` with what iteration to start with.")
        return CheckpointDir(final, listed=self.folder, siblings=self.is_member)

    def retention(self, *, logger: logging.Logger = log) -> Optional[Callable[[str], None]]:
        """The ``after`` of :func:`fastpersist.dirsave.save_directory`: ``after(new)`` deletes the
        lowest-numbered checkpoints so that at most ``limit`` remain with ``new``; None
        without a limit."""
        if self.limit is None:
            return None
        limit = self.limit

        def after(new: str) -> None:
            retention.prune(self.folder, limit, new, logger=logger)

        return after


def checkpoint_dir(final: Any, *, listed: Optional[str] = None) -> CheckpointDir:
    """The :class:`~fastpersist.dirsave.CheckpointDir` of a checkpoint the caller named
    (``final``), its parent made; staged one level up where the parent is ``listed``."""
    final = os.fspath(final)
    os.makedirs(os.path.dirname(os.path.abspath(final)), exist_ok=True)
    return CheckpointDir(final, listed=listed)
