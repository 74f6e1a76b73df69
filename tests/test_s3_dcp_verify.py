"""``fastpersist.verify`` / ``fastpersist verify`` of a DCP checkpoint under an s3:// prefix,
against the real S3 server (s3proxy): the same verdicts as the local directory's, a
flipped byte anywhere in a record (the kept ends or the middle whose pages are given
back) found and named, a missing data object, a stock (unchecksummed) checkpoint, an
empty prefix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

pytest.importorskip("boto3", reason="the s3 extra is not installed: pip install 'fastpersist[s3]'")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP: "assuming ... a single process"

from s3fixtures import boto, bucket, s3_env, s3_server  # noqa: E402,F401 (fixtures)

import fastpersist  # noqa: E402
from fastpersist import s3dcpverify  # noqa: E402
from fastpersist.dcp import FastPersistWriter  # noqa: E402
from fastpersist.formats.dcpmetadata import load_metadata  # noqa: E402


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {"big": torch.randn(512, 1024, generator=g),  # 2 MiB: its middle is given back once checksummed
            "small": torch.arange(10), "extra": {"step": 7, "name": "x"}}


def _upload_dir(boto: Any, bucket: str, local: Path, prefix: str) -> None:
    for f in sorted(local.iterdir()):
        boto.put_object(Bucket=bucket, Key=f"{prefix}/{f.name}", Body=f.read_bytes())


def _record(local: Path, fqn: str) -> tuple[str, int, int]:
    """(data file, offset, length) of the storage record of item ``fqn``."""
    md, _ = load_metadata(str(local / ".metadata"))
    for index, info in md.storage_data.items():
        if index.fqn == fqn:
            return info.relative_path, info.offset, info.length
    raise KeyError(fqn)


@pytest.fixture
def saved(tmp_path: Path, s3_env: Any, boto: Any, bucket: str) -> tuple[Path, str]:
    """One checkpoint, saved locally and to s3://bucket/ck by FastPersistWriter."""
    local = tmp_path / "ck"
    dcp.save(_state(), storage_writer=FastPersistWriter(str(local)))
    dcp.save(_state(), storage_writer=FastPersistWriter(f"s3://{bucket}/ck"))
    return local, f"s3://{bucket}/ck"


def test_pristine_checkpoint_is_ok_as_its_local_copy(saved: tuple[Path, str], boto: Any, bucket: str) -> None:
    local, url = saved
    want = fastpersist.verify(local)
    assert want.status == "ok"
    for target in (url, url + "/"):
        got = fastpersist.verify(target)
        assert (got.status, got.format, got.records, got.bytes) == ("ok", "dcp", want.records, want.bytes)
        assert got.path == url and not got.problems
    # the objects are the local files' bytes (what is checked is what a local save wrote)
    rel, _off, _n = _record(local, "big")
    assert boto.get_object(Bucket=bucket, Key=f"ck/{rel}")["Body"].read() == (local / rel).read_bytes()


@pytest.mark.parametrize("where", ["head", "middle", "tail"])
def test_flipped_byte_anywhere_in_a_record_is_corrupt(tmp_path: Path, saved: tuple[Path, str], boto: Any,
                                                      bucket: str, where: str) -> None:
    local, url = saved
    rel, off, n = _record(local, "big")
    assert n > 2 * s3dcpverify.KEEP  # the middle is a span whose pages are given back
    at = {"head": off + 100, "middle": off + n // 2, "tail": off + n - 10}[where]
    body = bytearray((local / rel).read_bytes())
    body[at] ^= 0x10
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in local.iterdir():
        (bad / f.name).write_bytes(bytes(body) if f.name == rel else f.read_bytes())
    _upload_dir(boto, bucket, bad, "bad")
    want = fastpersist.verify(bad)
    got = fastpersist.verify(f"s3://{bucket}/bad")
    assert want.status == got.status == "corrupt"
    assert len(got.problems) == len(want.problems) >= 1
    assert any(f"s3://{bucket}/bad/{rel}" in p and "big" in p for p in got.problems), got.problems
    # the command: FAILED, exit 1
    r = subprocess.run([sys.executable, "-m", "fastpersist", "verify", f"s3://{bucket}/bad"], capture_output=True,
                       text=True, env=os.environ.copy(), timeout=300)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "FAILED" in r.stdout or "CORRUPT" in r.stdout.upper(), r.stdout


def test_missing_data_object_is_named(saved: tuple[Path, str], boto: Any, bucket: str) -> None:
    local, url = saved
    rel, _off, _n = _record(local, "big")
    boto.delete_object(Bucket=bucket, Key=f"ck/{rel}")
    got = fastpersist.verify(url)
    assert got.status == "corrupt"
    assert any(f"{url}/{rel}: missing" in p for p in got.problems), got.problems


def test_truncated_data_object_is_corrupt(tmp_path: Path, saved: tuple[Path, str], boto: Any, bucket: str) -> None:
    local, url = saved
    rel, off, n = _record(local, "big")
    data = (local / rel).read_bytes()
    boto.put_object(Bucket=bucket, Key=f"ck/{rel}", Body=data[:off + n // 2])
    got = fastpersist.verify(url)
    assert got.status == "corrupt"
    assert any("outside the file" in p for p in got.problems), got.problems


def test_stock_checkpoint_is_unchecked(tmp_path: Path, s3_env: Any, boto: Any, bucket: str) -> None:
    local = tmp_path / "stock"
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(local)))
    _upload_dir(boto, bucket, local, "stock")
    got = fastpersist.verify(f"s3://{bucket}/stock")
    assert got.status == "unchecked" and got.bytes == 0 and got.records == fastpersist.verify(local).records


def test_prefix_without_a_checkpoint_is_not_found(s3_env: Any, boto: Any, bucket: str) -> None:
    boto.put_object(Bucket=bucket, Key="other/file.txt", Body=b"x")
    with pytest.raises(FileNotFoundError):
        fastpersist.verify(f"s3://{bucket}/other")
    r = subprocess.run([sys.executable, "-m", "fastpersist", "verify", f"s3://{bucket}/nothing"],
                       capture_output=True, text=True, env=os.environ.copy(), timeout=300)
    assert r.returncode == 2, (r.stdout, r.stderr)
