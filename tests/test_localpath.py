"""fastpersist.localpath: which checkpoint locations are local files, and their paths."""

from __future__ import annotations

import pathlib

import pytest

from fastpersist.localpath import is_local, local_path


@pytest.mark.parametrize("location, local, path", [
    ("/tmp/x.ckpt", True, "/tmp/x.ckpt"),
    ("relative/x.ckpt", True, "relative/x.ckpt"),
    ("file:///tmp/x.ckpt", True, "/tmp/x.ckpt"),
    ("local://tmp/x.ckpt", True, "tmp/x.ckpt"),
    ("s3://bucket/x.ckpt", False, "s3://bucket/x.ckpt"),
    ("gs://bucket/x.ckpt", False, "gs://bucket/x.ckpt"),
    (pathlib.Path("/tmp/y.ckpt"), True, "/tmp/y.ckpt"),
])
def test_locations(location, local, path):
    assert is_local(location) is local
    assert local_path(location) == path


def test_pathlike_with_url_text_is_a_path():
    """An os.PathLike is a filesystem path whatever it spells (a directory named 's3:')."""
    p = pathlib.PurePosixPath("s3:/bucket")
    assert is_local(p) is True and local_path(p) == "s3:/bucket"
