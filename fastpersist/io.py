"""Low-level I/O for tensors: an engine handle, pinned host tensors, byte views.

This is the layer ``fastpersist.save``/``load`` are built on, offered for code
that manages its own files (offloading, swapping, custom formats)::

    import torch
    from fastpersist.io import IOHandle, pinned_empty

    buf = pinned_empty(1 << 20)                 # page-aligned, page-locked
    buf.copy_(torch.arange(1 << 20, dtype=torch.uint8))
    h = IOHandle()                              # engine="auto": pread/pwrite threads
    h.pwrite(buf, "/data/blob.bin")             # O_DIRECT when the filesystem allows
    out = torch.empty_like(buf)
    h.async_pread(out, "/data/blob.bin")        # returns at once
    assert h.wait() == 1 and torch.equal(out, buf)

It mirrors DeepSpeed's DeepNVMe ``aio_handle`` (``sync_pwrite``,
``async_pread``, ``wait``, ``new_cpu_locked_tensor``, ...) and adds what that
lacks: any file offset and size (only the file's tail may be unaligned; the
engine stages through aligned buffers), every dtype, CPU-only machines, and
errors that raise the right ``OSError`` with the path and offset.

Errors: I/O failures raise ``OSError`` subclasses chosen from errno
(``FileNotFoundError``, ``PermissionError``, ``OSError(ENOSPC)``, ...) with
``.filename`` set to the path and the file offset in the message; reading past
the end of a file raises ``EOFError``; bad arguments raise ``ValueError``.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from fastpersist import config as config_mod
from fastpersist import prefault

try:
    import fastpersist._native as _native
except ModuleNotFoundError as _exc:
    # Not built (e.g. a source checkout): as_bytes works, I/O raises ImportError.
    # A build that is present but fails to load (or a bad FASTPERSIST_FAULT)
    # raises right here instead.
    if _exc.name != "fastpersist._native":
        raise
    _native = None
    _NATIVE_IMPORT_ERROR: Optional[ImportError] = _exc
else:
    _NATIVE_IMPORT_ERROR = None

__all__ = [
    "IOHandle",
    "PinningWarning",
    "alignment_of",
    "as_bytes",
    "available_engines",
    "cufile_status",
    "direct_io_supported",
    "gpu_path",
    "is_page_locked",
    "pinned_empty",
]

#: A file path, or an open file descriptor (never closed by fastpersist).
PathOrFd = Union[str, bytes, "os.PathLike[str]", int]

PAGE_SIZE = 4096


class PinningWarning(UserWarning):
    """Host memory could not be page-locked (or CUDA-registered) as requested."""


_staging_pages_set = False


def native_module() -> Any:
    """The compiled extension, or an ImportError that says how to get it.

    The first call gives the native staging buffers (the rings that saves and staged
    loads copy through) their page size: :func:`fastpersist.prefault.staging_huge_pages`."""
    global _staging_pages_set
    if _native is None:
        raise ImportError(
            "fastpersist's native extension (fastpersist._native) is not built "
            f"({_NATIVE_IMPORT_ERROR}); reinstall with `pip install -e .` on a machine "
            "with a C++17 compiler"
        ) from _NATIVE_IMPORT_ERROR
    if not _staging_pages_set:
        _native.set_staging_huge_pages(prefault.staging_huge_pages())
        _staging_pages_set = True
    return _native


# ---- fork safety ------------------------------------------------------------------

#: Every live IOHandle, so a forked child can reset their Python-side state.
_live_handles: "weakref.WeakSet[IOHandle]" = weakref.WeakSet()


def _reset_handles_in_child() -> None:
    """``os.register_at_fork(after_in_child=...)``: make inherited IOHandles usable.

    The native handle rebuilds its threads on first use in the child (see
    ``_native.pyi``). Here: a fresh lock (a parent thread may have held the old one
    at the fork), and the parent's uncollected async ops are forgotten (their bytes
    move in the parent's memory only; the child's ``wait()`` raises RuntimeError
    once to say so).
    """
    for h in list(_live_handles):
        h._lock = threading.Lock()
        h._ops = {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_handles_in_child)


# ---- engine and filesystem facts --------------------------------------------------


def available_engines() -> list[str]:
    """Engines usable on this machine now: some of ``"aio"``, ``"psync"``, ``"cufile"``.

    ``"cufile"`` appears only when libcufile loads and its driver opens.
    """
    return list(native_module().available_engines())


def cufile_status() -> str:
    """``"available"``, or the reason GPUDirect Storage (cuFile) cannot be used here."""
    return str(native_module().cufile_status())


@dataclass(frozen=True)
class GpuPath:
    """How CUDA tensors move between device memory and files of one directory
    (:func:`gpu_path`): ``save``/``load`` are ``"cufile"`` (GPUDirect Storage, device
    memory <-> disk), ``"pinned"`` (through page-locked host windows, D2H/H2D on a
    side stream) or ``"none"`` (no CUDA device), each with the reason."""

    save: str
    save_reason: str
    load: str
    load_reason: str

    def lines(self) -> list[str]:
        """Two lines for ``fastpersist info``."""
        return [f"GPU save   : {self.save} ({self.save_reason})", f"GPU load   : {self.load} ({self.load_reason})"]


def gpu_path(directory: Union[str, "os.PathLike[str]"], *, engine: str = "auto", checksum: bool = True) -> GpuPath:
    """Which path CUDA tensors take to and from files in ``directory``, and why.

    Saves always stage through page-locked windows: the file's CRC-32 fields are
    computed from host bytes, which a GPUDirect write never has. Loads read with
    cuFile straight into device memory when cuFile is available (``engine`` ``"auto"``
    or ``"cufile"``), the filesystem takes O_DIRECT and checksums are off; otherwise
    through the pinned ring, where CRC-32s are checked. Never initialises CUDA
    (``torch.cuda.is_available()`` and the cuFile probe do not).
    """
    if not torch.cuda.is_available():
        why = "no CUDA device (torch.cuda.is_available() is False)"
        return GpuPath("none", why, "none", why)
    if engine not in ("auto", "cufile"):
        why = f"engine={engine!r}: device bytes go through page-locked host windows"
        return GpuPath("pinned", why, "pinned", why)
    save_why = "the file's CRC-32s are computed from host bytes; GPUDirect writes are not used for saves"
    status = cufile_status()
    if status != "available":
        why = f"cuFile unavailable: {status}"
        return GpuPath("pinned", f"{why}; {save_why}", "pinned", why)
    if not direct_io_supported(directory):
        why = "the filesystem refuses O_DIRECT, which cuFile needs"
        return GpuPath("pinned", save_why, "pinned", why)
    if checksum:
        return GpuPath("pinned", save_why, "pinned",
                       "checksums on (Config.checksum): CRC-32s are checked from host bytes; cuFile reads need checksum=False")
    return GpuPath("pinned", save_why, "cufile", "cuFile available, O_DIRECT filesystem, checksums off")


def require_cufile(directory: Union[str, "os.PathLike[str]"], what: str, *, checksum: bool = True) -> None:
    """``engine="cufile"`` fails loudly: raise RuntimeError naming why ``what`` (``"save"``
    or ``"load"``) of CUDA tensors in ``directory`` cannot go through cuFile."""
    p = gpu_path(directory, engine="cufile", checksum=checksum)
    way, why = (p.save, p.save_reason) if what == "save" else (p.load, p.load_reason)
    if way != "cufile":
        raise RuntimeError(f"fastpersist: engine='cufile' cannot {what} CUDA tensors in {os.fspath(directory)!r}: {why}; "
                           "use engine='auto' (pinned staging)")


def alignment_of(path: Union[str, "os.PathLike[str]"]) -> int:
    """O_DIRECT alignment in bytes for files at ``path`` (a file or a directory).

    The device's logical block size (statx DIO alignment where the kernel reports
    it), never below 4096.
    """
    return int(native_module().alignment_of(os.fspath(path)))


def direct_io_supported(path: Union[str, "os.PathLike[str]"]) -> bool:
    """Whether the filesystem holding ``path`` (a file or a directory) accepts O_DIRECT."""
    return bool(native_module().direct_io_supported(os.fspath(path)))


# ---- pinned host tensors ----------------------------------------------------------


def _shape_of(size: Union[int, Sequence[int], torch.Size]) -> tuple[int, ...]:
    shape = (size,) if isinstance(size, int) else tuple(size)
    if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
        raise ValueError(f"pinned_empty: size must be non-negative ints, got {size!r}")
    return shape


def pinned_empty(
    size: Union[int, Sequence[int], torch.Size],
    dtype: torch.dtype = torch.uint8,
    *,
    register_cuda: Optional[bool] = None,
    alignment: int = PAGE_SIZE,
) -> torch.Tensor:
    """An uninitialised host tensor in page-aligned, page-locked memory.

    Unlike ``torch.empty(..., pin_memory=True)`` this works with CPU-only torch:
    the memory is ``mlock``-ed (so the kernel never pages it out and O_DIRECT
    transfers need no bounce copies), aligned to ``alignment`` bytes (a power of
    two, at least 4096) so it can be handed to O_DIRECT directly, and, when
    ``register_cuda`` is true (default: ``torch.cuda.is_available()``),
    registered with CUDA (``cudaHostRegister``) so device copies to and from it
    are fast and asynchronous.

    The memory belongs to the returned tensor: it is unregistered, unlocked and
    freed when the tensor and every view of it are gone.

    If the memory cannot be locked (``RLIMIT_MEMLOCK``, see ``ulimit -l``), the
    tensor is still returned, page-aligned but pageable, and a
    :class:`PinningWarning` says so; :func:`is_page_locked` tells which you got.
    With ``register_cuda=True`` a failed CUDA registration raises RuntimeError
    (with the default it only warns). A tensor of 0 bytes has no memory at all.
    """
    shape = _shape_of(size)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    buf = native_module().PinnedBuffer(nbytes, alignment, True)
    if not buf.locked:
        warnings.warn(
            f"fastpersist: could not page-lock {nbytes} bytes (mlock failed; RLIMIT_MEMLOCK is "
            f"{_memlock_limit_text()}); using page-aligned pageable memory. Raise the limit "
            "(`ulimit -l`, or memlock in /etc/security/limits.conf) for pinned buffers.",
            PinningWarning,
            stacklevel=2,
        )
    want_cuda = torch.cuda.is_available() if register_cuda is None else register_cuda
    if want_cuda and not buf.cuda_registered and not buf.cuda_register():
        message = (
            f"fastpersist: cudaHostRegister of {nbytes} bytes failed (no CUDA runtime loaded in "
            "this process?); device copies from this tensor will be synchronous"
        )
        if register_cuda:
            raise RuntimeError(message)
        warnings.warn(message, PinningWarning, stacklevel=2)
    flat = torch.frombuffer(buf, dtype=torch.uint8)  # holds a reference to buf
    return flat.view(dtype).reshape(shape)


def _memlock_limit_text() -> str:
    try:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ImportError, OSError, ValueError):
        return "unknown"
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"


def _locked_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process's VMAs flagged ``lo`` (VM_LOCKED) in smaps."""
    ranges: list[tuple[int, int]] = []
    start = end = 0
    with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
        for line in f:
            head, _, rest = line.partition(" ")
            if head == "VmFlags:":
                if "lo" in rest.split():
                    ranges.append((start, end))
            elif "-" in head and not head.endswith(":"):  # "start-end perms offset dev inode path"
                lo, hi = head.split("-", 1)
                start, end = int(lo, 16), int(hi, 16)
    return ranges


def is_page_locked(tensor: torch.Tensor) -> bool:
    """Whether every page of ``tensor``'s bytes is locked in RAM.

    True for CUDA-pinned host memory (``tensor.is_pinned()``, which covers
    ``cudaHostAlloc`` and ``cudaHostRegister``), and for memory whose mappings the
    kernel reports as ``mlock``-ed: the VmFlags ``lo`` bit of
    ``/proc/self/smaps`` (Linux), which is what :func:`pinned_empty` produces on
    CPU-only machines. A tensor with no bytes is trivially locked; a CUDA tensor
    is not host memory and gives False.
    """
    if tensor.device.type != "cpu":
        return False
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return True
    try:
        if torch.cuda.is_available() and tensor.is_pinned():
            return True
    except RuntimeError:
        pass
    lo = tensor.data_ptr()
    hi = lo + nbytes
    try:
        ranges = _locked_ranges()
    except OSError:
        return False
    for start, end in sorted(ranges):  # adjacent locked VMAs may split one buffer
        if start <= lo < end:
            lo = end
            if lo >= hi:
                return True
    return False


# ---- byte views -----------------------------------------------------------------


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A zero-copy 1-D ``torch.uint8`` view of ``tensor``'s bytes, for any dtype.

    Works for bool, complex, bfloat16, float8, 0-d and empty tensors, on any
    device (a CUDA tensor gives a CUDA view). The view shares storage with
    ``tensor`` (writes through it change ``tensor``) and keeps it alive. Bytes
    are in memory order, i.e. what ``tensor.numpy().tobytes()`` gives for dtypes
    numpy knows.

    Raises ValueError for non-contiguous tensors (call ``.contiguous()`` first),
    for tensors with a pending lazy conjugation/negation (call
    ``.resolve_conj()`` / ``.resolve_neg()``) and for non-strided layouts.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"as_bytes expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"as_bytes needs a dense (strided) tensor, got layout {tensor.layout}")
    if not tensor.is_contiguous():
        raise ValueError(
            f"as_bytes needs a contiguous tensor, got shape {tuple(tensor.shape)} with strides "
            f"{tensor.stride()}; call .contiguous() first"
        )
    if tensor.is_conj() or tensor.is_neg():
        raise ValueError(
            "as_bytes: tensor has a lazy conjugate/negative bit, so its memory differs from its "
            "values; call .resolve_conj() / .resolve_neg() first"
        )
    itemsize = tensor.element_size()
    nbytes = tensor.numel() * itemsize
    out = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    with torch.no_grad():
        out.set_(tensor.untyped_storage(), tensor.storage_offset() * itemsize, (nbytes,), (1,))
    return out


# ---- the handle -----------------------------------------------------------------


def _target(path_or_fd: PathOrFd) -> Union[str, int]:
    if isinstance(path_or_fd, bool):
        raise TypeError("path_or_fd must be a path or a file descriptor, not a bool")
    if isinstance(path_or_fd, int):
        if path_or_fd < 0:
            raise ValueError(f"invalid file descriptor {path_or_fd}")
        return path_or_fd
    if isinstance(path_or_fd, (str, bytes, os.PathLike)):
        return os.fsdecode(path_or_fd)
    raise TypeError(
        f"path_or_fd must be a str, os.PathLike or an int fd, got {type(path_or_fd).__name__}"
    )


def _check_offset(file_offset: int) -> int:
    if isinstance(file_offset, bool) or not isinstance(file_offset, int) or file_offset < 0:
        raise ValueError(f"file_offset must be a non-negative int, got {file_offset!r}")
    return file_offset


def _check_positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


@dataclass
class _Op:
    """What an in-flight async op needs until wait(): references and a finisher."""

    keepalive: tuple[Any, ...]
    finish: Optional[Callable[[], Any]] = None


class IOHandle:
    """Reads and writes tensors to files at disk speed; sync or async.

    Args:
        engine: ``"auto"`` (positional I/O threads, the fastest in our measurements),
            ``"aio"``, ``"psync"`` or ``"cufile"`` (GPUDirect Storage; needs
            :func:`available_engines` to list it).
        block_size: bytes per I/O (a multiple of 4096); also the size of each
            aligned staging buffer.
        queue_depth: I/Os in flight per operation (and staging buffers in the ring).
        threads: worker threads per operation (memcpy into staging buffers, and
            the I/O threads of ``"psync"``).
        direct: use O_DIRECT where the filesystem accepts it; where it refuses
            (tmpfs, some network filesystems) the engine falls back to buffered I/O.
        max_async: async operations executed concurrently; later ones queue.
        stage_reads: reads land in a staging buffer and are copied out, even when
            they could go straight into the destination (see
            :attr:`fastpersist.Config.read_staging`; :meth:`from_config` resolves it).

    Files: a path given to :meth:`pwrite` is opened with ``O_CREAT | O_TRUNC``,
    i.e. **truncated** first, unless ``truncate=False`` (then it is created if
    missing and otherwise kept, so several pwrites at different offsets build one
    file; the DeepNVMe-named :meth:`sync_pwrite` / :meth:`async_pwrite` never
    truncate). A file descriptor is used as is: never truncated, never closed.

    CPU tensors go to the engine as they are (it stages through its aligned
    buffers what O_DIRECT cannot take directly). CUDA tensors go straight from
    device memory with the ``"cufile"`` engine (which takes CUDA tensors only);
    with any other engine they are staged through a pinned host tensor
    (device-to-host copy on the current stream, then write; read, then
    host-to-device copy in :meth:`wait`, or at once for a synchronous read).

    The handle keeps every tensor of an async operation alive until
    :meth:`wait`; don't modify a tensor while its write is pending. It is safe to
    use from several threads.
    """

    def __init__(
        self,
        engine: str = "auto",
        block_size: int = 8 << 20,
        queue_depth: int = 8,
        threads: int = 2,
        direct: bool = True,
        *,
        max_async: int = 2,
        stage_reads: bool = False,
    ) -> None:
        _check_positive_int("queue_depth", queue_depth)
        _check_positive_int("threads", threads)
        _check_positive_int("max_async", max_async)
        if _check_positive_int("block_size", block_size) % PAGE_SIZE:
            raise ValueError(f"block_size must be a multiple of 4096, got {block_size}")
        self._ops: dict[int, _Op] = {}
        self._lock = threading.Lock()
        self._locked_tensors: dict[int, torch.Tensor] = {}
        self._h = native_module().Handle(
            engine=engine,
            chunk_size=block_size,
            queue_depth=queue_depth,
            threads=threads,
            direct=direct,
            max_async=max_async,
            stage_reads=stage_reads,
        )
        _live_handles.add(self)

    @classmethod
    def from_config(cls, config: Any = None) -> IOHandle:
        """A handle with the engine settings of a :class:`fastpersist.Config`
        (default: the one derived from ``FASTPERSIST_*`` environment variables)."""
        cfg = config_mod.resolve(config)
        kw = dict(cfg.handle_kwargs())
        kw["block_size"] = kw.pop("chunk_size")
        kw["stage_reads"] = cfg.stages_reads()
        return cls(**kw)

    # -- settings ------------------------------------------------------------------

    @property
    def engine(self) -> str:
        """The engine as requested (``"auto"`` stays ``"auto"``; see :attr:`last_engine`)."""
        return str(self._h.engine)

    @property
    def last_engine(self) -> str:
        """Engine that ran the last completed op: ``"aio"``, ``"psync"``, ``"psync-buffered"``..."""
        return str(self._h.last_engine)

    @property
    def stage_reads(self) -> bool:
        """Whether reads go through the staging buffers (copied out) instead of straight to their destination."""
        return bool(self._h.stage_reads)

    @property
    def block_size(self) -> int:
        """Bytes per I/O."""
        return int(self._h.chunk_size)

    @property
    def queue_depth(self) -> int:
        """I/Os in flight per operation."""
        return int(self._h.queue_depth)

    @property
    def threads(self) -> int:
        """Worker threads per operation."""
        return int(self._h.threads)

    @property
    def direct(self) -> bool:
        """Whether O_DIRECT is used where the filesystem allows it."""
        return bool(self._h.direct)

    def get_block_size(self) -> int:
        """DeepNVMe-style accessor for :attr:`block_size`."""
        return self.block_size

    def get_queue_depth(self) -> int:
        """DeepNVMe-style accessor for :attr:`queue_depth`."""
        return self.queue_depth

    def get_thread_count(self) -> int:
        """DeepNVMe-style accessor for :attr:`threads`."""
        return self.threads

    get_intra_op_parallelism = get_thread_count

    # -- I/O ---------------------------------------------------------------------

    def _needs_staging(self, op: str, data: torch.Tensor) -> bool:
        """Whether the byte view ``data`` must go through a pinned host copy."""
        kind = data.device.type
        if self.engine == "cufile":
            if kind != "cuda":
                raise ValueError(
                    f"{op}: the cufile engine moves CUDA memory; use an IOHandle with another "
                    f"engine for {kind} tensors"
                )
            return False
        if kind not in ("cpu", "cuda"):
            raise ValueError(f"{op}: tensors on {data.device} are not supported")
        return kind == "cuda"

    def _submit(self, submit: Callable[[], int], op: _Op) -> None:
        with self._lock:
            op_id = submit()
            self._ops[int(op_id)] = op

    def pwrite(
        self,
        tensor: torch.Tensor,
        path_or_fd: PathOrFd,
        file_offset: int = 0,
        async_: bool = False,
        truncate: bool = True,
        *,
        fsync: bool = False,
    ) -> int:
        """Write ``tensor``'s bytes to ``path_or_fd`` starting at ``file_offset``.

        Any contiguous tensor, any dtype, CPU or CUDA. A path is truncated first
        unless ``truncate=False``; a file descriptor is neither truncated nor
        closed. ``fsync=True`` flushes the file to stable storage before the
        write counts as done. With ``async_=True`` it returns at once and
        :meth:`wait` collects the result (and raises its error). Returns the
        number of bytes written (or submitted).
        """
        target = _target(path_or_fd)
        _check_offset(file_offset)
        data = as_bytes(tensor)
        keep: tuple[Any, ...] = (tensor, data)
        if self._needs_staging("pwrite", data):
            data = pinned_empty(data.numel()).copy_(data)  # device-to-host, synchronous
            keep += (data,)
        nbytes = data.numel()
        extents = [(file_offset, data.data_ptr(), nbytes, -1)] if nbytes else []
        if async_:
            self._submit(
                lambda: self._h.submit_write(target, extents, truncate=truncate, fsync=fsync),
                _Op(keep),
            )
        else:
            self._h.write(target, extents, truncate=truncate, fsync=fsync)
        return nbytes

    def pread(
        self,
        tensor: torch.Tensor,
        path_or_fd: PathOrFd,
        file_offset: int = 0,
        async_: bool = False,
    ) -> int:
        """Read ``tensor.nbytes`` bytes from ``path_or_fd`` at ``file_offset`` into ``tensor``.

        ``tensor`` must be contiguous (any dtype, CPU or CUDA). Raises EOFError if
        the file ends before the last byte. With ``async_=True`` it returns at once;
        the data is in ``tensor`` after :meth:`wait`. Returns the number of bytes.
        """
        target = _target(path_or_fd)
        _check_offset(file_offset)
        dest = as_bytes(tensor)
        keep: tuple[Any, ...] = (tensor, dest)
        buf, finish = dest, None
        if self._needs_staging("pread", dest):
            buf = pinned_empty(dest.numel())
            keep += (buf,)
            finish = functools.partial(dest.copy_, buf)  # host-to-device once the read is done
        nbytes = dest.numel()
        extents = [(file_offset, buf.data_ptr(), nbytes, -1)] if nbytes else []
        if async_:
            self._submit(lambda: self._h.submit_read(target, extents), _Op(keep, finish))
        else:
            self._h.read(target, extents)
            if finish is not None:
                finish()
        return nbytes

    def wait(self) -> int:
        """Block until every async operation has finished; return how many completed.

        If any failed, raises the first failure (an ``OSError`` naming path and
        offset, or ``EOFError``) after all have finished; the destinations of the
        reads collected by that call are then undefined. The handle stays usable.
        """
        with self._lock:
            try:
                done = self._h.wait()
            except BaseException:
                self._ops.clear()
                raise
            ops = [self._ops.pop(int(op_id), None) for op_id, _crcs in done]
        for op in ops:
            if op is not None and op.finish is not None:
                op.finish()
        return len(done)

    def pending(self) -> int:
        """Async operations submitted and not yet collected by :meth:`wait`."""
        return int(self._h.pending())

    # -- DeepNVMe-compatible names ------------------------------------------------

    def sync_pwrite(self, buffer: torch.Tensor, filename: PathOrFd, file_offset: int = 0) -> int:
        """Blocking write at ``file_offset`` (DeepNVMe name and semantics: the file
        is created if missing and **not** truncated)."""
        return self.pwrite(buffer, filename, file_offset, async_=False, truncate=False)

    def async_pwrite(self, buffer: torch.Tensor, filename: PathOrFd, file_offset: int = 0) -> int:
        """Asynchronous :meth:`sync_pwrite` (not truncating); collect with :meth:`wait`."""
        return self.pwrite(buffer, filename, file_offset, async_=True, truncate=False)

    def sync_pread(self, buffer: torch.Tensor, filename: PathOrFd, file_offset: int = 0) -> int:
        """``pread(buffer, filename, file_offset)``, blocking (DeepNVMe name)."""
        return self.pread(buffer, filename, file_offset, async_=False)

    def async_pread(self, buffer: torch.Tensor, filename: PathOrFd, file_offset: int = 0) -> int:
        """``pread(..., async_=True)`` (DeepNVMe name); collect with :meth:`wait`."""
        return self.pread(buffer, filename, file_offset, async_=True)

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """A 1-D pinned tensor of ``num_elem`` elements of ``example_tensor``'s dtype.

        The handle holds a reference until :meth:`free_cpu_locked_tensor` (DeepNVMe
        semantics); the memory goes when that and every other reference are gone.
        """
        t = pinned_empty(num_elem, example_tensor.dtype)
        self._locked_tensors[id(t)] = t
        return t

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """Drop the handle's reference to a tensor from :meth:`new_cpu_locked_tensor`.

        Returns False if it did not come from this handle (or was freed already).
        """
        return self._locked_tensors.pop(id(tensor), None) is not None

    # -- lifetime -------------------------------------------------------------------

    def __enter__(self) -> IOHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pending():
            if exc[0] is None:
                self.wait()
            else:  # don't mask the original exception
                try:
                    self.wait()
                except Exception:  # noqa: BLE001
                    pass

    def __del__(self) -> None:
        # Tensors of in-flight ops must outlive the I/O: finish it before they go.
        h = self.__dict__.get("_h")
        if h is not None and self._ops:
            try:
                h.wait()
            except Exception:  # noqa: BLE001 - nobody left to report to
                pass

    def __repr__(self) -> str:
        return (
            f"IOHandle(engine={self.engine!r}, block_size={self.block_size}, "
            f"queue_depth={self.queue_depth}, threads={self.threads}, direct={self.direct})"
        )


# ---- page-cache residency ----------------------------------------------------------


def cached_fraction(fd: int, size: int) -> Optional[float]:
    """Fraction of ``fd``'s first ``size`` bytes that are in the page cache (``mincore`` on
    a mapping of the file: starts no I/O), or None where that cannot be asked."""
    if size <= 0:
        return None
    try:
        import ctypes
        import ctypes.util
        import mmap as _mmap

        libc = libc_handle()
        if libc is None:
            return None
        pages = (size + PAGE_SIZE - 1) // PAGE_SIZE
        addr = libc.mmap(None, ctypes.c_size_t(size), _mmap.PROT_READ, _mmap.MAP_SHARED, fd, ctypes.c_long(0))
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
                return None
            return (pages - bytes(vec).count(0)) / pages  # bit 0: resident (the others are reserved)
        finally:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    except (OSError, AttributeError, ValueError):
        return None


@functools.lru_cache(maxsize=1)
def libc_handle() -> Any:
    """The C library through ctypes, with ``mmap``, ``munmap``, ``mincore`` and
    ``fstatfs`` typed; None where it cannot be found."""
    import ctypes

    try:
        # the process's own symbols, libc's among them (dlopen(NULL)); find_library("c")
        # runs ldconfig in a subprocess: 3-4 ms of a process's first load
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore  # noqa: B018 - present in every Linux C library
    except (OSError, AttributeError):
        return None
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
    return libc
