"""Steps 1 and 2 of a collective save (:mod:`fastpersist.collectivesave`): plan the file,
agree on the target, the plan and the tensor values, find which ranks share the target.

1. **Plan and agree.** Each rank plans the file (:mod:`fastpersist.formats`) and
   hashes the plan: sizes, offsets, record names, patches, and every byte that is
   not tensor payload (zip headers, the pickle, the central directory, the
   safetensors header); see :func:`fastpersist.formats.split.plan_digest`. It also
   computes the CRC-32 of every tensor's bytes (one read pass over the state, on the
   native handle's threads: about 0.2 s per GiB on the 2-vCPU reference VM; CUDA
   storages were already staged to host memory by the planner) and hashes that list.
   The ranks exchange both hashes and the resolved target path. If the plans differ,
   the ranks exchange per-record hashes and every rank raises
   :class:`~fastpersist.errors.ReplicasDifferError` naming the first record that differs; if only the
   tensor values differ, they exchange the per-tensor CRCs and every rank raises
   :class:`~fastpersist.errors.ReplicasDifferError` naming the first tensor that differs (its key path
   in the object, e.g. ``['model']['w']``): a collective save writes one rank's
   state or nothing, never a blend. Either way before any byte is written. The
   agreed CRCs are the records' CRC fields (no partial CRCs to compute when writing).
2. **Who shares the target.** Rank 0 creates a probe file named after its process
   (``.fastpersist-probe-PID-HOST-START-RANDOM``; probes whose creator has exited are
   removed first, and by every rank when a save fails, see
   :func:`clean_stale_probes`) with random content next to the target; the other
   ranks look for it. Ranks that see it must have passed the same path, else every
   rank raises :class:`~fastpersist.errors.DistributedCheckpointError` naming each rank's path. The ranks that see it
   write one file together. The others are grouped by host name; the lowest rank
   of each host creates its own probe and the host's ranks that see it write one
   complete copy together on that filesystem (node-local disks); a rank that sees
   no probe at all writes a copy alone. The outcome is logged (``DEBUG`` when shared, ``INFO`` otherwise).

The replica checks (:func:`value_crcs`, :func:`values_digest`, :func:`slot_crcs`,
:func:`first_value_difference`) serve the collective save to object storage
(:mod:`fastpersist.s3collective`) too, which agrees on its plan and values the same way.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import socket
import struct
import time
from typing import Any, Optional, Sequence

import torch

from fastpersist import _native, _sys, commit, handles
from fastpersist.commit import FOREIGN_TMP_GRACE_S
from fastpersist.coordinator import Coordinator, Local
from fastpersist.errors import DistributedCheckpointError, ReplicasDifferError, UnsupportedLayoutError
from fastpersist.formats import registry, split

log = logging.getLogger(__name__)

#: Save slices start on page boundaries (and on the O_DIRECT alignment, when larger): the
#: CRC-field blocks a rank writes through the page cache never share a page with another rank.
PAGE = 4096

_PROBE_PREFIX = ".fastpersist-probe-"


#: ``.fastpersist-probe-PID-HOST-START-RANDOM`` (the creator's identity, as in ``commit.temp_path_for``)
#: and ``.fastpersist-probe-RANDOM`` (earlier releases)
_PROBE_RE = re.compile(
    r"\.fastpersist-probe-(?:(?P<pid>[0-9]{1,10})-(?P<host>[0-9a-f]{10})-(?P<start>[0-9a-f]{1,16})-)?[0-9a-f]{16}")


def clean_stale_probes(directory: str, *, grace: Optional[float] = None) -> list[str]:
    """Remove probe files (see :func:`_make_probe`) left in ``directory`` by collective saves
    that can no longer finish: their creator has exited (same host and pid namespace,
    checked by pid and start time as for temporary files, ``commit.classify``), or, when
    that cannot be told (another machine, an earlier release), the probe has not been
    modified for ``grace`` seconds (default ``commit.FOREIGN_TMP_GRACE_S``). A probe of a
    live save is never removed. Never raises; returns the paths removed."""
    grace = FOREIGN_TMP_GRACE_S if grace is None else grace
    removed: list[str] = []
    now = time.time()
    try:
        entries = list(os.scandir(directory))
    except OSError as e:
        log.debug("cannot scan %s for leftover probe files: %s", directory, e)
        return removed
    for entry in entries:
        m = _PROBE_RE.fullmatch(entry.name)
        if m is None:
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            st = entry.stat(follow_symlinks=False)
            pid = int(m["pid"]) if m["pid"] else 0
            _state, removable, reason = commit.classify(pid, m["host"], m["start"], st, now, grace)
            if not removable:
                continue
            os.unlink(entry.path)
        except FileNotFoundError:
            continue
        except Exception as e:  # noqa: BLE001 - cleanup must never fail a save
            log.debug("cannot remove leftover probe file %s: %s", entry.path, e)
            continue
        log.debug("removed leftover probe file %s: %s", entry.path, reason)
        removed.append(entry.path)
    return removed


def _make_probe(directory: str) -> tuple[str, str]:
    clean_stale_probes(directory)
    host, start = commit.process_identity()
    name = f"{_PROBE_PREFIX}{os.getpid()}-{host}-{start}-{secrets.token_hex(8)}"
    token = secrets.token_hex(16)
    path = os.path.join(directory, name)
    fd = _sys.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    return name, token


def _probe_visible(directory: str, probe: Optional[tuple[str, str]]) -> bool:
    """Whether the probe file another rank created is visible here with its content."""
    if probe is None:
        return False
    try:
        with open(os.path.join(directory, probe[0]), "rb") as f:
            return f.read(256) == probe[1].encode()
    except OSError:
        return False


def remove_temp(path: Optional[str]) -> None:
    if not path:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:  # pragma: no cover - best effort
        log.warning("could not remove %s: %s", path, e)


def _write_groups(co: Coordinator, directory: Optional[str], hosts: list[str], probe0: Optional[tuple[str, str]],
                  loc: Local) -> list[list[int]]:
    """Partition the ranks into groups that each write one complete copy (see module docstring)."""
    seen = False
    if co.rank == 0:
        seen = probe0 is not None
    elif directory is not None:
        seen = _probe_visible(directory, probe0)
    visible = co.gather("probe", (loc.status, seen))
    if co.rank == 0 and probe0 is not None and directory is not None:
        remove_temp(os.path.join(directory, probe0[0]))
    co.check("probe", [v[0] for v in visible], local=loc.exc)
    shared = [r for r in range(co.size) if visible[r][1]]
    if len(shared) == co.size:
        return [shared]
    rest = [r for r in range(co.size) if not visible[r][1]]
    leaders = {}
    for r in rest:
        leaders.setdefault(hosts[r], r)
    probe = None
    if co.rank in rest and leaders[hosts[co.rank]] == co.rank and directory is not None:
        probe = loc.run(lambda: _make_probe(directory))
    try:
        probes = co.gather("probe-node", (loc.status, probe))
        co.check("probe-node", [v[0] for v in probes], local=loc.exc)
        mine = False
        if co.rank in rest and directory is not None:
            lead = leaders[hosts[co.rank]]
            mine = lead == co.rank or _probe_visible(directory, probes[lead][1])
        seen2 = co.gather("probe-node-seen", mine)
    finally:  # also when a rank died meanwhile: no probe outlives the save
        if probe is not None and directory is not None:
            remove_temp(os.path.join(directory, probe[0]))
    groups = [shared] if shared else []
    by_leader: dict[int, list[int]] = {}
    for r in rest:
        lead = leaders[hosts[r]]
        if r != lead and not seen2[r]:
            groups.append([r])
        else:
            by_leader.setdefault(lead, []).append(r)
    groups.extend(by_leader.values())
    groups.sort()
    return groups


def _plan(obj: Any, final: str, fmt: str, cfg: Any) -> tuple[Optional[split.Layout], int]:
    align = handles.alignment_for(os.path.dirname(final))
    plan = registry.FORMATS[fmt].plan
    assert plan is not None
    try:
        return split.Layout(plan(obj, align, cfg, target=final), fmt), align
    except UnsupportedLayoutError as e:  # torch's format only
        log.debug("fast torch layout not possible for %s (%s): group leaders write with torch's writer", final, e)
        return None, align


class Agreed:
    """What every rank of a collective save agreed on (see :func:`agree`)."""

    def __init__(self, final: str, directory: str, fmt: str, layout: Optional[split.Layout], align: int,
                 groups: list[list[int]], mygroup: list[int], fallback: bool,
                 hosts: Optional[list[str]] = None) -> None:
        self.final = final
        self.directory = directory
        self.fmt = fmt
        self.layout = layout
        self.align = align
        self.groups = groups
        self.mygroup = mygroup
        self.leader = mygroup[0]
        self.fallback = fallback
        #: every rank's host name (``socket.gethostname()``)
        self.hosts = hosts or []
        #: every CRC slot's CRC-32, from the value check every rank agreed on (None: not computed)
        self.slot_crcs: Optional[list[int]] = None

    def leader_fsync_covers(self, rank: int) -> bool:
        """Whether the group leader's fsync of the file after the write exchange makes
        ``rank``'s writes durable too: ranks on the leader's host share its kernel, so its
        fsync of the inode commits their O_DIRECT writes' allocations and flushes the same
        device cache. A rank on another host (a network filesystem) fsyncs its own writes."""
        return bool(self.hosts) and self.hosts[rank] == self.hosts[self.leader]

    def bounds(self, rank: int) -> tuple[int, int]:
        """This rank's slice ``[lo, hi)`` of the file within its write group."""
        assert self.layout is not None
        return split.slice_bounds(self.layout.plan.file_size, len(self.mygroup), max(self.align, PAGE))[
            self.mygroup.index(rank)]

def agree(co: Coordinator, obj: Any, path: Any, cfg: Any, format: Optional[str], loc: "Local") -> Agreed:
    """Steps 1 and 2 of the module docstring: plan, agree on the target, the plan and the
    tensor values, find who shares the target. Raises on every rank (nothing written)
    when a rank failed, the targets differ or the states differ.
    ``loc`` may already hold an error of the caller's (reported at the plan step)."""
    final = loc.run(lambda: commit.resolve_target(path))
    directory = os.path.dirname(final) if final else None
    fmt = loc.run(lambda: registry.format_for(final, format).name) if final else None
    planned = loc.run(lambda: _plan(obj, final, fmt, cfg)) if fmt else None
    layout, align = planned if planned else (None, 0)
    digest = loc.run(lambda: split.plan_digest(layout)) if layout is not None else None
    values = loc.run(lambda: value_crcs(layout, cfg)) if layout is not None else None
    vdigest = values_digest(values) if values is not None else None
    probe0 = loc.run(lambda: _make_probe(directory)) if co.rank == 0 and directory else None
    try:
        info = co.gather("plan", (loc.status, planned is not None and layout is None, digest, align,
                                  socket.gethostname(), probe0, final, vdigest))
        co.check("plan", [v[0] for v in info], local=loc.exc, after="Nothing was written")
        probe0 = info[0][5]
        fallback = [v[1] for v in info]
        if any(fallback) and not all(fallback):
            bad = [co.name(r) for r, f in enumerate(fallback) if f]
            why = (f"{', '.join(bad)} cannot lay the object out for a split write (torch's writer needed) "
                   "and the others can")
            digests_differ = True
        else:
            why = ""
            digests_differ = len({v[2] for v in info}) > 1 or len({v[3] for v in info}) > 1
        if digests_differ:
            records = co.gather("plan-records", split.plan_records(layout) if layout is not None else [])
            aligns = {v[3] for v in info}
            if not why and len(aligns) > 1:
                why = "the O_DIRECT alignments of the target differ: " + ", ".join(
                    f"{co.name(r)}: {v[3]}" for r, v in enumerate(info))
            if not why:
                why = split.first_difference(records) or "the plans' digests differ"
            raise ReplicasDifferError(
                f"{co.what}: the ranks do not hold the same state, nothing was written: {why}. A replicated save "
                "needs every rank to pass the same object (same keys, shapes, dtypes and Python values)", why)
        if len({v[7] for v in info}) > 1:
            every = co.gather("values", values)
            why = first_value_difference(co, obj, layout, every)
            raise ReplicasDifferError(
                f"{co.what}: the ranks hold the same layout but different tensor values, nothing was written: "
                f"{why}. A replicated save writes one state; make the replicas equal (e.g. broadcast from rank 0) "
                "or save from one rank without group=", why)

        groups = _write_groups(co, directory, [v[4] for v in info], probe0, loc)
        _check_targets(co, [v[6] for v in info], groups)
    except BaseException:
        if directory:  # the probe of a rank that died creating it (the others' are theirs to remove)
            clean_stale_probes(directory)
        raise
    finally:
        if co.rank == 0 and probe0 is not None and directory:
            remove_temp(os.path.join(directory, probe0[0]))
    mygroup = next(g for g in groups if co.rank in g)
    if co.rank == 0:
        if len(groups) == 1:
            log.debug("%s: all ranks see the target directory (shared filesystem): one file, %d slices",
                     co.what, co.size)
        else:
            log.info("%s: the ranks do not share the target directory; one complete copy per group: %s",
                     co.what, groups)
    assert final is not None and directory is not None and fmt is not None
    agreed = Agreed(final, directory, fmt, layout, align, groups, mygroup, all(fallback), [v[4] for v in info])
    if layout is not None and values is not None:
        agreed.slot_crcs = slot_crcs(layout, values)
    return agreed


def _check_targets(co: Coordinator, finals: list[Optional[str]], groups: list[list[int]]) -> None:
    """The ranks that write one file together (they see one directory: :func:`_write_groups`)
    must have passed the same path: raise on every rank, naming each rank's path, if not.
    Ranks that do not see each other's directory (node-local disks) each write a complete
    copy to the path they passed."""
    bad = [g for g in groups if len({finals[r] for r in g}) > 1]
    if not bad:
        return
    paths = "; ".join(f"{co.name(r)}: {finals[r]!r}" for g in bad for r in g)
    raise DistributedCheckpointError(
        f"{co.what}: ranks that share the target directory passed different paths, nothing was written ({paths}). "
        "A collective save writes one file that every rank passes; save without group= to write one file per rank",
        {r: f"path {finals[r]!r}" for g in bad for r in g if finals[r] != finals[g[0]]})


def _payload_ranges(layout: split.Layout) -> list[tuple[int, int, int]]:
    """``(index, ptr, length)`` of every payload extent (tensor bytes) of the plan with bytes."""
    return [(i, e[1], e[2]) for i, e in enumerate(layout.plan.extents) if layout.is_payload(i, e) and e[2] > 0]


def value_crcs(layout: split.Layout, cfg: Any) -> list[int]:
    """CRC-32 of every payload extent (:func:`_payload_ranges` order): one read pass over the
    tensor bytes this rank would write, on the native handle's threads. The plan holds host
    addresses only (CUDA storages were staged to host memory when it was planned: ``_plan`` calls
    ``plan_torch`` without device sources), so the CRC covers exactly the bytes any rank
    would write and costs no device-to-host copy of its own."""

    ranges = [(ptr, n) for _i, ptr, n in _payload_ranges(layout)]
    if not ranges:
        return []
    return list(handles.handle_for(cfg).crc32_ranges(ranges))


def values_digest(crcs: Sequence[int]) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(struct.pack(f"<{len(crcs)}I", *crcs))
    return h.hexdigest()


def slot_crcs(layout: split.Layout, values: Sequence[int]) -> list[int]:
    """Every CRC slot's CRC-32, folded from the per-extent CRCs of :func:`value_crcs` (the
    same bytes the slices' partial CRCs cover: the ranks agreed on them)."""
    plan = layout.plan
    per = {i: c for (i, _p, _n), c in zip(_payload_ranges(layout), values)}
    crcs: list[Optional[int]] = [None] * plan.nslots
    for i, (_off, ptr, n, slot) in enumerate(plan.extents):
        if slot < 0 or n == 0:
            continue
        c = per[i] if i in per else _native.crc32(ptr, n)
        crcs[slot] = c if crcs[slot] is None else _native.crc32_combine(crcs[slot], c, n)
    return [0 if c is None else c for c in crcs]


def _tensor_paths(obj: Any, limit: int = 100000) -> list[tuple[str, int, int]]:
    """``(key path, storage host address, storage bytes)`` of the CPU tensors in ``obj``
    (dicts, lists, tuples, objects' ``__dict__``), in walk order."""
    out: list[tuple[str, int, int]] = []
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack and len(out) < limit:
        where, o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            try:
                st = o.untyped_storage()
                if st.device.type == "cpu":
                    out.append((where or "<the object>", st.data_ptr(), st.nbytes()))
            except Exception:  # noqa: BLE001 - a tensor subclass without storage: no name
                pass
            continue
        if isinstance(o, dict):
            items = [(f"{where}[{k!r}]", v) for k, v in o.items()]
        elif isinstance(o, (list, tuple)):
            items = [(f"{where}[{k}]", v) for k, v in enumerate(o)]
        elif hasattr(o, "__dict__") and not isinstance(o, type):
            items = [(f"{where}.{k}", v) for k, v in vars(o).items()]
        else:
            continue
        stack.extend(reversed(items))
    return out


def first_value_difference(co: Coordinator, obj: Any, layout: split.Layout, every: list[Any]) -> str:
    """Name the first payload extent (file order) whose CRC differs between ranks: the
    tensor's key path in ``obj`` when it can be told, else the file record."""
    ranges = _payload_ranges(layout)
    plan = layout.plan
    for k, (i, ptr, n) in enumerate(ranges):
        got = [v[k] if v is not None and k < len(v) else None for v in every]
        if all(g == got[0] for g in got):
            continue
        off, _p, _n, slot = plan.extents[i]
        record = plan.slot_names[slot] if 0 <= slot < len(plan.slot_names) else f"bytes at offset {off}"
        ranks = {}
        for r, g in enumerate(got):
            ranks.setdefault(g, []).append(co.name(r))
        groups = " / ".join(", ".join(v) for v in ranks.values())
        names = [p for p, sptr, sn in _tensor_paths(obj) if sptr <= ptr < sptr + max(sn, 1)]
        tensor = f"tensor {names[0]}" + (f" (and {len(names) - 1} view(s) of its storage)" if len(names) > 1 else "")
        if not names:
            tensor = "a tensor"
        return f"{tensor} (file record {record!r}, {n} bytes) differs between {groups}"
    return "the tensor values' digests differ"
