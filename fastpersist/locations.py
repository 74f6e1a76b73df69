"""Checkpoint locations as frameworks pass them: local paths, ``file://`` and ``s3://`` URLs.

A framework hands a checkpoint-IO object paths that may be fsspec URLs. :func:`resolve`
says where fastpersist writes a location (a local path, an ``s3://`` URL, or nowhere:
another URL scheme stays the framework's); :func:`wait_for_file` and
:func:`wait_for_folder` make a framework's own check of a location wait for this
process's pending saves there. Frameworks see ``s3://`` folders through fsspec (s3fs):
:func:`forget_listings` drops s3fs's cached listings after fastpersist wrote or deleted
an object, and :func:`list_s3` lists a folder with the scheme kept on every name.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Callable, Optional

from fastpersist import pending
from fastpersist.localpath import is_local, local_path
from fastpersist.s3url import is_s3_url

__all__ = ["forget_listings", "list_s3", "resolve", "wait_for_file", "wait_for_folder"]


def resolve(location: Any) -> Optional[str]:
    """Where fastpersist writes ``location``: an ``s3://`` URL as a string, a local path
    (``file://``/``local://`` removed), or None (None, or another URL scheme)."""
    if location is None:
        return None
    if is_s3_url(location):
        return str(location)
    return local_path(location) if is_local(location) else None


def wait_for_file(location: Any) -> None:
    """Wait for this process's pending saves of ``location`` (a str or os.PathLike; other
    objects, such as open files, and other URL schemes return at once)."""
    target = resolve(location) if isinstance(location, (str, os.PathLike)) else None
    if target is not None:
        pending.wait_for_path(target)


def wait_for_folder(location: Any) -> None:
    """Wait for this process's pending saves of files in the folder ``location`` or below."""
    target = resolve(location) if isinstance(location, (str, os.PathLike)) else None
    if target is not None:
        pending.wait_for_dir(target)


def forget_listings(url: str) -> None:
    """After fastpersist wrote or deleted the object ``url``: drop what every s3fs
    filesystem of this process cached about it and its folder, so fsspec's existence checks
    and listings see the change. A no-op for other locations, or when s3fs is not loaded."""
    if not is_s3_url(url) or "s3fs" not in sys.modules:
        return
    fs_class = getattr(sys.modules["s3fs"], "S3FileSystem", None)
    for fs in list(getattr(fs_class, "_cache", {}).values()):
        with contextlib.suppress(Exception):
            fs.invalidate_cache(url)


def list_s3(folder: str, match: Callable[[str], Any]) -> set[str]:
    """The objects directly in the ``s3://`` folder whose base names ``match``, as
    ``s3://`` URLs (fsspec names them ``bucket/key``), after this process's pending saves
    there finished; empty when the folder does not exist. Needs fsspec and s3fs."""
    from fsspec.core import url_to_fs  # noqa: PLC0415 - optional: the frameworks' dependency

    wait_for_folder(folder)
    fs, _path = url_to_fs(folder)
    if not fs.exists(folder):
        return set()
    found = set()
    for name in fs.ls(folder, detail=False, refresh=True):
        if match(str(name).rsplit("/", 1)[-1]):
            found.add("s3://" + str(name).lstrip("/"))
    return found
