"""fastpersist.idlepool.IdlePool: the pool the writers and the readers are lent from."""

from __future__ import annotations

import os
import threading

import pytest

from fastpersist.idlepool import IdlePool


class _Item:
    pass


def test_an_item_is_lent_once_and_kept_up_to_the_limit():
    pool: IdlePool[_Item] = IdlePool(2)
    assert pool.take("k") is None
    a, b, c = _Item(), _Item(), _Item()
    assert pool.keep("k", a) and pool.keep("k", b)
    assert not pool.keep("k", c)  # full
    assert not pool.keep("k", a)  # handed back twice: kept once
    assert pool.idle("k") == 2 and pool.idle("other") == 0
    got = {id(pool.take("k")), id(pool.take("k"))}
    assert got == {id(a), id(b)}
    assert pool.take("k") is None  # lent: nobody else gets them
    assert pool.take("other") is None


def test_clear_drops_every_idle_item():
    pool: IdlePool[_Item] = IdlePool(3)
    pool.keep(1, _Item())
    pool.keep(2, _Item())
    pool.clear()
    assert pool.idle(1) == pool.idle(2) == 0 and pool.take(1) is None


def test_negative_limit_is_refused():
    with pytest.raises(ValueError, match="max_idle"):
        IdlePool(-1)


def test_concurrent_takers_never_share_an_item():
    pool: IdlePool[_Item] = IdlePool(64)
    items = [_Item() for _ in range(64)]
    for it in items:
        pool.keep("k", it)
    got: list[_Item] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def take() -> None:
        start.wait(timeout=30)
        while (it := pool.take("k")) is not None:
            with lock:
                got.append(it)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(got) == 64 and len({id(i) for i in got}) == 64


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_with_an_empty_pool():
    pool: IdlePool[_Item] = IdlePool(2)
    pool.keep("k", _Item())
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.write(w, b"%d" % pool.idle("k"))
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 16) == b"0"
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert pool.idle("k") == 1  # the parent's is untouched
