"""Loads from object storage with the CRC-32s checked as the bytes arrive
(fastpersist.s3download, fastpersist.s3check), against a real s3proxy: bit-exact
against torch.load / safetensors of the same bytes; corrupt, truncated and replaced
objects and broken bodies give named errors, and load_state_dict changes nothing in
the model when the object is bad."""

from __future__ import annotations

import io
from typing import Callable, Iterator

import pytest
import torch

import fastpersist
from fastpersist import objectstore, s3download
from fastpersist.errors import CheckpointFormatError, ChecksumError, ObjectStoreError

pytest.importorskip("boto3", reason="the s3 extra is not installed: pip install 'fastpersist[s3]'")

from s3faultproxy import Fault  # noqa: E402
from s3fixtures import boto, bucket, fault_proxy, faulty, s3_env, s3_server  # noqa: E402,F401 (fixtures)

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _small_ranges() -> Iterator[None]:
    with fastpersist.config.override(s3_part_size=5 * MiB, s3_threads=3):
        yield


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    big = torch.randn(3 * MiB, generator=g)  # 12 MiB: several ranges, records across their edges
    m = torch.randn(40, 30, generator=g)
    return {
        "big": big,
        "view": big[1000:1600].view(20, 30),  # shares big's storage
        "t": m.t(),  # non-contiguous
        "m": m,
        "bf16": torch.randn(17, 5, generator=g).bfloat16(),
        "f16": torch.randn(3, 3, 3, generator=g).half(),
        "f64": torch.randn(7, generator=g, dtype=torch.float64),
        "i64": torch.arange(-50, 50),
        "u8": torch.randint(0, 255, (333,), dtype=torch.uint8, generator=g),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "c64": torch.randn(5, generator=g, dtype=torch.complex64),
        "meta": {"step": 7, "name": "x"},
    }


def _object(boto, bucket: str, key: str) -> bytes:  # noqa: ANN001
    return boto.get_object(Bucket=bucket, Key=key)["Body"].read()


def _same(a, b) -> None:  # noqa: ANN001
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert a.storage_offset() == b.storage_offset()
        assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    else:
        assert a == b


def _flip(blob: bytes, at: int) -> bytes:
    out = bytearray(blob)
    out[at] ^= 0x40
    return bytes(out)


def test_torch_object_loads_bit_exact_and_checked_in_flight(boto, bucket):  # noqa: ANN001
    url = f"s3://{bucket}/a.pt"
    state = _state()
    fastpersist.save(state, url)
    want = torch.load(io.BytesIO(_object(boto, bucket, "a.pt")), weights_only=True)
    got, cfg = objectstore.fetch_for_reading(url)
    with got:
        assert cfg.checksum is False  # every record compared during the download
        assert got.crcs is not None and len(got.crcs) >= 14
    for mmap in (None, False):
        out = fastpersist.load(url, mmap=mmap)
        _same(want, out)
        assert out["view"].untyped_storage().data_ptr() == out["big"].untyped_storage().data_ptr()


def test_object_written_by_torch_loads_bit_exact(boto, bucket):  # noqa: ANN001
    buf = io.BytesIO()
    torch.save(_state(), buf)
    boto.put_object(Bucket=bucket, Key="t.pt", Body=buf.getvalue())
    _same(torch.load(io.BytesIO(buf.getvalue()), weights_only=True), fastpersist.load(f"s3://{bucket}/t.pt"))


def test_safetensors_object_loads_bit_exact(boto, bucket):  # noqa: ANN001
    from safetensors.torch import load as st_load

    url = f"s3://{bucket}/m.safetensors"
    tensors = {k: v.contiguous() for k, v in _state().items() if isinstance(v, torch.Tensor) and k not in ("view",)}
    fastpersist.save_file(tensors, url, metadata={"k": "v"})
    want = st_load(_object(boto, bucket, "m.safetensors"))
    got, cfg = objectstore.fetch_for_reading(url)
    with got:
        assert cfg.checksum is False
    out = fastpersist.load_file(url)
    assert out.keys() == want.keys()
    for k in want:
        _same(want[k], out[k])
    model = torch.nn.Linear(30, 40)
    fastpersist.save_file({"weight": torch.randn(40, 30), "bias": torch.randn(40)}, f"s3://{bucket}/lin.safetensors")
    fastpersist.load_model(model, f"s3://{bucket}/lin.safetensors")
    lin = st_load(_object(boto, bucket, "lin.safetensors"))
    assert torch.equal(model.weight, lin["weight"]) and torch.equal(model.bias, lin["bias"])


@pytest.mark.parametrize("where", ["payload", "pickle"])
def test_corrupt_torch_object_is_a_named_error(boto, bucket, where):  # noqa: ANN001
    from fastpersist.formats.zipindex import buffer_reader, parse_zip_index

    url = f"s3://{bucket}/c.pt"
    fastpersist.save(_state(), url)
    blob = _object(boto, bucket, "c.pt")
    index = parse_zip_index(buffer_reader(blob), len(blob))
    e = max(index.entries, key=lambda e: e.compressed_size) if where == "payload" else index.find("data.pkl")
    boto.put_object(Bucket=bucket, Key="c.pt", Body=_flip(blob, e.data_offset + e.compressed_size // 2))
    with pytest.raises(ChecksumError) as err:
        fastpersist.load(url)
    assert url in str(err.value) and err.value.path == url and e.name in err.value.records
    assert not fastpersist.verify(url)


def test_corrupt_safetensors_object_is_a_named_error(boto, bucket):  # noqa: ANN001
    url = f"s3://{bucket}/c.safetensors"
    fastpersist.save_file({"a": torch.randn(2 * MiB), "b": torch.randn(10)}, url)
    blob = _object(boto, bucket, "c.safetensors")
    boto.put_object(Bucket=bucket, Key="c.safetensors", Body=_flip(blob, len(blob) - 3 * MiB))
    with pytest.raises(ChecksumError, match="'a'") as err:
        fastpersist.load_file(url)
    assert url in str(err.value)
    header_len = int.from_bytes(blob[:8], "little")
    at = blob.index(b'"b"', 8, 8 + header_len) + 1  # the tensor's name in the header
    boto.put_object(Bucket=bucket, Key="c.safetensors", Body=_flip(blob, at))
    with pytest.raises((ChecksumError, CheckpointFormatError)) as err2:
        fastpersist.load_file(url)
    assert url in str(err2.value)


def test_truncated_object_is_a_named_error(boto, bucket):  # noqa: ANN001
    url = f"s3://{bucket}/cut.pt"
    fastpersist.save(_state(), url)
    blob = _object(boto, bucket, "cut.pt")
    boto.put_object(Bucket=bucket, Key="cut.pt", Body=blob[: len(blob) // 2])
    with pytest.raises(CheckpointFormatError) as err:
        fastpersist.load(url)
    assert url in str(err.value)


def test_body_cut_short_is_resumed_then_named(faulty, boto, bucket, monkeypatch):  # noqa: ANN001
    url = f"s3://{bucket}/r.pt"
    state = _state()
    fastpersist.save(state, url)
    faulty.cut_bytes = 1 * MiB
    faulty.arm(Fault("cut", method="GET", nth=2))  # the first payload GET (after the index window)
    _same(state, fastpersist.load(url))
    ranges = [h.get("range") for (m, _t), h in zip(faulty.requests, faulty.headers) if m == "GET"]
    starts = {int(r.split("=")[1].split("-")[0]) for r in ranges if r}
    assert any(s % (5 * MiB) for s in starts if s < 12 * MiB)  # a GET resumed inside its range
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    faulty.clear()
    faulty.arm(Fault("cut", method="GET", count=0))
    with pytest.raises(ObjectStoreError) as err:
        fastpersist.load(url)
    assert err.value.operation == "GetObject" and url in str(err.value)


def _replace_on_call(monkeypatch, url: str, n: int, new: dict) -> Callable[..., None]:  # noqa: ANN001
    """Make the ``n``-th GET of the next load find the object replaced; returns the real GET."""
    original = s3download._get_range
    calls = []

    def replacing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        if len(calls) == n:  # another writer replaces the object between two GETs of a load
            monkeypatch.setattr(s3download, "_get_range", original)
            fastpersist.save(new, url)
            monkeypatch.setattr(s3download, "_get_range", replacing)
        return original(*args, **kwargs)

    monkeypatch.setattr(s3download, "_get_range", replacing)
    return original


def test_object_replaced_after_the_index_fails_the_load(boto, bucket, monkeypatch):  # noqa: ANN001
    url = f"s3://{bucket}/moving.pt"
    fastpersist.save({"w": torch.zeros(3 * MiB)}, url)
    original = _replace_on_call(monkeypatch, url, 2, {"w": torch.ones(3 * MiB)})
    with pytest.raises(ObjectStoreError) as e:
        fastpersist.load(url)
    assert e.value.code == "PreconditionFailed" and "replaced" in str(e.value)
    monkeypatch.setattr(s3download, "_get_range", original)
    assert torch.equal(fastpersist.load(url)["w"], torch.ones(3 * MiB))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.BatchNorm1d(2048), torch.nn.Linear(2048, 64))


def test_load_state_dict_bit_exact_and_untouched_on_error(boto, bucket, monkeypatch):  # noqa: ANN001
    url = f"s3://{bucket}/sd.pt"
    src = _model()
    for p in src.parameters():
        p.data.add_(1.0)
    fastpersist.save({"model": src.state_dict(), "step": 3}, url)
    dst = _model()
    fastpersist.load_state_dict(dst, url, key="model")
    want = torch.load(io.BytesIO(_object(boto, bucket, "sd.pt")), weights_only=True)["model"]
    for k, v in dst.state_dict().items():
        _same(want[k], v)

    fresh = _model()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}

    def untouched() -> None:
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, before[k]), k

    blob = _object(boto, bucket, "sd.pt")
    from fastpersist.formats.zipindex import buffer_reader, parse_zip_index

    big = max(parse_zip_index(buffer_reader(blob), len(blob)).entries, key=lambda e: e.compressed_size)
    boto.put_object(Bucket=bucket, Key="sd.pt", Body=_flip(blob, big.data_offset + 5))
    with pytest.raises(ChecksumError):
        fastpersist.load_state_dict(fresh, url, key="model")
    untouched()
    boto.put_object(Bucket=bucket, Key="sd.pt", Body=blob[: len(blob) - 100])
    with pytest.raises(CheckpointFormatError):
        fastpersist.load_state_dict(fresh, url, key="model")
    untouched()
    boto.put_object(Bucket=bucket, Key="sd.pt", Body=blob)
    _replace_on_call(monkeypatch, url, 2, {"model": src.state_dict(), "step": 4})
    with pytest.raises(ObjectStoreError, match="replaced"):
        fastpersist.load_state_dict(fresh, url, key="model")
    untouched()


@pytest.mark.parametrize("key", ["v.pt", "v.safetensors"])
def test_verify_streams_without_holding_the_payloads(boto, bucket, key):  # noqa: ANN001
    url = f"s3://{bucket}/{key}"
    tensors = {"a": torch.randn(3 * MiB), "b": torch.arange(10)}
    if key.endswith(".pt"):
        fastpersist.save(tensors, url)
    else:
        fastpersist.save_file(tensors, url)
    with objectstore.fetch(url, crcs=True, discard=True) as got:
        assert got.discarded and got.crcs
        import os

        assert os.fstat(got.fd).st_blocks * 512 < got.size // 4  # the payload pages were given back
    result = fastpersist.verify(url)
    assert result.ok and result.status == "ok" and result.path == url
    blob = _object(boto, bucket, key)
    boto.put_object(Bucket=bucket, Key=key, Body=_flip(blob, len(blob) // 2))
    bad = fastpersist.verify(url)
    assert not bad.ok and bad.status == "corrupt" and bad.problems and all("/proc/" not in p for p in bad.problems)
    with fastpersist.config.override(checksum=True):  # the file-based verify of the same bytes agrees
        with objectstore.fetch(url) as whole:
            from fastpersist import handles
            from fastpersist.formats import registry

            ref = registry.format_for(key).verify(whole.path, handles.handle_for(fastpersist.config.get_default(),
                                                                                read=True))
            assert [p.replace(whole.path, url) for p in ref.problems] == bad.problems
