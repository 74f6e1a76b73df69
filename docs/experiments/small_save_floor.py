"""What a durable replace costs ``torch.save`` itself, against ``fastpersist.save``.

For each size (8 float32 tensors), ``--rounds`` saves by each way, interleaved (the order
alternates between rounds), after one untimed save of each:

* ``torch``: ``torch.save`` into the file, then ``fsync`` of the file (rewritten in place);
* ``torch atomic``: ``torch.save`` into a temporary file, its ``fsync``, ``rename`` over the
  file, ``fsync`` of the directory (what fastpersist's guarantee takes, with torch's writer);
* ``torch atomic, no dir fsync``: the same without the directory ``fsync``;
* ``fastpersist``: ``fastpersist.save``.

Prints the median milliseconds and the speedup against ``torch`` of the same rounds: the
``torch atomic`` figure is the floor a save with fastpersist's guarantee starts from on
that disk. Run::

    python docs/experiments/small_save_floor.py --dir /path/on/the/disk --sizes 1MiB,4MiB --rounds 60
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import fastpersist
from fastpersist.units import format_bytes, median, parse_size_list


def _fsync(path: str, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--sizes", default="1MiB,4MiB")
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()
    d = args.dir
    os.makedirs(d, exist_ok=True)

    def plain(state, path):
        torch.save(state, path)
        _fsync(path)

    def atomic(state, path, dir_fsync=True):
        tmp = path + ".tmp"
        torch.save(state, tmp)
        _fsync(tmp)
        os.rename(tmp, path)
        if dir_fsync:
            _fsync(d, os.O_RDONLY | os.O_DIRECTORY)

    ways = {"torch": plain, "torch atomic": atomic,
            "torch atomic, no dir fsync": lambda s, p: atomic(s, p, False), "fastpersist": fastpersist.save}
    paths = {w: os.path.join(d, f"floor-{i}.pt") for i, w in enumerate(ways)}
    try:
        for nbytes in parse_size_list(args.sizes):
            state = {f"layer{i}.weight": torch.randn(max(nbytes // 32, 1)) for i in range(8)}
            times: dict[str, list[float]] = {w: [] for w in ways}
            for w in ways:
                ways[w](state, paths[w])
            names = list(ways)
            for r in range(args.rounds):
                for w in names if r % 2 == 0 else reversed(names):
                    t0 = time.perf_counter()
                    ways[w](state, paths[w])
                    times[w].append(time.perf_counter() - t0)
            base = median(times["torch"])
            print(f"{format_bytes(nbytes):>10} " + "  ".join(
                f"{w} {median(t) * 1e3:.2f} ms ({base / median(t):.2f}x)" for w, t in times.items()), flush=True)
    finally:
        for p in paths.values():
            for q in (p, p + ".tmp"):
                if os.path.exists(q):
                    os.remove(q)


if __name__ == "__main__":
    main()
