"""Fault a load's fresh destination buffers in on a second thread while the reads run.

Memory a process has never used costs a page fault per page on its first write: the
kernel zeroes the page (and, in a VM, the host may first have to back it). A load that
reads into new buffers pays that inside the reads, serially with them; on the
reference VM the first touch of fresh memory swung between 0.6 and 5.5 GB/s from one
minute to the next, and was the variable part of every cold load. A thread that
populates the buffers ahead of the reads (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14
and later, 32 MiB at a time, in file order) takes that cost off the read path: in the
ram-disk experiment of docs/benchmarks.md ("Loads on a fast disk") it raised cold loads
from 0.88x to 1.09x fio's read. Where the call is refused (an older kernel) the thread
stops at once and nothing changes.

Page size of fresh load buffers (:func:`choose_pages`). The native buffers ask for
transparent huge pages (``MADV_HUGEPAGE``), so that first touch zeroes 2 MiB per fault.
In a guest whose kernel reports free memory to the hypervisor (virtio-balloon free page
reporting, Hyper-V's balloon) that is the expensive way for memory nobody freed lately:
the kernel reports free blocks of 2 MiB and more (``page_reporting_order`` 9) about 2 s
after they are freed (``page_reporting_delay``, a background work item that reports part
of each free list per pass), the host takes their memory back, and a huge page carved
from such a block faults every 4 KiB of it in on the host when it is zeroed. On the
reference VM a fresh process's first touch of 1 GiB took 3-4 s of system time with huge
pages against 0.3-0.7 s with 4 KiB pages (which come from blocks smaller than the
reporting order, still backed), and a cold 1 GiB ``fastpersist.load`` went from
0.55-0.75x ``torch.load`` to 3-4x. Memory freed moments ago is the other case: the buddy
allocator hands out the blocks freed last first, the host still backs them, and huge
pages are then the cheap way (populating 1 GiB right after freeing 1 GiB of huge pages:
0.13-0.18 s in 4 of 4 tries; 0.5 s and 1 s later: 0.13-0.26 s in 3 of 5 tries each,
0.5-1.1 s in the others; against 0.27-0.46 s with 4 KiB pages; 2 s and more later:
0.8-1.3 s). That is a load in a process that loads repeatedly (the previous load's
tensors, the page cache of an evicted file, another load's result just freed).

So there the page size is chosen per buffer, from what the kernel shows: the free memory
in blocks of the reporting order and above (``/proc/buddyinfo``, all zones), sampled
every 0.1 s by a daemon thread (:class:`FreeWatch`, started by the first load that asks,
ending after 30 s without one). A buffer takes huge pages for as many bytes, in 2 MiB
steps from its start, as that free memory grew within the last :data:`RECENT_S` (0.5 s:
a reporting pass can start at any moment, and the older the freed memory the likelier a
pass took part of it) less what earlier buffers of that half second took; the rest gets
``MADV_NOHUGEPAGE`` (4 KiB pages) before anything touches it. Freed 4 KiB pages that did
not merge into such blocks, page cache dropped in small folios, and older frees do not
count: 1 GiB freed as 4 KiB pages left those blocks unchanged, and huge pages right
after it took 1.6-2.6 s. The first load of a process has no history and takes 4 KiB
pages (the resume case, unchanged). Elsewhere (no free page reporting) every buffer
keeps huge pages. ``FASTPERSIST_LOAD_HUGE_PAGES=on|off`` overrides the rule.

The native staging buffers (the 8 MiB rings that saves above 32 MiB and staged loads
copy through, allocated per operation) keep huge pages unless that variable says
``off`` (:func:`staging_huge_pages`): measured on the reference VM, 4 KiB pages there
made back-to-back 64 MiB saves 0.8x ``torch.save`` + fsync instead of 1.7-1.9x (each
save faults its fresh ring in 4 KiB at a time, where freed huge pages are reused before
the kernel reports them), and did not speed up the first 1 GiB save of a fresh process
(median 0.74 s against 0.60-0.72 s over five interleaved rounds; fewer system-time
spikes).
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import ctypes.util
import glob
import os
import threading
import time
import weakref
from typing import Any, Callable, Optional, Sequence

__all__ = ["HUGE_PAGES_ENV", "FreeWatch", "Prefaulter", "RECENT_S", "STEP", "choose_pages", "huge_pages",
           "staging_huge_pages"]

_MADV_NOHUGEPAGE = 15
_MADV_POPULATE_WRITE = 23
#: The variable that overrides :func:`huge_pages` (``on``/``off``; unset or ``auto``: the rule).
HUGE_PAGES_ENV = "FASTPERSIST_LOAD_HUGE_PAGES"
#: native buffers this large are a mapping of their own, advised huge (native/src/handle.cpp)
_OWN_MAPPING_MIN = 4 << 20
_HUGE = 2 << 20
_VIRTIO_BALLOON = 5  # virtio device id
_VIRTIO_BALLOON_F_REPORTING = 5  # feature bit
#: bytes populated per call (the stop flag is checked between calls)
STEP = 32 << 20
#: seconds within which memory freed in large blocks counts as still backed by the host
#: (a quarter of the balloon's 2 s reporting delay: see the module docstring)
RECENT_S = 0.5
_SAMPLE_S = 0.1  # FreeWatch's sampling period
_IDLE_S = 30.0  # FreeWatch's thread ends after this long without a decision
_libc: Optional[Any] = None


def _madvise() -> Optional[Any]:
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)  # the process's symbols, libc's among them
            _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            _libc.madvise.restype = ctypes.c_int
        except (OSError, AttributeError):
            _libc = False
    return _libc.madvise if _libc else None


def free_page_reporter(sysfs: str = "/sys") -> Optional[str]:
    """The driver through which this kernel reports free memory to a hypervisor, or
    None: a virtio balloon that negotiated free page reporting, or Hyper-V's balloon."""
    for dev in sorted(glob.glob(os.path.join(sysfs, "bus/virtio/devices/*"))):
        try:
            with open(os.path.join(dev, "device")) as f:
                if int(f.read().strip(), 16) != _VIRTIO_BALLOON:
                    continue
            with open(os.path.join(dev, "features")) as f:
                bits = f.read().strip()  # one character per feature bit, bit 0 first
        except (OSError, ValueError):
            continue
        if len(bits) > _VIRTIO_BALLOON_F_REPORTING and bits[_VIRTIO_BALLOON_F_REPORTING] == "1":
            return "virtio-balloon free page reporting"
    if os.path.isdir(os.path.join(sysfs, "module/hv_balloon")):
        return "Hyper-V balloon (hv_balloon)"
    return None


def reporting_order(sysfs: str = "/sys") -> int:
    """The smallest order (log2 of 4 KiB pages) of the free blocks the kernel reports to
    the hypervisor: ``page_reporting_order``, 9 (2 MiB) where it cannot be read."""
    try:
        with open(os.path.join(sysfs, "module/page_reporting/parameters/page_reporting_order")) as f:
            order = int(f.read().strip())
    except (OSError, ValueError):
        return 9
    return order if 0 <= order < 64 else 9


def large_free_bytes(order: int, buddyinfo: str = "/proc/buddyinfo") -> Optional[int]:
    """Bytes of free memory in blocks of ``order`` and above, all zones (the buddy
    allocator's free lists, ``/proc/buddyinfo``), or None where it cannot be read."""
    try:
        with open(buddyinfo) as f:
            text = f.read()
    except OSError:
        return None
    total = 0
    for line in text.splitlines():
        fields = line.split()
        if "zone" not in fields:
            continue
        try:
            counts = [int(x) for x in fields[fields.index("zone") + 2:]]
        except ValueError:
            return None
        total += sum(n << (o + 12) for o, n in enumerate(counts) if o >= order)
    return total


class FreeWatch:
    """How much memory was freed in large blocks lately: samples ``read()`` (bytes free in
    blocks the balloon reports, or None) every ``period`` seconds of ``clock`` on a daemon
    thread, started by :meth:`claim` and ending after ``idle`` seconds without one
    (``thread=False``: only the samples :meth:`sample` and :meth:`claim` take; tests)."""

    def __init__(self, read: Callable[[], Optional[int]], *, clock: Callable[[], float] = time.monotonic,
                 window: float = RECENT_S, period: float = _SAMPLE_S, idle: float = _IDLE_S,
                 thread: bool = True) -> None:
        self._read, self._clock = read, clock
        self.window, self.period, self.idle = window, period, idle
        self._use_thread = thread
        self._lock = threading.Lock()
        self._samples: "collections.deque[tuple[float, int]]" = collections.deque()
        self._claims: "collections.deque[tuple[float, int]]" = collections.deque()
        self._used = clock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def sample(self) -> Optional[int]:
        """Take a sample now; returns it."""
        value = self._read()
        now = self._clock()
        with self._lock:
            if value is not None:
                self._samples.append((now, value))
            self._trim(now)
        return value

    def _trim(self, now: float) -> None:
        for q in (self._samples, self._claims):
            while q and q[0][0] < now - self.window:
                q.popleft()

    def recent(self) -> int:
        """Bytes by which that free memory grew within the last ``window`` seconds (from
        its lowest sample then to now), less what :meth:`claim` gave out meanwhile."""
        value = self._read()
        now = self._clock()
        with self._lock:
            return self._recent(now, value)

    def _recent(self, now: float, value: Optional[int]) -> int:
        self._trim(now)
        if value is None:
            return 0
        low = min((v for _, v in self._samples), default=value)
        self._samples.append((now, value))
        return max(0, value - low - sum(n for _, n in self._claims))

    def claim(self, nbytes: int) -> int:
        """Bytes, in 2 MiB steps and at most ``nbytes``, of a buffer about to be
        allocated that may take huge pages (memory that recent); counted against later
        claims of the same window. Starts the sampling thread where it is not running."""
        value = self._read()
        now = self._clock()
        with self._lock:
            keep = min(int(nbytes), self._recent(now, value)) // _HUGE * _HUGE
            if keep:
                self._claims.append((now, keep))
            self._used = now
            if self._use_thread and self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="fastpersist-freewatch", daemon=True)
                self._thread.start()
        return keep

    def running(self) -> bool:
        """Whether the sampling thread runs."""
        with self._lock:
            return self._thread is not None

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            with self._lock:
                if self._clock() - self._used > self.idle:
                    self._thread = None
                    return
            self.sample()
        with self._lock:
            self._thread = None

    def close(self) -> None:
        """Stop the sampling thread and wait for it (one period at most)."""
        self._stop.set()
        with self._lock:
            t = self._thread
        if t is not None:
            t.join()


_huge: Optional[tuple[Optional[bool], str]] = None
_watch: Optional[FreeWatch] = None
_watch_lock = threading.Lock()


def huge_pages() -> tuple[Optional[bool], str]:
    """Whether fresh load buffers take transparent huge pages here: True (all of them),
    False (none) or None (chosen per buffer from the memory freed in the last :data:`RECENT_S`, see
    the module docstring), and why (a sentence, for ``fastpersist info``). The rule is a
    fact of the machine, decided once per process; :data:`HUGE_PAGES_ENV` overrides it."""
    global _huge
    if _huge is None:
        raw = os.environ.get(HUGE_PAGES_ENV, "").strip().lower()
        if raw in ("1", "on", "true", "yes"):
            _huge = (True, f"{HUGE_PAGES_ENV}={raw}")
        elif raw in ("0", "off", "false", "no"):
            _huge = (False, f"{HUGE_PAGES_ENV}={raw}")
        elif raw not in ("", "auto"):
            raise ValueError(f"{HUGE_PAGES_ENV}={raw!r}: expected on, off or auto")
        else:
            reporter = free_page_reporter()
            if reporter is not None:
                _huge = (None, f"chosen per load: free memory goes back to the hypervisor ({reporter}) about "
                               "2 s after it is freed, and a huge page carved from it faults in on the host "
                               "4 KiB at a time; a buffer takes huge pages for as much of it as memory was "
                               f"freed in blocks of 2 MiB and more in the last {RECENT_S:g} s "
                               "(/proc/buddyinfo), 4 KiB pages for the rest (all of it in a fresh process)")
            else:
                _huge = (True, "no free page reporting to a hypervisor: fresh buffers ask for transparent huge pages")
    return _huge


def staging_huge_pages() -> bool:
    """Whether the native staging buffers ask for transparent huge pages: yes, unless
    :data:`HUGE_PAGES_ENV` says ``off`` (see the module docstring for why they do not
    follow :func:`huge_pages`'s rule)."""
    raw = os.environ.get(HUGE_PAGES_ENV, "").strip().lower()
    return raw not in ("0", "off", "false", "no")


def forget_huge_pages() -> None:
    """Decide :func:`huge_pages` again at the next call, with a new :class:`FreeWatch` (tests)."""
    global _huge
    _huge = None
    set_free_watch(None)


def set_free_watch(watch: Optional[FreeWatch]) -> None:
    """Make ``watch`` the evidence :func:`choose_pages` consults (None: a new one of
    ``/proc/buddyinfo`` at the next call); the one it replaces is closed (tests)."""
    global _watch
    with _watch_lock:
        old, _watch = _watch, watch
    if old is not None and old is not watch:
        old.close()


def _free_watch() -> FreeWatch:
    global _watch
    with _watch_lock:
        if _watch is None:
            order = reporting_order()
            _watch = FreeWatch(lambda: large_free_bytes(order))
        return _watch


def _forget_watch_in_child() -> None:
    global _watch, _watch_lock
    _watch = None  # the parent's thread does not exist here; a fresh watch starts with no history
    _watch_lock = threading.Lock()  # another thread of the parent may have held it at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_watch_in_child)


def choose_pages(buffer: Any) -> Any:
    """Give a fresh, untouched native buffer (``ptr``, ``nbytes``) the page size
    :func:`huge_pages` chooses: ``MADV_NOHUGEPAGE`` where huge pages cost more than
    they save (on such a machine, for the part of the buffer beyond the memory freed in
    the last :data:`RECENT_S`). Returns ``buffer``. Call it before anything touches the
    buffer (a page already faulted in keeps its size); not for locked buffers (mlock
    faulted them in)."""
    n = int(buffer.nbytes)
    if n < _OWN_MAPPING_MIN:
        return buffer  # smaller buffers come from malloc's heap, never advised huge (and shared with neighbours)
    on = huge_pages()[0]
    if on:
        return buffer
    keep = 0 if on is False else _free_watch().claim(n)
    fn = _madvise()
    if keep < n and fn is not None:
        fn(int(buffer.ptr) + keep, n - keep, _MADV_NOHUGEPAGE)  # advice only: a refusal changes nothing
    return buffer


class Prefaulter:
    """Populates ``buffers`` (objects with ``ptr`` and ``nbytes``: page-aligned native
    buffers), in order, on a daemon thread started at construction. The thread holds
    the buffers until it ends; :meth:`close` stops it and waits (a fraction of a second
    at most: one :data:`STEP`)."""

    #: the running ones, stopped at interpreter exit (before finalization, so that no
    #: thread comes back from madvise into a finalizing interpreter)
    _live: "weakref.WeakSet[Prefaulter]" = weakref.WeakSet()

    def __init__(self, buffers: Sequence[Any]) -> None:
        self._buffers = list(buffers)
        self._stop = threading.Event()
        self.populated = 0  #: bytes populated so far
        self.error: Optional[int] = None  #: errno of a refused call (then the thread stopped)
        fn = _madvise()
        self._thread: Optional[threading.Thread] = None
        if fn is not None and self._buffers:
            self._thread = threading.Thread(target=self._run, args=(fn,), name="fastpersist-prefault", daemon=True)
            Prefaulter._live.add(self)
            self._thread.start()

    def _run(self, fn: Any) -> None:
        for b in self._buffers:
            ptr, n = int(b.ptr), int(b.nbytes)
            off = 0
            while off < n:
                if self._stop.is_set():
                    return
                step = min(STEP, n - off)
                if fn(ptr + off, step, _MADV_POPULATE_WRITE) != 0:  # GIL released during the call
                    self.error = ctypes.get_errno()
                    return
                self.populated += step
                off += step

    def close(self) -> None:
        """Stop populating and wait for the thread; drops the buffers."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._buffers = []


@atexit.register
def _stop_all() -> None:
    for p in list(Prefaulter._live):
        p.close()
    if _watch is not None:
        _watch.close()
