"""The collective ``slices`` load builds its tensors over the bytes the ranks assembled
(fastpersist.collectiveload, fastpersist.formats.torchload.load_torch with memory=), with real
gloo process groups: bit-exact against ``torch.load``, storages of their own, writes that
stay in their process, a corrupt byte in any rank's slice (on disk or in one rank's read)
refused on every rank, a failed read and a rank dying in its read named on every rank.

Each world size is spawned once; its ranks run the scenarios in order (the one that kills
a rank last) and write their outcomes for the tests below (``test_distributed``'s harness).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch

import fastpersist
import test_distributed  # tests/ is on sys.path
from test_distributed import TIMEOUT, ok, outcome, rank_results, run_scenarios, spawn_ranks
from subprocs import flip_byte  # tests/ is on sys.path

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()), reason="no gloo backend"
)

#: pieces of 64 KiB: every rank's slice of the ~1.3 MB files is several pieces, the ranks' counts differ
PIECE = 64 << 10


def state(seed: int = 0) -> dict:
    """test_distributed's state, larger (~1.3 MB): records straddling the slices and the pieces,
    views sharing a storage, odd dtypes."""
    return test_distributed.state(seed, w_shape=(400, 700), many=(12, 37))


def cfg() -> fastpersist.Config:
    return fastpersist.Config(dist_timeout=TIMEOUT, fsync=False, dist_load="slices")


def _no_second_pass() -> None:
    """Fail any load that would fall back to loading the assembled bytes a second time."""
    from fastpersist import collectiveload

    def refused(*a: Any, **k: Any) -> Any:
        raise AssertionError("the assembled bytes were loaded a second time")

    collectiveload._load_memfd = refused


def _storage_ranges(obj: Any) -> list[tuple[int, int]]:
    out = {}
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            if st.nbytes():
                out[st.data_ptr()] = (st.data_ptr(), st.data_ptr() + st.nbytes())
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return sorted(out.values())


def _payload_offset_in_slice(path: str, world: int, rank: int) -> int:
    """A byte of tensor payload inside ``rank``'s slice of ``path``."""
    from fastpersist.formats import split
    from fastpersist.formats.zipindex import parse_zip_index

    size = os.path.getsize(path)
    lo, hi = split.slice_bounds(size, world, 4096)[rank]
    with open(path, "rb") as f:
        index = parse_zip_index(lambda off, n: os.pread(f.fileno(), n, off), size, path)
    for e in index.entries:
        if "/data/" in e.name and e.compressed_size > 64:
            start = e.data_offset
            a, b = max(lo, start), min(hi, start + e.compressed_size)
            if b - a > 2:
                return (a + b) // 2
    raise AssertionError(f"no payload in rank {rank}'s slice [{lo}, {hi})")


# --------------------------------------------------------------------------- scenarios (every rank)


def sc_exact(rank: int, world: int, d: str) -> Any:
    """Bit-exact against torch.load, for fastpersist's and torch's files, with torch's storage
    sharing, no second pass, storages that do not overlap and cannot grow."""
    from conftest import assert_same_object

    wg = torch.distributed.group.WORLD
    for name in ("fp.pt", "torch.pt"):
        p = os.path.join(d, name)
        want = torch.load(p, weights_only=True)
        got = fastpersist.load(p, group=wg, config=cfg(), weights_only=True)
        assert_same_object(got, want)
        ranges = _storage_ranges(got)
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:])), "storages overlap"
        with pytest.raises(RuntimeError):
            got["model"]["b"].untyped_storage().resize_(1 << 30)
        got = fastpersist.load(p, group=wg, config=cfg(), weights_only=False, map_location="cpu")
        assert_same_object(got, want)
    return True


def sc_private(rank: int, world: int, d: str) -> Any:
    """Writes to a loaded tensor stay in the process that makes them (a forked child's do not
    reach the parent), and loaded tensors are independent of one another."""
    got = fastpersist.load(os.path.join(d, "fp.pt"), group=torch.distributed.group.WORLD, config=cfg())
    w, b = got["model"]["w"], got["model"]["b"]
    before_b = b.clone()
    w.add_(1.0)
    assert torch.equal(b, before_b)
    assert torch.equal(got["model"]["w_t"], w.t())  # a view of the same storage, as with torch.load
    saved = w.clone()
    import ctypes

    pid = os.fork()
    if pid == 0:  # no torch op in the child (its thread pools do not survive a fork): a plain memset
        try:
            ctypes.memset(w.data_ptr(), 0, w.untyped_storage().nbytes())
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert torch.equal(w, saved), "a forked child's write reached the parent's tensor"
    return True


def _group_load(rank: int, world: int, d: str, name: str) -> Any:
    return fastpersist.load(os.path.join(d, name), group=torch.distributed.group.WORLD, config=cfg(),
                            weights_only=True)


def sc_corrupt_slice0(rank: int, world: int, d: str) -> Any:
    return _group_load(rank, world, d, "bad0.pt")


def sc_corrupt_slice_last(rank: int, world: int, d: str) -> Any:
    return _group_load(rank, world, d, "badlast.pt")


class _FlippingHandle:
    """A read handle whose first read flips one byte of what it read (a bad read on one rank;
    the slices used here start inside the large tensor ``w``)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.flipped = False

    def read(self, path: str, extents: list, nslots: int) -> Any:
        import ctypes

        out = self.real.read(path, extents, nslots)
        if not self.flipped:
            _off, ptr, n, _slot = extents[0]
            ctypes.c_uint8.from_address(ptr + n // 2).value ^= 0x01
            self.flipped = True
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def _spanning_offset(path: str, world: int) -> tuple[int, int, int]:
    """(data offset, size, a byte) of a payload record that starts in rank 0's slice and
    ends in rank 1's: the byte is in rank 1's part of it."""
    from fastpersist.formats import split
    from fastpersist.formats.zipindex import parse_zip_index

    size = os.path.getsize(path)
    cut = split.slice_bounds(size, world, 4096)[1][0]
    with open(path, "rb") as f:
        index = parse_zip_index(lambda off, n: os.pread(f.fileno(), n, off), size, path)
    for e in index.entries:
        if "/data/" in e.name and e.data_offset < cut < e.data_offset + e.compressed_size - 2 * PIECE:
            return e.data_offset, e.compressed_size, cut + PIECE + 123
    raise AssertionError(f"no record across offset {cut}")


def _with_piece_crcs(load: Callable[[], Any]) -> tuple[Any, dict]:
    """Run ``load``; (its result or the exception, the CRC-32s computed as the pieces arrived)."""
    from fastpersist import collectiveload

    real = collectiveload.PieceCrcs.finish
    seen: dict = {}

    def finish(self: Any) -> dict:
        seen.update(real(self))
        return seen

    collectiveload.PieceCrcs.finish = finish
    try:
        return load(), seen
    except Exception as e:  # noqa: BLE001
        return e, seen
    finally:
        collectiveload.PieceCrcs.finish = real


def sc_early_crcs(rank: int, world: int, d: str) -> Any:
    """Every payload record's CRC-32 is computed as the pieces arrive (records across
    pieces and ranks included), equal to zlib's over the file's bytes."""
    import zlib

    from conftest import assert_same_object
    from fastpersist.formats.zipindex import read_zip_index

    p = os.path.join(d, "fp.pt")
    got, seen = _with_piece_crcs(lambda: _group_load(rank, world, d, "fp.pt"))
    assert_same_object(got, torch.load(p, weights_only=True))
    data = open(p, "rb").read()
    want = {(e.data_offset, e.compressed_size): zlib.crc32(data[e.data_offset : e.data_offset + e.compressed_size])
            for e in read_zip_index(p).entries if e.compressed_size}
    assert seen == want, (len(seen), len(want), sorted(set(want) ^ set(seen))[:5], [k for k in seen if seen[k] != want.get(k)][:5])
    return True


def sc_corrupt_spanning(rank: int, world: int, d: str) -> Any:
    """A flipped byte in rank 1's part of a record that starts in rank 0's slice: its CRC,
    computed as the pieces arrived, differs; every rank raises."""
    got, seen = _with_piece_crcs(lambda: _group_load(rank, world, d, "badspan.pt"))
    start, n, _byte = _spanning_offset(os.path.join(d, "fp.pt"), world)
    assert (start, n) in seen, "the spanning record's CRC was not computed as the pieces arrived"
    assert isinstance(got, Exception), "a corrupt record was loaded"
    return type(got).__name__, str(got), sorted(getattr(got, "failures", {}))


def sc_bad_read_one_rank(rank: int, world: int, d: str) -> Any:
    """Rank 1's reads return a flipped byte (the file is fine): no rank returns tensors."""
    from fastpersist import collectiveload, handles

    real = handles.handle_for
    if rank == 1:
        flipping = _FlippingHandle(real(cfg(), read=True))
        collectiveload.handles = _HandlesWith(lambda c, read=False: flipping)
    try:
        return _group_load(rank, world, d, "fp.pt")
    finally:
        collectiveload.handles = handles


class _HandlesWith:
    """Stands for ``fastpersist.handles`` inside collectiveload with another ``handle_for``."""

    def __init__(self, handle_for: Callable[..., Any]) -> None:
        self.handle_for = handle_for

    def __getattr__(self, name: str) -> Any:
        from fastpersist import handles

        return getattr(handles, name)


def sc_read_error(rank: int, world: int, d: str) -> Any:
    """Rank 1's read fails (EIO): every rank raises, naming rank 1."""
    from fastpersist import collectiveload, handles

    class Failing:
        def __init__(self, real: Any) -> None:
            self.real = real

        def read(self, path: str, extents: list, nslots: int) -> Any:
            raise OSError(5, "injected read error", path)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.real, name)

    real = handles.handle_for
    if rank == 1:
        collectiveload.handles = _HandlesWith(lambda c, read=False: Failing(real(c, read=read)))
    try:
        return _group_load(rank, world, d, "fp.pt")
    finally:
        collectiveload.handles = handles


def sc_dies_in_read(rank: int, world: int, d: str) -> Any:
    """The last rank exits during the read of its second piece: the others name it."""
    from fastpersist import collectiveload, handles

    class Dying:
        def __init__(self, real: Any) -> None:
            self.real = real
            self.n = 0

        def read(self, path: str, extents: list, nslots: int) -> Any:
            self.n += 1
            if self.n == 2:
                os._exit(0)
            return self.real.read(path, extents, nslots)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.real, name)

    real = handles.handle_for
    if rank == world - 1:
        dying = Dying(real(cfg(), read=True))
        collectiveload.handles = _HandlesWith(lambda c, read=False: dying)
    return _group_load(rank, world, d, "fp.pt")


SCENARIOS: dict[str, Callable[..., Any]] = {
    name[3:]: fn for name, fn in list(globals().items()) if name.startswith("sc_") and callable(fn)}


def _worker(rank: int, world: int, port: int, d: str, names: list[str]) -> None:
    from fastpersist import collectiveload

    collectiveload.EXCHANGE_PIECE = PIECE
    _no_second_pass()
    run_scenarios(rank, world, port, d, names, SCENARIOS)


def _files(d: str, world: int) -> None:
    fastpersist.save(state(), os.path.join(d, "fp.pt"))
    torch.save(state(), os.path.join(d, "torch.pt"))
    for name, victim in (("bad0.pt", 0), ("badlast.pt", world - 1)):
        p = os.path.join(d, name)
        fastpersist.save(state(), p)
        flip_byte(p, _payload_offset_in_slice(p, world, victim))
    p = os.path.join(d, "badspan.pt")
    fastpersist.save(state(), p)
    flip_byte(p, _spanning_offset(p, world)[2])


NAMES = ["exact", "private", "corrupt_slice0", "corrupt_slice_last", "early_crcs", "corrupt_spanning",
         "bad_read_one_rank", "read_error"]


@pytest.fixture(scope="module", params=[2, 3])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[dict]]:
    n = request.param
    d = str(tmp_path_factory.mktemp(f"collload{n}"))
    _files(d, n)
    names = NAMES + (["dies_in_read"] if n == 3 else [])
    spawn_ranks(n, _worker, (d, names), 150)
    return n, rank_results(d, n)


def test_slices_load_is_bit_exact_in_place(world: tuple) -> None:
    n, results = world
    assert ok(results, "exact") == [True] * n


def test_loaded_tensors_are_private_and_independent(world: tuple) -> None:
    n, results = world
    assert ok(results, "private") == [True] * n


@pytest.mark.parametrize("name", ["corrupt_slice0", "corrupt_slice_last", "bad_read_one_rank"])
def test_a_corrupt_byte_in_any_slice_fails_every_rank(world: tuple, name: str) -> None:
    n, results = world
    for rank in range(n):
        got = outcome(results, name, rank)
        assert got[0] == "error" and got[1] == "DistributedCheckpointError", got
        assert "ChecksumError" in got[2] and "CRC-32 mismatch" in got[2], got[2]
        assert sorted(got[3]["failures"]) == list(range(n)), got[3]  # every rank found it


def test_crcs_are_computed_as_the_pieces_arrive(world: tuple) -> None:
    n, results = world
    assert ok(results, "early_crcs") == [True] * n


def test_a_corrupt_byte_in_a_record_across_two_ranks_fails_every_rank(world: tuple) -> None:
    n, results = world
    for rank in range(n):
        kind, message, failures = ok(results, "corrupt_spanning")[rank]
        assert kind == "DistributedCheckpointError", message
        assert "ChecksumError" in message and "CRC-32 mismatch" in message, message
        assert failures == list(range(n)), failures  # every rank found it


def test_a_failed_read_fails_every_rank_naming_it(world: tuple) -> None:
    n, results = world
    for rank in range(n):
        got = outcome(results, "read_error", rank)
        assert got[0] == "error" and got[1] == "DistributedCheckpointError", got
        assert list(got[3]["failures"]) == [1] and "injected read error" in got[2], got


def test_a_rank_dying_in_its_read_is_named_by_the_others(world: tuple) -> None:
    n, results = world
    if n != 3:
        pytest.skip("run with 3 ranks")
    for rank in range(n - 1):
        got = outcome(results, "dies_in_read", rank)
        assert got[0] == "error" and got[1] == "DistributedTimeoutError", got
        assert got[3]["missing"] == [n - 1], got
    assert "dies_in_read" not in results[n - 1]
