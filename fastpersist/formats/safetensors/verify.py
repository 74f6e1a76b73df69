"""Verifying a safetensors file: its structure always, its bytes when fastpersist recorded CRC-32s."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Union

from fastpersist.formats.safetensors import header as hdr
from fastpersist.formats.safetensors.crc import crc_problems, data_extents
from fastpersist.formats.safetensors.errors import SafetensorsFormatError
from fastpersist.formats.safetensors.load import Reader, read_fd

__all__ = ["SafetensorsCheck", "check_safetensors", "has_checksums", "verify_safetensors"]


@dataclass
class SafetensorsCheck:
    """What :func:`check_safetensors` found. ``checked`` is false when the file has
    no fastpersist CRCs (only its structure was validated, its bytes were not)."""

    problems: list[str]
    records: int = 0  #: tensors in the header
    nbytes: int = 0  #: payload bytes checksummed (0 when unchecked)
    checked: bool = False


def check_safetensors(path: Union[str, os.PathLike], handle: Reader) -> SafetensorsCheck:
    """Validate a safetensors file's structure and, if it carries fastpersist CRCs,
    every tensor's bytes.

    Raises:
        OSError, EOFError: the file cannot be read (bad content never raises).
    """
    path = os.fspath(path)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # one descriptor: header and bytes of one file
    try:
        try:
            header = hdr.read_header_fd(fd, path)
        except SafetensorsFormatError as exc:
            return SafetensorsCheck([str(exc)], checked=True)
        records = len(header.tensors)
        if header.crcs is None:
            return SafetensorsCheck([], records=records, checked=False)
        extents, slots = data_extents(header, lambda off: 0)
        crcs = read_fd(handle, fd, path, extents, len(slots)) if extents else []
    finally:
        os.close(fd)
    problems = [msg for _, msg in crc_problems(header, slots, crcs)]
    return SafetensorsCheck(problems, records=records, nbytes=sum(e.nbytes for e in slots), checked=True)


def verify_safetensors(path: Union[str, os.PathLike], handle: Reader) -> list[str]:
    """Check a safetensors file; return the problems found (empty: none).

    Always checks the structure (header length, JSON, dtypes, shapes, offsets, no
    holes or overlaps, file size). If fastpersist recorded CRC-32s, every tensor's
    bytes are read (one native read, discarded after checksumming) and compared,
    naming each tensor that differs. Files written by other tools carry no
    checksums: only their structure can be checked, and an empty list then does
    not vouch for the bytes (see :func:`check_safetensors`, :func:`has_checksums`).

    Raises:
        OSError, EOFError: the file cannot be read.
    """
    return check_safetensors(path, handle).problems


def has_checksums(path: Union[str, os.PathLike]) -> bool:
    """Whether the file's header carries fastpersist CRC-32s (else verify checks structure only)."""
    return hdr.read_header(path).crcs is not None
