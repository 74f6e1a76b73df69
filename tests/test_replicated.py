"""fastpersist.replicated: a file every rank holds a replica of, written by the ranks together
when the replicas are equal, else by the designated writer alone (real gloo ranks)."""

from __future__ import annotations

import os

import torch

import fastpersist
from fastpersist import replicated
from fastpersist.distributed import ReplicasDifferError


def test_group_save_available():
    assert replicated.group_save_available() is True


def _state(rank: int, differ: bool) -> dict:
    torch.manual_seed(0)
    state = {"w": torch.randn(300, 257), "b": torch.arange(1000, dtype=torch.float64), "step": 7}
    if differ:
        state["w"][rank, 0] += rank  # rank 1's replica differs in one value
    return state


def _body(rank: int, world: int, d: str) -> dict:
    import torch.distributed as dist

    out: dict = {}
    calls: list = []

    def counting_save(obj, path, **kw):
        calls.append((os.path.basename(os.fspath(path)), kw.get("group") is not None))
        return fastpersist.save(obj, path, **kw)

    group = dist.group.WORLD
    out["same"] = replicated.save_replicated(_state(rank, False), os.path.join(d, "same.pt"), group=group,
                                             writer=rank == 0, format="torch", save=counting_save)
    out["differ"] = replicated.save_replicated(_state(rank, True), os.path.join(d, "differ.pt"), group=group,
                                               writer=rank == 0, format="torch", save=counting_save)
    out["calls"] = calls
    differences: list = []  # on_differ: told on every rank, before the writer writes alone
    out["on_differ"] = replicated.save_replicated(_state(rank, True), os.path.join(d, "differ2.pt"), group=group,
                                                  writer=rank == 0, format="torch",
                                                  on_differ=lambda e: differences.append(e.difference))
    out["differences"] = differences
    dist.barrier()
    return out


def test_two_ranks_write_together_or_the_writer_alone(tmp_path):
    from test_distributed import gloo_rank, rank_results, spawn_ranks  # tests/ is on sys.path (rootdir conftest)

    d = str(tmp_path)
    assert spawn_ranks(2, gloo_rank, (d, _body), 240) == [0, 0]
    results = rank_results(d, 2)
    for r in results:
        assert "error" not in r, r.get("error")
    # equal replicas: one collective save on every rank, the file as a one-rank save writes it
    assert [r["same"] for r in results] == [True, True]
    fastpersist.save(_state(0, False), tmp_path / "one.pt", format="torch")
    assert (tmp_path / "same.pt").read_bytes() == (tmp_path / "one.pt").read_bytes()
    # different replicas: the collective save refuses on both ranks; rank 0 (the writer) writes alone
    assert [r["differ"] for r in results] == [False, False]
    assert results[0]["calls"] == [("same.pt", True), ("differ.pt", True), ("differ.pt", False)]
    assert results[1]["calls"] == [("same.pt", True), ("differ.pt", True)]
    got = torch.load(tmp_path / "differ.pt", weights_only=True)
    want = _state(0, True)
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"]) and got["step"] == 7
    for r in results:
        assert r["on_differ"] is False and len(r["differences"]) == 1 and r["differences"][0]
    assert (tmp_path / "differ2.pt").read_bytes() == (tmp_path / "differ.pt").read_bytes()


def test_one_rank_writes_only_as_the_writer(tmp_path):
    import torch.distributed as dist

    from test_distributed import _free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        state = _state(0, False)
        assert replicated.save_replicated(state, tmp_path / "w.pt", group=dist.group.WORLD, writer=True) is False
        assert replicated.save_replicated(state, tmp_path / "n.pt", group=dist.group.WORLD, writer=False) is False
    finally:
        dist.destroy_process_group()
    assert not (tmp_path / "n.pt").exists()
    got = torch.load(tmp_path / "w.pt", weights_only=True)
    assert torch.equal(got["w"], state["w"]) and got["step"] == 7


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("cannot pickle this (test)")


def _agree_body(rank: int, world: int, d: str) -> dict:
    import torch.distributed as dist

    out: dict = {}
    group = dist.group.WORLD
    same = {"epoch": 3, "cb": ["a", "b"]}
    differ, got = replicated.rank0_if_different(same, group)
    out["same"] = (differ, got is same)  # this rank's own object, untouched
    shared = [rank]
    mine = {"metric": float(rank), "x": shared, "y": shared}
    differ, got = replicated.rank0_if_different(mine, group)
    out["differ"] = (differ, got, got["x"] is got["y"], got is mine)
    bad = {"ok": 1} if rank == 0 else {"ok": _Unpicklable()}
    try:
        replicated.rank0_if_different(bad, group, what="the test state")
        out["unpicklable"] = None
    except ReplicasDifferError as e:
        out["unpicklable"] = (str(e), e.difference)
    return out


def test_rank0_if_different(tmp_path):
    from test_distributed import gloo_rank, rank_results, spawn_ranks

    assert spawn_ranks(2, gloo_rank, (str(tmp_path), _agree_body), 240) == [0, 0]
    results = rank_results(str(tmp_path), 2)
    for r in results:
        assert "error" not in r, r.get("error")
        assert r["same"] == (False, True)
        # rank 0's value on every rank, a fresh copy on rank 0 too, its shared references kept
        assert r["differ"] == (True, {"metric": 0.0, "x": [0], "y": [0]}, True, False)
        # one rank's value does not pickle: every rank raises, naming it
        message, difference = r["unpicklable"]
        assert "the test state do not pickle" in message
        assert difference.startswith("the test state unpicklable (TypeError: cannot pickle this (test)")
