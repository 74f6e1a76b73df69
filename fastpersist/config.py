"""Settings of fastpersist: the :class:`Config` dataclass and the ``FASTPERSIST_*`` variables.

Every environment variable is defined once, in :data:`ENV_VARS` below (name, field,
type, default, meaning); the parsers, :meth:`Config.from_env` and the documentation
page ``docs/config.md`` (``python -m fastpersist.config --markdown``) are all driven
by that table.

Example::

    cfg = fastpersist.Config(chunk_size=16 << 20, threads=4)
    fastpersist.save(state, "ckpt.pt", config=cfg)

    with fastpersist.config.override(fsync=False):   # temporary process-wide default
        ...
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import re
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional

__all__ = [
    "ENGINES",
    "READ_MODES",
    "READ_STAGING",
    "ENV_VARS",
    "Config",
    "EnvVar",
    "get_default",
    "markdown",
    "override",
    "parse_bool",
    "parse_size",
    "reset_default",
]

#: Values accepted for :attr:`Config.engine`.
ENGINES = ("auto", "aio", "psync", "cufile")

#: The read queue depth where :attr:`Config.read_queue_depth` is None and the device
#: does not decide it (see :func:`fastpersist.readpolicy.plan_read`).
DEFAULT_READ_QUEUE_DEPTH = 16

#: Values accepted for :attr:`Config.read_staging`.
READ_STAGING = ("auto", "on", "off")

#: Values accepted for :attr:`Config.read_mode`.
READ_MODES = ("auto", "direct", "buffered")

_PAGE = 4096


@functools.cache
def under_hypervisor() -> bool:
    """Whether this Linux guest runs under a hypervisor (the ``hypervisor`` CPU flag in
    ``/proc/cpuinfo``, which x86 guests of KVM, Xen, Hyper-V and VMware report).

    ``read_staging="auto"`` stages reads there: a virtual disk's data is copied into
    guest memory by the host, and on the reference VM loads ran 1.4-1.6x faster
    through a small staging ring than straight into their multi-GiB destination.
    Read once per process.
    """
    return cpu_flags_say_hypervisor(_read_cpuinfo())


def _read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def cpu_flags_say_hypervisor(cpuinfo: str) -> bool:
    """Whether a ``/proc/cpuinfo`` text lists the ``hypervisor`` flag on a ``flags`` line."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags" and "hypervisor" in value.split():
            return True
    return False


@dataclass(frozen=True)
class Config:
    """How fastpersist moves bytes. Immutable; derive variants with :meth:`replace`.

    Attributes:
        engine: I/O engine: ``"auto"`` (currently ``"psync"``, which measured fastest),
            ``"aio"`` (Linux AIO), ``"psync"`` (thread pool of pread/pwrite) or
            ``"cufile"`` (GPUDirect Storage; fails loudly when unavailable).
        chunk_size: Bytes per I/O request and per staging buffer; a positive multiple of 4096.
        queue_depth: I/O requests in flight per write operation (also the number of
            staging buffers in the ring); at least 2.
        read_queue_depth: I/O requests in flight per read operation (loads, verify);
            at least 2 (also the number of staging buffers when reads are staged).
            ``None`` (default): chosen per device for the O_DIRECT reads of loads
            (:func:`fastpersist.readpolicy.plan_read`): 2 where the file's block device
            has one hardware queue (a VM's virtio disk, a loop device, SATA; deeper
            queues' reads there ran ahead of the pre-fault thread and collided with it);
            :data:`DEFAULT_READ_QUEUE_DEPTH` elsewhere (NVMe's many queues, stacked or
            unknown devices) and for buffered and staged reads.
        read_staging: How reads reach their destination: ``"off"``: straight into it
            (``O_DIRECT`` DMA, no copy); ``"on"``: through a ring of
            ``read_queue_depth`` staging buffers of ``chunk_size`` bytes, copied out by
            the worker threads; ``"auto"`` (default): with ``read_mode="auto"``, cold
            loads from a local disk read zero-copy (see ``read_mode``); elsewhere ``"on"`` under a hypervisor
            (:func:`under_hypervisor`), ``"off"`` on bare metal. Only ``O_DIRECT``
            reads are staged (a buffered read already copies out of the page cache).
            The ring costs ``read_queue_depth x chunk_size`` bytes (128 MiB by
            default), which the reading handle keeps for its next read.
        read_mode: How loads (``load``, safetensors loads) read a file: ``"direct"``:
            parallel ``O_DIRECT`` reads (staged or not, see :attr:`read_staging`);
            ``"buffered"``: parallel reads through the page cache (kernel readahead);
            ``"auto"`` (default): chosen from the filesystem and the page cache, the
            same way every time (:func:`fastpersist.readpolicy.plan_read`): buffered on
            a memory, network or no-``O_DIRECT`` filesystem and for a file mostly in
            the page cache already; otherwise ``O_DIRECT``, zero-copy unless
            ``read_staging="on"``. Nothing is learned from earlier loads.
            With ``direct=False`` every read is buffered.
        threads: Worker threads that fill staging buffers (and do the I/O for ``psync``); >= 1.
        direct: Use ``O_DIRECT`` where the filesystem accepts it (bypasses the page cache).
        fsync: ``fsync`` the file and its directory before a save is reported complete.
        checksum: Check CRC-32s when loading; record them in safetensors metadata when saving
            (torch zip files always carry their zip CRC-32s).
        max_async: Asynchronous saves executed concurrently; later ones queue; >= 1.
        fast_pickle: Pickle plain tensors and lay out torch zip records with fastpersist's
            own code, which produces torch's bytes (checked against torch once per
            process, with torch's own path as the automatic fallback); ``False``:
            torch's ``Tensor.__reduce_ex__`` and ``PyTorchFileWriter`` (slower when a
            state has many tensors).
        dist_timeout: Collective saves/loads (``group=``): seconds a rank waits for the
            others at each step before raising an error naming the missing ranks.
        dist_load: Collective loads: ``"slices"`` (each rank reads a disjoint slice,
            the ranks exchange them), ``"whole"`` (every rank reads the whole file) or
            ``"auto"`` (default): slices for NCCL groups, whole for gloo groups, where
            the exchange over TCP measured slower than reading the file again
            (docs/benchmarks.md, "Multi-rank").
        async_staging_limit: Bytes of page-locked host memory for
            :func:`fastpersist.save_async` snapshots (a pool reused across saves; a save
            that needs more waits for its earlier windows to reach the disk); also the
            most a ``lazy`` save copies at call time. A multiple of 4096, >= 8192.
        async_nice: Nice value (0-19) of the native threads that copy and write
            :func:`fastpersist.save_async` saves in the background; 0 (default) runs
            them at the training's priority, higher values make them yield the CPUs to
            the training's threads (copies the training waits for stay at full priority).
        s3_threads: Requests in flight per transfer to or from an ``s3://`` URL (parts of
            an upload, ranged GETs of a load).
        s3_part_size: Bytes per part of an upload and per ranged GET of a load, for
            ``s3://`` URLs; at least 5 MiB (S3's minimum part), a multiple of 1 MiB,
            grown for files that would need more than 10,000 parts.
        s3_timeout: Seconds an ``s3://`` request may wait to connect, and then for
            each read from the store, before botocore retries it (a stalled store).
        s3_local_dir: The local directory of the tiered mode (None: direct mode). Set,
            a save to ``s3://bucket/key`` writes ``<s3_local_dir>/bucket/key`` as a local
            save does and a background drain uploads it; loads read the local copy
            when it is there and checks out (:mod:`fastpersist.s3tier`).
        s3_keep_local: Tiered mode: checkpoints kept in the local directory per
            ``s3://bucket/prefix/`` (only ones already durable remotely are removed);
            0 keeps all.
        s3_keep_remote: Tiered mode: checkpoints kept in the store per
            ``s3://bucket/prefix/``, counting only objects the tier uploaded; 0 keeps all.
    """

    engine: str = "auto"
    chunk_size: int = 8 << 20
    queue_depth: int = 8
    read_queue_depth: Optional[int] = None
    read_staging: str = "auto"
    read_mode: str = "auto"
    threads: int = 2
    direct: bool = True
    fsync: bool = True
    checksum: bool = True
    max_async: int = 2
    fast_pickle: bool = True

    # -- collective saves and loads over a process group (fastpersist.distributed) --
    #: Seconds a rank waits for the others at each step of a collective save/load
    #: before raising an error that names the missing ranks.
    dist_timeout: float = 600.0
    #: Collective loads: ``"slices"``: each rank reads a disjoint slice of the file and
    #: the ranks exchange them; ``"whole"``: every rank reads the whole file itself;
    #: ``"auto"``: slices when the group moves CUDA tensors (NCCL), else whole.
    dist_load: str = "auto"

    # -- asynchronous saves (fastpersist.asyncsave) --
    #: Page-locked host memory that ``save_async(mode="snapshot")`` copies state into
    #: (a pool reused across saves); also the most a ``lazy`` save copies at call time.
    async_staging_limit: int = 1 << 30
    #: Nice value (0-19) of the threads that write async saves in the background.
    async_nice: int = 0

    # -- object storage (s3:// URLs: fastpersist.objectstore) --
    #: Requests in flight per upload or download.
    s3_threads: int = 8
    #: Bytes per uploaded part and per ranged GET (>= 5 MiB, a multiple of 1 MiB).
    s3_part_size: int = 16 << 20
    #: Seconds to connect and per read before a request is retried (a stalled store).
    s3_timeout: float = 60.0
    #: Tiered mode: the local directory saves land in before the drain uploads them (None: direct mode).
    s3_local_dir: Optional[str] = None
    #: Tiered mode: checkpoints kept locally per bucket and key prefix (0: all).
    s3_keep_local: int = 0
    #: Tiered mode: checkpoints the tier uploaded kept remotely per bucket and key prefix (0: all).
    s3_keep_remote: int = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _validate_field(f.name, getattr(self, f.name))

    def replace(self, **changes: Any) -> "Config":
        """Return a copy with ``changes`` applied (validated like the constructor).

        Raises:
            TypeError: a name in ``changes`` is not a field of :class:`Config`.
            ValueError: a value is out of range.
        """
        unknown = sorted(set(changes) - _FIELD_NAMES)
        if unknown:
            raise TypeError(
                f"Config has no field(s) {', '.join(unknown)}; fields are {', '.join(sorted(_FIELD_NAMES))}"
            )
        return dataclasses.replace(self, **changes)

    def stages_reads(self) -> bool:
        """Whether reads go through the staging ring (:attr:`read_staging` resolved)."""
        if self.read_staging == "auto":
            return under_hypervisor()
        return self.read_staging == "on"

    def read_depth(self) -> int:
        """:attr:`read_queue_depth`, or :data:`DEFAULT_READ_QUEUE_DEPTH` where it is None (a
        load's O_DIRECT reads may then take the depth its device calls for instead)."""
        return DEFAULT_READ_QUEUE_DEPTH if self.read_queue_depth is None else self.read_queue_depth

    def handle_kwargs(self, *, read: bool = False) -> dict[str, Any]:
        """Keyword arguments for ``fastpersist._native.Handle(**kwargs)``; ``read``: for a
        handle that reads (its queue depth is :attr:`read_queue_depth`, and it stages
        reads when :meth:`stages_reads`)."""
        kwargs: dict[str, Any] = {
            "engine": self.engine,
            "chunk_size": self.chunk_size,
            "queue_depth": self.read_depth() if read else self.queue_depth,
            "threads": self.threads,
            "direct": self.direct,
            "max_async": self.max_async,
        }
        if read:
            kwargs["stage_reads"] = self.stages_reads()
            kwargs["read_mode"] = self.read_mode
        return kwargs

    @classmethod
    def from_env(cls, base: Optional["Config"] = None, environ: Optional[Mapping[str, str]] = None) -> "Config":
        """Return ``base`` (default: ``Config()``) with every ``FASTPERSIST_*`` variable applied.

        Variables are read and parsed now, at each call. Unset or empty variables leave
        the field of ``base`` unchanged.

        Args:
            base: The configuration to start from.
            environ: Mapping to read instead of ``os.environ`` (tests).

        Raises:
            ValueError: a variable holds an invalid value; the message names the
                variable, the value and what is accepted.
        """
        env = os.environ if environ is None else environ
        changes: dict[str, Any] = {}
        for var in ENV_VARS:
            if var.field is None:
                continue
            raw = env.get(var.name)
            if raw is None or raw.strip() == "":
                continue
            value = var.parse(var.name, raw)
            try:
                _validate_field(var.field, value)
            except ValueError as exc:
                raise ValueError(f"{var.name}={raw!r}: {exc}") from None
            changes[var.field] = value
        return (base if base is not None else cls()).replace(**changes)


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(Config))


def _validate_field(name: str, value: Any) -> None:
    """Raise ``ValueError``/``TypeError`` if ``value`` is not acceptable for field ``name``."""
    if name in _DIST_FIELDS:
        _validate_dist_field(name, value)
        return
    if name == "s3_local_dir":
        if value is not None and (not isinstance(value, str) or not value):
            raise TypeError(f"s3_local_dir must be a directory path (str) or None, not {value!r}")
        return
    if name == "read_queue_depth" and value is None:
        return  # chosen per device
    if name == "s3_timeout":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"s3_timeout must be a positive number of seconds, not {value!r}")
        return
    if name == "engine":
        if value not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {value!r}")
    elif name == "read_staging":
        if value not in READ_STAGING:
            raise ValueError(f"read_staging must be one of {', '.join(READ_STAGING)}, not {value!r}")
    elif name == "read_mode":
        if value not in READ_MODES:
            raise ValueError(f"read_mode must be one of {', '.join(READ_MODES)}, not {value!r}")
    elif name in ("direct", "fsync", "checksum", "fast_pickle"):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, not {type(value).__name__}")
    else:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, not {type(value).__name__}")
        if name == "chunk_size":
            if value <= 0 or value % _PAGE:
                raise ValueError(f"chunk_size must be a positive multiple of {_PAGE} bytes, not {value}")
        elif name in ("queue_depth", "read_queue_depth"):
            if value < 2:
                raise ValueError(f"{name} must be at least 2, not {value}")
        elif name in ("threads", "max_async", "s3_threads"):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, not {value}")
        elif name in ("s3_keep_local", "s3_keep_remote"):
            if value < 0:
                raise ValueError(f"{name} must be >= 0 (0 keeps every checkpoint), not {value}")
        elif name == "async_nice":
            if not 0 <= value <= 19:
                raise ValueError(f"async_nice must be a nice value from 0 to 19, not {value}")
        elif name == "s3_part_size":
            if value < 5 << 20 or value % (1 << 20):
                raise ValueError(f"s3_part_size must be a multiple of 1 MiB, at least 5 MiB (S3's minimum part), "
                                 f"not {value}")
        elif name == "async_staging_limit":
            if value < 2 * _PAGE or value % _PAGE:
                raise ValueError(f"async_staging_limit must be a multiple of {_PAGE} bytes, at least {2 * _PAGE}, not {value}")


#: Values accepted for :attr:`Config.dist_load`.
DIST_LOAD = ("auto", "slices", "whole")
_DIST_FIELDS = frozenset({"dist_timeout", "dist_load"})


def _validate_dist_field(name: str, value: Any) -> None:
    if name == "dist_timeout":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"dist_timeout must be a number of seconds, not {type(value).__name__}")
        if not value > 0 or value != value or value == float("inf"):
            raise ValueError(f"dist_timeout must be a positive, finite number of seconds, not {value}")
    elif name == "dist_load":
        if value not in DIST_LOAD:
            raise ValueError(f"dist_load must be one of {', '.join(DIST_LOAD)}, not {value!r}")


def _parse_seconds(name: str, raw: str) -> float:
    try:
        return float(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None


def _parse_dist_load(name: str, raw: str) -> str:
    text = raw.strip().lower()
    if text not in DIST_LOAD:
        raise ValueError(f"{name}={raw!r} is not a load mode; use one of {', '.join(DIST_LOAD)}")
    return text


# ---------------------------------------------------------------------------
# Typed parsers: (variable name, raw text) -> value, ValueError naming both.

_TRUE = frozenset({"1", "true", "on", "yes"})
_FALSE = frozenset({"0", "false", "off", "no"})


def parse_bool(name: str, raw: str) -> bool:
    """Parse 1/0/true/false/on/off/yes/no (any case, surrounding spaces ignored)."""
    text = raw.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean; use one of 1/0, true/false, on/off, yes/no")


def _parse_depth(name: str, raw: str) -> Optional[int]:
    """An integer, or ``auto`` (None: chosen per device)."""
    if raw.strip().lower() == "auto":
        return None
    return _parse_int(name, raw)


def _parse_int(name: str, raw: str) -> int:
    try:
        return int(raw.strip(), 10)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_SHIFT = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}


def parse_size(name: str, raw: str) -> int:
    """Parse a byte count: ``8388608``, ``8M``, ``8MiB``, ``8MB``, ``1G``, ``512K``.

    Suffixes K, M, G, T (optionally followed by ``B`` or ``iB``, any case) are binary
    multiples: ``1K == 1024``.
    """
    m = _SIZE_RE.match(raw)
    if m is None or (m.group(3) and not m.group(2) and m.group(3).lower() == "ib"):
        raise ValueError(f"{name}={raw!r} is not a size; use bytes or a number with K, M, G or T (e.g. 8M, 8MiB)")
    return int(m.group(1)) << _SIZE_SHIFT[m.group(2).lower()]


def _parse_path(name: str, raw: str) -> str:
    return os.path.expanduser(raw.strip())


def _parse_engine(name: str, raw: str) -> str:
    text = raw.strip().lower()
    if text not in ENGINES:
        raise ValueError(f"{name}={raw!r} is not an engine; use one of {', '.join(ENGINES)}")
    return text


def _parse_read_staging(name: str, raw: str) -> str:
    text = raw.strip().lower()
    if text in _TRUE:
        return "on"
    if text in _FALSE:
        return "off"
    if text != "auto":
        raise ValueError(f"{name}={raw!r} is not a staging mode; use auto, on or off")
    return text


def _parse_read_mode(name: str, raw: str) -> str:
    text = raw.strip().lower()
    if text not in READ_MODES:
        raise ValueError(f"{name}={raw!r} is not a read mode; use one of {', '.join(READ_MODES)}")
    return text


def _parse_fault(name: str, raw: str) -> str:
    """Syntax check only; the native module applies the fault."""
    parts = raw.strip().split(":")
    if len(parts) not in (3, 4) or not parts[1].isdigit() or (len(parts) == 4 and not parts[3].isdigit()):
        raise ValueError(f"{name}={raw!r} is not a fault spec; use op:nth:action[:count], e.g. write:3:EIO")
    return raw.strip()


def _parse_huge_pages(name: str, raw: str) -> str:
    """``on``, ``off`` or ``auto`` (booleans accepted); fastpersist.prefault reads the variable itself."""
    value = raw.strip().lower()
    if value in ("1", "on", "true", "yes"):
        return "on"
    if value in ("0", "off", "false", "no"):
        return "off"
    if value == "auto":
        return value
    raise ValueError(f"{name}={raw!r}: expected on, off or auto")


def _parse_copy(name: str, raw: str) -> str:
    """``stream`` or ``plain``; the native module reads the variable itself."""
    value = raw.strip().lower()
    if value not in ("stream", "plain"):
        raise ValueError(f"{name}={raw!r}: use stream or plain")
    return value


# ---------------------------------------------------------------------------
# The one table of environment variables.


@dataclass(frozen=True)
class EnvVar:
    """One ``FASTPERSIST_*`` variable.

    ``field`` is the :class:`Config` field it sets, or ``None`` for variables read
    elsewhere (documented here so the documentation stays complete).
    """

    name: str
    field: Optional[str]
    parse: Callable[[str, str], Any]
    type: str
    meaning: str
    default: Optional[str] = None  # display text; None: taken from Config's default


def _bool_text(value: bool) -> str:
    return "on" if value else "off"


def _size_text(value: int) -> str:
    for suffix, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if value >= 1 << shift and value % (1 << shift) == 0:
            return f"{value >> shift}{suffix}"
    return str(value)


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar(
        "FASTPERSIST_ENGINE", "engine", _parse_engine, "one of auto, aio, psync, cufile",
        "I/O engine. `auto` is currently `psync`, a thread pool of pread/pwrite (it matched or beat "
        "Linux AIO in every interleaved comparison on the reference VM); `aio` is Linux AIO; `cufile` (GPUDirect Storage) fails loudly when unavailable.",
    ),
    EnvVar(
        "FASTPERSIST_CHUNK_SIZE", "chunk_size", parse_size, "size (8388608, 8M, 8MiB, 1G)",
        "Bytes per I/O request and per pinned staging buffer; a multiple of 4096. "
        "Suffixes K, M, G, T are binary (1K = 1024).",
    ),
    EnvVar(
        "FASTPERSIST_QUEUE_DEPTH", "queue_depth", _parse_int, "integer >= 2",
        "I/O requests in flight per write operation; also the number of staging buffers in the ring.",
    ),
    EnvVar(
        "FASTPERSIST_READ_QUEUE_DEPTH", "read_queue_depth", _parse_depth, "auto or integer >= 2",
        "I/O requests in flight per read operation (`load`, `verify`); also the number of "
        "staging buffers when reads are staged. `auto`: the O_DIRECT reads of a load take 2 where "
        "the file's block device has one hardware queue (a VM's virtio disk, a loop device, SATA: "
        "on the reference VM's virtio disk and RAM disk, cold loads of 64 MiB-1 GiB ran 1.1-1.6x "
        "faster than at 16, docs/loading.md), 16 elsewhere (NVMe's many queues, stacked or unknown "
        "devices) and for buffered or staged reads. "
        "`fastpersist info --dir D` says which depth a directory gets.",
        default="auto",
    ),
    EnvVar(
        "FASTPERSIST_READ_STAGING", "read_staging", _parse_read_staging, "auto, on or off",
        "How reads reach their destination. `off`: straight into it with O_DIRECT, no copy. "
        "`on`: through a ring of `read_queue_depth` staging buffers, copied out by the worker "
        "threads. `auto`: with `FASTPERSIST_READ_MODE=auto` (the default), the read mode's choice: zero-copy "
        "O_DIRECT for a cold file on a local disk (the destination pre-faulted by a second thread), see "
        "FASTPERSIST_READ_MODE; where the read mode is set explicitly, `auto` "
        "means `on` under a hypervisor (the `hypervisor` flag in /proc/cpuinfo) and `off` on bare metal. "
        "Only O_DIRECT reads are "
        "staged: a buffered read is already a copy out of the page cache. The ring costs "
        "`read_queue_depth` x `chunk_size` bytes (128 MiB by default), kept by the reading handle for its next read.",
    ),
    EnvVar(
        "FASTPERSIST_READ_MODE", "read_mode", _parse_read_mode, "auto, direct or buffered",
        "How loads read a file. `direct`: parallel O_DIRECT reads (staged or not, see "
        "FASTPERSIST_READ_STAGING). `buffered`: parallel reads through the page cache (kernel "
        "readahead, then a copy). `auto`: chosen from what the filesystem and the file are, the same "
        "way every time (fastpersist/readpolicy.py; docs/loading.md, \"How loads read the file\"): "
        "buffered on a memory filesystem (tmpfs, ramfs), a network or FUSE filesystem, or one that "
        "refuses O_DIRECT, and for a file mostly in the page cache already (checked with mincore, which "
        "starts no I/O); otherwise (a cold file on a local disk) O_DIRECT, zero-copy unless "
        "FASTPERSIST_READ_STAGING is `on`. Nothing is learned from earlier loads (their speed follows "
        "whatever else runs on the machine). `fastpersist info --dir D` prints the choice for D and why. "
        "With FASTPERSIST_DIRECT off every read is buffered.",
    ),
    EnvVar(
        "FASTPERSIST_THREADS", "threads", _parse_int, "integer >= 1",
        "Worker threads that fill staging buffers (and perform the I/O for `psync`).",
    ),
    EnvVar(
        "FASTPERSIST_DIRECT", "direct", parse_bool, "boolean",
        "Use O_DIRECT where the filesystem accepts it (bypasses the page cache).",
    ),
    EnvVar(
        "FASTPERSIST_FSYNC", "fsync", parse_bool, "boolean",
        "fsync the file and its directory before a save is reported complete.",
    ),
    EnvVar(
        "FASTPERSIST_CHECKSUM", "checksum", parse_bool, "boolean",
        "Check every record's CRC-32 when loading, and record per-tensor CRC-32s in safetensors "
        "metadata when saving. Torch zip files always carry their CRC-32s (computed during the write).",
    ),
    EnvVar(
        "FASTPERSIST_MAX_ASYNC", "max_async", _parse_int, "integer >= 1",
        "Asynchronous saves executed concurrently; later ones queue behind them.",
    ),
    EnvVar(
        "FASTPERSIST_FAST_PICKLE", "fast_pickle", parse_bool, "boolean",
        "Pickle plain tensors and lay out torch zip records with fastpersist's own code (the "
        "bytes torch writes; checked against torch's own path once per process, which is used "
        "instead if they differ). Off: torch's `Tensor.__reduce_ex__` and zip writer, slower "
        "for states of many tensors.",
    ),
    EnvVar(
        "FASTPERSIST_DIST_TIMEOUT", "dist_timeout", _parse_seconds, "seconds (> 0)",
        "Collective saves/loads (`group=`): how long a rank waits for the others at each step "
        "before raising an error naming the ranks that did not arrive (dead or hung).",
    ),
    EnvVar(
        "FASTPERSIST_DIST_LOAD", "dist_load", _parse_dist_load, "auto, slices or whole",
        "Collective loads (`load(path, group=...)`): `slices`: each rank reads a disjoint slice "
        "of the file and the ranks exchange them over the group, so the storage is read once; "
        "`whole`: every rank reads the whole file; `auto`: `slices` when the group's backend moves CUDA "
        "tensors (NCCL), `whole` for gloo, where on the reference VM the exchange over loopback TCP was "
        "slower than each rank reading the file (docs/benchmarks.md, \"Multi-rank\").",
    ),
    EnvVar(
        "FASTPERSIST_PATCH_TORCH_SAVE", None, parse_bool, "boolean",
        "When true, `torch.save`/`torch.load` on paths go through fastpersist in every Python "
        "process of the environment, with no code change: the start-up hook installed with the "
        "package (`fastpersist-startup.pth`) calls `fastpersist.patch_torch_save()` right after "
        "`import torch` (and `import fastpersist` does too). Also switches on the Accelerate and "
        "DeepSpeed adapters unless their own variables say off. Check: "
        "`python -c \"import torch; print(hasattr(torch.save, '_fastpersist_original'))\"`.",
        default="off",
    ),
    EnvVar(
        "FASTPERSIST_ACCELERATE", None, parse_bool, "boolean",
        "When true, every `Accelerator.save_state`/`load_state` of the process goes through "
        "fastpersist (`fastpersist.integrations.accelerate.install_from_env()`, run by the start-up "
        "hook when `accelerate.accelerator` is imported). Unset: follows FASTPERSIST_PATCH_TORCH_SAVE.",
        default="unset",
    ),
    EnvVar(
        "FASTPERSIST_DEEPSPEED", None, parse_bool, "boolean",
        "When true, every DeepSpeed engine checkpoints through fastpersist's CheckpointEngine "
        "(`fastpersist.integrations.deepspeed.install_from_env()`, run by the start-up hook when "
        "`deepspeed.runtime.engine` is imported). Unset: follows FASTPERSIST_PATCH_TORCH_SAVE. "
        "An engine whose DeepSpeed config has a top-level `\"fastpersist\"` key follows that key "
        "instead (`true`/`false`, or `{\"enabled\", \"decoupled\", \"split_replicated\", \"config\"}`; "
        "docs/integrations.md, DeepSpeed).",
        default="unset",
    ),
    EnvVar(
        "FASTPERSIST_STARTUP", None, parse_bool, "boolean",
        "`0`/off turns the start-up hook off entirely (no import watcher: no torch.save switch, no "
        "adapter switches, no Lightning strategy names registered without an import of "
        "`fastpersist.integrations.lightning`).",
        default="on",
    ),
    EnvVar(
        "FASTPERSIST_FAULT", None, _parse_fault, "op:nth:action[:count]",
        "Tests only: inject a fault into the native I/O layer, e.g. `write:3:EIO`, "
        "`write:2:short`, `read:1:eintr:5`, `fsync:1:ENOSPC`. Read once, when the native "
        "module is imported.",
        default="unset",
    ),
    EnvVar(
        "FASTPERSIST_COPY", None, _parse_copy, "stream or plain",
        "Diagnostics: how the native code copies bulk bytes (into staging buffers for saves and "
        "async snapshots, out of them for staged loads). `stream` (default): the CRC-32 of each "
        "256 KiB step of the source first, then the copy with non-temporal stores on x86-64 "
        "(copies of 256 KiB or more), which skip reading the destination's cache lines and leave "
        "the caches to the training; `plain`: memcpy, then the CRC-32 of the copy. On the reference "
        "VM `stream` took 20% less CPU per 1 GiB save and made the async snapshot call 1.4-1.9x "
        "shorter (docs/benchmarks.md, \"Where the time goes\"). Read once, when the native module is imported.",
        default="stream",
    ),
    EnvVar(
        "FASTPERSIST_LOAD_HUGE_PAGES", None, _parse_huge_pages, "on, off or auto",
        "Page size of the new CPU buffers a load returns its tensors in (fastpersist/prefault.py; "
        "docs/loading.md). `auto`: 2 MiB transparent huge pages, except in a guest that reports "
        "free memory to its hypervisor (virtio-balloon free page reporting, Hyper-V's balloon), "
        "where each buffer takes huge pages only as far as memory was freed in blocks of 2 MiB and "
        "more within the last half second, and 4 KiB pages otherwise (a fresh huge page there "
        "faults in on the host 4 KiB at a time). `on`/`off`: every buffer; `off` also gives the "
        "native staging buffers 4 KiB pages. `fastpersist info` prints the rule. Read once per process.",
        default="auto",
    ),
    # -- asynchronous saves (fastpersist.asyncsave) --
    EnvVar(
        "FASTPERSIST_ASYNC_STAGING_LIMIT", "async_staging_limit", parse_size, "size (1G, 512M, ...)",
        "Page-locked host memory for `fastpersist.save_async`: snapshot saves copy the state into "
        "a pool of this many bytes (allocated on first use, reused by later saves, windows of at "
        "most 64M); a save larger than the pool, or one queued behind another, waits for earlier "
        "windows to reach the disk before copying more. Also the most a `lazy` save copies at call time.",
    ),
    EnvVar(
        "FASTPERSIST_ASYNC_NICE", "async_nice", _parse_int, "integer 0-19",
        "Nice value of the native threads that copy and write `fastpersist.save_async` saves in the "
        "background (0: the training's priority). Higher values make them yield the CPUs to the "
        "training; copies the training waits for (inside the call, in the lazy guard) stay at full "
        "priority. On a 2-vCPU VM shared with other work, 10 did not shorten the guard's wait.",
    ),
    # -- object storage (fastpersist.objectstore) --
    EnvVar(
        "FASTPERSIST_S3_THREADS", "s3_threads", _parse_int, "integer >= 1",
        "Requests in flight per transfer to or from an `s3://` URL: parts of a save's multipart "
        "upload, ranged GETs of a load or verify (docs/objectstore.md).",
    ),
    EnvVar(
        "FASTPERSIST_S3_PART_SIZE", "s3_part_size", parse_size, "size (16M, 64M, ...)",
        "Bytes per part of an `s3://` save's multipart upload and per ranged GET of a load: at least "
        "5M (S3's minimum part), a multiple of 1M; grown for a file that would need more than "
        "10,000 parts (docs/objectstore.md).",
    ),
    EnvVar(
        "FASTPERSIST_S3_TIMEOUT", "s3_timeout", _parse_seconds, "seconds",
        "Seconds an `s3://` request may take to connect, and then may wait for each read from the "
        "store, before botocore retries it with backoff (a stalled store; docs/objectstore.md).",
    ),
    EnvVar(
        "FASTPERSIST_S3_LOCAL_DIR", "s3_local_dir", _parse_path, "directory",
        "Turns on the tiered mode of `s3://` URLs: a save to `s3://bucket/key` lands in "
        "`DIR/bucket/key` at local-disk speed and a background drain uploads it; "
        "`SaveFuture.wait_durable()`/`fastpersist.wait_durable()` say when the object is in the store; "
        "loads read the local copy when it is there and checks out, else the object "
        "(docs/objectstore.md, \"Tiered mode\"). Unset: direct mode.",
        default="unset",
    ),
    EnvVar(
        "FASTPERSIST_S3_KEEP_LOCAL", "s3_keep_local", _parse_int, "integer >= 0",
        "Tiered mode: the newest N checkpoints of each `s3://bucket/prefix/` stay in the local "
        "directory; older ones are removed from it once they are durable in the store. 0 keeps all.",
    ),
    EnvVar(
        "FASTPERSIST_S3_KEEP_REMOTE", "s3_keep_remote", _parse_int, "integer >= 0",
        "Tiered mode: the newest N checkpoints of each `s3://bucket/prefix/` that the tier uploaded "
        "stay in the store; older ones are deleted (from both tiers). Objects the tier did not upload "
        "are never deleted. 0 keeps all.",
    ),
)


def _default_text(var: EnvVar) -> str:
    if var.default is not None:
        return var.default
    assert var.field is not None
    value = getattr(Config(), var.field)
    if isinstance(value, bool):
        return _bool_text(value)
    if var.field in ("chunk_size", "async_staging_limit", "s3_part_size"):
        return f"{_size_text(value)} ({value})"
    return str(value)


def markdown() -> str:
    """The documentation page of every ``FASTPERSIST_*`` variable (``docs/config.md``)."""
    lines = [
        "# Configuration",
        "",
        "<!-- Generated by `python -m fastpersist.config --markdown`; do not edit. -->",
        "",
        "fastpersist reads these environment variables. The `Config` fields are applied by",
        "`fastpersist.Config.from_env()`, which parses them each time it is called;",
        "`fastpersist.config.get_default()` calls it once and caches the result. An",
        "invalid value raises `ValueError` naming the variable and the value. Booleans",
        "accept `1/0`, `true/false`, `on/off`, `yes/no` in any case. An unset or empty",
        "variable keeps the default.",
        "",
        "In code, pass a `fastpersist.Config(...)` or change the default temporarily with",
        "`with fastpersist.config.override(threads=4): ...`.",
        "",
        "| Variable | Meaning | Default | Values | `Config` field |",
        "|---|---|---|---|---|",
    ]
    for var in ENV_VARS:
        field = f"`{var.field}`" if var.field else "(none)"
        lines.append(f"| `{var.name}` | {var.meaning} | {_default_text(var)} | {var.type} | {field} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# The process-wide default.

_lock = threading.RLock()
_default: Optional[Config] = None


def get_default() -> Config:
    """The default :class:`Config`: ``Config.from_env()`` on first use, then cached
    (or the value set by an enclosing :func:`override`)."""
    global _default
    with _lock:
        if _default is None:
            _default = Config.from_env()
        return _default


def resolve(config: Optional[Config]) -> Config:
    """``config``, or the default :class:`Config` when it is None (what every entry point
    does with its ``config=`` argument)."""
    return get_default() if config is None else config


def reset_default() -> None:
    """Forget the cached default; the next :func:`get_default` reads the environment again."""
    global _default
    with _lock:
        _default = None


@contextlib.contextmanager
def override(**changes: Any) -> Iterator[Config]:
    """Temporarily replace the default configuration (process-wide, not per thread).

    ``with override(fsync=False) as cfg: ...`` makes :func:`get_default` return
    ``cfg`` inside the block and restores the previous default on exit. Nests.
    """
    global _default
    with _lock:
        previous = _default
        new = get_default().replace(**changes)
        _default = new
    try:
        yield new
    finally:
        with _lock:
            _default = previous


def _main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastpersist.config", description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the documentation page of every variable")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown())
    else:
        cfg = Config.from_env()
        for f in dataclasses.fields(cfg):
            print(f"{f.name} = {getattr(cfg, f.name)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
