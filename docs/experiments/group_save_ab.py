"""A/B in one run: the group save of f5434ea (CRC first, then one write) vs the current one (write while
CRC, then CRC-field pages), 2 gloo ranks on this machine, 1 GiB GPT state, threads 1, plus the 1-rank save.

Setup: ``git show f5434ea:fastpersist/distributed.py > docs/experiments/olddist.py`` (the old module, loaded
beside the current one), then ``python docs/experiments/group_save_ab.py 7`` (rounds; every round runs the
three ways in a seeded shuffled order; durable saves, timed on each rank from a barrier to a barrier).

Result (2026-11-23 ~21:40 UTC, quiet 2-vCPU VM, disk slow that minute), medians of 7:
old 2.12 s, new 2.04 s, one-rank fastpersist.save 2.14 s; all three files byte-identical.
"""
import os, sys, time, random, statistics, socket
import torch, torch.distributed as dist, torch.multiprocessing as mp
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # olddist.py, see the docstring

def worker(rank, world, port, rounds, out):
    os.environ.setdefault("OMP_NUM_THREADS", "1"); torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    import fastpersist, olddist
    from fastpersist import distributed as newdist
    from fastpersist.bench.state import build_training_state
    st = build_training_state(1 << 30)
    cfg = fastpersist.Config(threads=1)
    D = "/work/bench/ab"; os.makedirs(D, exist_ok=True)
    ways = {"old": lambda p: olddist.save(st, p, group=dist.group.WORLD, config=cfg),
            "new": lambda p: newdist.save(st, p, group=dist.group.WORLD, config=cfg),
            "one": lambda p: fastpersist.save(st, p, config=cfg) if rank == 0 else None}
    res = {k: [] for k in ways}
    for r in range(rounds + 1):
        for k in random.Random(r).sample(list(ways), 3):
            p = f"{D}/{k}.pt"
            dist.barrier(); os.sync(); time.sleep(0.5); dist.barrier()
            t = time.perf_counter(); ways[k](p); dist.barrier(); dt = time.perf_counter() - t
            if r: res[k].append(dt)
    if rank == 0:
        import filecmp
        print("identical old/new/one:", filecmp.cmp(f"{D}/old.pt", f"{D}/new.pt", False), filecmp.cmp(f"{D}/one.pt", f"{D}/new.pt", False))
        for k, v in res.items():
            print(f"{k}: median {statistics.median(v):.3f}s  {(1<<30)/statistics.median(v)/1e9:.2f} GB/s  runs {' '.join(f'{x:.2f}' for x in v)}", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(worker, args=(2, port, int(sys.argv[1]) if len(sys.argv) > 1 else 5, None), nprocs=2)
