"""What a checked ``mmap=True`` load costs (docs/loading.md, "Checked mmap loads").

A 1 GiB state (64 fp32 tensors of 16 MiB) is saved once with ``fastpersist.save``.
Each round runs every mode below once, in a fresh Python process (torch and
fastpersist imported before the clock starts), after evicting the file from the
page cache; only the load (and the touching) is timed. Modes, interleaved:

- ``checked``: ``fastpersist.load(path, mmap=True)`` (index, sizes and the CRC-32 of
  every storage over a mapping of the file, then torch maps it);
- ``checked+touch``: the same, then one byte of every 4 KiB page of every tensor read
  (what using the weights costs on top: torch's mapping is new, the pages are cached);
- ``torch+touch``: ``torch.load(path, mmap=True)`` (checks nothing), then the same touching:
  the unchecked way to the same pages in memory;
- ``default``: ``fastpersist.load(path)`` (parallel read into private buffers, checked).

Eviction: ``--drop file`` (default) writes the file back and drops its pages with
``posix_fadvise(DONTNEED)``, leaving other processes' caches alone (the machine may be
shared); ``--drop all`` does ``sync; echo 3 > /proc/sys/vm/drop_caches`` (root). The
fraction of the file still cached after eviction is printed with each run; ``--drop
none`` keeps the file cached (what the checking itself costs).

Usage::

    nice -n 19 python docs/experiments/mmap_load.py --dir /tmp/mmap_exp --rounds 3

Results (2026-11-23, 2-vCPU AMD EPYC VM, ext4 on virtio /dev/vda, read_ahead_kb 8192,
torch 2.15; the machine was shared with another engineer's benchmarks, which kept
one core busy (load average 2.9-3.5 during the runs); every process at nice 19;
seconds to load (and touch) the 1 GiB, median of 3 rounds [min-max])::

    mode             evicted (--drop file)     cached (--drop none)
    checked          1.07 [0.80-1.46]          0.24 [0.22-0.90]
    checked+touch    1.32 [1.15-1.42]          0.35 [0.23-0.62]
    torch+touch      0.82 [0.77-0.86]          0.11 [0.09-0.13]
    default          2.26 [2.11-2.35]          1.50 [1.28-1.79]

The file was evicted with ``posix_fadvise(DONTNEED)`` (0% cached before every run),
not with ``drop_caches``, so as not to empty the other engineer's page cache.
``torch.load(mmap=True)`` alone returns in 0.016 s (it reads nothing). On a machine
this loaded the spreads are wide; take the medians as rough.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

MODES = ("checked", "checked+touch", "torch+touch", "default")
N_TENSORS = 64
TENSOR_BYTES = 16 << 20


def make_state():
    import torch

    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(TENSOR_BYTES // 4, generator=g) for i in range(N_TENSORS)}


def touch(obj) -> int:
    """Read one byte of every 4 KiB page of every tensor (faults the mapping in)."""
    total = 0
    for t in obj.values():
        total += int(t.view(-1).view(dtype=__import__("torch").uint8)[::4096].sum())
    return total


def child(mode: str, path: str) -> None:
    import torch

    import fastpersist

    t0 = time.perf_counter()
    if mode.startswith("checked"):
        obj = fastpersist.load(path, mmap=True)
    elif mode == "torch+touch":
        obj = torch.load(path, mmap=True)
    else:
        obj = fastpersist.load(path)
    t1 = time.perf_counter()
    if mode.endswith("touch"):
        touch(obj)
    t2 = time.perf_counter()
    print(json.dumps({"mode": mode, "load": t1 - t0, "total": t2 - t0}))


def evict(path: str, how: str) -> float:
    from fastpersist.bench.fsutil import drop_page_cache
    from fastpersist.io import cached_fraction

    if how == "all":
        subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=True)
    elif how == "file":
        drop_page_cache(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        return cached_fraction(fd, os.fstat(fd).st_size) or 0.0
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/mmap_exp")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--drop", choices=("file", "all", "none"), default="file",
                    help="none: the file stays cached (warm runs: what the checking itself costs)")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "state.pt")
    if not os.path.exists(path) or os.path.getsize(path) < N_TENSORS * TENSOR_BYTES:
        import fastpersist

        fastpersist.save(make_state(), path)
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    rng = random.Random(0)
    for r in range(args.rounds):
        order = list(MODES)
        rng.shuffle(order)
        for mode in order:
            cached = evict(path, args.drop)
            out = subprocess.run(["nice", "-n", "19", sys.executable, __file__, "--child", mode, path],
                                 check=True, capture_output=True, text=True).stdout
            res = json.loads(out.strip().splitlines()[-1])
            results[mode].append(res)
            print(f"round {r} {mode:14s} load {res['load']:.3f} s  total {res['total']:.3f} s  "
                  f"(cached before: {cached:.0%})", flush=True)
    print()
    for mode in MODES:
        totals = [x["total"] for x in results[mode]]
        loads = [x["load"] for x in results[mode]]
        print(f"{mode:14s} total {statistics.median(totals):.3f} s [{min(totals):.3f}-{max(totals):.3f}]  "
              f"load {statistics.median(loads):.3f} s  "
              f"{N_TENSORS * TENSOR_BYTES / statistics.median(totals) / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
