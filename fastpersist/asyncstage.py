"""Staging for asynchronous saves: a bounded pool of page-locked windows, and the
copies that turn a :class:`~fastpersist.formats.base.WritePlan` into writes that no
longer depend on live tensors.

A *snapshot* copies the planned file into windows: each window is an exact image of
a byte range of the file (headers, pickle and tensor bytes in file order), placed
in page-locked memory at the file offset's alignment, so the native writer sends
it to the disk with O_DIRECT and no further copy. The call only copies (a plain
memory copy, no CRC): each window is submitted as soon as it is full, with the
plan's CRC fields as planned (placeholders). The CRC-32 of every payload is then
computed from the windows on a background thread (:class:`BackgroundCrc`), which
holds each window until it has read it, and the finisher writes the CRC fields
(zip data descriptors and central directory, safetensors header) into the file
once every window is on disk, before the fsync and the rename.

The pool holds at most ``limit`` bytes in windows of at most 64 MiB (at least two
windows), allocated on first use and reused by later saves. A save needing a
window when none is free waits (GIL released) for the oldest window in flight to
reach the disk (and, for a snapshot, to have its CRC read): that is how a second
save queues behind the first, and how a save larger than the pool streams through it.

A *lazy* save (:class:`LazyFeed`) fills the same windows from the live tensors on
a background thread after the call returned; the optimizer guard finishes the
copy on the training's thread. Its CRC fields are written once every window is on
disk (as a collective save's slice, :func:`snapshot_slice`).
"""

from __future__ import annotations

import bisect
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from fastpersist import _native, _sys
from fastpersist.plan import WritePlan, patch_bytes

_PAGE = 4096
_MAX_WINDOW = 64 << 20


def window_size(limit: int) -> int:
    """Bytes per staging window for a pool of ``limit`` bytes (two windows at least)."""
    return max(_PAGE, min(_MAX_WINDOW, limit // 2) // _PAGE * _PAGE)


@dataclass(eq=False)
class Window:
    buf: Any  # _native.PinnedBuffer
    view: memoryview
    future: Any = None  # the write reading it; None: free, or held by a save that fills it
    busy: bool = False
    seq: int = 0


class StagingPool:
    """At most ``limit`` bytes of page-locked windows, reused across saves."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.window = window_size(limit)
        self.max_windows = max(2, limit // self.window)
        self._windows: list[Window] = []
        self._lock = threading.Lock()
        self._seq = 0

    @property
    def allocated(self) -> int:
        """Bytes of page-locked memory the pool holds now."""
        return len(self._windows) * self.window

    def acquire(self, before_wait: Optional[Callable[[], None]] = None) -> Window:
        """A free window; waits for the oldest write in flight when all are taken
        (calling ``before_wait()`` first: whatever frees windows must be running)."""
        while True:
            with self._lock:
                for w in self._windows:
                    if w.busy and w.future is not None and w.future.done():
                        w.busy, w.future = False, None
                    if not w.busy:
                        w.busy = True
                        return w
                if len(self._windows) < self.max_windows:
                    buf = _native.PinnedBuffer(self.window, _PAGE, True)
                    w = Window(buf, memoryview(buf).cast("B"), busy=True)
                    self._windows.append(w)
                    return w
                inflight = [w for w in self._windows if w.future is not None]
                if not inflight:
                    raise RuntimeError(
                        "fastpersist: every staging window is held by a save waiting for later bytes "
                        f"(pool of {self.max_windows} x {self.window} bytes); raise async_staging_limit"
                    )
                oldest = min(inflight, key=lambda x: x.seq)
                fut = oldest.future
            if before_wait is not None:
                before_wait()
            fut.wait()  # GIL released

    def submitted(self, w: Window, future: Any) -> None:
        """``w`` is being written by ``future``; free again once that is done."""
        with self._lock:
            self._seq += 1
            w.future, w.seq = future, self._seq

    def release(self, w: Window) -> None:
        """Give back a window that was never submitted (error paths)."""
        with self._lock:
            w.busy, w.future = False, None


class Both:
    """What frees a snapshot window: its write is done and its CRC-32s were read."""

    def __init__(self, write: Any, crc_read: threading.Event) -> None:
        self.write = write
        self.crc_read = crc_read

    def done(self) -> bool:
        return self.crc_read.is_set() and self.write.done()

    def wait(self) -> None:
        self.crc_read.wait()
        self.write.wait()  # GIL released


class BackgroundCrc:
    """The CRC-32s of a snapshot, computed on a thread of their own from the staged
    windows (``_native.crc32`` releases the GIL), after the call returned: the call
    then costs one plain memory copy. Windows are added in file order; each one's
    event is set once its pieces were read, and the pool keeps the window until then.
    The thread starts at :meth:`go` (the call is done, or must wait for a window),
    so that it does not compete with the call's own copies for the cores."""

    def __init__(self) -> None:
        self.partial: dict[int, tuple[int, int]] = {}
        self.exc: Optional[BaseException] = None
        self.done = threading.Event()
        self._items: list[tuple[threading.Event, list[tuple[int, int, int]]]] = []
        self._cv = threading.Condition()
        self._closed = False
        self._aborted = False
        self._thread: Optional[threading.Thread] = None
        self.keep: Any = None

    def add(self, pieces: list[tuple[int, int, int]]) -> threading.Event:
        """One window's ``(ptr, length, slot)`` payload pieces; returns its event."""
        ev = threading.Event()
        with self._cv:
            self._items.append((ev, pieces))
            self._cv.notify()
        return ev

    def go(self) -> None:
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="fastpersist-snapshot-crc", daemon=True)
                self._thread.start()

    def close(self) -> None:
        """No more windows: start (if not yet) and finish."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self.go()

    def abort(self) -> None:
        """The capture failed: read nothing more, free every window."""
        self._aborted = True
        self.close()

    def _run(self) -> None:
        i = 0
        try:
            while True:
                with self._cv:
                    while i >= len(self._items) and not self._closed:
                        self._cv.wait()
                    if i >= len(self._items):
                        return
                    ev, pieces = self._items[i]
                if not self._aborted:
                    crcs = _native.crc32_many([(ptr, n) for ptr, n, _slot in pieces])  # GIL released once
                    _add_partial_crcs(self.partial, [(slot, n) for _p, n, slot in pieces], crcs)
                ev.set()
                i += 1
        except BaseException as e:  # noqa: BLE001 - raised by the finisher
            self.exc = e
        finally:
            with self._cv:
                items = list(self._items)
            for ev, _pieces in items:
                ev.set()
            self.done.set()

    def crcs(self, nslots: int) -> list[int]:
        """Every slot's CRC-32 (after :attr:`done`)."""
        out = [0] * nslots
        for slot, (crc, _n) in self.partial.items():
            out[slot] = crc
        return out


def snapshot_plan(
    plan: WritePlan,
    pool: StagingPool,
    handle: Any,
    submit: Callable[[int, int, int], Any],
) -> tuple[list[Any], BackgroundCrc]:
    """Copy the file ``plan`` describes into staging windows and submit each window.

    ``submit(file_offset, ptr, length)`` starts the write of one window and returns
    its native Future. The copy computes no CRC: the windows go to the disk with the
    plan's CRC fields as planned (placeholders), and the returned
    :class:`BackgroundCrc` computes every slot's CRC-32 from the windows in the
    background; the caller writes the CRC fields once it is done and every write
    completed. Returns ``(futures in file order, crc)``. When this returns, no byte
    of the plan's sources is read any more: the caller may change them.
    """
    extents = plan.extents
    crc = BackgroundCrc()
    crc.keep = pool  # the windows it reads stay allocated while it runs
    futures: list[Any] = []
    current: Optional[Window] = None  # taken, not yet submitted
    try:
        for current, start, base, ranges, slots, pos in fill_windows(
                extents, pool, lambda: pool.acquire(before_wait=crc.go)):
            handle.copy_ranges(ranges, False)  # GIL released, on the handle's threads
            pieces = [(dst, n, slot) for (dst, _src, n), (slot, _n) in zip(ranges, slots) if slot >= 0 and n]
            fut = submit(start, base, pos - start)
            futures.append(fut)
            pool.submitted(current, Both(fut, crc.add(pieces)))
            current = None
        crc.close()
        return futures, crc
    except BaseException:
        crc.abort()
        if current is not None:
            pool.release(current)
        for f in futures:
            f.wait()
        crc.done.wait()
        raise


def fill_windows(
    extents: list[tuple[int, int, int, int]], pool: StagingPool, acquire: Callable[[], Window],
) -> Iterator[tuple[Window, int, int, list[tuple[int, int, int]], list[tuple[int, int]], int]]:
    """Cut the plan's extents into staging windows, in file order: for each window, one
    window taken with ``acquire()`` and ``(window, start, base, ranges, slots, pos)``
    (see :func:`_window_ranges`; ``base``: where file offset ``start`` lands in it).
    The caller owns each window from the moment it is yielded."""
    k, k_off = 0, 0
    while k < len(extents):
        if extents[k][2] == 0:
            k += 1
            continue
        start = extents[k][0] + k_off
        lead = start % _PAGE
        win = acquire()
        base = win.buf.ptr + lead
        ranges, slots, pos, k, k_off = _window_ranges(extents, k, k_off, start, start + pool.window - lead, base)
        yield win, start, base, ranges, slots, pos


def _window_ranges(
    ext: list[tuple[int, int, int, int]], k: int, k_off: int, start: int, end: int, base: int,
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]], int, int, int]:
    """The copies that fill one staging window with file bytes ``[start, end)`` from
    extent ``k`` at offset ``k_off`` on (``base``: where ``start`` lands in the window).
    Stops at ``end`` or at a gap in the plan. Returns ``(ranges, slots, pos, k, k_off)``:
    ``(dst, src, length)`` copies, ``(crc slot, length)`` of each, the file offset
    reached, and where the next window resumes."""
    ranges: list[tuple[int, int, int]] = []
    slots: list[tuple[int, int]] = []
    pos = start
    while k < len(ext) and pos < end:
        off, ptr, n, slot = ext[k]
        if off + k_off != pos:  # a gap in the plan: the next window starts at the next extent
            break
        take = min(n - k_off, end - pos)
        if take:
            ranges.append((base + pos - start, ptr + k_off, take))
            slots.append((slot, take))
        pos += take
        k_off += take
        if k_off == n:
            k, k_off = k + 1, 0
    return ranges, slots, pos, k, k_off


def _add_partial_crcs(partial: dict[int, tuple[int, int]], slots: list[tuple[int, int]], crcs: list[int]) -> None:
    """Fold each copied piece's CRC-32 into its slot's running ``(crc, length)``."""
    for (slot, n), c in zip(slots, crcs):
        if slot < 0:
            continue
        if slot in partial:
            crc, have = partial[slot]
            partial[slot] = (_native.crc32_combine(crc, c, n), have + n)
        else:
            partial[slot] = (c, n)


def snapshot_slice(
    extents: list[tuple[int, int, int, int]],
    pool: StagingPool,
    handle: Any,
    submit: Callable[[int, int, int], Any],
) -> tuple[dict[int, tuple[int, int]], list[Any]]:
    """One rank's slice of a collective async save: copy ``extents`` (clipped to the
    slice, file order) into staging windows, computing CRCs during the copy, and
    submit each window as soon as it is full. CRC fields are written as planned
    (placeholders): the caller patches them once the group's CRCs are known.

    Returns ``({slot: (crc, length)}, futures)``, the partial CRCs in the form of
    :func:`fastpersist.formats.split.partial_crcs`. When this returns, no source byte
    is read any more.
    """
    partial: dict[int, tuple[int, int]] = {}
    futures: list[Any] = []
    taken: list[Window] = []
    try:
        for win, start, base, ranges, slots, pos in fill_windows(extents, pool, pool.acquire):
            taken.append(win)
            piece_crcs = handle.copy_ranges(ranges, True)  # GIL released, on the handle's threads
            _add_partial_crcs(partial, slots, piece_crcs)
            fut = submit(start, base, pos - start)
            pool.submitted(win, fut)
            futures.append(fut)
        return partial, futures
    except BaseException:
        submitted = {id(f) for f in futures}
        for w in taken:
            if w.future is None or id(w.future) not in submitted:
                pool.release(w)
        for f in futures:
            f.wait()
        raise


class LazyFeed:
    """The background capture of a ``mode="lazy"`` save: the file's extents (live
    tensors, and the bytes copied at call time) are copied window by window into the
    staging pool (a plain copy), each window written as soon as it is full, by a
    feeder thread whose copies run on the (possibly lower-priority) background
    handle. The CRC-32s are computed from the windows by a :class:`BackgroundCrc`,
    as for a snapshot, so that neither the feeder nor the guard's copy pays for them.

    Live tensors are read only by the copies, never by the disk writes, so a tensor is
    *consumed* once copied, at memory speed, not once on disk. :meth:`release` (the
    guard, before ``optimizer.step``) copies whatever the feeder has not reached yet,
    on the caller's thread with the full-priority handle, and returns when no live
    byte is read any more. CRC fields stay as planned in the windows: the finisher
    patches them (:meth:`crcs`, after ``crc.done``) once every write is done.
    """

    def __init__(self, extents: list[tuple[int, int, int, int]], pool: StagingPool, background: Any,
                 foreground: Any, submit: Callable[[int, int, int], Any]) -> None:
        self.extents = extents
        self.pool = pool
        self.background = background
        self.foreground = foreground
        self.submit = submit
        self.futures: list[Any] = []
        self.crc = BackgroundCrc()
        self.crc.keep = pool  # the windows it reads stay allocated while it runs
        self.exc: Optional[BaseException] = None
        self.done = threading.Event()
        self._lock = threading.Lock()  # one window copied at a time, in file order, by either thread
        self._k = 0
        self._k_off = 0
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fastpersist-lazy-feed", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._drain(self.background)

    def release(self) -> None:
        """Copy the rest now on this thread (full priority); return once no live byte is read."""
        if not self.done.is_set():
            self._drain(self.foreground)
        self.done.wait()

    def _drain(self, handle: Any) -> None:
        try:
            while not self.done.is_set():
                with self._lock:
                    if self.done.is_set() or self.exc is not None:
                        return
                    if not self._one(handle):
                        self.crc.close()
                        self.done.set()
        except BaseException as e:  # noqa: BLE001 - raised by the finisher
            self.exc = e
            self.crc.abort()
            self.done.set()

    def _one(self, handle: Any) -> bool:
        """Copy and submit the next window; False when nothing is left."""
        ext = self.extents
        while self._k < len(ext) and ext[self._k][2] == 0:
            self._k += 1
        if self._k >= len(ext):
            return False
        start = ext[self._k][0] + self._k_off
        lead = start % _PAGE
        win = self.pool.acquire(before_wait=self.crc.go)
        try:
            end = start + self.pool.window - lead
            ranges, slots, pos, k, k_off = _window_ranges(ext, self._k, self._k_off, start, end, win.buf.ptr + lead)
            handle.copy_ranges(ranges, False)  # GIL released
            pieces = [(dst, n, slot) for (dst, _src, n), (slot, _n) in zip(ranges, slots) if slot >= 0 and n]
            fut = self.submit(start, win.buf.ptr + lead, pos - start)
        except BaseException:
            self.pool.release(win)
            raise
        self.pool.submitted(win, Both(fut, self.crc.add(pieces)))
        self.futures.append(fut)
        self._k, self._k_off = k, k_off
        return True

    def crcs(self, nslots: int) -> list[int]:
        """Every slot's CRC-32 (after :attr:`done` and ``crc.done``; raises the CRC
        thread's error, if any)."""
        self.crc.done.wait()
        if self.crc.exc is not None:
            raise self.crc.exc
        return self.crc.crcs(nslots)


def copy_private(plan: WritePlan, handle: Any, keep: Callable[[Any], bool]) -> tuple[list[tuple[int, int, int, int]], Any, int]:
    """Lazy saves: extents for which ``keep(extent)`` is false are copied into one
    private buffer (returned with the retargeted extents and its size in bytes)."""
    import torch

    total = sum(e[2] for e in plan.extents if not keep(e))
    buf = torch.empty(total, dtype=torch.uint8)
    base = buf.data_ptr()
    out: list[tuple[int, int, int, int]] = []
    ranges: list[tuple[int, int, int]] = []
    pos = 0
    for e in plan.extents:
        off, ptr, n, slot = e
        if keep(e):
            out.append(e)
        else:
            if n:
                ranges.append((base + pos, ptr, n))
            out.append((off, base + pos, n, slot))
            pos += n
    handle.copy_ranges(ranges, False)
    return out, buf, total


def optimizer_ranges(optimizers: list[Any]) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Sorted ``(start, end, optimizer index)`` host address ranges of every CPU tensor
    an optimizer's ``step`` may modify (its parameters and its state tensors)."""
    import torch

    ranges: list[tuple[int, int, int]] = []
    for i, opt in enumerate(optimizers):
        tensors: list[Any] = []
        for group in opt.param_groups:
            tensors.extend(group["params"])
        for st in opt.state.values():
            if isinstance(st, dict):
                tensors.extend(v for v in st.values() if isinstance(v, torch.Tensor))
        for t in tensors:
            if t.device.type != "cpu":
                continue
            s = t.untyped_storage()
            if s.nbytes():
                ranges.append((s.data_ptr(), s.data_ptr() + s.nbytes(), i))
    ranges.sort()
    return [r[0] for r in ranges], ranges


def owner_of(starts: list[int], ranges: list[tuple[int, int, int]], ptr: int, n: int) -> Optional[int]:
    """Index of the optimizer whose tensor holds ``[ptr, ptr + n)``, or None."""
    i = bisect.bisect_right(starts, ptr) - 1  # storages never overlap: the last start <= ptr
    if i >= 0 and ptr + n <= ranges[i][1]:
        return ranges[i][2]
    return None


# ---- the process's staging pool: async saves and blocking saves of CUDA state share it

_shared_lock = threading.Lock()
_capture_lock = threading.Lock()  # one save captures its state at a time (call order = queue order)
_shared_pool: Optional[StagingPool] = None


def _reset_in_child() -> None:
    """A forked child starts with no pool and fresh locks (a parent thread may have held them)."""
    global _shared_lock, _capture_lock, _shared_pool
    _shared_lock = threading.Lock()
    _capture_lock = threading.Lock()
    _shared_pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)


def shared_pool(limit: int) -> StagingPool:
    """The process's staging pool of ``limit`` bytes (a new one when the limit changed;
    saves using the old one keep it alive)."""
    global _shared_pool
    with _shared_lock:
        if _shared_pool is None or _shared_pool.limit != limit:
            _shared_pool = StagingPool(limit)
        return _shared_pool


def current_pool() -> Optional[StagingPool]:
    """The pool :func:`shared_pool` last returned (None before the first)."""
    return _shared_pool


def capture_lock() -> threading.Lock:
    """Held while a save captures its state into the pool: captures run in call order."""
    return _capture_lock


def patch_slice(tmp: str, patches: list[Any], crcs: list[int], lo: int, hi: int, fsync: bool) -> None:
    """Write the CRC fields of ``patches`` that fall inside ``[lo, hi)`` into ``tmp`` (after its
    slice's O_DIRECT writes completed), then fsync it."""
    fd = _sys.open(tmp, os.O_WRONLY | os.O_CLOEXEC)
    try:
        for off, slot, kind in patches:
            b = patch_bytes(kind, crcs[slot])
            a, z = max(off, lo), min(off + len(b), hi)
            if a < z:
                _sys.pwrite(fd, b[a - off:z - off], a, tmp)
        if fsync:
            _sys.fsync(fd, tmp)
    finally:
        os.close(fd)
