"""read_mode: how loads choose between O_DIRECT and buffered reads (fastpersist.io.plan_read)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import fastpersist
from fastpersist import config as config_mod
from fastpersist import io as fio


@pytest.fixture
def stats(tmp_path, monkeypatch):
    """A private record of outcomes (not the user's ~/.cache) and a small measuring threshold."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(fio, "READ_MEASURE_MIN", 1 << 20)
    fio.reset_read_stats()
    yield tmp_path
    fio.reset_read_stats()


def _cold_file(path, nbytes: int) -> None:
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _plan(path, nbytes, **kw):
    fd = os.open(path, os.O_RDONLY)
    try:
        args = {"read_mode": "auto", "direct": True, "stage": True}
        args.update(kw)
        return fio.plan_read(fd, nbytes, **args)
    finally:
        os.close(fd)


def test_configured_modes_are_kept(stats):
    p = stats / "f.bin"
    _cold_file(p, 2 << 20)
    assert _plan(p, 2 << 20, read_mode="direct") == fio.ReadPlan("direct", True, True, "configured")
    assert _plan(p, 2 << 20, read_mode="direct", stage=False).stage is False
    assert _plan(p, 2 << 20, read_mode="buffered") == fio.ReadPlan("buffered", False, False, "configured")
    # direct=False (FASTPERSIST_DIRECT off) reads buffered whatever the mode
    assert _plan(p, 2 << 20, read_mode="auto", direct=False).mode == "buffered"


def test_a_cached_file_is_read_buffered(stats):
    p = stats / "warm.bin"
    data = os.urandom(4 << 20)
    p.write_bytes(data)
    with open(p, "rb") as f:
        assert f.read() == data  # in the page cache now
    fd = os.open(p, os.O_RDONLY)
    try:
        frac = fio.cached_fraction(fd, len(data))
    finally:
        os.close(fd)
    if frac is None or frac < fio.CACHED_ENOUGH:
        pytest.skip(f"the page cache did not keep the file ({frac})")
    plan = _plan(p, len(data))
    assert (plan.mode, plan.why, plan.key) == ("buffered", "cached", None)


def test_small_cold_reads_are_direct_and_not_recorded(stats, monkeypatch):
    monkeypatch.setattr(fio, "READ_MEASURE_MIN", 64 << 20)
    p = stats / "small.bin"
    _cold_file(p, 1 << 20)
    plan = _plan(p, 1 << 20)
    assert (plan.mode, plan.why, plan.key) == ("direct", "small", None)
    fio.record_read(plan, 1 << 20, 0.01)
    assert fio.read_stats() == {}


def test_auto_tries_each_way_then_takes_the_faster_and_re_measures(stats):
    p = stats / "cold.bin"
    _cold_file(p, 2 << 20)
    first = _plan(p, 2 << 20)
    assert (first.mode, first.why, first.stage) == ("direct", "untried", True)
    fio.record_read(first, 1_000_000_000, 1.0)  # 1 GB/s
    second = _plan(p, 2 << 20)
    assert (second.mode, second.why, second.direct, second.stage) == ("buffered", "untried", False, False)
    fio.record_read(second, 2_000_000_000, 1.0)  # 2 GB/s: buffered wins here
    seen = []
    for _ in range(fio.READ_REMEASURE_EVERY + 2):
        plan = _plan(p, 2 << 20)
        seen.append((plan.mode, plan.why))
        fio.record_read(plan, 2_000_000_000 if plan.mode == "buffered" else 1_000_000_000, 1.0)
    assert seen.count(("buffered", "fastest")) >= fio.READ_REMEASURE_EVERY - 1
    assert ("direct", "re-measure") in seen
    # the disk changes: direct becomes faster, and after its re-measurement it is taken
    for _ in range(2 * fio.READ_REMEASURE_EVERY):
        plan = _plan(p, 2 << 20)
        fio.record_read(plan, 4_000_000_000 if plan.mode == "direct" else 2_000_000_000, 1.0)
    assert _plan(p, 2 << 20).mode == "direct"


def test_outcomes_persist_per_filesystem(stats):
    p = stats / "cold.bin"
    _cold_file(p, 2 << 20)
    plan = _plan(p, 2 << 20)
    fio.record_read(plan, 3_000_000_000, 1.0)
    with open(fio.read_stats_path(), encoding="utf-8") as f:
        on_disk = json.load(f)
    assert plan.arm == "staged"  # stage=True in _plan
    assert on_disk[plan.key]["staged"]["gbps"] == pytest.approx(3.0)
    fio.reset_read_stats()  # a new process: starts from the file
    assert fio.read_stats()[plan.key]["staged"]["n"] == 1
    assert _plan(p, 2 << 20).mode == "buffered"  # the untried way next
    fio.reset_read_stats(forget_file=True)
    assert not os.path.exists(fio.read_stats_path())


def test_staging_left_to_auto_is_measured_too(stats):
    """With read_staging "auto", zero-copy and staged O_DIRECT reads are two ways of their own:
    each is tried, and the faster one is taken."""
    p = stats / "cold.bin"
    _cold_file(p, 2 << 20)
    speed = {"zero-copy": 3_000_000_000, "staged": 1_000_000_000, "buffered": 2_000_000_000}
    tried = []
    for _ in range(3):
        plan = _plan(p, 2 << 20, stage_auto=True)
        assert plan.why == "untried"
        tried.append(plan.arm)
        fio.record_read(plan, speed[plan.arm], 1.0)
    assert tried == ["zero-copy", "staged", "buffered"]
    seen = []
    for _ in range(2 * fio.READ_REMEASURE_EVERY):
        plan = _plan(p, 2 << 20, stage_auto=True)
        seen.append((plan.arm, plan.why))
        assert (plan.direct, plan.stage) == {"zero-copy": (True, False), "staged": (True, True),
                                             "buffered": (False, False)}[plan.arm]
        fio.record_read(plan, speed[plan.arm], 1.0)
    assert seen.count(("zero-copy", "fastest")) >= 2 * fio.READ_REMEASURE_EVERY - 3
    assert {arm for arm, why in seen if why == "re-measure"} == {"staged", "buffered"}
    # without stage_auto the handle's own staging is the only O_DIRECT way
    assert _plan(p, 2 << 20, stage=True).arm in ("staged", "buffered")
    assert _plan(p, 2 << 20, stage=False).arm in ("zero-copy", "buffered")


def test_api_handles_mark_auto_staging_only():
    from fastpersist import handles

    auto = handles.handle_for(config_mod.Config(read_staging="auto"), read=True)
    on = handles.handle_for(config_mod.Config(read_staging="on"), read=True)
    writer = handles.handle_for(config_mod.Config(read_staging="auto"))
    assert fio.staging_auto(auto) and not fio.staging_auto(on) and not fio.staging_auto(writer)
    assert auto is not on and on.stage_reads


def test_a_broken_record_file_is_ignored(stats):
    path = fio.read_stats_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("{not json")
    fio.reset_read_stats()
    assert fio.read_stats() == {}
    p = stats / "cold.bin"
    _cold_file(p, 2 << 20)
    assert _plan(p, 2 << 20).why == "untried"


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_loads_in_auto_mode_record_and_return_the_same_tensors(stats, fmt):
    state = {f"w{i}": torch.randn(256, 1024) for i in range(4)}  # 4 MiB
    p = stats / f"m.{fmt}"
    fastpersist.save(state, p)
    with open(p, "rb+") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    cfg = config_mod.Config(read_mode="auto")
    modes = []
    for _ in range(3):
        with open(p, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        out = fastpersist.load(p, config=cfg)
        assert set(out) == set(state) and all(torch.equal(out[k], state[k]) for k in state)
        rec = fio.read_stats()
        modes.append({m: v["n"] for fs in rec.values() for m, v in fs.items() if isinstance(v, dict)})
    # read_staging "auto" (the default): all three ways are tried in the first three loads
    assert modes[-1] == {"zero-copy": 1, "staged": 1, "buffered": 1}


def test_read_mode_setting():
    assert config_mod.Config().read_mode == "auto"
    assert config_mod.Config.from_env(environ={"FASTPERSIST_READ_MODE": " Buffered "}).read_mode == "buffered"
    with pytest.raises(ValueError, match="FASTPERSIST_READ_MODE"):
        config_mod.Config.from_env(environ={"FASTPERSIST_READ_MODE": "fast"})
    with pytest.raises(ValueError, match="read_mode"):
        config_mod.Config(read_mode="mmap")
    assert config_mod.Config(read_mode="direct").handle_kwargs(read=True)["read_mode"] == "direct"
    assert "read_mode" not in config_mod.Config().handle_kwargs()


def test_native_handle_carries_the_read_mode():
    from fastpersist import _native

    assert _native.Handle().read_mode == "direct"
    assert _native.Handle(read_mode="auto").read_mode == "auto"
    with pytest.raises(ValueError):
        _native.Handle(read_mode="sideways")


def test_crc32_paths_match_zlib():
    """Every CRC-32 path the CPU picks (slicing, PCLMUL, VPCLMULQDQ 256/512-bit) against zlib."""
    import ctypes
    import random
    import zlib

    from fastpersist import _native

    rng = random.Random(7)
    for n in [0, 1, 15, 16, 127, 128, 255, 256, 511, 512, 513, 1000, 4096, 65536 + 17, (1 << 20) + 48]:
        for lead in (0, 3):
            data = os.urandom(n + lead)[lead:]
            buf = ctypes.create_string_buffer(data, max(1, len(data)))
            seed = rng.randrange(1 << 32)
            assert _native.crc32(ctypes.addressof(buf), len(data)) == zlib.crc32(data), n
            assert _native.crc32(ctypes.addressof(buf), len(data), seed) == zlib.crc32(data, seed), n


def test_loads_into_existing_memory_are_recorded_apart(stats):
    """load_state_dict reads into memory in use; its outcomes go under the filesystem key + "+into"
    and do not steer loads into new memory (and the other way round)."""
    state = {f"w{i}": torch.randn(256, 1024) for i in range(4)}  # 4 MiB
    p = stats / "m.pt"
    fastpersist.save(state, p)
    cfg = config_mod.Config(read_mode="auto")
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    with open(p, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    fastpersist.load_state_dict(target, p, config=cfg)
    assert all(torch.equal(target[k], state[k]) for k in state)
    keys = list(fio.read_stats())
    assert len(keys) == 1 and keys[0].endswith("+into")
    with open(p, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    fastpersist.load(p, config=cfg)
    assert sorted(fio.read_stats()) == sorted([keys[0], keys[0][: -len("+into")]])
    plain = _plan(p, 2 << 20)
    assert plain.key is None or not plain.key.endswith("+into")
