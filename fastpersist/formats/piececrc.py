"""CRC-32s of a zip file's records computed while its bytes arrive in pieces.

A collective ``slices`` load assembles a file in memory from pieces that arrive out of
file order (each rank's slice, piece by piece). :class:`PieceCrcs` computes, on a thread
of its own, the CRC-32 of every stored record's bytes as the pieces covering them
arrive: each record's part in each piece separately, joined with ``crc32_combine`` once
the record is complete. The record list comes from the zip central directory (read
before any piece, from the file's tail); where a record's data starts comes from its
local header in the arrived bytes. The result maps ``(data offset, length)`` to the
CRC-32 of exactly those bytes of the buffer, for the records whose every byte was
covered; the loader compares them with the recorded CRCs instead of computing them
again (:func:`fastpersist.formats.torchload.load_torch` ``checked_crcs``). A record
missing from the map (its header unreadable, a piece missing) is checked by the loader
as before: nothing is skipped that was not computed.
"""

from __future__ import annotations

import bisect
import ctypes
import queue
import struct
import threading
from typing import Optional, Sequence

from fastpersist import _native
from fastpersist.formats.zipindex import CentralEntry

__all__ = ["PieceCrcs"]

_LOCAL_SIG = b"PK\x03\x04"
_LOCAL_HEADER = 30
# a local header's name and extra field are at most 64 KiB each
_HEADER_REACH = _LOCAL_HEADER + 2 * 0xFFFF


class _Rec:
    __slots__ = ("header", "length", "data", "parts")

    def __init__(self, header: int, length: int) -> None:
        self.header = header
        self.length = length
        self.data = -1  # where its bytes start, once its local header arrived
        self.parts: dict[int, tuple[int, int]] = {}  # start -> (crc, length) of each computed part


class PieceCrcs:
    """Computes records' CRC-32s over the pieces of ``[base, base + size)`` as they arrive
    (:meth:`arrived`), on a thread of its own; :meth:`finish` waits and returns the
    ``(data offset, length) -> CRC-32`` map. ``entries`` is the file's central directory."""

    def __init__(self, entries: Sequence[CentralEntry], size: int, base: int) -> None:
        self._size = size
        self._base = base
        recs = sorted((e.header_offset, e.compressed_size) for e in entries if e.method == 0 and e.compressed_size > 0)
        self._recs = [_Rec(h, n) for h, n in recs]
        self._heads = [r.header for r in self._recs]
        self._pieces: list[tuple[int, int]] = []  # arrived, sorted
        self._queue: queue.SimpleQueue[Optional[tuple[int, int]]] = queue.SimpleQueue()
        self._failed: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="fastpersist-piece-crc", daemon=True)
        self._thread.start()

    def arrived(self, lo: int, hi: int) -> None:
        """Bytes ``[lo, hi)`` are in the buffer for good (never written again)."""
        self._queue.put((lo, hi))

    def finish(self) -> dict[tuple[int, int], int]:
        """Wait for every arrived piece's CRCs; the CRC-32 of every record wholly covered."""
        self._queue.put(None)
        self._thread.join()
        if self._failed is not None:
            return {}
        out: dict[tuple[int, int], int] = {}
        for r in self._recs:
            if r.data < 0:
                continue
            pos, crc = r.data, 0
            for start in sorted(r.parts):
                if start != pos:
                    break
                c, n = r.parts[start]
                crc = _native.crc32_combine(crc, c, n)
                pos += n
            if pos == r.data + r.length:
                out[(r.data, r.length)] = crc
        return out

    # -- the thread -----------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    return
                self._add(*item)
        except BaseException as exc:  # noqa: BLE001 - the loader computes every CRC itself then
            self._failed = exc
            while self._queue.get() is not None:
                pass

    def _covered(self, lo: int, hi: int) -> bool:
        i = bisect.bisect_right(self._pieces, (lo, float("inf"))) - 1
        pos = lo
        while pos < hi and 0 <= i < len(self._pieces) and self._pieces[i][0] <= pos:
            pos = max(pos, self._pieces[i][1])
            i += 1
        return pos >= hi

    def _read(self, lo: int, n: int) -> bytes:
        return ctypes.string_at(self._base + lo, n)

    def _add(self, lo: int, hi: int) -> None:
        bisect.insort(self._pieces, (lo, hi))
        work: list[tuple[_Rec, int, int]] = []
        # records whose local header may have just become whole: learn where their bytes start,
        # then take their parts in every piece that arrived before this one
        a = bisect.bisect_left(self._heads, lo - _HEADER_REACH)
        b = bisect.bisect_left(self._heads, hi)
        for r in self._recs[a:b]:
            if r.data >= 0 or not self._covered(r.header, min(self._size, r.header + _LOCAL_HEADER)):
                continue
            head = self._read(r.header, min(_LOCAL_HEADER, self._size - r.header))
            if len(head) < _LOCAL_HEADER or head[:4] != _LOCAL_SIG:
                continue  # the loader reports it
            nlen, xlen = struct.unpack_from("<HH", head, 26)
            data = r.header + _LOCAL_HEADER + nlen + xlen
            if data + r.length > self._size or not self._covered(r.header, data):
                continue
            r.data = data
            for plo, phi in self._pieces:
                if (plo, phi) != (lo, hi):
                    work.extend(self._part(r, plo, phi))
        # every known record's part in this piece
        a = max(0, bisect.bisect_right(self._heads, lo) - 1)
        b = bisect.bisect_left(self._heads, hi)
        for r in self._recs[a:b]:
            if r.data >= 0:
                work.extend(self._part(r, lo, hi))
        if work:
            crcs = _native.crc32_many([(self._base + s, n) for _r, s, n in work])
            for (r, s, n), c in zip(work, crcs):
                r.parts[s] = (c, n)

    @staticmethod
    def _part(r: _Rec, lo: int, hi: int) -> list[tuple[_Rec, int, int]]:
        s, e = max(lo, r.data), min(hi, r.data + r.length)
        return [(r, s, e - s)] if e > s and s not in r.parts else []

