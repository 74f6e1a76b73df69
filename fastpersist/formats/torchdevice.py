"""torch zip storages loaded straight onto CUDA devices: which ones, and their checks.

``fastpersist.load(path, map_location=...)`` of a torch zip file decides, from the
pickle's persistent ids (:func:`fastpersist.formats.picklescan.scan_pickle` records
each storage's saved location), where torch's ``map_location`` semantics put each
storage (:func:`destinations`: a device string or ``torch.device`` maps every
storage; a dict maps saved locations; ``None`` keeps them). The records of storages
that end up on a CUDA device are not read into host buffers: :func:`read_to_device`
hands them to :func:`fastpersist.cudaload.read_items` (the page-locked ring, or
cuFile), then checks each record's local header and CRC-32 against the zip index of a
:class:`fastpersist.formats.torchload.LoadState`. The unpickler's ``persistent_load``
then gets those device storages, and torch's ``restore_location`` leaves them where
they are (``storage.to(device)`` is the identity on the right device).

A callable ``map_location`` keeps the host path (torch's unpickler moves
storages after the callable saw a CPU storage, which it may rely on).

``torchload`` passes its load state in (duck-typed: this module sits below it).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

import torch

from fastpersist.cudaload import RingItem, read_items

__all__ = ["destinations", "read_to_device", "records_for_device"]

_CUDA_LOCATION = re.compile(r"^cuda(:[0-9]+)?$")


def _cuda_device(target: Any) -> Optional[torch.device]:
    """The CUDA device torch's ``default_restore_location`` would put a storage on for
    the location ``target``, or None (not CUDA, or not restorable: torch raises then)."""
    if isinstance(target, bytes):
        target = target.decode()
    if isinstance(target, torch.device):
        target = str(target)
    if not isinstance(target, str) or not _CUDA_LOCATION.match(target):
        return None
    if not torch.cuda.is_available():
        return None
    index = int(target[5:]) if ":" in target else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        return None
    return torch.device("cuda", index)


def _is_storage_pid(pid: Any) -> bool:
    return isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[3], str)


def destinations(map_location: Any, pids: list[Any]) -> dict[str, torch.device]:
    """Storage key -> the CUDA device torch would restore it to, for the storages
    that go to a CUDA device under ``map_location`` (None, str, bytes, torch.device or
    dict; a callable gives ``{}``). ``pids``: the pickle's persistent ids
    (``('storage', type, key, location, numel)``). Costs one check when nothing goes
    to a CUDA device (a CPU ``map_location``, or no CUDA device here), and never
    initialises CUDA then (``torch.cuda.is_available()`` does not)."""
    if isinstance(map_location, (str, bytes, torch.device)):
        dev = _cuda_device(map_location)
        if dev is None:
            return {}
        return {str(pid[2]): dev for pid in pids if _is_storage_pid(pid)}
    if map_location is not None and not isinstance(map_location, dict):
        return {}  # a callable: the host path (it may rely on getting CPU storages)
    if not torch.cuda.is_available():
        return {}  # saved CUDA locations cannot be restored here: torch raises its own error
    where: dict[str, Optional[torch.device]] = {}  # saved location -> device (None: not CUDA)
    out: dict[str, torch.device] = {}
    seen: dict[str, Optional[torch.device]] = {}
    for pid in pids:
        if not _is_storage_pid(pid):
            continue
        key, loc = str(pid[2]), pid[3]
        if loc not in where:
            target = map_location.get(loc, loc) if isinstance(map_location, dict) else loc
            where[loc] = _cuda_device(target)
        dev = where[loc]
        if key in seen and seen[key] != dev:  # one key, two places: leave it to torch
            out.pop(key, None)
            continue
        seen[key] = dev
        if dev is not None:
            out[key] = dev
    return out


def records_for_device(load: Any, dest: dict[str, torch.device]) -> list[Any]:
    """The storage records of a :class:`fastpersist.formats.torchload.LoadState` whose key
    goes to a CUDA device (non-empty, not read yet), in file order."""
    out = []
    for key in dest:
        r = load.by_short.get(f"data/{key}")
        if r is not None and r.buffer is None and r.size > 0:
            out.append(r)
    out.sort(key=lambda r: r.entry.header_offset)
    return out


def read_to_device(load: Any, reader: Any, fd: int, dest: dict[str, torch.device],
                   allocate: Optional[Callable[[int, torch.device], torch.Tensor]] = None) -> list[Any]:
    """Read every record of ``dest``'s keys into device memory through the ring; each
    record's ``device`` attribute is set to its uint8 tensor once its local header and
    CRC-32 (``load.checksum``) are checked. Returns the records."""

    records = records_for_device(load, dest)
    if not records:
        return []
    cuda = any(d.type == "cuda" for d in dest.values())
    alloc = allocate or (lambda n, dev: torch.empty(n, dtype=torch.uint8, device=dev))
    items = [RingItem(r.entry.header_offset, r.data_offset, r.size, alloc(r.size, dest[r.short[5:]]))
             for r in records]
    items = read_items(fd, load.path, reader, items, cuda=cuda, checksum=load.checksum)
    for r, it in zip(records, items):
        load.check_header(r, memoryview(it.header))
    if load.checksum:
        bad = [f"{r.entry.name}: CRC-32 mismatch (computed {it.crc:08x}, recorded {r.entry.crc32:08x}) "
               f"in bytes [{r.data_offset}, {r.data_end})" for r, it in zip(records, items)
               if it.crc != r.entry.crc32 and r.entry.crc32 != 0]  # 0: no CRC (fastpersist.formats.crcpolicy)
        if bad:
            load.crc_mismatch(bad)  # raises for files fastpersist wrote
    for r, it in zip(records, items):
        r.device = it.dest
    return records
