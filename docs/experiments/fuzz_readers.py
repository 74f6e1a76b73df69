"""Differential random fuzz of every fastpersist reader against stock torch / safetensors / DCP.

Run (one process, low priority, e.g. ``nice -n 19``)::

    python docs/experiments/fuzz_readers.py --reader all --seconds 600 --seed 1 --dir /tmp/fuzz

Readers (``--reader``): ``load`` (``fastpersist.load``, torch zip files written by
fastpersist.save and by torch.save, ``weights_only`` True and False, checksums on and
sometimes off), ``mmap`` (``load(mmap=True)``), ``safetensors`` (``load`` with and
without mmap on files written by fastpersist and by the safetensors library),
``into`` (``load_state_dict`` into a dict and an ``nn.Module``), ``partial``
(``fastpersist.open(...).get/get_many``), ``verify`` and ``dcp``
(``FastPersistReader`` through ``dcp.load`` on checkpoints of ``FastPersistWriter``
and of stock ``FileSystemWriter``).

Mutations are multi-byte and structural: 2-8 flips at once, a flip plus a
truncation, overwritten byte runs, inserted/deleted bytes, swapped records (with and
without their CRCs), duplicated central-directory entries, lying fields (local
header, central directory, end records, zip64 records), payload bytes changed with
every CRC field rewritten to match, pickle opcodes rewritten (ints, strings) with the
CRC fixed or the archive rebuilt by torch's own writer (records dropped, added,
resized), safetensors header JSON edits (dtype, shape, offsets, metadata) with or
without fastpersist's CRCs re-signed, DCP ``.metadata`` edits re-sealed.

The oracle (tests/test_hostile_load.py ``check``, extended to self-consistent files):

* ours raises a clear error (CheckpointFormatError, ChecksumError, or the error types
  torch itself raises for files it is handed) -> "error";
  a raw KeyError/IndexError/struct.error/UnicodeDecodeError/RecursionError only when
  stock raises the same type for the same file -> "error", else BUG;
* ours returns the saved values exactly (type, dtype, shape, stride, bytes) -> "ok";
* ours returns other values: "stock" if stock torch / safetensors / DCP returns the
  same values for the same file and arguments (a self-consistent file: CRCs rewritten,
  records renamed; no reader can tell), else BUG: a silently wrong tensor;
* safetensors: returning values where ``load_file`` raises is "lenient" (reported
  apart: the agreed safetensors oracle wants load_file's answer);
* load_state_dict: the target ends with the saved (or, for a self-consistent file,
  stock's) values, or an error is raised and the target is untouched (a
  PartialLoadError may leave it partly written: it says so);
* verify: "ok" only if torch.load / load_file / stock DCP and fastpersist.load return
  the saved values, or both return the same other values (self-consistent file).

Each BUG is saved under ``--dir`` (``bug-<reader>-<n>.<ext>`` or a directory) with a
``.txt`` beside it naming the mutation and the outcome.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import pickle
import pickletools
import random
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
import warnings
import zipfile
import zlib
from typing import Any, Callable, Optional

import torch

import fastpersist
from fastpersist.errors import CheckpointFormatError, ChecksumError, FastPersistError, UnsupportedLayoutError
from fastpersist.formats.zipindex import read_zip_index

warnings.filterwarnings("ignore")

CLEAR = (CheckpointFormatError, ChecksumError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError,
         OSError, AssertionError, TypeError, AttributeError, ImportError, pickle.UnpicklingError,
         UnsupportedLayoutError)
RAW = (KeyError, struct.error, UnicodeDecodeError, RecursionError, IndexError)

READERS = ("load", "mmap", "safetensors", "into", "partial", "verify", "dcp")


class Hang(Exception):
    pass


def _alarm(_sig: int, _frm: Any) -> None:
    raise Hang("case took longer than the per-case limit")


# --------------------------------------------------------------------------- states


def saved_torch() -> dict:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(4, 6, generator=g)
    return {
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.tensor([1, 0, 1], dtype=torch.bool),
        "h": torch.arange(5, dtype=torch.bfloat16),
        "i": torch.arange(9, dtype=torch.int16),
        "e": torch.empty(0),
        "v": base,
        "t": base.t(),  # non-contiguous view sharing the storage of "v"
        "s": base[1:3, 2:],  # offset view
        "l": torch.randn(300, generator=g, dtype=torch.float64),
        "step": 7,
        "name": "run",
    }


def saved_st() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(3, 4, generator=g),
        "b": torch.arange(5, dtype=torch.int16),
        "e": torch.empty(0, 2),
        "h": torch.ones(2, dtype=torch.bfloat16),
        "d": torch.randn(7, generator=g, dtype=torch.float64),
        "u": torch.arange(6, dtype=torch.uint8),
    }


def tensors_of(state: dict) -> dict:
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def tbytes(t: torch.Tensor) -> bytes:
    if t.numel() == 0:
        return b""
    return bytes(torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8).numpy())


def same(a: Any, b: Any) -> bool:
    try:
        return _same(a, b)
    except RuntimeError:
        return False


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
                and tbytes(a) == tbytes(b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.serialization.StorageType):  # no __eq__: two loads give two equal objects
        return a.dtype == b.dtype
    if isinstance(a, torch.storage.TypedStorage):  # a storage in the result (pickle edits): same dtype and bytes
        return a.dtype == b.dtype and a.device == b.device and _same(a._untyped_storage, b._untyped_storage)
    if isinstance(a, torch.UntypedStorage):
        return a.device == b.device and a.nbytes() == b.nbytes() and bytes(a.cpu()) == bytes(b.cpu())
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return False


def same_values(a: Any, b: Any) -> bool:
    """dtype, shape and bytes (a load into existing tensors keeps the target's strides)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    try:
        return a.dtype == b.dtype and a.shape == b.shape and tbytes(a) == tbytes(b)
    except RuntimeError:
        return False


def call(fn: Callable[[], Any]) -> tuple[bool, Any]:
    """(True, result) or (False, exception)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return True, fn()
    except Hang:
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt):
            raise
        return False, e


def _err(e: BaseException) -> str:
    return f"error:{type(e).__name__}"


# --------------------------------------------------------------------------- zip helpers


def structure_offsets(data: bytes, path: str) -> tuple[list[int], list[int]]:
    """(structure offsets: headers, descriptors, pickle, small records, directory, end
    records; payload offsets: storage bytes)."""
    idx = read_zip_index(path)
    st: set[int] = set(range(idx.cd_offset, len(data)))
    pay: set[int] = set()
    for e in idx.entries:
        name_end = e.header_offset + 30 + len(e.name.encode())
        st.update(range(e.header_offset, min(name_end + 20, e.data_offset)))
        if e.descriptor_offset is not None:
            st.update(range(e.descriptor_offset, e.descriptor_offset + e.descriptor_size))
        if "/data/" in e.name and not e.name.endswith(".pkl"):
            pay.update(range(e.data_offset, e.data_end))
        else:
            st.update(range(e.data_offset, e.data_end))
    return sorted(st), sorted(pay) or sorted(st)


def set_crc(b: bytearray, entry: Any, crc: int) -> None:
    for off in entry.crc_field_offsets:
        b[off:off + 4] = struct.pack("<I", crc & 0xFFFFFFFF)


def rebuild(records: list[tuple[str, bytes]], alignment: int, workdir: str) -> bytes:
    """A torch archive written by torch's own writer (sizes, CRCs consistent)."""
    p = os.path.join(workdir, "archive")
    w = torch._C.PyTorchFileWriter(p, True, alignment)
    for name, data in records:
        w.write_record(name, data, len(data))
    w.write_end_of_file()
    del w
    with open(p, "rb") as f:
        return f.read()


def as_read(path: str, workdir: str) -> Optional[str]:
    """The records of the torch file at ``path`` as fastpersist's reader takes them (names
    and sizes from the central directory, data after each local header's name and extra
    field, only the records in data.pkl's folder), written again by torch's own writer:
    the file whose torch.load answer a ``checksum=False`` load must give. None when the
    directory cannot be read or torch's writer refuses the records (duplicate names)."""
    from fastpersist.formats.zipindex import fd_reader, read_central_directory

    with open(path, "rb") as fh:
        data = fh.read()
    fd = os.open(path, os.O_RDONLY)
    try:
        _cd, entries = read_central_directory(fd_reader(fd, path), len(data), path)
    except Exception:  # noqa: BLE001 - no directory: nothing to compare with
        return None
    finally:
        os.close(fd)
    pkl = [e.name for e in entries if e.name.endswith("data.pkl")]
    if not pkl:
        return None
    prefix = pkl[0][: -len("data.pkl")]
    records = []
    for e in entries:
        if not e.name.startswith(prefix) or e.header_offset + 30 > len(data):
            continue
        nlen, xlen = struct.unpack_from("<HH", data, e.header_offset + 26)
        at = e.header_offset + 30 + nlen + xlen
        records.append((e.name[len(prefix):], data[at:at + e.compressed_size]))
    try:
        rebuilt = rebuild(records, 64, workdir)
    except RuntimeError:
        return None
    out = os.path.join(workdir, "as-read.pt")
    with open(out, "wb") as fh:
        fh.write(rebuilt)
    return out


def zip_records(data: bytes) -> tuple[list[tuple[str, bytes]], str]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        names = z.namelist()
        prefix = names[0].split("/")[0]
        out = [(n.split("/", 1)[1], z.read(n)) for n in names]
    return out, prefix


INTERESTING = [0, 1, 2, 0x7F, 0x80, 0xFF, 0x100, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 4096, 64]


def pickle_mutation(pkl: bytes, rng: random.Random) -> tuple[bytes, str]:
    """Rewrite one or two pickle operations: an int argument, a string argument (taken
    from the pickle's own strings or storage type names), or a raw opcode byte."""
    ops = list(pickletools.genops(pkl))
    ints = [(op, arg, pos) for op, arg, pos in ops if op.name in ("BININT1", "BININT2", "BININT", "LONG1")]
    strs = [(op, arg, pos) for op, arg, pos in ops if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8")]
    pool = sorted({a for _o, a, _p in strs} | {"FloatStorage", "HalfStorage", "BFloat16Storage", "LongStorage",
                                              "IntStorage", "ShortStorage", "ByteStorage", "BoolStorage",
                                              "DoubleStorage", "CharStorage", "0", "1", "2", "3", "cpu", "cuda:0"})
    b = bytearray(pkl)
    what = []
    for _ in range(rng.choice((1, 1, 2))):
        kind = rng.random()
        if kind < 0.5 and ints:
            op, arg, pos = rng.choice(ints)
            if op.name == "BININT1":
                v = rng.choice([0, 1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 255, (arg or 0) + 1, max(0, (arg or 0) - 1)]) & 0xFF
                b[pos + 1] = v
            elif op.name == "BININT2":
                v = rng.choice([0, 1, (arg + 1) & 0xFFFF, 0xFFFF, 300, 600, 2400])
                b[pos + 1:pos + 3] = struct.pack("<H", v)
            elif op.name == "BININT":
                v = rng.choice([0, -1, 1, arg + 1, arg - 1, 2**31 - 1, -(2**31), 4096])
                b[pos + 1:pos + 5] = struct.pack("<i", v)
            else:
                continue
            what.append(f"{op.name}@{pos}:{arg}->{v}")
        elif kind < 0.85 and strs:
            op, arg, pos = rng.choice(strs)
            new = rng.choice(pool)
            enc = new.encode()
            if op.name == "SHORT_BINUNICODE":
                if len(enc) > 255:
                    continue
                old_len = 2 + b[pos + 1]
                rep = bytes([0x8C, len(enc)]) + enc
            elif op.name == "BINUNICODE":
                old_len = 5 + struct.unpack_from("<I", b, pos + 1)[0]
                rep = b"X" + struct.pack("<I", len(enc)) + enc
            else:
                old_len = 9 + struct.unpack_from("<Q", b, pos + 1)[0]
                rep = b"\x8d" + struct.pack("<Q", len(enc)) + enc
            b[pos:pos + old_len] = rep
            what.append(f"{op.name}@{pos}:{arg!r}->{new!r}")
            break  # positions after this one moved
        else:
            pos = rng.randrange(len(b))
            b[pos] ^= rng.randrange(1, 256)
            what.append(f"byte@{pos}")
            break
    return bytes(b), "pickle[" + ",".join(what) + "]"


def zip_mutate(data: bytes, path: str, rng: random.Random, alignment: int, workdir: str) -> tuple[bytes, str, bool]:
    """(mutated bytes, label, self_consistent): self_consistent when every CRC and size
    was rewritten to match (stock readers then see a valid file of other values)."""
    idx = read_zip_index(path)
    st, pay = structure_offsets(data, path)
    anyoff = lambda: rng.random() < 0.6 and rng.choice(st) or (rng.random() < 0.75 and rng.choice(pay)) or rng.randrange(len(data))  # noqa: E731
    storages = [e for e in idx.entries if "/data/" in e.name and not e.name.endswith(".pkl")]
    pkl = next(e for e in idx.entries if e.name.endswith("data.pkl"))
    b = bytearray(data)
    kind = rng.choice(["flips", "flips", "flip_trunc", "overwrite", "insert", "delete", "swap", "dup_cd", "crc_fix",
                       "pickle", "pickle", "lying", "zip64", "rebuild", "truncate_multi"])
    if kind == "flips":
        offs = [anyoff() for _ in range(rng.randint(2, 8))]
        for o in offs:
            b[o] ^= rng.randrange(1, 256)
        return bytes(b), f"flips{offs}", False
    if kind == "flip_trunc":
        o = anyoff()
        b[o] ^= rng.randrange(1, 256)
        n = rng.choice([rng.randrange(len(b)), len(b) - rng.randint(1, 64), idx.cd_offset + rng.randint(0, 40)])
        return bytes(b[:max(0, n)]), f"flip@{o}+trunc@{n}", False
    if kind == "truncate_multi":
        n = rng.randrange(len(b))
        o = rng.randrange(max(1, n))
        b[o:o + 4] = bytes(rng.randrange(256) for _ in range(4))
        return bytes(b[:n]), f"run4@{o}+trunc@{n}", False
    if kind == "overwrite":
        o = anyoff()
        n = rng.randint(1, 32)
        fill = rng.choice([bytes(rng.randrange(256) for _ in range(n)), b"\x00" * n, b"\xff" * n])
        b[o:o + n] = fill
        return bytes(b[:len(data)]), f"overwrite{n}@{o}", False
    if kind == "insert":
        o = anyoff()
        n = rng.randint(1, 64)
        b[o:o] = bytes(rng.randrange(256) for _ in range(n))
        return bytes(b), f"insert{n}@{o}", False
    if kind == "delete":
        o = anyoff()
        n = rng.randint(1, 64)
        del b[o:o + n]
        return bytes(b), f"delete{n}@{o}", False
    if kind == "swap" and len(storages) >= 2:
        x, y = rng.sample(storages, 2)
        variant = rng.choice(["data", "data+crc", "names"])
        if variant == "names" and len(x.name) == len(y.name):
            for e, other in ((x, y), (y, x)):
                nb = other.name.encode()
                b[e.cd_offset + 46:e.cd_offset + 46 + len(nb)] = nb
                b[e.header_offset + 30:e.header_offset + 30 + len(nb)] = nb
            return bytes(b), f"swap-names {x.name}<->{y.name}", True
        n = min(x.compressed_size, y.compressed_size)
        dx, dy = data[x.data_offset:x.data_offset + n], data[y.data_offset:y.data_offset + n]
        b[x.data_offset:x.data_offset + n] = dy
        b[y.data_offset:y.data_offset + n] = dx
        if variant == "data+crc":
            set_crc(b, x, zlib.crc32(b[x.data_offset:x.data_end]))
            set_crc(b, y, zlib.crc32(b[y.data_offset:y.data_end]))
            return bytes(b), f"swap-data+crc {n}B {x.name}<->{y.name}", True
        return bytes(b), f"swap-data {n}B {x.name}<->{y.name}", False
    if kind == "dup_cd":
        e = rng.choice(idx.entries)
        nlen, xlen, clen = struct.unpack_from("<HHH", data, e.cd_offset + 28)
        rec = bytearray(data[e.cd_offset:e.cd_offset + 46 + nlen + xlen + clen])
        label = f"dup-cd {e.name}"
        if rng.random() < 0.5:  # the copy names another entry of the same name length
            others = [o for o in idx.entries if o is not e and len(o.name) == len(e.name)]
            if others:
                o = rng.choice(others)
                rec[46:46 + nlen] = o.name.encode()
                label += f" renamed {o.name}"
        at = rng.choice([e.cd_offset + len(rec), e.cd_offset, idx.cd_offset + idx.cd_size])
        b[at:at] = rec
        shift = len(rec)
        eocd = idx.eocd_offset + shift
        cnt = struct.unpack_from("<H", b, eocd + 8)[0]
        if cnt != 0xFFFF:
            struct.pack_into("<HHI", b, eocd + 8, cnt + 1, cnt + 1, struct.unpack_from("<I", b, eocd + 12)[0] + shift)
        if idx.zip64:  # zip64 end record and locator sit between the directory and the end record
            z = b.rfind(b"PK\x06\x06", 0, eocd)
            loc = b.rfind(b"PK\x06\x07", 0, eocd)
            if z >= 0:
                n64 = struct.unpack_from("<Q", b, z + 24)[0]
                struct.pack_into("<QQQ", b, z + 24, n64 + 1, n64 + 1, struct.unpack_from("<Q", b, z + 40)[0] + shift)
            if loc >= 0:
                struct.pack_into("<Q", b, loc + 8, struct.unpack_from("<Q", b, loc + 8)[0] + shift)
        return bytes(b), label + f" at {at}", False
    if kind == "crc_fix":
        e = rng.choice(storages + [pkl])
        if e.compressed_size == 0:
            return bytes(b), "noop", True
        offs = [rng.randrange(e.data_offset, e.data_end) for _ in range(rng.randint(1, 4))]
        for o in offs:
            b[o] ^= rng.randrange(1, 256)
        set_crc(b, e, zlib.crc32(b[e.data_offset:e.data_end]))
        return bytes(b), f"crc-fixed flips{offs} in {e.name}", True
    if kind == "pickle":
        body = data[pkl.data_offset:pkl.data_end]
        new, label = pickle_mutation(body, rng)
        if len(new) == len(body) and rng.random() < 0.7:
            b[pkl.data_offset:pkl.data_end] = new
            set_crc(b, pkl, zlib.crc32(new))
            return bytes(b), label + " crc-fixed", True
        recs, _prefix = zip_records(data)
        recs = [(n, new if n == "data.pkl" else d) for n, d in recs]
        return rebuild(recs, alignment, workdir), label + " rebuilt", True
    if kind == "rebuild":
        recs, _prefix = zip_records(data)
        sidx = [i for i, (n, _d) in enumerate(recs) if n.startswith("data/")]
        v = rng.choice(["drop", "add", "grow", "shrink", "reorder", "swapnames", "dup"])
        i = rng.choice(sidx)
        n, d = recs[i]
        if v == "drop":
            del recs[i]
        elif v == "add":
            recs.insert(rng.randrange(len(recs) + 1), (f"data/{rng.choice([9, 99, 1000])}", rng.randbytes(rng.randint(0, 64))))
        elif v == "grow":
            recs[i] = (n, d + rng.randbytes(rng.choice([1, 2, 8, 64])))
        elif v == "shrink":
            recs[i] = (n, d[:rng.randrange(len(d) + 1)] if d else d)
        elif v == "reorder":
            rng.shuffle(recs)
        elif v == "dup":
            recs.insert(rng.randrange(len(recs) + 1), (n, rng.randbytes(len(d))))
        else:
            j = rng.choice(sidx)
            recs[i], recs[j] = (recs[j][0], d), (n, recs[j][1])
        try:
            return rebuild(recs, rng.choice([alignment, 64, 4096]), workdir), f"rebuild-{v} {n}", True
        except RuntimeError as exc:  # torch's writer refuses a duplicate name
            return bytes(b), f"rebuild-{v} refused by writer ({exc.__class__.__name__})", True
    if kind == "zip64" and idx.zip64:
        z = data.rfind(b"PK\x06\x06")
        loc = data.rfind(b"PK\x06\x07")
        fields = [(z + 4, 8), (z + 12, 2), (z + 14, 2), (z + 16, 4), (z + 20, 4), (z + 24, 8), (z + 32, 8),
                  (z + 40, 8), (z + 48, 8), (loc + 4, 4), (loc + 8, 8), (loc + 16, 4)]
        picks = rng.sample(fields, rng.randint(1, 3))
        for at, w in picks:
            cur = int.from_bytes(b[at:at + w], "little")
            v = rng.choice([0, 1, cur + 1, cur - 1, cur + 4096, cur ^ (1 << rng.randrange(8 * w)), (1 << (8 * w)) - 1,
                            len(data), idx.cd_offset, idx.cd_size]) & ((1 << (8 * w)) - 1)
            b[at:at + w] = v.to_bytes(w, "little")
        return bytes(b), f"zip64 fields {[(a, w) for a, w in picks]}", False
    # lying: a field of a local header, central directory entry or end record
    e = rng.choice(idx.entries)
    where = rng.choice(["cd", "local", "eocd", "desc"])
    if where == "cd":
        at, w = rng.choice([(8, 2), (10, 2), (14, 4), (18, 4), (20, 4), (24, 4), (28, 2), (30, 2), (32, 2), (34, 2),
                            (36, 2), (38, 4), (42, 4)])
        base = e.cd_offset
    elif where == "local":
        at, w = rng.choice([(6, 2), (8, 2), (14, 4), (18, 4), (22, 4), (26, 2), (28, 2)])
        base = e.header_offset
    elif where == "desc" and e.descriptor_offset is not None:
        at, w = rng.choice([(4, 4), (8, 4), (12, 4)])
        base = e.descriptor_offset
    else:
        at, w = rng.choice([(4, 2), (6, 2), (8, 2), (10, 2), (12, 4), (16, 4), (20, 2)])
        base = idx.eocd_offset
    cur = int.from_bytes(b[base + at:base + at + w], "little")
    others = [o.compressed_size for o in idx.entries] + [o.header_offset for o in idx.entries]
    v = rng.choice(INTERESTING + [cur + 1, cur - 1, cur + 64, cur + 4096, rng.choice(others)]) & ((1 << (8 * w)) - 1)
    b[base + at:base + at + w] = v.to_bytes(w, "little")
    label = f"lying {where}+{at} of {e.name}: {cur}->{v}"
    if rng.random() < 0.3:  # and one more flip somewhere
        o = anyoff()
        b[o] ^= rng.randrange(1, 256)
        label += f" +flip@{o}"
    return bytes(b), label, False


# --------------------------------------------------------------------------- safetensors helpers


def st_split(raw: bytes) -> tuple[dict, bytes, int]:
    n = struct.unpack_from("<Q", raw)[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:], n


ST_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8, "C64": 8}


def st_resign(head: dict, data: bytes) -> None:
    """Recompute fastpersist's CRCs (per tensor in data order, and the header's) after an edit."""
    from fastpersist.formats.safetensors import CRC_METADATA_KEY, HEADER_CRC_METADATA_KEY, header_crc32

    meta = head.get("__metadata__")
    if not isinstance(meta, dict) or CRC_METADATA_KEY not in meta:
        return
    ents = {k: v for k, v in head.items() if k != "__metadata__"}
    try:
        order = sorted(ents.items(), key=lambda kv: tuple(kv[1]["data_offsets"]))
        meta[CRC_METADATA_KEY] = ",".join(f"{zlib.crc32(data[e['data_offsets'][0]:e['data_offsets'][1]]):08x}"
                                          for _k, e in order)
        meta[HEADER_CRC_METADATA_KEY] = f"{header_crc32({k: (e['dtype'], e['shape'], e['data_offsets']) for k, e in ents.items()}, meta):08x}"
    except Exception:  # noqa: BLE001 - an edit that made the header unusable: leave it
        pass


def st_join(head: dict, data: bytes, old_len: int, rng: random.Random) -> bytes:
    text = json.dumps(head, separators=(",", ":")).encode()
    if len(text) <= old_len and rng.random() < 0.8:
        text = text + b" " * (old_len - len(text))  # keep the data where it was
    return struct.pack("<Q", len(text)) + text + data


def st_mutate(raw: bytes, rng: random.Random) -> tuple[bytes, str, bool]:
    head, data, hlen = st_split(raw)
    b = bytearray(raw)
    hdr_end = 8 + hlen
    anyoff = lambda: rng.randrange(8, hdr_end) if rng.random() < 0.5 else rng.randrange(len(raw))  # noqa: E731
    kind = rng.choice(["flips", "flip_trunc", "overwrite", "insert", "json", "json", "json", "json", "crc_fix",
                       "hlen"])
    if kind == "flips":
        offs = [anyoff() for _ in range(rng.randint(2, 8))]
        for o in offs:
            b[o] ^= rng.randrange(1, 256)
        return bytes(b), f"flips{offs}", False
    if kind == "flip_trunc":
        o = anyoff()
        b[o] ^= rng.randrange(1, 256)
        n = rng.randrange(len(b))
        return bytes(b[:n]), f"flip@{o}+trunc@{n}", False
    if kind == "overwrite":
        o = anyoff()
        n = rng.randint(1, 24)
        b[o:o + n] = bytes(rng.randrange(256) for _ in range(n))
        return bytes(b[:len(raw)]), f"overwrite{n}@{o}", False
    if kind == "insert":
        o = anyoff()
        n = rng.randint(1, 32)
        if rng.random() < 0.5:
            b[o:o] = bytes(rng.randrange(256) for _ in range(n))
            return bytes(b), f"insert{n}@{o}", False
        del b[o:o + n]
        return bytes(b), f"delete{n}@{o}", False
    if kind == "hlen":
        v = rng.choice([hlen - 1, hlen + 1, hlen - 8, hlen + 8, 0, len(raw), len(raw) - 8, 2**63, hlen - rng.randint(1, 200)])
        struct.pack_into("<Q", b, 0, v & (2**64 - 1))
        return bytes(b), f"header-len {hlen}->{v}", False
    if kind == "crc_fix":
        offs = [rng.randrange(len(data)) for _ in range(rng.randint(1, 4))] if data else []
        d = bytearray(data)
        for o in offs:
            d[o] ^= rng.randrange(1, 256)
        st_resign(head, bytes(d))
        return st_join(head, bytes(d), hlen, rng), f"crc-fixed data flips{offs}", True
    names = [k for k in head if k != "__metadata__"]
    edits = []
    resign = rng.random() < 0.6
    for _ in range(rng.randint(1, 3)):
        k = rng.choice(names)
        e = head[k]
        what = rng.choice(["dtype", "shape", "offsets", "swap", "shift", "meta", "rename", "extra", "drop"])
        if what == "dtype":
            e["dtype"] = rng.choice(list(ST_DTYPES) + ["F4", "x", "I4"])
        elif what == "shape":
            s = list(e["shape"])
            choice = rng.random()
            if choice < 0.25 and s:
                rng.shuffle(s)
            elif choice < 0.5:
                s = s + [1]
            elif choice < 0.7 and s:
                s[rng.randrange(len(s))] = rng.choice([0, 1, 2, 3, -1, 2**62, s[0] * 2])
            elif choice < 0.85:
                n = 1
                for x in s:
                    n *= x
                s = [n] if n else [0]
            else:
                s = []
            e["shape"] = s
        elif what == "offsets":
            a, z = e["data_offsets"]
            e["data_offsets"] = rng.choice([[a, z + 1], [a + 1, z], [a, z - 1], [a - 1, z - 1], [a + 2, z + 2],
                                            [z, a], [a, a], [0, z - a], [a, len(data)], [a, len(data) + 1]])
        elif what == "swap":
            k2 = rng.choice(names)
            e["data_offsets"], head[k2]["data_offsets"] = head[k2]["data_offsets"], e["data_offsets"]
        elif what == "shift":
            step = ST_DTYPES.get(e["dtype"], 1) * rng.choice([1, -1, 2])
            e["data_offsets"] = [x + step for x in e["data_offsets"]]
        elif what == "meta":
            m = head.setdefault("__metadata__", {})
            if isinstance(m, dict):
                ks = list(m) or ["x"]
                mk = rng.choice(ks)
                m[mk] = rng.choice(["", "0" * 8, "zz", "00000000,00000000", m.get(mk, "") + ",00000000",
                                    ",".join(reversed(str(m.get(mk, "")).split(",")))])
                resign = False
        elif what == "rename":
            head[k + "x"] = head.pop(k)
            names = [n for n in head if n != "__metadata__"]
        elif what == "extra":
            e[rng.choice(["foo", "dtype_", "offsets"])] = 1
        else:
            head.pop(k)
            names = [n for n in head if n != "__metadata__"] or names
            if not names or k not in head and names == [k]:
                break
        edits.append(f"{what}:{k}")
        if k not in head:
            break
        names = [n for n in head if n != "__metadata__"]
        if not names:
            break
    if resign:
        st_resign(head, data)
    return st_join(head, data, hlen, rng), "json[" + ",".join(edits) + ("] re-signed" if resign else "]"), resign


# --------------------------------------------------------------------------- the campaign


class Stats:
    def __init__(self) -> None:
        self.cases = 0
        self.outcomes: collections.Counter = collections.Counter()
        self.bugs: list[str] = []
        self.notes: list[str] = []


class Fuzzer:
    def __init__(self, workdir: str, bugdir: str, seed: int, case_limit_s: int = 20) -> None:
        self.work = workdir
        self.bugdir = bugdir
        self.seed = seed
        self.case_limit_s = case_limit_s
        os.makedirs(bugdir, exist_ok=True)
        self.stats: dict[str, Stats] = collections.defaultdict(Stats)
        self._originals: dict[str, Any] = {}
        self._nbug = 0
        self._current: tuple[str, Any, str] = ("?", b"", ".bin")  # (label, payload, ext) of the case running

    # -- originals ---------------------------------------------------------------
    def torch_original(self, writer: str) -> tuple[bytes, str, int]:
        key = "pt-" + writer
        if key not in self._originals:
            p = os.path.join(self.work, f"orig-{writer}.pt")
            (fastpersist.save if writer == "fastpersist" else torch.save)(saved_torch(), p)
            with open(p, "rb") as f:
                self._originals[key] = (f.read(), p, 4096 if writer == "fastpersist" else 64)
        return self._originals[key]

    def st_original(self, writer: str) -> bytes:
        key = "st-" + writer
        if key not in self._originals:
            p = os.path.join(self.work, f"orig-{writer}.safetensors")
            if writer == "fastpersist":
                fastpersist.save(saved_st(), p)
            else:
                from safetensors.torch import save_file
                save_file(saved_st(), p)
            with open(p, "rb") as f:
                self._originals[key] = f.read()
        return self._originals[key]

    # -- bookkeeping ---------------------------------------------------------------
    def record(self, reader: str, verdict: str, label: str, payload: Any, ext: str, detail: str = "") -> None:
        s = self.stats[reader]
        s.outcomes[verdict.split(" ")[0]] += 1
        if verdict.startswith("BUG") or verdict.startswith("lenient"):
            self._nbug += 1
            base = os.path.join(self.bugdir, f"{'bug' if verdict.startswith('BUG') else 'lenient'}-{reader}-{self.seed}-{self._nbug}")
            if isinstance(payload, (bytes, bytearray)):
                with open(base + ext, "wb") as f:
                    f.write(payload)
            elif isinstance(payload, str) and os.path.isdir(payload):
                shutil.copytree(payload, base + ext, dirs_exist_ok=True)
            with open(base + ".txt", "w") as f:
                f.write(f"reader: {reader}\nmutation: {label}\nverdict: {verdict}\n{detail}\n")
            line = f"{verdict} [{label}] -> {base}{ext}"
            (s.bugs if verdict.startswith("BUG") else s.notes).append(line)
        elif verdict.startswith("stock") and len(s.notes) < 20:
            s.notes.append(f"{verdict} [{label}]")

    def run_case(self, reader: str, rng: random.Random) -> None:
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(self.case_limit_s)
        self._current = ("?", b"", ".bin")
        try:
            getattr(self, "case_" + reader)(rng)
        except Hang:
            # the file being read when the limit struck (a hang or an allocation gone wild)
            label, payload, ext = self._current
            self.record(reader, "BUG hang", label, payload, ext, "timed out")
        except MemoryError as exc:  # --mem-limit-gb: a reader (or the oracle) asked for more than the limit
            label, payload, ext = self._current
            self.record(reader, "BUG memory", label, payload, ext, "".join(traceback.format_exception(exc))[-3000:])
        finally:
            signal.alarm(0)
        self.stats[reader].cases += 1

    # -- torch zip readers ---------------------------------------------------------
    def _zip_case(self, rng: random.Random) -> tuple[str, bytes, str, bool]:
        writer = rng.choice(["fastpersist", "torch"])
        data, src, alignment = self.torch_original(writer)
        bad, label, consistent = zip_mutate(data, src, rng, alignment, self.work)
        p = os.path.join(self.work, "case.pt")
        with open(p, "wb") as f:
            f.write(bad)
        self._current = (f"{writer}: {label}", bad, ".pt")
        return p, bad, f"{writer}: {label}", consistent

    def judge_torch_load(self, path: str, kw: dict, ours: Callable[[], Any], want: Any) -> tuple[str, str]:
        ok, got = call(ours)
        if not ok:
            if isinstance(got, RAW) and not isinstance(got, FastPersistError):
                tok, theirs = call(lambda: torch.load(path, **kw))
                if not tok and type(theirs) is type(got):
                    return "error:torch-" + type(got).__name__, ""
                return "BUG raw-" + type(got).__name__, "".join(traceback.format_exception(got))[-3000:]
            if isinstance(got, CLEAR + (FastPersistError,)):
                return _err(got), ""
            tok, theirs = call(lambda: torch.load(path, **kw))  # e.g. OverflowError/MemoryError from the pickle
            if not tok and type(theirs) is type(got):
                return "error:torch-" + type(got).__name__, ""
            return "BUG unexpected-" + type(got).__name__, "".join(traceback.format_exception(got))[-3000:]
        if same(got, want):
            return "ok", ""
        tok, theirs = call(lambda: torch.load(path, **kw))
        if tok and same(got, theirs):
            return "stock", ""
        return "BUG wrong-values", f"torch.load: {'returned other values' if tok else repr(theirs)[:300]}\nours: {got!r}"[:4000]

    def case_load(self, rng: random.Random, mmap: bool = False) -> None:
        p, bad, label, _consistent = self._zip_case(rng)
        want = saved_torch()
        checksum = rng.random() > 0.15
        cfg = fastpersist.Config(checksum=checksum)
        for wo in (False, True):
            kw: dict = {"weights_only": wo}
            if mmap:
                kw["mmap"] = True
            if rng.random() < 0.2:
                kw["map_location"] = "cpu"
            verdict, detail = self.judge_torch_load(p, kw, lambda: fastpersist.load(p, config=cfg, **kw), want)
            if not checksum and verdict.startswith("BUG"):
                verdict = self.nocrc(verdict, detail, p, cfg, kw, want)
            self.record("mmap" if mmap else "load", verdict, f"{label} {kw} checksum={checksum}", bad, ".pt", detail)

    def nocrc(self, verdict: str, detail: str, p: str, cfg: Any, kw: dict, want: Any) -> str:
        """With ``Config(checksum=False)`` nothing vouches for the bytes: a flipped payload
        byte is returned as it is (same dtype/shape/stride as saved, other bytes) and a
        flipped pickle byte gets torch's own unpickler error, also where torch.load
        refuses the file earlier for a structural flip the fast reader tolerates (a
        record name outside the archive folder, a local header's extra field). The
        reference for those: torch.load of the records *as the fast reader reads them*
        (central directory, local header lengths), rewritten by torch's own writer
        (:func:`as_read`); the same values or the same error type are "nocrc" notes;
        anything else stays a BUG."""
        ok, got = call(lambda: fastpersist.load(p, config=cfg, **kw))
        ref = as_read(p, self.work)
        if ref is not None:
            rok, theirs = call(lambda: torch.load(ref, **kw))
            if ok and rok and same(got, theirs):
                return "nocrc-as-read"
            if not ok and not rok and type(got) is type(theirs):
                return "nocrc-as-read-error"
        if "raw-" in verdict and ("_weights_only_unpickler.py" in detail or "pickle" in detail.split("\n")[-3]):
            return "nocrc-unpickler-error"
        if verdict == "BUG wrong-values":
            if ok and isinstance(got, dict) and list(got) == list(want) and all(
                    type(got[k]) is type(want[k]) and (not isinstance(want[k], torch.Tensor) or (
                        got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
                        and got[k].stride() == want[k].stride())) for k in want):
                return "nocrc-payload"
        return verdict

    def case_mmap(self, rng: random.Random) -> None:
        self.case_load(rng, mmap=True)

    # -- safetensors ---------------------------------------------------------------
    def case_safetensors(self, rng: random.Random) -> None:
        from safetensors.torch import load_file

        writer = rng.choice(["fastpersist", "safetensors"])
        raw = self.st_original(writer)
        bad, label, _consistent = st_mutate(raw, rng)
        label = f"{writer}: {label}"
        p = os.path.join(self.work, "case.safetensors")
        with open(p, "wb") as f:
            f.write(bad)
        self._current = (label, bad, ".safetensors")
        want = saved_st()
        tok, theirs = call(lambda: load_file(p))
        for mmap in (False, True):
            checksum = rng.random() > 0.15
            ok, got = call(lambda: fastpersist.load(p, mmap=mmap, config=fastpersist.Config(checksum=checksum)))
            kw = f"mmap={mmap} checksum={checksum}"
            if not ok:
                verdict = _err(got) if isinstance(got, (CheckpointFormatError, ChecksumError)) else "BUG raised-" + type(got).__name__
                self.record("safetensors", verdict, f"{label} {kw}", bad, ".safetensors", repr(got)[:2000])
                continue
            if tok and same_dict(got, theirs):
                verdict = "ok" if same_dict(got, want) else "stock"
            elif same_dict(got, want):
                verdict = "lenient (saved values; load_file: " + (repr(theirs)[:100] if not tok else "other values") + ")"
            else:
                verdict = "BUG wrong-values"
            self.record("safetensors", verdict, f"{label} {kw}", bad, ".safetensors",
                        f"load_file: {'ok' if tok else repr(theirs)[:300]}")

    def _mixed_case(self, rng: random.Random) -> tuple[str, bytes, str, str, Any]:
        """A mutated file for the readers that take both formats: 30% safetensors (written by
        fastpersist or the safetensors library), else torch zip. ``(path, bytes, label, ext,
        saved safetensors state or None)``."""
        if rng.random() < 0.3:
            writer = rng.choice(["fastpersist", "safetensors"])
            bad, label, _c = st_mutate(self.st_original(writer), rng)
            p = os.path.join(self.work, "case.safetensors")
            with open(p, "wb") as f:
                f.write(bad)
            self._current = ("st " + label, bad, ".safetensors")
            return p, bad, "st " + label, ".safetensors", saved_st()
        p, bad, label, _c = self._zip_case(rng)
        return p, bad, label, ".pt", None

    # -- load_state_dict -------------------------------------------------------------
    def case_into(self, rng: random.Random) -> None:
        p, bad, label, ext, st_want = self._mixed_case(rng)
        use_st = ext == ".safetensors"
        want = st_want if use_st else tensors_of(saved_torch())
        target = {k: torch.full(v.shape, 3, dtype=v.dtype) if v.numel() else torch.empty_like(v) for k, v in want.items()}
        before = {k: v.clone() for k, v in target.items()}
        strict = rng.random() < 0.8
        checksum = rng.random() > 0.15
        ok, got = call(lambda: fastpersist.load_state_dict(target, p, strict=strict, config=fastpersist.Config(checksum=checksum)))
        label += f" strict={strict} checksum={checksum}"
        if not ok:
            if isinstance(got, fastpersist.PartialLoadError):
                self.record("into", "error:PartialLoadError", label, bad, ext)
                return
            if isinstance(got, RAW) and not isinstance(got, FastPersistError):
                self.record("into", "BUG raw-" + type(got).__name__, label, bad, ext, "".join(traceback.format_exception(got))[-3000:])
                return
            if not isinstance(got, CLEAR):
                self.record("into", "BUG unexpected-" + type(got).__name__, label, bad, ext, repr(got))
                return
            if not all(same_values(target[k], before[k]) for k in target):
                self.record("into", "BUG error-but-target-changed", label, bad, ext, repr(got)[:1000])
                return
            self.record("into", _err(got), label, bad, ext)
            return
        if all(same_values(target[k], want[k]) for k in want):
            self.record("into", "ok", label, bad, ext)
            return
        # other values: stock's answer for the same file?
        if use_st:
            from safetensors.torch import load_file
            tok, theirs = call(lambda: load_file(p))
        else:
            # into CPU targets: storage location tags play no part, as with map_location="cpu"
            tok, theirs = call(lambda: torch.load(p, weights_only=True, map_location="cpu"))
        if tok and isinstance(theirs, dict):
            fine = True
            for k in want:
                if k in theirs and isinstance(theirs[k], torch.Tensor):
                    if not (same_values(target[k], theirs[k].to(target[k].dtype)) if theirs[k].shape == target[k].shape else False):
                        fine = False
                elif not strict and same_values(target[k], before[k]):
                    pass  # missing key, non-strict: kept
                else:
                    fine = False
            if fine:
                self.record("into", "stock", label, bad, ext)
                return
        self.record("into", "BUG wrong-values", label, bad, ext,
                    f"stock: {'ok' if tok else repr(theirs)[:300]}\n" + "\n".join(
                        f"{k}: got {target[k].flatten()[:8].tolist()} want {want[k].flatten()[:8].tolist()}" for k in want
                        if not same_values(target[k], want[k])))

    # -- partial loads -----------------------------------------------------------------
    def case_partial(self, rng: random.Random) -> None:
        p, bad, label, ext, st_want = self._mixed_case(rng)
        use_st = ext == ".safetensors"
        want = st_want if use_st else tensors_of(saved_torch())
        checksum = rng.random() > 0.15
        label += f" checksum={checksum}"

        def run() -> dict:
            with fastpersist.open(p, config=fastpersist.Config(checksum=checksum)) as f:
                names = list(f.keys())
                pick = rng.sample(names, k=rng.randint(1, len(names))) if names else []
                out = f.get_many(pick) if rng.random() < 0.5 else {n: f.get(n) for n in pick}
                return out

        ok, got = call(run)
        if not ok:
            if isinstance(got, RAW) and not isinstance(got, FastPersistError):
                self.record("partial", "BUG raw-" + type(got).__name__, label, bad, ext, "".join(traceback.format_exception(got))[-3000:])
            elif isinstance(got, CLEAR):
                self.record("partial", _err(got), label, bad, ext)
            else:
                self.record("partial", "BUG unexpected-" + type(got).__name__, label, bad, ext, repr(got))
            return
        if all(n in want and same(got[n], want[n]) for n in got):
            self.record("partial", "ok", label, bad, ext)
            return
        if use_st:
            from safetensors.torch import load_file
            tok, theirs = call(lambda: load_file(p))
        else:
            # open().get returns CPU tensors whatever location a storage was tagged with (the
            # index unpickles with map_location="cpu"): the reference is torch.load with the
            # same map_location, for which a broken location tag is no error either. Like
            # safetensors.safe_open, which validates the whole header at open, the whole
            # pickle must be sound: torch's refusal for any tensor is the answer for all.
            tok, theirs = call(lambda: torch.load(p, weights_only=True, map_location="cpu"))
        if tok and isinstance(theirs, dict):
            from fastpersist.formats.torchindex import tensor_leaves, tensor_name
            flat = {tensor_name(k): t for k, t in tensor_leaves(theirs)} if not use_st else theirs
            if all(n in flat and same(got[n], flat[n]) for n in got):
                self.record("partial", "stock", label, bad, ext)
                return
            if use_st and all(n in flat and (same(got[n], flat[n]) or (got[n].numel() == 0 and same_values(got[n], flat[n])))
                              for n in got):
                # only the strides of 0-element tensors differ (e.g. shape (0, 0): (0, 1) vs load_file's (1, 1))
                self.record("partial", "stride-of-empty", label, bad, ext)
                return
        if not checksum and all(n in want and isinstance(got[n], torch.Tensor) and got[n].dtype == want[n].dtype
                                and got[n].shape == want[n].shape and got[n].stride() == want[n].stride() for n in got):
            self.record("partial", "nocrc-payload", label, bad, ext)
            return
        self.record("partial", "BUG wrong-values", label, bad, ext,
                    f"stock: {'ok' if tok else repr(theirs)[:300]}\nours: {got!r}"[:4000])

    # -- verify ----------------------------------------------------------------------------
    def case_verify(self, rng: random.Random) -> None:
        p, bad, label, ext, st_want = self._mixed_case(rng)
        use_st = ext == ".safetensors"
        want: Any = st_want if use_st else saved_torch()
        ok, res = call(lambda: fastpersist.verify(p))
        if not ok:
            verdict = _err(res) if isinstance(res, (CheckpointFormatError, OSError)) else "BUG verify-raised-" + type(res).__name__
            self.record("verify", verdict, label, bad, ext, "".join(traceback.format_exception(res))[-3000:])
            return
        if not res.ok:
            self.record("verify", "error:" + res.status, label, bad, ext)
            return
        # storages verify noted as not restorable here without map_location (documented): load onto the CPU
        loc = {"map_location": "cpu"} if res.notes else {}
        if use_st:
            from safetensors.torch import load_file
            tok, theirs = call(lambda: load_file(p))
            cmp = same_dict
        else:
            tok, theirs = call(lambda: torch.load(p, weights_only=False, **loc))
            cmp = same
        fok, ours = call(lambda: fastpersist.load(p, weights_only=False, **loc) if not use_st else fastpersist.load(p))
        if tok and cmp(theirs, want) and (not fok or cmp(ours, want)):
            self.record("verify", "ok" if fok else "BUG verify-ok-but-load-raises", label, bad, ext, repr(ours)[:500])
            return
        if tok and fok and cmp(theirs, ours):
            self.record("verify", "stock", label, bad, ext)
            return
        if not tok and not fok:
            # verify walks the pickle, it does not run it: a self-consistent (CRC-fixed) pickle whose
            # tensors do not fit their storages, or a storage renamed to a record of another size,
            # passes verify while every loader refuses it. No values are returned: reported apart.
            self.record("verify", "verify-ok-load-refuses", label, bad, ext)
            return
        self.record("verify", "BUG verify-ok-wrongly", label, bad, ext,
                    f"stock: {'other values' if tok else repr(theirs)[:300]}; ours: {'other values' if fok else repr(ours)[:300]}")

    # -- DCP -------------------------------------------------------------------------------
    def dcp_original(self, writer: str) -> str:
        key = "dcp-" + writer
        if key not in self._originals:
            import torch.distributed.checkpoint as dcp
            from fastpersist.dcp import FastPersistWriter

            d = os.path.join(self.work, f"orig-dcp-{writer}")
            shutil.rmtree(d, ignore_errors=True)
            w = FastPersistWriter(d, thread_count=1) if writer == "fp" else dcp.FileSystemWriter(d, thread_count=1)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save(dcp_saved(), storage_writer=w, no_dist=True)
            self._originals[key] = d
        return self._originals[key]

    def case_dcp(self, rng: random.Random) -> None:
        import torch.distributed.checkpoint as dcp
        from fastpersist.dcp import FastPersistReader

        writer = rng.choice(["fp", "stock"])
        src = self.dcp_original(writer)
        d = os.path.join(self.work, "case-dcp")
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(src, d)
        try:
            label = f"{writer}: " + dcp_mutate(d, rng)
        except OSError as exc:  # a mutation that renamed/removed what it then reads: still a hostile directory
            label = f"{writer}: mutation stopped by {exc!r}"


        def load(reader: Callable[[str], Any]) -> tuple[bool, Any]:
            state = dcp_blank()
            ok, err = call(lambda: dcp.load(state, storage_reader=reader(d), no_dist=True))
            if not ok:
                return False, unwrap(err)
            return True, state

        ok, got = load(FastPersistReader)
        if not ok:
            if isinstance(got, (CheckpointFormatError, ChecksumError, FileNotFoundError)):
                self.record("dcp", _err(got), label, d, ".dcp")
                return
            sok, stock = load(dcp.FileSystemReader)
            if not sok and type(stock) is type(got):
                self.record("dcp", "error:stock-" + type(got).__name__, label, d, ".dcp")
            elif isinstance(got, AssertionError) and "metadata read failed" in str(got):
                self.record("dcp", "error:metadata", label, d, ".dcp")
            else:
                self.record("dcp", "BUG raised-" + type(got).__name__, label, d, ".dcp",
                            f"ours: {got!r}\nstock: {'ok' if sok else repr(stock)}"[:3000])
            return
        if dcp_same(got, dcp_saved()):
            verdict = "ok"
        else:
            sok, stock = load(dcp.FileSystemReader)
            verdict = "stock" if sok and dcp_same(got, stock) else "BUG wrong-values"
        # verify on DCP directories, with the same oracle as for files
        vok, res = call(lambda: fastpersist.verify(d))
        self.record("dcp", verdict, label, d, ".dcp")
        if vok and res.ok and verdict != "ok" and verdict != "stock":
            self.record("verify", "BUG verify-ok-wrongly (dcp)", label, d, ".dcp")


def same_dict(a: Any, b: Any) -> bool:
    if not isinstance(a, dict) or not isinstance(b, dict) or set(a) != set(b):
        return False
    return all(same_values(a[k], b[k]) for k in a)


def dcp_saved() -> dict:
    g = torch.Generator().manual_seed(1)
    return {"a": torch.randn(33, 17, generator=g), "i": torch.arange(700, dtype=torch.int64),
            "h": torch.randn(4, 5, generator=g).to(torch.bfloat16), "e": torch.empty(0, 3),
            "meta": {"lr": 0.25, "name": "run"}, "step": 7}


def dcp_blank() -> dict:
    return {"a": torch.zeros(33, 17), "i": torch.zeros(700, dtype=torch.int64),
            "h": torch.zeros(4, 5, dtype=torch.bfloat16), "e": torch.zeros(0, 3),
            "meta": {"lr": None, "name": None}, "step": None}


def dcp_same(got: dict, want: dict) -> bool:
    try:
        return _dcp_same(got, want)
    except (RuntimeError, TypeError, KeyError):
        return False


def _dcp_same(got: dict, want: dict) -> bool:
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            if not same_values(got[k], v):
                return False
        elif isinstance(v, dict):
            if not isinstance(got[k], dict) or set(got[k]) != set(v):
                return False
            for kk, vv in v.items():  # a hostile .metadata can put a tensor where a value was
                g = got[k][kk]
                if isinstance(g, torch.Tensor) or isinstance(vv, torch.Tensor):
                    if not (isinstance(g, torch.Tensor) and isinstance(vv, torch.Tensor) and same_values(g, vv)):
                        return False
                elif type(g) is not type(vv) or g != vv:
                    return False
        elif got[k] != v:
            return False
    return True


def unwrap(e: BaseException) -> BaseException:
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException):
        f = next(iter(e.failures.values()))
        return f[0] if isinstance(f, tuple) else f
    return e


def dcp_mutate(d: str, rng: random.Random) -> str:
    from fastpersist import _compat
    from fastpersist.formats import dcpmetadata as md

    files = sorted(os.listdir(d))
    distcp = [f for f in files if f.endswith(".distcp")]
    kind = rng.choice(["bytes", "bytes", "meta_obj", "meta_obj", "meta_bytes", "swap_files", "crc_fix"])
    if kind == "bytes" and distcp:
        f = os.path.join(d, rng.choice(distcp))
        b = bytearray(open(f, "rb").read())
        v = rng.choice(["flips", "trunc", "overwrite", "insert"])
        if v == "flips" and b:
            offs = [rng.randrange(len(b)) for _ in range(rng.randint(2, 8))]
            for o in offs:
                b[o] ^= rng.randrange(1, 256)
            lab = f"flips{offs}"
        elif v == "trunc":
            n = rng.randrange(len(b) + 1)
            b = b[:n]
            lab = f"trunc@{n}"
        elif v == "overwrite" and b:
            o = rng.randrange(len(b))
            n = rng.randint(1, 32)
            b[o:o + n] = rng.randbytes(n)
            b = b[:max(len(b), o)]
            lab = f"overwrite{n}@{o}"
        else:
            o = rng.randrange(len(b) + 1)
            b[o:o] = rng.randbytes(rng.randint(1, 16))
            lab = f"insert@{o}"
        open(f, "wb").write(bytes(b))
        return f"{os.path.basename(f)} {lab}"
    if kind == "swap_files" and len(distcp) >= 2:
        x, y = rng.sample(distcp, 2)
        os.rename(os.path.join(d, x), os.path.join(d, "tmp"))
        os.rename(os.path.join(d, y), os.path.join(d, x))
        os.rename(os.path.join(d, "tmp"), os.path.join(d, y))
        return f"swapped files {x} {y}"
    mp = os.path.join(d, ".metadata")
    raw = open(mp, "rb").read()
    if kind == "meta_bytes":
        b = bytearray(raw)
        offs = [rng.randrange(len(b)) for _ in range(rng.randint(1, 6))]
        for o in offs:
            b[o] ^= rng.randrange(1, 256)
        if rng.random() < 0.3:
            b = b[:rng.randrange(len(b))]
        open(mp, "wb").write(bytes(b))
        return f".metadata flips{offs} len={len(b)}"
    body, sealed = md.unseal(raw, mp) if raw[-md.TRAILER_SIZE:-md.TRAILER_SIZE + 8] == md.MAGIC else (raw, False)
    meta = pickle.loads(body)
    sd = meta.storage_data
    keys = list(sd)
    edits = []
    for _ in range(rng.randint(1, 2)):
        k = rng.choice(keys)
        info = sd[k]
        what = rng.choice(["offset", "length", "path", "swap", "chunk"]) if kind == "meta_obj" else "crc_fix"
        if what == "offset":
            info.offset = max(0, info.offset + rng.choice([-8, -4, -1, 1, 2, 4, 8, 64]))
        elif what == "length":
            info.length = max(0, info.length + rng.choice([-8, -4, -1, 1, 4, 8]))
        elif what == "path":
            others = [sd[o].relative_path for o in keys]
            info.relative_path = rng.choice(others + ["nope.distcp"])
        elif what == "swap":
            k2 = rng.choice(keys)
            sd[k], sd[k2] = sd[k2], sd[k]
        elif what == "chunk":
            # a tensor's recorded chunk metadata: change a chunk's size/offset
            for fqn, tmd in meta.state_dict_metadata.items():
                if hasattr(tmd, "chunks") and tmd.chunks and rng.random() < 0.5:
                    c = tmd.chunks[0]
                    if len(c.sizes) and rng.random() < 0.5:
                        sizes = list(c.sizes)
                        sizes[0] = max(0, sizes[0] + rng.choice([-1, 1]))
                        c.sizes = torch.Size(sizes)
                    break
        else:  # crc_fix: move the item and re-sign its CRC over its new bytes
            info.offset = max(0, info.offset + rng.choice([-4, 4, 8]))
        if what in ("offset", "length", "crc_fix", "path", "swap") and _compat.dcp_storage_crc(info) is not None and (
                what == "crc_fix" or rng.random() < 0.5):
            try:
                with open(os.path.join(d, info.relative_path), "rb") as fh:
                    fh.seek(info.offset)
                    chunk = fh.read(info.length)
                setattr(info, _compat.DCP_CRC_ATTR, zlib.crc32(chunk))
                what += "+crc"
            except OSError:
                pass
        edits.append(f"{what}:{getattr(k, 'fqn', k)}")
    data = pickle.dumps(meta)
    if sealed or (kind == "crc_fix" and rng.random() < 0.5):
        data = md.seal(data)
    open(mp, "wb").write(data)
    return f".metadata object [{','.join(edits)}] sealed={sealed}"


def summary(fz: Fuzzer, elapsed: dict) -> str:
    lines = []
    for reader, s in fz.stats.items():
        errs = {k: v for k, v in s.outcomes.items() if k.startswith("error")}
        lines.append(f"== {reader}: {s.cases} cases ({elapsed.get(reader, 0):.0f} s), checks {sum(s.outcomes.values())}: "
                     f"ok {s.outcomes.get('ok', 0)}, stock-consistent {s.outcomes.get('stock', 0)}, "
                     f"lenient {s.outcomes.get('lenient', 0)}, BUGS {len(s.bugs)}")
        lines.append("   clear errors: " + ", ".join(f"{k[6:]} {v}" for k, v in sorted(errs.items(), key=lambda kv: -kv[1])))
        for b in s.bugs[:15]:
            lines.append("   " + b[:400])
        for n in s.notes[:5]:
            lines.append("   note: " + n[:300])
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="total time, split evenly across the readers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reader", default="all", help="one of " + ", ".join(READERS) + ", or all, or a comma list")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "fastpersist-fuzz"),
                    help="where reproducers of bugs are saved")
    ap.add_argument("--cases", type=int, default=0, help="stop each reader after this many cases (0: time only)")
    ap.add_argument("--mem-limit-gb", type=float, default=0.0,
                    help="address-space limit (RLIMIT_AS) of the process: an allocation past it is a MemoryError, "
                         "recorded as 'BUG memory' with the file, instead of the machine's OOM killer (0: none)")
    args = ap.parse_args(argv)
    if args.mem_limit_gb:
        import resource

        lim = int(args.mem_limit_gb * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    readers = READERS if args.reader == "all" else tuple(args.reader.split(","))
    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="fuzzwork-")
    fz = Fuzzer(work, args.dir, args.seed)
    per = args.seconds / len(readers)
    elapsed: dict[str, float] = {}
    try:
        for r in readers:
            rng = random.Random(f"{args.seed}-{r}")
            t0 = time.monotonic()
            while time.monotonic() - t0 < per and (not args.cases or fz.stats[r].cases < args.cases):
                fz.run_case(r, rng)
            elapsed[r] = time.monotonic() - t0
            print(f"[{r}] {fz.stats[r].cases} cases in {elapsed[r]:.0f} s, bugs {len(fz.stats[r].bugs)}", flush=True)
    finally:
        print(summary(fz, elapsed), flush=True)
        shutil.rmtree(work, ignore_errors=True)
    return 1 if any(s.bugs for s in fz.stats.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
