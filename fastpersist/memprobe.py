"""How fast this machine hands out fresh memory: the cap on every loader that returns new tensors.

A load that returns new tensors writes every byte into memory the process did not
have before. The kernel zeroes each fresh page on first touch, and on a virtual
machine whose guest reports free memory back to the host (virtio-balloon free
page reporting, as on Firecracker), the host must also back the page again: a
second fault, outside the guest. On the VM these benchmarks were developed on,
fresh memory filled at 0.8-3.5 GB/s while resident memory took 10 GB/s. fio's
read ceiling reads into one reused buffer and never pays this, so a loader can
trail fio's ceiling for a reason that is not I/O at all.

:func:`probe_fresh_memory` measures it (``MADV_POPULATE_WRITE`` on a fresh
anonymous mapping, from one thread and from several) and reads the guest's
free page reporting setting, for the header every benchmark prints.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

from fastpersist.io import libc_handle

_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_REPORTING_ORDER = "/sys/module/page_reporting/parameters/page_reporting_order"


@dataclass
class FreshMemory:
    """First-touch and resident write rates of anonymous memory, GB/s (1e9 B/s); ``None`` where unmeasured."""

    #: bytes populated per measurement
    probe_bytes: int
    #: fresh transparent-huge-page memory populated by one thread
    fresh_gbps_1: Optional[float] = None
    #: the same, split over ``threads`` threads
    fresh_gbps_n: Optional[float] = None
    threads: int = 1
    #: memset of the same memory once resident
    resident_gbps: Optional[float] = None
    #: the guest's free page reporting order (pages of 2**order x 4 KiB are given back to the host), if on
    page_reporting_order: Optional[int] = None
    #: why nothing was measured
    error: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form."""
        return asdict(self)

    def summary(self, verbose: bool = False) -> str:
        """One line for the benchmark header: a plain sentence; ``verbose`` adds the probe's detail."""
        if self.error:
            text = f"not measured ({self.error})"
        else:
            text = (f"memory a process never used fills at {self.fresh_gbps_1:.2f} GB/s (1 thread; "
                    f"{self.fresh_gbps_n:.2f} GB/s from {self.threads} threads), memory in use at "
                    f"{self.resident_gbps:.2f} GB/s; a load that returns new tensors cannot beat the first")
        if verbose:
            text += (f" [probe: MADV_POPULATE_WRITE of a fresh {self.probe_bytes >> 20} MiB mapping with "
                     "transparent huge pages, then memset")
            if self.page_reporting_order is not None:
                text += (f"; free page reporting on (order {self.page_reporting_order}: memory freed for ~2 s "
                         "goes back to the host and faults there again)")
            text += "]"
        return text


def page_reporting_order() -> Optional[int]:
    """The guest kernel's free page reporting order, or ``None`` when the module is absent."""
    try:
        with open(_REPORTING_ORDER, encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _libc() -> Any:
    found = libc_handle()
    if found is None:
        raise OSError("libc not found")
    return found


class _Mapping:
    """A fresh anonymous mapping with transparent huge pages, as the load arena gets."""

    def __init__(self, libc: Any, nbytes: int) -> None:
        self.libc = libc
        self.nbytes = nbytes
        self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._buf: Any = ctypes.c_char.from_buffer(self.map)
        self.addr = ctypes.addressof(self._buf)
        libc.madvise(ctypes.c_void_p(self.addr), ctypes.c_size_t(nbytes), _MADV_HUGEPAGE)

    def populate(self, threads: int) -> float:
        """Seconds to fault every page in from ``threads`` threads."""
        per = self.nbytes // threads
        errors: list[int] = []

        def fill(i: int) -> None:
            # ctypes drops the GIL around the call, so the threads fault pages in parallel
            rc = self.libc.madvise(ctypes.c_void_p(self.addr + i * per), ctypes.c_size_t(per), _MADV_POPULATE_WRITE)
            if rc != 0:
                errors.append(ctypes.get_errno())

        workers = [threading.Thread(target=fill, args=(i,)) for i in range(threads)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - t0
        if errors:
            raise OSError(errors[0], "madvise(MADV_POPULATE_WRITE) failed (Linux 5.14 or later needed)")
        return seconds

    def memset(self) -> float:
        """Seconds to write every byte once more (the pages are resident now)."""
        t0 = time.perf_counter()
        ctypes.memset(self.addr, 1, self.nbytes)
        return time.perf_counter() - t0

    def close(self) -> None:
        del self._buf
        self.map.close()


def probe_fresh_memory(nbytes: int = 256 << 20, threads: int = 2) -> FreshMemory:
    """Measure first-touch and resident write rates (about a second at 1 GB/s; never raises)."""
    threads = max(1, threads)
    nbytes = max(threads * mmap.PAGESIZE, nbytes // (threads * mmap.PAGESIZE) * threads * mmap.PAGESIZE)
    out = FreshMemory(probe_bytes=nbytes, threads=threads, page_reporting_order=page_reporting_order())
    try:
        libc = _libc()
        first = _Mapping(libc, nbytes)
        try:
            one = first.populate(1)
            # the second mapping is taken while the first is held, so it cannot get the pages just freed
            second = _Mapping(libc, nbytes)
            try:
                many = second.populate(threads)
            finally:
                second.close()
            resident = first.memset()
        finally:
            first.close()
    except (OSError, AttributeError, ValueError) as exc:
        out.error = str(exc) or type(exc).__name__
        return out
    out.fresh_gbps_1 = nbytes / one / 1e9
    out.fresh_gbps_n = nbytes / many / 1e9
    out.resident_gbps = nbytes / resident / 1e9
    return out
