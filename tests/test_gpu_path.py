"""The GPU path of issue 14, on a CUDA device (every test skips without one).

NOT RUN by the session that wrote them (no GPU there). Run on a GPU machine with:

    python -m pytest tests/test_gpu_path.py -q -m gpu -rs

What they check: CUDA state dicts round trip bit-exactly (every dtype, views,
shared storages, non-contiguous tensors, tensors produced on two streams, kernels
still queued at the call); save_async snapshot consistency while the tensors keep
changing on the current stream; loads to ``cuda``/``cuda:0``/``torch.device``/dict
/None go through the ring (fastpersist.cudaload) and land on the right device;
corrupt files are refused; cuFile when available, and the fallback; an injected
write error mid-copy leaves the previous checkpoint intact; the bench commands.
"""

from __future__ import annotations

import os

import pytest
import torch

import fastpersist
import fastpersist.formats.safetensors
import fastpersist.formats.safetensors.load
from fastpersist import _native, cudaload, cudastage
from fastpersist.config import override
from fastpersist.errors import ChecksumError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _dtypes() -> list[torch.dtype]:
    names = ["float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool",
             "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"]
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def _tensor(dt: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * torch.empty(0, dtype=dt).element_size(),), dtype=torch.uint8, generator=g)
    if dt == torch.bool:
        return (raw[:n] & 1).bool().cuda()
    return raw.view(dt).cuda()  # every bit pattern, NaNs included: compared as bytes


def _bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    return bytes(t.view(-1).view(torch.uint8).numpy()) if t.numel() else b""


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
    assert _bytes(a) == _bytes(b)


def _state(n: int = 1 << 16) -> dict:
    sd = {f"t_{str(dt)[6:]}": _tensor(dt, n + i, i) for i, dt in enumerate(_dtypes())}
    base = _tensor(torch.float32, 4096 * 8, 99).view(4096, 8)
    sd["base"] = base
    sd["view"] = base[100:200]
    sd["transposed"] = base.t()
    sd["scalar"] = torch.tensor(3.5, device="cuda")
    sd["empty"] = torch.empty(0, 5, device="cuda")
    sd["nested"] = {"list": [base[7], torch.arange(10, device="cuda")], "step": 12}
    return sd


def _check_state(ref: dict, out: dict, device: str = "cuda") -> None:
    for k, v in ref.items():
        if isinstance(v, torch.Tensor):
            assert out[k].device.type == device, k
            _same(v, out[k])
    assert out["view"].untyped_storage().data_ptr() == out["base"].untyped_storage().data_ptr()
    assert out["transposed"].untyped_storage().data_ptr() == out["base"].untyped_storage().data_ptr()
    _same(ref["nested"]["list"][0], out["nested"]["list"][0])
    assert out["nested"]["step"] == 12


def _spy(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(module, name, spy)
    return calls


def test_round_trip_every_dtype_against_torch(tmp_path, monkeypatch):
    sd = _state()
    calls = _spy(monkeypatch, cudastage, "write_plan_blocking")
    p = str(tmp_path / "fp.pt")
    fastpersist.save(sd, p)
    assert calls, "the blocking save of CUDA state did not take the streaming path"
    ref = str(tmp_path / "torch.pt")
    torch.save(sd, ref)
    a = torch.load(p, map_location="cpu", weights_only=True)  # stock torch reads our file
    b = torch.load(ref, map_location="cpu", weights_only=True)
    _check_state(b, a, "cpu")
    _check_state(sd, torch.load(p, weights_only=True), "cuda")
    assert fastpersist.verify(p).ok


@pytest.mark.parametrize("map_location", ["cuda", "cuda:0", torch.device("cuda", 0), {"cuda:0": "cuda:0"}, None])
def test_load_to_cuda_goes_through_the_ring(tmp_path, monkeypatch, map_location):
    sd = _state()
    p = str(tmp_path / "a.pt")
    fastpersist.save(sd, p)
    calls = _spy(monkeypatch, cudaload, "ring_read")
    out = fastpersist.load(p, map_location=map_location, weights_only=True)
    assert calls, "the CUDA load did not use the ring"
    _check_state(sd, out, "cuda")
    assert all(t.device == torch.device("cuda", 0) for t in out.values() if isinstance(t, torch.Tensor))


def test_load_dict_to_cpu_and_callable(tmp_path):
    sd = _state()
    p = str(tmp_path / "a.pt")
    fastpersist.save(sd, p)
    _check_state(sd, fastpersist.load(p, map_location={"cuda:0": "cpu"}, weights_only=True), "cpu")
    _check_state(sd, fastpersist.load(p, map_location=lambda s, loc: s, weights_only=True), "cpu")


def test_load_of_a_torch_saved_cuda_file(tmp_path):
    sd = _state()
    p = str(tmp_path / "t.pt")
    torch.save(sd, p)
    _check_state(sd, fastpersist.load(p, map_location="cuda", weights_only=True), "cuda")


def test_corrupt_record_is_refused_on_the_cuda_path(tmp_path):
    p = str(tmp_path / "a.pt")
    fastpersist.save({"w": torch.ones(1 << 20, device="cuda")}, p)
    size = os.path.getsize(p)
    with open(p, "r+b") as f:  # flip a byte in the middle of the payload
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ChecksumError):
        fastpersist.load(p, map_location="cuda", weights_only=True)


def test_kernels_queued_before_the_call_are_saved(tmp_path):
    x = torch.zeros(1 << 24, device="cuda")
    for _ in range(50):
        x.add_(1)  # queued, not synchronized
    p = str(tmp_path / "a.pt")
    fastpersist.save({"x": x}, p)
    assert torch.all(torch.load(p, map_location="cpu", weights_only=True)["x"] == 50)


def test_tensors_from_two_streams(tmp_path):
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        a = torch.full((1 << 22,), 3.0, device="cuda")
    with torch.cuda.stream(s2):
        b = torch.full((1 << 22,), 4.0, device="cuda")
    cur = torch.cuda.current_stream()
    cur.wait_stream(s1)  # the user's duty, as for torch.save
    cur.wait_stream(s2)
    p = str(tmp_path / "a.pt")
    fastpersist.save({"a": a, "b": b}, p)
    out = fastpersist.load(p, map_location="cuda", weights_only=True)
    assert torch.all(out["a"] == 3) and torch.all(out["b"] == 4)


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_async_snapshot_consistent_while_tensors_change(tmp_path, monkeypatch, fmt):
    sd = {f"w{i}": torch.randn(1 << 20, device="cuda") for i in range(8)}  # 32 MiB
    old = {k: v.clone() for k, v in sd.items()}
    calls = _spy(monkeypatch, cudastage, "stream_plan")
    p = str(tmp_path / f"a.{fmt}")
    cfg = fastpersist.Config(async_staging_limit=4 << 20)  # 8 x 4 MiB: streams through 2 windows
    fut = fastpersist.save_async(sd, p, config=cfg)
    for v in sd.values():
        v.mul_(-1).add_(1)  # right after the call, on the current stream
    fut.wait()
    assert fut.exception() is None and calls
    out = fastpersist.load(p, map_location="cuda") if fmt == "safetensors" else \
        fastpersist.load(p, map_location="cuda", weights_only=True)
    for k in sd:
        assert torch.equal(out[k], old[k]), k


def test_async_snapshot_under_continued_training(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(64, 512, device="cuda")

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    step()
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    p = str(tmp_path / "a.pt")
    fut = fastpersist.save_async(state, p)
    for _ in range(5):
        step()
    fut.wait()
    assert fut.exception() is None
    out = fastpersist.load(p, map_location="cuda", weights_only=True)
    for k, v in expected.items():
        assert torch.equal(out["model"][k], v), k


def test_blocking_save_larger_than_the_pool(tmp_path):
    sd = {f"w{i}": torch.randn(1 << 21, device="cuda") for i in range(6)}  # 48 MiB through a 4 MiB pool
    p = str(tmp_path / "a.pt")
    with override(async_staging_limit=4 << 20):
        fastpersist.save(sd, p)
    out = fastpersist.load(p, map_location="cuda", weights_only=True)
    assert all(torch.equal(out[k], v) for k, v in sd.items())


def test_write_error_mid_copy_keeps_previous_checkpoint(tmp_path):
    p = str(tmp_path / "a.pt")
    first = {"w": torch.full((1 << 22,), 1.0, device="cuda")}
    fastpersist.save(first, p)
    second = {"w": torch.full((1 << 24,), 2.0, device="cuda")}
    _native.set_fault("write", 2, "EIO")
    try:
        with pytest.raises(OSError):
            fastpersist.save(second, p)
    finally:
        _native.clear_faults()
    out = fastpersist.load(p, map_location="cuda", weights_only=True)
    assert torch.all(out["w"] == 1.0) and out["w"].numel() == 1 << 22
    assert sorted(os.listdir(tmp_path)) == ["a.pt"]
    _native.set_fault("write", 2, "EIO")
    try:
        fut = fastpersist.save_async(second, p, config=fastpersist.Config(async_staging_limit=4 << 20))
        with pytest.raises(OSError, match="previous file at this path is untouched"):
            fut.wait()  # wait() raises the save's error
        assert isinstance(fut.exception(), OSError)
    finally:
        _native.clear_faults()
    assert torch.all(fastpersist.load(p, map_location="cuda", weights_only=True)["w"] == 1.0)


def test_lazy_mode_with_cuda_tensors_captures_at_call_time(tmp_path):
    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    fastpersist.guard(opt)
    expected = model.weight.detach().clone()
    p = str(tmp_path / "a.pt")
    fut = fastpersist.save_async(model.state_dict(), p, mode="lazy")
    with torch.no_grad():
        model.weight.add_(1)
    fut.wait()
    assert torch.equal(fastpersist.load(p, map_location="cuda", weights_only=True)["weight"], expected)


def test_gpu_path_and_cufile(tmp_path, monkeypatch):
    from fastpersist.io import cufile_status, gpu_path

    p = gpu_path(tmp_path)
    assert p.save == "pinned" and p.load in ("pinned", "cufile")
    sd = {"w": torch.randn(1 << 20, device="cuda")}
    f = str(tmp_path / "a.pt")
    fastpersist.save(sd, f)
    with pytest.raises(RuntimeError, match="engine='cufile' cannot save"):
        fastpersist.save(sd, f, config=fastpersist.Config(engine="cufile"))
    if cufile_status() != "available" or gpu_path(tmp_path, checksum=False).load != "cufile":
        pytest.skip(f"cuFile not usable here: {gpu_path(tmp_path, checksum=False).load_reason}")
    calls = _spy(monkeypatch, cudaload, "_cufile_read")
    ring = _spy(monkeypatch, cudaload, "ring_read")
    out = fastpersist.load(f, map_location="cuda", weights_only=True, config=fastpersist.Config(checksum=False))
    assert calls and torch.equal(out["w"], sd["w"])
    if ring:  # cuFile refused this file (ENOTSUP): the auto engine fell back to the ring, the loud one says why
        with pytest.raises(OSError, match="cuFileHandleRegister refused"):
            fastpersist.load(f, map_location="cuda", weights_only=True,
                             config=fastpersist.Config(checksum=False, engine="cufile"))


def test_cufile_fallback_reason_logged(tmp_path, caplog):
    import logging

    f = str(tmp_path / "a.pt")
    fastpersist.save({"w": torch.randn(1000, device="cuda")}, f)
    with caplog.at_level(logging.DEBUG, logger="fastpersist.cudaload"):
        fastpersist.load(f, map_location="cuda", weights_only=True)  # checksums on: the pinned ring
    assert any("pinned ring" in r.getMessage() for r in caplog.records)


def test_no_cuda_init_for_cpu_state_is_kept(tmp_path):
    # on a GPU machine too: a CPU save/load in a fresh process leaves CUDA uninitialised
    from test_cuda_not_initialised import _SCRIPT, _run  # tests/ is on sys.path (rootdir conftest)

    steps = _run(tmp_path, _SCRIPT)
    assert not any(steps.values()), steps


@pytest.mark.parametrize("bench", ["save", "io"])
def test_bench_device_cuda_smoke(tmp_path, bench):
    from fastpersist import cli

    args = ["bench", bench, "--dir", str(tmp_path), "--device", "cuda", "--size", "8M", "--repeat", "1"]
    args += ["--peers", "none"] if bench == "save" else ["--engines", "psync,cufile", "--no-fio"]
    assert cli.main(args) == 0


def test_safetensors_round_trip_on_cuda(tmp_path, monkeypatch):
    sd = {f"t{i}": _tensor(dt, 5000 + i, i) for i, dt in enumerate(_dtypes())
          if dt not in (torch.complex64, torch.complex128)}  # safetensors has no complex dtypes
    sd = {k: v for k, v in sd.items() if v.dtype in fastpersist.formats.safetensors.DTYPE_CODES}
    p = str(tmp_path / "a.safetensors")
    fastpersist.save(sd, p)
    calls = _spy(monkeypatch, fastpersist.formats.safetensors.load, "ring_read")  # imported by name there
    out = fastpersist.load(p, map_location="cuda")
    assert calls
    for k, v in sd.items():
        assert out[k].is_cuda
        _same(v, out[k])
    from safetensors.torch import load_file

    ref = load_file(p, device="cpu")
    for k, v in sd.items():
        _same(ref[k], out[k].cpu())


def test_no_device_wide_synchronize_on_save_and_load(tmp_path, monkeypatch):
    """Saves and loads order themselves with streams and events, never cudaDeviceSynchronize
    (which would stall every stream of the device, the training step's too)."""
    sd = {f"w{i}": torch.randn(1 << 20, device="cuda") for i in range(4)}
    p = str(tmp_path / "a.pt")
    fastpersist.save(sd, p)  # warm-up: windows registered, side streams made
    calls = []
    real = torch.cuda.synchronize

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(torch.cuda, "synchronize", spy)
    fastpersist.save(sd, p)
    fut = fastpersist.save_async(sd, str(tmp_path / "b.pt"))
    fut.wait()
    assert fut.exception() is None
    out = fastpersist.load(p, map_location="cuda", weights_only=True)
    s = str(tmp_path / "c.safetensors")
    fastpersist.save(sd, s)
    out2 = fastpersist.load(s, map_location="cuda")
    assert calls == []
    for k, v in sd.items():
        assert torch.equal(out[k], v) and torch.equal(out2[k], v)
