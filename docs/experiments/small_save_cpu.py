"""Small saves against ``torch.save`` + fsync: wall time and CPU time (issue 35).

For each size (8 float32 tensors), ``--saves`` saves by each method, interleaved (the
order alternates), after one untimed save of each: ``torch.save`` into a file, then
``flush`` and ``os.fsync`` of the file; ``fastpersist.save`` (temporary file, fsync,
rename, fsync of the directory). Prints the median wall and CPU milliseconds (user +
system of this process, which a busy machine disturbs less than wall time) and
fastpersist's speedup (torch's median over fastpersist's). Run::

    python docs/experiments/small_save_cpu.py --dir /path/on/the/disk --saves 40
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch

import fastpersist


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--sizes", default="1,4,16", help="MiB, comma-separated")
    ap.add_argument("--saves", type=int, default=40)
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    for mib in (int(x) for x in a.sizes.split(",")):
        state = {f"t{i}": torch.randn((mib << 20) // 32) for i in range(8)}

        def torch_save(p: str) -> None:
            with open(p, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())

        ways = {"torch": torch_save, "fastpersist": lambda p: fastpersist.save(state, p)}
        paths = {w: os.path.join(a.dir, f"small-{w}.pt") for w in ways}
        for w, fn in ways.items():
            fn(paths[w])
        wall: dict[str, list[float]] = {w: [] for w in ways}
        cpu: dict[str, list[float]] = {w: [] for w in ways}
        for i in range(a.saves):
            for w in (list(ways) if i % 2 == 0 else list(ways)[::-1]):
                c0, t0 = _cpu(), time.perf_counter()
                ways[w](paths[w])
                wall[w].append(time.perf_counter() - t0)
                cpu[w].append(_cpu() - c0)
        m = {w: (statistics.median(wall[w]) * 1e3, statistics.median(cpu[w]) * 1e3) for w in ways}
        print(f"{mib:4d} MiB  torch.save+fsync {m['torch'][0]:7.2f} ms ({m['torch'][1]:5.2f} ms CPU)  "
              f"fastpersist.save {m['fastpersist'][0]:7.2f} ms ({m['fastpersist'][1]:5.2f} ms CPU)  "
              f"speedup wall {m['torch'][0] / m['fastpersist'][0]:.2f}x, CPU {m['torch'][1] / m['fastpersist'][1]:.2f}x",
              flush=True)
        for p in paths.values():
            os.unlink(p)


if __name__ == "__main__":
    main()
