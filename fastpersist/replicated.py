"""Saving one file that every rank of a process group holds a replica of.

Frameworks write replicated state (DDP weights, DeepSpeed's non-ZeRO model-states
file) from one rank alone. :func:`save_replicated` lets every rank of the group write
a slice of the file instead (:func:`fastpersist.collectivesave.save`, the collective
``fastpersist.save(..., group=)``), byte-identical to a one-rank save. The collective
save compares the ranks' plans and tensor values before writing anything: a
framework's "replicated" state is not always identical (BatchNorm statistics in
DeepSpeed, which does not broadcast buffers; client state that differs per rank).
When the replicas differ, the file is written by the rank(s) the framework would
have used, as the framework would have written it. Used by the Accelerate, DeepSpeed
and Lightning adapters.

:func:`rank0_if_different` makes small picklable state agree across the ranks (rank 0's
wins) before a collective save, for state a framework does not keep in sync (callback
and loop states, a metric logged on one rank).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import pickle
from typing import Any, Callable, Optional

from fastpersist import api
from fastpersist.errors import ReplicasDifferError

__all__ = ["group_save_available", "rank0_if_different", "save_replicated"]

log = logging.getLogger(__name__)


def group_save_available() -> bool:
    """Whether :func:`fastpersist.save` takes ``group=`` (the collective save)."""
    try:
        return "group" in inspect.signature(api.save).parameters
    except (TypeError, ValueError):  # pragma: no cover - a save without a signature
        return False


def save_replicated(obj: Any, path: "os.PathLike[str] | str", *, group: Any, writer: bool,
                    format: Optional[str] = None, config: Any = None,
                    save: Optional[Callable[..., None]] = None,
                    on_differ: Optional[Callable[[ReplicasDifferError], None]] = None) -> bool:
    """Write ``path`` from ``obj``, a replica every rank of ``group`` holds; every rank calls it.

    With more than one rank the ranks write ``path`` together (``save(obj, path,
    group=group, ...)``). When the collective save finds the replicas different it raises
    :class:`~fastpersist.errors.ReplicasDifferError` on every rank before writing
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
            if on_differ is not None:
                on_differ(e)
            else:
                log.info("fastpersist: replicas of %s differ across ranks (%s); the designated rank writes it alone",
                         path, e.difference)
    if writer:
        do_save(obj, path, format=format, config=config)
    return False


def rank0_if_different(value: Any, group: Any, *, what: str = "the value") -> tuple[bool, Any]:
    """Every rank of ``group`` calls this with its ``value`` (picklable); the ranks compare
    a digest of their pickled values.

    Returns ``(False, value)``, this rank's own object, when every rank's digest is equal;
    else ``(True, rank 0's value)`` on every rank: broadcast from the group's rank 0 and, on
    rank 0 too, a freshly unpickled copy, so that every rank holds equal objects (pickling
    them again gives the same bytes, shared references included). When ``value`` does not
    pickle on some rank, every rank raises
    :class:`~fastpersist.errors.ReplicasDifferError` (``what`` names the value in it).
    """
    import torch.distributed as dist

    try:
        digest = hashlib.blake2b(pickle.dumps(value, protocol=4), digest_size=16).hexdigest()
    except Exception as e:  # noqa: BLE001 - cannot be compared nor broadcast
        digest = f"unpicklable ({type(e).__name__}: {e})"
    digests: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    bad = [d for d in digests if d.startswith("unpicklable")]
    if bad:  # every rank sees it: every rank raises
        raise ReplicasDifferError(f"{what} do not pickle", f"{what} {bad[0]}")
    if all(d == digests[0] for d in digests):
        return False, value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    if dist.get_rank(group) == 0:  # the same unpickled copies as the others hold: the pickle's memo
        box = pickle.loads(pickle.dumps(box, protocol=pickle.DEFAULT_PROTOCOL))  # (shared objects) agrees
    return True, box[0]
