"""read_mode: how loads choose between O_DIRECT and buffered reads (fastpersist.readpolicy).

The choice is a function of the filesystem, the page cache and the settings; these tests
use real files on this disk (tmp_path) and on /dev/shm (tmpfs)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import fastpersist
from fastpersist import config as config_mod
from fastpersist import io as fio
from fastpersist import readpolicy as rp


def _cold_file(path, nbytes: int) -> None:
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _drop_cache(path) -> None:
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _plan(path, nbytes, **kw):
    fd = os.open(path, os.O_RDONLY)
    try:
        args = {"read_mode": "auto", "direct": True, "stage": True}
        args.update(kw)
        return rp.plan_read(fd, nbytes, **args)
    finally:
        os.close(fd)


def _cold_or_skip(path) -> None:
    """Skip where the page cache keeps the file anyway (tmpfs under tmp_path, a kernel
    ignoring DONTNEED) or where this disk refuses O_DIRECT."""
    if not rp.filesystem_facts(os.path.dirname(path)).direct:
        pytest.skip("tmp_path's filesystem refuses O_DIRECT")
    fd = os.open(path, os.O_RDONLY)
    try:
        frac = fio.cached_fraction(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    if frac is not None and frac >= rp.CACHED_ENOUGH:
        pytest.skip(f"the page cache kept the file after DONTNEED ({frac})")


@pytest.fixture
def shm(tmp_path):
    if not os.path.isdir("/dev/shm") or rp.filesystem_facts("/dev/shm").kind != "memory":
        pytest.skip("no tmpfs at /dev/shm")
    import tempfile

    d = tempfile.mkdtemp(prefix="fp-readpolicy-", dir="/dev/shm")
    yield d
    import shutil

    shutil.rmtree(d, ignore_errors=True)


def test_configured_modes_are_kept(tmp_path):
    p = tmp_path / "f.bin"
    _cold_file(p, 2 << 20)
    assert _plan(p, 2 << 20, read_mode="direct").arm == "staged"
    assert _plan(p, 2 << 20, read_mode="direct", stage=False).arm == "zero-copy"
    assert _plan(p, 2 << 20, read_mode="direct", stage_auto=True).arm == "staged"  # explicit mode: the handle's staging
    assert _plan(p, 2 << 20, read_mode="buffered").arm == "buffered"
    for plan in (_plan(p, 2 << 20, read_mode="direct"), _plan(p, 2 << 20, read_mode="buffered")):
        assert plan.why == "configured"
    # direct=False (FASTPERSIST_DIRECT off) reads buffered whatever the mode
    assert _plan(p, 2 << 20, read_mode="auto", direct=False).mode == "buffered"
    assert _plan(p, 2 << 20, read_mode="direct", direct=False).mode == "buffered"


def test_a_cold_file_on_a_local_disk_is_read_direct_zero_copy(tmp_path):
    p = tmp_path / "cold.bin"
    _cold_file(p, 4 << 20)
    _cold_or_skip(p)
    facts = rp.filesystem_facts(tmp_path)
    assert facts.kind == "local" and facts.direct
    plan = _plan(p, 4 << 20, stage=True, stage_auto=True)
    assert (plan.arm, plan.why) == ("zero-copy", "disk") and facts.name in plan.reason
    # read_staging "on" (not auto): the handle's ring
    assert _plan(p, 4 << 20, stage=True, stage_auto=False).arm == "staged"
    assert _plan(p, 4 << 20, stage=False, stage_auto=False).arm == "zero-copy"


def test_the_plan_depends_on_no_earlier_load_and_no_size(tmp_path, monkeypatch):
    """Deterministic: many cold loads, all sizes and destinations get one plan, and nothing is
    written to the user's cache directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    p = tmp_path / "cold.bin"
    _cold_file(p, 2 << 20)
    _cold_or_skip(p)
    plans = set()
    for nbytes in (1, 4096, 1 << 20, 1 << 30, 1 << 40):
        for into in (False, True):
            plans.add(_plan(p, nbytes, stage_auto=True, into_existing=into))
    state = {f"w{i}": torch.randn(64, 1024) for i in range(4)}
    q = tmp_path / "m.pt"
    fastpersist.save(state, q)
    for _ in range(4):
        _drop_cache(q)
        out = fastpersist.load(q)
        assert all(torch.equal(out[k], state[k]) for k in state)
    plans.add(_plan(p, 2 << 20, stage_auto=True))
    assert len(plans) == 1
    assert not (tmp_path / "cache").exists()


def test_a_cached_file_is_read_buffered(tmp_path):
    p = tmp_path / "warm.bin"
    data = os.urandom(4 << 20)
    p.write_bytes(data)
    with open(p, "rb") as f:
        assert f.read() == data  # in the page cache now
    fd = os.open(p, os.O_RDONLY)
    try:
        frac = fio.cached_fraction(fd, len(data))
    finally:
        os.close(fd)
    if frac is None or frac < rp.CACHED_ENOUGH:
        pytest.skip(f"the page cache did not keep the file ({frac})")
    if rp.filesystem_facts(tmp_path).kind == "memory":
        pytest.skip("tmp_path is on tmpfs")
    plan = _plan(p, len(data), stage_auto=True)
    assert (plan.mode, plan.why) == ("buffered", "cached")


def test_memory_filesystems_are_read_buffered(shm):
    p = os.path.join(shm, "f.bin")
    _cold_file(p, 1 << 20)
    facts = rp.filesystem_facts(shm)
    assert (facts.name, facts.kind) == ("tmpfs", "memory")
    plan = _plan(p, 1 << 20, stage_auto=True)
    assert (plan.arm, plan.why) == ("buffered", "memory-fs") and "tmpfs" in plan.reason
    assert _plan(p, 1 << 20, read_mode="direct", stage=False).arm == "zero-copy"  # explicit: obeyed


@pytest.mark.parametrize("facts,why", [
    (rp.FsFacts("nfs", "remote", True), "remote-fs"),
    (rp.FsFacts("fuse", "remote", False), "remote-fs"),
    (rp.FsFacts("0x1234", "local", False), "no-direct"),
    (rp.FsFacts("tmpfs", "memory", True), "memory-fs"),
])
def test_filesystems_that_are_not_local_disks_are_read_buffered(tmp_path, monkeypatch, facts, why):
    """Network filesystems and filesystems refusing O_DIRECT (none mounted here: the
    facts of tmp_path's disk are replaced) read through the page cache."""
    p = tmp_path / "f.bin"
    _cold_file(p, 1 << 20)
    monkeypatch.setattr(rp, "filesystem_facts", lambda target: facts)
    plan = _plan(p, 1 << 20, stage_auto=True)
    assert (plan.arm, plan.why) == ("buffered", why)
    assert rp.describe_dir(tmp_path, config_mod.Config()).why == why


def test_filesystem_magic_of_real_mounts(tmp_path, shm):
    assert rp.filesystem_facts(shm).kind == "memory"
    disk = rp.filesystem_facts(tmp_path)
    assert disk.kind in ("local", "memory", "remote") and disk.name
    with open(tmp_path / "x", "wb"):
        pass
    fd = os.open(tmp_path / "x", os.O_RDONLY)
    try:
        assert rp.filesystem_facts(fd) == disk  # a descriptor and its directory: one filesystem
    finally:
        os.close(fd)


def test_api_handles_mark_auto_staging_only():
    from fastpersist import handles

    auto = handles.handle_for(config_mod.Config(read_staging="auto"), read=True)
    on = handles.handle_for(config_mod.Config(read_staging="on"), read=True)
    writer = handles.handle_for(config_mod.Config(read_staging="auto"))
    assert rp.staging_auto(auto) and not rp.staging_auto(on) and not rp.staging_auto(writer)
    assert auto is not on and on.stage_reads


def _places(tmp_path, shm):
    return [str(tmp_path), shm]


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
@pytest.mark.parametrize("where", ["disk", "shm"])
@pytest.mark.parametrize("mode", ["auto", "direct", "buffered"])
def test_every_read_way_returns_what_torch_load_returns(tmp_path, shm, fmt, where, mode):
    state = {f"w{i}": torch.randn(64, 1024) for i in range(3)}
    state["i8"] = torch.arange(-100, 100, dtype=torch.int8)
    state["bf"] = torch.randn(33, dtype=torch.bfloat16)
    d = str(tmp_path) if where == "disk" else shm
    p = os.path.join(d, f"m.{fmt}")
    fastpersist.save(state, p)
    _drop_cache(p)
    out = fastpersist.load(p, config=config_mod.Config(read_mode=mode))
    assert set(out) == set(state)
    for k in state:
        assert out[k].dtype == state[k].dtype and torch.equal(out[k], state[k])
    if fmt == "pt":
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        _drop_cache(p)
        fastpersist.load_state_dict(target, p, config=config_mod.Config(read_mode=mode))
        assert all(torch.equal(target[k], state[k]) for k in state)
        ref = torch.load(p, weights_only=True)
        assert all(torch.equal(out[k], ref[k]) for k in state)


def test_readers_are_pooled_and_never_shared_by_two_loads(tmp_path):
    handle = fio.native_module().Handle(direct=True)
    plan = rp.ReadPlan("direct", True, False, "disk")
    a = rp.borrow_reader(handle, plan)
    b = rp.borrow_reader(handle, plan)
    assert a is not b
    rp.give_back_reader(a)
    assert rp.borrow_reader(handle, plan) is a  # idle: reused
    rp.give_back_reader(a)
    rp.give_back_reader(a)  # twice: kept once
    assert rp.borrow_reader(handle, plan) is a and rp.borrow_reader(handle, plan) is not a
    staged = rp.borrow_reader(handle, rp.ReadPlan("direct", True, True, "configured"))
    rp.give_back_reader(staged)  # a staged reader's ring is not kept
    assert rp.borrow_reader(handle, rp.ReadPlan("direct", True, True, "configured")) is not staged

    # loads on several threads at once, each with its own reader, all correct
    states = [{f"w{j}": torch.full((256, 1024), float(i * 10 + j)) for j in range(3)} for i in range(4)]
    paths = [tmp_path / f"t{i}.pt" for i in range(4)]
    for s, p in zip(states, paths):
        fastpersist.save(s, p)
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def work(i: int) -> None:
        try:
            start.wait(timeout=60)
            for _ in range(3):
                out = fastpersist.load(paths[i])
                assert all(torch.equal(out[k], states[i][k]) for k in states[i])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors


def test_info_names_the_read_way(tmp_path, shm, capsys):
    from fastpersist import cli

    assert cli.main(["info", "--dir", shm]) == 0
    out = capsys.readouterr().out
    assert "Load reads : buffered (the filesystem is memory (tmpfs)" in out
    assert cli.main(["info", "--dir", str(tmp_path)]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("Load reads")]
    expected = rp.describe_dir(tmp_path, config_mod.get_default())
    assert line and line[0].startswith(f"Load reads : {expected.arm} (")
    with config_mod.override(read_mode="buffered"):
        assert cli.main(["info", "--json", "--dir", str(tmp_path)]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    assert data["read_way"] == {"way": "buffered", "why": "read_mode='buffered'"}


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


def _fake_sysfs(root) -> None:
    """A sysfs tree with a partition of a one-queue disk, an 8-queue NVMe namespace and a
    device-mapper device (no blk-mq queues of its own)."""
    def dev(name_path: str, queues: int, majmin: str, partition: str = "") -> None:
        disk = root / "devices" / name_path
        (disk / "mq").mkdir(parents=True)
        for q in range(queues):
            (disk / "mq" / str(q)).mkdir()
        node = disk
        if partition:
            node = disk / partition
            node.mkdir()
            (node / "partition").write_text("1\n")
        (root / "dev" / "block").mkdir(parents=True, exist_ok=True)
        (root / "dev" / "block" / majmin).symlink_to(node)

    dev("virtual/block/vda", 1, "254:0")
    dev("virtual/block/sda", 1, "8:1", partition="sda1")
    dev("pci/nvme/nvme0n1", 8, "259:0")
    dm = root / "devices" / "virtual" / "block" / "dm-0"
    dm.mkdir(parents=True)
    (root / "dev" / "block" / "253:0").symlink_to(dm)


def test_hardware_queues_come_from_sysfs(tmp_path, monkeypatch):
    _fake_sysfs(tmp_path)
    monkeypatch.setattr(rp, "_SYSFS", str(tmp_path))
    assert rp.hardware_queues(os.makedev(254, 0)) == 1
    assert rp.hardware_queues(os.makedev(8, 1)) == 1  # a partition counts as its disk
    assert rp.hardware_queues(os.makedev(259, 0)) == 8
    assert rp.hardware_queues(os.makedev(253, 0)) is None  # device mapper: not one device
    assert rp.hardware_queues(os.makedev(0, 42)) is None  # btrfs, overlay: anonymous devices


@pytest.mark.parametrize("queues,depth", [(1, rp.SINGLE_QUEUE_DEPTH), (8, None), (None, None)])
def test_the_read_depth_follows_the_device(tmp_path, monkeypatch, queues, depth):
    p = tmp_path / "f.bin"
    _cold_file(p, 1 << 20)
    _cold_or_skip(p)
    monkeypatch.setattr(rp, "filesystem_facts", lambda target: rp.FsFacts("ext2/3/4", "local", True, queues))
    plan = _plan(p, 1 << 20, stage_auto=True, depth_auto=True)
    assert plan.arm == "zero-copy" and plan.depth == depth
    assert ("one hardware queue" in plan.reason) == (depth is not None)
    # an explicit read_mode="direct" reading zero-copy takes it too
    assert _plan(p, 1 << 20, read_mode="direct", stage=False, depth_auto=True).depth == depth
    # not for an explicit depth, a staged read (the ring's size) or a buffered one
    assert _plan(p, 1 << 20, stage_auto=True, depth_auto=False).depth is None
    assert _plan(p, 1 << 20, read_mode="direct", stage=True, depth_auto=True).depth is None
    assert _plan(p, 1 << 20, read_mode="buffered", depth_auto=True).depth is None
    described = rp.describe_dir(tmp_path, config_mod.Config())
    assert described.depth == depth
    assert rp.describe_dir(tmp_path, config_mod.Config(read_queue_depth=16)).depth is None


def test_api_handles_leave_the_depth_to_the_device_only_by_default():
    from fastpersist import handles

    auto = handles.handle_for(config_mod.Config(), read=True)
    fixed = handles.handle_for(config_mod.Config(read_queue_depth=config_mod.DEFAULT_READ_QUEUE_DEPTH), read=True)
    writer = handles.handle_for(config_mod.Config())
    assert rp.depth_auto(auto) and not rp.depth_auto(fixed) and not rp.depth_auto(writer)
    assert auto is not fixed and auto.queue_depth == fixed.queue_depth == config_mod.DEFAULT_READ_QUEUE_DEPTH


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_a_load_at_the_device_depth_returns_what_torch_load_returns(tmp_path, monkeypatch, fmt):
    """Loads (and load_state_dict) on a one-queue device read with readers of the chosen
    depth and return the same values."""
    monkeypatch.setattr(rp, "filesystem_facts", lambda target: rp.FsFacts("ext2/3/4", "local", True, 1))
    borrowed: list[int] = []
    real = rp.borrow_reader

    def spy(handle, plan):
        reader = real(handle, plan)
        borrowed.append(reader.queue_depth)
        return reader

    for mod in (rp, __import__("fastpersist.formats.torchload", fromlist=["x"]),
                __import__("fastpersist.formats.safetensors.load", fromlist=["x"]),
                __import__("fastpersist.formats.torchindex", fromlist=["x"])):
        monkeypatch.setattr(mod, "borrow_reader", spy)
    state = {f"w{i}": torch.randn(512, 1024) for i in range(6)}  # 12 MiB: several chunks
    state["small"] = torch.arange(1000, dtype=torch.int16)
    p = tmp_path / f"m.{fmt}"
    fastpersist.save(state, p)
    _drop_cache(p)
    _cold_or_skip(p)
    out = fastpersist.load(p)
    assert all(out[k].dtype == state[k].dtype and torch.equal(out[k], state[k]) for k in state)
    assert borrowed and set(borrowed) == {rp.SINGLE_QUEUE_DEPTH}
    if fmt == "pt":
        ref = torch.load(p, weights_only=True)
        assert all(torch.equal(out[k], ref[k]) for k in state)
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        _drop_cache(p)
        fastpersist.load_state_dict(target, p)
        assert all(torch.equal(target[k], state[k]) for k in state)
