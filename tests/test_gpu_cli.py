"""CLI parts of the GPU path: ``bench save/io --device cuda`` refuse clearly without
CUDA, and ``fastpersist info`` says which GPU path a directory gets."""

from __future__ import annotations

import json

import pytest
import torch

from fastpersist import cli

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")


@pytest.mark.parametrize("bench", ["save", "io"])
def test_bench_device_cuda_without_gpu(tmp_path, capsys, bench):
    code = cli.main(["bench", bench, "--dir", str(tmp_path), "--device", "cuda", "--size", "1M"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--device cuda: no CUDA device" in err
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_info_gpu_lines(tmp_path, capsys):
    assert cli.main(["info", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "GPU save   : none (no CUDA device" in out and "GPU load   : none" in out
    assert cli.main(["info", "--dir", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["gpu_path"]["save"] == "none" and "no CUDA device" in data["gpu_path"]["load_reason"]
