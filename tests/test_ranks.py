"""fastpersist.ranks: rank, world size, gathers and the world group, with and without torch.distributed."""

from __future__ import annotations

import os
import pickle
import traceback

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


def _worker(rank: int, world: int, port: int, d: str) -> None:
    out: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        out["rank"], out["world"] = ranks.global_rank(), ranks.world_size()
        out["gathered"] = ranks.all_gather((rank, f"r{rank}"))
        out["world_group"] = ranks.world_group() is dist.group.WORLD
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        out["error"] = traceback.format_exc()
    with open(os.path.join(d, f"result-{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)


def test_three_ranks(tmp_path):
    from test_distributed import rank_results, spawn_ranks

    assert spawn_ranks(3, _worker, (str(tmp_path),), 240) == [0, 0, 0]
    for r, res in enumerate(rank_results(str(tmp_path), 3)):
        assert "error" not in res, res.get("error")
        assert (res["rank"], res["world"]) == (r, 3)
        assert res["gathered"] == [(0, "r0"), (1, "r1"), (2, "r2")]  # rank order, on every rank
        assert res["world_group"] is True
