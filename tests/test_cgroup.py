"""fastpersist.bench.cgroup: a block-I/O cgroup per process with its own bandwidth limit.

Needs root and a cgroup v1 blkio (or v2 io) controller; skipped cleanly otherwise.
Asserts what the kernel reports (the limit files, the members, the bytes it
counted), never how long a write took.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fastpersist.bench import cgroup

REASON = cgroup.unavailable_reason()
needs_cgroup = pytest.mark.skipif(REASON is not None, reason=f"block-I/O cgroup: {REASON}")


def _device_or_skip(path: str) -> str:
    try:
        return cgroup.device_of(path)
    except ValueError as exc:
        pytest.skip(str(exc))


@needs_cgroup
def test_group_limits_counts_and_cleans_up(tmp_path) -> None:
    dev = _device_or_skip(str(tmp_path))
    target = tmp_path / "data.bin"
    # a child that writes 4 MiB with O_DIRECT (buffered if the filesystem refuses it), fsyncs, then waits
    code = (
        "import os, sys, mmap\n"
        "buf = mmap.mmap(-1, 1 << 20); buf.write(b'x' * (1 << 20))\n"
        "try:\n"
        "    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)\n"
        "except OSError:\n"
        "    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o644)\n"
        "for _ in range(4): os.write(fd, buf)\n"
        "os.fsync(fd); os.close(fd)\n"
        "print('written', flush=True); sys.stdin.readline()\n"
    )
    with cgroup.BandwidthGroup(str(tmp_path), 200 << 20, 300 << 20) as group:
        assert os.path.isdir(group.path) and group.device == dev
        limits = group.limits()
        if group.controller.version == 1:
            assert limits["blkio.throttle.write_bps_device"] == f"{dev} {200 << 20}"
            assert limits["blkio.throttle.read_bps_device"] == f"{dev} {300 << 20}"
        else:
            assert f"wbps={200 << 20}" in limits["io.max"] and f"rbps={300 << 20}" in limits["io.max"]
        proc = subprocess.Popen([sys.executable, "-c", code, str(target)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, preexec_fn=lambda: group.join())
        try:
            assert proc.stdout.readline().strip() == "written"
            assert proc.pid in group.members()
            assert group.written_bytes() >= 4 << 20  # the kernel charged the child's writes to the group
        finally:
            proc.communicate("\n", timeout=60)
        path = group.path
    assert not os.path.exists(path)  # removed on leaving the context
    assert target.stat().st_size == 4 << 20


@needs_cgroup
def test_a_member_is_moved_back_before_the_group_goes(tmp_path) -> None:
    _device_or_skip(str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE,
                            text=True)
    try:
        group = cgroup.BandwidthGroup(str(tmp_path), 100 << 20)
        group.create()
        group.join(proc.pid)
        assert group.members() == [proc.pid]
        group.close()
        group.close()  # idempotent
        assert not os.path.exists(group.path)
        assert proc.poll() is None  # the member lives on, in the root group
    finally:
        proc.communicate("\n", timeout=60)


def test_without_root_the_reason_is_given(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cgroup.find_controller() is None
    assert "root" in (cgroup.unavailable_reason() or "")
    with pytest.raises(RuntimeError, match="needs root"):
        cgroup.BandwidthGroup(str(tmp_path), 100 << 20)


def test_a_path_on_no_block_device_is_refused() -> None:
    with pytest.raises(ValueError, match="not on a block device"):
        cgroup.device_of("/proc/self")


def test_limits_must_be_positive(tmp_path) -> None:
    ctl = cgroup.Controller(1, str(tmp_path))
    try:
        dev_ok = cgroup.device_of(str(tmp_path))
    except ValueError:
        pytest.skip("tmp_path is on no block device")
    assert dev_ok
    with pytest.raises(ValueError, match="positive"):
        cgroup.BandwidthGroup(str(tmp_path), 0, controller=ctl)


def test_bench_dist_refuses_rank_bandwidth_without_a_controller(monkeypatch, tmp_path, capsys) -> None:
    from fastpersist.cli import main

    monkeypatch.setattr(cgroup, "unavailable_reason", lambda: "needs root (cgroup block-I/O limits)")
    rc = main(["bench", "dist", "--dir", str(tmp_path), "--ranks", "2", "--rank-bandwidth", "100MiB"])
    assert rc == 2
    assert "cannot limit each rank's bandwidth here: needs root" in capsys.readouterr().err
