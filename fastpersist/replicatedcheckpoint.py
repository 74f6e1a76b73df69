"""A replicated checkpoint dict written by every rank together, when its small parts may differ.

Data-parallel frameworks hold a checkpoint dict whose bulk tensors (weights, optimizer
state) every rank holds equal and whose small parts (callback, loop and scheduler
states, hyper-parameters) may differ between ranks, e.g. a metric logged on each rank
and monitored by a checkpoint callback. :func:`save_split` makes the small parts agree
(rank 0's, :func:`rank0_small_parts`) and has the ranks write one file together
(:func:`fastpersist.replicated.save_replicated`); when the bulk tensors differ too, rank 0
writes its own checkpoint alone and a warning names the difference.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Collection

from fastpersist.checkpointfiles import CheckpointFiles
from fastpersist.errors import ReplicasDifferError
from fastpersist.replicated import rank0_if_different, save_replicated

__all__ = ["rank0_small_parts", "save_split"]

log = logging.getLogger(__name__)


def rank0_small_parts(checkpoint: dict[str, Any], group: Any, bulk_keys: Collection[str]) -> dict[str, Any]:
    """``checkpoint`` with its small parts (every top-level key but ``bulk_keys``) replaced
    by rank 0's when they differ between the ranks of ``group``, in rank 0's key order; the
    same object when they do not. Every rank calls it. Raises
    :class:`~fastpersist.errors.ReplicasDifferError` on every rank when the small parts do
    not pickle on some rank."""
    small = {k: v for k, v in checkpoint.items() if k not in bulk_keys}
    differ, (order, theirs) = rank0_if_different((list(checkpoint), small), group,
                                                 what="the checkpoint's small parts")
    if not differ:
        return checkpoint
    log.debug("fastpersist: the checkpoint's small parts differ between ranks; rank 0's are saved")
    return {k: (theirs[k] if k in theirs else checkpoint[k]) for k in order if k in theirs or k in checkpoint}


def save_split(files: CheckpointFiles, checkpoint: dict[str, Any], path: str, *, group: Any, writer: bool,
               bulk_keys: Collection[str], label: str = "fastpersist") -> None:
    """Write the local file ``path`` from ``checkpoint``, every rank of ``group`` a slice
    (through ``files``: in the background when it saves asynchronously); every rank calls it.

    The small parts are made to agree first (:func:`rank0_small_parts`). When the
    replicas still differ (the bulk tensors, or small parts that do not pickle), the
    ``writer`` rank (rank 0) saves its own ``checkpoint`` alone through ``files`` and
    warns (``label`` starts the message); the others write nothing.
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # (an earlier background save's uncollected error fails this save on every rank, at its
    # plan step: fastpersist.collectivesave)

    def save(obj: Any, target: str, group: Any = None, format: Any = None, config: Any = None) -> None:
        if group is None:  # the replicas differ: rank 0 writes its own checkpoint alone
            files.save_file(checkpoint, target)
        else:
            files.save_group_file(obj, target, group)

    def differ(e: ReplicasDifferError) -> None:
        if writer:
            warnings.warn(
                f"{label}: the ranks' checkpoints for {path} differ beyond their small parts "
                f"({e.difference or e}); rank 0 writes its own checkpoint alone (not split across ranks). "
                "Make the replicas equal (e.g. DDP's broadcast_buffers) to get split saves",
                RuntimeWarning, stacklevel=4)

    try:
        agreed = rank0_small_parts(checkpoint, group, bulk_keys)
    except ReplicasDifferError as e:  # small parts that do not pickle on some rank
        differ(e)
        if writer:
            files.save_file(checkpoint, path)
        return
    if save_replicated(agreed, path, group=group, writer=writer, save=save, on_differ=differ):
        files.counts["save_group"] += 1
