"""What the benchmark ran on: CPU, memory, filesystem, block device, O_DIRECT, engines, torch.

Every figure a benchmark prints is preceded by this header, so that numbers from
different machines are never compared blind. Everything here is read from
``/proc``, ``/sys`` and the native module; nothing needs root.
"""

from __future__ import annotations

import mmap
import os
import platform
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import fastpersist
from fastpersist import _native
from fastpersist import memprobe
from fastpersist.units import format_bytes


@dataclass
class MachineInfo:
    """The machine and target directory a benchmark ran on (see :func:`collect_machine_info`)."""

    directory: str
    cpu_model: str
    cpu_count: int
    cpus_usable: int
    memory_bytes: int
    kernel: str
    python: str
    torch_version: str
    cuda: str
    fastpersist_version: str
    filesystem: str
    mount_point: str
    mount_source: str
    block_device: Optional[str]
    device_model: Optional[str]
    rotational: Optional[bool]
    logical_block_size: Optional[int]
    direct_io: Optional[bool]
    direct_io_alignment: Optional[int]
    engines: list[str] = field(default_factory=list)
    cufile: str = "unknown"
    native_error: Optional[str] = None
    #: the device's readahead window (KiB): how far buffered readers such as torch.load read ahead
    read_ahead_kb: Optional[int] = None
    #: first-touch and resident write rates of memory (:mod:`fastpersist.memprobe`): what caps
    #: every loader that returns new tensors
    fresh_memory: Optional[dict[str, Any]] = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form."""
        return asdict(self)

    def summary_lines(self, verbose: bool = False) -> list[str]:
        """The header printed above every benchmark table (``verbose``: the memory probe's detail too)."""
        dev = self.block_device or "none (virtual filesystem)"
        if self.device_model:
            dev += f" ({self.device_model})"
        if self.rotational is not None:
            dev += ", rotational" if self.rotational else ", non-rotational"
        if self.logical_block_size:
            dev += f", logical block {self.logical_block_size} B"
        if self.read_ahead_kb is not None:
            dev += f", readahead {self.read_ahead_kb} KiB"
        if self.direct_io is None:
            odirect = "unknown"
        elif self.direct_io:
            odirect = f"supported (alignment {self.direct_io_alignment} B)"
        else:
            odirect = "NOT supported (buffered I/O only)"
        engines = ", ".join(self.engines) if self.engines else f"unavailable ({self.native_error})"
        return [
            f"CPU        : {self.cpu_model} ({self.cpus_usable} usable of {self.cpu_count} cores)",
            f"Memory     : {format_bytes(self.memory_bytes)}",
            f"Directory  : {self.directory}",
            f"Filesystem : {self.filesystem} on {self.mount_source} (mounted at {self.mount_point})",
            f"Device     : {dev}",
            f"O_DIRECT   : {odirect}",
            f"Engines    : {engines}; cuFile: {self.cufile}",
            f"Software   : fastpersist {self.fastpersist_version}, torch {self.torch_version} "
            f"(CUDA: {self.cuda}), Python {self.python}, Linux {self.kernel}",
        ] + ([f"New memory : {memprobe.FreshMemory(**self.fresh_memory).summary(verbose)}"]
             if self.fresh_memory else [])


def cpu_model() -> str:
    """CPU model name from ``/proc/cpuinfo`` (``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Processor", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def memory_bytes() -> int:
    """Total RAM in bytes (``MemTotal`` of ``/proc/meminfo``), 0 if unknown."""
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _unescape_mount(text: str) -> str:
    # /proc/mounts escapes space, tab, newline and backslash as octal.
    return (
        text.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
    )


def mount_of(path: str) -> tuple[str, str, str]:
    """``(filesystem type, mount point, source)`` of the mount holding ``path``.

    Longest mount-point prefix from ``/proc/mounts``; falls back to ``stat -f``
    for the type when ``/proc/mounts`` is unreadable.
    """
    real = os.path.realpath(path)
    best = ("unknown", "/", "unknown")
    best_len = -1
    try:
        with open("/proc/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                source, point, fstype = _unescape_mount(parts[0]), _unescape_mount(parts[1]), parts[2]
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= best_len:
                    best, best_len = (fstype, point, source), len(point)
    except OSError:
        pass
    if best[0] == "unknown":
        try:
            out = subprocess.run(
                ["stat", "-f", "-c", "%T", real], capture_output=True, text=True, timeout=10, check=True
            )
            best = (out.stdout.strip() or "unknown", best[1], best[2])
        except (OSError, subprocess.SubprocessError):
            pass
    return best


def _read_sys(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def block_device_of(path: str) -> dict[str, Any]:
    """Block device holding ``path``: name, model, rotational, logical block size, readahead.

    Resolved through ``st_dev`` and ``/sys/dev/block/MAJ:MIN`` (a partition is
    reported as its disk's properties). Empty dict for virtual filesystems
    (tmpfs, overlay, NFS...).
    """
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    if major == 0:
        return {}
    sysdir = f"/sys/dev/block/{major}:{minor}"
    if not os.path.exists(sysdir):
        return {"name": f"{major}:{minor}"}
    real = os.path.realpath(sysdir)
    name = os.path.basename(real)
    disk = os.path.dirname(real) if os.path.exists(os.path.join(real, "partition")) else real
    info: dict[str, Any] = {"name": name}
    model = _read_sys(os.path.join(disk, "device", "model")) or _read_sys(os.path.join(disk, "device", "name"))
    if model:
        info["model"] = model
    rot = _read_sys(os.path.join(disk, "queue", "rotational"))
    if rot in ("0", "1"):
        info["rotational"] = rot == "1"
    lbs = _read_sys(os.path.join(disk, "queue", "logical_block_size"))
    if lbs and lbs.isdigit():
        info["logical_block_size"] = int(lbs)
    ra = _read_sys(os.path.join(disk, "queue", "read_ahead_kb"))
    if ra and ra.isdigit():
        info["read_ahead_kb"] = int(ra)
    return info


def probe_direct_io(directory: str) -> tuple[bool, int]:
    """Pure-Python O_DIRECT probe of ``directory``: ``(supported, alignment)``.

    Writes one aligned block (4096 bytes, then the device's block size, ...)
    to a temporary file with ``O_DIRECT``; used when the native module is absent.
    """
    if not hasattr(os, "O_DIRECT"):
        return False, 4096
    fd_tmp, name = tempfile.mkstemp(prefix=".fastpersist-dio-", dir=directory)
    os.close(fd_tmp)
    try:
        for align in (4096, 8192, 16384, 65536):
            buf = mmap.mmap(-1, align)  # page-aligned anonymous memory
            try:
                fd = os.open(name, os.O_WRONLY | os.O_DIRECT)
            except OSError:
                return False, 4096
            try:
                os.write(fd, buf)
                return True, align
            except OSError:
                continue
            finally:
                os.close(fd)
                buf.close()
        return False, 4096
    finally:
        os.unlink(name)


def collect_machine_info(directory: str, *, probe_memory: bool = True) -> MachineInfo:
    """Describe this machine and the storage behind ``directory`` (must exist).

    ``probe_memory`` also measures how fast fresh memory is handed out
    (:func:`fastpersist.memprobe.probe_fresh_memory`, a fraction of a second).
    """
    import torch

    directory = os.path.abspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"benchmark directory {directory!r} does not exist (create it first)")
    fstype, point, source = mount_of(directory)
    dev = block_device_of(directory)
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    if torch.cuda.is_available():
        cuda = f"{torch.version.cuda}, {torch.cuda.get_device_name(0)}"
    else:
        cuda = f"no GPU (built for {torch.version.cuda})" if torch.version.cuda else "CPU-only build"

    engines: list[str] = []
    cufile = "unknown"
    native_error: Optional[str] = None
    direct: Optional[bool] = None
    align: Optional[int] = None
    try:
        engines = list(_native.available_engines())
        cufile = _native.cufile_status()
        direct = bool(_native.direct_io_supported(directory))
        align = int(_native.alignment_of(directory))
    except ImportError as exc:
        native_error = f"native module not importable: {exc}"
    except OSError as exc:
        native_error = str(exc)
    if direct is None:
        try:
            direct, align = probe_direct_io(directory)
        except OSError as exc:
            native_error = (native_error + "; " if native_error else "") + f"O_DIRECT probe failed: {exc}"

    return MachineInfo(
        directory=directory,
        cpu_model=cpu_model(),
        cpu_count=os.cpu_count() or 1,
        cpus_usable=usable,
        memory_bytes=memory_bytes(),
        kernel=platform.release(),
        python=platform.python_version(),
        torch_version=torch.__version__,
        cuda=cuda,
        fastpersist_version=getattr(fastpersist, "__version__", "unknown"),
        filesystem=fstype,
        mount_point=point,
        mount_source=source,
        block_device=dev.get("name"),
        device_model=dev.get("model"),
        rotational=dev.get("rotational"),
        logical_block_size=dev.get("logical_block_size"),
        direct_io=direct,
        direct_io_alignment=align,
        engines=engines,
        cufile=cufile,
        native_error=native_error,
        read_ahead_kb=dev.get("read_ahead_kb"),
        fresh_memory=memprobe.probe_fresh_memory(128 << 20, max(1, usable)).to_dict() if probe_memory else None,
    )
