"""fastpersist.dcpsave: a sharded checkpoint folder that DCP's stock reader loads (one process)."""

from __future__ import annotations

import pytest
import torch

from fastpersist import dcpsave

pytestmark = pytest.mark.skipif(not dcpsave.available(), reason="this torch has no DCP storage-layer API")


def _shards(value: float) -> dict:
    return {"model": {"w": torch.full((64, 32), value), "b": torch.arange(5.0) * value},
            "optimizer_0": {"step": torch.tensor(value)}}


def test_sharded_folder_replaces_a_file_and_loads_with_stock_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "epoch=0.ckpt"
    folder.write_bytes(b"a full checkpoint saved here before")
    dcpsave.save_sharded(_shards(2.0), folder, rest={"epoch": 0, "loops": {"step": 7}}, rest_name="meta.pt")
    assert folder.is_dir() and (folder / ".metadata").is_file()
    got = _shards(0.0)
    dcp.load(got, storage_reader=dcp.FileSystemReader(str(folder)))
    for part, tensors in _shards(2.0).items():
        for name, tensor in tensors.items():
            assert torch.equal(got[part][name], tensor), (part, name)
    assert torch.load(folder / "meta.pt", weights_only=True) == {"epoch": 0, "loops": {"step": 7}}


def test_only_the_designated_rank_writes_the_rest(tmp_path):
    dcpsave.save_sharded(_shards(1.0), tmp_path / "ck", rest={"epoch": 1}, rest_name="meta.pt", writes_rest=False)
    assert (tmp_path / "ck" / ".metadata").is_file() and not (tmp_path / "ck" / "meta.pt").exists()
