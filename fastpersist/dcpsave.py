"""A sharded checkpoint folder: DCP shards through fastpersist's storage layer, plus one small file.

Frameworks that shard state (FSDP) save a folder: ``torch.distributed.checkpoint``
(DCP) writes each rank's shards and the ``.metadata`` index, and one rank writes the
remaining, unsharded state beside them in a file of its own. :func:`save_sharded`
writes such a folder through :class:`fastpersist.dcp.FastPersistWriter` (a stock DCP
folder that DCP's own reader loads) and :func:`fastpersist.save`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from fastpersist import api

try:  # the DCP storage layer needs a torch whose torch.distributed.checkpoint it supports
    from fastpersist.dcp import FastPersistWriter
except ImportError:  # pragma: no cover - without it callers keep their framework's own save
    FastPersistWriter = None  # type: ignore[assignment,misc]

__all__ = ["available", "save_sharded"]


def available() -> bool:
    """Whether this torch supports fastpersist's DCP storage layer."""
    return FastPersistWriter is not None


def save_sharded(shards: dict[str, Any], folder: "str | Path", *, rest: Optional[dict[str, Any]] = None,
                 rest_name: str = "meta.pt", writes_rest: bool = True, config: Any = None) -> None:
    """Write ``shards`` (a DCP state dict) into ``folder`` with ``dcp.save`` through
    :class:`~fastpersist.dcp.FastPersistWriter`; then, on the rank with ``writes_rest``,
    ``rest`` to ``folder/rest_name`` with :func:`fastpersist.save`. Every rank of DCP's
    process group calls it. A file at ``folder`` is replaced by the folder."""
    if FastPersistWriter is None:
        raise RuntimeError("fastpersist.dcp is not available with this torch: sharded saves need "
                           "torch.distributed.checkpoint's storage-layer API")
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415 - optional: torch.distributed

    path = Path(folder)
    if path.is_file():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    dcp.save(shards, storage_writer=FastPersistWriter(path, config=config))
    if writes_rest and rest is not None:
        api.save(rest, path / rest_name, config=config)
