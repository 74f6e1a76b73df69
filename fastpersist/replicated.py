"""Saving one file that every rank of a process group holds a replica of.

Frameworks write replicated state (DDP weights, DeepSpeed's non-ZeRO model-states
file) from one rank alone. :func:`save_replicated` lets every rank of the group write
a slice of the file instead (:func:`fastpersist.distributed.save`, the collective
``fastpersist.save(..., group=)``), byte-identical to a one-rank save. The collective
save compares the ranks' plans and tensor values before writing anything: a
framework's "replicated" state is not always identical (BatchNorm statistics in
DeepSpeed, which does not broadcast buffers; client state that differs per rank).
When the replicas differ, the file is written by the rank(s) the framework would
have used, as the framework would have written it. Used by the Accelerate, DeepSpeed
and Lightning adapters.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any, Callable, Optional

from fastpersist import api
from fastpersist.distributed import ReplicasDifferError

__all__ = ["group_save_available", "save_replicated"]

log = logging.getLogger(__name__)


def group_save_available() -> bool:
    """Whether :func:`fastpersist.save` takes ``group=`` (the collective save)."""
    try:
        return "group" in inspect.signature(api.save).parameters
    except (TypeError, ValueError):  # pragma: no cover - a save without a signature
        return False


def save_replicated(obj: Any, path: "os.PathLike[str] | str", *, group: Any, writer: bool,
                    format: Optional[str] = None, config: Any = None,
                    save: Optional[Callable[..., None]] = None) -> bool:
    """Write ``path`` from ``obj``, a replica every rank of ``group`` holds; every rank calls it.

    With more than one rank the ranks write ``path`` together (``save(obj, path,
    group=group, ...)``). When the collective save finds the replicas different it raises
    :class:`~fastpersist.distributed.ReplicasDifferError` on every rank before writing
    anything; then the rank(s) called with ``writer=True`` write their own state alone
    (``save(obj, path, ...)``, no group), as the framework would have. With one rank,
    or no collective save, only ``writer`` ranks write.

    Args:
        obj: this rank's replica.
        path: the file to write.
        group: a ``torch.distributed`` process group (every rank of it calls this).
        writer: whether this rank writes the file when it is not written collectively.
        format: ``"torch"``, ``"safetensors"`` or None (by suffix).
        config: a :class:`fastpersist.Config`, or None.
        save: the save function to call (default :func:`fastpersist.api.save`, which is
            ``fastpersist.save``); the adapters pass ``fastpersist.save`` as it is at the
            call, so that a wrapped ``fastpersist.save`` sees these saves too.

    Returns:
        True when the file was written by the ranks together.
    """
    import torch.distributed as dist

    do_save = api.save if save is None else save
    world = dist.get_world_size(group)
    if world > 1 and group_save_available():
        try:
            do_save(obj, path, group=group, format=format, config=config)
            return True
        except ReplicasDifferError as e:
            log.info("fastpersist: replicas of %s differ across ranks (%s); the designated rank writes it alone",
                     path, e.difference)
    if writer:
        do_save(obj, path, format=format, config=config)
    return False
