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

import hashlib
import io
import logging
import os
import pickle
from typing import Any, Optional

import torch

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


def _storage_crc(storage: torch.UntypedStorage) -> int:
    from fastpersist import _native

    if storage.device.type != "cpu":
        storage = storage.cpu()
    n = storage.nbytes()
    return _native.crc32(storage.data_ptr(), n) if n else 0


def replica_digest(obj: Any) -> Optional[str]:
    """A digest of everything ``torch.save(obj)`` would write: the pickle with every
    storage replaced by its size, dtype and the CRC-32 of its bytes. ``None`` when the
    object does not pickle (then no rank splits)."""
    seen: dict[int, tuple] = {}

    class _Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            if isinstance(o, torch.storage.TypedStorage):
                dtype = str(o.dtype)
                o = o._untyped_storage
            elif isinstance(o, torch.UntypedStorage):
                dtype = "untyped"
            else:
                return None
            key = (o.data_ptr(), o.nbytes(), o.device.type)
            if key not in seen:
                seen[key] = ("storage", o.nbytes(), _storage_crc(o))
            return seen[key] + (dtype,)

    buf = io.BytesIO()
    try:
        _Pickler(buf, protocol=2).dump(obj)
    except Exception as e:  # an object torch.save would refuse too, or a lambda
        log.debug("replica digest not possible (%r): the designated rank writes alone", e)
        return None
    return hashlib.sha256(buf.getvalue()).hexdigest()


def save_replicated(obj: Any, path: "os.PathLike[str] | str", *, group: Any, writer: bool,
                    format: Optional[str] = None, config: Any = None) -> bool:
    """Every rank of ``group`` calls this with its replica of ``obj``.

    If all ranks hold the same bytes (:func:`replica_digest`), they write ``path``
    together (``fastpersist.save(obj, path, group=group)``, byte-identical to a
    one-rank save); otherwise the rank(s) with ``writer=True`` write it alone, as
    the framework would have. Returns True when the save was split across ranks.
    """
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world > 1 and group_save_available():
        digest = replica_digest(obj)
        digests: list[Any] = [None] * world
        dist.all_gather_object(digests, digest, group=group)
        if digests[0] is not None and all(d == digests[0] for d in digests):
            fastpersist.save(obj, path, group=group, format=format, config=config)
            return True
        log.info("fastpersist: replicas of %s differ across ranks; the designated rank writes it alone", path)
    if writer:
        fastpersist.save(obj, path, format=format, config=config)
    return False
