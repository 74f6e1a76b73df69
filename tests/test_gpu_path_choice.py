"""The decision table of fastpersist.io.gpu_path (which path CUDA bytes take, and
why) and ``engine="cufile"`` failing loudly.

On machines without a GPU only the "no CUDA device" row is real; the other rows
are checked by making ``torch.cuda.is_available`` and the cuFile probe answer as
they would on a GPU machine. That checks the *decision*, not any CUDA code (the
data paths are in tests/test_gpu_path.py, skipped without a GPU).
"""

from __future__ import annotations

import pytest
import torch

import fastpersist.io as fio


def test_no_cuda_device(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    p = fio.gpu_path(tmp_path)
    assert (p.save, p.load) == ("none", "none") and "no CUDA device" in p.save_reason
    assert any("GPU save" in line for line in p.lines())


@pytest.fixture
def gpu_like(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def set_cufile(status: str, direct: bool = True) -> None:
        monkeypatch.setattr(fio, "cufile_status", lambda: status)
        monkeypatch.setattr(fio, "direct_io_supported", lambda _p: direct)

    return set_cufile


def test_cufile_unavailable_falls_back_with_reason(tmp_path, gpu_like):
    gpu_like("libcufile not loadable: nope")
    p = fio.gpu_path(tmp_path)
    assert (p.save, p.load) == ("pinned", "pinned")
    assert "libcufile not loadable" in p.load_reason
    with pytest.raises(RuntimeError, match="engine='cufile' cannot load.*libcufile not loadable"):
        fio.require_cufile(tmp_path, "load")


def test_no_o_direct(tmp_path, gpu_like):
    gpu_like("available", direct=False)
    p = fio.gpu_path(tmp_path, checksum=False)
    assert p.load == "pinned" and "O_DIRECT" in p.load_reason


def test_cufile_loads_only_without_checksums(tmp_path, gpu_like):
    gpu_like("available")
    assert fio.gpu_path(tmp_path, checksum=True).load == "pinned"
    p = fio.gpu_path(tmp_path, checksum=False)
    assert p.load == "cufile"
    fio.require_cufile(tmp_path, "load", checksum=False)  # no error
    assert p.save == "pinned" and "CRC-32" in p.save_reason
    with pytest.raises(RuntimeError, match="cannot save"):
        fio.require_cufile(tmp_path, "save")


def test_other_engines_stage(tmp_path, gpu_like):
    gpu_like("available")
    p = fio.gpu_path(tmp_path, engine="psync", checksum=False)
    assert (p.save, p.load) == ("pinned", "pinned") and "psync" in p.load_reason


def test_load_destinations_follow_torch_map_location(monkeypatch):
    """torchdevice.destinations applies torch's map_location rules (string/device: every
    storage; dict: saved locations mapped, others kept; None: saved locations; callable:
    the host path), with a 2-GPU machine's answers faked: the mapping, not CUDA."""
    from fastpersist.formats import torchdevice

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    pids = [("storage", None, "0", "cpu", 4), ("storage", None, "1", "cuda:0", 4),
            ("storage", None, "2", "cuda:1", 4), ("storage", None, "3", "cuda:5", 4), "junk"]
    c0, c1 = torch.device("cuda", 0), torch.device("cuda", 1)
    d = torchdevice.destinations
    assert d("cuda", pids) == {"0": c1, "1": c1, "2": c1, "3": c1}  # "cuda" = the current device
    assert d("cuda:0", pids) == {k: c0 for k in "0123"}
    assert d(torch.device("cuda", 1), pids) == {k: c1 for k in "0123"}
    assert d("cuda:7", pids) == {}  # torch raises its own error
    assert d("cpu", pids) == {}
    assert d(None, pids) == {"1": c0, "2": c1}  # saved cpu stays; cuda:5 does not exist: torch's error
    assert d({"cuda:1": "cuda:0", "cpu": "cuda"}, pids) == {"0": c1, "1": c0, "2": c0}
    assert d({"cuda:0": "cpu", "cuda:1": "cpu"}, pids) == {}
    assert d(lambda s, loc: s, pids) == {}
    conflicting = [("storage", None, "9", "cuda:0", 4), ("storage", None, "9", "cpu", 4)]
    assert d(None, conflicting) == {}
