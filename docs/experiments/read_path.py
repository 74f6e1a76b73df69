"""The read-path experiment behind ``Config.read_staging`` (docs/benchmarks.md, "Staged reads").

Each round, for each reader in a shuffled order: delete the file and ``sync``, write
a fresh file with fio (8M, qd 32, libaio, O_DIRECT, ``end_fsync``), drop it from the
page cache, read it once. Readers:

- ``fio``: fio's read (``--bs``/``--iodepth`` below; libaio, O_DIRECT); fio's own
  bandwidth figure.
- ``zero-copy``: the native reader, every 8 MiB chunk straight into a fresh
  (unlocked, huge-page) buffer of the file's size; what ``read_staging=off`` does.
- ``staged``: the same, but through the staging ring and copied out
  (``Handle(stage_reads=True)``); what ``read_staging=on`` does.
- ``ring``: every chunk into a reused ring of ``queue depth x chunk`` bytes (chunk
  i at slot i mod depth); no copy, the data is overwritten. Not a loader, only the
  destination-footprint probe.

Usage (fio on PATH; the directory on the disk to measure)::

    python docs/experiments/read_path.py --dir /work/bench --size 2GiB --rounds 5

Prints each round and the medians (GB/s, decimal) with each reader's ratio to fio.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Callable

from fastpersist import _native
from fastpersist.bench.fio import run_fio
from fastpersist.bench.fsutil import drop_page_cache
from fastpersist.config import parse_size


def native_read(path: str, size: int, *, engine: str, chunk: int, depth: int, mode: str) -> float:
    """GB/s of one native read of ``path`` in ``mode`` (zero-copy, staged or ring)."""
    h = _native.Handle(engine, chunk, depth, 2, True, 2, mode == "staged")
    if mode == "ring":
        buf = _native.PinnedBuffer(depth * chunk, 4096, False)
        extents = [(o, buf.ptr + (o // chunk % depth) * chunk, min(chunk, size - o), -1) for o in range(0, size, chunk)]
    else:
        buf = _native.PinnedBuffer(size, 4096, False)
        extents = [(0, buf.ptr, size, -1)]
    t = time.perf_counter()
    h.read(path, extents, 0)
    return size / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--engine", default="psync")
    ap.add_argument("--chunk", default="8M")
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--fio-bs", default="8M")
    ap.add_argument("--fio-iodepth", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    size, chunk = parse_size("--size", a.size), parse_size("--chunk", a.chunk)
    fio_bs = parse_size("--fio-bs", a.fio_bs)
    path = os.path.join(os.path.abspath(a.dir), ".fastpersist-read-path.dat")
    kw = dict(engine=a.engine, chunk=chunk, depth=a.depth)
    readers: dict[str, Callable[[], float]] = {
        "fio": lambda: run_fio(path, "read", size, fio_bs, a.fio_iodepth).gbps,
        "zero-copy": lambda: native_read(path, size, mode="zero-copy", **kw),
        "staged": lambda: native_read(path, size, mode="staged", **kw),
        "ring": lambda: native_read(path, size, mode="ring", **kw),
    }
    got: dict[str, list[float]] = {n: [] for n in readers}
    rng = random.Random(a.seed)
    try:
        for r in range(a.rounds):
            order = list(readers)
            rng.shuffle(order)
            for name in order:
                if os.path.exists(path):
                    os.unlink(path)
                os.sync()
                run_fio(path, "write", size, 8 << 20, 32)
                drop_page_cache(path)
                got[name].append(readers[name]())
            print(f"round {r}: " + ", ".join(f"{n} {got[n][-1]:.2f}" for n in readers), flush=True)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    fio = statistics.median(got["fio"])
    for name, runs in got.items():
        m = statistics.median(runs)
        print(f"{name:10s} median {m:.2f} GB/s  {m / fio:.2f}x fio  ({' '.join(f'{x:.2f}' for x in runs)})")


if __name__ == "__main__":
    main()
