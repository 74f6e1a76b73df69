"""What a benchmark run can say about itself before and after: the size it picks when the
user gave none, what it will cost, and whether the machine was quiet while it ran.

* :func:`auto_size`: the ``bench save`` state size from the memory and disk this
  machine has free (a first run must fit, and finish in a few minutes).
* :func:`plan_line`: one line printed before the run starts: size, runs, peak memory
  and disk it needs, and the bytes it moves through the disk with the time that takes
  at 0.5 and 2 GB/s.
* :class:`Conditions`: the load average before and after the run against the usable
  cores, and the fresh-memory fill speed against the disk's read ceiling, turned into
  lines that name the rows they affect.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

from fastpersist.units import format_bytes

#: the largest state ``bench save`` picks by itself (``--size`` chooses any)
AUTO_SIZE_MAX = 512 << 20
AUTO_SIZE_MIN = 64 << 20
#: peak resident memory of ``bench save`` per byte of state, measured (5 GB for 2 GiB: the
#: state, torch.save's and safetensors' copies, a fresh process's load)
PEAK_MEMORY_FACTOR = 2.5
#: files alive at once per byte of state: every method's file of the round, fio's file
DISK_FACTOR = 6


def available_memory() -> Optional[int]:
    """``MemAvailable`` of /proc/meminfo, lowered to the memory cgroup's free room, or None."""
    avail: Optional[int] = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        return None
    for limit_f, usage_f in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                             ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                              "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_f) as f:
                raw = f.read().strip()
            with open(usage_f) as f:
                used = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if raw.isdigit() and int(raw) < (1 << 60):
            room = int(raw) - used
            avail = room if avail is None else min(avail, room)
        break
    return avail


def auto_size(directory: str) -> tuple[int, str]:
    """``(bytes, why)``: :data:`AUTO_SIZE_MAX`, or less where free memory (divided by
    :data:`PEAK_MEMORY_FACTOR`) or free disk space in ``directory`` (divided by
    :data:`DISK_FACTOR`) is short; a multiple of 64 MiB, at least :data:`AUTO_SIZE_MIN`."""
    size, why = AUTO_SIZE_MAX, "the default for a first run"
    mem = available_memory()
    if mem is not None and mem / PEAK_MEMORY_FACTOR < size:
        size, why = int(mem / PEAK_MEMORY_FACTOR), f"chosen from the {format_bytes(mem)} of memory free"
    try:
        st = os.statvfs(directory)
        disk = st.f_bavail * st.f_frsize
    except OSError:
        disk = None
    if disk is not None and disk / DISK_FACTOR < size:
        size, why = int(disk / DISK_FACTOR), f"chosen from the {format_bytes(disk)} of disk free in {directory}"
    size = max(AUTO_SIZE_MIN, size // (64 << 20) * (64 << 20))
    return size, why


def plan_line(size: int, why: Optional[str], methods: int, repeat: int, fio: bool) -> str:
    """The line printed before ``bench save`` starts (what it will take)."""
    moved = size * 2 * methods * repeat + (size * 2 * (8 + repeat) if fio else 0)
    chosen = f" ({why}; --size to choose)" if why else ""
    return (f"Plan       : a {format_bytes(size)} state{chosen}, {repeat} round{'s' if repeat != 1 else ''} of "
            f"{methods} methods"
            + (" and fio" if fio else "") + f"; needs about {format_bytes(size * PEAK_MEMORY_FACTOR)} of memory "
            f"and {format_bytes(size * DISK_FACTOR)} of disk; moves about {moved / 1e9:.1f} GB through the disk: "
            f"{_minutes(moved / 2e9)} at 2 GB/s, {_minutes(moved / 0.5e9)} at 0.5 GB/s, plus the loads' "
            "process starts")


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def load_average() -> Optional[float]:
    """The 1-minute load average, or None."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def usable_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def busy_cores(seconds: float = 0.5) -> Optional[float]:
    """How many cores other work kept busy over the next ``seconds`` (this process sleeps
    meanwhile): the non-idle share of /proc/stat's CPU time times the core count, or None.
    Unlike the load average, which decays over a minute, it does not count work that just
    ended (the install before a first benchmark)."""
    def sample() -> Optional[tuple[int, int]]:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]) - idle, sum(fields[:8])

    a = sample()
    time.sleep(seconds)
    b = sample()
    if a is None or b is None or b[1] <= a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1]) * (os.cpu_count() or 1)


@dataclass
class Conditions:
    """How quiet the machine was around a run (see the module docstring)."""

    cpus: int
    load_before: Optional[float]
    busy_before: Optional[float] = None  #: cores other work kept busy just before the run (:func:`busy_cores`)
    load_after: Optional[float] = None
    fresh_memory_gbps: Optional[float] = None
    read_ceiling_gbps: Optional[float] = None

    @classmethod
    def before(cls) -> "Conditions":
        """Sampled before the run starts."""
        return cls(usable_cpus(), load_average(), busy_cores())

    def after(self, fresh_memory_gbps: Optional[float], read_ceiling_gbps: Optional[float]) -> None:
        """Sampled when the run has ended; the fresh-memory and read figures of the run."""
        self.load_after = load_average()
        self.fresh_memory_gbps = fresh_memory_gbps
        self.read_ceiling_gbps = read_ceiling_gbps

    @property
    def busy(self) -> bool:
        """Other work was running when the run started: half a core or more kept busy by it
        (:attr:`busy_before`), or where that could not be read, a load average of half the
        usable cores or more."""
        if self.busy_before is not None:
            return self.busy_before >= 0.5
        return self.load_before is not None and self.load_before >= 0.5 * self.cpus

    @property
    def memory_bound_loads(self) -> bool:
        """Memory the process never used fills slower than the disk reads: cold loads into
        new tensors measure the page faults, not the disk."""
        return (self.fresh_memory_gbps is not None and self.read_ceiling_gbps is not None
                and self.fresh_memory_gbps < self.read_ceiling_gbps)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form, with the verdicts."""
        d = asdict(self)
        d.update(busy=self.busy, memory_bound_loads=self.memory_bound_loads)
        return d

    def lines(self) -> list[str]:
        """Report lines: each condition and the rows it affects."""
        la = "unknown" if self.load_before is None else f"{self.load_before:.2f}"
        after = "" if self.load_after is None else f", {self.load_after:.2f} at its end (its own work included)"
        used = "" if self.busy_before is None else f"other work kept {self.busy_before:.1f} cores busy at the start; "
        if self.busy:
            out = [f"Conditions : NOT QUIET: {used}load average {la} on {self.cpus} usable cores before the "
                   f"run{after}; other work competed for the CPU and the disk, so every row, loads most, may be "
                   "slower than on a quiet machine (ratios within one run stay comparable)"]
        else:
            out = [f"Conditions : quiet at the start ({used}load average {la} on {self.cpus} usable cores{after})"]
        if self.memory_bound_loads:
            out.append(f"Cold loads : limited by new memory, not the disk: a process fills memory it never used at "
                       f"{self.fresh_memory_gbps:.2f} GB/s, the disk reads at {self.read_ceiling_gbps:.2f} GB/s; the "
                       "load rows measure page faults as much as reads")
        return out
