"""Where the time of a load from s3:// goes, against s3proxy, in one run, interleaved.

    python tools/s3_load_profile.py [--mib 256] [--rounds 5]

A torch checkpoint of 32 tensors (256 MiB by default), loaded in rounds; every round
runs, one after the other:

- ``ceiling GET``: parallel ranged GETs of the object into a bytearray (the bench's
  GET ceiling: fastpersist's part size and threads);
- ``fetch, read(amt)``: the object into a memfd the way fastpersist did before
  (botocore's ``read(1 MiB)`` into bytes, copied into the mapping; no pre-fault; no CRC);
- ``fetch + CRC``: :func:`fastpersist.objectstore.fetch_for_reading` (bodies read
  into a per-thread buffer and copied into the memfd without the GIL, every record's
  CRC-32 computed as it arrives, then compared);
- ``loader, checked``: the format's loader over that memfd with its own CRC pass
  (what followed the fetch before); ``loader, no 2nd pass``: the same loader with the
  CRC pass skipped, as fetch_for_reading decides;
- ``fastpersist.load``: the whole load;
- ``s3torchconnector``: ``torch.load`` from its reader (AWS CRT client), if installed.

docs/objectstore.md quotes it. Run it on a quiet machine for figures to quote; on a
busy one compare within a run only.
"""
import argparse
import mmap
import os
import pathlib
import statistics
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import s3server  # noqa: E402
import torch  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--mib", type=int, default=256)
p.add_argument("--rounds", type=int, default=5)
p.add_argument("--gpt", action="store_true", help="the bench's GPT-style training state (501 tensors) instead")
args = p.parse_args()
scratch = tempfile.mkdtemp(prefix="s3loadprofile-")  # the server's data: removed at the end
srv = s3server.start(pathlib.Path(scratch))
os.environ.update(srv.env())
import fastpersist  # noqa: E402
from fastpersist import config, objectstore, s3client  # noqa: E402
from fastpersist.bench.s3_bench import _ceiling_get  # noqa: E402
from fastpersist.formats import registry  # noqa: E402
from fastpersist.s3url import S3Url  # noqa: E402

threads, part = config.get_default().s3_threads, config.get_default().s3_part_size
c = s3client.client(threads + 2)
c.create_bucket(Bucket="prof")
if args.gpt:
    from fastpersist.bench.save_bench import build_workload

    state = build_workload(args.mib << 20, None, seed=0)[0]
else:
    state = {"w%d" % i: torch.randn((args.mib << 20) // 32 // 4) for i in range(32)}
fastpersist.save(state, "s3://prof/x.pt")
url = S3Url("prof", "x.pt")
size = c.head_object(Bucket="prof", Key="x.pt")["ContentLength"]


def fetch_read_amt() -> int:
    """The object into a memfd with botocore's read(amt), as fastpersist did before."""
    etag = c.head_object(Bucket="prof", Key="x.pt")["ETag"]
    fd = os.memfd_create("prof", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
        view = memoryview(mm)

        def get(lo: int) -> None:
            hi = min(size, lo + part)
            body = c.get_object(Bucket="prof", Key="x.pt", Range=f"bytes={lo}-{hi - 1}", IfMatch=etag)["Body"]
            pos = lo
            while pos < hi:
                chunk = body.read(min(1 << 20, hi - pos))
                view[pos:pos + len(chunk)] = chunk
                pos += len(chunk)
            body.close()

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(get, range(0, size, part)))
        view.release()
    return fd


def loader(path: str, cfg: object) -> object:
    return registry.TORCH.load(path, cfg, registry.LoadRequest(path, None, None, None, True, {}))


s3tc = None
try:
    from s3torchconnector import S3Checkpoint, S3ClientConfig

    s3tc = S3Checkpoint(region=c.meta.region_name, endpoint=c.meta.endpoint_url,
                        s3client_config=S3ClientConfig(force_path_style=True, part_size=part))
except ImportError as e:
    print(f"(s3torchconnector not measured: {e})")

_ceiling_get(c, url, size, part, threads)  # warm-up
rows: dict[str, list[float]] = {k: [] for k in ("ceiling GET", "fetch, read(amt)", "loader, checked", "fetch + CRC",
                                                 "loader, no 2nd pass", "fastpersist.load", "s3torchconnector")}
for r in range(args.rounds):
    t = time.perf_counter(); _ceiling_get(c, url, size, part, threads)
    rows["ceiling GET"].append(time.perf_counter() - t)
    t = time.perf_counter(); fd = fetch_read_amt(); t1 = time.perf_counter()
    out = loader(f"/proc/self/fd/{fd}", config.get_default()); t2 = time.perf_counter()
    os.close(fd); del out
    rows["fetch, read(amt)"].append(t1 - t); rows["loader, checked"].append(t2 - t1)
    t = time.perf_counter(); got, cfg = objectstore.fetch_for_reading("s3://prof/x.pt"); t1 = time.perf_counter()
    assert cfg.checksum is False
    out = loader(got.path, cfg); t2 = time.perf_counter()
    got.close(); del out
    rows["fetch + CRC"].append(t1 - t); rows["loader, no 2nd pass"].append(t2 - t1)
    t = time.perf_counter(); out = fastpersist.load("s3://prof/x.pt")
    rows["fastpersist.load"].append(time.perf_counter() - t)
    del out
    if s3tc is not None:
        t = time.perf_counter()
        with s3tc.reader("s3://prof/x.pt") as rd:
            out = torch.load(rd)
        rows["s3torchconnector"].append(time.perf_counter() - t)
        del out
print(f"object {size / 1e9:.3f} GB, {args.rounds} rounds interleaved, {threads} threads, {part >> 20} MiB ranges; "
      "seconds, median (rounds); x ceiling: median over rounds of the ceiling's time / the row's")
for k, v in rows.items():
    if v:
        x = statistics.median(a / b for a, b in zip(rows["ceiling GET"], v))
        print(f"{k:22s} {statistics.median(v):.3f}  x ceiling {x:.2f}  ({' '.join(f'{x:.2f}' for x in v)})")
srv.stop()
shutil.rmtree(scratch, ignore_errors=True)
