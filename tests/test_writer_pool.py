"""Saves borrow their native handle from a small pool (fastpersist.handles.borrow_writer):
a save starts no handle threads of its own, two saves at once never share a handle,
and a handle with work pending is never kept."""

from __future__ import annotations

import threading

import torch

import fastpersist
from fastpersist import handles
from fastpersist.config import Config


def _state(seed: int, n: int = 300_000) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": torch.arange(seed, seed + 9), "step": seed}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def test_a_handle_given_back_is_lent_again_and_saves_reuse_it(tmp_path):
    cfg = Config()
    handles.forget_writers()
    h = handles.borrow_writer(cfg)
    assert handles.borrow_writer(cfg) is not h  # lent: nobody else gets it meanwhile
    handles.give_back_writer(cfg, h)
    assert handles.borrow_writer(cfg) is h
    handles.give_back_writer(cfg, h)
    fastpersist.save(_state(1), tmp_path / "a.pt")  # borrows h and gives it back
    assert handles.borrow_writer(cfg) is h
    other = Config(queue_depth=cfg.queue_depth + 1)
    assert handles.borrow_writer(other) is not h  # another setting: another handle
    handles.forget_writers()


def test_a_handle_with_pending_work_is_not_kept(tmp_path):
    cfg = Config()
    handles.forget_writers()
    h = handles.borrow_writer(cfg)
    buf = torch.arange(4096, dtype=torch.uint8)
    h.submit_write(str(tmp_path / "raw"), [(0, buf.data_ptr(), 4096, -1)], (), 0)
    handles.give_back_writer(cfg, h)  # may still be pending: then dropped
    kept = handles.borrow_writer(cfg)
    h.wait()
    assert kept is not h or not h.pending()
    assert (tmp_path / "raw").read_bytes() == bytes(buf.tolist())
    handles.forget_writers()


def test_concurrent_saves_each_get_their_own_handle(tmp_path):
    handles.forget_writers()
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def saver(i: int) -> None:
        try:
            start.wait(timeout=30)
            for r in range(3):
                fastpersist.save(_state(10 * i + r), tmp_path / f"{i}.pt")
                assert _same(fastpersist.load(tmp_path / f"{i}.pt", weights_only=True), _state(10 * i + r))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=saver, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert all(not t.is_alive() for t in threads)
    assert handles._writers.idle(tuple(sorted(Config().handle_kwargs().items()))) <= handles._WRITERS_MAX
    handles.forget_writers()
