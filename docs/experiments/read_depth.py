"""Cold loads at the read depth the device calls for against a fixed depth of 16, and ``torch.load``.

For each size (16 float32 tensors of that total size), a file saved by ``torch.save``
and one saved by ``fastpersist.save`` are loaded cold (both dropped from the page cache
before every load), ``--rounds`` times, interleaved (a shuffled order each round), three
ways: ``torch.load(weights_only=True)``; ``fastpersist.load`` as it is (``read_queue_depth``
None: the depth of the file's device, ``fastpersist info --dir`` says which);
``fastpersist.load`` with ``read_queue_depth=16``. ``--fresh`` runs every load in a new
Python process (imports done before the clock starts), as a resumed job loads; without
it the loads run in this process, one after another. Prints the median milliseconds and
the speedup against ``torch.load`` of the same rounds. Run::

    python docs/experiments/read_depth.py --dir /path/on/the/disk --sizes 16MiB,64MiB,256MiB,1GiB --rounds 12
    python docs/experiments/read_depth.py --dir /path/on/the/disk --sizes 1GiB --rounds 6 --fresh
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import subprocess
import sys
import time

import torch

import fastpersist
from fastpersist import readpolicy
from fastpersist.bench.fsutil import drop_page_cache
from fastpersist.config import Config
from fastpersist.units import format_bytes, median, parse_size_list

_CHILD = r"""
import sys, time, torch, fastpersist
from fastpersist.bench.fsutil import drop_page_cache
from fastpersist.config import Config
way, pf, pt = sys.argv[1:4]
drop_page_cache(pf); drop_page_cache(pt)
t0 = time.perf_counter()
if way == "torch":
    x = torch.load(pt, weights_only=True)
elif way == "device depth":
    x = fastpersist.load(pf)
else:
    x = fastpersist.load(pf, config=Config(read_queue_depth=16))
print(time.perf_counter() - t0)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--sizes", default="16MiB,64MiB,256MiB,1GiB")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--fresh", action="store_true", help="every load in a new process")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    print("read way:", readpolicy.describe_dir(args.dir, Config()).reason)
    pt, pf = os.path.join(args.dir, "depth-torch.pt"), os.path.join(args.dir, "depth-fastpersist.pt")
    fixed = Config(read_queue_depth=16)
    ways = {"torch": lambda: torch.load(pt, weights_only=True), "device depth": lambda: fastpersist.load(pf),
            "depth 16": lambda: fastpersist.load(pf, config=fixed)}
    try:
        for nbytes in parse_size_list(args.sizes):
            state = {f"layer{i}.weight": torch.randn(max(nbytes // 16 // 4, 1)) for i in range(16)}
            torch.save(state, pt)
            fastpersist.save(state, pf)
            del state
            times: dict[str, list[float]] = {w: [] for w in ways}
            for r in range(args.rounds):
                order = list(ways)
                random.Random(r).shuffle(order)
                for w in order:
                    if args.fresh:
                        out = subprocess.run([sys.executable, "-c", _CHILD, w, pf, pt], capture_output=True,
                                             text=True, check=True)
                        times[w].append(float(out.stdout.strip().splitlines()[-1]))
                        continue
                    drop_page_cache(pf)
                    drop_page_cache(pt)
                    gc.collect()
                    t0 = time.perf_counter()
                    x = ways[w]()
                    times[w].append(time.perf_counter() - t0)
                    del x
            base = median(times["torch"])
            where = "fresh processes" if args.fresh else "one process"
            print(f"{format_bytes(nbytes)} ({where}, {args.rounds} rounds):")
            for w, ts in times.items():
                print(f"  {w:13s} {median(ts) * 1e3:8.1f} ms  {base / median(ts):5.2f}x torch.load")
    finally:
        for p in (pt, pf):
            if os.path.exists(p):
                os.unlink(p)


if __name__ == "__main__":
    main()
