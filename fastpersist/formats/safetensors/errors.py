"""The exceptions of the safetensors format, each also the exception type safetensors
itself raises for the same input (so that code written against safetensors catches them)."""

from __future__ import annotations

from typing import Optional

from fastpersist.errors import CheckpointFormatError

__all__ = ["MetaTensorError", "SafetensorsFormatError", "SafetensorsInputError", "SafetensorsValueError",
           "UnsupportedDtypeError"]

try:  # the exception safetensors raises for invalid files, devices, 0-d float4 ...
    from safetensors import SafetensorError as _StockError
except ImportError:  # safetensors is optional: a stand-in with the same role

    class _StockError(Exception):  # type: ignore[no-redef]
        """Stands for ``safetensors.SafetensorError`` when safetensors is not installed."""


class SafetensorsFormatError(CheckpointFormatError, _StockError):
    """A file is not a valid safetensors file; ``path`` names it. Also a
    ``safetensors.SafetensorError`` (what safetensors raises for the same file) when
    safetensors is installed, and a ``ValueError``."""

    def __init__(self, message: str, path: Optional[str] = None, offset: Optional[int] = None) -> None:
        super().__init__(message, path, offset)


class SafetensorsInputError(ValueError, TypeError):
    """``tensors`` is not a dict: ``ValueError`` as safetensors raises it, and the
    ``TypeError`` earlier fastpersist versions raised."""


class UnsupportedDtypeError(ValueError, KeyError):
    """A tensor's dtype has no safetensors code: a ``ValueError``, and the ``KeyError``
    safetensors raises (its dtype table lookup) for the same tensor."""

    def __str__(self) -> str:  # not KeyError's repr() of the message
        return str(self.args[0]) if self.args else ""


class MetaTensorError(NotImplementedError, ValueError):
    """A meta tensor has no bytes to save: ``NotImplementedError`` (a ``RuntimeError``)
    as torch's copy out of a meta tensor raises inside safetensors, and a ``ValueError``."""


class SafetensorsValueError(ValueError, _StockError):
    """An argument safetensors refuses with ``SafetensorError`` (a 0-d float4 tensor, an
    unknown device or backend); also a ``ValueError``."""
