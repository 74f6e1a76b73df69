"""This process's place in the default ``torch.distributed`` group, usable without one.

Small helpers the framework adapters share: each answers for a single process when
``torch.distributed`` is unavailable or not initialized (rank 0 of a world of 1), so
adapter code runs the same with and without a launcher. ``torch.distributed`` is
imported at the call (an optional dependency at this layer).
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["all_gather", "global_rank", "whole_world", "world_group", "world_size"]


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def global_rank() -> int:
    """This process's rank in the default group; 0 without ``torch.distributed``."""
    import torch.distributed as dist

    return dist.get_rank() if _initialized() else 0


def world_size() -> int:
    """The default group's size; 1 without ``torch.distributed``."""
    import torch.distributed as dist

    return dist.get_world_size() if _initialized() else 1


def all_gather(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), on every rank, in rank order
    (``all_gather_object`` over the default group; ``[value]`` for a world of 1).
    Every rank of the default group must call it."""
    import torch.distributed as dist

    if world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def world_group() -> Optional[Any]:
    """The world process group when ``torch.distributed`` runs more than one rank, else None."""
    import torch.distributed as dist

    if _initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


def whole_world(group: Any) -> Optional[Any]:
    """``group`` (a process group) when it holds every rank of the default group, else None."""
    import torch.distributed as dist

    return group if dist.get_world_size(group) == dist.get_world_size() else None
