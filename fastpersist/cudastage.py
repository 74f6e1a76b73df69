"""The GPU path of saves: device bytes streamed through the page-locked staging pool.

Planning (:func:`fastpersist.formats.torchzip.plan_torch`,
:func:`fastpersist.formats.safetensors.plan_safetensors` with ``device_sources``)
copies no CUDA byte: every CUDA storage (tensor, for safetensors) is recorded as a
*device source* (:class:`DeviceSources`, kept in ``WritePlan.keepalive``) and its
extent's ``ptr`` is the device address. Device and host addresses never collide
(CUDA's unified virtual addressing on 64-bit Linux), so a copy range tells which
one it reads by its source address alone.

:func:`stream_plan` then writes the plan window by window through a
:class:`~fastpersist.asyncstage.StagingPool` (the async saves' pool, bounded by
``Config.async_staging_limit``): host bytes are copied by the native handle as in
a snapshot; device bytes are queued by a :class:`Copier` (for CUDA,
:class:`CudaCopier`: ``copy_(non_blocking=True)`` on one side stream per device,
ordered after the producing stream). Each window gets a token after its copies;
a submitter thread waits for that token (GIL released) and only then submits the
window to the disk, while the caller is already queueing the next windows'
copies: D2H copies overlap the disk writes, and host memory is bounded by the pool.
CRC-32s are computed from the windows on a background thread (as a snapshot's).

:func:`stream_plan` returns once every copy is *queued*; with ``order_after=True``
the producing streams then wait on the side streams (``wait_stream``: an event
wait on the GPU, no host synchronize), so kernels queued after the call cannot
change a tensor before it was copied. This is what ``save_async(mode="snapshot")``
needs; a blocking save waits for everything (:func:`write_plan_blocking`).

Nothing here initialises CUDA unless a plan holds CUDA sources (the planners'
predicate only reads ``storage.device``).

NOTE: the CUDA parts (:class:`CudaCopier`) have not been run on a GPU by the
session that wrote them; the pipeline itself is exercised on CPU through
:class:`HostCopier` (tests/test_cuda_stage.py). See docs/gpu.md.
"""

from __future__ import annotations

import bisect
import logging
import os
import queue
import threading
from typing import Any, Callable, Optional, Protocol

import torch

from fastpersist.asyncstage import BackgroundCrc, Both, StagingPool, Window, fill_windows, patch_slice
from fastpersist.io import require_cufile

log = logging.getLogger(__name__)

__all__ = [
    "CudaCopier", "Copier", "DeviceSources", "HostCopier", "device_sources_of",
    "stream_plan", "write_plan_blocking",
]


# --------------------------------------------------------------------------- sources


class DeviceSources:
    """The extents of a plan whose bytes are not read by the native writer: for each,
    ``(start, end, bytes tensor)`` (a 1-D ``uint8`` tensor over exactly ``[start, end)``,
    on the source's device), looked up by address."""

    def __init__(self) -> None:
        self.items: list[tuple[int, int, torch.Tensor]] = []
        self.starts: list[int] = []
        self._seen: dict[tuple[int, int], int] = {}
        self._sorted = True

    def add(self, t: torch.Tensor) -> int:
        """Record a 1-D uint8 tensor as a source; returns its address (the extent's ptr)."""
        ptr, n = t.data_ptr(), t.numel()
        if (ptr, n) not in self._seen:  # the same storage may be named twice
            self._seen[(ptr, n)] = len(self.items)
            self.items.append((ptr, ptr + n, t))
            self._sorted = False
        return ptr

    def add_storage(self, storage: torch.UntypedStorage) -> int:
        """Record a whole untyped storage."""
        return self.add(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage))

    def find(self, ptr: int, n: int) -> Optional[tuple[torch.Tensor, int]]:
        """``(bytes tensor, offset)`` of the source holding ``[ptr, ptr + n)``, or None."""
        if not self._sorted:
            self.items.sort(key=lambda x: x[0])
            self.starts = [x[0] for x in self.items]
            self._sorted = True
        i = bisect.bisect_right(self.starts, ptr) - 1
        if i >= 0:
            a, z, t = self.items[i]
            if ptr + n <= z:
                return t, ptr - a
        return None

    def __len__(self) -> int:
        return len(self.items)

    def devices(self) -> list[torch.device]:
        """The distinct devices of the sources."""
        out: list[torch.device] = []
        for _a, _z, t in self.items:
            if t.device not in out:
                out.append(t.device)
        return out


def device_sources_of(plan: Any) -> Optional[DeviceSources]:
    """The plan's :class:`DeviceSources`, or None when it has none (or they are empty)."""
    for k in plan.keepalive:
        if isinstance(k, DeviceSources):
            return k if len(k) else None
    return None


def is_cuda_storage(storage: Any) -> bool:
    """Default predicate of the planners: storages on a CUDA device become device sources."""
    return storage.device.type == "cuda"


# --------------------------------------------------------------------------- copiers


class Copier(Protocol):
    """Queues the device copies of windows and says when a window's copies are done."""

    def begin(self, sources: DeviceSources) -> None:
        """Order later copies after the work already queued on the sources' producers."""

    def copy(self, win: Window, dst_off: int, src: torch.Tensor) -> None:
        """Queue the copy of ``src`` (1-D uint8) into the window at byte ``dst_off``."""

    def mark(self) -> Any:
        """A token for every copy queued since the last mark (one window's)."""

    def wait(self, token: Any) -> None:
        """Block (GIL released) until the token's copies are done; raise their error."""

    def end(self, order_after: bool) -> None:
        """Every copy is queued; with ``order_after`` make the producers wait for them."""


def mark_side_streams(streams: dict[torch.device, Any], used: set[torch.device]) -> list[Any]:
    """One CUDA event per device in ``used``, recorded on its side stream in ``streams``
    (the copies queued there since the last mark); empties ``used``. Shared by the
    save's :class:`CudaCopier` and the load ring's ``cudaload.H2DCopier``."""
    events = []
    for dev in used:
        ev = torch.cuda.Event()
        ev.record(streams[dev])
        events.append(ev)
    used.clear()
    return events


def wait_events(token: Any) -> None:
    """Block until every event of a :func:`mark_side_streams` token has completed."""
    for ev in token or ():
        ev.synchronize()  # GIL released by torch


class CudaCopier:
    """D2H copies on one side stream per device, ordered after the producing (current)
    stream, one event per device and window; the caching allocator is told
    (``record_stream``) that the side stream reads the sources."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}
        self._producers: dict[torch.device, Any] = {}
        self._used: set[torch.device] = set()
        self._tensors: dict[int, torch.Tensor] = {}  # window ptr -> CPU uint8 tensor over it

    def begin(self, sources: DeviceSources) -> None:
        for dev in sources.devices():
            producer = torch.cuda.current_stream(dev)
            side = torch.cuda.Stream(device=dev)
            side.wait_stream(producer)  # an event recorded on the producer now, waited on the GPU
            self._streams[dev] = side
            self._producers[dev] = producer

    def _window_tensor(self, win: Window) -> torch.Tensor:
        t = self._tensors.get(win.buf.ptr)
        if t is None:
            if not win.buf.cuda_registered and not win.buf.cuda_register():
                log.debug("fastpersist: staging window not registered with CUDA; D2H copies into it are synchronous")
            t = torch.frombuffer(win.buf, dtype=torch.uint8)
            self._tensors[win.buf.ptr] = t
        return t

    def copy(self, win: Window, dst_off: int, src: torch.Tensor) -> None:
        side = self._streams[src.device]
        dst = self._window_tensor(win)[dst_off:dst_off + src.numel()]
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        src.record_stream(side)
        self._used.add(src.device)

    def mark(self) -> Any:
        return mark_side_streams(self._streams, self._used)

    def wait(self, token: Any) -> None:
        wait_events(token)

    def end(self, order_after: bool) -> None:
        if order_after:
            for dev, side in self._streams.items():
                self._producers[dev].wait_stream(side)


class HostCopier:
    """The same contract for host sources, copies run on a thread of their own
    (optionally ``delay`` seconds late each): the window pipeline on machines without
    a GPU, used by the tests to check that a window reaches the disk only after its
    copies, and in file order."""

    def __init__(self, delay: float = 0.0, fail_after: Optional[int] = None) -> None:
        self.delay = delay
        self.fail_after = fail_after  # raise in the copy thread after this many copies (tests)
        self._q: "queue.Queue[Any]" = queue.Queue()
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._copies = 0
        self._thread = threading.Thread(target=self._run, name="fastpersist-host-copier", daemon=True)
        self._thread.start()

    def begin(self, sources: DeviceSources) -> None:
        pass

    def copy(self, win: Window, dst_off: int, src: torch.Tensor) -> None:
        dst = torch.frombuffer(win.buf, dtype=torch.uint8)[dst_off:dst_off + src.numel()]
        self._pending.append((dst, src))

    def mark(self) -> Any:
        box: dict[str, Any] = {"done": threading.Event()}
        self._q.put((self._pending, box))
        self._pending = []
        return box

    def _run(self) -> None:
        import time

        while True:
            item = self._q.get()
            if item is None:
                return
            pairs, box = item
            try:
                if self.delay:
                    time.sleep(self.delay)
                for dst, src in pairs:
                    if self.fail_after is not None and self._copies >= self.fail_after:
                        raise RuntimeError("fastpersist test: injected device copy failure")
                    dst.copy_(src)
                    self._copies += 1
            except BaseException as e:  # noqa: BLE001 - raised by wait()
                box["exc"] = e
            box["done"].set()

    def wait(self, token: Any) -> None:
        token["done"].wait()
        if "exc" in token:
            raise token["exc"]

    def end(self, order_after: bool) -> None:
        self._q.put(None)


def copier_for(sources: DeviceSources) -> Copier:
    """:class:`CudaCopier` for CUDA sources, :class:`HostCopier` otherwise."""
    if any(d.type == "cuda" for d in sources.devices()):
        return CudaCopier()
    return HostCopier()


# --------------------------------------------------------------------------- the pipeline


class StreamedWrites:
    """The writes of :func:`stream_plan`, as one future-like object: ``wait()``,
    ``done()``, ``result()`` (raises the first error: a copy's, a submission's or a
    write's). Its :attr:`futures` are the native write futures, file order."""

    def __init__(self) -> None:
        self.futures: list[Any] = []
        self.exc: Optional[BaseException] = None
        self.finished = threading.Event()  # the submitter is done (every window submitted or released)

    def done(self) -> bool:
        return self.finished.is_set() and all(f.done() for f in self.futures)

    def wait(self, timeout: Optional[float] = None) -> bool:
        self.finished.wait()
        for f in list(self.futures):
            f.wait()  # GIL released
        return True

    def result(self, timeout: Optional[float] = None) -> list[int]:
        self.wait()
        if self.exc is not None:
            raise self.exc
        for f in self.futures:
            f.result()
        return []


class _Submitter:
    """Waits for each window's copies (in file order) and submits its write."""

    def __init__(self, pool: StagingPool, copier: Copier, crc: BackgroundCrc,
                 submit: Callable[[int, int, int], Any], out: StreamedWrites, keep: Any) -> None:
        self.pool, self.copier, self.crc, self.submit, self.out = pool, copier, crc, submit, out
        self.keep = keep  # the sources stay alive until their copies are done
        self.cv = threading.Condition()
        self.pending = 0  # windows handed over, not yet submitted (or released)
        self.q: "queue.Queue[Any]" = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="fastpersist-device-submit", daemon=True)
        self.thread.start()

    def put(self, item: Any) -> None:
        with self.cv:
            self.pending += 1
        self.q.put(item)

    def wait_below(self, n: int) -> None:
        """Block until at most ``n`` windows wait for their copies (raise the submitter's error)."""
        with self.cv:
            while self.pending > n and self.out.exc is None:
                self.cv.wait(0.05)
        if self.out.exc is not None:
            raise self.out.exc

    def _run(self) -> None:
        try:
            while True:
                item = self.q.get()
                if item is None:
                    return
                token, win, start, base, length, pieces = item
                if self.out.exc is not None:
                    _settle(self.copier, token)  # no copy may still land in a window given back
                    self.pool.release(win)
                else:
                    try:
                        self.copier.wait(token)
                        fut = self.submit(start, base, length)
                    except BaseException as e:  # noqa: BLE001 - raised by result()
                        self.out.exc = e
                        _settle(self.copier, token)
                        self.pool.release(win)
                    else:
                        self.out.futures.append(fut)
                        self.pool.submitted(win, Both(fut, self.crc.add(pieces)))
                with self.cv:
                    self.pending -= 1
                    self.cv.notify_all()
        finally:
            if self.out.exc is not None:
                self.crc.abort()
            else:
                self.crc.close()
            self.keep = None
            self.out.finished.set()


def _mark_quietly(copier: Copier) -> Any:
    try:
        return copier.mark()
    except BaseException:  # noqa: BLE001 - an error is already being reported
        return None


def _settle(copier: Copier, token: Any) -> None:
    """Wait for a token's copies, ignoring their errors (another one is reported)."""
    if token is None:
        return
    try:
        copier.wait(token)
    except BaseException:  # noqa: BLE001 - the first error is the one to report
        pass


def stream_plan(
    plan: Any,
    pool: StagingPool,
    handle: Any,
    submit: Callable[[int, int, int], Any],
    *,
    copier: Optional[Copier] = None,
    order_after: bool = True,
) -> tuple[StreamedWrites, BackgroundCrc]:
    """Write ``plan`` (which may hold :class:`DeviceSources`) through ``pool``'s windows.

    Host bytes are copied into each window by ``handle.copy_ranges`` on the caller's
    thread; device bytes are queued on ``copier`` (default: :func:`copier_for`). A
    submitter thread submits each window (``submit(file_offset, ptr, length)``, which
    returns a native Future) once its copies are done, in file order; CRC-32s come
    from the windows on a :class:`BackgroundCrc` (write the CRC fields once it is done).
    Returns once every copy is queued (``order_after``: the producers then wait for the
    copies on the GPU): the caller may change its *host* tensors at once, and its device
    tensors by work queued on their current streams from now on.

    Raises the first error of a copy or submission met during the call; later errors
    come from ``StreamedWrites.result()``. After an error nothing more is submitted.
    """
    sources = device_sources_of(plan) or DeviceSources()
    if getattr(handle, "engine", "auto") == "cufile" and len(sources):
        require_cufile(".", "save")  # raises: saves of CUDA tensors never go through cuFile (docs/gpu.md)
    if copier is None:
        copier = copier_for(sources)
    copier.begin(sources)
    crc = BackgroundCrc()
    crc.keep = pool
    out = StreamedWrites()
    sub = _Submitter(pool, copier, crc, submit, out, keep=plan.keepalive)
    most = max(0, pool.max_windows - 2)  # windows waiting for copies when acquiring: one stays for the disk

    def acquire() -> Window:
        sub.wait_below(most)
        return pool.acquire(before_wait=crc.go)

    current: Optional[Window] = None
    try:
        for current, start, base, ranges, slots, pos in fill_windows(plan.extents, pool, acquire):
            host: list[tuple[int, int, int]] = []
            for dst, src, n in ranges:
                found = sources.find(src, n) if len(sources) else None
                if found is None:
                    host.append((dst, src, n))
                else:
                    t, off = found
                    copier.copy(current, dst - current.buf.ptr, t[off:off + n])
            if host:
                handle.copy_ranges(host, False)  # GIL released
            pieces = [(dst, n, slot) for (dst, _src, n), (slot, _n) in zip(ranges, slots) if slot >= 0 and n]
            w, current = current, None
            sub.put((copier.mark(), w, start, base, pos - start, pieces))
        copier.end(order_after)
    except BaseException as e:
        if out.exc is None:
            out.exc = e
        if current is not None:
            _settle(copier, _mark_quietly(copier))  # copies already queued into it must land first
            pool.release(current)
        try:
            copier.end(order_after)
        except BaseException:  # noqa: BLE001 - the first error is the one to report
            pass
        sub.q.put(None)
        out.wait()
        crc.done.wait()
        raise
    sub.q.put(None)
    return out, crc


def write_plan_blocking(plan: Any, path: str, handle: Any, pool: StagingPool, *, fsync: bool,
                        copier: Optional[Copier] = None) -> None:
    """Write ``plan`` to ``path`` (created/truncated) through ``pool`` with
    :func:`stream_plan`, wait for every write, write the CRC fields, fsync if asked."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666))
    writes, crc = stream_plan(
        plan, pool, handle, lambda off, ptr, n: handle.write_async(path, [(off, ptr, n, -1)], truncate=False),
        copier=copier, order_after=False,
    )
    writes.result()
    crc.done.wait()
    if crc.exc is not None:
        raise crc.exc
    patch_slice(path, plan.patches, crc.crcs(plan.nslots), 0, plan.file_size, fsync)
