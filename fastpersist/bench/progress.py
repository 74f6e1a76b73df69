"""Progress of a benchmark: a tqdm bar on a terminal, plain lines anywhere else.

Redirected into a log file (CI, ``nohup``, ``| tee``), a bar redrawn with
carriage returns becomes one long line; there, each finished step prints one
line instead (``[3/12, 40 s] torch run 1/3: 5.1 s``: steps done, time so far, the step and its time) on standard error.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Optional, TextIO


class PlainProgress:
    """tqdm's ``set_description`` / ``update`` / ``close``, printed as one line per finished step."""

    def __init__(self, total: int, desc: str, unit: str = "run", out: Optional[TextIO] = None) -> None:
        self.total = total
        self.n = 0
        self.desc = desc
        self.unit = unit
        self.out = out if out is not None else sys.stderr
        self._t0 = time.perf_counter()
        self._step_t0 = self._t0

    def set_description(self, desc: str) -> None:
        """Name the step now running."""
        self.desc = desc

    def update(self, n: int = 1) -> None:
        """Count ``n`` finished steps and print one line."""
        self.n += n
        now = time.perf_counter()
        width = len(str(self.total))
        print(f"[{self.n:>{width}}/{self.total}, {now - self._t0:.0f} s] {self.desc}: {now - self._step_t0:.1f} s",
              file=self.out, flush=True)
        self._step_t0 = now

    def close(self) -> None:
        """Nothing to clear (the lines stay in the log)."""


class NoProgress:
    """Progress switched off (counts, prints nothing)."""

    def __init__(self) -> None:
        self.n = 0

    def set_description(self, desc: str) -> None:
        """Ignored."""

    def update(self, n: int = 1) -> None:
        """Count ``n`` steps."""
        self.n += n

    def close(self) -> None:
        """Ignored."""


def progress(total: int, enabled: bool, desc: str, unit: str = "run", stream: Optional[TextIO] = None) -> Any:
    """A tqdm bar labelled ``desc`` when ``stream`` (standard error) is a terminal, else :class:`PlainProgress`."""
    if not enabled:
        return NoProgress()
    stream = stream if stream is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True, file=stream)
    return PlainProgress(total, desc, unit, stream)
