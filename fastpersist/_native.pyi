"""Typed stub of the private native module ``fastpersist._native`` (C++ core, nanobind).

The public, documented API lives in the pure-Python modules (``fastpersist.io``,
``fastpersist.api``); this module is the engine room they call.

Errors: every I/O failure raises an ``OSError`` subclass chosen from errno
(``FileNotFoundError``, ``PermissionError``, ``IsADirectoryError``, plain
``OSError`` for EIO/ENOSPC/...), with ``.errno`` set, ``.filename`` the path, and a
message naming the operation, file offset and length, e.g.
``[Errno 28] No space left on device: pwrite 'ckpt.pt' at offset 8388608, length 8388608``.
A read that hits end of file before the requested bytes raises ``EOFError`` with
path and offset in the message. Bad arguments raise ``ValueError``.

Extents
-------
A write or read is described by *extents*, tuples ``(file_offset, ptr, length, crc_slot)``:

* ``file_offset``: absolute byte offset in the file.
* ``ptr``: host address (int) of ``length`` bytes (``tensor.data_ptr()``,
  ``PinnedBuffer.ptr``, ...). For reads, ``ptr == 0`` means "read and discard"
  (useful with a crc slot to checksum a file range without keeping it).
* ``crc_slot``: ``-1`` for none, else an index ``0 <= slot < nslots``; the CRC-32
  (zlib/zip polynomial, same value as ``zlib.crc32``) of all extents that share
  a slot, concatenated in file order, is returned in the result list.

Write extents must be sorted by offset, must not overlap, and must cover the
byte range ``[extents[0].file_offset, last.file_offset + last.length)``
without gaps. Read extents must be sorted and must not overlap; gaps are allowed
(they are read and skipped when cheaper than a separate I/O).

Patches (writes only): tuples ``(file_offset, crc_slot, kind)``: the CRC-32 of
``crc_slot`` is stored at ``file_offset`` as ``kind`` 0: 4 bytes little-endian
(zip fields), or ``kind`` 1: 8 lowercase hex ASCII characters (JSON headers).
The bytes land in the staging buffer; the caller's memory is never modified.
A write of up to 32 MiB (engine ``auto`` or ``psync``) runs on the calling
thread: its CRCs are computed first, so every patch is known before any chunk
is written. Above that, a chunk holding a patch whose slot is not yet complete
(e.g. a header placed before the data it checksums) is held back in a copy of
its own, and written as soon as the slot completes. This is how zip CRC fields
(data descriptor, central directory) are filled in one pass at disk speed.

The caller keeps the memory behind every ``ptr`` alive and unchanged until the
call returns (sync) or the op is complete (async: ``wait()``/``wait_op()``
returned, or its ``Future`` is done).

Asynchronous ops and their completion
-------------------------------------
Two ways to submit, both run by the handle's ``max_async`` worker threads in
submission order (later ops queue), without the GIL:

* ``submit_write``/``submit_read`` return an op id. ``wait()`` collects *every*
  such op not collected yet; ``wait_op(op_id, timeout)`` collects one (its CRCs,
  or its own error) and ``done(op_id)`` polls one. For one caller per handle.
* ``write_async``/``read_async`` return a :class:`Future` (``done()``,
  ``wait(timeout)``, ``result(timeout)``) with the op's own result and error.
  ``wait()`` and ``pending()`` never see these ops, so one long-lived handle can
  serve concurrent saves and loads from several threads: each caller waits for
  its own futures only. A ``Future`` may outlive its ``Handle`` (a destroyed
  handle finishes its queued ops first).

Waiting releases the GIL. A timeout raises ``TimeoutError`` (``wait_op``,
``Future.result``) or returns False (``Future.wait``); the op stays pending.

Fork
----
Everything here works in a child created by ``fork()`` (multiprocessing's
"fork" start method, DataLoader workers, launchers), also when the fork happens
while another thread of the parent is in the middle of an I/O. A ``Handle``
keeps its worker threads, locks, async queue and staging buffers in one
per-process block; its first use in a child (any method) builds a fresh block
with new threads, and the parent's block is left alone and leaked (its locks
may be held, and its condition variables waited on, by threads that do not
exist in the child; joining or destroying them would hang). Destroying a
``Handle`` in a child that never used it leaks the parent's block the same way.
Linux AIO contexts are per operation, never inherited. Async ops the parent
submitted and had not collected with ``wait()`` before the fork are not the
child's (a read lands in the parent's memory only): the child's ``pending()``
counts them and its first ``wait()`` raises ``RuntimeError`` naming how many,
then forgets them. A ``PinnedBuffer`` registered with CUDA by the parent is not
unregistered by a child (``cuda_registered`` is False there): CUDA itself cannot
be used in a forked child of a process that initialised it. The mechanism
(``pthread_atfork`` + a fork generation) is described in ``native/include/fastpersist/fork.hpp``.
"""

from typing import Optional, Sequence, Union

Extent = tuple[int, int, int, int]  # (file_offset, ptr, length, crc_slot)
Patch = tuple[int, int, int]  # (file_offset, crc_slot, kind)
Target = Union[str, int]  # path, or an open file descriptor (not closed by us)

__version__: str
ENGINES: tuple[str, ...]  # engines compiled in: ("aio", "psync", "cufile")

def available_engines() -> list[str]:
    """Engines usable on this machine right now (cufile only when libcufile loads)."""

def cufile_status() -> str:
    """'available', or the reason cuFile is not usable (library missing, driver open failed, ...)."""

def set_staging_huge_pages(huge: bool) -> None:
    """Whether staging buffers allocated from now on ask for transparent huge pages
    (``MADV_HUGEPAGE``, the default) or refuse them (``MADV_NOHUGEPAGE``); process-wide.
    ``fastpersist.io.native_module`` sets it from ``fastpersist.prefault.huge_pages()``."""
def staging_huge_pages() -> bool:
    """The setting of :func:`set_staging_huge_pages`."""
def alignment_of(path: str) -> int:
    """O_DIRECT alignment (bytes) for files at ``path`` (a file or a directory):
    the device's logical block size / statx DIO alignment, never below 4096."""

def direct_io_supported(path: str) -> bool:
    """Whether the filesystem holding ``path`` (file or directory) accepts O_DIRECT."""

def crc32(ptr: int, length: int, crc: int = 0) -> int:
    """CRC-32 (zlib-compatible) of ``length`` bytes at host address ``ptr``, continuing ``crc``. GIL released."""

def crc32_many(ranges: Sequence[tuple[int, int]]) -> list[int]:
    """CRC-32 of each ``(ptr, length)`` host range, in order, on the calling thread; the GIL
    is released once for all of them."""

def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC of A+B from crc(A), crc(B) and len(B) (zlib's crc32_combine)."""

class Future:
    """Completion of one asynchronous op from ``Handle.write_async``/``read_async``.
    Thread-safe; several threads may wait on one future."""

    @property
    def id(self) -> int: ...
    def done(self) -> bool:
        """Whether the op has finished (successfully or not). Never blocks."""
    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block (GIL released) until the op finished or ``timeout`` seconds passed;
        returns ``done()``. Never raises the op's error. ``RuntimeError`` in a forked
        child for an op its parent submitted (it never completes there)."""
    def result(self, timeout: Optional[float] = None) -> list[int]:
        """Wait, then return the op's ``nslots`` CRCs or raise its own error (every
        call raises it again). ``TimeoutError`` if not finished in time."""

class Handle:
    """An I/O engine instance with its settings. Thread-safe for submit/wait.
    Fork-safe: rebuilds its threads on first use in a forked child (see "Fork" above)."""

    def __init__(
        self,
        engine: str = "auto",        # "auto" | "aio" | "psync" | "cufile"
        chunk_size: int = 8 << 20,   # bytes per I/O (multiple of 4096)
        queue_depth: int = 8,        # I/Os in flight per op (also: staging buffers in the ring)
        threads: int = 2,            # fill/copy worker threads (and psync I/O threads)
        direct: bool = True,         # use O_DIRECT when the filesystem allows it
        max_async: int = 2,          # async ops executed concurrently; others queue
        stage_reads: bool = False,   # reads: every chunk through the staging ring, then copied out
        read_mode: str = "direct",   # what loaders on this handle do: "direct" | "buffered" | "auto" (carried only)
    ) -> None: ...
    @property
    def engine(self) -> str: ...        # as requested ("auto" stays "auto")
    @property
    def chunk_size(self) -> int: ...
    @property
    def queue_depth(self) -> int: ...
    @property
    def threads(self) -> int: ...
    @property
    def direct(self) -> bool: ...
    @property
    def stage_reads(self) -> bool: ...
    @property
    def read_mode(self) -> str: ...     # "direct" | "buffered" | "auto" (the loaders' choice; fastpersist.readpolicy.plan_read)
    @property
    def last_engine(self) -> str: ...   # engine actually used by the last completed op ("aio", "psync", "psync-buffered")

    def write(
        self,
        target: Target,
        extents: Sequence[Extent],
        patches: Sequence[Patch] = (),
        nslots: int = 0,
        truncate: bool = True,   # path targets: open with O_CREAT|O_TRUNC (False: O_CREAT, keep contents)
        fsync: bool = False,     # fsync the file before returning
    ) -> list[int]:
        """Gather-write; returns the ``nslots`` CRCs. GIL released throughout."""
    def read(
        self,
        target: Target,
        extents: Sequence[Extent],
        nslots: int = 0,
    ) -> list[int]:
        """Scatter-read; returns the ``nslots`` CRCs. GIL released throughout."""
    def submit_write(
        self,
        target: Target,
        extents: Sequence[Extent],
        patches: Sequence[Patch] = (),
        nslots: int = 0,
        truncate: bool = True,
        fsync: bool = False,
    ) -> int:
        """Asynchronous ``write``; returns an op id at once."""
    def submit_read(self, target: Target, extents: Sequence[Extent], nslots: int = 0) -> int:
        """Asynchronous ``read``; returns an op id at once."""
    def write_async(
        self,
        target: Target,
        extents: Sequence[Extent],
        patches: Sequence[Patch] = (),
        nslots: int = 0,
        truncate: bool = True,
        fsync: bool = False,
    ) -> Future:
        """Asynchronous ``write`` with its own completion (see "Asynchronous ops")."""
    def read_async(self, target: Target, extents: Sequence[Extent], nslots: int = 0) -> Future:
        """Asynchronous ``read`` with its own completion (see "Asynchronous ops")."""
    def wait_op(self, op_id: int, timeout: Optional[float] = None) -> list[int]:
        """Wait (GIL released) for one op from ``submit_*``, collect it, return its CRCs
        or raise its own error. ``TimeoutError`` if not done in time (still pending);
        ``ValueError`` if ``op_id`` is not pending (unknown or collected already)."""
    def done(self, op_id: int) -> bool:
        """Whether op ``op_id`` from ``submit_*`` has finished; ``ValueError`` if not pending."""
    def copy_ranges(self, ranges: Sequence[tuple[int, int, int]], crc: bool = False) -> list[int]:
        """Copy each ``(dst_ptr, src_ptr, length)`` host range on the handle's threads
        (GIL released); with ``crc`` return the CRC-32 of each copy (else zeros),
        computed while the bytes are in cache."""
    def wait(self) -> list[tuple[int, list[int]]]:
        """Block until every op submitted with ``submit_*`` and not yet collected has finished. Returns ``(op_id, crcs)`` of
        the ops completed since the last wait, in submission order. If any failed,
        raises the first failure (after all have finished) and forgets the rest.
        In a forked child whose parent had uncollected ops at the fork, the first
        ``wait()`` raises ``RuntimeError`` about them (see "Fork")."""
    def pending(self) -> int:
        """Number of submitted ops not yet collected by ``wait`` (in a forked child,
        including the parent's uncollected ops until ``wait`` reports them)."""
    def crc32_ranges(self, ranges: Sequence[tuple[int, int]]) -> list[int]:
        """CRC-32 of each ``(ptr, length)`` host range, computed on the handle's
        threads (large ranges split and combined). GIL released."""

class PinnedBuffer:
    """Page-aligned host memory, mlock'ed when possible (page-locked on CPU-only
    machines), registered with CUDA when requested. Exposes the buffer protocol
    (writable, 1-D bytes), so ``torch.frombuffer(buf, dtype=torch.uint8)`` wraps
    it without a copy and keeps it alive. Freed (unregistered, munlock'ed) when
    the last reference dies."""

    def __init__(self, nbytes: int, alignment: int = 4096, lock: bool = True) -> None: ...
    @property
    def ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def locked(self) -> bool: ...        # mlock succeeded
    @property
    def cuda_registered(self) -> bool: ...
    def cuda_register(self) -> bool:
        """cudaHostRegister via the already-loaded CUDA runtime (dlopen RTLD_NOLOAD). False if no runtime."""

# ---- interpreter exit -------------------------------------------------------
# Every binding that releases the GIL takes it back through an exit gate: once the
# gate is closed (or the interpreter is finalizing), a thread other than the one
# exiting never takes the GIL again and sleeps in the call until the process ends
# (CPython 3.11-3.13 would end it with pthread_exit, which aborts C++ code).
def close_exit_gate() -> None:
    """Close the gate; waits until every thread already past it holds the GIL.
    Registered with ``atexit`` when the module is loaded; not for other callers."""
def set_exit_status(status: int) -> bool:
    """Make the process exit with ``status`` at the end of interpreter finalization
    (after every Python exit handler; C atexit handlers are skipped, as with
    ``os._exit``). False if the hook could not be installed."""

# ---- fault injection (tests) ----------------------------------------------
# Also read once at import from FASTPERSIST_FAULT="op:nth:action[:count]", e.g.
# "write:3:EIO", "write:2:short", "read:1:eintr:5", "fsync:1:ENOSPC".
# op: write | read | fsync | open | any. nth: 1-based index of the matching
# syscall (or AIO completion) counted from when the fault was set. action: an
# errno name (EIO, ENOSPC, ...), "short" (transfer returns half the bytes) or
# "eintr" (call fails with EINTR, which the engine must retry). count: how many
# consecutive matching calls are hit (default 1).
def set_fault(op: str, nth: int, action: str, count: int = 1) -> None: ...
def clear_faults() -> None: ...
def fault_hits() -> int:
    """How many calls the current fault has hit so far."""
def fault_errno(op: str) -> int:
    """Count one call of ``op`` made outside the native core (Python's os.fsync, os.open,
    os.rename); the errno an active fault gives it, else 0."""
