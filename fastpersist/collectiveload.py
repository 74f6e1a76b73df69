"""Collective loads over a ``torch.distributed`` group.

``fastpersist.load(path, group=g)`` is called by every rank of the process group ``g``
and every rank gets the whole object.

A collective load reads the file once in total: each rank reads a disjoint
aligned slice (O_DIRECT) into an anonymous memory file, the slices are broadcast
over the group (gloo: CPU tensors; NCCL: through CUDA tensors), and every rank
then loads the assembled bytes with the ordinary loader, with all its checks
(``Config.dist_load="slices"``). With ``dist_load="whole"`` every rank reads the
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
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from fastpersist import handles, pipeline
from fastpersist import config as config_mod
from fastpersist._inputs import is_path
from fastpersist._sys import pread_full
from fastpersist.coordinator import Coordinator, Local, check_group
from fastpersist.errors import DistributedCheckpointError
from fastpersist.formats import registry, split
from fastpersist.formats.safetensors import load_safetensors

log = logging.getLogger(__name__)

__all__ = ["load", "last_load_phases"]

_HASH_SPAN = 64 << 10


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
    co = Coordinator(group, cfg.dist_timeout, f"fastpersist.load({fspath!r}) over {dist.get_world_size(group)} ranks")
    global _last_load_phases
    try:
        mode = cfg.dist_load
        if mode == "auto":
            mode = "slices" if _bulk_device(group) is not None else "whole"
        slices = mode == "slices" and not mmap and hasattr(os, "memfd_create")
        if slices:
            return _load_slices(co, fspath, cfg, map_location, local_load)
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
    finally:
        co.finish()
        _last_load_phases = co.phases(time.monotonic())
        log.debug("%s: phases (step, local s, exchange s): %s", co.what, _last_load_phases)


_last_load_phases: list[tuple[str, float, float]] = []


def last_load_phases() -> list[tuple[str, float, float]]:
    """Where this rank's last collective load (``load(..., group=...)``) spent its time, as
    :func:`last_save_phases` says it for saves: ``open`` (the file's fingerprint), ``read``
    (this rank's slice, or with ``dist_load="whole"`` nothing), ``exchange`` (the slices'
    broadcasts: local time 0, all of it in the exchange), ``load`` (the ordinary loader on
    the assembled bytes, or on the whole file), then ``end``. For benchmarks."""
    return list(_last_load_phases)


def _fingerprint(fspath: str) -> tuple[int, str]:
    """(size, hash of the first and last 64 KiB) of the file."""
    with open(fspath, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h = hashlib.blake2b(digest_size=16)
        h.update(pread_full(f.fileno(), _HASH_SPAN, 0, fspath))
        h.update(pread_full(f.fileno(), _HASH_SPAN, max(0, size - _HASH_SPAN), fspath))
    return size, h.hexdigest()


def _bulk_device(group: Any) -> Optional[torch.device]:
    """Device of the tensors the user's group moves: None for CPU (exchange on our gloo group)."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "nccl" not in backend:
        return None
    return torch.device("cuda", torch.cuda.current_device())


def _load_slices(co: Coordinator, fspath: str, cfg: Any, map_location: Any, local_load: Callable[[Any], Any]) -> Any:

    loc = Local()
    fp = loc.run(lambda: _fingerprint(fspath))
    info = co.gather("open", (loc.status, fp))
    co.check("open", [v[0] for v in info], local=loc.exc)
    if len({v[1] for v in info}) > 1:
        sizes = ", ".join(f"{co.name(r)}: {v[1][0]} bytes" for r, v in enumerate(info))
        raise DistributedCheckpointError(
            f"{co.what}: the ranks do not see the same file (size or contents of its index differ: {sizes}); "
            "load without group= to read each rank's own file")
    size = info[0][1][0]
    bounds = split.slice_bounds(size, co.size, 4096)
    fd = os.memfd_create("fastpersist-load", getattr(os, "MFD_CLOEXEC", 1))
    try:
        os.ftruncate(fd, size)
        mm = _mmap.mmap(fd, size) if size else None
        try:
            buf = torch.frombuffer(mm, dtype=torch.uint8) if mm is not None else torch.empty(0, dtype=torch.uint8)
            lo, hi = bounds[co.rank]
            if hi > lo:
                handle = handles.handle_for(cfg, read=True)
                loc.run(lambda: handle.read(fspath, [(lo, buf.data_ptr() + lo, hi - lo, -1)], 0))
            co.check("read", co.gather("read", loc.status), local=loc.exc)
            _exchange(co, buf, bounds)
            del buf
        finally:
            if mm is not None:
                try:
                    mm.close()
                except BufferError:  # pragma: no cover - a view is still alive; freed with it
                    pass
        result = loc.run(lambda: _load_memfd(fd, fspath, cfg, map_location, local_load))
    finally:
        os.close(fd)
    co.check("load", co.gather("load", loc.status), local=loc.exc)
    return result


def _exchange(co: Coordinator, buf: torch.Tensor, bounds: list[tuple[int, int]]) -> None:
    """Broadcast every rank's slice of ``buf`` to all ranks."""
    device = _bulk_device(co.group)

    def broadcasts() -> None:
        for r, (lo, hi) in enumerate(bounds):
            if hi <= lo:
                continue
            src = co.global_ranks[r]
            if device is None:
                dist.broadcast(buf[lo:hi], src=src, group=co.side)
            else:
                t = buf[lo:hi].to(device) if r == co.rank else torch.empty(hi - lo, dtype=torch.uint8, device=device)
                dist.broadcast(t, src=src, group=co.group)
                if r != co.rank:
                    buf[lo:hi].copy_(t)

    co.exchange("exchange", broadcasts)


def _load_memfd(fd: int, fspath: str, cfg: Any, map_location: Any, local_load: Callable[[Any], Any]) -> Any:
    """Load the assembled bytes with the ordinary loader, through the memory file's /proc path."""

    proc = f"/proc/self/fd/{fd}"
    if registry.format_for(fspath) is registry.SAFETENSORS:
        return load_safetensors(proc, handles.handle_for(cfg, read=True), registry.safetensors_device(map_location),
                                checksum=cfg.checksum)
    return local_load(proc)
