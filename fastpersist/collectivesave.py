"""Collective saves of replicated state over a ``torch.distributed`` group.

``fastpersist.save(obj, path, group=g)`` is called by every rank of the process group
``g`` (gloo, NCCL, or both), each rank holding the same object (data-parallel replicas).
One ordinary checkpoint file comes out, byte-identical to what ``fastpersist.save(obj,
path)`` writes in one process, written by all ranks together. ``group=None`` never
reaches this module.

How a collective save runs (every step ends with an exchange of each rank's
status over the group (:mod:`fastpersist.coordinator`); any error stops every rank at that step):

1. **Plan and agree**, 2. **who shares the target**: :mod:`fastpersist.collectiveplan`.
3. **Slices.** Each write group cuts the file into contiguous slices, one per
   member, every boundary a multiple of the page size and of the O_DIRECT
   alignment (:func:`~fastpersist.formats.split.slice_bounds`). The group leader creates the
   temporary file (stale temporaries of killed saves are cleaned first),
   preallocates it to the final size and sends its name to the group.
4. **Write and CRCs, overlapped.** Each rank starts the aligned O_DIRECT write of
   its whole slice into the shared temporary file (opened without truncation), the
   CRC fields (data descriptors, central directory entries, safetensors metadata)
   still holding the plan's placeholders. The records' CRCs are those agreed in
   step 1 (``save_async(group=)`` computes the partial CRC-32 of every record inside
   its slice while copying it, and the ranks combine them with zlib's
   ``crc32_combine``); the ranks exchange their status. Once its
   bulk write is done, each rank writes the page-aligned blocks of its slice that
   hold CRC fields (:func:`~fastpersist.formats.split.patch_blocks`) again, with
   the fields filled, through the page cache.
   A rank on another host than its group leader (a network filesystem) then fsyncs
   its writes; the leader's host needs one fsync, the leader's own in step 5, which
   runs after every rank reported its writes complete and commits them all (same
   kernel, same inode, same device cache). "Same host" is checked three ways: the
   host name, the kernel's boot id (``/proc/sys/kernel/random/boot_id``) and the
   temporary file's ``st_dev``/``st_ino`` as the rank sees it, all equal to the
   leader's; if any differs or is unknown, the rank fsyncs its own writes.
5. **Commit.** Only when every rank reported success does each group leader fsync
   the file, rename it over the target and fsync the directory. If any rank
   failed (exception, I/O error such as ENOSPC, injected fault), every rank
   raises :class:`~fastpersist.errors.DistributedCheckpointError` naming the failing rank(s) and
   their errors, the temporary files are removed, and the previous checkpoint
   stays untouched (:mod:`fastpersist.collectivecommit`).

The exchanges' timeouts and the verdict on ranks that died: :mod:`fastpersist.coordinator`.
The temporary file of a rank that died is removed by the survivors (or by the next save's
stale-file cleanup).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Optional, Sequence

import torch.distributed as dist

from fastpersist import _sys, handles, pending, pipeline
from fastpersist import config as config_mod
from fastpersist._inputs import is_path
# commit's functions are called through the module (``commit.resolve_target(...)``): fault
# injection and tests replace them there, and the collective save must see that
from fastpersist import commit
from fastpersist.collectivecommit import commit_agreed, create_temp, save_fallback
from fastpersist.collectiveplan import PAGE, agree, remove_temp
from fastpersist.coordinator import Coordinator, Local, check_group, collective
from fastpersist.formats import split


__all__ = ["save", "last_save_phases"]


def save(obj: Any, path: Any, *, group: Any, config: Any = None, format: Optional[str] = None) -> None:
    """Collective :func:`fastpersist.save`: every rank of ``group`` calls it with the same
    object; see the module docstring. ``group`` is a process group (``dist.group.WORLD``
    for all ranks)."""

    check_group(group)
    cfg = config_mod.resolve(config)
    if dist.get_world_size(group) == 1:
        pipeline.save(obj, path, config=cfg, format=format)
        return
    if not is_path(path):
        raise TypeError(f"fastpersist.save writes to a file path (str or os.PathLike), got {type(path).__name__}")
    with collective("save", path, group, cfg.dist_timeout, _last_save_phases) as co:
        _save(co, obj, path, cfg, format)


_last_save_phases: list[tuple[str, float, float]] = []


def last_save_phases() -> list[tuple[str, float, float]]:
    """Where this rank's last collective save (``save(..., group=...)``) spent its time:
    ``(step, seconds of local work before the step's exchange, seconds in the exchange)``
    per exchange (``plan``: planning and digest; ``probe``: shared-filesystem detection;
    ``crc``: temporary file and partial CRCs; ``write``: this rank's slice; ``commit``: the
    leader's fsync, rename and directory fsync), then ``("end", seconds after the last
    exchange, 0)``. Waiting in an exchange is waiting for the slowest rank. For benchmarks."""
    return list(_last_save_phases)



def _save(co: Coordinator, obj: Any, path: Any, cfg: Any, format: Optional[str]) -> None:

    loc = Local()
    # This rank's pending async saves to the file finish first (and an uncollected async
    # error fails every rank at the plan step, before anything is written).
    loc.run(lambda: pending.before_blocking_save(commit.resolve_target(path)))
    agreed = agree(co, obj, path, cfg, format, loc)
    final, directory, layout, align = agreed.final, agreed.directory, agreed.layout, agreed.align
    groups, mygroup = agreed.groups, agreed.mygroup
    leader = agreed.leader == co.rank
    fmt = agreed.fmt

    if agreed.fallback:
        save_fallback(co, obj, final, cfg, fmt, leader, loc)
        return

    assert layout is not None and final is not None
    plan = layout.plan
    lo, hi = split.slice_bounds(plan.file_size, len(mygroup), max(align, PAGE))[mygroup.index(co.rank)]
    extents = split.clip(plan.extents, lo, hi)
    handle = handles.handle_for(cfg)
    tmp: Optional[str] = None

    ident: Optional[tuple[str, int, int]] = None
    if leader:
        tmp = loc.run(lambda: create_temp(final, plan.file_size))
        ident = loc.run(lambda: _file_identity(tmp)) if tmp else None
    temps: list[Optional[str]] = []
    bulk: Any = None  # the write of the slice's CRC-free blocks, in flight while the CRCs are exchanged
    try:
        made = co.gather("tmp", (loc.status, tmp, ident))
        temps = [made[g[0]][1] for g in groups]
        tmp = made[mygroup[0]][1]
        co.check("tmp", [v[0] for v in made], local=loc.exc, after="Nothing was written under the final name")

        # The whole slice goes to the disk now, its CRC fields still holding the plan's
        # placeholders; the partial CRCs are computed from memory meanwhile, on this thread
        # (the handle's threads are writing), and exchanged. Once the bulk write is done,
        # the page-aligned blocks that hold CRC fields are written again with the fields
        # filled, through the page cache (a few KiB per record; O_DIRECT would cost a
        # device round trip each), and the leader's fsync (or this rank's own) flushes them.
        held = split.patch_blocks(plan.patches, lo, hi, PAGE)
        body = [(off, ptr, n, -1) for off, ptr, n, _slot in extents]
        if body:
            bulk = loc.run(lambda: handle.write_async(tmp, body, [], 0, truncate=False, fsync=False))
        # The value check of the plan step computed every record's CRC on every rank and the
        # ranks agreed on them: no partial CRCs to compute here.
        known = agreed.slot_crcs
        partial = loc.run(lambda: split.partial_crcs(None, extents)) if known is None else None
        crcinfo = co.gather("crc", (loc.status, partial))
        co.check("crc", [v[0] for v in crcinfo], local=loc.exc, after="Nothing was written under the final name")
        crcs = known if known is not None else split.combine_crcs([crcinfo[r][1] for r in mygroup], plan.nslots)

        # One fsync per host, not per rank: the leader fsyncs the file after every rank wrote
        # (commit_agreed), which covers the ranks of its own host.
        # Same host name is not proof enough (two machines may share one): the rank must also
        # run under the leader's kernel (boot id) and see the leader's inode (st_dev, st_ino).
        own_fsync = cfg.fsync and not (
            agreed.leader_fsync_covers(co.rank) and (leader or _same_inode(tmp, made[mygroup[0]][2])))

        def write() -> None:
            assert tmp is not None
            if bulk is not None:  # before the blocks it wrote are written again
                pipeline.naming_final(final, lambda t: bulk.result())(tmp)
            pieces = [e for a, b in held for e in split.clip(extents, a, b)]
            ext, keep = split.apply_patches(pieces, plan.patches, crcs, lo, hi)
            pipeline.naming_final(final, lambda t: _pwrite_runs(t, ext, own_fsync))(tmp)
            del keep

        loc.run(write)
        bulk = None
        wrote = co.gather("write", loc.status)
        co.check("write", wrote, local=loc.exc,
                 after="The temporary files were removed; the previous file at the path is untouched")

        commit_agreed(co, agreed, tmp, cfg, loc)  # a renamed temporary name no longer exists: removing it is harmless
        temps = []
        del extents, plan, layout
    except BaseException:
        if bulk is not None:  # it reads the caller's tensors: never return while it runs
            try:
                bulk.wait()
            except BaseException:  # noqa: BLE001 - the failure being raised says more
                pass
        for t in temps:
            remove_temp(t)
        if leader and not temps:  # the exchange of the names failed (a rank died): this leader's own file
            remove_temp(tmp)
        raise


def _pwrite_runs(path: str, extents: Sequence[split.Extent], fsync: bool) -> None:
    """Write ``extents`` (sorted, maybe with gaps) into ``path`` through the page cache, one
    ``pwrite`` per contiguous run; fsync the file after when ``fsync``. An OSError names
    the offset (callers add which save it was, see ``pipeline.naming_final``)."""
    if not extents and not fsync:
        return
    fd = _sys.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        k = 0
        while k < len(extents):
            start = extents[k][0]
            parts = []
            end = start
            while k < len(extents) and extents[k][0] == end:
                parts.append(ctypes.string_at(extents[k][1], extents[k][2]))
                end += extents[k][2]
                k += 1
            data = memoryview(b"".join(parts))
            done = 0
            while done < len(data):
                try:
                    done += _sys.pwrite(fd, data[done:], start + done)
                except OSError as e:
                    raise type(e)(e.errno, f"{e.strerror}: writing CRC fields at offset {start + done} of {path!r}",
                                  path) from e
        if fsync:
            _sys.fsync(fd, path)
    finally:
        os.close(fd)


def _boot_id() -> str:
    """The running kernel's boot id ('' when unknown): two processes see the same one only
    under the same kernel (same page cache, same inodes)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def _file_identity(path: str) -> tuple[str, int, int]:
    """(boot id, st_dev, st_ino) of ``path`` as this process sees it."""
    st = os.stat(path)
    return _boot_id(), st.st_dev, st.st_ino


def _same_inode(tmp: Optional[str], leader_ident: Optional[Sequence[Any]]) -> bool:
    """Whether this process sees ``tmp`` as the very inode the leader created, under the
    leader's kernel: then the leader's fsync of it covers this rank's writes. False when
    anything is unknown (the rank fsyncs its own writes: always safe)."""
    if not tmp or not leader_ident or not leader_ident[0]:
        return False
    try:
        return _file_identity(tmp) == tuple(leader_ident)
    except OSError:
        return False
