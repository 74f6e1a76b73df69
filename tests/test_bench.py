"""fastpersist.bench: workloads, helpers and the benchmark drivers, with tiny sizes.

Numbers are checked for shape and sign only (no timed assertions); data is
checked for equality wherever a benchmark moves it.
"""

from __future__ import annotations

import ctypes
import errno
import io
import json
import math
import mmap
import os
import random
import shutil
import sys
from collections import OrderedDict

import pytest
import torch

from fastpersist.bench import fio as fio_mod
from fastpersist.bench import state as S
from fastpersist.bench.fsutil import drop_page_cache, files_under, total_size
from fastpersist.bench.io_bench import run_io_bench
from fastpersist.machine import collect_machine_info, probe_direct_io
from fastpersist.bench.ceiling import EngineProbe, write_ceiling
from fastpersist.bench.progress import NoProgress, PlainProgress, progress
from fastpersist.bench.report import WIDTH, plot_io, plot_save, print_io_report, print_save_report
from fastpersist.bench.save_bench import (
    DcpMethod,
    FastPersistMethod,
    Method,
    MethodResult,
    SafetensorsMethod,
    TorchMethod,
    _measure,
    load_in_fresh_process,
    run_save_bench,
)
from fastpersist.units import format_block, format_bytes, gbps, parse_int_list, parse_size, parse_size_list

MiB = 1 << 20
HAVE_FIO = fio_mod.fio_executable() is not None
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _cpu_engines() -> list[str]:
    from fastpersist.io import available_engines

    return [e for e in available_engines() if e != "cufile"]


def _assert_png(path: str) -> None:
    with open(path, "rb") as f:
        head = f.read(8)
    assert head == PNG_MAGIC, f"{path} is not a PNG"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img = plt.imread(path)
    assert img.shape[0] > 100 and img.shape[1] > 100


# ---- units ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,value",
    [("4096", 4096), ("1M", MiB), ("8MiB", 8 * MiB), ("1GiB", 1 << 30), ("2GB", 2 * 10**9),
     ("512k", 512 << 10), ("1.5K", 1536), ("3 MB", 3 * 10**6), ("1T", 1 << 40)],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "abc", "1XB", "-1M", "0.3"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_parse_lists_and_formats() -> None:
    assert parse_size_list("1M,8M") == [MiB, 8 * MiB]
    assert parse_int_list("4, 8,16") == [4, 8, 16]
    with pytest.raises(ValueError):
        parse_int_list("4,0")
    with pytest.raises(ValueError):
        parse_int_list("4,x")
    assert format_bytes(3 << 30) == "3.00 GiB"
    assert format_bytes(10) == "10 B"
    assert format_block(8 * MiB) == "8M" and format_block(4096) == "4K" and format_block(4097) == "4097"
    assert gbps(2 * 10**9, 2.0) == 1.0


@pytest.mark.parametrize("use_rich", [True, False])
def test_render_table(monkeypatch, use_rich: bool) -> None:
    from fastpersist.bench.report import render_table

    if not use_rich:
        for mod in ("rich", "rich.console", "rich.table"):
            monkeypatch.setitem(sys.modules, mod, None)  # as if rich were not installed
    out = io.StringIO()
    render_table("Title", ["method", "GB/s"], [["torch", "1.00"], ["fastpersist", "12.50"]], out)
    text = out.getvalue()
    assert "Title" in text and "fastpersist" in text and "12.50" in text
    assert ("┃" in text) is use_rich
    lines = [line for line in text.splitlines() if "torch" in line or "fastpersist" in line]
    assert len(lines) == 2


# ---- workloads --------------------------------------------------------------------


@pytest.mark.parametrize("size", [8 * MiB, 64 * MiB, 2 << 30, 64 << 30])
def test_gpt_shape_matches_requested_size(size: int) -> None:
    shape = S.gpt_shape_for_bytes(size)
    assert shape.layers >= 1 and shape.hidden % 64 == 0
    assert abs(shape.params * S.BYTES_PER_PARAM / size - 1) < 0.25


def test_training_state_is_realistic_and_deterministic() -> None:
    a = S.build_training_state(8 * MiB, seed=0)
    b = S.build_training_state(8 * MiB, seed=0)
    c = S.build_training_state(8 * MiB, seed=1)
    assert S.compare_states(a, b) == []
    assert S.compare_states(a, c) != []
    assert abs(S.tensor_bytes(a) / (8 * MiB) - 1) < 0.25
    shape = S.gpt_shape_for_bytes(8 * MiB)
    n_params = len(a["model"])
    assert n_params == 2 + 12 * shape.layers + 2
    assert S.count_tensors(a) == 4 * n_params + n_params + 1  # model, master, 2 moments, steps; rng
    assert {t.dtype for t in a["model"].values()} == {torch.bfloat16}
    assert {t.dtype for t in a["master_weights"].values()} == {torch.float32}
    name = "layers.0.mlp.fc1.weight"
    assert a["model"][name].shape == (4 * shape.hidden, shape.hidden)
    assert torch.equal(a["model"][name], a["master_weights"][name].to(torch.bfloat16))
    assert all(bool((s["exp_avg_sq"] >= 0).all()) for s in a["optimizer"]["state"].values())
    assert isinstance(a["iteration"], int) and isinstance(a["rng_state"]["python"], tuple)
    # What a trainer saves must load with torch's safe loader.
    buf = io.BytesIO()
    torch.save(a, buf)
    buf.seek(0)
    assert S.compare_states(a, torch.load(buf, weights_only=True)) == []


def test_small_tensors() -> None:
    t = S.build_small_tensors(200, seed=3)
    assert len(t) == 200
    sizes = [x.numel() * x.element_size() for x in t.values()]
    assert min(sizes) >= 1024 - 8 and max(sizes) <= 1 << 20
    assert len(set(sizes)) > 150  # random sizes, not one size
    assert {x.dtype for x in t.values()} >= {torch.float32, torch.bfloat16, torch.int64}
    assert S.compare_states(t, S.build_small_tensors(200, seed=3)) == []
    with pytest.raises(ValueError):
        S.build_small_tensors(0)


def test_flatten_tensors_keeps_tensors_and_lists_skipped_leaves() -> None:
    state = S.build_training_state(1 * MiB)
    flat, skipped = S.flatten_tensors(state)
    assert len(flat) == S.count_tensors(state)
    assert torch.equal(flat["optimizer.state.0.exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert flat["rng_state.torch"] is state["rng_state"]["torch"]
    assert "iteration" in skipped and "rng_state.python" in skipped and "optimizer.param_groups.0.lr" in skipped
    assert not set(skipped) & set(flat)


def test_compare_states_finds_each_kind_of_difference() -> None:
    base = {"a": torch.arange(10, dtype=torch.float32), "b": [1, (2, 3)], "c": OrderedDict(x=torch.zeros(2))}

    def variant() -> dict:
        return {"a": base["a"].clone(), "b": [1, (2, 3)], "c": OrderedDict(x=torch.zeros(2))}

    assert S.compare_states(base, variant()) == []
    v = variant()
    v["a"][7] = -1
    assert S.compare_states(base, v) == ["a: tensor values differ"]
    v = variant()
    v["a"] = v["a"].double()
    assert "float64" in S.compare_states(base, v)[0]
    v = variant()
    v["b"][1] = (2, 4)
    assert S.compare_states(base, v) == ["b.1.1: expected 3, got 4"]
    v = variant()
    del v["c"]
    assert "keys differ" in S.compare_states(base, v)[0]
    v = variant()
    v = {"b": v["b"], "a": v["a"], "c": v["c"]}
    assert S.compare_states(base, v) == ["<root>: same keys in a different order"]
    v = variant()
    v["b"] = [1, [2, 3]]
    assert "expected tuple" in S.compare_states(base, v)[0]


def test_empty_like_state_keeps_structure() -> None:
    state = S.build_training_state(1 * MiB)
    tmpl = S.empty_like_state(state)
    assert [(k, t.shape, t.dtype) for k, t in S.iter_tensors(tmpl)] == [
        (k, t.shape, t.dtype) for k, t in S.iter_tensors(state)
    ]
    assert tmpl["model"]["embed.tokens.weight"].data_ptr() != state["model"]["embed.tokens.weight"].data_ptr()
    assert tmpl["iteration"] == state["iteration"]


# ---- file-system helpers ----------------------------------------------------------


def _resident_pages(path: str) -> int:
    """Pages of ``path`` in the page cache, by mincore(2) on a private mapping."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        view = (ctypes.c_char * size).from_buffer(mm)
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(ctypes.addressof(view)), ctypes.c_size_t(size), vec) != 0:
                pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
            return sum(v & 1 for v in vec)
        finally:
            del view
    finally:
        mm.close()


def test_drop_page_cache_evicts_the_file(tmp_path) -> None:
    if collect_machine_info(str(tmp_path)).filesystem in ("tmpfs", "ramfs"):
        pytest.skip("a RAM filesystem has no page cache to drop")
    path = str(tmp_path / "f.bin")
    data = random.Random(0).randbytes(4 * MiB)
    with open(path, "wb") as f:
        f.write(data)
    with open(path, "rb") as f:
        assert f.read() == data
    pages = 4 * MiB // mmap.PAGESIZE
    assert _resident_pages(path) > pages // 2
    drop_page_cache(path)
    assert _resident_pages(path) < pages // 10
    with open(path, "rb") as f:
        assert f.read() == data  # dropping the cache never touches the data


def test_files_under_and_total_size(tmp_path) -> None:
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "a").write_bytes(b"x" * 10)
    (tmp_path / "d" / "e" / "b").write_bytes(b"y" * 5)
    assert files_under(str(tmp_path / "d")) == [str(tmp_path / "d" / "a"), str(tmp_path / "d" / "e" / "b")]
    assert total_size(str(tmp_path / "d")) == 15
    assert total_size(str(tmp_path / "d" / "a")) == 10


# ---- machine ----------------------------------------------------------------------


def test_machine_info_describes_the_directory(tmp_path) -> None:
    from fastpersist import _native

    info = collect_machine_info(str(tmp_path))
    assert info.cpu_count >= 1 and 1 <= info.cpus_usable <= info.cpu_count
    assert info.memory_bytes > 0
    assert info.filesystem and info.filesystem != "unknown"
    assert info.torch_version == torch.__version__
    assert info.engines == list(_native.available_engines()) and "psync" in info.engines
    assert info.direct_io == _native.direct_io_supported(str(tmp_path))
    assert info.direct_io_alignment == _native.alignment_of(str(tmp_path))
    assert info.native_error is None
    if info.block_device is not None:  # a real disk: its readahead as sysfs has it, printed
        st = os.stat(tmp_path)
        real = os.path.realpath(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
        disk = os.path.dirname(real) if os.path.exists(os.path.join(real, "partition")) else real
        with open(os.path.join(disk, "queue", "read_ahead_kb")) as f:
            assert info.read_ahead_kb == int(f.read())
        assert f"readahead {info.read_ahead_kb} KiB" in "\n".join(info.summary_lines())
    json.dumps(info.to_dict())
    text = "\n".join(info.summary_lines())
    for word in ("CPU", "Filesystem", "O_DIRECT", "torch", info.filesystem):
        assert word in text
    with pytest.raises(FileNotFoundError, match="does not exist"):
        collect_machine_info(str(tmp_path / "missing"))


def test_python_direct_io_probe_agrees_with_native(tmp_path) -> None:
    from fastpersist import _native

    supported, align = probe_direct_io(str(tmp_path))
    assert supported == _native.direct_io_supported(str(tmp_path))
    assert align >= 4096 and align % 4096 == 0
    assert os.listdir(tmp_path) == []  # the probe file is gone


# ---- fio --------------------------------------------------------------------------


@pytest.mark.skipif(not HAVE_FIO, reason="fio not on PATH")
def test_fio_ceiling_measures_write_and_read(tmp_path) -> None:
    direct = bool(collect_machine_info(str(tmp_path)).direct_io)
    res = fio_mod.fio_ceiling(str(tmp_path), 2 * MiB, block_sizes=(MiB,), iodepths=(2, 4), direct=direct)
    assert res.error is None
    n_sweep = fio_mod.fio_sweep_count(2 * MiB, (MiB,), (2, 4))
    assert n_sweep == 7
    sweep = res.runs[:n_sweep]
    assert [(r.rw, r.iodepth, r.numjobs) for r in sweep[:4]] == [
        ("write", 2, 1), ("read", 2, 1), ("write", 4, 1), ("read", 4, 1)]
    # one configuration is not a ceiling: two jobs (each half the file), then a buffered write + fsync
    assert [(r.rw, r.numjobs, r.iodepth, r.direct) for r in sweep[4:6]] == [
        ("write", 2, 2, direct), ("read", 2, 2, direct)]
    assert (sweep[6].rw, sweep[6].direct, sweep[6].ioengine) == ("write", False, "psync")
    assert all(r.gbps > 0 and r.nbytes == 2 * MiB for r in res.runs)
    best_w = max((r for r in sweep if r.rw == "write"), key=lambda r: r.gbps)
    best_r = max((r for r in sweep if r.rw == "read"), key=lambda r: r.gbps)
    assert res.best_write is best_w and res.best_read is best_r
    # then 3 rounds of (write, read, buffered read) with the best configurations; the sweep's runs do not count
    rounds = res.runs[n_sweep:]
    assert [(r.rw, r.direct) for r in rounds[1::3]] == [("read", best_r.direct)] * 3
    assert [(r.rw, r.direct, r.ioengine) for r in rounds[2::3]] == [("read", False, "psync")] * 3
    assert all(fio_mod._config_of(r) == fio_mod._config_of(best_w) and r.rw == "write" for r in rounds[0::3])
    assert all(fio_mod._config_of(r) == fio_mod._config_of(best_r) for r in rounds[1::3])
    assert res.write_repeats == [r.gbps for r in rounds[0::3]]
    assert res.read_repeats == [r.gbps for r in rounds[1::3]]
    # the buffered sequential read (page cache) and the read ceiling: the higher of the two medians
    assert res.buffered_read_repeats == [r.gbps for r in rounds[2::3]]
    assert res.buffered_read_gbps == sorted(res.buffered_read_repeats)[1]
    assert res.read_ceiling_gbps == max(res.read_gbps, res.buffered_read_gbps)
    assert res.to_dict()["read_ceiling_gbps"] == res.read_ceiling_gbps
    assert res.write_gbps == sorted(res.write_repeats)[1] > 0
    assert res.read_gbps == sorted(res.read_repeats)[1] > 0
    assert len(res.runs) == fio_mod.fio_sweep_count(2 * MiB, (MiB,), (2, 4)) + 9
    json.dumps(res.to_dict())
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not HAVE_FIO, reason="fio not on PATH")
def test_fio_probe_rounds_interleave_and_stop_after_a_failure(tmp_path) -> None:
    direct = bool(collect_machine_info(str(tmp_path)).direct_io)
    work = tmp_path / "d"
    work.mkdir()
    probe = fio_mod.FioProbe(str(work), MiB, block_sizes=(MiB,), iodepths=(1,), direct=direct, extras=False)
    probe.round()  # before the sweep there is no configuration to repeat: nothing runs
    assert probe.result.runs == [] and probe.ok
    probe.sweep()
    assert len(probe.result.runs) == 2 and probe.result.write_gbps is None
    assert os.listdir(work) == []  # no file left between turns
    probe.round()
    assert len(probe.result.write_repeats) == 1 and probe.result.read_gbps == probe.result.read_repeats[0]
    work.rmdir()  # the directory becomes a file: the next round fails, is recorded, and ends the probe
    work.write_bytes(b"")
    probe.round()
    assert not probe.ok and "fio" in (probe.result.error or "")
    n = len(probe.result.runs)
    probe.round()
    assert len(probe.result.runs) == n
    probe.close()


def test_fio_missing_is_reported_not_raised(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    res = fio_mod.fio_ceiling(str(tmp_path), MiB)
    assert res.write_gbps is None and "not found" in (res.error or "")
    with pytest.raises(fio_mod.FioError, match="not on PATH"):
        fio_mod.run_fio(str(tmp_path / "x"), "write", MiB, MiB, 1)


@pytest.mark.skipif(not HAVE_FIO, reason="fio not on PATH")
def test_fio_failure_is_reported(tmp_path) -> None:
    (tmp_path / "not-a-dir").write_bytes(b"")
    res = fio_mod.fio_ceiling(str(tmp_path / "not-a-dir"), MiB, block_sizes=(MiB,), iodepths=(1,))
    assert res.error and "fio" in res.error and res.write_gbps is None


# ---- peers ------------------------------------------------------------------------


@pytest.mark.parametrize("method_cls", [TorchMethod, SafetensorsMethod, DcpMethod])
def test_peer_methods_round_trip(tmp_path, method_cls) -> None:
    state = S.build_training_state(1 * MiB, seed=5)
    method = method_cls()
    target = str(tmp_path / method.target_name)
    method.save(state, target)
    loaded = method.load(target, state)
    if method.name == "safetensors":
        flat, _ = S.flatten_tensors(state)
        assert S.compare_states(dict(sorted(flat.items())), dict(sorted(loaded.items()))) == []
    else:
        assert S.compare_states(state, loaded) == []
    assert total_size(target) >= S.tensor_bytes(state)


# ---- save benchmark ---------------------------------------------------------------


@pytest.mark.skipif(not HAVE_FIO, reason="fio not on PATH")
def test_save_bench_runs_fio_in_the_rotation(tmp_path, monkeypatch) -> None:
    events: list[str] = []
    for cls, name in ((FastPersistMethod, "fastpersist"), (TorchMethod, "torch")):
        orig = cls.save
        monkeypatch.setattr(cls, "save", lambda self, obj, target, _o=orig, _n=name: (events.append(_n), _o(self, obj, target))[1])
    orig_round, orig_sweep = fio_mod.FioProbe.round, fio_mod.FioProbe.sweep
    monkeypatch.setattr(fio_mod.FioProbe, "round", lambda self: (events.append("fio"), orig_round(self))[1])
    monkeypatch.setattr(fio_mod.FioProbe, "sweep", lambda self: (events.append("sweep"), orig_sweep(self))[1])
    orig_engine = EngineProbe.round
    monkeypatch.setattr(EngineProbe, "round", lambda self: (events.append("engine"), orig_engine(self))[1])
    res = run_save_bench(str(tmp_path), size=2 * MiB, peers=("torch", "fio"), repeat=3, progress=False,
                         fio_block_sizes=(MiB,), fio_iodepths=(2,), load_process="same")
    assert events[0] == "sweep" and len(events) == 13
    rounds = [events[1 + 4 * i : 5 + 4 * i] for i in range(3)]
    # each round: every step once, the raw engine's write (part of the write ceiling) too
    assert all(sorted(r) == ["engine", "fastpersist", "fio", "torch"] for r in rounds)
    assert rounds == res.order
    assert len({tuple(r) for r in res.order}) > 1 or res.order[0][0] != "fastpersist"  # not a fixed rotation
    assert res.fio is not None and res.fio.error is None
    assert len(res.fio.write_repeats) == 3 and res.fio.read_gbps == sorted(res.fio.read_repeats)[1]
    eng = res.engine_ceiling
    assert eng is not None and eng.error is None and len(eng.write_repeats) == 3
    assert res.write_ceiling == max((res.fio.write_gbps, "fio"), (eng.write_gbps, "engine"))
    d = res.to_dict()
    assert d["write_ceiling_gbps"] == res.write_ceiling[0] and d["engine_ceiling"]["write_gbps"] == eng.write_gbps
    fp = d["methods"][[m["name"] for m in d["methods"]].index("fastpersist")]
    assert fp["save_vs_write_ceiling"] == pytest.approx(fp["save_median_gbps"] / res.write_ceiling[0])


def test_run_save_bench_with_every_peer(tmp_path) -> None:
    peers = ("torch", "safetensors", "dcp") + (("fio",) if HAVE_FIO else ())
    res = run_save_bench(str(tmp_path), size=4 * MiB, peers=peers, repeat=2, progress=False, load_process="same")
    d = json.loads(json.dumps(res.to_dict()))
    assert d["benchmark"] == "save" and d["repeat"] == 2
    assert [m["name"] for m in d["methods"]] == ["fastpersist", "torch", "safetensors", "dcp"]
    nbytes = d["workload"]["tensor_bytes"]
    assert nbytes == S.tensor_bytes(S.build_training_state(4 * MiB))
    for m in d["methods"]:
        assert m["error"] is None, m
        assert len(m["save_gbps"]) == 2 and len(m["load_gbps"]) == 2
        assert all(v > 0 for v in m["save_gbps"] + m["load_gbps"] + m["save_seconds"] + m["load_seconds"])
        assert m["save_median_gbps"] > 0 and m["load_median_gbps"] > 0
        assert m["file_bytes"] >= nbytes
        assert math.isclose(m["save_gbps"][0], nbytes / m["save_seconds"][0] / 1e9)
    torch_row = d["methods"][1]
    assert torch_row["save_vs_torch"] == 1.0 and torch_row["load_vs_torch"] == 1.0
    assert d["verification"]["ok"] is True and d["verification"]["method"] == "fastpersist"
    assert d["verification"]["tensors_compared"] == d["workload"]["tensors"]
    assert d["machine"]["directory"] == str(tmp_path)
    if HAVE_FIO:
        assert d["fio"]["write_gbps"] > 0 and d["fio"]["read_gbps"] > 0
        assert len(d["fio"]["write_repeats"]) == 2 and len(d["fio"]["read_repeats"]) == 2  # one round per run
        assert all(m["save_vs_fio"] > 0 and m["load_vs_fio"] > 0 for m in d["methods"])
    else:
        assert d["fio"] is None
    assert any("posix_fadvise" in n for n in d["notes"])
    assert any("safetensors" in n and "skipped" in n for n in d["notes"])
    assert os.listdir(tmp_path) == []  # cleaned up
    out = io.StringIO()
    print_save_report(res, out)
    text = out.getvalue()
    for word in ("O_DIRECT", "fastpersist", "torch", "safetensors", "dcp", "Verified", "equals"):
        assert word in text
    png = str(tmp_path / "save.png")
    plot_save(res, png)
    _assert_png(png)
    # the report a newcomer reads fits 100 columns, with rich and without
    assert _widest(text) <= WIDTH, text
    assert "vs ceiling" in text and "page reporting" not in text


def _widest(text: str) -> int:
    return max(len(line.rstrip()) for line in text.splitlines())


@pytest.mark.parametrize("use_rich", [True, False])
def test_save_report_fits_100_columns_and_names_its_ceilings(tmp_path, monkeypatch, use_rich: bool) -> None:
    """The table was 136 columns wide; every line of the report now fits 100, the per-run figures
    included, and the expert detail (fio's sweep, the memory probe's page reporting) is behind verbose."""
    if not use_rich:
        for mod in ("rich", "rich.console", "rich.table"):
            monkeypatch.setitem(sys.modules, mod, None)
    res = run_save_bench(str(tmp_path), size=2 * MiB, peers=("torch", "safetensors", "dcp", "fio") if HAVE_FIO
                         else ("torch", "safetensors", "dcp"), repeat=3, progress=False, load_process="same",
                         fio_block_sizes=(MiB,), fio_iodepths=(2,))
    res.machine.fresh_memory = {"probe_bytes": 1 << 28, "fresh_gbps_1": 0.61, "fresh_gbps_n": 0.32, "threads": 2,
                                "resident_gbps": 25.5, "page_reporting_order": 9, "error": None}
    out = io.StringIO()
    print_save_report(res, out)
    text = out.getvalue()
    assert _widest(text) <= WIDTH, text
    assert "New memory : memory a process never used fills at 0.61 GB/s" in text
    assert "order 9" not in text and "Fresh mem" not in text
    for row in ("fastpersist", "torch", "safetensors", "dcp"):
        cells = [line.strip("│ ").split() for line in text.splitlines()]
        assert sum(bool(c) and c[0] == row and c[1] not in (":",) for c in cells) == 2  # save and load tables
    verbose = io.StringIO()
    print_save_report(res, verbose, verbose=True)
    assert "free page reporting on (order 9" in verbose.getvalue()
    assert _widest(verbose.getvalue()) <= WIDTH
    if HAVE_FIO:
        flat = " ".join(text.split())  # wrapped lines joined
        tried = sum(rw == "write" for rw, _ in fio_mod.sweep_configs(res.workload["tensor_bytes"], (MiB,), (2,), True))
        assert tried >= 2  # the O_DIRECT grid and a buffered write + fsync at least
        assert "raw engine" in text and "fio, best config" in text and f"best of {tried} write configurations" in flat
        assert "sweep    :" in verbose.getvalue() and "sweep    :" not in text
        star = [line for line in text.splitlines() if "*" in line and ("raw engine" in line or "fio, best" in line)]
        assert len(star) == 1  # exactly one row is the write ceiling


def test_write_ceiling_is_the_higher_of_fio_and_the_raw_engine() -> None:
    from fastpersist.bench.ceiling import EngineCeiling

    fio = fio_mod.FioCeiling(write_gbps=1.5)
    eng = EngineCeiling(nbytes=1, write_repeats=[2.0, 3.0, 2.5])
    assert eng.write_gbps == 2.5
    assert write_ceiling(fio, eng) == (2.5, "engine")
    assert write_ceiling(fio_mod.FioCeiling(write_gbps=4.0), eng) == (4.0, "fio")
    assert write_ceiling(None, EngineCeiling(nbytes=1)) == (None, "")


def test_engine_probe_writes_durably_and_cleans_up(tmp_path) -> None:
    probe = EngineProbe(str(tmp_path), 3 * MiB + 4096)
    probe.round()
    probe.round()
    assert probe.ok and len(probe.result.write_repeats) == 2 and probe.result.write_gbps > 0
    assert "IOHandle.pwrite" in probe.result.settings
    probe.close()
    assert os.listdir(tmp_path) == []
    bad = EngineProbe(str(tmp_path / "missing"), MiB)
    bad.round()
    assert not bad.ok and "FileNotFoundError" in bad.result.error
    bad.round()  # stays stopped, never raises
    assert bad.result.write_repeats == []


def test_progress_in_a_log_file_is_plain_lines() -> None:
    """Not on a terminal, progress prints one labelled line per step: no carriage returns."""
    log = io.StringIO()
    bar = progress(3, True, "fio sweep", stream=log)
    assert isinstance(bar, PlainProgress)
    bar.update(1)
    bar.set_description("torch run 1/1")
    bar.update(2)
    bar.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) == 2
    assert lines[0].startswith("[1/3, ") and "] fio sweep: " in lines[0]  # the first step has its label
    assert lines[1].startswith("[3/3, ") and "] torch run 1/1: " in lines[1]
    assert isinstance(progress(3, False, "x", stream=log), NoProgress)

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    bar = progress(2, True, "fio sweep", stream=tty)
    assert not isinstance(bar, PlainProgress)  # a terminal gets the tqdm bar, labelled from the start
    bar.update(1)
    bar.close()
    assert "fio sweep" in tty.getvalue()


def test_cli_bench_save_writes_its_plot_by_default(tmp_path, monkeypatch, capsys) -> None:
    """README's first command: the chart is written without --plot (its path printed), not with --no-plot;
    stdout in a log file gets plain progress lines, the first one labelled."""
    from fastpersist.cli import SAVE_PLOT, main

    here = tmp_path / "cwd"
    disk = tmp_path / "disk"
    here.mkdir()
    disk.mkdir()
    monkeypatch.chdir(here)
    base = ["bench", "save", "--dir", str(disk), "--small-tensors", "10", "--repeat", "1", "--peers", "torch",
            "--load-process", "same"]
    assert main(base) == 0
    captured = capsys.readouterr()
    assert f"Plot       : {disk / SAVE_PLOT}" in captured.out  # in --dir, not the current directory
    _assert_png(str(disk / SAVE_PLOT))
    assert os.listdir(here) == []
    # the closing lines wrap at 100 columns too; only a path too long to fit stands alone on its line
    assert all(len(line) <= 100 or len(line.split()) <= 3 for line in captured.out.splitlines()), captured.out
    assert "\r" not in captured.err
    steps = captured.err.splitlines()
    assert len(steps) == 2 and steps[0].startswith("[1/2, ") and "run 1/1: " in steps[0]
    os.unlink(disk / SAVE_PLOT)
    assert main(base + ["--no-plot", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "Plot" not in captured.out and captured.err == "" and os.listdir(here) == []
    assert SAVE_PLOT not in os.listdir(disk)


def test_run_save_bench_small_tensors_keep(tmp_path) -> None:
    res = run_save_bench(str(tmp_path), small_tensors=50, peers=("torch",), repeat=1, keep=True, progress=False,
                         load_process="same")
    assert res.workload["kind"] == "small-tensors" and res.workload["tensors"] == 50
    assert res.verification["ok"] is True
    (workdir,) = [p for p in tmp_path.iterdir() if p.name.startswith("fastpersist-bench-")]
    assert sorted(os.listdir(workdir)) == ["fastpersist.pt", "torch.pt"]
    expected = S.build_small_tensors(50)
    # fastpersist's file is a torch.save file: stock torch.load reads it.
    assert S.compare_states(expected, torch.load(workdir / "fastpersist.pt", weights_only=True)) == []
    assert S.compare_states(expected, torch.load(workdir / "torch.pt", weights_only=True)) == []
    shutil.rmtree(workdir)


def test_run_save_bench_peers_only(tmp_path) -> None:
    res = run_save_bench(str(tmp_path), size=MiB, peers=("torch",), repeat=1, progress=False, include_fastpersist=False,
                         load_process="same")
    assert [m.name for m in res.methods] == ["torch"] and res.fio is None
    assert res.method("fastpersist") is None and res.verification == {"checked": False}
    assert res.method("torch").save_s and res.method("torch").error is None
    assert res.to_dict()["engine"] == "not measured"


def test_a_failing_method_becomes_an_error_result(tmp_path) -> None:
    class Full(Method):
        name = "full"
        target_name = "full.pt"

        def save(self, obj, target):
            with open(target, "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device", target)

    res = MethodResult(name="full", nbytes=1)
    _measure(Full(), {}, str(tmp_path), res, verify=False, verification={}, keep=False)
    assert res.error and res.error.startswith("OSError") and "No space" in res.error
    assert res.save_s == [] and res.load_s == []
    assert os.listdir(tmp_path) == []  # the partial file is removed


def test_run_save_bench_rejects_bad_arguments(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown peer"):
        run_save_bench(str(tmp_path), size=MiB, peers=("pickle",))
    with pytest.raises(ValueError, match="repeat"):
        run_save_bench(str(tmp_path), size=MiB, repeat=0)
    with pytest.raises(ValueError, match="load_process"):
        run_save_bench(str(tmp_path), size=MiB, load_process="spawn")
    with pytest.raises(FileNotFoundError):
        run_save_bench(str(tmp_path / "missing"), size=MiB)


# ---- io benchmark -----------------------------------------------------------------


def test_run_io_bench(tmp_path) -> None:
    engines = _cpu_engines()
    res = run_io_bench(
        str(tmp_path), size=2 * MiB + 4096, engines=engines, block_sizes=(MiB,), queue_depths=(2, 4),
        threads=(1, 2), direct_modes=(True, False), stage_modes=(False, True), repeat=2, fio=HAVE_FIO,
        fio_block_sizes=(MiB,), fio_iodepths=(4,), progress=False,
    )
    d = json.loads(json.dumps(res.to_dict()))
    assert d["benchmark"] == "io" and d["size_bytes"] == 2 * MiB + 4096
    assert len(d["runs"]) == len(engines) * 2 * 2 * 2 * 2
    assert {(r["engine"], r["direct"], r["queue_depth"], r["threads"], r["stage_reads"]) for r in d["runs"]} == {
        (e, dio, q, t, s) for e in engines for dio in (True, False) for q in (2, 4) for t in (1, 2)
        for s in (False, True)
    }
    for r in d["runs"]:
        assert r["error"] is None, r
        assert r["verified"] is True
        assert r["engine_used"]
        assert len(r["write_gbps"]) == 2 and all(v > 0 for v in r["write_gbps"] + r["read_gbps"])
        assert r["write_median_gbps"] > 0 and r["read_median_gbps"] > 0
        if HAVE_FIO:
            assert r["write_vs_fio"] > 0 and r["read_vs_fio"] > 0
    assert any("posix_fadvise" in n for n in d["notes"])
    assert [p.name for p in tmp_path.iterdir()] == []
    out = io.StringIO()
    print_io_report(res, out)
    assert "Best write" in out.getvalue() and "O_DIRECT" in out.getvalue()
    png = str(tmp_path / "io.png")
    plot_io(res, png)
    _assert_png(png)


@pytest.mark.parametrize("mode,staged", [("on", True), ("off", False)])
def test_run_io_bench_reads_like_loads_by_default(tmp_path, mode, staged) -> None:
    from fastpersist import config as fpconfig

    with fpconfig.override(read_staging=mode):
        res = run_io_bench(str(tmp_path), size=MiB, engines=("psync",), block_sizes=(MiB,), queue_depths=(2,),
                           threads=(1,), repeat=1, fio=False, progress=False)
    (run,) = res.runs
    assert run.config.stage_reads is staged and run.verified is True
    out = io.StringIO()
    print_io_report(res, out)
    assert f"reads {'staged' if staged else 'direct'}" in out.getvalue()


def test_run_io_bench_records_an_unusable_engine(tmp_path) -> None:
    res = run_io_bench(str(tmp_path), size=MiB, engines=("bogus",), block_sizes=(MiB,), queue_depths=(2,),
                       threads=(1,), repeat=1, fio=False, progress=False)
    (run,) = res.runs
    assert run.error and "bogus" in run.error and not run.write_s
    assert res.best() == (None, None)


def test_describe_engine_names_the_read_path() -> None:
    from fastpersist import Config
    from fastpersist.bench.save_bench import describe_engine

    assert "(reads 16, staged)" in describe_engine(Config(read_staging="on", read_queue_depth=16))
    assert "(reads 4, zero-copy)" in describe_engine(Config(read_staging="off", read_queue_depth=4))
    assert "(reads by device: 2 on one hardware queue, else 16, staged)" in describe_engine(Config(read_staging="on"))
    auto = describe_engine(Config())
    assert ("staged, read_staging auto" in auto) is Config().stages_reads()


def test_read_ceiling_is_the_higher_read() -> None:
    c = fio_mod.FioCeiling(read_gbps=1.5, buffered_read_gbps=2.5)
    assert c.read_ceiling_gbps == 2.5
    assert fio_mod.FioCeiling(read_gbps=1.5).read_ceiling_gbps == 1.5
    assert fio_mod.FioCeiling().read_ceiling_gbps is None


def test_save_bench_load_into_row_and_report(tmp_path) -> None:
    """--load-into: fastpersist.load_state_dict and torch.load + copy_ timed every round, the
    state filled with the original values, the read ceiling and the row in the report."""
    import io as _io

    from fastpersist.bench import report

    peers = ("torch", "safetensors") + (("fio",) if HAVE_FIO else ())
    res = run_save_bench(str(tmp_path), size=2 * MiB, peers=peers, repeat=2, progress=False, load_into=True,
                         fio_block_sizes=(MiB,), fio_iodepths=(2,), load_process="same")
    d = res.to_dict()
    by = {m["name"]: m for m in d["methods"]}
    assert len(by["fastpersist"]["into_seconds"]) == 2 and len(by["torch"]["into_seconds"]) == 2
    assert by["safetensors"]["into_seconds"] == []
    assert by["torch"]["into_vs_torch"] == 1.0 and by["fastpersist"]["into_vs_torch"] > 0
    assert res.verification["ok"] and res.verification["into_ok"]
    if HAVE_FIO:
        assert d["read_ceiling_gbps"] == max(d["fio"]["read_gbps"], d["fio"]["buffered_read_gbps"])
        assert by["fastpersist"]["load_vs_read_ceiling"] > 0
    out = _io.StringIO()
    report.print_save_report(res, out)
    text = out.getvalue()
    assert "Cold load into an existing state" in text and "torch.load + copy_" in text
    assert "load-into filled the state" in text
    if HAVE_FIO:
        assert "fio O_DIRECT read" in text and "fio buffered read" in text and "Read: the higher of" in " ".join(text.split())
    assert d["load_process"] == "same" and "in this process, round after round" in text
    assert any("--load-process same" in n for n in d["notes"])


# ---- loads in fresh processes ---------------------------------------------------------


def test_skeleton_round_trips_and_materializes(tmp_path) -> None:
    """The skeleton a child reads: meta tensors of the state's shapes, loadable with
    weights_only; zeros_like_state makes resident CPU zeros of those shapes from it."""
    state = S.build_training_state(1 * MiB)
    path = str(tmp_path / "skel.pt")
    torch.save(S.skeleton(state), path)
    assert os.path.getsize(path) < 64 << 10  # no tensor data
    skel = torch.load(path, weights_only=True)
    shapes = [(k, t.shape, t.dtype) for k, t in S.iter_tensors(state)]
    assert [(k, t.shape, t.dtype) for k, t in S.iter_tensors(skel)] == shapes
    assert all(t.device.type == "meta" for _, t in S.iter_tensors(skel))
    assert skel["rng_state"]["python"] == state["rng_state"]["python"] and skel["iteration"] == state["iteration"]
    target = S.zeros_like_state(skel)
    assert [(k, t.shape, t.dtype) for k, t in S.iter_tensors(target)] == shapes
    assert all(t.device.type == "cpu" and not t.any() for _, t in S.iter_tensors(target))
    assert type(target["model"]) is OrderedDict
    assert all(t.device.type == "cpu" for _, t in S.iter_tensors(S.empty_like_state(skel, device="cpu")))


def test_fingerprints_compare_like_the_states() -> None:
    """compare_states on fingerprints (what fresh-process verification compares) finds a
    one-byte change of a tensor, a dtype change and a non-tensor change, and names them."""
    state = S.build_training_state(1 * MiB, seed=3)
    expected = S.fingerprint(state)
    assert S.compare_states(expected, S.fingerprint(S.build_training_state(1 * MiB, seed=3))) == []
    wrong = S.build_training_state(1 * MiB, seed=3)
    raw = wrong["model"]["layers.0.mlp.fc1.weight"].view(torch.uint8).reshape(-1)
    raw[12345] ^= 1  # one bit of one bf16 element
    (problem,) = S.compare_states(expected, S.fingerprint(wrong))
    assert problem.startswith("model.layers.0.mlp.fc1.weight: tensor values differ")
    wrong = S.build_training_state(1 * MiB, seed=3)
    wrong["master_weights"]["final_ln.bias"] = wrong["master_weights"]["final_ln.bias"].double()
    assert S.compare_states(expected, S.fingerprint(wrong)) == [
        "master_weights.final_ln.bias: expected float32[64], got float64[64]"]
    wrong["master_weights"]["final_ln.bias"] = 0.0
    assert "expected a tensor, got float" in S.compare_states(expected, S.fingerprint(wrong))[0]
    wrong = S.build_training_state(1 * MiB, seed=3)
    wrong["iteration"] += 1
    assert S.compare_states(expected, S.fingerprint(wrong)) == ["iteration: expected 1000, got 1001"]
    d = S.tensor_digest(torch.tensor(1.5))  # 0-dim tensors too
    assert d.shape == () and d.nbytes == 4 and d == S.tensor_digest(torch.tensor(1.5))


def test_fresh_loads_time_every_method_in_children(tmp_path, monkeypatch) -> None:
    """load_process="fresh": every load and load-into of every method runs in a child (the
    loaders raise if called in this process), is timed, and verification passes."""
    for cls in (FastPersistMethod, TorchMethod, SafetensorsMethod, DcpMethod):
        def refuse(self, *args, **kwargs):
            raise AssertionError(f"{type(self).__name__} loaded in the benchmark's own process")

        monkeypatch.setattr(cls, "load", refuse)
        monkeypatch.setattr(cls, "load_into", refuse)
    res = run_save_bench(str(tmp_path), size=2 * MiB, peers=("torch", "safetensors", "dcp"), repeat=1,
                         progress=False, load_into=True)
    d = json.loads(json.dumps(res.to_dict()))
    assert d["load_process"] == "fresh"
    by = {m["name"]: m for m in d["methods"]}
    assert list(by) == ["fastpersist", "torch", "safetensors", "dcp"]
    for name, m in by.items():
        assert m["error"] is None, m
        assert len(m["load_seconds"]) == 1 and m["load_seconds"][0] > 0 and m["load_gbps"][0] > 0
        assert len(m["into_seconds"]) == (1 if name in ("fastpersist", "torch") else 0)
    assert by["fastpersist"]["into_gbps"][0] > 0 and by["torch"]["into_vs_torch"] == 1.0
    v = d["verification"]
    assert v["ok"] is True and v["into_ok"] is True and v["method"] == "fastpersist"
    assert v["tensors_compared"] == d["workload"]["tensors"]
    assert any("--load-process fresh" in n for n in d["notes"])
    assert os.listdir(tmp_path) == []  # checkpoints and skeleton removed
    out = io.StringIO()
    print_save_report(res, out)
    text = out.getvalue()
    assert "each in a fresh Python process" in text and "load equals the original state" in text
    assert "CRC-32" in v["compared_by"] and "CRC-32" in text
    assert "load-into filled the state" in text


@pytest.mark.parametrize("load_process", ["fresh", "same"])
def test_verification_fails_when_the_load_returns_other_bytes(tmp_path, monkeypatch, load_process) -> None:
    """fastpersist's file holds other values than the state (one element changed before
    the save): the load and the load-into verification both fail and name the tensor."""
    orig_save = FastPersistMethod.save

    def save_a_changed_copy(self, obj, target):
        changed = S.map_tensors(obj, lambda t: t.clone())
        changed["optimizer"]["state"][3]["exp_avg"].view(-1)[7] += 1.0
        orig_save(self, changed, target)

    monkeypatch.setattr(FastPersistMethod, "save", save_a_changed_copy)
    res = run_save_bench(str(tmp_path), size=MiB, peers=(), repeat=1, progress=False, load_into=True,
                         load_process=load_process)
    v = res.verification
    assert v["checked"] and v["ok"] is False and v["into_ok"] is False
    assert v["problems"] == v["into_problems"]
    (problem,) = v["problems"]
    assert problem.startswith("optimizer.state.3.exp_avg: tensor values differ")
    out = io.StringIO()
    print_save_report(res, out)
    assert "MISMATCH after fastpersist load:" in out.getvalue()
    assert "MISMATCH after fastpersist load-into:" in out.getvalue()


def test_a_failing_child_load_is_an_error(tmp_path) -> None:
    """A child that cannot load reports its error, and the parent raises it."""
    skel = str(tmp_path / "skel.pt")
    torch.save(S.skeleton({"w": torch.zeros(4)}), skel)
    with pytest.raises(RuntimeError, match=r"torch load in a fresh process failed \(exit 1\).*No such file"):
        load_in_fresh_process("torch", "load", str(tmp_path / "missing.pt"), skel)
    with pytest.raises(ValueError, match="op"):
        load_in_fresh_process("torch", "copy", str(tmp_path / "missing.pt"), skel)


def test_touch_pages_reads_every_page_of_a_lazy_mapping(tmp_path) -> None:
    """safetensors' load_file maps the file lazily; touch_pages brings every page in."""
    import resource

    st = pytest.importorskip("safetensors.torch")
    p = tmp_path / "m.safetensors"
    st.save_file({"a": torch.ones(4 * MiB, dtype=torch.uint8), "b": torch.arange(10)}, str(p))
    drop_page_cache(str(p))
    out = st.load_file(str(p))
    before = resource.getrusage(resource.RUSAGE_SELF)
    touched = S.touch_pages(out)
    after = resource.getrusage(resource.RUSAGE_SELF)
    assert touched >= 4 * MiB
    assert (after.ru_majflt + after.ru_minflt) - (before.ru_majflt + before.ru_minflt) > 0


def test_copy_into_fills_a_nested_state() -> None:
    state = {"m": {"w": torch.zeros(3)}, "l": [torch.zeros(2), 5]}
    S.copy_into(state, {"m": {"w": torch.ones(3)}, "l": [torch.full((2,), 2.0), 7]})
    assert torch.equal(state["m"]["w"], torch.ones(3)) and torch.equal(state["l"][0], torch.full((2,), 2.0))
    assert state["l"][1] == 5  # non-tensors are left
