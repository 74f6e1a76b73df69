"""Saving one file that every data-parallel rank holds a replica of (shared by the
Accelerate and DeepSpeed adapters).

Frameworks write replicated state (DDP weights, the non-ZeRO model-states file) from
rank 0 alone. :func:`save_replicated` lets every rank of the group write a slice of
the file instead (:func:`fastpersist.save` with ``group=``, see
:mod:`fastpersist.distributed`), but only after the ranks have checked that they
really hold the same bytes: ``fastpersist.save(group=)`` compares the plans (the
pickle, the sizes) but not the tensor values, and a framework's "replicated" state
is not always identical (BatchNorm statistics in DeepSpeed, which does not
broadcast buffers; client state that differs per rank). When the replicas differ,
or the multi-rank save does not exist in this fastpersist, the file is written by
the rank the framework would have used, as the framework would have written it.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import fastpersist

log = logging.getLogger(__name__)


def group_save_available() -> bool:
    """Whether this fastpersist has the collective save (``fastpersist.save(group=)``)."""
    try:
        import inspect

        from fastpersist import api

        return "group" in inspect.signature(api.save).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


def save_replicated(obj: Any, path: "os.PathLike[str] | str", *, group: Any, writer: bool,
                    format: Optional[str] = None, config: Any = None) -> bool:
    """Every rank of ``group`` calls this with its replica of ``obj``.

    The ranks write ``path`` together (``fastpersist.save(obj, path, group=group)``,
    byte-identical to a one-rank save). The collective save compares the ranks' plans
    and tensor values itself before writing anything; when they differ it raises
    :class:`~fastpersist.distributed.ReplicasDifferError` on every rank, and the rank(s)
    with ``writer=True`` then write their own state alone, as the framework would have.
    Returns True when the save was split across ranks.
    """
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world > 1 and group_save_available():
        from fastpersist.distributed import ReplicasDifferError

        try:
            fastpersist.save(obj, path, group=group, format=format, config=config)
            return True
        except ReplicasDifferError as e:
            log.info("fastpersist: replicas of %s differ across ranks (%s); the designated rank writes it alone",
                     path, e.difference)
    if writer:
        fastpersist.save(obj, path, format=format, config=config)
    return False
