"""A node's disk bandwidth on one machine: a block-I/O cgroup per process, with its own limit.

FastPersist's data-parallel split pays when every node brings its own
bandwidth (its own NVMe, its own link to shared storage). One shared disk
cannot show that. Putting each rank of ``fastpersist bench dist`` in a cgroup
of its own, with a write and a read bandwidth limit on the device of the
target directory, gives every rank its own "node bandwidth" on one machine.

Two kernels' interfaces (root needed for both):

* cgroup v1 ``blkio`` (``/sys/fs/cgroup/blkio``): ``blkio.throttle.write_bps_device``
  and ``blkio.throttle.read_bps_device`` take ``"MAJ:MIN BYTES_PER_SECOND"``.
* cgroup v2 ``io`` (a v2 hierarchy whose ``cgroup.controllers`` lists ``io``):
  ``io.max`` takes ``"MAJ:MIN wbps=N rbps=N"``.

The limit holds the I/O the kernel attributes to the cgroup: direct I/O and
reads always; buffered writes only when written back by the process itself
(``fsync``, ``O_SYNC``, throttled dirtying), since v1 attributes the flusher
threads' background write-back to the root cgroup. Measure it before
trusting a comparison (:func:`fastpersist.bench.cgroup.check_limit`).

Use on a RAM-backed disk (``shared/tools/ramdisk.sh``: ext4 on a loop device
in ``/dev/shm``), whose own speed is far above the limit, so that the limit
alone sets each rank's bandwidth.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

V1_ROOT = "/sys/fs/cgroup/blkio"
V2_ROOTS = ("/sys/fs/cgroup/unified", "/sys/fs/cgroup")


@dataclass(frozen=True)
class Controller:
    """Where block-I/O limits can be set: ``version`` 1 (blkio) or 2 (io), and the hierarchy's root."""

    version: int
    root: str


def find_controller() -> Optional[Controller]:
    """The block-I/O controller this machine offers to root, or ``None`` (not root, or none mounted)."""
    if os.geteuid() != 0:
        return None
    if os.path.exists(os.path.join(V1_ROOT, "blkio.throttle.write_bps_device")):
        return Controller(1, V1_ROOT)
    for root in V2_ROOTS:
        try:
            with open(os.path.join(root, "cgroup.controllers"), encoding="ascii") as f:
                if "io" in f.read().split():
                    return Controller(2, root)
        except OSError:
            continue
    return None


def unavailable_reason() -> Optional[str]:
    """Why :func:`find_controller` finds nothing (``None`` when it finds one)."""
    if os.geteuid() != 0:
        return "needs root (cgroup block-I/O limits)"
    if find_controller() is None:
        return (f"no cgroup v1 blkio controller ({V1_ROOT}) and no cgroup v2 hierarchy with the io controller "
                "enabled")
    return None


def device_of(path: str) -> str:
    """``"MAJ:MIN"`` of the whole block device holding ``path`` (a partition's disk; limits apply to disks).

    Raises ``ValueError`` when ``path`` is on no block device (tmpfs, overlay of no device).
    """
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    sys_dev = f"/sys/dev/block/{major}:{minor}"
    if not os.path.exists(sys_dev):
        raise ValueError(f"{path!r} is not on a block device (device {major}:{minor}); "
                         "use a disk or the RAM-backed loop device of shared/tools/ramdisk.sh")
    if os.path.exists(os.path.join(sys_dev, "partition")):
        with open(os.path.join(os.path.realpath(sys_dev), "..", "dev"), encoding="ascii") as f:
            return f.read().strip()
    return f"{major}:{minor}"


class BandwidthGroup:
    """A cgroup with a write and a read bandwidth limit (bytes/s) on one device; processes join it.

    ``with BandwidthGroup(path, write_bps, read_bps) as g: g.join()`` puts the
    calling process (all its threads, and children started afterwards) in the
    group; leaving the context moves every member back to the root group and
    removes the group. Raises ``PermissionError``/``OSError`` when the
    controller refuses, ``RuntimeError`` when there is no controller.
    """

    def __init__(self, path: str, write_bps: int, read_bps: Optional[int] = None, *, name: Optional[str] = None,
                 controller: Optional[Controller] = None) -> None:
        ctl = controller or find_controller()
        if ctl is None:
            raise RuntimeError(f"cannot limit block I/O here: {unavailable_reason()}")
        if write_bps <= 0 or (read_bps is not None and read_bps <= 0):
            raise ValueError("bandwidth limits must be positive")
        self.controller = ctl
        self.device = device_of(path)
        self.write_bps = int(write_bps)
        self.read_bps = int(read_bps if read_bps is not None else write_bps)
        self.path = os.path.join(ctl.root, name or f"fastpersist-bench-{os.getpid()}-{time.monotonic_ns()}")
        self._made = False

    def __enter__(self) -> "BandwidthGroup":
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self) -> None:
        """Make the group and set its limits."""
        os.mkdir(self.path)
        self._made = True
        try:
            if self.controller.version == 1:
                self._write("blkio.throttle.write_bps_device", f"{self.device} {self.write_bps}")
                self._write("blkio.throttle.read_bps_device", f"{self.device} {self.read_bps}")
            else:
                self._write("io.max", f"{self.device} wbps={self.write_bps} rbps={self.read_bps}")
        except BaseException:
            self.close()
            raise

    def limits(self) -> dict[str, str]:
        """The limit files' contents, as the kernel reports them."""
        names = (("blkio.throttle.write_bps_device", "blkio.throttle.read_bps_device") if self.controller.version == 1
                 else ("io.max",))
        out = {}
        for n in names:
            with open(os.path.join(self.path, n), encoding="ascii") as f:
                out[n] = f.read().strip()
        return out

    def join(self, pid: int = 0) -> None:
        """Move process ``pid`` (0: the caller) into the group."""
        self._write("cgroup.procs", str(pid or os.getpid()))

    def members(self) -> list[int]:
        """Process ids in the group."""
        with open(os.path.join(self.path, "cgroup.procs"), encoding="ascii") as f:
            return [int(x) for x in f.read().split()]

    def written_bytes(self) -> int:
        """Bytes written to the device by the group's members, as the controller counted them."""
        if self.controller.version == 1:
            name, key = "blkio.throttle.io_service_bytes", "Write"
            with open(os.path.join(self.path, name), encoding="ascii") as f:
                for line in f:
                    parts = line.split()
                    if len(parts) == 3 and parts[0] == self.device and parts[1] == key:
                        return int(parts[2])
            return 0
        with open(os.path.join(self.path, "io.stat"), encoding="ascii") as f:
            for line in f:
                parts = line.split()
                if parts and parts[0] == self.device:
                    fields = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
                    return int(fields.get("wbytes", 0))
        return 0

    def close(self) -> None:
        """Move every member back to the root group and remove the group (idempotent)."""
        if not self._made:
            return
        try:
            for pid in self.members():
                try:
                    with open(os.path.join(self.controller.root, "cgroup.procs"), "w", encoding="ascii") as f:
                        f.write(str(pid))
                except OSError:  # the process is gone
                    pass
        except OSError:
            pass
        for _ in range(50):
            try:
                os.rmdir(self.path)
                break
            except FileNotFoundError:
                break
            except OSError:  # members still leaving
                time.sleep(0.02)
        self._made = False

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w", encoding="ascii") as f:
            f.write(value)


def check_limit(directory: str, bps: int, nbytes: int = 32 << 20, *, buffered: bool = False) -> float:
    """Write ``nbytes`` into ``directory`` from a child process inside a ``bps`` group; its GB/s.

    ``buffered=False``: O_DIRECT writes; ``True``: buffered writes then ``fsync``
    (what ``torch.save`` + fsync does). A result near ``bps`` means the limit
    holds that kind of write; far above it, the writes escape the limit.
    """
    import subprocess
    import sys

    target = os.path.join(directory, f".fastpersist-cgroup-check-{os.getpid()}")
    code = (
        "import os, sys, time, mmap\n"
        "path, n, direct = sys.argv[1], int(sys.argv[2]), sys.argv[3] == '1'\n"
        "buf = mmap.mmap(-1, 1 << 20); buf.write(os.urandom(1 << 20))\n"
        "flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)\n"
        "t0 = time.perf_counter(); fd = os.open(path, flags, 0o644)\n"
        "for _ in range(n >> 20): os.write(fd, buf)\n"
        "os.fsync(fd); os.close(fd)\n"
        "print(n / (time.perf_counter() - t0) / 1e9)\n"
    )
    with BandwidthGroup(directory, bps) as group:
        proc = subprocess.Popen([sys.executable, "-c", code, target, str(nbytes), "0" if buffered else "1"],
                                stdout=subprocess.PIPE, text=True, preexec_fn=lambda: group.join())
        out, _ = proc.communicate(timeout=600)
    try:
        os.unlink(target)
    except OSError:
        pass
    if proc.returncode != 0:
        raise RuntimeError(f"the check's writer failed (exit {proc.returncode})")
    return float(out.strip())
