"""``s3://bucket/key`` URLs: recognising and parsing them (no client needed).

Every entry point that takes a path asks :func:`is_s3_url` first; only then does it
load the optional client (:mod:`fastpersist.s3client`, the ``s3`` extra).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = ["S3Url", "is_s3_url", "parse", "parse_prefix"]

_SCHEME = "s3://"
# S3's bucket rules (3-63 characters of lowercase letters, digits, dots and hyphens,
# starting and ending with a letter or digit); S3-compatible stores accept the same.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class S3Url:
    """One object: ``bucket`` and ``key`` of ``s3://bucket/key``."""

    bucket: str
    key: str

    def __str__(self) -> str:
        return f"{_SCHEME}{self.bucket}/{self.key}"


def is_s3_url(target: object) -> bool:
    """Whether ``target`` is an ``s3://`` URL (a str, or an os.PathLike whose path is one)."""
    if isinstance(target, os.PathLike):
        target = os.fspath(target)
    return isinstance(target, str) and target.startswith(_SCHEME)


def parse(target: object) -> S3Url:
    """``S3Url`` of ``s3://bucket/key`` (an ``S3Url`` as it is); ``ValueError`` naming the
    URL and what is wrong."""
    if isinstance(target, S3Url):
        return target
    url = os.fspath(target) if isinstance(target, os.PathLike) else target
    if not isinstance(url, str) or not url.startswith(_SCHEME):
        raise ValueError(f"not an s3:// URL: {url!r}")
    rest = url[len(_SCHEME):]
    bucket, sep, key = rest.partition("/")
    if not _BUCKET.match(bucket):
        raise ValueError(f"{url!r}: bucket name {bucket!r} is not a valid S3 bucket name "
                         "(3-63 lowercase letters, digits, dots or hyphens)")
    if not sep or not key:
        raise ValueError(f"{url!r} names a bucket, not an object: give s3://{bucket}/KEY")
    if key.endswith("/"):
        raise ValueError(f"{url!r} ends with '/': a checkpoint is an object, give its full key")
    if len(key.encode("utf-8")) > 1024:
        raise ValueError(f"{url!r}: S3 keys are at most 1024 bytes")
    return S3Url(bucket, key)


def parse_prefix(target: object) -> S3Url:
    """``s3://bucket`` or ``s3://bucket/prefix`` (a "directory": the key may be empty or
    end with '/'); ``ValueError`` naming the URL and what is wrong."""
    url = os.fspath(target) if isinstance(target, os.PathLike) else target
    if not isinstance(url, str) or not url.startswith(_SCHEME):
        raise ValueError(f"not an s3:// URL: {url!r}")
    bucket, _sep, key = url[len(_SCHEME):].partition("/")
    if not _BUCKET.match(bucket):
        raise ValueError(f"{url!r}: bucket name {bucket!r} is not a valid S3 bucket name "
                         "(3-63 lowercase letters, digits, dots or hyphens)")
    return S3Url(bucket, key)
