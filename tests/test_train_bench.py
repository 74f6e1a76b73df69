"""``fastpersist bench train`` options: rounds, training threads, the bytes check, guard waits."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch

import fastpersist
from fastpersist.bench import train_bench
from fastpersist.bench.train_bench import METHODS, print_train_report, round_order, run_train_bench

TINY = dict(steps=4, every=2, layers=1, d_model=32, heads=2, vocab=64, seq=8, batch=2, progress=False)


def test_rounds_threads_and_bytes(tmp_path):
    before = torch.get_num_threads()
    want = 1 if before > 1 else 2
    seen: list[int] = []
    real = train_bench._one_run

    def spy(*a, **k):
        seen.append(torch.get_num_threads())
        return real(*a, **k)

    train_bench._one_run = spy
    try:
        res = run_train_bench(str(tmp_path), rounds=2, train_threads=want, seed=3,
                              methods=["torch.save", "async-snapshot", "async-lazy"], **TINY)
    finally:
        train_bench._one_run = real
    # the thread count applied to every run (the baseline included), and restored afterwards
    assert seen and set(seen) == {want}
    assert all(r.train_threads == want for r in res.runs)
    assert res.train_threads == want and res.train_threads_applied == want
    assert torch.get_num_threads() == before
    # every round: each method once plus the baseline, in the seeded order
    assert res.rounds == 2 and len(res.runs) == 8
    for rnd in range(2):
        got = [r.method for r in res.runs if r.round == rnd]
        assert got == res.orders[rnd] == round_order(["torch.save", "async-snapshot", "async-lazy"], 3, rnd)
        assert sorted(got) == sorted(["none", "torch.save", "async-snapshot", "async-lazy"])
    assert all(r.error is None for r in res.runs), [r.error for r in res.runs]
    # the bytes check ran and passed for every checkpointing run of every round
    assert all(r.verified is True for r in res.runs if r.method != "none")
    assert all(r.verified is None for r in res.runs if r.method == "none")
    # lost vs the same round's baseline
    for r in res.runs:
        base = next(b for b in res.runs if b.round == r.round and b.method == "none")
        assert r.lost_vs_baseline_s == pytest.approx(r.total_s - base.total_s)
    # the lazy runs recorded a guard wait per step; the others none
    for r in res.runs:
        assert len(r.guard_wait_s) == (TINY["steps"] if r.method == "async-lazy" else 0)
        assert all(w >= 0 for w in r.guard_wait_s)
        assert len(r.call_s) == (0 if r.method == "none" else 1)  # steps 4, every 2: one checkpoint (step 2)
    s = res.summary()
    assert set(s) == {"none", "torch.save", "async-snapshot", "async-lazy"}
    assert s["async-lazy"]["verified"] == "2/2" and s["none"]["verified"] is None
    lost = sorted(r.lost_vs_baseline_s for r in res.runs if r.method == "async-snapshot")
    assert s["async-snapshot"]["median_lost_vs_baseline_s"] == pytest.approx(sum(lost) / 2)
    ts = s["torch.save"]["median_lost_vs_baseline_s"]
    want_ratio = s["async-snapshot"]["median_lost_vs_baseline_s"] / ts if ts > 0 else None
    assert res.ratio_vs_baseline("async-snapshot") == (pytest.approx(want_ratio) if want_ratio else None)
    d = json.loads(json.dumps(res.to_dict(), default=str))
    assert d["train_threads_applied"] == want and d["rounds"] == 2
    assert {"ratios_vs_torch_save", "ratios_vs_torch_save_vs_baseline", "summary"} <= set(d)
    out = io.StringIO()
    print_train_report(res, out)
    text = out.getvalue()
    assert f"intra-op threads: {want} (--train-threads)" in text and "Every run" in text


def test_round_order_is_seeded_and_always_has_the_baseline():
    a = [round_order(["torch.save", "async-lazy"], 0, r) for r in range(6)]
    assert a == [round_order(["torch.save", "async-lazy"], 0, r) for r in range(6)]
    assert all(sorted(o) == sorted(["none", "torch.save", "async-lazy"]) for o in a)
    assert len({tuple(o) for o in a}) > 1  # shuffled, not one fixed order
    assert sorted(round_order(METHODS, 1, 0)) == sorted(METHODS)


def test_default_threads_left_alone(tmp_path):
    before = torch.get_num_threads()
    res = run_train_bench(str(tmp_path), methods=["none"], **TINY)
    assert res.train_threads is None and res.train_threads_applied == before
    assert [r.method for r in res.runs] == ["none"] and math.isnan(res.median_lost_vs_baseline("torch.save"))


def test_bad_options_refused(tmp_path):
    with pytest.raises(ValueError, match="rounds"):
        run_train_bench(str(tmp_path), rounds=0, **TINY)
    with pytest.raises(ValueError, match="train_threads"):
        run_train_bench(str(tmp_path), train_threads=0, **TINY)


def test_cli_train_threads_and_rounds(tmp_path):
    from fastpersist.cli import main

    js = tmp_path / "r.json"
    rc = main(["bench", "train", "--dir", str(tmp_path), "--steps", "4", "--every", "2", "--layers", "1",
               "--d-model", "64", "--vocab", "64", "--seq", "8", "--batch", "2", "--methods", "async-snapshot",
               "--rounds", "2", "--train-threads", "1", "--no-progress", "--json", str(js)])
    assert rc == 0
    d = json.loads(js.read_text())
    assert d["train_threads"] == 1 and d["train_threads_applied"] == 1 and d["rounds"] == 2
    assert [r["method"] for r in d["runs"]].count("none") == 2
    assert all(r["verified"] for r in d["runs"] if r["method"] == "async-snapshot")


def test_guard_counts_its_waits(tmp_path, monkeypatch):
    from fastpersist import asyncsave

    held: list = []
    real_enqueue = asyncsave._enqueue
    monkeypatch.setattr(asyncsave, "_enqueue", held.append)  # the save stays pending until the step ran
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = fastpersist.guard(opt)
    try:
        assert g.waited_s == 0.0 and g.waits == 0
        model(torch.randn(2, 512)).sum().backward()
        opt.step()  # no save pending: not counted
        assert g.waits == 0
        fut = fastpersist.save_async({"m": model.state_dict()}, tmp_path / "g.pt", mode="lazy")
        assert len(held) == 1 and not fut.done()
        opt.step()
        assert g.waits == 1 and g.waited_s > 0.0
        real_enqueue(held[0])
        assert fut.wait(60)
        opt.step()  # nothing pending any more
        assert g.waits == 1
    finally:
        g.remove()


def test_pool_warmup_before_the_rounds_only_with_async_methods(tmp_path, monkeypatch):
    """With an async method, one untimed save_async allocates the staging pool before the
    rounds (reported, and printed); every run ends with a sync(); without one, no warm-up."""
    warmed: list[str] = []
    real_warm = train_bench._warm_pool
    synced: list[int] = []

    def warm(*a, **k):
        warmed.append("yes")
        return real_warm(*a, **k)

    monkeypatch.setattr(train_bench, "_warm_pool", warm)
    monkeypatch.setattr(train_bench, "_settle_disk", lambda: synced.append(1))
    res = run_train_bench(str(tmp_path), methods=["torch.save", "async-snapshot"], **TINY)
    assert warmed == ["yes"] and math.isfinite(res.pool_warmup_s) and res.pool_warmup_s > 0
    assert len(synced) == len(res.runs) == 3
    assert not any(n.startswith("train-") for n in __import__("os").listdir(tmp_path))
    out = io.StringIO()
    print_train_report(res, out)
    assert "staging pool" in out.getvalue()
    assert json.loads(json.dumps(res.to_dict(), default=str))["pool_warmup_s"] == pytest.approx(res.pool_warmup_s)
    warmed.clear()
    res = run_train_bench(str(tmp_path), methods=["torch.save"], **TINY)
    assert warmed == [] and math.isnan(res.pool_warmup_s)
    out = io.StringIO()
    print_train_report(res, out)
    assert "staging pool" not in out.getvalue()


def test_async_peers_every_checkpoint_verified_with_peak_memory(tmp_path):
    """DCP async_save (thread and process modes) and Lightning's AsyncCheckpointIO run in the same
    rounds as fastpersist; every checkpoint of every run is read back and equals its step's state."""
    tiny = dict(TINY, steps=5, every=2)  # checkpoints at steps 2 and 4
    methods = ["async-snapshot", "dcp.async_save", "dcp.async_save-process", "lightning-async"]
    res = run_train_bench(str(tmp_path), methods=methods, **tiny)
    assert all(r.error is None for r in res.runs), [(r.method, r.error) for r in res.runs]
    for r in res.runs:
        if r.method == "none":
            assert r.verified is None and r.checkpoints_verified == 0
        else:
            assert r.checkpoint_steps == [1, 3] and r.checkpoints_verified == 2 and r.verified is True
        assert r.peak_rss_bytes >= 0 and r.fingerprint_s > 0  # the reference is taken in every run
    s = res.summary()
    assert s["dcp.async_save"]["checkpoints"] == 2 and s["lightning-async"]["checkpoints_verified"] == 2
    assert all("median_peak_rss_mib" in v for v in s.values())
    name, lost = res.best_peer()
    assert name in ("dcp.async_save", "dcp.async_save-process", "lightning-async")
    assert lost == min(res.median_lost_vs_baseline(m) for m in methods[1:])
    d = json.loads(json.dumps(res.to_dict(), default=str))
    assert d["vs_best_async_peer"]["best_peer"] == name
    assert math.isfinite(res.dcp_process_warmup_s)
    assert any("DeepSpeed" in n and "not measured" in n for n in res.notes)
    assert any("AsyncCheckpointerType.PROCESS" in n for n in res.notes)
    out = io.StringIO()
    print_train_report(res, out)
    text = out.getvalue()
    assert "peak MiB" in text and "best async peer" in text and "DeepSpeed" in text
    assert not [n for n in __import__("os").listdir(tmp_path) if not n.startswith(".")]  # checkpoints removed
    import torch.distributed as dist

    assert not dist.is_initialized()  # the 1-rank group made for DCP's process mode is gone


def test_a_checkpoint_with_other_bytes_is_caught(tmp_path, monkeypatch):
    def corrupt(self, state, path):
        bad = {**state, "model": {k: v.clone().add_(1) if v.is_floating_point() else v
                                  for k, v in state["model"].items()}}
        torch.save(bad, path)

    from fastpersist.bench import train_peers

    monkeypatch.setattr(train_peers._TorchSaver, "save", corrupt)
    res = run_train_bench(str(tmp_path), methods=["torch.save"], **TINY)
    (run,) = [r for r in res.runs if r.method == "torch.save"]
    assert run.error is None and run.verified is False and run.checkpoints_verified == 0
    assert res.summary()["torch.save"]["verified"] == "0/1"


def test_unknown_method_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown method"):
        run_train_bench(str(tmp_path), methods=["deepspeed"], **TINY)


def test_a_peer_whose_library_is_missing_is_skipped_with_a_note(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lightning" else real(name, *a))
    res = run_train_bench(str(tmp_path), methods=["torch.save", "lightning-async"], **TINY)
    assert [r.method for r in res.runs if r.method != "none"] == ["torch.save"]
    assert "lightning-async: not run (lightning is not installed)" in res.notes
