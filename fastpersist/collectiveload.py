"""Collective loads over a ``torch.distributed`` group.

``fastpersist.load(path, group=g)`` is called by every rank of the process group ``g``
and every rank gets the whole object.

A collective load reads the file once in total (``Config.dist_load="slices"``): each
rank reads a disjoint aligned slice (O_DIRECT) into an anonymous memory file, in pieces
of :data:`EXCHANGE_PIECE` bytes, and broadcasts each piece over the group (gloo: CPU
tensors; NCCL: through CUDA tensors) while it reads the next. Every rank then holds the
whole file in memory and loads it there: a torch zip file's tensors are built over
those bytes (a private mapping of the memory file: no second copy, and a write to a
tensor stays in its process), every record's local header and CRC-32 checked in place
before the result is returned, with the checks of an ordinary load. The CRC-32s are
computed as the pieces arrive, on a thread that overlaps the next broadcasts
(:class:`~fastpersist.formats.piececrc.PieceCrcs`, from the zip central directory in the
file's last 128 KiB, which the ranks read to compare the file); a record not covered so
(a central directory beyond that tail, an unreadable local header) is checked over the
assembled bytes after the exchange. Where every rank has a CPU of its own, the last pieces
of each slice are smaller (halves down to a sixteenth of a piece), so little is left to
broadcast after the last read. Each tensor has a
storage of its own, as with ``torch.load``, but together they keep the file's memory
alive, as a ``torch.load(mmap=True)`` result keeps its mapping. A corrupt byte in any
rank's slice reaches every rank, so every rank raises. Safetensors files, legacy torch
files and what the fast reader hands to ``torch.load`` are loaded from the memory file
by the ordinary loader (a second pass over the bytes). With ``dist_load="whole"`` every rank reads the
whole file itself; ranks that share a host then read it through the page cache
when ``read_mode`` is ``"auto"``, so the host's storage serves the bytes once. The default, ``"auto"``, takes slices for NCCL groups (an
exchange over NVLink/InfiniBand is far faster than storage) and whole for gloo
groups: on the 2-vCPU reference VM, broadcasting 1 GB over loopback TCP cost more
than each rank reading the file again (docs/benchmarks.md, "Multi-rank"). The ranks first check that they see the same file (size and a
hash of its first and last 64 KiB, which hold the zip central directory with every
record's CRC, or the safetensors header).
"""

from __future__ import annotations

import hashlib
import logging
import mmap as _mmap
import os
import socket
import threading
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from fastpersist import handles, pending, pipeline
from fastpersist import config as config_mod
from fastpersist._inputs import is_path
from fastpersist._sys import pread_full
from fastpersist.coordinator import Coordinator, Local, check_group, collective
from fastpersist.errors import DistributedCheckpointError, UnsupportedLayoutError, ZipFormatError
from fastpersist.formats import registry, split
from fastpersist.formats.piececrc import PieceCrcs
from fastpersist.formats.zipindex import CentralEntry, read_central_directory
from fastpersist.formats.safetensors import load_safetensors

log = logging.getLogger(__name__)

__all__ = ["load", "last_load_phases"]

_HASH_SPAN = 64 << 10
_TAIL_SPAN = 128 << 10


def load(
    path: Any,
    map_location: Any = None,
    pickle_module: Any = None,
    *,
    group: Any,
    weights_only: Optional[bool] = None,
    mmap: Optional[bool] = None,
    config: Any = None,
    **pickle_load_args: Any,
) -> Any:
    """Collective :func:`fastpersist.load`: every rank of ``group`` calls it and gets the
    whole object; see the module docstring (``Config.dist_load``)."""

    check_group(group)
    cfg = config_mod.resolve(config)

    def local_load(p: Any) -> Any:
        return pipeline.load(p, map_location, pickle_module, weights_only=weights_only, mmap=mmap, config=cfg,
                        **pickle_load_args)

    if dist.get_world_size(group) == 1:
        return local_load(path)
    if not is_path(path):
        raise TypeError(f"a collective load reads a file path (str or os.PathLike), got {type(path).__name__}")
    fspath = os.fsdecode(os.fspath(path))
    with collective("load", fspath, group, cfg.dist_timeout, _last_load_phases) as co:
        mode = cfg.dist_load
        if mode == "auto":
            mode = "slices" if _bulk_device(group) is not None else "whole"
        slices = mode == "slices" and not mmap and hasattr(os, "memfd_create")
        if slices:
            req = registry.LoadRequest(path, map_location, pickle_module, weights_only, mmap, dict(pickle_load_args))
            return _load_slices(co, fspath, cfg, req, local_load)
        # Every rank reads the whole file. Ranks on one host then read the same bytes: through
        # the page cache the host's disk serves them once (O_DIRECT would read them once per rank),
        # so read_mode "auto" reads buffered there; an explicit read_mode is honoured.
        hosts = co.gather("hosts", socket.gethostname())
        shared = sum(h == hosts[co.rank] for h in hosts) > 1
        wcfg = cfg.replace(read_mode="buffered") if shared and cfg.read_mode == "auto" else cfg
        loc = Local()
        result = loc.run(lambda: pipeline.load(path, map_location, pickle_module, weights_only=weights_only, mmap=mmap,
                                          config=wcfg, **pickle_load_args))
        co.check("load", co.gather("load", loc.status), local=loc.exc)
        return result


_last_load_phases: list[tuple[str, float, float]] = []


def last_load_phases() -> list[tuple[str, float, float]]:
    """Where this rank's last collective load (``load(..., group=...)``) spent its time, as
    :func:`last_save_phases` says it for saves: ``open`` (the file's fingerprint), then with
    ``dist_load="slices"`` ``exchange`` (this rank's reads of its slice overlapped with
    the pieces' broadcasts: local time 0, all of it in the exchange) and ``read`` (the
    ranks' read status), or with ``dist_load="whole"`` ``hosts``; ``load`` (the tensors
    built over the assembled bytes, or the ordinary loader on the whole file), then
    ``end``. For benchmarks."""
    return list(_last_load_phases)


def _fingerprint(fspath: str) -> tuple[int, str, bytes]:
    """(size, hash of the first and last 64 KiB, the last 128 KiB) of the file (the tail
    holds a zip file's end records, which may be 64 KiB away from its end, and its
    central directory if it is small)."""
    with open(fspath, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h = hashlib.blake2b(digest_size=16)
        h.update(pread_full(f.fileno(), _HASH_SPAN, 0, fspath))
        tail = bytes(pread_full(f.fileno(), _TAIL_SPAN, max(0, size - _TAIL_SPAN), fspath))
        h.update(tail[-_HASH_SPAN:])
    return size, h.hexdigest(), tail


def _central_directory(fspath: str, size: int, tail: bytes) -> Optional[list[CentralEntry]]:
    """The zip central directory of a torch zip file from its last bytes ``tail``; None
    when it is not wholly there or not a zip file (the loader then computes every CRC)."""
    if registry.format_for(fspath) is not registry.TORCH:
        return None
    start = size - len(tail)

    def read_at(offset: int, length: int) -> bytes:
        if offset < start or offset + length > size:
            raise EOFError("outside the tail")
        return tail[offset - start : offset - start + length]

    try:
        return read_central_directory(read_at, size, fspath)[1]
    except (EOFError, ZipFormatError, ValueError):
        return None


def _bulk_device(group: Any) -> Optional[torch.device]:
    """Device of the tensors the user's group moves: None for CPU (exchange on our gloo group)."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "nccl" not in backend:
        return None
    return torch.device("cuda", torch.cuda.current_device())


#: Bytes per piece of a slices load: each rank reads its slice in pieces of this size and
#: broadcasts each piece while it reads the next (a multiple of the page size).
EXCHANGE_PIECE = 32 << 20


def _load_slices(co: Coordinator, fspath: str, cfg: Any, req: registry.LoadRequest,
                 local_load: Callable[[Any], Any]) -> Any:

    loc = Local()
    loc.run(lambda: pending.wait_before_reading(fspath))  # this process's own saves of the file first
    got = loc.run(lambda: _fingerprint(fspath))
    fp = got[:2] if got is not None else None
    info = co.gather("open", (loc.status, fp))
    co.check("open", [v[0] for v in info], local=loc.exc)
    if len({v[1] for v in info}) > 1:
        sizes = ", ".join(f"{co.name(r)}: {v[1][0]} bytes" for r, v in enumerate(info))
        raise DistributedCheckpointError(
            f"{co.what}: the ranks do not see the same file (size or contents of its index differ: {sizes}); "
            "load without group= to read each rank's own file")
    size = info[0][1][0]
    entries = _central_directory(fspath, size, got[2]) if cfg.checksum else None
    checked: dict[tuple[int, int], int] = {}
    bounds = split.slice_bounds(size, co.size, 4096)
    fd = os.memfd_create("fastpersist-load", getattr(os, "MFD_CLOEXEC", 1))
    try:
        os.ftruncate(fd, size)
        if size:
            # not populated here: the pages are faulted in by the reads and the broadcasts, which
            # overlap (a populate up front costs more and overlaps nothing)
            mm = _mmap.mmap(fd, size, flags=_mmap.MAP_SHARED)
            try:
                buf = torch.frombuffer(mm, dtype=torch.uint8)
                checked = _read_and_exchange(co, loc, fspath, cfg, buf, bounds, entries)
                del buf
            finally:
                try:
                    mm.close()
                except BufferError:  # pragma: no cover - a view is still alive; freed with it
                    pass
        co.check("read", co.gather("read", loc.status), local=loc.exc)
        result = loc.run(lambda: _load_assembled(fd, size, fspath, cfg, req, local_load, checked))
    finally:
        os.close(fd)
    co.check("load", co.gather("load", loc.status), local=loc.exc)
    return result


def _pieces(lo: int, hi: int, taper: bool) -> list[tuple[int, int]]:
    """The pieces of the slice ``[lo, hi)``: :data:`EXCHANGE_PIECE` bytes each; with
    ``taper`` the last two pieces' worth in halves down to a sixteenth of a piece, so that
    what is left to broadcast after the slice's last read is small (the pipeline's tail).
    Tapered only where every rank has a CPU of its own: where ranks outnumber the CPUs the
    exchange is CPU-bound and each extra piece is one more round of it (4 ranks on 2
    CPUs: exchange 1.6 s tapered against 1.3 s not)."""
    piece, page = EXCHANGE_PIECE, 4096
    least = max(page, piece // 16 // page * page)
    out = []
    a = lo
    while a < hi:
        left = hi - a
        if left > 2 * piece or not taper:
            n = min(piece, left)
        elif left > least:
            n = max(least, (left // 2 + page - 1) // page * page)
        else:
            n = left
        out.append((a, a + n))
        a += n
    return out


def _read_and_exchange(co: Coordinator, loc: Local, fspath: str, cfg: Any, buf: torch.Tensor,
                       bounds: list[tuple[int, int]],
                       entries: Optional[list[CentralEntry]] = None) -> dict[tuple[int, int], int]:
    """Read this rank's slice of the file into ``buf`` piece by piece (O_DIRECT, on a thread
    of its own) while broadcasting the pieces already read: every rank's slice ends up in
    every rank's ``buf``. A failed read is kept in ``loc`` (the ranks learn of it at the
    ``read`` step); the rank still takes part in every broadcast, so the others neither
    hang nor get ahead. With the file's zip central directory ``entries``, the CRC-32s
    of its records are computed as the pieces arrive (on a thread of its own, overlapping
    the next broadcasts: :class:`~fastpersist.formats.piececrc.PieceCrcs`); returned as
    ``(data offset, length) -> CRC-32`` for the loader to compare."""
    taper = co.size <= (os.cpu_count() or 1)
    pieces = [_pieces(lo, hi, taper) for lo, hi in bounds]
    mine = pieces[co.rank]
    ready = [threading.Event() for _ in mine]
    stop = threading.Event()
    failed: list[BaseException] = []
    base = buf.data_ptr()

    def read() -> None:
        try:
            handle = handles.handle_for(cfg, read=True)
            for k, (a, b) in enumerate(mine):
                if stop.is_set():
                    break
                handle.read(fspath, [(a, base + a, b - a, -1)], 0)
                ready[k].set()
        except BaseException as exc:  # noqa: BLE001 - reported to every rank at the read step
            failed.append(exc)
        finally:
            for e in ready:  # the broadcasts go on (with whatever bytes are there); the read step fails
                e.set()

    reader = threading.Thread(target=read, name="fastpersist-slice-read", daemon=True)
    reader.start()
    device = _bulk_device(co.group)
    crcs = PieceCrcs(entries, buf.numel(), base) if entries else None

    def broadcasts() -> None:
        for k in range(max(len(p) for p in pieces)):
            for r in range(co.size):
                if k >= len(pieces[r]):
                    continue
                a, b = pieces[r][k]
                if r == co.rank:
                    ready[k].wait()
                src = co.global_ranks[r]
                if device is None:
                    dist.broadcast(buf[a:b], src=src, group=co.side)
                else:
                    t = buf[a:b].to(device) if r == co.rank else torch.empty(b - a, dtype=torch.uint8, device=device)
                    dist.broadcast(t, src=src, group=co.group)
                    if r != co.rank:
                        buf[a:b].copy_(t)
                if crcs is not None:
                    crcs.arrived(a, b)

    checked: dict[tuple[int, int], int] = {}
    try:
        co.exchange("exchange", broadcasts)
    finally:
        stop.set()
        reader.join()  # it writes into buf: never return while it runs
        if crcs is not None:
            checked = crcs.finish()  # it reads buf: never return while it runs either
    if failed and loc.exc is None:
        loc.exc = failed[0]
    return checked


def _load_assembled(fd: int, size: int, fspath: str, cfg: Any, req: registry.LoadRequest,
                    local_load: Callable[[Any], Any], checked: Optional[dict[tuple[int, int], int]] = None) -> Any:
    """Load the file whose bytes every rank now holds in the memory file ``fd``.

    A torch zip file is loaded in place: its tensors are views of a private mapping of the
    memory file (no second copy; a write to a tensor stays in this process, as with
    ``torch.load``), every record's CRC-32 checked there (compared with ``checked``, the
    CRC-32s computed as the pieces arrived, where it has the record's range). Every other case (safetensors, a
    legacy torch file, what the fast reader hands to ``torch.load``) loads the memory file
    by its ``/proc`` path with the ordinary loader."""
    if size and registry.format_for(fspath) is registry.TORCH:
        # not populated: the CRC pass maps the pages, many per fault (a populate of a private
        # mapping costs about twice as much here)
        mem = _mmap.mmap(fd, size, flags=_mmap.MAP_PRIVATE, prot=_mmap.PROT_READ | _mmap.PROT_WRITE)
        try:
            return registry.load_torch_in_memory(fspath, fd, mem, cfg, req, checked)
        except UnsupportedLayoutError as e:
            log.debug("%s: in-place load not possible (%s); loading the assembled bytes again", fspath, e)
        del mem
    return _load_memfd(fd, fspath, cfg, req.map_location, local_load)


def _load_memfd(fd: int, fspath: str, cfg: Any, map_location: Any, local_load: Callable[[Any], Any]) -> Any:
    """Load the assembled bytes with the ordinary loader, through the memory file's /proc path."""

    proc = f"/proc/self/fd/{fd}"
    if registry.format_for(fspath) is registry.SAFETENSORS:
        return load_safetensors(proc, handles.handle_for(cfg, read=True), registry.safetensors_device(map_location),
                                checksum=cfg.checksum)
    return local_load(proc)
