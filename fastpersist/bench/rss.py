"""Peak resident memory of a process tree, sampled by a thread (``bench train``'s memory column)."""

from __future__ import annotations

import os
import threading


def _rss_tree(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (0 for a process gone meanwhile)."""
    total = 0
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/statm", encoding="ascii") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children", encoding="ascii") as f:
                    stack.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return total


class PeakMemory:
    """Peak resident memory of this process and its children above its value at start (a sampler thread)."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.start = _rss_tree(os.getpid())
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fastpersist-bench-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pid = os.getpid()
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, _rss_tree(pid))

    def stop(self) -> int:
        """Stop sampling; the peak above the start, in bytes."""
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_tree(os.getpid()))
        return max(0, self.peak - self.start)
