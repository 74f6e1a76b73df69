"""When a CRC-32 that does not match is an error: the checksum policy of torch zip loads.

Stock ``torch.load`` never compares CRC-32s, and torch itself writes and changes files
whose CRC fields do not describe their bytes:

* ``torch.serialization.set_crc32_options(False)`` (``config.save.compute_crc32``)
  writes 0 in every CRC field; ``skip_data()`` writes 0 for every storage record
  (its bytes are left to be filled in later);
* ``torch.load(f, mmap=True)`` under ``set_default_mmap_options(mmap.MAP_SHARED)``
  maps the file writable and shared: writing into a loaded tensor changes the file,
  and its CRCs go stale.

fastpersist's loads (``fastpersist.load``, the patched ``torch.load``, the checked
``mmap=True`` path) therefore apply this rule:

1. **A recorded CRC-32 of 0 means "no CRC"**, as torch's writer uses it: the record is
   not checked (a record whose bytes really have CRC 0 loses nothing: it matches).
2. **A mismatch in a file fastpersist wrote raises**
   :class:`~fastpersist.errors.ChecksumError`: its CRCs were computed by fastpersist
   from the bytes it wrote, so a difference is corruption (media, a torn copy, a
   program writing where it should not).
3. **In any other file, a mismatch confined to storage records** (``data/N``, the
   tensor bytes, the only records a shared mapping can change) **is loaded as torch
   loads it**, with a warning in the ``fastpersist`` log naming the records: torch
   wrote those CRCs and torch does not hold its files to them. A mismatch in any other
   record (``data.pkl``, ``byteorder``, ...: nothing of torch's changes them in place)
   still raises ``ChecksumError``.

"Written by fastpersist" is read from the file itself: fastpersist's zip writer
(:class:`~fastpersist.formats.zipwriter.MinizLayout`) derives the content of
``.data/serialization_id`` from the record names and ``data.pkl``'s CRC-32
(:func:`serialization_id`); torch's writer puts other digits there. A file laid out by
torch's own writer (fastpersist's fallback when its layout does not match this torch)
counts as torch's.

A ``MAP_SHARED`` mmap load through fastpersist (``torch.load(f, mmap=True)`` with the
switch on, ``fastpersist.load(f, mmap=True)``) hands the program write access to the
file's bytes: before mapping, it **releases** a file fastpersist wrote (:func:`release`:
the serialization id is rewritten to a value that is not fastpersist's, its own CRC
fields updated, so the archive stays consistent), and later loads treat the file as
rule 3 says. A file fastpersist wrote and another program changed in place through a
shared mapping made *without* fastpersist (stock torch, numpy) still raises
``ChecksumError``; load it with ``Config(checksum=False)`` (``FASTPERSIST_CHECKSUM=0``),
or re-save it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import zlib
from typing import Any, Callable, Optional, Sequence

from fastpersist.errors import ChecksumError
from fastpersist.formats.zipindex import fd_reader, parse_zip_index

log = logging.getLogger(__name__)

SERIALIZATION_ID = ".data/serialization_id"


def no_crc(recorded: int) -> bool:
    """Whether a record's recorded CRC-32 means "none was computed" (torch writes 0)."""
    return recorded == 0


def serialization_id(names: Sequence[bytes], pkl_crc: int) -> bytes:
    """The ``.data/serialization_id`` content fastpersist's zip writer gives a file:
    from the names of the records before it (in order) and ``data.pkl``'s CRC-32."""
    h = hashlib.blake2b(digest_size=8)
    for name in names:
        h.update(name + b"\0")
    return b"%020d%020d" % (int.from_bytes(h.digest(), "little") % 10**20, pkl_crc)


def _released_id(names: Sequence[bytes], pkl_crc: int) -> bytes:
    ours = serialization_id(names, pkl_crc)
    return b"%020d" % ((int(ours[:20]) + 1) % 10**20) + ours[20:]


def _expected(entries: Sequence[Any]) -> Optional[tuple[list[bytes], int]]:
    """``(names before the serialization id, data.pkl's CRC)`` from central directory
    entries (objects with ``name`` and ``crc32``), or None when there is no id record."""
    names: list[bytes] = []
    pkl_crc = 0
    for e in entries:
        if e.name == SERIALIZATION_ID or e.name.endswith("/" + SERIALIZATION_ID):
            return names, pkl_crc
        names.append(e.name.encode("utf-8"))
        if e.name == "data.pkl" or e.name.endswith("/data.pkl"):
            pkl_crc = e.crc32
    return None


def written_by_fastpersist(entries: Sequence[Any], id_bytes: Optional[bytes]) -> bool:
    """Whether a torch zip file with these central directory ``entries`` (in directory
    order) and ``.data/serialization_id`` content was written by fastpersist's writer."""
    if id_bytes is None:
        return False
    exp = _expected(entries)
    return exp is not None and bytes(id_bytes) == serialization_id(*exp)


def mismatch(path: str, problems: list[str], ours: Callable[[], bool], storages_only: bool) -> None:
    """Apply the rule to CRC mismatches (``problems``: one line per record, non-empty;
    ``storages_only``: every one of them is a storage record): raise
    :class:`~fastpersist.errors.ChecksumError` for a file fastpersist wrote (``ours()``)
    or a mismatch outside the storages; log a warning and return otherwise (torch does
    not check)."""
    if not storages_only or ours():

        raise checksum_error(path, problems)
    log.warning(
        "%s: %d record(s) do not match the CRC-32 torch recorded (%s%s); the file was not written by "
        "fastpersist, so it is loaded as torch.load loads it (torch does not check CRCs; a file changed "
        "in place through a MAP_SHARED mmap load has stale CRCs)",
        path, len(problems), "; ".join(problems[:3]), "; ..." if len(problems) > 3 else "",
    )


def release(fd: int, path: str) -> bool:
    """Before a writable shared mapping of the file open at ``fd``: if fastpersist wrote
    it, rewrite its serialization id (and that record's CRC fields) so that later loads
    no longer hold its storages to the CRCs recorded at save time. Returns whether the
    file was released. The file is reopened read-write through ``/proc/self/fd`` (the
    same inode); where that is refused the file stays as it is (torch's shared mapping
    needs write access too, and raises its own error)."""
    size = os.fstat(fd).st_size
    index = parse_zip_index(fd_reader(fd, path), size, path)
    e = index.find(SERIALIZATION_ID)
    if e is None or e.compressed_size != 40 or e.method != 0:
        return False
    current = os.pread(fd, 40, e.data_offset)
    exp = _expected(index.entries)
    if exp is None or current != serialization_id(*exp):
        return False
    new = _released_id(*exp)
    crc = zlib.crc32(new).to_bytes(4, "little")
    try:
        wfd = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_CLOEXEC)
    except OSError as err:
        log.debug("%s: cannot reopen for writing (%s); its CRCs stay authoritative", path, err)
        return False
    try:
        os.pwrite(wfd, new, e.data_offset)
        for off in e.crc_field_offsets:
            if int.from_bytes(os.pread(fd, 4, off), "little") == e.crc32:
                os.pwrite(wfd, crc, off)
        os.fsync(wfd)
    finally:
        os.close(wfd)
    log.info("%s: mapped shared and writable: fastpersist's CRCs of its storages no longer bind later loads", path)
    return True


def checksum_error(path: str, problems: list[str]) -> ChecksumError:
    """One error for every record whose CRC-32 is wrong (the first five spelled out)."""
    return ChecksumError(
        f"{path}: {len(problems)} record(s) do not match their checksum (the file is corrupt; "
        f"restore it from a good copy): " + "; ".join(problems[:5])
        + (f"; ... and {len(problems) - 5} more" if len(problems) > 5 else ""),
        path=path,
        records=[p.split(":", 1)[0] for p in problems],
    )
