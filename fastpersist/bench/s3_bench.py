"""``fastpersist bench save --dir s3://bucket/prefix``: saves and loads to object storage,
fastpersist against the server's own ceiling and the peers users would pick, in one
run, interleaved.

The ceiling is the best the chosen client (boto3, as fastpersist configures it) gets
from the server for in-memory bytes of the checkpoint's size: a parallel multipart
upload (the PUT ceiling) and parallel ranged GETs (the GET ceiling), with fastpersist's
part size and thread count. Every method is quoted as a ratio to it, as ``bench save``
quotes fio for disks. Peers, where they install and run against the server (else the
report says why):

- ``boto3``: ``torch.save`` into memory, then boto3's transfer manager
  (``upload_fileobj``); load: ``download_fileobj`` into memory, then ``torch.load``;
- ``s3torchconnector``: ``torch.save`` into ``S3Checkpoint``'s writer (AWS CRT client);
  load: ``torch.load`` from its reader;
- ``fsspec``: ``torch.save`` into ``fsspec.open(url, "wb")`` (s3fs); load: ``torch.load``
  from ``fsspec.open(url, "rb")``;
- ``dcp-fsspec``: ``torch.distributed.checkpoint.save`` with ``FsspecWriter`` (s3fs);
  load: ``dcp.load`` with ``FsspecReader``.

Besides the ratios to the ceilings, the report gives fastpersist's speed against each
peer's (the median over rounds of the peer's time divided by fastpersist's, in the same
round); ``--json FILE`` writes every round, the medians and these ratios.
"""

from __future__ import annotations

import io
import statistics
import sys
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TextIO

import torch

import fastpersist
from fastpersist import objectstore, s3client
from fastpersist.config import get_default
from fastpersist.bench.report import write_json
from fastpersist.bench.save_bench import build_workload
from fastpersist.s3url import S3Url, parse_prefix

S3_PEERS = ("boto3", "s3torchconnector", "fsspec", "dcp-fsspec")


@dataclass
class S3MethodResult:
    """One method's runs: seconds per save and per load (None: not measured), or why not."""

    name: str
    save_s: list[float] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)
    error: Optional[str] = None


def _key(prefix: S3Url, name: str) -> S3Url:
    base = prefix.key if not prefix.key or prefix.key.endswith("/") else prefix.key + "/"
    return S3Url(prefix.bucket, f"{base}{name}")


def _ceiling_put(c: Any, url: S3Url, data: bytes, part: int, threads: int) -> None:
    up = c.create_multipart_upload(Bucket=url.bucket, Key=url.key)["UploadId"]
    mv = memoryview(data)

    def put(i: int) -> dict:
        r = c.upload_part(Bucket=url.bucket, Key=url.key, UploadId=up, PartNumber=i + 1,
                          Body=bytes(mv[i * part:(i + 1) * part]))
        return {"PartNumber": i + 1, "ETag": r["ETag"]}

    try:
        with ThreadPoolExecutor(threads) as pool:
            parts = list(pool.map(put, range(max(1, -(-len(data) // part)))))
        c.complete_multipart_upload(Bucket=url.bucket, Key=url.key, UploadId=up, MultipartUpload={"Parts": parts})
    except BaseException:
        c.abort_multipart_upload(Bucket=url.bucket, Key=url.key, UploadId=up)
        raise


def _ceiling_get(c: Any, url: S3Url, size: int, part: int, threads: int) -> bytearray:
    out = bytearray(size)

    def get(lo: int) -> None:
        hi = min(size, lo + part)
        body = c.get_object(Bucket=url.bucket, Key=url.key, Range=f"bytes={lo}-{hi - 1}")["Body"]
        pos = lo
        while pos < hi:
            chunk = body.read(1 << 20)
            if not chunk:
                raise OSError(f"short ranged GET of {url}")
            out[pos:pos + len(chunk)] = chunk
            pos += len(chunk)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(get, range(0, size, part)))
    return out


def _fsspec_options() -> dict:
    c = s3client.client()
    creds = c._request_signer._credentials  # noqa: SLF001 - the same credentials as fastpersist's client
    return {"key": creds.access_key, "secret": creds.secret_key, "token": creds.token,
            "client_kwargs": {"endpoint_url": c.meta.endpoint_url, "region_name": c.meta.region_name}}


def _peer(name: str, prefix: S3Url, obj: Any) -> tuple[Callable[[int], None], Callable[[int], Any]]:
    """``(save(round), load(round))`` of a peer; raises ImportError/other where it cannot run."""
    if name == "boto3":
        c = s3client.client(get_default().s3_threads + 2)
        from boto3.s3.transfer import TransferConfig

        tc = TransferConfig(multipart_threshold=get_default().s3_part_size, multipart_chunksize=get_default().s3_part_size,
                            max_concurrency=get_default().s3_threads)

        def save(r: int) -> None:
            buf = io.BytesIO()
            torch.save(obj, buf)
            buf.seek(0)
            u = _key(prefix, f"boto3-{r}.pt")
            c.upload_fileobj(buf, u.bucket, u.key, Config=tc)

        def load(r: int) -> Any:
            u = _key(prefix, f"boto3-{r}.pt")
            buf = io.BytesIO()
            c.download_fileobj(u.bucket, u.key, buf, Config=tc)
            buf.seek(0)
            return torch.load(buf)
        return save, load
    if name == "s3torchconnector":
        from s3torchconnector import S3Checkpoint, S3ClientConfig

        c = s3client.client()
        ckpt = S3Checkpoint(region=c.meta.region_name, endpoint=c.meta.endpoint_url,
                            s3client_config=S3ClientConfig(force_path_style=True,
                                                           part_size=get_default().s3_part_size))

        def save(r: int) -> None:
            with ckpt.writer(str(_key(prefix, f"s3tc-{r}.pt"))) as w:
                torch.save(obj, w)

        def load(r: int) -> Any:
            with ckpt.reader(str(_key(prefix, f"s3tc-{r}.pt"))) as rd:
                return torch.load(rd)
        return save, load
    if name == "fsspec":
        import fsspec

        opts = _fsspec_options()

        def save(r: int) -> None:
            with fsspec.open(str(_key(prefix, f"fsspec-{r}.pt")), "wb", **opts) as f:
                torch.save(obj, f)

        def load(r: int) -> Any:
            with fsspec.open(str(_key(prefix, f"fsspec-{r}.pt")), "rb", **opts) as f:
                return torch.load(f)
        return save, load
    if name == "dcp-fsspec":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FsspecReader, FsspecWriter

        opts = _fsspec_options()
        flat = _flat(obj)

        def save(r: int) -> None:
            dcp.save(flat, storage_writer=FsspecWriter(str(_key(prefix, f"dcp-{r}")), **opts), no_dist=True)

        def load(r: int) -> Any:
            into = {k: torch.empty_like(v) for k, v in flat.items()}
            dcp.load(into, storage_reader=FsspecReader(str(_key(prefix, f"dcp-{r}")), **opts), no_dist=True)
            return into
        return save, load
    raise ValueError(f"unknown s3 peer {name!r}; expected one of {S3_PEERS}")


def _flat(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix or "t"] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_flat(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def run_s3_bench(target: str, *, size: int, repeat: int, peers: list[str], out: TextIO = sys.stdout,
                 json_path: Optional[str] = None) -> int:
    """Run the benchmark against ``target`` (``s3://bucket/prefix``); print the report
    (and write it as JSON to ``json_path``, ``-``: standard output); return the exit
    status (1 when fastpersist's own save or load failed or mismatched)."""
    prefix = parse_prefix(target)
    run_prefix = _key(prefix, f"fastpersist-bench-{uuid.uuid4().hex[:8]}/")
    obj, info = build_workload(size, None, seed=0)
    payload = objectstore.plan_for(obj, _key(run_prefix, "probe.pt"), get_default(), None, None).file_size
    threads, part = get_default().s3_threads, get_default().s3_part_size
    c = s3client.client(threads + 2)
    data = bytes(bytearray(torch.randint(0, 256, (payload,), dtype=torch.uint8).numpy()))
    results: dict[str, S3MethodResult] = {n: S3MethodResult(n) for n in ("ceiling", "fastpersist", *peers)}
    methods: dict[str, tuple[Callable[[int], None], Callable[[int], Any]]] = {
        "ceiling": (lambda r: _ceiling_put(c, _key(run_prefix, f"ceiling-{r}"), data, part, threads),
                    lambda r: _ceiling_get(c, _key(run_prefix, f"ceiling-{r}"), len(data), part, threads)),
        "fastpersist": (lambda r: fastpersist.save(obj, str(_key(run_prefix, f"fp-{r}.pt"))),
                        lambda r: fastpersist.load(str(_key(run_prefix, f"fp-{r}.pt")))),
    }
    for p in peers:
        try:
            methods[p] = _peer(p, run_prefix, obj)
        except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
            results[p].error = f"unavailable: {type(e).__name__}: {e}"
    print(f"Target     : {target} ({c.meta.endpoint_url}, {s3client.client_version()})", file=out)
    print(f"Checkpoint : {info['kind']}, {payload / 1e9:.3f} GB file, {info['tensors']} tensors; {threads} threads, "
          f"{part >> 20} MiB parts; {repeat} round(s), methods interleaved", file=out)
    try:  # warm-up, not recorded: the server's first requests (a JVM's, for s3proxy) are slow
        methods["ceiling"][0](-1)
        methods["ceiling"][1](-1)
    except Exception as e:  # noqa: BLE001 - the recorded rounds report it
        print(f"(warm-up failed: {e})", file=out)
    for r in range(repeat):
        for name, (save, load) in methods.items():
            res = results[name]
            if res.error:
                continue
            try:
                t = time.perf_counter()
                save(r)
                res.save_s.append(time.perf_counter() - t)
                t = time.perf_counter()
                got = load(r)
                res.load_s.append(time.perf_counter() - t)
                if name == "fastpersist" and r == 0:
                    want, have = _flat(obj), _flat(got)
                    if want.keys() != have.keys() or not all(torch.equal(want[k], have[k]) for k in want):
                        raise AssertionError("fastpersist's load differs from the saved state")
                del got
            except BaseException as e:  # noqa: BLE001 - reported in the table (DCP raises a BaseException)
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                res.error = f"failed: {type(e).__name__}: {str(e)[:200]}"
                if name == "fastpersist":
                    traceback.print_exc()
    ceil = results["ceiling"]
    print(f"{'method':18s} {'save GB/s':>10s} {'x PUT ceil':>10s} {'load GB/s':>10s} {'x GET ceil':>10s}  "
          "runs (s, save/load)", file=out)
    for name, res in results.items():
        if res.error:
            print(f"{name:18s} {res.error}", file=out)
            continue
        sv = payload / statistics.median(res.save_s) / 1e9
        ld = payload / statistics.median(res.load_s) / 1e9
        put_x = _median_ratio(ceil.save_s, res.save_s)
        get_x = _median_ratio(ceil.load_s, res.load_s)
        runs = " ".join(f"{s:.2f}/{l:.2f}" for s, l in zip(res.save_s, res.load_s))
        print(f"{name:18s} {sv:10.3f} {put_x:10.2f} {ld:10.3f} {get_x:10.2f}  {runs}", file=out)
    print("(GB/s: medians of the rounds. x ceil: the median over rounds of the ceiling's time in that round divided "
          "by the method's; the ceiling is a parallel multipart upload / parallel ranged GETs of in-memory bytes of "
          "the file's size with the same client and settings, run first in every round)", file=out)
    fp = results["fastpersist"]
    versus = _versus(fp, [results[p] for p in peers])
    for name, (save_x, load_x) in versus.items():
        print(f"vs {name}: fastpersist saves at {save_x:.2f}x, loads at {load_x:.2f}x its speed (median over rounds "
              f"of {name}'s time / fastpersist's)", file=out)
    _cleanup(c, run_prefix)
    if json_path:
        write_json(_to_dict(target, c.meta.endpoint_url, info, payload, threads, part, repeat, results, versus),
                   json_path)
    return 1 if fp.error else 0


def _versus(fp: S3MethodResult, peers: list[S3MethodResult]) -> dict[str, tuple[float, float]]:
    """``{peer: (save, load)}``: fastpersist's speed over the peer's, the median over
    rounds of the peer's time divided by fastpersist's (peers that ran only)."""
    if fp.error:
        return {}
    return {p.name: (_median_ratio(p.save_s, fp.save_s), _median_ratio(p.load_s, fp.load_s))
            for p in peers if not p.error}


def _to_dict(target: str, endpoint: str, info: dict, payload: int, threads: int, part: int, repeat: int,
             results: dict[str, S3MethodResult], versus: dict[str, tuple[float, float]]) -> dict:
    ceil = results["ceiling"]
    methods = {}
    for name, res in results.items():
        entry: dict[str, Any] = {"save_s": res.save_s, "load_s": res.load_s, "error": res.error}
        if not res.error and res.save_s and res.load_s:
            entry.update(save_gbps=payload / statistics.median(res.save_s) / 1e9,
                         load_gbps=payload / statistics.median(res.load_s) / 1e9,
                         save_x_put_ceiling=_median_ratio(ceil.save_s, res.save_s),
                         load_x_get_ceiling=_median_ratio(ceil.load_s, res.load_s))
        methods[name] = entry
    return {"target": target, "endpoint": endpoint, "client": s3client.client_version(), "file_bytes": payload,
            "workload": info, "threads": threads, "part_bytes": part, "rounds": repeat,
            "order": list(results), "methods": methods,
            "fastpersist_vs": {n: {"save": s, "load": ld} for n, (s, ld) in versus.items()}}


def _median_ratio(ceiling_s: list[float], method_s: list[float]) -> float:
    """Median over rounds of ``ceiling time / method time`` (NaN without a ceiling)."""
    pairs = [c / m for c, m in zip(ceiling_s, method_s) if m > 0]
    return statistics.median(pairs) if pairs and len(ceiling_s) == len(method_s) else float("nan")


def _cleanup(c: Any, prefix: S3Url) -> None:
    try:
        kwargs: dict[str, Any] = {"Bucket": prefix.bucket, "Prefix": prefix.key}
        while True:
            r = c.list_objects_v2(**kwargs)
            for o in r.get("Contents", []):
                c.delete_object(Bucket=prefix.bucket, Key=o["Key"])
            if not r.get("IsTruncated"):
                break
            kwargs["ContinuationToken"] = r["NextContinuationToken"]
    except Exception as e:  # noqa: BLE001 - leftovers are reported, not fatal
        print(f"(could not remove the benchmark's objects under s3://{prefix.bucket}/{prefix.key}: {e})",
              file=sys.stderr)
