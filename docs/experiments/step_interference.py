"""Which background work slows a one-thread training step (docs/benchmarks.md, "Training
time lost to checkpointing"). Writes a 469 MiB file under the directory given (default
/work/bench/train) several times; run on a quiet machine: python docs/experiments/step_interference.py DIR

Part 1 (raw work, no fastpersist save): a background thread writes 469 MiB with O_DIRECT, O_DIRECT +
fsync, buffered, buffered + fsync, or copies it in memory, started together with a training step;
prints the median of that step, the next one, and the step after the work finished.
Part 2: fastpersist.save_async (snapshot) with its disk writes and/or CRC-32s switched off by
monkeypatching (a probe, not product settings), the call and the two steps after it.
"""
torch.set_num_threads(1)
from fastpersist.io import IOHandle, pinned_empty
from fastpersist import _native
from fastpersist.bench.train_bench import GPT
model = GPT(8192, 768, 4, 12, 32); opt = torch.optim.Adam(model.parameters(), lr=1e-4)
x = torch.randint(0, 8192, (2, 32))
def step():
    opt.zero_grad(set_to_none=True); out = model(x)
    torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), x.reshape(-1)).backward(); opt.step()
for _ in range(3): step()
N = 469 << 20
src = pinned_empty(N); src.fill_(1); dst = pinned_empty(N); dst.fill_(2)
h = IOHandle(threads=2)
D = sys.argv[1] if len(sys.argv) > 1 else "/work/bench/train"
os.makedirs(D, exist_ok=True)
def odirect(): h.pwrite(src, f"{D}/io.bin")
def odirect_fsync():
    h.pwrite(src, f"{D}/io.bin"); fd = os.open(f"{D}/io.bin", os.O_RDONLY); os.fsync(fd); os.close(fd)
def buffered():
    with open(f"{D}/io.bin", "wb") as f: f.write(memoryview(src.numpy()))
def buffered_fsync():
    with open(f"{D}/io.bin", "wb") as f: f.write(memoryview(src.numpy())); f.flush(); os.fsync(f.fileno())
def memcpy(): dst.copy_(src)
def none(): pass
kinds = ["none", "odirect", "odirect_fsync", "buffered", "buffered_fsync", "memcpy"]
res = {}
for r in range(4):
    for k in random.Random(r).sample(kinds, len(kinds)):
        for i in range(4):
            os.sync(); time.sleep(0.3)
            th = threading.Thread(target=globals()[k]); t = time.perf_counter(); th.start()
            step(); t1 = time.perf_counter(); step(); t2 = time.perf_counter(); th.join(); tj = time.perf_counter()
            step(); t3 = time.perf_counter()
            res.setdefault(k, []).append((t1 - t, t2 - t1, t3 - tj, tj - t))
for k in kinds:
    v = res[k]
    print(f"{k:15s} step0 {statistics.median(a[0] for a in v):.3f} step1 {statistics.median(a[1] for a in v):.3f} after {statistics.median(a[2] for a in v):.3f}  bg-done {statistics.median(a[3] for a in v):.2f}s")

# ---- part 2: save_async snapshot with parts switched off
import fastpersist
from fastpersist import asyncsave

state = {"model": model.state_dict(), "opt": opt.state_dict()}
fastpersist.save_async(state, f"{D}/sp.pt").wait()


class _Done:
    def done(self): return True
    def wait(self, t=None): return True
    def result(self, t=None): return []


class _NoWrite:
    def __init__(self, h): self.h = h
    def write_async(self, *a, **k): return _Done()
    def __getattr__(self, n): return getattr(self.h, n)


real_io, real_many = asyncsave._io_handle, _native.crc32_many


def variant(v):
    asyncsave._io_handle = (lambda cfg: _NoWrite(real_io(cfg))) if v in ("nowrite", "nothing") else real_io
    _native.crc32_many = (lambda r: [0] * len(r)) if v in ("nocrc", "nothing") else real_many


res2 = {}
for r in range(4):
    for v in random.Random(r).sample(["none", "full", "nocrc", "nowrite", "nothing"], 5):
        variant(v)
        for i in range(5):
            step()
            t = time.perf_counter()
            f = fastpersist.save_async(state, f"{D}/sp.pt") if v != "none" else None
            tc = time.perf_counter(); step(); t1 = time.perf_counter(); step(); t2 = time.perf_counter()
            res2.setdefault(v, []).append((tc - t, t1 - tc, t2 - t1))
            if f is not None: f.wait()
variant("full")
for k, v in res2.items():
    print(f"{k:8s} call {statistics.median(a for a, _, _ in v):.3f} step0 {statistics.median(b for _, b, _ in v):.3f} "
          f"step1 {statistics.median(c for _, _, c in v):.3f}")
for name in ("io.bin", "sp.pt"):
    try: os.unlink(os.path.join(D, name))
    except OSError: pass
