"""Seeded, bounded run of the differential reader fuzz (docs/experiments/fuzz_readers.py).

For every reader (``load``, ``load(mmap=True)``, ``.safetensors`` loads,
``load_state_dict``, ``open().get``, ``verify``, the DCP ``FastPersistReader``), a
few hundred multi-byte / structural mutations of small checkpoints (2-8 flips at
once, flip + truncation, overwritten runs, inserted bytes, swapped records,
duplicated directory entries, lying and zip64 fields, CRC-fixed payload and pickle
edits, archives rebuilt by torch's writer, safetensors header JSON edits re-signed or
not, re-sealed DCP metadata). The property: each reader returns the saved values,
or exactly what the stock reader returns for the same (self-consistent) file, or
raises a clear error; never other values. Deterministic seeds; the campaign itself
(longer, any seed) is ``python docs/experiments/fuzz_readers.py --seconds N``.
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys

import pytest
import torch

import fastpersist

pytest.importorskip("safetensors")

_SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "experiments", "fuzz_readers.py")


def _module():
    spec = importlib.util.spec_from_file_location("fastpersist_fuzz_readers", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


fz = _module()

CASES = {"load": 250, "mmap": 200, "safetensors": 250, "into": 200, "partial": 200, "verify": 200, "dcp": 80}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("reader", list(CASES))
def test_fuzz_reader_never_returns_other_values(reader, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    f = fz.Fuzzer(str(work), str(tmp_path / "bugs"), seed=20240)
    rng = random.Random(f"test-{reader}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(CASES[reader]):
            f.run_case(reader, rng)
    finally:
        torch.set_num_threads(threads)
    st = f.stats[reader]
    assert st.cases == CASES[reader]
    assert not st.bugs, "\n".join(st.bugs[:10])
    # the mutations reach past the first check: some inputs load, some are refused
    assert sum(v for k, v in st.outcomes.items() if k.startswith("error")) > 0


# --------------------------------------------------------------------------- regressions found by the fuzz


def _empty_tensor_claiming_elements(tmp_path, writer, n):
    """A checkpoint whose pickle says the empty tensor has ``n`` elements (its 0-byte
    storage record unchanged), with the pickle's CRC-32 rewritten to match: a file stock
    ``torch.load`` refuses ("Trying to resize storage that is not resizable")."""
    import pickletools
    import struct
    import zlib

    from fastpersist.formats.zipindex import read_zip_index

    src = tmp_path / f"src-{writer}.pt"
    (fastpersist.save if writer == "fastpersist" else torch.save)({"w": torch.ones(3), "e": torch.empty(0)}, src)
    data = bytearray(src.read_bytes())
    pkl = next(e for e in read_zip_index(src).entries if e.name.endswith("data.pkl"))
    body = bytes(data[pkl.data_offset:pkl.data_end])
    ops = list(pickletools.genops(body))
    persids = [i for i, (op, _a, _p) in enumerate(ops) if op.name == "BINPERSID"]
    i = persids[1]  # the second tensor, "e": storage, offset, (size,), (stride,)
    op, arg, pos = ops[i + 2]
    assert op.name == "BININT1" and arg == 0
    data[pkl.data_offset + pos + 1] = n
    crc = zlib.crc32(bytes(data[pkl.data_offset:pkl.data_end]))
    for off in pkl.crc_field_offsets:
        struct.pack_into("<I", data, off, crc)
    bad = tmp_path / f"bad-{writer}-{n}.pt"
    bad.write_bytes(bytes(data))
    return bad


@pytest.mark.parametrize("writer", ["fastpersist", "torch"])
@pytest.mark.parametrize("n", [1, 9])
def test_empty_record_with_a_pickle_claiming_elements_is_refused_like_torch(tmp_path, writer, n):
    """Found by the fuzz (load, pickle BININT1 0->N, CRC fixed): the fast reader gave an
    empty record a resizable storage, so torch's ``set_`` grew it and ``load`` returned
    ``n`` elements of uninitialized memory as the tensor ``e``, where torch.load raises."""
    bad = _empty_tensor_claiming_elements(tmp_path, writer, n)
    for weights_only in (True, False):
        with pytest.raises(RuntimeError, match="not resizable"):
            torch.load(bad, weights_only=weights_only)
        for mmap in (False, True):
            with pytest.raises(RuntimeError, match="not resizable"):
                fastpersist.load(bad, weights_only=weights_only, mmap=mmap)
    # the index-based readers: the saved values or an error, never other values
    try:
        with fastpersist.open(bad) as f:
            got = f.get_many(f.keys())
    except Exception as e:  # noqa: BLE001 - any clear error
        assert isinstance(e, (RuntimeError, ValueError)), repr(e)
    else:
        assert got["e"].shape == (0,) and torch.equal(got["w"], torch.ones(3))
    target = {"w": torch.zeros(3), "e": torch.empty(0)}
    try:
        fastpersist.load_state_dict(target, bad)
    except Exception as e:  # noqa: BLE001
        assert isinstance(e, (RuntimeError, ValueError)), repr(e)
        assert torch.equal(target["w"], torch.zeros(3))
    else:
        assert torch.equal(target["w"], torch.ones(3)) and target["e"].shape == (0,)
