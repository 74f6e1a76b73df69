"""Adversarial inputs for ``fastpersist.load``: count clean and not-clean answers per family.

Clean: the saved values, or a clear error (``CheckpointFormatError``/``ChecksumError``
or torch's own error for files handed to torch). Not clean: other values, or a raw
``KeyError``/``struct.error``/``UnicodeDecodeError``/``RecursionError``/``IndexError``.

    python docs/experiments/adversarial_load.py [--json out.json]

Runs against whichever ``fastpersist`` is importable (put an older checkout first
on ``sys.path`` to measure it).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import tempfile
import threading
import zipfile

import torch

import fastpersist

RAW = (KeyError, struct.error, UnicodeDecodeError, RecursionError, IndexError)


def saved() -> dict:
    return {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([1, 0, 1], dtype=torch.bool),
            "h": torch.arange(5, dtype=torch.bfloat16), "e": torch.empty(0), "step": 7, "name": "run"}


def same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape
                and a.contiguous().view(-1).view(torch.uint8).tolist() == b.contiguous().view(-1).view(torch.uint8).tolist())
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


def judge(path: str, want, **kw) -> str:
    try:
        got = fastpersist.load(path, weights_only=False, **kw)
    except RAW as e:
        return f"raw {type(e).__name__}"
    except Exception:  # noqa: BLE001 - a clear error
        return "clean"
    return "clean" if same(got, want) else "wrong value"


class Family:
    def __init__(self, name: str) -> None:
        self.name, self.tried, self.clean, self.bad = name, 0, 0, {}

    def add(self, verdict: str) -> None:
        self.tried += 1
        if verdict == "clean":
            self.clean += 1
        else:
            self.bad[verdict] = self.bad.get(verdict, 0) + 1


def index(path: str):
    from fastpersist.formats.zipindex import read_zip_index

    return read_zip_index(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    d = tempfile.mkdtemp(prefix="fp-adv-")
    fams: list[Family] = []
    want = saved()
    for writer in ("fastpersist", "torch"):
        src = os.path.join(d, f"{writer}.pt")
        (fastpersist.save if writer == "fastpersist" else torch.save)(want, src)
        data = open(src, "rb").read()
        p = os.path.join(d, "x.pt")
        idx = index(src)

        f = Family(f"truncation at every offset ({writer} file)")
        for n in range(len(data)):
            open(p, "wb").write(data[:n])
            f.add(judge(p, want))
        fams.append(f)

        f = Family(f"every byte flipped (^0xFF) ({writer} file)")
        for off in range(len(data)):
            bad = bytearray(data)
            bad[off] ^= 0xFF
            open(p, "wb").write(bad)
            f.add(judge(p, want))
        fams.append(f)

        f = Family(f"lying central-directory/end-record fields ({writer} file)")
        for e in idx.entries:
            for field, width in ((8, 2), (10, 2), (16, 4), (20, 4), (24, 4), (28, 2), (30, 2), (34, 2), (42, 4)):
                for value in (0, 1, 4096, 0x7FFFFFFF, 0xFFFFFFFF):
                    bad = bytearray(data)
                    bad[e.cd_offset + field:e.cd_offset + field + width] = (value % (1 << 8 * width)).to_bytes(width, "little")
                    open(p, "wb").write(bad)
                    f.add(judge(p, want))
        for field, width in ((4, 2), (6, 2), (8, 2), (10, 2), (12, 4), (16, 4), (20, 4)):
            for value in (0, 1, 0xFFFF, 0xFFFFFFFF):
                bad = bytearray(data)
                at = idx.eocd_offset + field
                bad[at:at + width] = (value % (1 << 8 * width)).to_bytes(width, "little")
                open(p, "wb").write(bad)
                f.add(judge(p, want))
        fams.append(f)

        f = Family(f"pickle claims other storage sizes, CRCs recomputed ({writer} file)")
        for numel in (0, 1, 2, 5, 7, 100, 10**6):
            def edit(name: str, b: bytes) -> bytes:
                if not name.endswith("data.pkl"):
                    return b
                i = b.index(b"X\x01\x00\x00\x000")  # the first storage key '0'
                j = b.index(b"K\x06", i)  # numel 6 follows the location string
                return b[:j] + (b"K" + bytes([numel]) if numel < 256 else b"J" + struct.pack("<i", numel)) + b[j + 2:]
            with zipfile.ZipFile(src) as zin, zipfile.ZipFile(p, "w") as zout:
                for info in zin.infolist():
                    zout.writestr(info.filename, edit(info.filename, zin.read(info)))
            f.add(judge(p, want))
        fams.append(f)

        f = Family(f"re-zipped with deflate ({writer} file)")
        for level in range(1, 10):
            with zipfile.ZipFile(src) as zin, zipfile.ZipFile(p, "w", zipfile.ZIP_DEFLATED, compresslevel=level) as zout:
                for info in zin.infolist():
                    zout.writestr(info.filename, zin.read(info))
            f.add(judge(p, want))
        fams.append(f)

    f = Family("user code reading tensors while unpickling (__setstate__/__reduce__)")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
    from test_load_safety import ReadsTensorInSetstate, ReducesWithTensorSum  # noqa: E402

    for n in (10, 1000, 300_000):
        t = torch.arange(1, n + 1, dtype=torch.float64)
        for writer in (fastpersist.save, torch.save):
            p = os.path.join(d, "u.pt")
            writer({"s": ReadsTensorInSetstate(t), "r": ReducesWithTensorSum(t)}, p)
            try:
                got = fastpersist.load(p, weights_only=False)
                ok = got["s"].total == float(t.sum()) and got["r"] == float(t.sum())
                f.add("clean" if ok else "wrong value")
            except Exception as e:  # noqa: BLE001
                f.add(f"raw {type(e).__name__}")
    fams.append(f)

    for checksum in (True, False):
        f = Family(f"load while another thread saves the same path (checksum={checksum})")
        p = os.path.join(d, "c.pt")

        def st(k: int) -> dict:
            return {"step": k, **{f"w{i}": torch.full((20_000 * (i + 1),), float(k)) for i in range(6)}}

        fastpersist.save(st(0), p)
        stop = threading.Event()

        def writer_loop() -> None:
            k = 0
            while not stop.is_set():
                k += 1
                fastpersist.save(st(k), p, config=fastpersist.Config(fsync=False))

        th = threading.Thread(target=writer_loop)
        th.start()
        try:
            for _ in range(100):
                try:
                    out = fastpersist.load(p, config=fastpersist.Config(checksum=checksum))
                    k = out["step"]
                    f.add("clean" if all(bool((out[f"w{i}"] == float(k)).all()) for i in range(6)) else "mixed checkpoints")
                except Exception as e:  # noqa: BLE001
                    f.add(f"error {type(e).__name__}")  # no file was corrupt: any error is wrong
        finally:
            stop.set()
            th.join()
        fams.append(f)

    rows = [{"family": x.name, "tried": x.tried, "clean": x.clean, "not_clean": x.tried - x.clean, "how": x.bad}
            for x in fams]
    print(f"fastpersist from {os.path.dirname(fastpersist.__file__)}, torch {torch.__version__}")
    print("| family | tried | clean | not clean |\n|---|---|---|---|")
    for r in rows:
        how = ", ".join(f"{k}: {v}" for k, v in r["how"].items())
        print(f"| {r['family']} | {r['tried']} | {r['clean']} | {r['not_clean']}{' (' + how + ')' if how else ''} |")
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
