"""Loads never return wrong values (issue 9, cases 1-4, 9 and 10).

Each test uses the public API only, so it can be run against an older release to
show the defect it guards against.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
import threading
import zipfile

import pytest
import torch

import fastpersist
from fastpersist.errors import CheckpointFormatError, ChecksumError
from fastpersist.formats.zipindex import read_zip_index


def rezip(src, dst, *, method=zipfile.ZIP_STORED, edit=None, drop=(), add=()):
    """Rewrite a torch zip with Python's zipfile (records unaligned, CRCs recomputed)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", method) as zout:
        for info in zin.infolist():
            if info.filename.split("/", 1)[1] in drop:
                continue
            data = zin.read(info)
            if edit is not None:
                data = edit(info.filename.split("/", 1)[1], data)
            zout.writestr(info.filename, data, compress_type=method)
        prefix = zin.infolist()[0].filename.split("/", 1)[0]
        for name, data in add:
            zout.writestr(f"{prefix}/{name}", data, compress_type=method)


def outcome(fn):
    """("ok", value) or ("error", exception type)."""
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001
        return "error", e


def assert_torch_or_clear_error(path, saved, **kw):
    """fastpersist.load returns the saved values or raises a clear error; never other values.

    torch.load is the reference where it is right: when it returns the saved values
    we may only add a clear error (it checks no CRC, we do). Some damaged files make
    torch.load return other values (uninitialized memory, another record's bytes);
    there the saved values or an error are the only acceptable answers."""
    ours = outcome(lambda: fastpersist.load(path, weights_only=False, **kw))
    if ours[0] == "ok":
        assert_equal_trees(ours[1], saved)
    else:
        assert isinstance(ours[1], (CheckpointFormatError, ChecksumError, RuntimeError, OSError, EOFError,
                                    zipfile.BadZipFile, ValueError)), repr(ours[1])
        assert not isinstance(ours[1], (KeyError, struct.error, UnicodeDecodeError, RecursionError))


def assert_equal_trees(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert a.contiguous().view(-1).view(torch.uint8).tolist() == b.contiguous().view(-1).view(torch.uint8).tolist()
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_equal_trees(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_equal_trees(x, y)
    else:
        assert a == b


def small_state():
    return {"a": torch.arange(4, dtype=torch.float32), "b": torch.arange(50, dtype=torch.float32), "step": 3}


# ---------------------------------------------------------------- case 1: user code sees real bytes


class ReadsTensorInSetstate:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.total = float(t.sum())

    def __getstate__(self) -> dict:
        return {"t": self.t}

    def __setstate__(self, state: dict) -> None:
        self.t = state["t"]
        self.total = float(self.t.sum())  # reads storage bytes while unpickling


def total_of(t: torch.Tensor) -> float:
    return float(t.sum())


class ReducesWithTensorSum:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def __reduce__(self):
        return (total_of, (self.t,))


@pytest.mark.parametrize("writer", ["fastpersist", "torch"])
@pytest.mark.parametrize("n", [100, 300_000])
def test_user_code_during_unpickling_sees_the_real_bytes(tmp_path, writer, n):
    t = torch.arange(1, n + 1, dtype=torch.float64)
    obj = {"s": ReadsTensorInSetstate(t), "r": ReducesWithTensorSum(t), "plain": t.clone()}
    p = tmp_path / "c.pt"
    (fastpersist.save if writer == "fastpersist" else torch.save)(obj, p)
    got = fastpersist.load(p, weights_only=False)
    assert got["s"].total == float(t.sum())
    assert got["r"] == float(t.sum())
    assert torch.equal(got["plain"], t)


# ---------------------------------------------------------------- case 2: sizes the records do not back


def test_zeroed_central_directory_size_is_refused(tmp_path):
    p = tmp_path / "c.pt"
    fastpersist.save(small_state(), p)
    e = read_zip_index(p).find("data/1")
    with open(p, "r+b") as f:
        for field in (20, 24):  # compressed and uncompressed size in the central directory
            f.seek(e.cd_offset + field)
            f.write(b"\0\0\0\0")
    with pytest.raises(Exception) as info:
        torch.load(p)
    with pytest.raises((CheckpointFormatError, RuntimeError)):
        fastpersist.load(p)
    del info


@pytest.mark.parametrize("numel", [2, 50, 1000])
def test_pickle_claiming_another_size_is_refused(tmp_path, numel):
    src, p = tmp_path / "src.pt", tmp_path / "c.pt"
    fastpersist.save(small_state(), src)

    def edit(name, data):
        if name == "data.pkl":
            i = data.index(b"cpu" + b"q\x06K\x04")
            data = data[:i] + b"cpu" + b"q\x06K" + bytes([numel % 256]) + data[i + 7:] if numel < 256 else \
                data[:i] + b"cpu" + b"q\x06M" + struct.pack("<H", numel) + data[i + 7:]
        return data

    rezip(src, p, edit=edit)  # CRCs recomputed: checksums cannot catch it
    with pytest.raises(RuntimeError):
        torch.load(p)
    with pytest.raises(CheckpointFormatError, match="claims a storage of"):
        fastpersist.load(p)


def test_missing_record_is_a_clear_error(tmp_path):
    src, p = tmp_path / "src.pt", tmp_path / "c.pt"
    fastpersist.save(small_state(), src)
    rezip(src, p, drop={"data/1"})
    with pytest.raises(Exception):
        torch.load(p)
    with pytest.raises(CheckpointFormatError, match="data/1"):
        fastpersist.load(p)


def test_unreferenced_record_is_not_read(tmp_path):
    """A record the pickle cannot name is skipped: not read, so its bytes cannot matter."""
    src, p = tmp_path / "src.pt", tmp_path / "c.pt"
    fastpersist.save(small_state(), src)
    rezip(src, p, add=[("data/zzz_unused", os.urandom(3 << 20))])
    # corrupt the unused record's bytes: a load that does not read it still succeeds
    e = read_zip_index(p).find("data/zzz_unused")
    with open(p, "r+b") as f:
        f.seek(e.data_offset + 100)
        f.write(b"\xff" * 16)
    out = fastpersist.load(p)
    assert torch.equal(out["b"], small_state()["b"])


# ---------------------------------------------------------------- case 3: compressed records


@pytest.mark.parametrize("writer", ["fastpersist", "torch"])
def test_deflated_checkpoint_loads_like_torch(tmp_path, writer):
    src, p = tmp_path / "src.pt", tmp_path / "c.pt"
    s = {"w": torch.arange(100_000, dtype=torch.float32) % 7, "step": 9}
    (fastpersist.save if writer == "fastpersist" else torch.save)(s, src)
    rezip(src, p, method=zipfile.ZIP_DEFLATED)
    want = torch.load(p)
    got = fastpersist.load(p)
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["w"], s["w"]) and got["step"] == 9


# ---------------------------------------------------------------- case 4: load while saving


@pytest.mark.parametrize("checksum", [True, False])
def test_load_while_the_same_path_is_saved(tmp_path, checksum):
    """Saves replace the file by rename; every load sees one whole checkpoint."""
    p = tmp_path / "c.pt"
    cfg = fastpersist.Config(checksum=checksum)

    def state(k: int) -> dict:
        return {"step": k, **{f"w{i}": torch.full((20_000 * (i + 1),), float(k)) for i in range(6)}}

    fastpersist.save(state(0), p)
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        k = 0
        while not stop.is_set():
            k += 1
            try:
                fastpersist.save(state(k), p, config=fastpersist.Config(fsync=False))
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                return

    th = threading.Thread(target=writer)
    th.start()
    loads = 0
    try:
        for _ in range(60):
            out = fastpersist.load(p, config=cfg)
            loads += 1
            k = out["step"]
            for i in range(6):
                assert bool((out[f"w{i}"] == float(k)).all()), f"load {loads}: step {k} with tensors of another save"
    finally:
        stop.set()
        th.join()
    assert not errors, errors


def test_load_while_saving_in_another_process(tmp_path):
    p = tmp_path / "c.pt"
    fastpersist.save({"step": 0, "w": torch.zeros(100_000)}, p)
    code = textwrap.dedent(
        f"""
        import torch, fastpersist
        for k in range(1, 10**9):
            fastpersist.save({{"step": k, "w": torch.full((100_000,), float(k))}}, {str(p)!r},
                             config=fastpersist.Config(fsync=False))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        for _ in range(80):
            out = fastpersist.load(p)
            assert bool((out["w"] == float(out["step"])).all())
    finally:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------- case 9: clear errors


def test_truncations_of_a_small_file(tmp_path):
    src = tmp_path / "src.pt"
    fastpersist.save(small_state(), src)
    data = src.read_bytes()
    p = tmp_path / "t.pt"
    for cut in sorted({1, 2, 22, 23, 100, len(data) // 2, len(data) - 22, len(data) - 23} | set(range(1, 64))):
        p.write_bytes(data[: len(data) - cut])
        assert_torch_or_clear_error(p, small_state())


def test_every_central_directory_byte_flipped(tmp_path):
    src = tmp_path / "src.pt"
    fastpersist.save(small_state(), src)
    data = bytearray(src.read_bytes())
    idx = read_zip_index(src)
    p = tmp_path / "f.pt"
    for off in range(idx.cd_offset, len(data)):
        bad = bytearray(data)
        bad[off] ^= 0xFF
        p.write_bytes(bad)
        assert_torch_or_clear_error(p, small_state())


# ---------------------------------------------------------------- case 10: memory retention


def test_a_kept_slice_does_not_keep_the_whole_file(tmp_path):
    """Big storages own their memory: keeping a small tensor frees the rest."""
    p = tmp_path / "big.pt"
    fastpersist.save({"a": torch.ones(64 << 20, dtype=torch.uint8), "b": torch.ones(64 << 20, dtype=torch.uint8),
                      "small": torch.arange(10)}, p)
    code = textwrap.dedent(
        f"""
        import gc, torch, fastpersist
        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * 4096
        base = rss()
        out = fastpersist.load({str(p)!r})
        peak = rss()
        keep = out["small"]
        a_slice = out["a"][:10]
        del out; gc.collect()
        pooled = rss()
        # the idle reader kept for the next load holds a bounce buffer of its own (readpolicy's
        # pool, a bounded cache of fastpersist's, not the file's memory): dropped to measure
        from fastpersist import readpolicy
        readpolicy.forget_readers()
        after = rss()
        assert torch.equal(keep, torch.arange(10)) and bool((a_slice == 1).all())
        print(base, peak, after, pooled)
        """
    )
    base, peak, after, pooled = map(int, subprocess.check_output([sys.executable, "-c", code], text=True).split())
    assert peak - base >= 120 << 20  # both big storages were resident
    # only "a" (64 MiB) is kept
    assert after - base < 80 << 20, f"{(after - base) >> 20} MiB still resident ({(pooled - base) >> 20} with the pool)"


def test_crc_mismatch_in_a_big_storage_is_reported(tmp_path):
    p = tmp_path / "c.pt"
    fastpersist.save({"a": torch.randn(1 << 19), "c": torch.randn(10)}, p)
    e = read_zip_index(p).find("data/0")
    with open(p, "r+b") as f:
        f.seek(e.data_offset + 12345)
        b = f.read(1)
        f.seek(e.data_offset + 12345)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(ChecksumError) as info:
        fastpersist.load(p)
    assert e.name in info.value.records
