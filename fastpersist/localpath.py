"""Checkpoint locations that may be URLs: which are local files, and their paths.

Frameworks hand checkpoint paths around as strings that may be fsspec URLs
(``s3://bucket/x.ckpt``, ``file:///tmp/x.ckpt``). fastpersist writes local files only:
:func:`is_local` tells which locations are, :func:`local_path` gives their path.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["LOCAL_PROTOCOLS", "is_local", "local_path"]

#: URL schemes that name the local filesystem (fsspec's names for it).
LOCAL_PROTOCOLS = ("file", "local")


def is_local(path: Any) -> bool:
    """True for an ``os.PathLike``, a string without ``://``, or a ``file://``/``local://`` URL."""
    if isinstance(path, os.PathLike):
        return True
    text = str(path)
    protocol, sep, _ = text.partition("://")
    return not sep or protocol in LOCAL_PROTOCOLS


def local_path(path: Any) -> str:
    """The filesystem path of a local location: ``path`` as a string, a
    ``file://``/``local://`` prefix removed (other strings are returned unchanged)."""
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    for protocol in LOCAL_PROTOCOLS:
        if text.startswith(protocol + "://"):
            return text[len(protocol) + 3 :]
    return text
