"""The write ceiling of a save benchmark: the best of fio's configurations and of fastpersist's raw engine.

fio with one configuration is not a ceiling: a save that beats it only shows
that fio was not configured for this disk. So the ceiling a save is compared
with is the higher of two medians measured in the same run, each in its turn
in the rotation beside the methods:

* fio's best configuration (:class:`fastpersist.bench.fio.FioProbe`: O_DIRECT
  over block sizes x queue depths, two jobs, a buffered write ended by fsync);
* the raw engine (:class:`EngineProbe`): ``fastpersist.io.IOHandle.pwrite`` of
  one page-locked buffer of the checkpoint's size, with fastpersist's own
  settings, ended by an fsync of the file and of its directory. No
  serialization, no copy: the fastest write ``fastpersist.save`` could do.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from fastpersist import config as config_mod
from fastpersist.bench.fsutil import fsync_dir, remove_path
from fastpersist.bench.io_bench import fill_pattern
from fastpersist.io import IOHandle, pinned_empty


@dataclass
class EngineCeiling:
    """GB/s of the raw engine's durable writes, one per round; the ceiling is their median."""

    nbytes: int
    settings: str = ""
    write_repeats: list[float] = field(default_factory=list)
    error: Optional[str] = None

    @property
    def write_gbps(self) -> Optional[float]:
        """Median GB/s of the rounds (``None`` before the first)."""
        return statistics.median(self.write_repeats) if self.write_repeats else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form (with ``write_gbps``)."""
        d = asdict(self)
        d["write_gbps"] = self.write_gbps
        return d


class EngineProbe:
    """Durable writes of one pinned buffer through :class:`fastpersist.io.IOHandle`, a round at a time.

    The buffer (``nbytes``, incompressible bytes) is allocated at the first
    round and kept until :meth:`close`. Never raises: an error is recorded in
    ``result.error`` and later rounds do nothing.
    """

    def __init__(self, directory: str, nbytes: int, config: Any = None) -> None:
        self.directory = os.path.abspath(directory)
        self.nbytes = nbytes
        self.config = config
        self.filename = os.path.join(self.directory, f".fastpersist-engine-{os.getpid()}.dat")
        self.result = EngineCeiling(nbytes=nbytes)
        self._buf: Any = None
        self._handle: Any = None

    @property
    def ok(self) -> bool:
        """Whether the probe can still run."""
        return self.result.error is None

    def _setup(self) -> None:
        cfg = self.config if self.config is not None else config_mod.get_default()
        self._handle = IOHandle.from_config(cfg)
        h = self._handle
        self.result.settings = (f"fastpersist.io.IOHandle.pwrite of one page-locked {self.nbytes}-byte buffer, "
                                f"engine {h.engine}, block {h.block_size >> 10} KiB, queue depth {h.queue_depth}, "
                                f"threads {h.threads}, direct {'on' if h.direct else 'off'}, fsync of file and "
                                "directory")
        self._buf = pinned_empty(self.nbytes)
        fill_pattern(self._buf, 1)

    def round(self) -> None:
        """One durable write of the buffer into a fresh file (removed afterwards)."""
        if not self.ok:
            return
        try:
            if self._handle is None:
                self._setup()
            remove_path(self.filename)
            os.sync()  # the previous file's blocks freed outside the timing
            t0 = time.perf_counter()
            self._handle.pwrite(self._buf, self.filename, fsync=True)
            fsync_dir(self.directory)
            seconds = time.perf_counter() - t0
            self.result.write_repeats.append(self.nbytes / seconds / 1e9)
        except (OSError, RuntimeError, ValueError, ImportError) as exc:
            self.result.error = f"{type(exc).__name__}: {exc}"
        finally:
            remove_path(self.filename)

    def close(self) -> None:
        """Free the buffer and remove the file (idempotent)."""
        self._buf = None
        self._handle = None
        remove_path(self.filename)


def write_ceiling(fio: Any, engine: Optional[EngineCeiling]) -> tuple[Optional[float], str]:
    """The higher of fio's write median and the raw engine's, and which one it is (``"fio"``, ``"engine"``, ``""``)."""
    cands = []
    if fio is not None and fio.write_gbps:
        cands.append((fio.write_gbps, "fio"))
    if engine is not None and engine.write_gbps:
        cands.append((engine.write_gbps, "engine"))
    if not cands:
        return None, ""
    return max(cands)
