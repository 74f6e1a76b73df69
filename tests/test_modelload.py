"""fastpersist.load_model of a .safetensors file into a CPU model reads each tensor in
place (the model's own memory, no second copy of the weights) and gives exactly what
safetensors' load_model gives: values, dtype conversion, names reported, errors."""

from __future__ import annotations

import pytest
import torch

import fastpersist
from fastpersist.errors import FastPersistError

st = pytest.importorskip("safetensors.torch")


class _Net(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.a = torch.nn.Linear(300, 257).to(dtype)
        self.b = torch.nn.Linear(257, 3, bias=False).to(dtype)
        self.register_buffer("steps", torch.arange(5, dtype=torch.int64))
        self.register_buffer("scale16", torch.ones(7, dtype=torch.float16))


def _net(seed: int, dtype: torch.dtype = torch.float32) -> _Net:
    torch.manual_seed(seed)
    net = _Net(dtype)
    with torch.no_grad():
        net.steps += seed
        net.scale16 *= seed
    return net


def _same(x: torch.nn.Module, y: torch.nn.Module) -> None:
    sx, sy = x.state_dict(), y.state_dict()
    assert list(sx) == list(sy)
    for k in sx:
        assert sx[k].dtype == sy[k].dtype and torch.equal(sx[k], sy[k]), k


@pytest.mark.parametrize("writer", ["safetensors", "fastpersist"])
def test_in_place_and_equal_to_safetensors(tmp_path, writer: str, monkeypatch) -> None:
    path = str(tmp_path / "m.safetensors")
    if writer == "safetensors":
        st.save_model(_net(0), path)
    else:
        fastpersist.save_file(_net(0).state_dict(), path)
    want, got = _net(1), _net(2)
    ptrs = {k: v.data_ptr() for k, v in got.state_dict().items()}

    def no_whole_file_load(*a, **kw):
        raise AssertionError("load_model of a CPU model read the file into fresh tensors first")

    monkeypatch.setattr(fastpersist.pipeline, "load_file", no_whole_file_load)
    assert st.load_model(want, path) == fastpersist.load_model(got, path) == (set(), [])
    _same(got, want)
    assert {k: v.data_ptr() for k, v in got.state_dict().items()} == ptrs  # read into the model's own memory


def test_dtype_converted_like_load_state_dict(tmp_path) -> None:
    path = str(tmp_path / "fp32.safetensors")
    st.save_model(_net(0), path)
    want, got = _net(1, torch.bfloat16), _net(2, torch.bfloat16)
    assert st.load_model(want, path) == fastpersist.load_model(got, path)
    _same(got, want)


def test_shape_mismatch_raises_and_leaves_the_model(tmp_path) -> None:
    path = str(tmp_path / "m.safetensors")
    sd = _net(0).state_dict()
    sd["b.weight"] = torch.zeros(4, 257)
    st.save_file(sd, path)
    with pytest.raises(RuntimeError, match="b.weight"):
        st.load_model(_net(1), path)
    m, before = _net(1), _net(1)
    with pytest.raises(RuntimeError, match="size mismatch for b.weight"):
        fastpersist.load_model(m, path)
    _same(m, before)  # checked before any byte was read


def test_corrupt_payload_is_an_error_never_silent(tmp_path) -> None:
    path = tmp_path / "m.safetensors"
    fastpersist.save_file(_net(0).state_dict(), str(path))  # fastpersist's file: CRC-32 per tensor
    with fastpersist.open(str(path)) as f:
        info = f.info("a.weight")
    data = bytearray(path.read_bytes())
    data[info.file_offset + 100] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(FastPersistError) as e:
        fastpersist.load_model(_net(1), str(path))
    assert "a.weight" in str(e.value) or str(path) in str(e.value)


def test_model_off_the_cpu_or_a_torch_file_takes_the_copying_way(tmp_path) -> None:
    path = str(tmp_path / "m.pt")
    torch.save(_net(0).state_dict(), path)
    got = _net(1)
    assert fastpersist.load_model(got, path) == (set(), [])
    _same(got, _net(0))
