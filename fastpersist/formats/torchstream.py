"""Streaming layout of the torch zip format: storages are written while torch pickles.

``torch.save`` pickles the whole object before it writes any record, and the
offsets of the storage records depend on the pickle's length, so with torch's
record order no payload byte could be written before pickling ends. For states of
many small tensors, pickling (torch's per-tensor Python work) costs as much as
writing the bytes. This module runs torch's own ``_save`` with a proxy zip writer:

* the moment the pickler first names a storage (key ``0``, ``1``, ...), the
  record ``data/KEY`` (local header, alignment padding, payload hole, data
  descriptor) is laid out into a :class:`BlockRecorder`, and the file written so
  far can be handed to the native writer in batches while pickling goes on;
* when pickling ends, ``data.pkl`` and the small records follow, then the end of
  file (``version``, ``serialization_id``, central directory).

The records are laid out by :class:`~fastpersist.formats.zipwriter.MinizLayout`,
which writes the bytes torch's ``PyTorchFileWriter`` (miniz) writes, checked
against it once per process; if they ever differ, torch's writer itself lays them
out (slower: four Python callbacks per record). The pickle is torch's ``_save``
with a pickle module from :mod:`fastpersist.formats.torchpickle`. Only the record
order differs from ``torch.save`` (storages first, in key order, each aligned).
Readers find records through the central directory, so stock ``torch.load`` (also
with ``mmap=True`` and ``calculate_storage_offsets``) reads the file.

Payload CRCs are filled by native patches: the data descriptor of a payload lies in
the same batch as the payload (batches are cut at payload starts), and the central
directory entries are patched in the last batch (with values from earlier batches
written directly).

Every private torch name used here (``_save``, ``skip_data``, the serialization
config, ``PyTorchFileWriter``, the pickler's ``persistent_id`` slot) comes through
:mod:`fastpersist._compat`, which probes it once; when one is unusable,
:func:`stream_torch` raises :class:`~fastpersist.errors.UnsupportedLayoutError`
before writing anything and ``fastpersist.save`` uses ``torch.save``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from fastpersist import _compat
from fastpersist.errors import UnsupportedLayoutError
from fastpersist.formats.base import PATCH_U32LE
from fastpersist.formats.zipindex import CD_CRC_FIELD, central_directory_names
from fastpersist.formats.zipwriter import BlockRecorder, MinizLayout, layout_matches_torch, torch_version_record

_DESCRIPTOR_SIG = b"PK\x07\x08"
#: Serializes changes to torch's serialization config (``save.storage_alignment``).
_CONFIG_LOCK = _compat.CONFIG_LOCK
@dataclass
class _Payload:
    name: str
    offset: int
    nbytes: int
    ptr: int
    crc_field: int  # data descriptor CRC field


@dataclass
class Batch:
    """One contiguous byte range of the file, ready for ``Handle.write``/``submit_write``."""

    start: int
    end: int
    extents: list[tuple[int, int, int, int]]
    patches: list[tuple[int, int, int]]
    payloads: list[int]  # payload index of each crc slot
    final: bool


@dataclass
class StreamResult:
    """What the stream produced: payload names and the final file size."""

    file_size: int
    names: list[str] = field(default_factory=list)
    keepalive: list[Any] = field(default_factory=list)


def _save_signature_ok() -> bool:
    """Whether torch's private ``_save`` works as :func:`stream_torch` calls it
    (the ``private_save`` feature of :mod:`fastpersist._compat`)."""
    return _compat.ok("private_save")


#: What :func:`stream_torch` needs of torch (see :mod:`fastpersist._compat`).
_REQUIRED = ("private_save", "storage_alignment_config", "file_writer", "pickler_persistent_id")


class _TorchRecords:
    """Records through torch's own ``PyTorchFileWriter`` (miniz) into the recorder:
    the fallback when :func:`~fastpersist.formats.zipwriter.layout_matches_torch` fails."""

    def __init__(self, rec: BlockRecorder, alignment: int) -> None:
        self._rec = rec
        self._align = alignment
        self._writer = _compat.file_writer(rec, alignment)

    def add_payload(self, name: str, n: int) -> tuple[int, int]:
        rec = self._rec
        rec.last_hole = None
        self._writer.write_record_metadata(name, n)
        if n == 0:
            return rec.pos, -1
        hole = rec.last_hole
        if hole is None or hole[1] != n or hole[0] % self._align:
            raise UnsupportedLayoutError(f"record {name}: unexpected layout from torch's writer ({hole}, {n} bytes)")
        off = hole[0]
        if rec.read_at(off + n, 4) != _DESCRIPTOR_SIG:
            raise UnsupportedLayoutError(f"record {name}: no data descriptor after the payload")
        return off, off + n + 4

    def add_record(self, name: str, data: Any) -> None:
        self._writer.write_record(name, data, len(data))

    def finish(self) -> dict[str, tuple[str, int]]:
        """End of file; ``short name -> (full name, central directory CRC field)``."""
        self._writer.write_end_of_file()
        out = {}
        for full, entry_off in central_directory_names(self._rec.read_at, self._rec.pos, "<torch.save stream>"):
            short = full.split("/", 1)[1] if "/" in full else full  # torch prefixes "archive/"
            out[short] = (full, entry_off + CD_CRC_FIELD)
        return out


class _OurRecords:
    """Records laid out by :class:`~fastpersist.formats.zipwriter.MinizLayout` (same bytes, no callbacks)."""

    def __init__(self, rec: BlockRecorder, alignment: int) -> None:
        self._layout = MinizLayout(rec, alignment, torch_version_record())

    def add_payload(self, name: str, n: int) -> tuple[int, int]:
        return self._layout.add_payload(name, n)

    def add_record(self, name: str, data: Any) -> None:
        self._layout.add_record(name, data)

    def finish(self) -> dict[str, tuple[str, int]]:
        self._layout.finish()
        out = {}
        for e in self._layout.entries:
            full = e.name.decode("utf-8")
            out[full.split("/", 1)[1]] = (full, e.cd_crc_field)
        return out


class _ZipProxy:
    """What torch's ``_save`` writes through: every record goes to the record writer,
    except storage records, which were emitted already when first pickled."""

    def __init__(self, records: Any, emitted: set[str]) -> None:
        self._records = records
        self._emitted = emitted

    def write_record(self, name: str, data: Any, nbytes: int) -> None:
        if isinstance(data, str):
            data = data.encode("utf-8")
        if len(data) != nbytes:
            raise UnsupportedLayoutError(f"record {name}: {len(data)} bytes given for {nbytes}")
        self._records.add_record(name, data)

    def write_record_metadata(self, name: str, nbytes: int) -> None:
        if name not in self._emitted:
            raise UnsupportedLayoutError(f"torch wrote storage record {name} that pickling never named")


def stream_torch(
    obj: Any,
    alignment: int,
    emit: Callable[[Batch], None],
    *,
    batch_bytes: int = 0,
    host_bytes: Callable[[torch.UntypedStorage, list[Any]], int],
    capture_module: Callable[..., Any],
    crcs_before_final: Callable[[], dict[int, int]] = dict,
    fast_layout: bool = True,
) -> StreamResult:
    """Serialize ``obj`` with torch's ``_save``, emitting batches of the file as it grows.

    ``emit`` receives each :class:`Batch` in file order. With ``batch_bytes`` > 0 a
    batch is cut (at an aligned payload start) whenever that many bytes are
    pending; 0 means one final batch. Before the final batch,
    ``crcs_before_final()`` must return the CRC of every payload emitted in earlier
    batches (payload index -> crc): they go straight into the central directory.
    ``fast_layout``: lay out the records with :class:`MinizLayout` when it matches
    torch's writer here; False: always through torch's ``PyTorchFileWriter``.
    """
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    for feature in _REQUIRED:
        _compat.require(feature)  # UnsupportedLayoutError: the caller uses torch's writer
    save = _compat.private_save()
    rec = BlockRecorder()
    records: Any = (
        _OurRecords(rec, alignment)
        if fast_layout and alignment <= 65536 and layout_matches_torch()
        else _TorchRecords(rec, alignment)
    )
    payloads: list[_Payload] = []
    emitted: set[str] = set()
    result = StreamResult(file_size=0)
    keepalive = result.keepalive
    keepalive.append(rec)
    state = {"start": 0, "first_payload": 0}

    def cut(end: int, final: bool, cd_fields: Optional[dict[str, int]] = None) -> None:
        start = state["start"]
        if end <= start and not final:
            return
        extents: list[tuple[int, int, int, int]] = []
        patches: list[tuple[int, int, int]] = []
        slots: list[int] = []
        runs = rec.runs
        i = rec.run_index(start)
        while i < len(runs) and runs[i][0] < end:
            f, ptr, n = runs[i][0], runs[i][1], runs[i][2]
            lo, hi = max(f, start), min(f + n, end)
            if lo < hi:
                extents.append((lo, ptr + (lo - f), hi - lo, -1))
            i += 1
        k = state["first_payload"]
        while k < len(payloads) and payloads[k].offset < end:
            p = payloads[k]
            slot = len(slots)
            slots.append(k)
            extents.append((p.offset, p.ptr, p.nbytes, slot))
            patches.append((p.crc_field, slot, PATCH_U32LE))
            if cd_fields is not None:
                patches.append((cd_fields[p.name], slot, PATCH_U32LE))
            k += 1
        state["first_payload"] = k
        extents.sort(key=lambda e: e[0])
        patches.sort(key=lambda q: q[0])
        emit(Batch(start=start, end=end, extents=extents, patches=patches, payloads=slots, final=final))
        state["start"] = end

    def on_storage(key: str, storage: torch.UntypedStorage) -> None:
        name = f"data/{key}"
        if name in emitted:
            return
        emitted.add(name)
        n = storage.nbytes()
        off, crc_field = records.add_payload(name, n)
        if n == 0:
            return
        keepalive.append(storage)
        payloads.append(_Payload(name, off, n, host_bytes(storage, keepalive), crc_field))
        if batch_bytes and off - state["start"] >= batch_bytes:
            cut(off, final=False)  # everything before this payload is final

    module = capture_module(on_storage)
    # _save records ".storage_alignment" from torch's (process-wide) config: it
    # must say what our writer does, or torch.load's calculate_storage_offsets
    # mode would compute wrong offsets. Planners take turns on the config.
    with _compat.save_storage_alignment(alignment), _compat.skip_data():
        save(obj, _ZipProxy(records, emitted), module, torch.serialization.DEFAULT_PROTOCOL, False)

    # Central directory CRCs: values of earlier batches now, patches for the rest.
    fields = records.finish()
    cd_fields = {short: field for short, (_full, field) in fields.items()}
    first_final = state["first_payload"]
    if first_final:
        known = crcs_before_final()
        for k in range(first_final):
            rec.patch(cd_fields[payloads[k].name], struct.pack("<L", known[k]))
    cut(rec.pos, final=True, cd_fields=cd_fields)
    result.file_size = rec.pos
    result.names = [fields[p.name][0] for p in payloads]
    return result
