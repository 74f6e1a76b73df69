"""N processes load the same cold 1 GiB checkpoint at the same moment: torch.load vs fastpersist.load with the
arena on transparent huge pages (default) vs 4 KiB pages (prctl PR_SET_THP_DISABLE in the loading process)."""
import os, sys, time, subprocess, random, statistics, json
D = "/work/bench/conc"; os.makedirs(D, exist_ok=True)
P = f"{D}/state.pt"
if not os.path.exists(P):
    import torch, fastpersist
    g = torch.Generator().manual_seed(0)
    fastpersist.save({f"w{i}": torch.randn(4 << 20, generator=g) for i in range(64)}, P)
CHILD = r'''
import os, sys, time, ctypes
mode, start = sys.argv[1], float(sys.argv[2])
if mode.endswith("4k"):
    ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
import torch, fastpersist
while time.time() < start: time.sleep(0.001)
t = time.perf_counter()
cfg = fastpersist.Config(read_mode="buffered") if mode.startswith("fpbuf") else (fastpersist.Config(read_mode="direct") if mode == "fpdirect" else None)
if mode == "fpbuf1": cfg = fastpersist.Config(read_mode="buffered", threads=1)
sd = torch.load(sys.argv[3], weights_only=True) if mode == "torch" else fastpersist.load(sys.argv[3], config=cfg)
print(time.perf_counter() - t)
'''
def run(mode, n):
    subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True); time.sleep(2)
    start = time.time() + 2.5
    ps = [subprocess.Popen([sys.executable, "-c", CHILD, mode, str(start), P], stdout=subprocess.PIPE, text=True) for _ in range(n)]
    return [float(p.communicate()[0]) for p in ps]
res = {}
modes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["torch", "fp", "fp4k"]
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    for n in (1, 2):
        for m in random.Random(r * 10 + n).sample(modes, len(modes)):
            ts = run(m, n); res.setdefault(f"{m} x{n}", []).append(max(ts))
            print(f"round {r} {m} x{n}: {' '.join(f'{t:.2f}' for t in ts)}", flush=True)
for k, v in sorted(res.items()):
    print(f"{k:10s} median slowest {statistics.median(v):.2f}s  runs {' '.join(f'{x:.2f}' for x in v)}")
