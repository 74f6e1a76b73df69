"""Cold loads of small checkpoints: arenas under 4 MiB against one arena, and ``torch.load``.

For each size (``--tensors`` float32 tensors of that total size), a file saved by
``torch.save`` and one saved by ``fastpersist.save`` are loaded cold (both files
dropped from the page cache before every load), ``--rounds`` times, interleaved (the
order alternates between rounds), three ways: ``torch.load(weights_only=True)``;
``fastpersist.load`` with every small record in one arena (``ARENA_MAX`` set out of
reach: the layout before the arenas were cut); ``fastpersist.load`` as it is. Prints the
median milliseconds and the speedup against ``torch.load`` of the same rounds. Run::

    python docs/experiments/small_load_arenas.py --dir /path/on/the/disk --sizes 1MiB,4MiB,6MiB,16MiB --rounds 60
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch

import fastpersist
from fastpersist.bench.fsutil import drop_page_cache
from fastpersist.formats import torchload
from fastpersist.units import format_bytes, median, parse_size_list


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--sizes", default="1MiB,4MiB,6MiB,16MiB")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    pt, pf = os.path.join(args.dir, "arenas-torch.pt"), os.path.join(args.dir, "arenas-fastpersist.pt")
    cut = torchload.ARENA_MAX

    def fp_load(arena_max: int):
        def run():
            torchload.ARENA_MAX = arena_max
            try:
                return fastpersist.load(pf)
            finally:
                torchload.ARENA_MAX = cut
        return run

    try:
        for nbytes in parse_size_list(args.sizes):
            per = max(nbytes // args.tensors // 4, 1)
            state = {f"layer{i}.weight": torch.randn(per) for i in range(args.tensors)}
            torch.save(state, pt)
            fastpersist.save(state, pf)
            ways = {"torch": lambda: torch.load(pt, weights_only=True), "one arena": fp_load(1 << 62),
                    "arenas": fp_load(cut)}
            times: dict[str, list[float]] = {w: [] for w in ways}
            for w in ways:
                ways[w]()
            names = list(ways)
            for r in range(args.rounds):
                for w in names if r % 2 == 0 else reversed(names):
                    drop_page_cache(pt)
                    drop_page_cache(pf)
                    gc.collect()
                    t0 = time.perf_counter()
                    ways[w]()
                    times[w].append(time.perf_counter() - t0)
            base = median(times["torch"])
            print(f"{format_bytes(nbytes):>10} " + "  ".join(
                f"{w} {median(t) * 1e3:.2f} ms ({base / median(t):.2f}x)" for w, t in times.items()), flush=True)
    finally:
        for p in (pt, pf):
            if os.path.exists(p):
                os.remove(p)


if __name__ == "__main__":
    main()
