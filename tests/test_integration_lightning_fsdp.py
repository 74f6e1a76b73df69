"""Trainer(strategy="fsdp_fastpersist") with a real Lightning FSDP fit, 2 processes on CPU/gloo.

Sharded checkpoints (``state_dict_type="sharded"``, the strategy's default) are DCP
directories. Proof that ``fastpersist.dcp.FastPersistWriter`` wrote them, independent
of the strategy's own counter: every ``_StorageInfo`` in ``.metadata`` carries
fastpersist's CRC-32 (stock ``FileSystemWriter`` records none) matching the bytes, every
tensor item starts at a 4096-aligned offset, ``fastpersist.verify`` passes, and
``meta.pt`` is a torch zip with 4096 storage alignment (written by ``fastpersist.save``).
Stock DCP (``FileSystemReader``) reads the checkpoint in a subprocess that never imports
fastpersist.

Torch's FSDP refuses a CPU-only process when given no ``device_id`` ("FSDP needs a
non-CPU accelerator device"), which is what Lightning's ``FSDPStrategy`` passes on CPU,
and Lightning refuses ``Trainer(strategy="fsdp", accelerator="cpu")``;
``FastPersistFSDPStrategy`` wraps with ``device_id=cpu`` there, which is what lets this run.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

import fastpersist  # noqa: E402
from fastpersist import _compat  # noqa: E402
from test_integration_lightning import assert_state_equal  # noqa: E402

HERE = Path(__file__).resolve().parent
NO_FASTPERSIST_ENV = {**os.environ, "FASTPERSIST_STARTUP": "0", "FASTPERSIST_PATCH_TORCH_SAVE": "0"}

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="no gloo"
)


def assert_dcp_written_by_fastpersist(path: Path) -> None:
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    assert md.storage_data, path
    tensors = 0
    for index, info in md.storage_data.items():
        crc = _compat.dcp_storage_crc(info)
        assert crc is not None, (path, index)  # FastPersistWriter's record; stock writes none
        with open(path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        assert zlib.crc32(raw) == crc, (path, index)
        if index.offset is not None and raw[:4] == b"PK\x03\x04":  # a tensor item: its storage is aligned
            name_len, extra_len = int.from_bytes(raw[26:28], "little"), int.from_bytes(raw[28:30], "little")
            assert (info.offset + 30 + name_len + extra_len) % 4096 == 0, (path, index)
            tensors += 1
    assert tensors > 0, path
    # one file per rank: an overwrite (Lightning saves last.ckpt again) names its files __{rank}_fp{token}_{i}
    # and removes the previous save's files once its .metadata is in place
    names = sorted(p.name for p in path.iterdir() if p.suffix == ".distcp")
    assert sorted(re.sub(r"_fp[0-9a-f]{12}_", "_", n) for n in names) == ["__0_0.distcp", "__1_0.distcp"], names
    res = fastpersist.verify(str(path))
    assert res.ok and res.format == "dcp", res
    # meta.pt (trainer state without model/optimizer) comes from fastpersist.save
    import zipfile

    with zipfile.ZipFile(path / "meta.pt") as z:
        record = next((z.read(n) for n in z.namelist() if n.endswith(".storage_alignment")), b"")
    assert record == b"4096", (path, record)


STOCK_READ = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.simplefilter("ignore")
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    src, dst = sys.argv[1], sys.argv[2]
    state = {}
    _load_state_dict(state, storage_reader=FileSystemReader(src), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    meta = torch.load(src + "/meta.pt", weights_only=False)
    torch.save({"state": state, "meta": meta}, dst)
    assert not any(m == "fastpersist" or m.startswith("fastpersist.") for m in sys.modules)
    print(json.dumps({"keys": sorted(state), "global_step": meta["global_step"]}))
    """
)


def stock_read(src: Path, dst: Path) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-c", STOCK_READ, str(src), str(dst)], env=NO_FASTPERSIST_ENV,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_fsdp_fastpersist_two_processes(tmp_path: Path) -> None:
    """A 2-process FSDP fit: every sharded checkpoint (top-k and last) written by
    FastPersistWriter; resume from last.ckpt restores step, weights and each rank's
    optimizer shards; stock DCP reads the checkpoint without fastpersist."""
    r = subprocess.run([sys.executable, str(HERE / "lightning_fsdp_script.py"), str(tmp_path)], env=dict(os.environ),
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-5000:])
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for rank in ranks:
        first, second = rank["first"], rank["second"]
        assert first["strategy"] == "FastPersistFSDPStrategy" and first["state_dict_type"] == "sharded", rank
        assert first["process_group_backend"] == "gloo", rank
        assert first["dcp_saves"] == 6 and second["dcp_saves"] == 4, rank  # top-k + last at steps 2,4,6 / 8,10
        assert second["resumed_step"] == 6 and second["final_step"] == 10, rank

    ck_dir = tmp_path / "ck"
    assert sorted(os.listdir(ck_dir)) == ["epoch=0-step=8.ckpt", "epoch=1-step=10.ckpt", "last.ckpt"]
    for d in [*ck_dir.iterdir(), tmp_path / "resume-source"]:
        assert d.is_dir(), d
        assert_dcp_written_by_fastpersist(d)

    seen = stock_read(tmp_path / "resume-source", tmp_path / "source.pt")
    assert seen == {"keys": ["model", "optimizer_0"], "global_step": 6}, seen
    assert stock_read(ck_dir / "last.ckpt", tmp_path / "last.pt")["global_step"] == 10
    source = torch.load(tmp_path / "source.pt", weights_only=False)["state"]
    for i in range(2):
        rec = torch.load(tmp_path / f"restored-rank{i}.pt", weights_only=False)
        assert rec["saved"]["step"] == rec["restored"]["step"] == 6
        assert_state_equal(rec["saved"]["params"], source["model"])  # what was saved is what stock DCP reads
        assert_state_equal(rec["restored"]["params"], source["model"])  # and what the resume restored
        assert rec["restored"]["opt"]["state"], rec["restored"]["opt"]
        assert_state_equal(rec["restored"]["opt"], rec["saved"]["opt"])  # this rank's optimizer shards
