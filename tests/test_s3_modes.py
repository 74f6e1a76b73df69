"""s3:// URLs through save_async, load_state_dict and the CLI (info, verify), and stock
readers (s3fs/fsspec) of the objects, against a real S3 server (s3proxy)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from functools import partial

import pytest
import torch

import fastpersist
from fastpersist.errors import ObjectStoreError

pytest.importorskip("boto3", reason="the s3 extra is not installed: pip install 'fastpersist[s3]'")

from conftest import assert_same_object  # noqa: E402
from s3fixtures import boto, bucket, five_mib_parts, s3_env, s3_server  # noqa: E402,F401 (fixtures)
from subprocs import run_all, side_by_side  # noqa: E402


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.BatchNorm1d(128), torch.nn.Linear(128, 8))


@pytest.mark.parametrize("mode", ["snapshot", "lazy"])
def test_save_async_holds_the_state_of_the_call(boto, bucket, mode, five_mib_parts):  # noqa: ANN001
    w = torch.randn(3 * (1 << 20))  # 12 MiB: three parts
    want = {"w": w.clone(), "step": 1}
    url = f"s3://{bucket}/async.pt"
    fut = fastpersist.save_async({"w": w, "step": 1}, url, mode=mode)
    w.add_(1.0)  # changed right after the call: the object holds the values of the call
    assert fut.wait() is True and fut.done() and fut.exception() is None
    assert_same_object(torch.load(io.BytesIO(boto.get_object(Bucket=bucket, Key="async.pt")["Body"].read())), want)
    assert_same_object(fastpersist.load(url), want)


def test_save_async_error_surfaces_and_previous_stays(boto, bucket, s3_env, monkeypatch):  # noqa: ANN001
    url = f"s3://{bucket}/e.pt"
    fastpersist.save({"v": torch.zeros(4)}, url)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    fut = fastpersist.save_async({"v": torch.ones(4)}, url)
    with pytest.raises(ObjectStoreError, match="credentials"):
        fut.wait()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_env.secret_key)
    assert torch.equal(fastpersist.load(url)["v"], torch.zeros(4))


def test_load_waits_for_a_pending_async_save(boto, bucket):  # noqa: ANN001
    url = f"s3://{bucket}/p.pt"
    fastpersist.save({"v": torch.zeros(1 << 20)}, url)
    fastpersist.save_async({"v": torch.ones(1 << 20)}, url)
    assert torch.equal(fastpersist.load(url)["v"], torch.ones(1 << 20))  # the newer save's bytes
    assert fastpersist.wait_all()


def test_load_state_dict_into_existing_tensors(boto, bucket):  # noqa: ANN001
    src, dst = _model(1), _model(2)
    url = f"s3://{bucket}/m.pt"
    fastpersist.save({"model": src.state_dict(), "epoch": 4}, url)
    before = [p.data_ptr() for p in dst.parameters()]
    fastpersist.load_state_dict(dst, url, key="model")
    assert [p.data_ptr() for p in dst.parameters()] == before  # the same tensors, filled in place
    for (k, a), (_k, b) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert torch.equal(a, b), k
    with pytest.raises(FileNotFoundError):
        fastpersist.load_state_dict(dst, f"s3://{bucket}/none.pt")


def test_load_state_dict_names_the_url_on_mismatch(boto, bucket):  # noqa: ANN001
    url = f"s3://{bucket}/small.pt"
    fastpersist.save(torch.nn.Linear(3, 3).state_dict(), url)
    with pytest.raises(Exception) as e:  # noqa: PT011 - fastpersist's own mismatch error
        fastpersist.load_state_dict(torch.nn.Linear(4, 4), url)
    assert "/proc/self/fd" not in str(e.value)


def test_cli_verify_and_info(boto, bucket, s3_env):  # noqa: ANN001
    url = f"s3://{bucket}/dir/v.safetensors"
    fastpersist.save({"a": torch.arange(1000.0)}, url)
    fastpersist.save({"b": torch.ones(3)}, f"s3://{bucket}/dir/b.pt")
    up = boto.create_multipart_upload(Bucket=bucket, Key="dir/left.pt")["UploadId"]  # as a killed save leaves
    # these commands only read: they run side by side
    cli = [sys.executable, "-m", "fastpersist"]
    one, three, missing, info, no_bucket = run_all([
        [*cli, "verify", url],
        [*cli, "verify", url, f"s3://{bucket}/dir/b.pt", f"s3://{bucket}/dir/missing.pt"],
        [*cli, "verify", f"s3://{bucket}/dir/missing.pt"],
        [*cli, "info", f"s3://{bucket}/dir/", "--json"],
        [*cli, "info", "s3://no-such-bucket-fp/x"]], capture_output=True, text=True)
    r = one
    assert r.returncode == 0 and r.stdout.startswith(f"OK: {url}"), r.stdout + r.stderr
    r = three
    assert r.returncode == 2, r.stdout + r.stderr  # two OK, one that cannot be read
    assert r.stdout.count("OK: s3://") == 2 and f"ERROR: s3://{bucket}/dir/missing.pt" in r.stdout, r.stdout
    r = missing
    assert r.returncode == 2 and "no object" in r.stdout + r.stderr, r.stdout + r.stderr
    r = info
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["bucket"] == "reachable" and data["addressing_style"] == "path"
    assert [u["upload_id"] for u in data["incomplete_uploads"]] == [up]
    assert s3_env.secret_key not in r.stdout
    r = subprocess.run([sys.executable, "-m", "fastpersist", "info", f"s3://{bucket}/dir/", "--clean"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "(aborted)" in r.stdout, r.stdout + r.stderr
    assert boto.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    r = no_bucket
    assert r.returncode == 2 and "does not exist" in r.stdout


def test_stock_fsspec_reader(boto, bucket, s3_env, monkeypatch):  # noqa: ANN001
    fsspec = pytest.importorskip("fsspec")
    pytest.importorskip("s3fs")
    # s3proxy refuses the response-checksum header new botocore sends by default
    monkeypatch.setenv("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
    state = {"w": torch.randn(1000), "n": 3}
    url = f"s3://{bucket}/fs.pt"
    fastpersist.save(state, url)
    opts = {"key": s3_env.access_key, "secret": s3_env.secret_key,
            "client_kwargs": {"endpoint_url": s3_env.endpoint, "region_name": s3_env.region}}
    with fsspec.open(url, "rb", **opts) as f:
        got = torch.load(f)
    assert_same_object(got, state)


def test_bench_save_to_s3_smoke(boto, bucket, s3_env, tmp_path):  # noqa: ANN001
    out = tmp_path / "s3bench.json"
    r = subprocess.run([sys.executable, "-m", "fastpersist", "bench", "save", "--dir", f"s3://{bucket}/b",
                        "--size", "2MiB", "--repeat", "1", "--peers", "boto3,s3torchconnector", "--json", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line.split()}
    for name in ("ceiling", "fastpersist", "boto3"):
        assert name in rows and float(rows[name][1]) > 0, r.stdout
    assert "vs boto3: fastpersist saves at" in r.stdout
    import json

    data = json.loads(out.read_text())
    assert data["order"] == ["ceiling", "fastpersist", "boto3", "s3torchconnector"]
    assert data["methods"]["fastpersist"]["save_x_put_ceiling"] > 0 and data["fastpersist_vs"]["boto3"]["load"] > 0
    s3tc = data["methods"]["s3torchconnector"]  # measured where it is installed, else the reason, printed
    if s3tc["error"]:
        assert s3tc["error"].startswith("unavailable: ") and "s3torchconnector " + s3tc["error"] in " ".join(
            " ".join(row) for row in rows.values()), r.stdout
    else:
        assert s3tc["save_gbps"] > 0 and "s3torchconnector" in data["fastpersist_vs"]
    assert boto.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0  # its objects removed
    assert boto.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    r = subprocess.run([sys.executable, "-m", "fastpersist", "bench", "save", "--dir", f"s3://{bucket}/b",
                        "--peers", "fio"], capture_output=True, text=True)
    assert r.returncode != 0 and "unknown s3 peer" in r.stderr + r.stdout


def _s3_examples(path: str) -> list[str]:
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / path).read_text(encoding="utf-8")
    return [b for b in re.findall(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE) if "s3://" in b]


def _lanes(blocks: list[str]) -> list[list[int]]:
    """The blocks' indices in lanes that can run side by side: two blocks that name the same
    s3:// URL, or one URL inside the other's folder, are in one lane, in their order."""
    import re

    urls = [set(re.findall(r"s3://[^\s\"']+", b)) for b in blocks]

    def touch(x: set, y: set) -> bool:
        return any(u == v or u.startswith(v.rstrip("/") + "/") or v.startswith(u.rstrip("/") + "/")
                   for u in x for v in y)

    lane_of = list(range(len(blocks)))  # union-find over blocks that touch
    def root(i: int) -> int:
        while lane_of[i] != i:
            i = lane_of[i]
        return i
    for i in range(len(blocks)):
        for j in range(i):
            if touch(urls[i], urls[j]):
                lane_of[root(i)] = root(j)
    lanes: dict[int, list[int]] = {}
    for i in range(len(blocks)):
        lanes.setdefault(root(i), []).append(i)
    return list(lanes.values())


def test_lanes_keep_blocks_that_share_a_url_together() -> None:
    assert _lanes(['"s3://b/run-1/a.pt"', '"s3://b/other"', '"s3://b/run-1/a.pt" "s3://b/x"', "'s3://b/x/y'",
                   '"s3://b/run-1/a"']) == [[0, 2, 3], [1], [4]]


@pytest.mark.parametrize("doc", ["README.md", "docs/objectstore.md"])
def test_doc_examples_run_against_the_server(boto, s3_env, tmp_path, doc):  # noqa: ANN001
    """The s3:// examples of README.md and docs/objectstore.md run as written (bucket my-bucket);
    examples that share no object run side by side, those that do one after the other."""
    blocks = _s3_examples(doc)
    assert blocks, f"{doc} has no s3:// example"
    try:
        boto.create_bucket(Bucket="my-bucket")
    except boto.exceptions.BucketAlreadyOwnedByYou:
        pass
    except Exception as e:  # noqa: BLE001 - s3proxy answers BucketAlreadyExists
        assert "BucketAlready" in type(e).__name__ or "BucketAlready" in str(e), e
    for i, block in enumerate(blocks):
        (tmp_path / f"example_{i}").mkdir()  # a working directory each (ckpt-tier/, lightning_logs/)
        (tmp_path / f"example_{i}" / "example.py").write_text(block, encoding="utf-8")

    def run_lane(lane: list[int]) -> list[tuple[int, subprocess.CompletedProcess]]:
        return [(i, subprocess.run([sys.executable, "example.py"], cwd=tmp_path / f"example_{i}", capture_output=True,
                                   text=True, timeout=600)) for i in lane]

    done = sorted(r for f in side_by_side([partial(run_lane, lane) for lane in _lanes(blocks)]) for r in f.result())
    assert [i for i, _ in done] == list(range(len(blocks)))
    for i, r in done:
        assert r.returncode == 0, f"{doc} example {i} failed:\n{blocks[i]}\n{r.stderr}"


def test_endpoint_and_credentials_from_a_profile(boto, bucket, s3_env, tmp_path, monkeypatch):  # noqa: ANN001
    """No AWS_* credentials or endpoint in the environment: a named profile of the config
    and credentials files gives them (endpoint_url of the profile: path-style addressing)."""
    (tmp_path / "config").write_text(f"[profile fp-test]\nendpoint_url = {s3_env.endpoint}\nregion = us-east-1\n")
    (tmp_path / "credentials").write_text(
        f"[fp-test]\naws_access_key_id = {s3_env.access_key}\naws_secret_access_key = {s3_env.secret_key}\n")
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_PROFILE", "fp-test")
    state = {"w": torch.randn(100)}
    fastpersist.save(state, f"s3://{bucket}/profile.pt")
    assert_same_object(fastpersist.load(f"s3://{bucket}/profile.pt"), state)
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    with pytest.raises(Exception, match="no-such-profile"):  # botocore's ProfileNotFound, raised as is
        fastpersist.load(f"s3://{bucket}/profile.pt")


def test_the_torch_save_switch_sends_urls_to_object_storage(boto, bucket):  # noqa: ANN001
    """With the switch on, torch.save/torch.load of an s3:// URL go through fastpersist (stock
    torch raises for such a path: its parent directory does not exist); the object is the
    same bytes as a local save."""
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 3}
    url = f"s3://{bucket}/switch.pt"
    fastpersist.patch_torch_save()
    try:
        torch.save(state, url)
        back = torch.load(url, weights_only=True)
    finally:
        fastpersist.unpatch_torch_save()
    assert_same_object(back, state)
    assert_same_object(torch.load(io.BytesIO(boto.get_object(Bucket=bucket, Key="switch.pt")["Body"].read())), state)
    with pytest.raises(RuntimeError):
        torch.save(state, url)  # unpatched: stock torch's own error, as before
