"""Accelerate's save_state/load_state with an s3:// output_dir through the fastpersist
adapter, against the real s3proxy: a real training loop on CPU, the folder committed by
its manifest, a resume equal to the saved state, a refused load of an uncommitted
folder, and an upload that fails mid-save (clear error, previous checkpoint loads, no
multipart upload left, the next save cleans up)."""

from __future__ import annotations

import pytest

accelerate = pytest.importorskip("accelerate")
torch = pytest.importorskip("torch")
pytest.importorskip("boto3", reason="the s3 extra is not installed: pip install 'fastpersist[s3]'")

from fastpersist import s3folder  # noqa: E402
from fastpersist.errors import ObjectStoreError  # noqa: E402
from fastpersist.integrations import accelerate as fp_accelerate  # noqa: E402

from s3faultproxy import Fault  # noqa: E402
from s3fixtures import boto, bucket, fault_proxy, faulty, s3_env, s3_server  # noqa: E402,F401 (fixtures)
from test_integration_accelerate import Counter, _same, _snapshot, _train_step  # noqa: E402


def _build(tmp_path):  # noqa: ANN001, ANN202
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    torch.manual_seed(0)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path)))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    model, opt, sched = acc.prepare(model, opt, sched)
    fp_accelerate.enable(acc)
    return acc, model, opt, sched, counter


def _keys(boto, bucket: str) -> set[str]:  # noqa: ANN001
    return {o["Key"] for o in boto.list_objects_v2(Bucket=bucket).get("Contents", []) if not o["Key"].endswith("/")}


def test_save_state_to_s3_and_resume(boto, bucket, tmp_path):  # noqa: ANN001
    parts = _build(tmp_path / "a")
    acc = parts[0]
    for _ in range(3):
        _train_step(*parts)
    url = f"s3://{bucket}/run/step-3"
    saved = _snapshot(*parts)
    assert acc.save_state(url) == url
    manifest = s3folder.read_manifest(url)
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
            "custom_checkpoint_0.pkl"} <= set(manifest["files"])
    assert _keys(boto, bucket) == _committed(url, "run/step-3")  # the objects the manifest names, no others
    assert not list((tmp_path / "a").glob("**/s3:*"))  # nothing written locally under the URL's name
    _train_step(*parts)  # the state moves on; the resume must bring back step 3
    fresh = _build(tmp_path / "b")
    fresh[0].load_state(url)
    _same(_snapshot(*fresh), saved)
    # an uncommitted folder is refused, naming it
    boto.put_object(Bucket=bucket, Key="run/half/model.safetensors", Body=b"partial")
    with pytest.raises(s3folder.UncommittedFolderError, match="run/half"):
        fresh[0].load_state(f"s3://{bucket}/run/half")


def _committed(url: str, folder: str) -> set[str]:
    """The keys of the objects the folder's manifest names, and the manifest's own."""
    manifest = s3folder.read_manifest(url)
    return {f"{folder}/{e.get('key', rel)}" for rel, e in manifest["files"].items()} | {f"{folder}/{s3folder.MANIFEST}"}


def test_failed_upload_keeps_previous_and_next_save_cleans(boto, bucket, faulty, tmp_path):  # noqa: ANN001
    parts = _build(tmp_path)
    acc = parts[0]
    _train_step(*parts)
    prev = f"s3://{bucket}/run/step-1"
    acc.save_state(prev)
    saved = _snapshot(*parts)
    _train_step(*parts)
    url = f"s3://{bucket}/run/step-2"
    faulty.arm(Fault("403", method="PUT", query="partNumber=", nth=3, count=1))  # the third file's part
    with pytest.raises(ObjectStoreError, match="UploadPart"):
        acc.save_state(url)
    faulty.clear()
    assert not s3folder.is_committed(url)
    assert boto.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    fresh = _build(tmp_path / "b")
    fresh[0].load_state(prev)
    _same(_snapshot(*fresh), saved)
    acc.save_state(url)  # the retry commits, and leaves only its own objects
    saved = _snapshot(*parts)
    assert s3folder.is_committed(url)
    assert {k for k in _keys(boto, bucket) if k.startswith("run/step-2/")} == _committed(url, "run/step-2")
    # saved again into the same output_dir, and failing: the checkpoint committed there still loads
    _train_step(*parts)
    faulty.arm(Fault("403", method="PUT", query="partNumber=", nth=2, count=1))
    with pytest.raises(ObjectStoreError, match="UploadPart"):
        acc.save_state(url)
    faulty.clear()
    fresh[0].load_state(url)
    _same(_snapshot(*fresh), saved)
    acc.save_state(url)  # and a successful one replaces it, leaving no object of the old one
    saved = _snapshot(*parts)
    fresh[0].load_state(url)
    _same(_snapshot(*fresh), saved)
    assert {k for k in _keys(boto, bucket) if k.startswith("run/step-2/")} == _committed(url, "run/step-2")
    assert boto.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
