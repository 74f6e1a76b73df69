"""DCP saves: stock ``FileSystemWriter`` vs ``fastpersist.dcp.FastPersistWriter``.

N ranks (forked processes, gloo on CPU) each hold a unique shard (``--mib`` MiB per
rank, in tensors of ``--tensor-mib``) and call ``dcp.save`` with one writer or the
other, same ``thread_count``, ``sync_files=True`` (durable), into a fresh directory.
Rounds alternate the writers (interleaved); each save's time is the slowest
rank's, from a barrier before to the return of ``dcp.save``. Prints each round and
the medians, and loads (warm page cache: the file was just written) with both
readers once at the end as a check.

    python docs/experiments/dcp_save.py --dir /work/bench --ranks 2 --mib 512 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import time
import warnings


def _rank(rank: int, args: argparse.Namespace, store: str, q: "mp.Queue") -> None:
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from fastpersist.dcp import FastPersistReader, FastPersistWriter

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=args.ranks)
    g = torch.Generator().manual_seed(rank)
    n = max(1, args.mib // args.tensor_mib)
    numel = args.tensor_mib * (1 << 20) // 4
    state = {f"r{rank}.t{i}": torch.randn(numel, generator=g) for i in range(n)}
    state["step"] = 100
    writers = {
        "dcp": lambda p: dcp.FileSystemWriter(p, thread_count=args.threads, sync_files=True),
        "fastpersist": lambda p: FastPersistWriter(p, thread_count=args.threads, sync_files=True),
    }
    for rnd in range(args.rounds):
        order = list(writers) if rnd % 2 == 0 else list(reversed(writers))
        for name in order:
            path = os.path.join(args.dir, f"dcp-bench-{name}")
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=writers[name](path))
            dt = time.perf_counter() - t0
            q.put((rnd, name, rank, dt))
            dist.barrier()
    for name, reader in (("dcp", dcp.FileSystemReader), ("fastpersist", FastPersistReader)):
        for rname, rd in (("dcp", dcp.FileSystemReader), ("fastpersist", FastPersistReader)):
            path = os.path.join(args.dir, f"dcp-bench-{name}")
            target = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in state.items()}
            dist.barrier()
            t0 = time.perf_counter()
            dcp.load(target, storage_reader=rd(path))
            dt = time.perf_counter() - t0
            assert all(torch.equal(target[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))
            q.put(("load", f"{name}-by-{rname}", rank, dt))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mib", type=int, default=512, help="MiB per rank")
    ap.add_argument("--tensor-mib", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="thread_count of both writers")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    store = os.path.join(args.dir, f".dcp-bench-store-{os.getpid()}")
    ctx = mp.get_context("spawn")
    q: "mp.Queue" = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, store, q)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    rows: dict[tuple, list[float]] = {}
    while any(p.is_alive() for p in procs) or not q.empty():
        try:
            rnd, name, _rank_, dt = q.get(timeout=1)
        except Exception:  # noqa: BLE001 - queue.Empty
            continue
        rows.setdefault((rnd, name), []).append(dt)
    for p in procs:
        p.join()
    total = args.ranks * args.mib
    print(f"{args.ranks} ranks x {args.mib} MiB ({total} MiB), tensors of {args.tensor_mib} MiB, "
          f"thread_count={args.threads}, sync_files=True, dir={args.dir}")
    saves: dict[str, list[float]] = {}
    for (rnd, name), dts in sorted(rows.items(), key=lambda kv: str(kv[0])):
        if len(dts) != args.ranks:
            continue
        t = max(dts)
        if rnd == "load":
            print(f"load {name:28s} {t:7.3f} s  {total / 1024 / t:6.2f} GiB/s (warm cache)")
        else:
            saves.setdefault(name, []).append(t)
            print(f"round {rnd} {name:12s} {t:7.3f} s  {total / 1024 / t:6.2f} GiB/s")
    med = {k: statistics.median(v) for k, v in saves.items()}
    for k, v in med.items():
        print(f"median {k:12s} {v:7.3f} s  {total / 1024 / v:6.2f} GiB/s")
    if "dcp" in med and "fastpersist" in med:
        print(f"speedup (median dcp / median fastpersist): {med['dcp'] / med['fastpersist']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "saves": saves, "median": med}, f, indent=1)
    for name in ("dcp", "fastpersist"):
        shutil.rmtree(os.path.join(args.dir, f"dcp-bench-{name}"), ignore_errors=True)
    try:
        os.unlink(store)
    except FileNotFoundError:
        pass


if __name__ == "__main__":
    main()
