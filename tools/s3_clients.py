"""Measure the S3 client candidates against one s3proxy server, in one run, interleaved.

    python tools/s3_clients.py [--mib 256] [--rounds 3] [--threads 8] [--part-mib 16] [--https]

Starts s3proxy (tests/s3/s3server.py: filesystem backend in a temporary directory) and
for each client that imports: a parallel multipart upload of in-memory bytes, and
parallel ranged GETs of the object into memory. Prints each round and the median in
GB/s (10^9 bytes/s); a client that fails says why. ``--https``: the server speaks
HTTPS with a self-signed certificate (trusted through AWS_CA_BUNDLE/SSL_CERT_FILE). The
figures in docs/objectstore.md come from this script.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import s3server  # noqa: E402


def boto_client(srv: Any, conns: int, sign_payloads: bool = True) -> Any:
    """A boto3 client on ``srv``; ``sign_payloads=False``: UNSIGNED-PAYLOAD (else botocore's default)."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=srv.endpoint, aws_access_key_id=srv.access_key,
                        verify=str(srv.ca_bundle) if srv.ca_bundle else None,
                        aws_secret_access_key=srv.secret_key, region_name=srv.region,
                        config=Config(s3={"addressing_style": "path",
                                          **({} if sign_payloads else {"payload_signing_enabled": False})},
                                      max_pool_connections=conns,
                                      request_checksum_calculation="when_required",
                                      response_checksum_validation="when_required"))


def boto_multipart(c: Any, bucket: str, key: str, data: bytes, part: int, threads: int) -> None:
    up = c.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    mv = memoryview(data)

    def put(i: int) -> dict:
        body = bytes(mv[i * part:(i + 1) * part])
        r = c.upload_part(Bucket=bucket, Key=key, UploadId=up, PartNumber=i + 1, Body=body)
        return {"PartNumber": i + 1, "ETag": r["ETag"]}

    n = -(-len(data) // part)
    with ThreadPoolExecutor(threads) as pool:
        parts = list(pool.map(put, range(n)))
    c.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up, MultipartUpload={"Parts": parts})


def boto_ranged_get(c: Any, bucket: str, key: str, size: int, part: int, threads: int) -> bytes:
    out = bytearray(size)

    def get(lo: int) -> None:
        hi = min(size, lo + part)
        body = c.get_object(Bucket=bucket, Key=key, Range=f"bytes={lo}-{hi - 1}")["Body"]
        pos = lo
        while pos < hi:
            chunk = body.read(1 << 20)
            if not chunk:
                break
            out[pos:pos + len(chunk)] = chunk
            pos += len(chunk)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(get, range(0, size, part)))
    return bytes(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--part-mib", type=int, default=16)
    ap.add_argument("--https", action="store_true")
    args = ap.parse_args()
    size = args.mib << 20
    part = args.part_mib << 20
    data = os.urandom(size)
    digest = hashlib.sha256(data).digest()
    scratch = Path(tempfile.mkdtemp(prefix="s3clients-"))  # the server's data: removed at the end
    srv = s3server.start(scratch, tls=args.https)
    os.environ.update(srv.env())
    try:
        c = boto_client(srv, args.threads + 2)
        c.create_bucket(Bucket="bench")
        methods: dict[str, Callable[[int], Any]] = {}
        methods["boto3 multipart (threads)"] = lambda r: boto_multipart(c, "bench", f"b{r}", data, part, args.threads)
        cu = boto_client(srv, args.threads + 2, sign_payloads=False)
        methods["boto3 multipart, unsigned payload"] = lambda r: boto_multipart(cu, "bench", f"u{r}", data, part,
                                                                                args.threads)

        def transfer(r: int) -> None:
            import io

            from boto3.s3.transfer import TransferConfig
            c.upload_fileobj(io.BytesIO(data), "bench", f"t{r}",
                             Config=TransferConfig(multipart_threshold=part, multipart_chunksize=part,
                                                   max_concurrency=args.threads))
        methods["boto3 s3transfer upload_fileobj"] = transfer
        gets: dict[str, Callable[[str], bytes]] = {
            "boto3 ranged GETs (threads)": lambda k: boto_ranged_get(c, "bench", k, size, part, args.threads)}
        try:
            import obstore
            from obstore.store import S3Store

            store = S3Store("bench", endpoint=srv.endpoint, access_key_id=srv.access_key,
                            secret_access_key=srv.secret_key, region=srv.region, virtual_hosted_style_request=False,
                            client_options={"allow_http": True})
            if args.https:
                raise ImportError("no option found here to trust a self-signed certificate")
            methods["obstore put (multipart)"] = lambda r: obstore.put(store, f"o{r}", data, chunk_size=part,
                                                                      max_concurrency=args.threads)

            def ob_get(k: str) -> bytes:
                starts = list(range(0, size, part))
                ends = [min(size, s + part) for s in starts]
                return b"".join(bytes(b) for b in obstore.get_ranges(store, k, starts=starts, ends=ends))
            gets["obstore get_ranges"] = ob_get
            gets["obstore get (one GET)"] = lambda k: bytes(obstore.get(store, k).bytes())
        except ImportError as e:
            print("obstore: not measured:", e)
        try:
            from s3torchconnector import S3Checkpoint, S3ClientConfig

            ckpt = S3Checkpoint(region=srv.region, endpoint=srv.endpoint,
                                s3client_config=S3ClientConfig(force_path_style=True, part_size=part))

            def crt_put(r: int) -> None:
                with ckpt.writer(f"s3://bench/c{r}") as w:
                    w.write(data)
            methods["s3torchconnector writer (CRT)"] = crt_put

            def crt_get(k: str) -> bytes:
                with ckpt.reader(f"s3://bench/{k}") as rd:
                    return rd.read()
            gets["s3torchconnector reader (CRT)"] = crt_get
        except Exception as e:  # noqa: BLE001 - report and go on
            print("s3torchconnector: unavailable:", type(e).__name__, e)
        put_t: dict[str, list[float]] = {m: [] for m in methods}
        get_t: dict[str, list[float]] = {m: [] for m in gets}
        failed: dict[str, str] = {}
        for r in range(args.rounds):
            for name, fn in methods.items():
                if name in failed:
                    continue
                t = time.perf_counter()
                try:
                    fn(r)
                except Exception as e:  # noqa: BLE001 - reported
                    failed[name] = f"{type(e).__name__}: {str(e)[:150]}"
                    continue
                put_t[name].append(size / (time.perf_counter() - t) / 1e9)
            for name, fn in gets.items():
                if name in failed:
                    continue
                t = time.perf_counter()
                try:
                    got = fn(f"b{r}")
                except Exception as e:  # noqa: BLE001 - reported
                    failed[name] = f"{type(e).__name__}: {str(e)[:150]}"
                    continue
                get_t[name].append(size / (time.perf_counter() - t) / 1e9)
                assert hashlib.sha256(got).digest() == digest, name
        print(f"object {args.mib} MiB, parts/ranges {args.part_mib} MiB, {args.threads} threads, "
              f"{args.rounds} rounds interleaved, s3proxy {s3server.VERSION} filesystem backend over "
              f"{'HTTPS' if args.https else 'HTTP'}; GB/s")
        for name, why in failed.items():
            print(f"failed   {name:34s} {why}")
        for title, table in (("upload", put_t), ("download", get_t)):
            for name, vals in table.items():
                if not vals:
                    continue
                print(f"{title:8s} {name:34s} median {statistics.median(vals):.3f}  rounds "
                      + " ".join(f"{v:.3f}" for v in vals))
    finally:
        srv.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
