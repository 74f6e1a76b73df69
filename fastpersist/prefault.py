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
transparent huge pages (``MADV_HUGEPAGE``), so that first touch zeroes 2 MiB per
fault. In a guest whose kernel reports free memory to the hypervisor (virtio-balloon
free page reporting, Hyper-V's balloon) that is the expensive way: the kernel reports
free blocks of 2 MiB and more (``page_reporting_order`` 9), the host takes their memory
back, and a huge page is then always carved from such a block, so zeroing it faults
every 4 KiB of it in on the host. On the reference VM a fresh process's first touch of
1 GiB took 3-4 s of system time with huge pages against 0.4-0.7 s with 4 KiB pages
(which come from blocks smaller than the reporting order, still backed), and a cold
1 GiB ``fastpersist.load`` went from 0.55-0.75x ``torch.load`` to 3-4x. There the
buffers get ``MADV_NOHUGEPAGE`` before anything touches them; elsewhere they keep huge
pages. A fact of the machine, not a measurement: the same machine always chooses the
same way. ``FASTPERSIST_LOAD_HUGE_PAGES=on|off`` overrides it.

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
import ctypes
import ctypes.util
import glob
import os
import threading
import weakref
from typing import Any, Optional, Sequence

__all__ = ["HUGE_PAGES_ENV", "Prefaulter", "STEP", "choose_pages", "huge_pages", "staging_huge_pages"]

_MADV_NOHUGEPAGE = 15
_MADV_POPULATE_WRITE = 23
#: The variable that overrides :func:`huge_pages` (``on``/``off``; unset or ``auto``: the rule).
HUGE_PAGES_ENV = "FASTPERSIST_LOAD_HUGE_PAGES"
#: native buffers this large are a mapping of their own, advised huge (native/src/handle.cpp)
_OWN_MAPPING_MIN = 4 << 20
_VIRTIO_BALLOON = 5  # virtio device id
_VIRTIO_BALLOON_F_REPORTING = 5  # feature bit
#: bytes populated per call (the stop flag is checked between calls)
STEP = 32 << 20
_libc: Optional[Any] = None


def _madvise() -> Optional[Any]:
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
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


_huge: Optional[tuple[bool, str]] = None


def huge_pages() -> tuple[bool, str]:
    """Whether fresh load buffers keep transparent huge pages here, and why (a
    sentence, for ``fastpersist info``). Decided once per process from what the machine
    is (see the module docstring); :data:`HUGE_PAGES_ENV` overrides it."""
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
                _huge = (False, f"free memory goes back to the hypervisor ({reporter}): a fresh huge "
                                "page would fault in on the host 4 KiB at a time")
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
    """Decide :func:`huge_pages` again at the next call (tests)."""
    global _huge
    _huge = None


def choose_pages(buffer: Any) -> Any:
    """Give a fresh, untouched native buffer (``ptr``, ``nbytes``) the page size
    :func:`huge_pages` chooses: ``MADV_NOHUGEPAGE`` where huge pages cost more than
    they save. Returns ``buffer``. Call it before anything touches the buffer (a page
    already faulted in keeps its size); not for locked buffers (mlock faulted them in)."""
    if int(buffer.nbytes) < _OWN_MAPPING_MIN or huge_pages()[0]:
        return buffer  # smaller buffers come from malloc's heap, never advised huge (and shared with neighbours)
    fn = _madvise()
    if fn is not None:
        fn(int(buffer.ptr), int(buffer.nbytes), _MADV_NOHUGEPAGE)  # advice only: a refusal changes nothing
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
