"""Cold loads in fresh processes: transparent huge pages against 4 KiB pages (issue 35).

A 1 GiB state (64 x 16 MiB fp32) is saved once by ``fastpersist.save`` and once by
``torch.save``; then, for ``--rounds`` rounds in a fresh random order, each way loads it
in a fresh Python process (imports untimed) after both files are dropped from the page
cache:

* ``torch``: ``torch.load(weights_only=True)``;
* ``fp``: ``fastpersist.load`` as it is (the page size :func:`fastpersist.prefault.huge_pages`
  chooses here);
* ``fp-huge``, ``fp-small``: the same with ``FASTPERSIST_LOAD_HUGE_PAGES=on`` / ``off``.

Per way: the median wall time and its ratio to ``torch``, the median CPU seconds of the
load (user + system: robust to a busy machine, unlike wall time), minor faults and the
machine's ``thp_fault_alloc`` during the load. Run::

    python docs/experiments/cold_load_pages.py --dir /path/on/the/disk --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time

WAYS = {"torch": None, "fp": None, "fp-huge": "on", "fp-small": "off"}


def _vmstat(key: str) -> int:
    with open("/proc/vmstat") as f:
        for line in f:
            k, v = line.split()
            if k == key:
                return int(v)
    return 0


def child(way: str, d: str) -> None:
    import torch

    import fastpersist

    path = os.path.join(d, "torch.pt" if way == "torch" else "fp.pt")
    r0, thp0, t0 = resource.getrusage(resource.RUSAGE_SELF), _vmstat("thp_fault_alloc"), time.perf_counter()
    if way == "torch":
        out = torch.load(path, map_location="cpu", weights_only=True)
    else:
        out = fastpersist.load(path, map_location="cpu", weights_only=True)
    t1, r1, thp1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF), _vmstat("thp_fault_alloc")
    del out
    print(json.dumps({"s": t1 - t0, "cpu": r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime,
                      "minflt": r1.ru_minflt - r0.ru_minflt, "thp": thp1 - thp0}))


def _evict(d: str) -> None:
    for name in ("fp.pt", "torch.pt"):
        fd = os.open(os.path.join(d, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child, a.dir)
    import torch

    import fastpersist
    from fastpersist import prefault

    os.makedirs(a.dir, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(4 << 20, generator=g) for i in range(64)}
    fastpersist.save(state, os.path.join(a.dir, "fp.pt"))
    with open(os.path.join(a.dir, "torch.pt"), "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    del state
    print("page size chosen here:", prefault.huge_pages())
    runs: dict[str, list[dict]] = {w: [] for w in WAYS}
    for r in range(a.rounds):
        order = list(WAYS)
        random.Random(r).shuffle(order)
        for way in order:
            env = dict(os.environ)
            env.pop(prefault.HUGE_PAGES_ENV, None)
            if WAYS[way]:
                env[prefault.HUGE_PAGES_ENV] = WAYS[way]
            _evict(a.dir)
            out = subprocess.run([sys.executable, __file__, "--dir", a.dir, "--child", way], env=env,
                                 capture_output=True, text=True, check=True)
            runs[way].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(r, way, runs[way][-1], flush=True)
    base = statistics.median(x["s"] for x in runs["torch"])
    print(f"{'way':10s} {'wall s':>8s} {'x torch':>8s} {'cpu s':>7s} {'minflt':>8s} {'thp':>5s}")
    for way, xs in runs.items():
        med = {k: statistics.median(x[k] for x in xs) for k in ("s", "cpu", "minflt", "thp")}
        print(f"{way:10s} {med['s']:8.3f} {base / med['s']:8.2f} {med['cpu']:7.3f} {med['minflt']:8.0f} {med['thp']:5.0f}")
    for name in ("fp.pt", "torch.pt"):
        os.unlink(os.path.join(a.dir, name))


if __name__ == "__main__":
    main()
