"""Retention of numbered checkpoints, run only once the new checkpoint is durable.

A framework that keeps the newest ``N`` checkpoints of a directory (Accelerate's
``total_limit``: ``checkpoints/checkpoint_0``, ``checkpoint_1``, ...) may delete the oldest
*before* writing the new one, so that a crash during the save leaves fewer checkpoints than
promised (none with ``N = 1``). :func:`prune` deletes the same ones, after: until then
there are ``N + 1``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil

from fastpersist.commit import fsync_dir

__all__ = ["checkpoint_number", "prune"]

log = logging.getLogger(__name__)

_NUMBER = re.compile(r"[\/]?([0-9]+)(?=[^\/]*$)")


def checkpoint_number(path: str) -> int:
    """The checkpoint's number: the first run of digits in the last component of ``path``
    (``.../checkpoint_12`` is 12; Accelerate's sort key). ``ValueError`` without one."""
    found = _NUMBER.findall(path)
    if not found:
        raise ValueError(f"{path} is not a numbered checkpoint: its name holds no number")
    return int(found[0])


def prune(parent: str, limit: int, keep: str, *, logger: logging.Logger = log) -> list[str]:
    """Delete the lowest-numbered entries of ``parent`` (:func:`checkpoint_number`) so that,
    with ``keep`` (the new checkpoint, durable), at most ``limit`` remain; fsync ``parent``.
    Returns the paths deleted."""
    folders = [os.path.join(parent, d) for d in os.listdir(parent)]
    folders = [d for d in folders if os.path.realpath(d) != os.path.realpath(keep)]
    excess = len(folders) + 1 - limit
    if excess <= 0:
        return []
    folders.sort(key=checkpoint_number)
    logger.info("fastpersist: deleting %d old checkpoint(s) now that %s is durable", excess, keep)
    for folder in folders[:excess]:
        shutil.rmtree(folder)
    fsync_dir(parent)
    return folders[:excess]
