"""torch's zip records laid out in Python (fastpersist.formats.zipwriter.MinizLayout).

Every byte but the content of ``.data/serialization_id`` (and its CRC fields) must
be what ``torch._C.PyTorchFileWriter`` writes for the same records; payloads are
holes, so multi-GiB records cost nothing here.
"""

from __future__ import annotations

import io
import random
import re
import struct
import sys
import zipfile
import zlib

import pytest
import torch

import fastpersist
from fastpersist import _compat, _native
from fastpersist.formats import torchstream, torchzip, zipwriter
from fastpersist.formats.torchstream import BlockRecorder
from fastpersist.formats.zipindex import parse_zip_index
from fastpersist.formats.zipwriter import (
    SERIALIZATION_ID,
    MinizLayout,
    mask_serialization_id,
    recorded_bytes,
    run_layouts,
    torch_version_record,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

MAX32 = 0xFFFFFFFF
GIB = 1 << 30
#: payload sizes to draw from; "random" is anything up to 1 MiB
SIZES = [0, 1, 63, 64, 65, 4095, 4096, "random", MAX32 - 1, MAX32, MAX32 + 1, 5 * GIB]


def _size(rng: random.Random) -> int:
    s = rng.choice(SIZES)
    return rng.randint(0, 1 << 20) if s == "random" else s


def random_sequence(rng: random.Random, alignment: int, interleave: bool = False) -> list:
    """Storage payload holes ``data/N`` followed by torch's small records."""
    first = rng.choice([0, 7, 95, 9990])  # record names of different lengths
    seq: list = [(f"data/{k}", _size(rng)) for k in range(first, first + rng.randint(0, 12))]
    small = [
        ("data.pkl", rng.randbytes(rng.randint(1, 5000))),
        (".format_version", b"1"),
        (".storage_alignment", str(alignment).encode("ascii")),
    ]
    if rng.random() < 0.5:
        small.append(("byteorder", sys.byteorder.encode("ascii")))
    if interleave:
        for rec in small:
            seq.insert(rng.randint(0, len(seq)), rec)
        return seq
    return seq + small


def _assert_same_layout(seq, alignment):
    theirs, ours, _layout = run_layouts(seq, alignment, BlockRecorder)
    assert theirs.pos == ours.pos
    assert recorded_bytes(theirs) == recorded_bytes(ours)
    return theirs, ours


def test_layout_matches_torch():
    assert zipwriter.layout_matches_torch() is True
    assert zipwriter._probe() is True


@pytest.mark.parametrize("alignment", [64, 4096, 65536])
@pytest.mark.parametrize("seed", range(6))
def test_random_sequences_match_torch(seed, alignment):
    rng = random.Random(seed * 1000 + alignment)
    for _ in range(3):
        _assert_same_layout(random_sequence(rng, alignment), alignment)


@pytest.mark.parametrize("alignment", [64, 4096, 65536])
@pytest.mark.parametrize("seed", range(3))
def test_interleaved_records_match_torch(seed, alignment):
    rng = random.Random(seed * 7 + alignment)
    _assert_same_layout(random_sequence(rng, alignment, interleave=True), alignment)


@pytest.mark.parametrize("alignment", [64, 4096])
@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 4095, 4096, MAX32 - 1, MAX32, MAX32 + 1, 5 * GIB])
def test_each_size_alone_matches_torch(size, alignment):
    seq = [("data/0", size), ("data/1", 3), ("data.pkl", b"\x80\x02}q\x00."), (".format_version", b"1")]
    _assert_same_layout(seq, alignment)


def _data_offset_of_first(alignment: int) -> int:
    layout = MinizLayout(BlockRecorder(), alignment, b"3\n")
    return layout.add_payload("data/0", 1)[0]


@pytest.mark.parametrize("alignment", [64, 4096])
@pytest.mark.parametrize("target", [MAX32 - 2, MAX32 - 1, MAX32, MAX32 + 1])
@pytest.mark.parametrize("second", ["payload", "empty", "record"])
def test_record_starting_at_the_zip64_boundary_matches_torch(target, alignment, second):
    """The second record's local header lands right at / around offset 2^32-1."""
    size = target - _data_offset_of_first(alignment) - 16  # 32-bit data descriptor after it
    seq = [("data/0", size)]
    if second == "payload":
        seq.append(("data/1", 100))
    elif second == "empty":
        seq.append(("data/1", 0))
    seq += [("data.pkl", b"x" * 77), (".format_version", b"1")]
    theirs, ours = _assert_same_layout(seq, alignment)
    index = parse_zip_index(ours.read_at, ours.pos)
    assert index.entries[1].header_offset == target


@pytest.mark.parametrize("alignment", [64, 4096])
def test_central_directory_around_the_zip64_boundary_matches_torch(alignment):
    """The central directory starts just below and just past 2^32-1 (the end record clamps its offset)."""
    small = [("data.pkl", b"p" * 10), (".format_version", b"1")]
    _t, ours, _l = run_layouts([("data/0", 1)] + small, alignment, BlockRecorder)
    first = 1 + MAX32 - parse_zip_index(ours.read_at, ours.pos).cd_offset  # lands near 2^32-1
    seen = set()
    for delta in range(-3 * alignment, 3 * alignment, max(8, alignment // 8)):
        theirs, ours = _assert_same_layout([("data/0", first + delta)] + small, alignment)
        index = parse_zip_index(ours.read_at, ours.pos)
        eocd = struct.unpack("<4s4H2LH", ours.read_at(ours.pos - 22, 22))
        assert eocd[6] == min(index.cd_offset, MAX32)
        seen.add(index.cd_offset >= MAX32)
    assert seen == {False, True}


@pytest.mark.parametrize("alignment", [64, 4096, 65536])
def test_plain_file_sink_matches_torch(alignment):
    """A sink with only write/seek/tell (no recorder): holes become zeros in both files."""
    rng = random.Random(alignment)
    for _ in range(3):
        seq = [(f"data/{k}", rng.choice([0, 1, 63, 64, 65, 4095, 4096, rng.randint(0, 1 << 18)])) for k in range(8)]
        seq += [("data.pkl", rng.randbytes(300)), (".format_version", b"1"), ("byteorder", b"little")]
        theirs, ours, _layout = run_layouts(seq, alignment, io.BytesIO)
        files = []
        for sink in (theirs, ours):
            raw = bytearray(sink.getvalue())
            for off, n in mask_serialization_id(lambda o, k: bytes(raw[o : o + k]), len(raw)):
                raw[off : off + n] = bytes(n)
            files.append(raw)
        assert files[0] == files[1]
        assert len(files[1]) == ours.tell()


def test_long_record_names_match_torch():
    seq = [("data/" + "k" * n, n * 13) for n in (1, 60, 200, 1000)] + [("data.pkl", b"abc"), ("x" * 300, b"y")]
    for alignment in (64, 4096, 65536):
        _assert_same_layout(seq, alignment)


def test_empty_sequence_matches_torch():
    _assert_same_layout([], 64)
    _assert_same_layout([("data.pkl", b"\x80\x02}q\x00.")], 4096)


def test_more_than_65535_records_match_torch():
    n = 70_000
    seq = [(f"data/{i}", i % 3 % 2) for i in range(n)]  # empty and one-byte payloads
    seq += [("data.pkl", b"\x80\x02}q\x00."), (".format_version", b"1"), (".storage_alignment", b"64")]
    theirs, ours, _layout = run_layouts(seq, 64, BlockRecorder)
    assert theirs.pos == ours.pos
    # the payloads are single-byte holes: the whole files are small; mask the id where it lies
    raw_theirs = bytearray(theirs.read_at(0, theirs.pos))
    raw_ours = bytearray(ours.read_at(0, ours.pos))
    index = parse_zip_index(ours.read_at, ours.pos)
    for off, length in mask_serialization_id(ours.read_at, ours.pos):
        raw_theirs[off : off + length] = bytes(length)
        raw_ours[off : off + length] = bytes(length)
    assert raw_theirs == raw_ours
    total = n + 3 + 3  # + version, byteorder, serialization_id
    assert len(index.entries) == total and index.zip64
    assert [e.name for e in index.entries[:n]] == [f"archive/data/{i}" for i in range(n)]
    sig, disk, cd_disk, n_disk, n_total, cd_size, cd_off, clen = struct.unpack("<4s4H2LH", bytes(raw_ours[-22:]))
    assert (sig, n_disk, n_total) == (b"PK\x05\x06", 0xFFFF, 0xFFFF)
    assert (cd_size, cd_off) == (index.cd_size, index.cd_offset)
    with zipfile.ZipFile(io.BytesIO(bytes(raw_ours))) as z:
        names = z.namelist()
    assert len(names) == total and names[-1] == "archive/" + SERIALIZATION_ID


# ---------------------------------------------------------------- CRC fields and the id


def _layout(seq, alignment):
    """``seq`` through MinizLayout alone: ``(sink, layout, {name: add_payload result})``."""
    sink = BlockRecorder()
    layout = MinizLayout(sink, alignment, torch_version_record())
    returned = {}
    for name, item in seq:
        if isinstance(item, bytes):
            assert layout.add_record(name, item) is None
        else:
            returned[name] = layout.add_payload(name, item)
    assert layout.finish() == sink.pos
    return sink, layout, returned


@pytest.mark.parametrize("alignment", [64, 4096, 65536])
@pytest.mark.parametrize("seed", range(4))
def test_crc_field_offsets_point_at_the_crc_fields(seed, alignment):
    rng = random.Random(seed)
    seq = random_sequence(rng, alignment, interleave=bool(seed % 2))
    seq.append(("data/zero_last", 0))
    sink, layout, returned = _layout(seq, alignment)
    index = parse_zip_index(sink.read_at, sink.pos)
    assert [e.name for e in index.entries] == [e.name.decode() for e in layout.entries]
    for e, ours in zip(index.entries, layout.entries):
        assert (e.header_offset, e.compressed_size, e.uncompressed_size, e.crc32) == (
            ours.offset, ours.size, ours.size, ours.crc)
        assert ours.cd_crc_field == e.crc_field_offsets[0] == e.cd_crc_offset
        short = e.name.split("/", 1)[1]
        if short in returned:
            data_at, crc_at = returned[short]
            assert data_at == e.data_offset and data_at % alignment == 0
            if e.compressed_size:
                assert crc_at == e.crc_field_offsets[1] == e.descriptor_crc_offset
                assert sink.read_at(crc_at - 4, 4) == b"PK\x07\x08"
            else:
                assert crc_at == -1 and e.descriptor_offset is None
        else:  # written here in full: CRC computed and stored in both places
            body = sink.read_at(e.data_offset, e.compressed_size)
            assert zlib.crc32(body) == e.crc32
            for off in e.crc_field_offsets:
                stored = int.from_bytes(sink.read_at(off, 4), "little")
                assert stored == e.crc32 or (not e.compressed_size and off == e.header_offset + 14 and stored == 0)
    # patching the returned fields sets the CRCs the index reads
    for i, (short, (_data_at, crc_at)) in enumerate(returned.items()):
        if crc_at < 0:
            continue
        crc = (0x9E3779B1 * (i + 1)) & MAX32
        sink.patch(crc_at, struct.pack("<L", crc))
        sink.patch(next(o.cd_crc_field for o in layout.entries if o.name.decode().endswith("/" + short)),
                   struct.pack("<L", crc))
    patched = parse_zip_index(sink.read_at, sink.pos)
    for e in patched.entries:
        short = e.name.split("/", 1)[1]
        if short in returned and returned[short][1] >= 0:
            assert int.from_bytes(sink.read_at(e.descriptor_crc_offset, 4), "little") == e.crc32 != 0


def _serialization_id(seq, alignment=64) -> bytes:
    sink, _layout_, _ = _layout(seq, alignment)
    entry = parse_zip_index(sink.read_at, sink.pos).find(SERIALIZATION_ID)
    return sink.read_at(entry.data_offset, entry.compressed_size)


BASE_SEQ = [("data/0", 10), ("data/1", 0), ("data.pkl", b"\x80\x02}q\x00."), (".format_version", b"1")]


def test_serialization_id_is_40_digits_and_deterministic():
    sid = _serialization_id(BASE_SEQ)
    assert re.fullmatch(rb"[0-9]{40}", sid), sid
    assert _serialization_id(list(BASE_SEQ)) == sid
    assert _serialization_id(BASE_SEQ, alignment=4096) == sid  # names and data.pkl decide, not offsets
    theirs, _ours, _l = run_layouts(BASE_SEQ, 64, BlockRecorder)
    entry = parse_zip_index(theirs.read_at, theirs.pos).find(SERIALIZATION_ID)
    assert entry.compressed_size == len(sid)


def test_serialization_id_changes_with_names_and_pickle():
    sid = _serialization_id(BASE_SEQ)
    renamed = [("data/7", 10)] + BASE_SEQ[1:]
    assert _serialization_id(renamed) != sid
    extra = BASE_SEQ + [("byteorder", b"little")]
    assert _serialization_id(extra) != sid
    other_pickle = BASE_SEQ[:2] + [("data.pkl", b"\x80\x02]q\x00.")] + BASE_SEQ[3:]
    assert _serialization_id(other_pickle) != sid


def test_version_record_is_torchs():
    buf = io.BytesIO()
    torch.save({"a": torch.ones(1)}, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        (name,) = [n for n in z.namelist() if n.endswith("/version")]
        assert z.read(name) == torch_version_record()


@pytest.mark.parametrize("alignment", [0, -64, 65537, 1 << 20])
def test_bad_alignment_rejected(alignment):
    with pytest.raises(ValueError):
        MinizLayout(BlockRecorder(), alignment, b"3\n")


@pytest.mark.parametrize("alignment", [1, 65536])
def test_extreme_alignments_accepted(alignment):
    _assert_same_layout([("data/0", 5), ("data/1", 70000), ("data.pkl", b"p")], alignment)


# ---------------------------------------------------------------- files on disk


def _state():
    g = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(i * 37 + 1, generator=g) for i in range(40)}
    base = torch.arange(5000, dtype=torch.float32)
    state.update(
        base=base,
        view=base[10:900],
        t=base.view(50, 100).t(),
        big=torch.randn(3 << 18, generator=g),  # 3 MiB
        empty=torch.empty(0, 2),
        half=torch.randn(7, generator=g).to(torch.bfloat16),
        u16=torch.zeros(5, dtype=torch.uint16),
        flag=torch.tensor([True, False]),
        scalar=torch.tensor(7, dtype=torch.int16),
        meta={"step": 3, "names": ["a", "b"]},
    )
    return state


def _use_writer(monkeypatch, ours: bool) -> None:
    """Make the planner lay records out with MinizLayout (ours) or torch's writer, and check it does."""
    def refuse(*args, **kwargs):
        raise AssertionError("the other record writer was used")

    if ours:
        assert zipwriter.layout_matches_torch()
        monkeypatch.setattr(torchstream, "_TorchRecords", refuse)
    else:
        monkeypatch.setitem(_compat._RESULTS, "zip_layout", _compat.Status(False, "forced by the test"))
        monkeypatch.setattr(torchstream, "_OurRecords", refuse)


@pytest.mark.parametrize("ours", [True, False], ids=["miniz_layout", "torch_writer"])
def test_saved_file_loads_with_stock_torch(tmp_path, monkeypatch, ours, assert_same):
    _use_writer(monkeypatch, ours)
    state = _state()
    path = tmp_path / "ckpt.pt"
    fastpersist.save(state, path)
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None  # every CRC correct
    assert_same(torch.load(path, weights_only=True), state)
    assert_same(torch.load(path, weights_only=True, mmap=True), state)
    from torch.utils.serialization import config as tconfig

    monkeypatch.setenv("TORCH_SERIALIZATION_DEBUG", "1")  # torch asserts each calculated offset
    with tconfig.patch({"load.calculate_storage_offsets": True}):
        assert_same(torch.load(path, weights_only=True, mmap=True), state)
        assert_same(torch.load(path, weights_only=True), state)
    assert_same(fastpersist.load(path, weights_only=True), state)
    result = fastpersist.verify(path)
    assert result.ok and result.problems == []


@pytest.mark.parametrize("alignment", [64, 4096, 65536])
def test_both_record_writers_write_the_same_file(tmp_path, monkeypatch, alignment):
    """Byte for byte, but for the serialization id (content and CRC fields)."""
    state = _state()
    files = {}
    for ours in (True, False):
        with monkeypatch.context() as m:
            _use_writer(m, ours)
            path = str(tmp_path / f"{ours}.pt")
            torchzip.stream_save_torch(state, path, _native.Handle(), alignment, fsync=False, batch_bytes=1 << 16)
            files[ours] = bytearray(open(path, "rb").read())
    assert len(files[True]) == len(files[False])
    for raw in files.values():
        mv = bytes(raw)
        for off, n in mask_serialization_id(lambda o, k: mv[o : o + k], len(mv)):
            raw[off : off + n] = bytes(n)
    assert files[True] == files[False]
