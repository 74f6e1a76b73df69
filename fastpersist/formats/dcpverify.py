"""``fastpersist.verify`` for a ``torch.distributed.checkpoint`` (DCP) directory.

A directory holding ``.metadata`` (or DCP's rank-local ``__N.metadata`` files,
written with ``use_collectives=False``) is a DCP checkpoint. Checked:

* ``.metadata`` unpickles with a restricted unpickler (DCP's own metadata
  classes, torch dtypes/sizes/layouts, paths: nothing that runs code) into a
  ``Metadata`` with a ``storage_data`` table, and when it carries fastpersist's
  seal (a CRC-32 of the pickle, see :mod:`fastpersist.dcp._metadata`) the seal
  matches: the checks are those :class:`fastpersist.dcp.FastPersistReader` makes
  before loading, with the same messages;
* the metadata is well formed (every field of DCP's classes present, dtypes,
  sizes, chunks inside their tensor) and every tensor chunk and bytes entry of
  ``state_dict_metadata`` has a storage record; every record names an existing file in the directory and a byte
  range inside it, not overlapping another record's;
* every record's bytes are read (natively, not kept) and their CRC-32 compared
  with the one :class:`fastpersist.dcp.FastPersistWriter` recorded on it.

A checkpoint written by DCP's stock ``FileSystemWriter`` carries no checksums: it
is ``"unchecked"`` when its structure is sound (its bytes are not read).

Only the files the metadata references are looked at. Data files it does not
reference (``__RANK_fpTOKEN_K.distcp`` of a save into this directory that failed
or was killed before its ``.metadata`` replaced the previous one, or temporary
files of a killed writer) are not part of the checkpoint: they are neither read
nor reported, and the next save that commits removes them
(:class:`fastpersist.dcp.FastPersistWriter`).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import Any

from fastpersist import _compat
from fastpersist.dcp._metadata import ADVICE, MetadataUnpickler, item_name, load_metadata, table_problems
from fastpersist.errors import CheckpointFormatError

_MetadataUnpickler = MetadataUnpickler  # the name this module used to define


@dataclass
class DcpCheck:
    records: int = 0
    nbytes: int = 0
    checked: bool = False
    problems: list[str] = field(default_factory=list)


_name = item_name


def looks_like_dcp(directory: str) -> bool:
    """Whether ``directory`` holds a DCP ``.metadata``, ``__N.metadata`` or ``.distcp``
    file (what ``fastpersist verify DIR`` accepts: a damaged checkpoint too)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return False
    return any(n == ".metadata" or (n.startswith("__") and n.endswith((".metadata", ".distcp"))) for n in names)


def metadata_files(directory: str) -> list[str]:
    """``.metadata``, else the rank-local ``__N.metadata`` files; [] when neither exists."""
    main = os.path.join(directory, ".metadata")
    if os.path.isfile(main):
        return [main]
    return sorted(glob.glob(os.path.join(glob.escape(directory), "__*.metadata")))


def _load_metadata(path: str, check: DcpCheck) -> Any:
    try:
        md, _sealed = load_metadata(path)
    except CheckpointFormatError as e:
        check.problems.append(str(e))
        return None
    return md


def check_dcp(directory: str, handle: Any) -> DcpCheck:
    """Check the DCP checkpoint in ``directory`` (see the module docstring)."""
    check = DcpCheck()
    files = metadata_files(directory)
    if not files:
        check.problems.append(f"{directory}: no .metadata: not a DCP checkpoint, or a save that did not finish "
                              f"(.metadata is written last); nothing here can be loaded; {ADVICE}")
        return check
    per_file: dict[str, list[tuple[Any, Any]]] = {}
    with_crc = without_crc = 0
    for mpath in files:
        md = _load_metadata(mpath, check)
        if md is None:
            continue
        bad = table_problems(md.storage_data, mpath)
        check.problems.extend(p[3] for p in bad)
        skip = {id(p[0]) for p in bad}
        for index, info in md.storage_data.items():
            if _compat.dcp_storage_crc(info) is None:
                without_crc += 1
            else:
                with_crc += 1
            if id(index) not in skip:
                per_file.setdefault(info.relative_path, []).append((index, info))
    check.records = with_crc + without_crc
    if with_crc and without_crc:
        check.problems.append(f"{directory}: {without_crc} of {check.records} items have no CRC-32")
    for rel, items in sorted(per_file.items()):
        _check_file(os.path.join(directory, rel), items, handle, check, read=with_crc > 0)
    check.checked = with_crc > 0
    return check


def _check_file(path: str, items: list[tuple[Any, Any]], handle: Any, check: DcpCheck, read: bool) -> None:
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        check.problems.append(f"{path}: missing ({len(items)} items of the checkpoint are stored in it); {ADVICE}")
        return
    good = []
    for index, info in sorted(items, key=lambda it: (it[1].offset, it[1].length)):
        off, n = info.offset, info.length
        if off + n > size:
            check.problems.append(f"{path}: item {_name(index)} at [{off}, {off + n}) lies outside the file "
                                  f"({size} bytes): truncated, or .metadata belongs to another checkpoint")
            continue
        good.append((index, info))
    if not read or not good:
        return
    extents = [(info.offset, 0, info.length, slot) for slot, (_i, info) in enumerate(good) if info.length]
    try:
        crcs = handle.read(path, extents, len(good)) if extents else [0] * len(good)
    except EOFError as e:
        check.problems.append(f"{path}: shorter than its items ({e})")
        return
    for (index, info), crc in zip(good, crcs):
        want = _compat.dcp_storage_crc(info)
        if want is None:
            continue
        check.nbytes += info.length
        if want != crc:
            check.problems.append(f"{path}: item {_name(index)} at offset {info.offset} ({info.length} bytes): "
                                  f"CRC-32 {crc:08x}, recorded {want:08x}: damaged after it was written, or "
                                  f".metadata belongs to another checkpoint")


def verify_dcp(directory: str, handle: Any) -> Any:
    """``fastpersist.verify`` of a directory: a :class:`fastpersist.api.VerifyResult`."""
    from fastpersist.api import VerifyResult

    c = check_dcp(directory, handle)
    if c.problems:
        status = "corrupt"
    elif c.checked:
        status = "ok"
    else:
        status = "unchecked"
    problems = list(c.problems)
    if status == "unchecked":
        problems = [f"{directory}: DCP checkpoint without fastpersist checksums (written by DCP's FileSystemWriter): "
                    f"its structure is valid ({c.records} items), its bytes cannot be checked"]
    return VerifyResult(ok=status == "ok", path=directory, format="dcp", records=c.records,
                        bytes=c.nbytes if status != "unchecked" else 0, problems=problems, status=status)
