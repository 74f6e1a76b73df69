"""DeepSpeed's save_checkpoint/load_checkpoint with an s3:// save_dir through the
fastpersist checkpoint engine, against the real s3proxy: a real ZeRO-1 training loop on
CPU in two processes (torch.distributed.run, gloo), the tag folder committed by its
manifest and then the ``latest`` object, a resume equal to the saved state, and saves
whose uploads rank 1 cannot finish (its parts refused through the fault proxy), into a
new tag and into the committed tag again: a clear error on both ranks, ``latest`` still
names the previous tag, which loads, no multipart upload left. Calls DeepSpeed's signature refuses
(a tag given twice, a surplus positional argument) raise its TypeError before anything is written,
as with a local save_dir."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install deepspeed)")
pytest.importorskip("boto3", reason="the s3 extra is not installed: pip install 'fastpersist[s3]'")

from s3faultproxy import Fault  # noqa: E402
from s3fixtures import boto, bucket, fault_proxy, s3_env, s3_server  # noqa: E402,F401 (fixtures)

HERE = os.path.abspath(__file__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_save_resume_and_failed_save(boto, bucket, fault_proxy, s3_env, tmp_path):  # noqa: ANN001
    fault_proxy.clear()
    fault_proxy.arm(Fault("403", method="PUT", query="partNumber=", count=0))  # rank 1's third save uses it
    env = dict(os.environ)
    for var in ("FASTPERSIST_DEEPSPEED", "FASTPERSIST_PATCH_TORCH_SAVE", "FASTPERSIST_ACCELERATE"):
        env.pop(var, None)
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", FP_PROXY=fault_proxy.endpoint)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), HERE, bucket, str(tmp_path)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=500, cwd=str(tmp_path))
    fault_proxy.clear()
    assert out.returncode == 0, out.stdout[-4000:] + "\n" + out.stderr[-8000:]
    for rank in (0, 1):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert res["saved_tag"] == "global_step2"
        assert res["resumed_path"].startswith(f"s3://{bucket}/run/global_step2/")
        assert res["resumed_equal"] and res["resumed_step"] == 2
        if rank == 1:  # its own upload refused
            assert "ObjectStoreError" in res["failed"] and "UploadPart" in res["failed"], res["failed"]
        else:  # told which rank failed, and why
            assert res["failed"].startswith("RuntimeError") and "another rank" in res["failed"], res["failed"]
            assert "AccessDenied" in res["failed"] and "`latest` still names the previous tag" in res["failed"]
        assert res["reused_failed"], "the save into the reused tag was meant to fail"
        assert res["after_failure_equal"]
        for s3_error, local_error in res["bad_calls"]:
            assert s3_error.startswith("TypeError") and s3_error == local_error, res["bad_calls"]
    files = set(json.loads(boto.get_object(Bucket=bucket, Key="run/global_step2/.fastpersist-manifest.json")
                           ["Body"].read())["files"])
    assert {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= files  # both ranks' files, one commit
    keys = {o["Key"] for o in boto.list_objects_v2(Bucket=bucket).get("Contents", []) if not o["Key"].endswith("/")}
    assert boto.get_object(Bucket=bucket, Key="run/latest")["Body"].read() == b"global_step2"
    assert "run/global_step2/.fastpersist-manifest.json" in keys and "run/zero_to_fp32.py" in keys
    assert "run/global_step3/.fastpersist-manifest.json" not in keys
    assert not any(k.startswith("run/bad_") for k in keys), keys  # the refused calls wrote nothing
    assert boto.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def _worker(bucket: str, root: str) -> None:
    import deepspeed
    import torch

    from fastpersist.integrations import deepspeed as fpd

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    real = os.environ["AWS_ENDPOINT_URL"]

    def engine():  # noqa: ANN202
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        cfg = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
               "zero_optimization": {"stage": 1}}
        eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        fpd.enable(eng)
        return eng

    def train(eng, steps: int) -> None:  # noqa: ANN001
        for _ in range(steps):
            loss = eng(torch.randn(4 // world, 8)).pow(2).mean()
            eng.backward(loss)
            eng.step()

    def weights(eng):  # noqa: ANN001, ANN202
        return {k: v.detach().clone() for k, v in eng.module.state_dict().items()}

    url = f"s3://{bucket}/run"
    res: dict = {}
    eng = engine()
    train(eng, 2)
    eng.save_checkpoint(url, client_state={"marker": 42})
    saved = weights(eng)
    res["saved_tag"] = f"global_step{eng.global_steps}"
    res["bad_calls"] = []  # calls DeepSpeed's signature refuses: its TypeError on both paths, nothing written
    for bad_args, bad_kwargs in ((("bad_a",), {"tag": "bad_b"}), (("bad_c", {}, True, False, "surplus"), {})):
        errors = []
        for where in (url, os.path.join(root, "local")):
            try:
                eng.save_checkpoint(where, *bad_args, **bad_kwargs)
                errors.append("")
            except Exception as e:  # noqa: BLE001 - reported to the test
                errors.append(f"{type(e).__name__}: {e}")
        res["bad_calls"].append(errors)
    fresh = engine()
    path, client = fresh.load_checkpoint(url)
    res["resumed_path"] = path
    res["resumed_step"] = fresh.global_steps
    res["resumed_equal"] = client["marker"] == 42 and all(torch.equal(v, saved[k]) for k, v in
                                                          weights(fresh).items())
    train(fresh, 1)
    if rank == 1:
        os.environ["AWS_ENDPOINT_URL"] = os.environ["FP_PROXY"]  # rank 1's parts refused (403) from here
    try:
        fresh.save_checkpoint(url)
        res["failed"] = ""
    except Exception as e:  # noqa: BLE001 - reported to the test
        res["failed"] = f"{type(e).__name__}: {e}"
    # the committed tag saved again (a reused tag), rank 1's parts refused: that tag still loads
    if rank == 1:
        os.environ["AWS_ENDPOINT_URL"] = os.environ["FP_PROXY"]
    try:
        fresh.save_checkpoint(url, tag=res["saved_tag"])
        res["reused_failed"] = ""
    except Exception as e:  # noqa: BLE001 - reported to the test
        res["reused_failed"] = f"{type(e).__name__}: {e}"
    os.environ["AWS_ENDPOINT_URL"] = real
    again = engine()
    again.load_checkpoint(url)
    res["after_failure_equal"] = all(torch.equal(v, saved[k]) for k, v in weights(again).items())
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    _worker(*sys.argv[1:3])
