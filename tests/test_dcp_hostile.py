"""Hostile DCP checkpoints for ``FastPersistReader`` (through ``dcp.load``) and ``verify``.

Real ``dcp.save`` checkpoints (one process; two gloo ranks where the split across
ranks matters), by ``FastPersistWriter`` (CRC per item, sealed ``.metadata``) and by
DCP's stock ``FileSystemWriter`` (no checksums), are damaged: ``.distcp`` files
truncated, payload and ``.metadata`` bytes flipped, ``.metadata`` offsets/lengths
lying, files missing, a ``.metadata`` from another checkpoint, duplicated and
overlapping storage records, records naming files outside the directory. Each is
loaded through our reader and through stock ``FileSystemReader``.

The property, for every input:

* our reader returns the saved values, or the values stock ``FileSystemReader``
  returns for the same directory (a stock checkpoint carries nothing to check
  damage against: torch's result), or raises a clear error: ``CheckpointFormatError``
  / ``ChecksumError`` / ``FileNotFoundError`` naming the file (and the offset where
  one applies) and saying what to do;
* on a fastpersist checkpoint it never returns other values than were saved:
  flipped item bytes are ``ChecksumError``, flipped ``.metadata`` bytes a seal
  error;
* ``fastpersist.verify`` / ``fastpersist verify DIR`` call every damaged
  fastpersist checkpoint corrupt (exit 1) whenever the reader would not return the
  saved values.
"""

from __future__ import annotations

import os
import pickle
import shutil
import warnings
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import fastpersist
from fastpersist.cli import main as cli_main
from fastpersist.dcp import FastPersistReader, FastPersistWriter
from fastpersist.formats.dcpmetadata import TRAILER_SIZE
from fastpersist.errors import CheckpointFormatError, ChecksumError

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

WRITERS = {"fp": FastPersistWriter, "stock": dcp.FileSystemWriter}
OUR_ERRORS = (CheckpointFormatError, ChecksumError, FileNotFoundError)


def saved() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "a": torch.randn(33, 17, generator=g),
        "i": torch.arange(700, dtype=torch.int64),
        "h": torch.randn(4, 5, generator=g).to(torch.bfloat16),
        "e": torch.empty(0, 3),
        "meta": {"lr": 0.25, "name": "run"},
        "step": 7,
    }


def blank() -> dict[str, Any]:
    return {"a": torch.zeros(33, 17), "i": torch.zeros(700, dtype=torch.int64),
            "h": torch.zeros(4, 5, dtype=torch.bfloat16), "e": torch.zeros(0, 3),
            "meta": {"lr": None, "name": None}, "step": None}


def same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            if got[k].dtype != v.dtype or got[k].shape != v.shape or not torch.equal(got[k], v):
                return False
        elif got[k] != v:
            return False
    return True


def unwrap(e: BaseException) -> BaseException:
    """DCP wraps a rank's failure in ``CheckpointException`` (``failures[rank]``)."""
    if isinstance(e, CheckpointException):
        f = next(iter(e.failures.values()))
        return f[0] if isinstance(f, tuple) else f
    return e


def load(path: str, reader: Callable[[str], Any], template: Optional[Callable[[], dict]] = None) -> Any:
    """The loaded state, or the (unwrapped) exception."""
    state = (template or blank)()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, storage_reader=reader(path), no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - classified by the caller (DCP's is a BaseException)
        return unwrap(e)
    return state


def assert_clear(err: BaseException, path: str) -> None:
    """One of ours, naming the damaged file; only a missing .metadata reaches the caller
    inside DCP's ``AssertionError("... global metadata read failed: <our message>")``, as
    with the stock reader (DCP then tries the per-rank files)."""
    msg = str(err)
    if isinstance(err, AssertionError) and "metadata read failed" in msg:
        assert ".metadata" in msg and "No such file" in msg, msg
        return
    assert isinstance(err, OUR_ERRORS), f"{type(err).__name__}: {err}"
    assert path in msg or (getattr(err, "filename", None) or "").startswith(path), msg
    if not isinstance(err, FileNotFoundError) or "missing file of the checkpoint" in msg:
        assert "restore" in msg or "copy" in msg, msg  # says what to do


def check(path: str, ckpt: str) -> str:
    """Load ``path`` with both readers and apply the property; returns our outcome:
    'ok', 'torch' (stock's values, not the saved ones: unchecked checkpoint) or 'error'."""
    ours = load(path, FastPersistReader)
    if isinstance(ours, BaseException):
        if not isinstance(ours, OUR_ERRORS + (AssertionError,)):  # DCP's own verdict: stock's, word for word
            stock = load(path, dcp.FileSystemReader)
            assert type(stock) is type(ours) and str(stock) == str(ours), (ours, stock)
            return "error"
        assert_clear(ours, path)
        return "error"
    if same(ours, saved()):
        return "ok"
    assert ckpt == "stock", f"{path}: our reader returned other values than were saved, with CRCs on"
    stock = load(path, dcp.FileSystemReader)
    assert not isinstance(stock, BaseException) and same(ours, stock), \
        f"{path}: our reader returned values that neither were saved nor are what FileSystemReader returns"
    return "torch"


def verify_status(path: str) -> str:
    return fastpersist.verify(path).status


# --------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("dcp-hostile")
    out = {}
    for name, writer in WRITERS.items():
        out[name] = str(root / name)
        dcp.save(saved(), storage_writer=writer(out[name]), no_dist=True)
    other = {k: (v + 1 if isinstance(v, torch.Tensor) else v) for k, v in saved().items()}
    for name, writer in WRITERS.items():  # same structure, other values
        out[f"{name}-other"] = str(root / f"{name}-other")
        dcp.save(other, storage_writer=writer(out[f"{name}-other"]), no_dist=True)
    return out


@pytest.fixture(params=["fp", "stock"])
def work(request: pytest.FixtureRequest, ckpts: dict[str, str], tmp_path: Any) -> tuple[str, str, str]:
    """(writer, pristine directory, a scratch directory name)."""
    return request.param, ckpts[request.param], str(tmp_path / "case")


def fresh(src: str, dst: str) -> str:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst


def metadata(path: str) -> Any:
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)


def write_metadata(path: str, md: Any) -> None:
    """A ``.metadata`` that lies consistently: plain pickle, no seal (as an editor, or a
    writer with a bug, would leave it), so the reader must catch the lie itself."""
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def records(path: str) -> list[tuple[Any, Any]]:
    return sorted(metadata(path).storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset))


def test_pristine(work: tuple[str, str, str]) -> None:
    writer, src, _ = work
    assert check(src, writer) == "ok"
    assert verify_status(src) == ("ok" if writer == "fp" else "unchecked")
    assert same(load(src, dcp.FileSystemReader), saved())  # the stock reader reads ours (seal ignored)


# --------------------------------------------------------------------------- truncated .distcp


def test_truncated_distcp(work: tuple[str, str, str]) -> None:
    writer, src, dst = work
    recs = records(src)
    rel = recs[0][1].relative_path
    size = os.path.getsize(os.path.join(src, rel))
    cuts = {0, 1, size - 1, size - TRAILER_SIZE}
    for _idx, info in recs:  # at, just inside and just past every item's ends
        for at in (info.offset, info.offset + 1, info.offset + info.length - 1, info.offset + info.length // 2):
            if 0 <= at < size:
                cuts.add(at)
    outcomes = {}
    for n in sorted(cuts):
        fresh(src, dst)
        os.truncate(os.path.join(dst, rel), n)
        outcomes[n] = check(dst, writer)
        if writer == "fp":  # every byte of our file belongs to an item: any cut is damage
            assert verify_status(dst) == "corrupt", n
    assert outcomes[0] == "error" and outcomes[size // 2 if size // 2 in outcomes else 0] == "error"


def test_truncation_message_names_file_item_and_offset(ckpts: dict[str, str], tmp_path: Any) -> None:
    dst = fresh(ckpts["fp"], str(tmp_path / "c"))
    (_idx, info), = [(k, v) for k, v in records(dst) if k.fqn == "i"]
    f = os.path.join(dst, info.relative_path)
    os.truncate(f, info.offset + 10)
    err = load(dst, FastPersistReader)
    assert isinstance(err, CheckpointFormatError) and err.path == f, err
    assert "i@(0,)" in str(err) and str(info.offset) in str(err) and "truncated" in str(err)
    assert err.offset is not None and err.offset <= info.offset


# --------------------------------------------------------------------------- flipped bytes


def test_flipped_distcp_bytes(work: tuple[str, str, str]) -> None:
    """Flips all over the file: inside an item of a fastpersist checkpoint always a
    ChecksumError naming it; in the zero padding between items harmless."""
    writer, src, dst = work
    recs = records(src)
    rel = recs[0][1].relative_path
    size = os.path.getsize(os.path.join(src, rel))
    spans = [(info.offset, info.offset + info.length, idx) for idx, info in recs if info.relative_path == rel]
    offsets = sorted(set(range(0, size, max(1, size // 40))) | {s for s, _e, _i in spans} | {e - 1 for _s, e, _i in spans})
    counts = {"ok": 0, "torch": 0, "error": 0}
    for off in offsets:
        dst = fresh(src, dst)
        with open(os.path.join(dst, rel), "r+b") as f:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0x41]))
        owner = [i for s, e, i in spans if s <= off < e]
        got = check(dst, writer)
        counts[got] += 1
        if writer == "fp" and owner:
            err = load(dst, FastPersistReader)
            if owner[0].fqn != "e":  # DCP does not read the empty tensor's item
                assert isinstance(err, ChecksumError), (off, err)
                assert owner[0].fqn in str(err) and rel in str(err) and "restore" in str(err)
            assert verify_status(dst) == "corrupt"
        elif writer == "fp":
            assert got == "ok" and verify_status(dst) == "ok", off  # padding: not part of any item
        if writer == "stock" and owner and owner[0].fqn in ("a", "i", "h"):
            assert got != "torch", off  # a tensor item's zip carries CRCs: our reader compares them
    assert counts["error"] > 0


def test_stock_tensor_item_flip_caught_by_its_zip_crc(ckpts: dict[str, str], tmp_path: Any) -> None:
    """A stock checkpoint has no fastpersist CRCs, but each tensor item is a torch zip
    with a CRC-32 per record, which torch does not compare (stock: other values)."""
    dst = fresh(ckpts["stock"], str(tmp_path / "c"))
    (info,) = [v for k, v in metadata(dst).storage_data.items() if k.fqn == "i"]
    with open(os.path.join(dst, info.relative_path), "r+b") as f:
        f.seek(info.offset + info.length // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x20]))
    stock = load(dst, dcp.FileSystemReader)
    assert not isinstance(stock, BaseException) and not same(stock, saved())  # before: ours did the same
    err = load(dst, FastPersistReader)
    assert isinstance(err, ChecksumError) and "i@(0,)" in str(err) and "data/0" in str(err), err
    assert err.offset is not None and info.offset <= err.offset < info.offset + info.length


def test_flipped_metadata_bytes_fastpersist(ckpts: dict[str, str], tmp_path: Any) -> None:
    """Every byte of a sealed .metadata flipped: the seal refuses it (the reader and
    verify), except flips inside the seal's magic, which leave an intact unsealed pickle."""
    dst = fresh(ckpts["fp"], str(tmp_path / "c"))
    mpath = os.path.join(dst, ".metadata")
    with open(mpath, "rb") as f:
        data = f.read()
    magic_at = len(data) - TRAILER_SIZE
    full_loads = set(range(0, len(data), max(1, len(data) // 25)))
    for off in range(len(data)):
        bad = bytearray(data)
        bad[off] ^= 0x04
        with open(mpath, "wb") as f:
            f.write(bad)
        if magic_at <= off < magic_at + 8:
            assert same(load(dst, FastPersistReader), saved())
            continue
        with pytest.raises(CheckpointFormatError, match=r"\.metadata"):
            FastPersistReader(dst).read_metadata()
        if off in full_loads:
            assert check(dst, "fp") == "error"
            assert verify_status(dst) == "corrupt"


def test_flipped_metadata_bytes_stock(ckpts: dict[str, str], tmp_path: Any) -> None:
    """Unsealed (stock) metadata: torch's result or a clear error, never other values
    than stock's; pickles naming anything but DCP's classes are refused, not run."""
    dst = fresh(ckpts["stock"], str(tmp_path / "c"))
    mpath = os.path.join(dst, ".metadata")
    with open(mpath, "rb") as f:
        data = f.read()
    for off in range(0, len(data), max(1, len(data) // 60)):
        bad = bytearray(data)
        bad[off] ^= 0x04
        with open(mpath, "wb") as f:
            f.write(bad)
        check(dst, "stock")


def test_rank_local_metadata_is_sealed_too(tmp_path: Any) -> None:
    """use_collectives=False: each rank's __N.metadata is sealed and checked the same way."""
    path = str(tmp_path / "local")
    dcp.save(saved(), storage_writer=FastPersistWriter(path), no_dist=True, use_collectives=False)
    assert ".metadata" not in os.listdir(path) and "__0.metadata" in os.listdir(path)
    assert same(load(path, FastPersistReader), saved())  # DCP falls back to the rank-local file
    assert same(load(path, dcp.FileSystemReader), saved())
    m = os.path.join(path, "__0.metadata")
    data = bytearray(open(m, "rb").read())
    data[len(data) // 3] ^= 0x10
    open(m, "wb").write(data)
    err = load(path, FastPersistReader)  # the class survives DCP (issue 33, case 4)
    assert isinstance(err, CheckpointFormatError) and "__0.metadata" in str(err) and "seal" in str(err), err
    res = fastpersist.verify(path)
    assert res.status == "corrupt" and "seal" in res.problems[0]


# --------------------------------------------------------------------------- lying .metadata


LIES = {
    "offset+1": ("offset", lambda v, size: v + 1),
    "offset-1": ("offset", lambda v, size: v - 1),
    "offset+64": ("offset", lambda v, size: v + 64),
    "offset=size": ("offset", lambda v, size: size),
    "offset=huge": ("offset", lambda v, size: 1 << 62),
    "offset<0": ("offset", lambda v, size: -4096),
    "offset=str": ("offset", lambda v, size: "0"),
    "length=0": ("length", lambda v, size: 0),
    "length+1": ("length", lambda v, size: v + 1),
    "length-1": ("length", lambda v, size: v - 1),
    "length=huge": ("length", lambda v, size: 1 << 50),
    "length<0": ("length", lambda v, size: -1),
    "length=float": ("length", lambda v, size: float(v)),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_lying_offsets_and_lengths(work: tuple[str, str, str], lie: str) -> None:
    writer, src, dst = work
    field, fn = LIES[lie]
    for fqn in ("a", "i", "meta.lr"):
        dst = fresh(src, dst)
        md = metadata(dst)
        (info,) = [v for k, v in md.storage_data.items() if k.fqn == fqn]
        size = os.path.getsize(os.path.join(dst, info.relative_path))
        setattr(info, field, fn(getattr(info, field), size))
        write_metadata(dst, md)
        got = check(dst, writer)
        if writer == "fp":
            assert got == "error", (lie, fqn)
            assert verify_status(dst) == "corrupt", (lie, fqn)


def test_huge_length_is_not_an_allocation(ckpts: dict[str, str], tmp_path: Any) -> None:
    """Before: std::bad_alloc (the reader sized its buffer by the recorded length)."""
    dst = fresh(ckpts["fp"], str(tmp_path / "c"))
    md = metadata(dst)
    (info,) = [v for k, v in md.storage_data.items() if k.fqn == "i"]
    info.offset = os.path.getsize(os.path.join(dst, info.relative_path))  # after every other item
    info.length = 1 << 50
    write_metadata(dst, md)
    err = load(dst, FastPersistReader)
    assert isinstance(err, CheckpointFormatError) and "the file has" in str(err), err


# --------------------------------------------------------------------------- missing files, foreign metadata


def test_missing_distcp(work: tuple[str, str, str]) -> None:
    writer, src, dst = work
    dst = fresh(src, dst)
    rel = records(dst)[0][1].relative_path
    os.unlink(os.path.join(dst, rel))
    err = load(dst, FastPersistReader)
    assert isinstance(err, FileNotFoundError) and err.filename == os.path.join(dst, rel), err
    assert "missing file of the checkpoint" in str(err) and "copy the whole checkpoint directory" in str(err)
    assert isinstance(load(dst, dcp.FileSystemReader), FileNotFoundError)
    assert verify_status(dst) == "corrupt"


def test_missing_metadata(work: tuple[str, str, str]) -> None:
    writer, src, dst = work
    dst = fresh(src, dst)
    os.unlink(os.path.join(dst, ".metadata"))
    assert check(dst, writer) == "error"
    res = fastpersist.verify(dst)
    assert res.status == "corrupt" and "no .metadata" in res.problems[0] and "did not finish" in res.problems[0]


@pytest.mark.parametrize("other", ["same-structure", "other-structure", "two-rank"])
def test_metadata_from_another_checkpoint(work: tuple[str, str, str], ckpts: dict[str, str], other: str,
                                          tmp_path: Any, request: pytest.FixtureRequest) -> None:
    writer, src, dst = work
    dst = fresh(src, dst)
    if other == "same-structure":
        foreign = metadata(ckpts[f"{writer}-other"])
    elif other == "other-structure":
        odir = str(tmp_path / "o")
        dcp.save({"a": torch.randn(40, 9), "i": torch.arange(5), "h": torch.ones(4, 5, dtype=torch.bfloat16),
                  "e": torch.empty(0, 3), "meta": {"lr": 1.0, "name": "x" * 300}, "step": 1},
                 storage_writer=WRITERS[writer](odir), no_dist=True)
        foreign = metadata(odir)
    else:
        foreign = metadata(request.getfixturevalue("two_rank")[writer])
    write_metadata(dst, foreign)
    got = check(dst, writer)
    if writer == "fp":
        assert got == "error"
        assert verify_status(dst) == "corrupt"
        if other == "same-structure":
            err = load(dst, FastPersistReader)
            assert isinstance(err, ChecksumError) and "another checkpoint" in str(err)


# --------------------------------------------------------------------------- duplicated / overlapping / escaping records


def _alias(md: Any, victim: str, source: str, shift: int = 0) -> None:
    sd = md.storage_data
    kv = [k for k in sd if k.fqn == victim][0]
    ks = [k for k in sd if k.fqn == source][0]
    dup = pickle.loads(pickle.dumps(sd[ks]))  # same bytes, same CRC: only the table can tell
    dup.offset += shift
    sd[kv] = dup


@pytest.mark.parametrize("case", ["dup-same-range", "dup-shifted", "bytes-dup", "copied-crc-same-shape"])
def test_duplicated_and_overlapping_records(work: tuple[str, str, str], case: str) -> None:
    writer, src, dst = work
    dst = fresh(src, dst)
    md = metadata(dst)
    if case == "dup-same-range":
        _alias(md, "a", "i")
    elif case == "dup-shifted":
        _alias(md, "a", "i", shift=16)
    elif case == "bytes-dup":
        _alias(md, "meta.lr", "meta.name")
    else:  # a bytes item's record over another's (same CRC copied): only the overlap tells
        _alias(md, "step", "meta.name")
    write_metadata(dst, md)
    err = load(dst, FastPersistReader)
    assert isinstance(err, CheckpointFormatError) and "overlaps" in str(err), err
    assert_clear(err, dst)
    assert verify_status(dst) == "corrupt"
    res = fastpersist.verify(dst)
    assert any("overlaps" in p for p in res.problems), res.problems


def test_crc_stripped_from_one_item(ckpts: dict[str, str], tmp_path: Any) -> None:
    """An edited .metadata whose damaged item lost its CRC: the others still have theirs,
    which no writer leaves; refused instead of loaded unchecked."""
    dst = fresh(ckpts["fp"], str(tmp_path / "c"))
    md = metadata(dst)
    (info,) = [v for k, v in md.storage_data.items() if k.fqn == "i"]
    del info.fastpersist_crc32
    write_metadata(dst, md)
    with open(os.path.join(dst, info.relative_path), "r+b") as f:
        f.seek(info.offset + info.length // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x08]))
    err = load(dst, FastPersistReader)
    assert isinstance(err, CheckpointFormatError) and "have no CRC-32" in str(err), err
    assert verify_status(dst) == "corrupt"


def test_record_outside_directory(work: tuple[str, str, str], tmp_path: Any) -> None:
    writer, src, dst = work
    dst = fresh(src, dst)
    outside = str(tmp_path / "elsewhere")
    fresh(src, outside)
    md = metadata(dst)
    for info in md.storage_data.values():
        info.relative_path = os.path.join("..", "elsewhere", info.relative_path)
    write_metadata(dst, md)
    err = load(dst, FastPersistReader)
    assert isinstance(err, CheckpointFormatError) and "names no file inside the checkpoint" in str(err), err
    assert verify_status(dst) == "corrupt"
    md.storage_data[next(iter(md.storage_data))].relative_path = os.path.join(outside, "x.distcp")  # absolute
    write_metadata(dst, md)
    assert isinstance(load(dst, FastPersistReader), CheckpointFormatError)


def test_metadata_naming_a_function_is_refused(ckpts: dict[str, str], tmp_path: Any) -> None:
    dst = fresh(ckpts["fp"], str(tmp_path / "c"))
    with open(os.path.join(dst, ".metadata"), "wb") as f:
        pickle.dump(os.getcwd, f)  # stock pickle.load would call nothing here, but resolves any name
    with pytest.raises(CheckpointFormatError, match="refused, never run"):
        FastPersistReader(dst).read_metadata()


# --------------------------------------------------------------------------- two gloo ranks


def _save_two(rank: int, world: int, path: str, writer: str) -> None:
    from test_dcp import sharded_state

    dcp.save(sharded_state(rank, world), storage_writer=WRITERS[writer](path))


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A 2-rank DTensor checkpoint by each writer."""
    from test_dcp import run_ranks

    root = str(tmp_path_factory.mktemp("two-rank"))
    out = {}
    for writer in WRITERS:
        out[writer] = os.path.join(root, writer)
        run_ranks(root, 2, _save_two, out[writer], writer)
    return out


def _load_two_expect_failure(rank: int, world: int, path: str, kind: str, fqn: str) -> None:
    """Every rank's dcp.load raises, and the failure names what is wrong."""
    from test_dcp import sharded_state

    state = sharded_state(rank, world)
    try:
        dcp.load(state, storage_reader=FastPersistReader(path))
    except CheckpointException as e:
        errs = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        assert any(type(x).__name__ == kind and fqn in str(x) for x in errs), (rank, errs)
    else:
        raise AssertionError(f"rank {rank}: the damaged checkpoint loaded")


def test_two_ranks_damage_on_one_rank_reaches_both(two_rank: dict[str, str], tmp_path: Any) -> None:
    """A flipped byte in rank 1's file (read by rank 1 only, resharded load as saved):
    both ranks raise, the failure is rank 1's ChecksumError naming the item."""
    from test_dcp import run_ranks

    src = two_rank["fp"]
    dst = fresh(src, str(tmp_path / "c"))
    (idx, info), = [(k, v) for k, v in records(dst) if k.fqn == "w" and v.relative_path.startswith("__1_")]
    with open(os.path.join(dst, info.relative_path), "r+b") as f:
        f.seek(info.offset + info.length - 30)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    run_ranks(str(tmp_path), 2, _load_two_expect_failure, dst, "ChecksumError", "w@")
    assert verify_status(dst) == "corrupt"


def test_two_ranks_flipped_metadata_refused_on_every_rank(two_rank: dict[str, str], tmp_path: Any) -> None:
    from test_dcp import run_ranks

    dst = fresh(two_rank["fp"], str(tmp_path / "c"))
    m = os.path.join(dst, ".metadata")
    data = bytearray(open(m, "rb").read())
    data[len(data) // 2] ^= 0x02
    open(m, "wb").write(data)
    run_ranks(str(tmp_path), 2, _load_two_expect_failure, dst, "CheckpointFormatError", "seal")


def test_two_ranks_cross_file_alias_caught_on_every_rank(two_rank: dict[str, str], tmp_path: Any) -> None:
    """Rank 1's chunk of w recorded over rank 0's chunk (same length, CRC copied): each
    rank reads only its own chunk, so no one rank's reads overlap; the table check
    (whole .metadata, every rank) refuses it. Stock FileSystemReader loads rank 0's
    rows into rank 1's half."""
    from test_dcp import run_ranks

    for writer, src in two_rank.items():
        dst = fresh(src, str(tmp_path / f"c-{writer}"))
        md = metadata(dst)
        w = sorted((k for k in md.storage_data if k.fqn == "w"), key=lambda k: tuple(k.offset))
        md.storage_data[w[1]] = pickle.loads(pickle.dumps(md.storage_data[w[0]]))
        write_metadata(dst, md)
        run_ranks(str(tmp_path), 2, _load_two_expect_failure, dst, "CheckpointFormatError", "overlaps")
        from test_dcp import expected_full

        state = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in expected_full().items()}
        dcp.load(state, storage_reader=dcp.FileSystemReader(dst), no_dist=True)
        assert not torch.equal(state["w"], expected_full()["w"])  # stock: other values, silently
        assert verify_status(dst) == "corrupt"


def test_two_rank_checkpoint_truncated_one_process(two_rank: dict[str, str], tmp_path: Any) -> None:
    for writer, src in two_rank.items():
        dst = fresh(src, str(tmp_path / f"t-{writer}"))
        f = os.path.join(dst, "__1_0.distcp")
        os.truncate(f, os.path.getsize(f) // 2)
        from test_dcp import expected_full

        state = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in expected_full().items()}
        err = load(dst, FastPersistReader, lambda: state)
        assert isinstance(err, CheckpointFormatError) and err.path == f and "truncated" in str(err), err
        assert verify_status(dst) == "corrupt"


# --------------------------------------------------------------------------- the command line


@pytest.mark.parametrize("damage", ["truncate", "flip", "missing", "lie", "overlap", "metadata-flip", "no-metadata"])
def test_cli_verify_exits_1_on_damage(ckpts: dict[str, str], tmp_path: Any, capsys: Any, damage: str) -> None:
    dst = fresh(ckpts["fp"], str(tmp_path / "c"))
    (idx, info), = [(k, v) for k, v in records(dst) if k.fqn == "i"]
    f = os.path.join(dst, info.relative_path)
    if damage == "truncate":
        os.truncate(f, info.offset + 5)
    elif damage == "flip":
        with open(f, "r+b") as fh:
            fh.seek(info.offset + info.length // 2)
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 0x10]))
    elif damage == "missing":
        os.unlink(f)
    elif damage == "no-metadata":  # a save that never finished: data files only
        os.unlink(os.path.join(dst, ".metadata"))
    elif damage in ("lie", "overlap"):
        md = metadata(dst)
        if damage == "lie":
            md.storage_data[idx].offset += 64
        else:
            _alias(md, "a", "i")
        write_metadata(dst, md)
    else:
        m = os.path.join(dst, ".metadata")
        data = bytearray(open(m, "rb").read())
        data[len(data) // 2] ^= 1
        open(m, "wb").write(data)
    capsys.readouterr()
    assert cli_main(["verify", dst]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"FAILED: {dst}") and dst in out.splitlines()[1], out


def test_cli_verify_intact_directories(ckpts: dict[str, str], capsys: Any) -> None:
    assert cli_main(["verify", ckpts["fp"]]) == 0
    assert "dcp format" in capsys.readouterr().out
    assert cli_main(["verify", ckpts["stock"]]) == 3


# --------------------------------------------------------------------------- swapped records, resealed (issue 24, case 8)


def _swap_and_reseal(dst: str, writer: str, fqn_a: str, fqn_b: str) -> None:
    """Swap the storage records (with their CRCs) of two items in ``.metadata`` and seal it
    again as FastPersistWriter would (fp) or leave it a plain pickle (stock): the seal and the
    CRCs all agree, only the items' types, shapes and places can tell."""
    from fastpersist.formats.dcpmetadata import seal

    md = metadata(dst)
    sd = md.storage_data
    ka = [k for k in sd if k.fqn == fqn_a][0]
    kb = [k for k in sd if k.fqn == fqn_b][0]
    sd[ka], sd[kb] = sd[kb], sd[ka]
    raw = pickle.dumps(md)
    with open(os.path.join(dst, ".metadata"), "wb") as f:
        f.write(seal(raw) if writer == "fp" else raw)


TENSOR_ITEMS = ["a", "i", "h", "e"]
BYTES_ITEMS = ["meta.lr", "meta.name", "step"]
SWAPS = [(x, y) for n, x in enumerate(TENSOR_ITEMS + BYTES_ITEMS) for y in (TENSOR_ITEMS + BYTES_ITEMS)[n + 1:]
         if x in TENSOR_ITEMS or y in TENSOR_ITEMS]


@pytest.mark.parametrize("pair", SWAPS, ids=[f"{x}<->{y}" for x, y in SWAPS])
def test_swapped_records_are_reported_by_verify(work: tuple[str, str, str], pair: tuple[str, str]) -> None:
    """Two items' storage records swapped (a tensor with a tensor of another dtype or shape, or
    with a bytes item) and resealed: the load refuses the checkpoint (wrong type, shape or
    dtype), and verify now reports it corrupt too, naming the item, where it said OK."""
    writer, src, dst = work
    dst = fresh(src, dst)
    _swap_and_reseal(dst, writer, *pair)
    got = load(dst, FastPersistReader)
    assert isinstance(got, BaseException), f"{pair}: the load returned values"
    res = fastpersist.verify(dst)
    assert res.status == "corrupt", (pair, res)
    assert any(pair[0] in p or pair[1] in p for p in res.problems), res.problems
    assert any("another item" in p or "not a tensor" in p or "bare tensor" in p for p in res.problems), res.problems


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_damaged_metadata_keeps_its_class_through_dcp_load(tmp_path: Any, damage: str) -> None:
    """Issue 33, case 4: a damaged .metadata read through dcp.load reached the caller as DCP's
    AssertionError("metadata is None; global metadata read failed: ..."); now it is fastpersist's
    CheckpointFormatError with .path, in CheckpointException.failures[rank]. A direct
    read_metadata() raises it as before; a missing .metadata stays DCP's AssertionError."""
    path = str(tmp_path / "c")
    dcp.save(saved(), storage_writer=FastPersistWriter(path), no_dist=True)
    m = os.path.join(path, ".metadata")
    data = bytearray(open(m, "rb").read())
    if damage == "flip":
        data[len(data) // 2] ^= 0x04
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray(b"PK\x03\x04 not metadata at all" * 8)
    open(m, "wb").write(data)
    err = load(path, FastPersistReader)
    assert isinstance(err, CheckpointFormatError), f"{type(err).__name__}: {err}"
    assert err.path == m and ".metadata" in str(err)
    with pytest.raises(CheckpointFormatError):
        FastPersistReader(path).read_metadata()
    os.remove(m)
    err = load(path, FastPersistReader)
    assert isinstance(err, AssertionError) and "No such file" in str(err), err
