"""pytest plugin: Lightning's upstream tests with fastpersist's CheckpointIO as the default one.

Loaded by ``tools/compat/lightning.sh`` (``-p lightning_plugin``, this folder on
``PYTHONPATH``). Lightning makes its default CheckpointIO in exactly one place,
``Strategy.checkpoint_io`` (``lightning/pytorch/strategies/strategy.py``: ``TorchCheckpointIO()``
when no CheckpointIO was given, and as the inner one of a ``_WrappingCheckpointIO`` such as
``AsyncCheckpointIO``). This plugin rebinds that module's name ``TorchCheckpointIO`` to a
factory of :class:`FastPersistCheckpointIO`, so every Trainer/strategy that would use the
stock default uses fastpersist's; a CheckpointIO the test passes itself is kept.

``FASTPERSIST_COMPAT_LIGHTNING=async`` (default) or ``sync`` (``async_save=False``).
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch.strategies.strategy as _strategy
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO as _StockTorchCheckpointIO

from fastpersist.integrations.lightning import FastPersistCheckpointIO

_MODE = os.environ.get("FASTPERSIST_COMPAT_LIGHTNING", "async")
if _MODE not in ("async", "sync"):
    raise ValueError(f"FASTPERSIST_COMPAT_LIGHTNING must be async or sync, not {_MODE!r}")


def _default_checkpoint_io() -> Any:
    return FastPersistCheckpointIO(async_save=(_MODE == "async"))


assert _strategy.TorchCheckpointIO is _StockTorchCheckpointIO, "Lightning's default CheckpointIO moved"
_strategy.TorchCheckpointIO = _default_checkpoint_io  # type: ignore[assignment,misc]


def pytest_report_header(config: Any) -> str:
    return f"fastpersist: FastPersistCheckpointIO(async_save={_MODE == 'async'}) is Lightning's default CheckpointIO"
