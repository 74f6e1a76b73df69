"""Adversarial files for ``fastpersist.load`` (issue 9): truncations at every offset,
every header, directory and pickle byte flipped, lying fields.

The property, for every input: ``load`` returns exactly the saved values or raises
a clear error (``CheckpointFormatError``, ``ChecksumError``, or torch's own error
for files it hands to torch); never other values, never a raw ``struct.error``,
``KeyError``, ``UnicodeDecodeError`` or ``RecursionError``.
"""

from __future__ import annotations

import pickle
import struct
import zipfile

import pytest
import torch

import fastpersist
from fastpersist.errors import CheckpointFormatError, ChecksumError
from fastpersist.formats.zipindex import read_zip_index

CLEAR = (CheckpointFormatError, ChecksumError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError,
         OSError, AssertionError, TypeError, AttributeError, ImportError, pickle.UnpicklingError)
RAW = (KeyError, struct.error, UnicodeDecodeError, RecursionError, IndexError)


def saved() -> dict:
    return {
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.tensor([1, 0, 1], dtype=torch.bool),
        "h": torch.arange(5, dtype=torch.bfloat16),
        "e": torch.empty(0),
        "step": 7,
        "name": "run",
    }


def same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
                and a.contiguous().view(-1).view(torch.uint8).tolist() == b.contiguous().view(-1).view(torch.uint8).tolist())
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


def _torch_raises(path, exc_type, weights_only: bool, **kw) -> bool:
    """Whether stock torch.load raises ``exc_type`` for the file too (e.g. a file whose
    zip signature is broken goes to torch's legacy reader, whose weights-only unpickler
    raises IndexError): then that is torch's result, not ours."""
    try:
        torch.load(path, weights_only=weights_only, **kw)
    except exc_type:
        return True
    except Exception:  # noqa: BLE001 - another error: not the same answer
        return False
    return False


def check(path, want, **kw) -> str:
    """'ok' (the saved values) or 'error' (a clear one); fails the test otherwise. Both
    load paths answer: ``weights_only=False`` (pickle dry run first, then the read) and
    the default weights-only load (the bulk read starts before the pickle is parsed,
    torchload._load_fast); both must give the saved values or a clear error."""
    outcome = None
    for weights_only in (False, True):
        try:
            got = fastpersist.load(path, weights_only=weights_only, **kw)
        except RAW as e:
            if not _torch_raises(path, type(e), weights_only, **kw):  # torch's own answer for a file handed to it
                pytest.fail(f"{path} (weights_only={weights_only}): raw {type(e).__name__}: {e}")
            outcome = outcome or "error"
            continue
        except CLEAR as e:
            assert not isinstance(e, RAW)
            outcome = outcome or "error"
            continue
        assert same(got, want), f"{path} (weights_only={weights_only}): load returned other values than were saved"
        outcome = "ok" if outcome in (None, "ok") else outcome
    return outcome


@pytest.fixture(scope="module", params=["fastpersist", "torch"])
def original(request, tmp_path_factory):
    p = tmp_path_factory.mktemp("orig") / "c.pt"
    (fastpersist.save if request.param == "fastpersist" else torch.save)(saved(), p)
    return request.param, p.read_bytes()


def header_offsets(data: bytes, path) -> list[int]:
    """Every byte of every local header, data descriptor, the pickle and the directory
    (padding inside extra fields excluded: it carries nothing)."""
    idx = read_zip_index(path)
    out: set[int] = set(range(idx.cd_offset, len(data)))
    for e in idx.entries:
        name_end = e.header_offset + 30 + len(e.name.encode())
        out.update(range(e.header_offset, min(name_end + 8, e.data_offset)))
        if e.descriptor_offset is not None:
            out.update(range(e.descriptor_offset, e.descriptor_offset + e.descriptor_size))
        if e.name.endswith("data.pkl") or not e.name.split("/")[-2:-1] == ["data"]:
            out.update(range(e.data_offset, e.data_end))
    return sorted(out)


def test_truncated_at_every_offset(original, tmp_path):
    writer, data = original
    p = tmp_path / "t.pt"
    want = saved()
    counts = {"ok": 0, "error": 0}
    step = 1 if len(data) < 4000 else 13  # fastpersist files are ~20 KB of mostly padding
    for n in range(0, len(data), step):
        p.write_bytes(data[:n])
        counts[check(p, want)] += 1
    assert counts["ok"] == 0  # no truncated file holds the whole checkpoint


def test_every_header_byte_flipped(original, tmp_path):
    writer, data = original
    src = tmp_path / "src.pt"
    src.write_bytes(data)
    p = tmp_path / "f.pt"
    want = saved()
    counts = {"ok": 0, "error": 0}
    for off in header_offsets(data, src):
        for x in (0xFF, 0x01):
            bad = bytearray(data)
            bad[off] ^= x
            p.write_bytes(bad)
            counts[check(p, want)] += 1
    assert counts["error"] > 0


def payload_flips(original, tmp_path):
    """Yield the path of a copy of the file with one payload byte flipped, for every byte of
    every storage record (the file is rewritten between yields)."""
    _writer, data = original
    src = tmp_path / "src.pt"
    src.write_bytes(data)
    p = tmp_path / "f.pt"
    for e in read_zip_index(src).entries:
        if "/data/" not in e.name or e.compressed_size == 0:
            continue
        for off in range(e.data_offset, e.data_end):
            bad = bytearray(data)
            bad[off] ^= 0x10
            p.write_bytes(bad)
            yield p


def test_every_payload_byte_flipped_is_caught(original, tmp_path):
    """In a file fastpersist wrote. A file torch wrote loads as torch.load loads it (its
    storages may have been changed in place through a MAP_SHARED mmap load; see
    fastpersist.formats.crcpolicy), with the values torch returns."""
    writer, _data = original
    for p in payload_flips(original, tmp_path):
        if writer == "torch":
            got, want = fastpersist.load(p), torch.load(p)
            assert same(got, want)  # torch's values
            continue
        with pytest.raises(ChecksumError):
            fastpersist.load(p)


@pytest.mark.parametrize("field,width", [(18, 4), (22, 4), (20, 4), (24, 4), (42, 4), (28, 2), (30, 2), (8, 2),
                                         (10, 2), (34, 2)])
@pytest.mark.parametrize("value", [0, 1, 0xFFFFFFFF, 0x7FFFFFFF, 4096])
def test_lying_central_directory_fields(original, tmp_path, field, width, value):
    """Sizes, offsets, name/extra lengths, method and disk number of each record, set to lies."""
    writer, data = original
    src = tmp_path / "src.pt"
    src.write_bytes(data)
    p = tmp_path / "f.pt"
    want = saved()
    for e in read_zip_index(src).entries:
        bad = bytearray(data)
        bad[e.cd_offset + field : e.cd_offset + field + width] = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "little")
        p.write_bytes(bad)
        check(p, want)


@pytest.mark.parametrize("field,width", [(4, 2), (6, 2), (8, 2), (10, 2), (12, 4), (16, 4), (20, 4)])
@pytest.mark.parametrize("value", [0, 1, 0xFFFF, 0xFFFFFFFF])
def test_lying_end_record_fields(original, tmp_path, field, width, value):
    writer, data = original
    src = tmp_path / "src.pt"
    src.write_bytes(data)
    idx = read_zip_index(src)
    bad = bytearray(data)
    at = idx.eocd_offset + field
    bad[at : at + width] = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "little")
    p = tmp_path / "f.pt"
    p.write_bytes(bad)
    check(p, saved())


@pytest.mark.parametrize("lie", ["encrypted", "deflated"])
def test_local_header_at_odds_with_the_directory(original, tmp_path, lie):
    """A local header that says encrypted (flag bit 0) or compressed (method 8) where the
    central directory says stored: a file at odds with itself, a ZipFormatError. It used
    to be taken for a layout this reader does not handle and handed to torch.load, which
    believes the directory and checks no CRC-32: a flipped payload byte came back as
    values (checksum on), and a record the directory also marks as a directory
    (external attribute 0x10) as memory torch never filled (fuzz: load, seed 1)."""
    writer, data = original
    src = tmp_path / "src.pt"
    src.write_bytes(data)
    idx = read_zip_index(src)
    by_short = {e.name.split("/", 1)[1]: e for e in idx.entries}
    bad = bytearray(data)
    e = by_short["byteorder"]
    if lie == "encrypted":
        bad[e.header_offset + 6] |= 0x01
    else:
        bad[e.header_offset + 8:e.header_offset + 10] = struct.pack("<H", 8)
    w = by_short["data/0"]  # "w": flip a payload byte (its CRC no longer matches)
    bad[w.data_offset] ^= 0x10
    h = by_short["data/2"]  # "h": marked a directory in the central directory (miniz will not extract it)
    bad[h.cd_offset + 38] |= 0x10
    p = tmp_path / "f.pt"
    p.write_bytes(bad)
    for weights_only in (False, True):
        with pytest.raises(CheckpointFormatError, match="local header"):
            fastpersist.load(p, weights_only=weights_only)
        with pytest.raises(CheckpointFormatError):
            fastpersist.load(p, weights_only=weights_only, mmap=True)
    with pytest.raises(CheckpointFormatError, match="local header"):
        fastpersist.load(p, config=fastpersist.Config(checksum=False))
    with pytest.raises(CheckpointFormatError, match="local header"):
        fastpersist.open(p)


_RSS_SCRIPT = r"""
import resource, sys, warnings
warnings.filterwarnings("ignore")
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # never the machine's OOM killer, whatever happens
import torch, fastpersist
path, want = sys.argv[1], torch.load(sys.argv[1], weights_only=True)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
got = [fastpersist.load(path, weights_only=True, map_location=lambda s, _loc: s),  # not the fast unpickler
       fastpersist.load(path, weights_only=True, mmap=True)]
res = fastpersist.verify(path)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
for g in got:
    assert list(g) == list(want) and all(torch.equal(g[k], want[k]) for k in want if isinstance(want[k], torch.Tensor))
assert not res.ok and "beyond its size" in " ".join(res.problems), res.problems  # no Python pickler writes it
"""


def test_huge_memo_index_is_not_an_allocation(tmp_path):
    """A ``LONG_BINPUT`` to memo index 30,000,000 in an otherwise valid pickle (torch's
    writer, CRCs right): torch.load(weights_only=True) keeps its memo in a dict and loads
    the file; the dry run of the pickle (picklescan, C pickle) grew its memo array to
    2 * index slots and zeroed them: 480 MB here, 20 GB for the fuzz's index of
    1,263,614,577 (the load fuzz was OOM-killed). Now refused before C pickle runs it
    (the scan is "not understood"), so load and load(mmap=True) answer as torch does, in
    the memory of the file; verify reports the file as corrupt (no pickler writes it,
    and a weights_only=False load of it makes that allocation in torch's own unpickler)."""
    import subprocess
    import sys

    p = tmp_path / "c.pt"
    torch.save(saved(), p)
    with zipfile.ZipFile(p) as z:
        prefix = z.namelist()[0].split("/")[0]
        records = [(n.split("/", 1)[1], z.read(n)) for n in z.namelist()]
    pkl = dict(records)["data.pkl"]
    assert pkl.startswith(b"\x80\x02}q\x00")  # PROTO 2, EMPTY_DICT, BINPUT 0
    pkl = pkl[:5] + b"r" + struct.pack("<I", 30_000_000) + pkl[5:]  # memoize the dict again, far away
    w = torch._C.PyTorchFileWriter(str(p), True, 64)
    for name, data in records:
        data = pkl if name == "data.pkl" else data
        w.write_record(name, data, len(data))
    w.write_end_of_file()
    del w
    assert prefix and same(torch.load(p, weights_only=True), saved())
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(p)], capture_output=True, text=True, timeout=300)
    grew_mb = int(out.stdout.split()[-1])
    assert grew_mb < 200, f"loading and verifying a 1 KB pickle grew the process by {grew_mb} MB"
    assert out.returncode == 0, out.stderr[-2000:]
