"""A corrupt file in an Accelerate checkpoint is never skipped quietly (issue 24, case 10).

Accelerate 1.15's ``load_accelerator_state`` catches every exception of the RNG file's
load (``random_states_N.pkl``), logs "Could not load random states" at INFO and resumes
with the RNG state not restored. With fastpersist enabled, a ChecksumError (or another
format or I/O error) of any checkpoint file fails ``load_state``, naming the file. The
other files' errors already propagate through Accelerate.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

from fastpersist.errors import CheckpointFormatError, ChecksumError  # noqa: E402
from fastpersist.formats.zipindex import read_zip_index  # noqa: E402
from fastpersist.integrations import accelerate as fpa  # noqa: E402


def _build(project_dir: str):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    torch.manual_seed(0)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=project_dir))
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    fpa.enable(acc)
    return acc, model, opt


def _flip_payload_byte(path: Path) -> None:
    """One byte of the file's largest stored record flipped: its CRC-32 no longer matches."""
    e = max((e for e in read_zip_index(path).entries if e.compressed_size), key=lambda e: e.compressed_size)
    raw = bytearray(path.read_bytes())
    raw[e.data_offset] ^= 0x01
    path.write_bytes(raw)


def _saved(tmp_path: Path):
    acc, model, opt = _build(str(tmp_path))
    out = tmp_path / "ckpt"
    acc.save_state(str(out))
    rng = out / "random_states_0.pkl"
    assert rng.is_file(), sorted(os.listdir(out))
    return acc, out, rng


def test_corrupt_rng_file_fails_the_resume_naming_it(tmp_path: Path, caplog) -> None:
    acc, out, rng = _saved(tmp_path)
    _flip_payload_byte(rng)
    torch.manual_seed(1234)
    with caplog.at_level(logging.INFO):
        with pytest.raises(ChecksumError) as info:
            acc.load_state(str(out))
    assert info.value.path == str(rng), info.value.path
    assert "random_states_0.pkl" in str(info.value)
    assert any("load_state" in n and "random_states_0.pkl" in n for n in getattr(info.value, "__notes__", [])), \
        getattr(info.value, "__notes__", None)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and "random_states_0.pkl" in r.getMessage()]
    assert errors, [r.getMessage() for r in caplog.records]


def test_truncated_rng_file_fails_the_resume(tmp_path: Path) -> None:
    acc, out, rng = _saved(tmp_path)
    raw = rng.read_bytes()
    rng.write_bytes(raw[: len(raw) // 2])
    with pytest.raises((CheckpointFormatError, ChecksumError)):
        acc.load_state(str(out))


def test_intact_checkpoint_restores_the_rng_state(tmp_path: Path) -> None:
    acc, out, _rng = _saved(tmp_path)
    want = torch.rand(5)  # the draw right after the save's RNG state
    torch.manual_seed(99)
    acc.load_state(str(out))
    assert torch.equal(torch.rand(5), want)


def test_missing_rng_file_is_still_accelerates_call(tmp_path: Path) -> None:
    """A checkpoint without the RNG file (e.g. saved by fewer processes): Accelerate's
    behaviour (it goes on), not a corruption."""
    acc, out, rng = _saved(tmp_path)
    rng.unlink()
    acc.load_state(str(out))
