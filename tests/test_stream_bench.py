"""fastpersist bench stream, with a tiny model: the CLI runs end to end (memory cgroup
where one can be made, fio where installed), writes its table, JSON and plot, and every
method generates the same tokens. No timed assertions."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from fastpersist.bench import stream_bench as sb  # noqa: E402
from fastpersist.cli import main  # noqa: E402


def test_model_shape_bytes_match_the_checkpoint(tmp_path) -> None:
    shape = sb.ModelShape(layers=2, hidden=64, intermediate=128, vocab=100, heads=4)
    size = sb.write_checkpoint(shape, str(tmp_path / "m"), shard_bytes=100_000)
    assert shape.weight_bytes() <= size < shape.weight_bytes() + (256 << 10)  # plus headers and alignment
    with open(tmp_path / "m" / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert len(set(index["weight_map"].values())) > 2
    import fastpersist

    for shard in set(index["weight_map"].values()):
        with fastpersist.open(str(tmp_path / "m" / shard)) as r:
            assert r.metadata()["format"] == "pt"
        assert fastpersist.verify(str(tmp_path / "m" / shard)).status == "ok"  # CRC-32s in the tensors' entries


def test_device_map_puts_blocks_on_disk() -> None:
    import transformers
    from accelerate import init_empty_weights

    from fastpersist.streaming import find_blocks

    shape = sb.ModelShape(layers=2, hidden=64, intermediate=128, vocab=100, heads=4)
    with init_empty_weights():
        m = transformers.AutoModelForCausalLM.from_config(shape.config())
    dm = sb._device_map(m, find_blocks(m))
    assert dm["model.layers.0"] == dm["model.layers.1"] == "disk"
    assert dm["lm_head"] == dm["model.embed_tokens"] == "cpu"


def test_bench_stream_cli_smoke(tmp_path, capsys) -> None:
    limited = not sb.cgroup_status().startswith("unavailable")
    args = ["bench", "stream", "--dir", str(tmp_path), "--layers", "3", "--hidden", "64", "--intermediate", "128",
            "--vocab", "100", "--heads", "4", "--prompt", "3", "--new-tokens", "2", "--methods",
            "fastpersist,accelerate,memory", "--fio-size", "16MiB", "--json", str(tmp_path / "r.json"),
            "--plot", str(tmp_path / "r.png"), "--no-progress"]
    if limited:
        args += ["--limit", "2GiB", "--no-unlimited", "--methods", "fastpersist,accelerate"]
    else:
        args += ["--no-limit", "--methods", "fastpersist,memory"]
    rc = main(args)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "Generation with weights larger than memory" in out and "DeepSpeed" in out
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["benchmark"] == "stream" and d["outputs_identical"] is True
    runs = d["runs"]
    assert runs and all(r["ok"] for r in runs), runs
    fp = [r for r in runs if r["method"] == "fastpersist"]
    assert fp[0]["streamed_bytes"] > 0 and fp[0]["tokens_per_s"] > 0 and fp[0]["peak_rss"] > 0
    if limited:
        assert all(r["limit"] == 2 << 30 and r["cgroup_peak"] for r in runs)
    assert os.path.getsize(tmp_path / "r.png") > 0
    assert not [n for n in os.listdir(tmp_path) if n.startswith("fastpersist-stream-")]  # work dir removed
    assert d["malloc_mmap_threshold"] == 1 << 20 and "MALLOC_MMAP_THRESHOLD_" in out


def test_runs_get_a_fixed_malloc_mmap_threshold(monkeypatch) -> None:
    # Accelerate's disk offload frees a copy of every layer's weights after each forward; under
    # glibc's dynamic threshold those blocks stay in the heap and the process grows to most of
    # the model (the OOM killer then ends it under any limit the benchmark sets).
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "999")
    assert sb.child_env(1 << 20)["MALLOC_MMAP_THRESHOLD_"] == str(1 << 20)
    assert "MALLOC_MMAP_THRESHOLD_" not in sb.child_env(0)
    assert sb.child_env(0)["PATH"] == os.environ["PATH"]
