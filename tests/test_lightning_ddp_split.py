"""ddp_fastpersist when the ranks' checkpoints differ (issue 23 case 5), with a real
2-process Lightning DDP fit on CPU (tests/lightning_ddp_split_script.py).

* Only the small parts differ (a metric logged without ``sync_dist`` and monitored by
  ``ModelCheckpoint``: the callback state): every save is still split across the
  ranks and runs in the background, and the file holds exactly rank 0's checkpoint.
* The bulk tensors differ too (a buffer with ``broadcast_buffers=False``): rank 0
  writes its own checkpoint alone, in the background, and a warning says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from test_integration_lightning import assert_state_equal  # noqa: E402

HERE = Path(__file__).resolve().parent


def run(tmp_path: Path, mode: str) -> list[dict]:
    r = subprocess.run([sys.executable, str(HERE / "lightning_ddp_split_script.py"), str(tmp_path), mode],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-5000:])
    return [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]


def states(tmp_path: Path) -> list[dict]:
    return [torch.load(tmp_path / f"state-rank{i}.pt", weights_only=False) for i in range(2)]


def test_differing_callback_state_still_splits_in_the_background(tmp_path: Path) -> None:
    ranks = run(tmp_path, "unsynced")
    mine = states(tmp_path)
    assert mine[0]["callbacks"] != mine[1]["callbacks"]  # the case is real: the replicas differ
    for rank in ranks:
        assert rank["async"] is True
        assert rank["warnings"] == [], rank
        assert rank["counts"]["save"] == 0 and rank["counts"]["save_async"] == 0, rank  # no rank-0 fallback
        assert rank["counts"]["save_group"] == rank["counts"]["save_group_async"] >= 3, rank
    on_disk = torch.load(tmp_path / "ck" / "last.ckpt", weights_only=False)
    assert_state_equal(on_disk, mine[0])  # rank 0's checkpoint, exactly
    assert sorted(os.listdir(tmp_path / "ck"))[-1] == "last.ckpt"
    assert not [n for n in os.listdir(tmp_path / "ck") if n.startswith(".")]


def test_differing_tensors_fall_back_to_rank_zero_with_a_warning(tmp_path: Path) -> None:
    ranks = run(tmp_path, "buffers")
    mine = states(tmp_path)
    assert not torch.equal(mine[0]["state_dict"]["rank_buf"], mine[1]["state_dict"]["rank_buf"])
    assert len(ranks[0]["warnings"]) >= 1 and "rank_buf" in ranks[0]["warnings"][0], ranks[0]
    assert "rank 0 writes its own checkpoint alone" in ranks[0]["warnings"][0]
    assert ranks[0]["counts"]["save_group"] == 0 and ranks[0]["counts"]["save_async"] >= 3, ranks[0]
    on_disk = torch.load(tmp_path / "ck" / "last.ckpt", weights_only=False)
    assert_state_equal(on_disk, mine[0])
    assert not [n for n in os.listdir(tmp_path / "ck") if n.startswith(".")]
