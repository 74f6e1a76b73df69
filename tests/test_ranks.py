"""fastpersist.ranks: rank, world size, gathers and the world group, with and without torch.distributed."""

from __future__ import annotations

import torch.distributed as dist

from fastpersist import ranks


def test_without_torch_distributed():
    assert not dist.is_initialized()
    assert ranks.global_rank() == 0
    assert ranks.world_size() == 1
    assert ranks.all_gather({"a": 1}) == [{"a": 1}]
    assert ranks.world_group() is None


def test_one_initialized_rank_has_no_world_group():
    from test_distributed import _free_port  # tests/ is on sys.path (rootdir conftest)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        assert (ranks.global_rank(), ranks.world_size()) == (0, 1)
        assert ranks.all_gather("x") == ["x"]
        assert ranks.world_group() is None
    finally:
        dist.destroy_process_group()


def _body(rank: int, world: int, d: str) -> dict:
    return {"rank": ranks.global_rank(), "world": ranks.world_size(),
            "gathered": ranks.all_gather((rank, f"r{rank}")), "world_group": ranks.world_group() is dist.group.WORLD}


def test_three_ranks(tmp_path):
    from test_distributed import gloo_rank, rank_results, spawn_ranks

    assert spawn_ranks(3, gloo_rank, (str(tmp_path), _body), 240) == [0, 0, 0]
    for r, res in enumerate(rank_results(str(tmp_path), 3)):
        assert "error" not in res, res.get("error")
        assert (res["rank"], res["world"]) == (r, 3)
        assert res["gathered"] == [(0, "r0"), (1, "r1"), (2, "r2")]  # rank order, on every rank
        assert res["world_group"] is True
