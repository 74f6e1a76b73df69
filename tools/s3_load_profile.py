"""Where the time of a load from s3:// goes, against s3proxy, in one run, interleaved.

    python tools/s3_load_profile.py

A 256 MiB torch checkpoint of 32 tensors: the GET ceiling (parallel ranged GETs of the
object into a bytearray, fastpersist's part size and threads), the fetch of the object
into a memfd (fastpersist.s3download), the format's loader over that memfd (index,
CRC-32 of every record, unpickling; mmap), and the whole ``fastpersist.load``.
docs/objectstore.md quotes it.
"""
import os
import pathlib
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import s3server, torch
srv = s3server.start(pathlib.Path(tempfile.mkdtemp()))
os.environ.update(srv.env())
import fastpersist
from fastpersist import s3client, objectstore, config
from fastpersist.formats import registry
from fastpersist.bench.s3_bench import _ceiling_get
from fastpersist.s3url import S3Url
c = s3client.client(10); c.create_bucket(Bucket="prof")
state = {"w%d" % i: torch.randn(8 << 20 >> 2) for i in range(32)}  # 256 MiB
fastpersist.save(state, "s3://prof/x.pt")
size = c.head_object(Bucket="prof", Key="x.pt")["ContentLength"]
_ceiling_get(c, S3Url("prof", "x.pt"), size, 16 << 20, 8)
rows = {"ceiling GET": [], "fetch into memfd": [], "loader over memfd": [], "fastpersist.load": []}
for r in range(5):
    t = time.perf_counter(); _ceiling_get(c, S3Url("prof", "x.pt"), size, 16 << 20, 8); rows["ceiling GET"].append(time.perf_counter() - t)
    t = time.perf_counter(); got = objectstore.fetch("s3://prof/x.pt"); t1 = time.perf_counter()
    out = registry.TORCH.load(got.path, config.get_default(), registry.LoadRequest(got.path, None, None, None, True, {})); t2 = time.perf_counter()
    got.close(); del out
    rows["fetch into memfd"].append(t1 - t); rows["loader over memfd"].append(t2 - t1)
    t = time.perf_counter(); fastpersist.load("s3://prof/x.pt"); rows["fastpersist.load"].append(time.perf_counter() - t)
print(f"object {size/1e9:.3f} GB, 5 rounds interleaved; seconds, median (rounds)")
for k, v in rows.items():
    print(f"{k:20s} {statistics.median(v):.3f}  ({' '.join(f'{x:.2f}' for x in v)})")
srv.stop()
