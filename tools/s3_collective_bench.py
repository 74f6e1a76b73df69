"""Collective saves and loads to s3:// against one-process ones, same server, same run.

Starts s3proxy (tests/s3server.py: filesystem backend in a temporary directory) and two
gloo ranks (forked, CPU). Each round, interleaved: a one-process ``fastpersist.save`` of
the state from rank 0 (rank 1 waits), then ``fastpersist.save(..., group=WORLD)`` from
both ranks (each uploads half the parts), then ``fastpersist.load`` from rank 0 alone and
``fastpersist.load(..., group=WORLD)`` on both ranks (each fetches the whole object).
Prints every round and the medians; GB/s = 10^9 bytes/s of the object per wall second
(for the collective load: bytes delivered to one rank).

    python tools/s3_collective_bench.py --mib 128 --rounds 3
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import s3server  # noqa: E402


def _rank(rank: int, store: str, mib: int, rounds: int, url: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    import fastpersist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}": torch.randn(mib * (1 << 20) // 4 // 16, generator=g) for i in range(16)}
    size = sum(t.nbytes for t in state.values())
    wg = dist.group.WORLD
    rows = []
    for r in range(rounds):
        row = {}
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            fastpersist.save(state, url)
        dist.barrier()
        row["save, 1 process"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        fastpersist.save(state, url, group=wg)
        dist.barrier()
        row["save, group of 2"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if rank == 0:
            fastpersist.load(url)
        dist.barrier()
        row["load, 1 process"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        fastpersist.load(url, group=wg)
        dist.barrier()
        row["load, group of 2"] = time.perf_counter() - t0
        rows.append(row)
        if rank == 0:
            print(f"round {r + 1}: " + ", ".join(f"{k} {size / v / 1e9:.3f} GB/s" for k, v in row.items()), flush=True)
    if rank == 0:
        with open(out, "w") as f:
            for k in rows[0]:
                med = statistics.median(size / row[k] / 1e9 for row in rows)
                f.write(f"{k}: median {med:.3f} GB/s\n")
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="s3collective-")
    srv = s3server.start(Path(tmp) / "server")
    try:
        os.environ.update(srv.env())
        import boto3
        from botocore.config import Config

        c = boto3.client("s3", endpoint_url=srv.endpoint, aws_access_key_id=srv.access_key,
                         aws_secret_access_key=srv.secret_key, region_name=srv.region,
                         config=Config(s3={"addressing_style": "path"}, request_checksum_calculation="when_required"))
        c.create_bucket(Bucket="bench")
        url = "s3://bench/state.pt"
        out = os.path.join(tmp, "result")
        ctx = mp.get_context("fork")
        procs = [ctx.Process(target=_rank, args=(r, os.path.join(tmp, "store"), args.mib, args.rounds, url, out))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            print("a rank failed", file=sys.stderr)
            return 1
        print(f"{args.mib} MiB state, 2 gloo ranks on one machine ({os.cpu_count()} CPUs), s3proxy {s3server.VERSION} "
              "filesystem backend, interleaved")
        print(Path(out).read_text(), end="")
    finally:
        srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
