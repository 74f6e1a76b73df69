"""fastpersist.replicatedcheckpoint: a checkpoint dict whose small parts may differ between
ranks, written by every rank together (real gloo ranks, real files)."""

from __future__ import annotations

import os

import torch

_BULK = ("state_dict", "optimizer_states")


def _checkpoint(rank: int, epoch: int, bulk_differs: bool = False) -> dict:
    torch.manual_seed(0)
    w = torch.randn(200, 100)
    if bulk_differs:
        w[0, 0] += rank
    return {"state_dict": {"w": w}, "callbacks": {"metric": float(rank)}, "epoch": epoch}


def _body(rank: int, world: int, d: str) -> dict:
    import warnings

    import torch.distributed as dist

    from fastpersist.checkpointfiles import CheckpointFiles
    from fastpersist.replicatedcheckpoint import rank0_small_parts, save_split

    group = dist.group.WORLD
    out: dict = {}
    same = {"state_dict": {"w": torch.ones(3)}, "epoch": 1}
    out["same_is_own"] = rank0_small_parts(same, group, _BULK) is same
    out["agreed"] = rank0_small_parts(_checkpoint(rank, 1), group, _BULK)["callbacks"]
    files, background = CheckpointFiles(async_save=False), CheckpointFiles()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_split(files, _checkpoint(rank, 1), os.path.join(d, "sub", "small.ckpt"), group=group,
                   writer=rank == 0, bulk_keys=_BULK, label="test")
        save_split(background, _checkpoint(rank, 2), os.path.join(d, "background.ckpt"), group=group,
                   writer=rank == 0, bulk_keys=_BULK, label="test")
        background.finalize()
        save_split(files, _checkpoint(rank, 3, bulk_differs=True), os.path.join(d, "bulk.ckpt"), group=group,
                   writer=rank == 0, bulk_keys=_BULK, label="test")
    out["warnings"] = [str(w.message) for w in caught if str(w.message).startswith("test:")]
    out["counts"], out["background"] = dict(files.counts), dict(background.counts)
    dist.barrier()
    return out


def test_small_parts_agree_and_the_ranks_write_together(tmp_path):
    from test_distributed import gloo_rank, rank_results, spawn_ranks  # tests/ is on sys.path

    def assert_state_equal(got: dict, want: dict) -> None:
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    d = str(tmp_path)
    assert spawn_ranks(2, gloo_rank, (d, _body), 240) == [0, 0]
    results = rank_results(d, 2)
    for rank, r in enumerate(results):
        assert "error" not in r, r.get("error")
        assert r["same_is_own"] is True and r["agreed"] == {"metric": 0.0}  # rank 0's small parts everywhere
        # small parts differ: still one collective save, blocking or in the background
        assert r["counts"]["save_group"] == 1 and r["background"]["save_group"] == 1
        assert r["background"]["save_group_async"] == 1 and r["background"]["save_async"] == 0
        # the bulk tensors differ: rank 0 writes its own checkpoint alone and warns
        assert r["counts"]["save"] == (1 if rank == 0 else 0)
    assert_state_equal(torch.load(tmp_path / "sub" / "small.ckpt", weights_only=True), _checkpoint(0, 1))
    assert_state_equal(torch.load(tmp_path / "background.ckpt", weights_only=True), _checkpoint(0, 2))
    assert_state_equal(torch.load(tmp_path / "bulk.ckpt", weights_only=True), _checkpoint(0, 3, bulk_differs=True))
    assert results[1]["warnings"] == [] and len(results[0]["warnings"]) == 1
    message = results[0]["warnings"][0]
    assert str(tmp_path / "bulk.ckpt") in message and "rank 0 writes its own checkpoint alone" in message
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]
