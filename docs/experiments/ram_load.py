"""Where a cold load's time goes on a fast disk (issue 27, piece 4).

A 1 GiB state (64 x 16 MiB fp32) is saved once by fastpersist and once by safetensors;
then, for ``--rounds`` rounds in a fresh random order, every way of reading it back runs
in a fresh Python process, the files dropped from the page cache first:

* ``fp-auto``, ``fp-direct``, ``fp-staged``, ``fp-buffered``: ``fastpersist.load`` with
  ``read_mode`` auto (default), O_DIRECT straight into the arena, O_DIRECT through the
  staging ring, buffered ``pread``;
* ``fp-direct-noprefault``: ``fp-direct`` with the product's pre-fault thread
  (``fastpersist.prefault``) switched off;
* ``fp-direct-prefault``: ``fp-direct``, with one more thread faulting the read buffers' pages
  in (``MADV_POPULATE_WRITE``, 32 MiB at a time, in file order) while the reads run: the
  experiment's first version of what ``fastpersist.prefault`` now does in every load;
* ``torch``: ``torch.load(weights_only=True)``;
* ``fp-into``: ``fastpersist.load_state_dict`` into a state whose pages were touched before
  the timing (the read path with no fresh memory: what a load could reach if faults were free);
* ``st``: ``safetensors.torch.load_file`` (maps the page cache: no anonymous memory), then one
  byte of every 4 KiB page read (what using the tensors faults in; as ``bench save`` times it);
* ``touch1``, ``touch2``: fault 1 GiB of fresh transparent-huge-page memory in, from 1 and
  2 threads (no I/O): the first-touch rate a load that returns new tensors pays;
* ``fio``: fio's O_DIRECT sequential read of a 1 GiB file (libaio, 1 MiB, depth 32).

Run (root for the RAM disk)::

    RD=$(bash ../shared/tools/ramdisk.sh up 4G /mnt/fp-ram)
    python docs/experiments/ram_load.py --dir "$RD" --rounds 5

Prints GB/s per way and round, medians, and each way against fio and safetensors.
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

GIB = 1 << 30

CHILD = r"""
import ctypes, json, os, sys, threading, time
mode, d = sys.argv[1], sys.argv[2]
import torch, fastpersist
from fastpersist.formats import torchload
path = os.path.join(d, "fp.pt")
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

def populate(addr, n, threads):
    per = n // threads
    def one(i):
        libc.madvise(addr + i * per, per, 23)  # MADV_POPULATE_WRITE
    ts = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    [t.start() for t in ts]; [t.join() for t in ts]

out = {}
if mode.startswith("touch"):
    import mmap
    m = mmap.mmap(-1, 1 << 30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = ctypes.c_char.from_buffer(m); addr = ctypes.addressof(buf)
    libc.madvise(addr, 1 << 30, 14)  # MADV_HUGEPAGE
    t = time.perf_counter(); populate(addr, 1 << 30, int(mode[-1])); out["s"] = time.perf_counter() - t
elif mode == "st":
    from safetensors.torch import load_file
    t = time.perf_counter(); sd = load_file(os.path.join(d, "st.safetensors"))
    # load_file returns tensors over a lazy mmap: read one byte of every 4 KiB page, as using them would
    sum(int(v.view(-1).view(torch.uint8)[::4096].sum()) for v in sd.values()); out["s"] = time.perf_counter() - t
elif mode == "torch":
    t = time.perf_counter(); sd = torch.load(path, weights_only=True); out["s"] = time.perf_counter() - t
elif mode == "fp-into":
    sd = {f"t{i}": torch.ones(4 << 20) for i in range(64)}
    cfg = fastpersist.Config(read_mode="direct", read_staging="off")
    t = time.perf_counter(); fastpersist.load_state_dict(sd, path, config=cfg); out["s"] = time.perf_counter() - t
else:
    kw = {"fp-auto": {}, "fp-direct": dict(read_mode="direct", read_staging="off"),
          "fp-direct-noprefault": dict(read_mode="direct", read_staging="off"),
          "fp-direct-prefault": dict(read_mode="direct", read_staging="off"),
          "fp-staged": dict(read_mode="direct", read_staging="on"),
          "fp-buffered": dict(read_mode="buffered")}[mode]
    if mode == "fp-direct-noprefault":  # the product's own pre-fault thread off
        from fastpersist.formats import torchload
        torchload.PREFAULT_MIN = 1 << 62
    if mode == "fp-direct-prefault":
        # every record of >= 1 MiB gets a buffer of its own (torchload._own_buffer), the rest
        # share the arena, allocated last: once it is, one thread faults them all in, in order
        own, orig_own, orig_alloc = [], torchload._own_buffer, torchload._Arena.allocate
        def own_buffer(file_offset, length, lock):
            buf, lead = orig_own(file_offset, length, lock)
            own.append(buf)
            return buf, lead
        def allocate(self, lock):
            orig_alloc(self, lock)
            bufs = own + [self.buffer]
            def run():
                step = 32 << 20
                for b in bufs:
                    for off in range(0, b.nbytes, step):
                        libc.madvise(b.ptr + off, min(step, b.nbytes - off), 23)
            threading.Thread(target=run, daemon=True).start()
        torchload._own_buffer = own_buffer
        torchload._Arena.allocate = allocate
    cfg = fastpersist.Config(**kw)
    t = time.perf_counter(); sd = fastpersist.load(path, config=cfg); out["s"] = time.perf_counter() - t
import resource
r = resource.getrusage(resource.RUSAGE_SELF)
out.update(minflt=r.ru_minflt, utime=r.ru_utime, stime=r.ru_stime)
print("RESULT " + json.dumps(out))
"""

WAYS = ("fp-auto", "fp-direct", "fp-direct-noprefault", "fp-direct-prefault", "fp-staged", "fp-buffered", "fp-into",
        "st", "torch",
        "touch1", "touch2", "fio")


def drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def setup(d: str) -> None:
    import torch
    from safetensors.torch import save_file

    import fastpersist

    g = torch.Generator().manual_seed(0)
    sd = {f"t{i}": torch.randn(4 << 20, generator=g) for i in range(64)}
    fastpersist.save(sd, os.path.join(d, "fp.pt"))
    save_file(sd, os.path.join(d, "st.safetensors"))
    with open(os.path.join(d, "fio.dat"), "wb") as f:
        for i in range(64):
            f.write(sd[f"t{i}"].numpy().tobytes())
        os.fsync(f.fileno())


def fio(d: str) -> float:
    p = subprocess.run(["fio", "--name=r", f"--filename={os.path.join(d, 'fio.dat')}", "--rw=read", "--bs=1M",
                        "--iodepth=32", "--ioengine=libaio", "--direct=1", "--size=1G", "--output-format=json"],
                       capture_output=True, text=True, check=True)
    job = json.loads(p.stdout)["jobs"][0]["read"]
    return job["io_bytes"] / (job["runtime"] / 1000.0) / 1e9


def one(way: str, d: str) -> dict:
    for name in ("fp.pt", "st.safetensors", "fio.dat"):
        drop(os.path.join(d, name))
    if way == "fio":
        return {"gbps": fio(d)}
    p = subprocess.run([sys.executable, "-c", CHILD, way, d], capture_output=True, text=True)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode or line is None:
        raise RuntimeError(f"{way}: exit {p.returncode}: {p.stderr[-800:]}")
    r = json.loads(line[7:])
    r["gbps"] = GIB / r["s"] / 1e9
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--json")
    a = ap.parse_args()
    ways = a.ways.split(",")
    setup(a.dir)
    res: dict[str, list[dict]] = {w: [] for w in ways}
    rng = random.Random(1)
    for rnd in range(a.rounds):
        order = ways[:]
        rng.shuffle(order)
        for w in order:
            res[w].append(one(w, a.dir))
        print(f"round {rnd + 1} ({time.strftime('%H:%M:%S')}, load {os.getloadavg()[0]:.1f}): "
              + "  ".join(f"{w} {res[w][-1]['gbps']:.2f}" for w in ways), flush=True)
    med = {w: statistics.median(r["gbps"] for r in res[w]) for w in ways}
    print(f"\n{'way':<20}{'median GB/s':>12}{'vs fio':>8}{'vs st':>8}{'minflt':>9}{'sys s':>7}  runs")
    for w in ways:
        rs = res[w]
        flt = statistics.median(r.get("minflt", 0) for r in rs)
        st = statistics.median(r.get("stime", 0) for r in rs)
        print(f"{w:<20}{med[w]:>12.2f}{med[w] / med['fio'] if 'fio' in med else 0:>8.2f}"
              f"{med[w] / med['st'] if 'st' in med else 0:>8.2f}{flt:>9.0f}{st:>7.2f}  "
              + " ".join(f"{r['gbps']:.2f}" for r in rs))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"results": res, "medians": med}, f, indent=1)


if __name__ == "__main__":
    main()
