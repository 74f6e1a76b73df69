"""The read way of loads: chosen from what the filesystem, the file and the destination are.

``Config.read_mode="auto"`` (the default) reads a file one of three ways: O_DIRECT
straight into the destination buffers (``"zero-copy"``; fresh CPU buffers are faulted in
by a second thread meanwhile, :mod:`fastpersist.prefault`), O_DIRECT through the handle's
staging ring (``"staged"``) or through the page cache (``"buffered"``). The choice is a
function of facts that do not change from one load to the next (:func:`plan_read`):

1. where the filesystem is memory (tmpfs, ramfs), or remote (NFS, SMB, FUSE, Ceph,
   Lustre, GPFS, 9p, ...), or refuses O_DIRECT: buffered (the page cache *is* the
   data, or the client's cache and readahead are what make it fast);
2. a file at least :data:`CACHED_ENOUGH` in the page cache (``mincore``, no I/O): buffered,
   a copy from memory;
3. otherwise O_DIRECT, zero-copy when ``read_staging`` is ``"auto"`` (the fastest way
   on every disk measured once the destination is pre-faulted), else as the setting says.

The O_DIRECT reads of a load whose ``Config.read_queue_depth`` is None (the default)
keep :data:`SINGLE_QUEUE_DEPTH` requests in flight where the file's block device has one
hardware queue (a VM's virtio disk, a loop device, SATA), and
``Config.DEFAULT_READ_QUEUE_DEPTH`` elsewhere (NVMe's many queues; stacked, network or
unknown devices); :func:`hardware_queues`. A device with one queue serves requests one
after another, so more in flight read no faster there; measured on a RAM disk (a loop
device), they ran ahead of the thread that faults the new buffers in and collided with it
(depth 16 was the faster without that thread, depth 2 with it; docs/loading.md).

Nothing is learned from earlier loads: a load's speed depends on what else runs on
the machine, and a choice learned from it followed the noise. Explicit ``read_mode``
values (``"direct"``, ``"buffered"``) and ``read_queue_depth`` values are obeyed as they are.

The readers a plan asks for are kept in a small pool per setting (:func:`borrow_reader`,
:func:`give_back_reader`), so a load does not start a native handle's threads.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import threading
from dataclasses import dataclass
from typing import Any, Optional, Union

from fastpersist import io
from fastpersist.idlepool import IdlePool

__all__ = [
    "CACHED_ENOUGH",
    "FsFacts",
    "ReadPlan",
    "SINGLE_QUEUE_DEPTH",
    "borrow_reader",
    "depth_auto",
    "describe_dir",
    "filesystem_facts",
    "give_back_reader",
    "hardware_queues",
    "mark_depth_auto",
    "mark_staging_auto",
    "plan_read",
    "staging_auto",
]

#: A file at least this much in the page cache is read buffered by ``read_mode="auto"``.
CACHED_ENOUGH = 0.9

#: O_DIRECT reads in flight on a block device with one hardware queue (``read_queue_depth`` None).
SINGLE_QUEUE_DEPTH = 2

_SYSFS = "/sys"  # tests point it at a tree of their own

# statfs(2) f_type magic numbers (linux/magic.h and the filesystems' own headers).
_MEMORY_FS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}
_REMOTE_FS = {
    0x6969: "nfs", 0x517B: "smb", 0xFF534D42: "cifs", 0xFE534D42: "smb2", 0x65735546: "fuse",
    0x00C36400: "ceph", 0x0BD00BD0: "lustre", 0x47504653: "gpfs", 0x01021997: "9p",
    0x564C: "ncp", 0x73757245: "coda", 0x5346414F: "afs", 0x6B414653: "afs",
}
_LOCAL_FS = {
    0xEF53: "ext2/3/4", 0x58465342: "xfs", 0x9123683E: "btrfs", 0x2FC12FC1: "zfs",
    0xF2F52010: "f2fs", 0x4D44: "vfat", 0x2011BAB0: "exfat", 0x5346544E: "ntfs",
    0x794C7630: "overlay", 0x3153464A: "jfs", 0x52654973: "reiserfs", 0xCA451A4E: "bcachefs",
}


@dataclass(frozen=True)
class FsFacts:
    """What a filesystem is, as far as the read way goes (:func:`filesystem_facts`)."""

    name: str  #: ``"ext2/3/4"``, ``"xfs"``, ``"tmpfs"``, ``"nfs"``, ... or ``"0x<magic>"``
    kind: str  #: ``"memory"``, ``"remote"`` or ``"local"`` (unknown filesystems count as local)
    direct: bool  #: O_DIRECT opens succeed there
    #: hardware queues of the block device holding the filesystem (:func:`hardware_queues`; None: not one device)
    queues: Optional[int] = None


@dataclass(frozen=True)
class ReadPlan:
    """How one load reads its file (:func:`plan_read`)."""

    mode: str  #: ``"direct"`` or ``"buffered"``
    direct: bool  #: open the handle with O_DIRECT
    stage: bool  #: O_DIRECT reads through the staging ring
    why: str  #: ``"configured"``, ``"memory-fs"``, ``"remote-fs"``, ``"no-direct"``, ``"cached"``, ``"disk"``
    reason: str = ""  #: the same, in a sentence (``fastpersist info``)
    depth: Optional[int] = None  #: requests in flight chosen for the device (None: the handle's ``queue_depth``)

    def fits(self, handle: Any) -> bool:
        """Whether ``handle`` itself reads the way this plan says (no other reader needed)."""
        return (self.direct == handle.direct and self.stage == handle.stage_reads
                and (self.depth is None or self.depth == handle.queue_depth))

    @property
    def arm(self) -> str:
        """The way this plan reads: ``"zero-copy"``, ``"staged"`` or ``"buffered"``."""
        if not self.direct:
            return "buffered"
        return "staged" if self.stage else "zero-copy"


# ---- facts ------------------------------------------------------------------------

_facts: dict[int, FsFacts] = {}  # st_dev -> facts (a filesystem's type does not change while mounted)
_facts_lock = threading.Lock()


def _fs_magic(fd: int) -> Optional[int]:
    """``fstatfs(fd).f_type``, or None where it cannot be asked (f_type is the first
    field of ``struct statfs`` on every Linux ABI: a word)."""
    libc = io.libc_handle()
    if libc is None:
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    try:
        if libc.fstatfs(fd, buf) != 0:
            return None
    except AttributeError:
        return None
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF


def _opens_direct(fd: int) -> bool:
    """Whether the file open as ``fd`` can be opened again with O_DIRECT."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        probe = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        return False
    os.close(probe)
    return True


def filesystem_facts(target: Union[int, str, "os.PathLike[str]"]) -> FsFacts:
    """The filesystem holding ``target`` (an open file descriptor, a file or a directory):
    its type from ``statfs`` and whether it takes O_DIRECT. Kept per device for the life
    of the process."""
    own = not isinstance(target, int)
    fd = os.open(os.fspath(target), os.O_RDONLY | os.O_CLOEXEC) if own else int(target)  # type: ignore[arg-type]
    try:
        dev = os.fstat(fd).st_dev
        with _facts_lock:
            hit = _facts.get(dev)
        if hit is not None:
            return hit
        magic = _fs_magic(fd)
        if magic in _MEMORY_FS:
            name, kind = _MEMORY_FS[magic], "memory"
        elif magic in _REMOTE_FS:
            name, kind = _REMOTE_FS[magic], "remote"
        else:
            name = "unknown" if magic is None else _LOCAL_FS.get(magic, f"0x{magic:x}")
            kind = "local"
        if own and os.path.isdir(target):  # type: ignore[arg-type]
            try:
                direct = io.direct_io_supported(target)  # type: ignore[arg-type]
            except (ImportError, OSError):
                direct = False
        else:
            direct = _opens_direct(fd)
        facts = FsFacts(name, kind, direct, hardware_queues(dev) if kind == "local" else None)
        with _facts_lock:
            _facts[dev] = facts
        return facts
    finally:
        if own:
            os.close(fd)


def hardware_queues(dev: int) -> Optional[int]:
    """The number of hardware queues (blk-mq) of the block device ``dev`` (an ``st_dev``;
    a partition counts as its disk), from ``/sys/dev/block/MAJOR:MINOR/mq``; None where
    ``dev`` is not one such device (btrfs, overlay and other anonymous devices, device
    mapper and md stacks, a sysfs without the entry)."""
    node = os.path.join(_SYSFS, "dev", "block", f"{os.major(dev)}:{os.minor(dev)}")
    try:
        node = os.path.realpath(node, strict=True)
        if os.path.exists(os.path.join(node, "partition")):
            node = os.path.dirname(node)
        queues = [e for e in os.listdir(os.path.join(node, "mq")) if e.isdigit()]
    except OSError:
        return None
    return len(queues) or None


def forget_facts() -> None:
    """Drop the filesystem facts kept so far (tests; a remount)."""
    with _facts_lock:
        _facts.clear()


# ---- the staging setting of a handle ------------------------------------------------

# Native handles whose staging was left to ``read_mode="auto"`` (``Config.read_staging``
# "auto"): ids of the handles fastpersist.handles caches for the life of the process.
_staging_auto: set[int] = set()


def mark_staging_auto(handle: Any) -> None:
    """Let :func:`plan_read` choose staged or zero-copy O_DIRECT reads for ``handle``
    (a handle made for a config whose ``read_staging`` is ``"auto"``, kept alive by its creator)."""
    _staging_auto.add(id(handle))


def staging_auto(handle: Any) -> bool:
    """Whether :func:`mark_staging_auto` was called for ``handle``."""
    return id(handle) in _staging_auto


# Native handles whose read queue depth was left to the device (``Config.read_queue_depth`` None).
_depth_auto: set[int] = set()


def mark_depth_auto(handle: Any) -> None:
    """Let :func:`plan_read` choose the O_DIRECT read depth for ``handle`` from the device
    (a handle made for a config whose ``read_queue_depth`` is None, kept alive by its creator)."""
    _depth_auto.add(id(handle))


def depth_auto(handle: Any) -> bool:
    """Whether :func:`mark_depth_auto` was called for ``handle``."""
    return id(handle) in _depth_auto


def _device_depth(facts: FsFacts) -> Optional[int]:
    """The O_DIRECT read depth the device calls for (None: the handle's own)."""
    return SINGLE_QUEUE_DEPTH if facts.queues == 1 else None


def _with_depth(plan: ReadPlan, facts: Optional[FsFacts], auto: bool) -> ReadPlan:
    """``plan`` with the device's depth where it reads O_DIRECT straight into its destination."""
    if not auto or facts is None or not plan.direct or plan.stage:
        return plan
    depth = _device_depth(facts)
    if depth is None:
        return plan
    return dataclasses.replace(plan, depth=depth, reason=(
        f"{plan.reason}; {depth} reads in flight (the device has one hardware queue)"))


# ---- the plan -----------------------------------------------------------------------


def _configured(read_mode: str, direct: bool, stage: bool) -> Optional[ReadPlan]:
    if not direct:
        return ReadPlan("buffered", False, False, "configured", "direct=False: every read goes through the page cache")
    if read_mode == "buffered":
        return ReadPlan("buffered", False, False, "configured", "read_mode='buffered'")
    if read_mode != "auto":
        return ReadPlan("direct", True, stage, "configured",
                        f"read_mode={read_mode!r}, {'staged' if stage else 'zero-copy'} (read_staging)")
    return None


def _by_filesystem(facts: FsFacts) -> Optional[ReadPlan]:
    if facts.kind == "memory":
        return ReadPlan("buffered", False, False, "memory-fs",
                        f"the filesystem is memory ({facts.name}): a buffered read is one copy from it")
    if facts.kind == "remote":
        return ReadPlan("buffered", False, False, "remote-fs",
                        f"a network filesystem ({facts.name}): reads go through its client's cache and readahead")
    if not facts.direct:
        return ReadPlan("buffered", False, False, "no-direct", f"the filesystem ({facts.name}) refuses O_DIRECT")
    return None


def _direct(facts: FsFacts, stage: bool, stage_auto: bool) -> ReadPlan:
    if stage_auto or not stage:
        return ReadPlan("direct", True, False, "disk",
                        f"a cold file on a local disk ({facts.name}): O_DIRECT straight into the destination, "
                        "fresh buffers pre-faulted by a second thread")
    return ReadPlan("direct", True, True, "disk",
                    f"a cold file on a local disk ({facts.name}): O_DIRECT through the staging ring (read_staging='on')")


def plan_read(fd: int, nbytes: int, *, read_mode: str, direct: bool, stage: bool,
              stage_auto: bool = False, into_existing: bool = False, depth_auto: bool = False) -> ReadPlan:
    """How a load of ``nbytes`` from ``fd`` reads (see :attr:`fastpersist.Config.read_mode`).

    ``direct``/``stage``: the handle's settings (``direct=False``: always buffered).
    ``read_mode``: ``"direct"`` and ``"buffered"`` are obeyed. ``"auto"``: buffered on a
    memory, network or no-O_DIRECT filesystem and for a file at least
    :data:`CACHED_ENOUGH` in the page cache; otherwise O_DIRECT, zero-copy when
    ``stage_auto`` (the handle's ``read_staging`` is ``"auto"``) or the handle does not
    stage, through the staging ring when ``read_staging`` is ``"on"``. ``into_existing``
    (the destination is memory in use: ``load_state_dict``) chooses the same way: the
    engine stages the pieces that are not aligned like the file by itself. ``nbytes``
    does not change the choice. ``depth_auto`` (the handle's ``read_queue_depth`` is
    None): an O_DIRECT plan that reads straight into its destination takes the depth
    the device calls for (:data:`SINGLE_QUEUE_DEPTH` on one hardware queue) in
    :attr:`ReadPlan.depth`. Deterministic: the same file, filesystem and settings
    give the same plan, whatever earlier loads measured.
    """
    del nbytes, into_existing  # the same way for every size and destination (see the docstring)
    try:
        facts: Optional[FsFacts] = filesystem_facts(fd)
    except OSError:
        facts = None
    fixed = _configured(read_mode, direct, stage)
    if fixed is not None:
        return _with_depth(fixed, facts, depth_auto)
    if facts is None:
        facts = FsFacts("unknown", "local", True)
    plan = _by_filesystem(facts)
    if plan is not None:
        return plan
    try:
        size = os.fstat(fd).st_size
    except OSError:
        size = 0
    cached = io.cached_fraction(fd, size)
    if cached is not None and cached >= CACHED_ENOUGH:
        return ReadPlan("buffered", False, False, "cached",
                        f"{cached:.0%} of the file is in the page cache: a buffered read is a copy from memory")
    return _with_depth(_direct(facts, stage, stage_auto), facts, depth_auto)


def describe_dir(directory: Union[str, "os.PathLike[str]"], config: Any) -> ReadPlan:
    """The plan a load of a cold file in ``directory`` gets with ``config`` (a
    :class:`~fastpersist.config.Config`), for ``fastpersist info --dir``."""
    auto = config.read_queue_depth is None
    facts = filesystem_facts(directory)
    fixed = _configured(config.read_mode, config.direct, config.stages_reads())
    if fixed is not None:
        return _with_depth(fixed, facts, auto)
    plan = _by_filesystem(facts)
    if plan is not None:
        return plan
    plan = _with_depth(_direct(facts, config.stages_reads(), config.read_staging == "auto"), facts, auto)
    return dataclasses.replace(plan, reason=plan.reason + "; a file already in the page cache: buffered")


# ---- readers ----------------------------------------------------------------------

_POOL_MAX = 4  #: idle readers kept per setting
_readers: IdlePool[Any] = IdlePool(_POOL_MAX)  # emptied in a forked child and at exit (idlepool)


def _depth(handle: Any, plan: ReadPlan) -> int:
    return handle.queue_depth if plan.depth is None else plan.depth


def _reader_key(handle: Any, plan: ReadPlan) -> tuple:
    return (handle.engine, handle.chunk_size, _depth(handle, plan), handle.threads, plan.direct, plan.stage)


def borrow_reader(handle: Any, plan: ReadPlan) -> Any:
    """A native handle with ``handle``'s settings that reads the way ``plan`` says, for
    one load alone (two loads on two threads never collect each other's reads): an idle
    one from the pool, or a new one. Hand it back with :func:`give_back_reader` once its
    reads are collected; one not handed back is simply dropped."""
    idle = _readers.take(_reader_key(handle, plan))
    if idle is not None:
        return idle
    return io.native_module().Handle(handle.engine, handle.chunk_size, _depth(handle, plan), handle.threads,
                                     plan.direct, stage_reads=plan.stage)


def give_back_reader(reader: Any) -> None:
    """Return a reader from :func:`borrow_reader` to the pool (only when it has nothing
    pending; staged readers are not kept, so their ring does not stay resident)."""
    if reader.stage_reads or reader.pending():
        return
    # an idle reader keeps its threads and one bounce buffer (chunk_size: the unaligned head and tail
    # of the next load's pieces), not every buffer its last load used (a kept 64 MiB slice had 85 MiB
    # resident with all of them; a new buffer costs its first touch at every load)
    reader.trim_buffers(1)
    _readers.keep((reader.engine, reader.chunk_size, reader.queue_depth, reader.threads, reader.direct, False), reader)


def forget_readers() -> None:
    """Drop the idle readers (their threads end)."""
    _readers.clear()
