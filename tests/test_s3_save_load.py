"""s3:// URLs through save, load, verify against a real S3 server (s3proxy): the objects
are the bytes of a local save, stock loaders read them, uploads leave nothing behind."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import torch

import fastpersist
from fastpersist import s3upload
from fastpersist.errors import ChecksumError, ObjectStoreError
from fastpersist.s3url import S3Url, is_s3_url, parse

pytest.importorskip("boto3", reason="the s3 extra is not installed: pip install 'fastpersist[s3]'")

from conftest import assert_same_object  # noqa: E402
from s3fixtures import boto, bucket, five_mib_parts, s3_env, s3_server  # noqa: E402,F401 (fixtures)


def _state(mib: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(7)
    n = int(mib * (1 << 20) / 4)
    base = torch.randn(n, generator=g)
    return {
        "model": {"w": base, "view": base[10:1000].view(10, 99), "bf16": torch.randn(33, 7, generator=g).bfloat16(),
                  "flag": torch.tensor(True), "empty": torch.empty(0, 3), "i8": torch.arange(-5, 5, dtype=torch.int8)},
        "step": 12,
        "name": "run-a",
        "nested": [1.5, (torch.ones(3, dtype=torch.float64), None)],
    }


def _object(boto, bucket: str, key: str) -> bytes:  # noqa: ANN001
    return boto.get_object(Bucket=bucket, Key=key)["Body"].read()


def _uploads(boto, bucket: str) -> list:  # noqa: ANN001
    return boto.list_multipart_uploads(Bucket=bucket).get("Uploads", [])


@pytest.mark.parametrize("mib", [0.01, 1.0, 23.0])
def test_torch_object_is_a_local_save_and_loads_everywhere(boto, bucket, tmp_path, five_mib_parts, mib):  # noqa: ANN001
    state = _state(mib)
    url = f"s3://{bucket}/run/ckpt.pt"
    fastpersist.save(state, url)
    local = tmp_path / "ckpt.pt"
    fastpersist.save(state, local)
    blob = _object(boto, bucket, "run/ckpt.pt")
    assert blob == local.read_bytes()  # the same bytes as a local save
    assert_same_object(torch.load(io.BytesIO(blob)), state)  # stock torch.load reads the object
    assert_same_object(fastpersist.load(url), state)
    assert_same_object(fastpersist.load(url, mmap=False), state)
    assert_same_object(fastpersist.load(url, map_location="cpu", weights_only=True), state)
    assert fastpersist.verify(url).ok
    assert _uploads(boto, bucket) == []
    if mib > 20:
        etag = boto.head_object(Bucket=bucket, Key="run/ckpt.pt")["ETag"].strip('"')
        assert etag.endswith("-5"), etag  # a multipart object of five parts


@pytest.mark.parametrize("mib", [0.01, 12.0])
def test_safetensors_object_is_a_local_save(boto, bucket, tmp_path, five_mib_parts, mib):  # noqa: ANN001
    from safetensors.torch import load as st_load

    g = torch.Generator().manual_seed(3)
    tensors = {"a": torch.randn(int(mib * 65536), 4, generator=g), "b": torch.arange(100, dtype=torch.int16),
               "c": torch.randn(3, 3, generator=g).half()}
    url = f"s3://{bucket}/m.safetensors"
    fastpersist.save(tensors, url, metadata={"epoch": "3"})
    local = tmp_path / "m.safetensors"
    fastpersist.save(tensors, local, metadata={"epoch": "3"})
    blob = _object(boto, bucket, "m.safetensors")
    assert blob == local.read_bytes()
    ordered = dict(sorted(tensors.items()))  # safetensors readers return names sorted
    assert_same_object(dict(sorted(st_load(blob).items())), ordered)
    assert_same_object(dict(sorted(fastpersist.load(url).items())), ordered)
    result = fastpersist.verify(url)
    assert result.ok and result.format == "safetensors" and result.path == url


def test_overwrite_replaces_whole_object(boto, bucket):  # noqa: ANN001
    url = f"s3://{bucket}/k.pt"
    fastpersist.save({"v": torch.zeros(1000)}, url)
    fastpersist.save({"v": torch.ones(10)}, url)
    assert torch.equal(fastpersist.load(url)["v"], torch.ones(10))


def test_object_torch_cannot_plan_is_saved_by_torchs_writer(boto, bucket, tmp_path):  # noqa: ANN001
    q = torch.quantize_per_tensor(torch.randn(16), 0.1, 0, torch.qint8)  # no fast layout for quantized tensors
    url = f"s3://{bucket}/q.pt"
    fastpersist.save({"q": q}, url)
    got = torch.load(io.BytesIO(_object(boto, bucket, "q.pt")), weights_only=False)
    assert torch.equal(got["q"].int_repr(), q.int_repr())
    assert torch.equal(fastpersist.load(url, weights_only=False)["q"].int_repr(), q.int_repr())


def test_verify_finds_a_flipped_byte_and_load_refuses_it(boto, bucket, tmp_path):  # noqa: ANN001
    url = f"s3://{bucket}/c.pt"
    state = {"w": torch.randn(4096)}
    fastpersist.save(state, url)
    blob = bytearray(_object(boto, bucket, "c.pt"))
    pos = blob.find(state["w"].numpy().tobytes()[:64])
    assert pos > 0
    blob[pos + 100] ^= 0x40
    boto.put_object(Bucket=bucket, Key="c.pt", Body=bytes(blob))
    result = fastpersist.verify(url)
    assert result.status == "corrupt" and result.path == url
    assert any("CRC-32 mismatch" in p for p in result.problems), result.problems
    with pytest.raises(ChecksumError) as e:
        fastpersist.load(url)
    assert "/proc/self/fd" not in str(e.value)


def test_missing_object_and_bad_urls(boto, bucket):  # noqa: ANN001
    with pytest.raises(FileNotFoundError) as e:
        fastpersist.load(f"s3://{bucket}/nothing.pt")
    assert isinstance(e.value, ObjectStoreError) and e.value.url == f"s3://{bucket}/nothing.pt"
    with pytest.raises(FileNotFoundError):
        fastpersist.verify(f"s3://{bucket}/nothing.safetensors")
    for bad in ("s3://", "s3://Bad_Bucket/k", f"s3://{bucket}", f"s3://{bucket}/", f"s3://{bucket}/dir/"):
        with pytest.raises(ValueError, match="s3://"):
            fastpersist.save({"a": 1}, bad)
    with pytest.raises(TypeError, match="metadata"):
        fastpersist.save({"a": torch.ones(1)}, f"s3://{bucket}/x.pt", metadata={"k": "v"})


def test_url_parsing() -> None:
    assert parse("s3://my-bucket/a/b.pt") == S3Url("my-bucket", "a/b.pt")
    assert str(parse("s3://my-bucket/a/b.pt")) == "s3://my-bucket/a/b.pt"
    assert is_s3_url("s3://b/k") and not is_s3_url("/tmp/s3://x") and not is_s3_url(b"s3://b/k")


def test_part_sizes_follow_s3_rules() -> None:
    MiB = 1 << 20
    assert s3upload.part_size(0) == 16 * MiB
    assert s3upload.part_size(1 << 30) == 16 * MiB
    assert s3upload.part_size(1 << 30, preferred=1) == 5 * MiB  # never under S3's 5 MiB
    big = 400 << 30  # 400 GiB: 16 MiB parts would be 25,600 of them
    p = s3upload.part_size(big)
    assert -(-big // p) <= 10_000 and p % MiB == 0 and p > 16 * MiB
    with pytest.raises(ValueError):
        s3upload.part_size(60 << 40)  # 60 TiB needs parts over 5 GiB


def test_core_does_not_import_the_client() -> None:
    code = ("import sys, torch, fastpersist; fastpersist.save({'a': torch.ones(2)}, sys.argv[1]); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('boto3', 'botocore', 's3transfer')]; "
            "assert not bad, bad")
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-c", code, os.path.join(d, "x.pt")], check=True)


def test_safetensors_style_functions(boto, bucket, tmp_path):  # noqa: ANN001
    from safetensors.torch import load as st_load

    tensors = {"weight": torch.randn(8, 4), "bias": torch.randn(8)}
    url = f"s3://{bucket}/st/model.safetensors"
    fastpersist.save_file(tensors, url, metadata={"k": "v"})
    fastpersist.save_file(tensors, tmp_path / "model.safetensors", metadata={"k": "v"})
    blob = _object(boto, bucket, "st/model.safetensors")
    assert blob == (tmp_path / "model.safetensors").read_bytes()  # exactly the metadata given, as save_file
    assert torch.equal(st_load(blob)["weight"], tensors["weight"])
    got = fastpersist.load_file(url)
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], tensors[k]) for k in tensors)
    model = torch.nn.Linear(4, 8)
    missing, unexpected = fastpersist.load_model(model, url)
    assert not missing and not unexpected and torch.equal(model.weight.detach(), tensors["weight"])
    with pytest.raises(FileNotFoundError):
        fastpersist.load_file(f"s3://{bucket}/st/none.safetensors")


def test_object_replaced_during_a_load_fails_it(boto, bucket, five_mib_parts, monkeypatch):  # noqa: ANN001
    from fastpersist import s3download

    url = f"s3://{bucket}/moving.pt"
    fastpersist.save({"w": torch.zeros(3 << 20)}, url)  # 12 MiB: three ranged GETs
    original = s3download._get_range
    calls = []

    def replacing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if not calls:  # another writer replaces the object after the HEAD, before the GETs
            fastpersist.save({"w": torch.ones(3 << 20)}, url)
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(s3download, "_get_range", replacing)
    with pytest.raises(ObjectStoreError) as e:
        fastpersist.load(url)
    assert e.value.code == "PreconditionFailed" and "replaced" in str(e.value)
    monkeypatch.setattr(s3download, "_get_range", original)
    assert torch.equal(fastpersist.load(url)["w"], torch.ones(3 << 20))


def test_group_calls_with_urls_need_a_process_group() -> None:
    """group= with a URL is a collective (tests/test_s3_collective.py): without an initialized
    process group it says so before any request."""
    sentinel = object()
    with pytest.raises(RuntimeError, match="init_process_group"):
        fastpersist.save({"a": torch.ones(1)}, "s3://some-bucket/k.pt", group=sentinel)
    with pytest.raises(RuntimeError, match="init_process_group"):
        fastpersist.load("s3://some-bucket/k.pt", group=sentinel)
    with pytest.raises(RuntimeError, match="init_process_group"):
        fastpersist.save_async({"a": torch.ones(1)}, "s3://some-bucket/k.pt", group=sentinel)