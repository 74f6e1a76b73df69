"""Collective saves and loads of replicated state over a ``torch.distributed`` group.

``fastpersist.save(obj, path, group=g)`` and ``fastpersist.load(path, group=g)`` are
called by every rank of the process group ``g`` (gloo, NCCL, or both), each rank
holding the same object (data-parallel replicas). One ordinary checkpoint file
comes out, byte-identical to what ``fastpersist.save(obj, path)`` writes in one
process, written by all ranks together. ``group=None`` never reaches this module.

How a collective save runs (every step ends with an exchange of each rank's
status over the group; any error stops every rank at that step):

1. **Plan and agree.** Each rank plans the file (:mod:`fastpersist.formats`) and
   hashes the plan: sizes, offsets, record names, patches, and every byte that is
   not tensor payload (zip headers, the pickle, the central directory, the
   safetensors header); see :func:`fastpersist.formats.split.plan_digest`. It also
   computes the CRC-32 of every tensor's bytes (one read pass over the state, on the
   native handle's threads: about 0.2 s per GiB on the 2-vCPU reference VM; CUDA
   storages were already staged to host memory by the planner) and hashes that list.
   The ranks exchange both hashes and the resolved target path. If the plans differ,
   the ranks exchange per-record hashes and every rank raises
   :class:`ReplicasDifferError` naming the first record that differs; if only the
   tensor values differ, they exchange the per-tensor CRCs and every rank raises
   :class:`ReplicasDifferError` naming the first tensor that differs (its key path
   in the object, e.g. ``['model']['w']``): a collective save writes one rank's
   state or nothing, never a blend. Either way before any byte is written. The
   agreed CRCs are the records' CRC fields (no partial CRCs to compute in step 4).
2. **Who shares the target.** Rank 0 creates a probe file named after its process
   (``.fastpersist-probe-PID-HOST-START-RANDOM``; probes whose creator has exited are
   removed first, and by every rank when a save fails, see
   :func:`clean_stale_probes`) with random content next to the target; the other
   ranks look for it. Ranks that see it must have passed the same path, else every
   rank raises :class:`DistributedCheckpointError` naming each rank's path. The ranks that see it
   write one file together. The others are grouped by host name; the lowest rank
   of each host creates its own probe and the host's ranks that see it write one
   complete copy together on that filesystem (node-local disks); a rank that sees
   no probe at all writes a copy alone. The outcome is logged (``DEBUG`` when shared, ``INFO`` otherwise).
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
   raises :class:`DistributedCheckpointError` naming the failing rank(s) and
   their errors, the temporary files are removed, and the previous checkpoint
   stays untouched.

Timeouts: the exchanges run on a gloo group of the same ranks created with
``Config.dist_timeout`` (``FASTPERSIST_DIST_TIMEOUT``, default 600 s); its creation
(the first collective save or load on a group) is guarded like an exchange, so a
rank that died before the save or never calls it is named too. Before each
exchange a rank leaves an arrival mark in the process group's rendezvous store; when
an exchange fails (a peer's connection closed, or the timeout passed), the rank
waits for the marks until the timeout and raises :class:`DistributedTimeoutError`
naming the ranks that never arrived. The temporary file of a rank that died is
removed by the survivors (or by the next save's stale-file cleanup).

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

import atexit
import ctypes
import hashlib
import logging
import mmap as _mmap
import os
import pickle
import re
import secrets
import socket
import struct
import time
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from fastpersist import _compat, _native, _sys, handles, pending, pipeline
from fastpersist import config as config_mod
from fastpersist import io as fpio
from fastpersist._inputs import is_path
from fastpersist._sys import pread_full
# commit's functions are called through the module (``commit.fsync_path(...)``): fault
# injection and tests replace them there, and the collective save must see that
from fastpersist import commit
from fastpersist.commit import FOREIGN_TMP_GRACE_S, UNKNOWN_HOST
from fastpersist.errors import FastPersistError, UnsupportedLayoutError
from fastpersist.formats import registry, split
from fastpersist.formats.safetensors import load_safetensors

log = logging.getLogger(__name__)

#: Save slices start on page boundaries (and on the O_DIRECT alignment, when larger): the
#: CRC-field blocks a rank writes through the page cache never share a page with another rank.
_PAGE = 4096

__all__ = ["DistributedCheckpointError", "DistributedTimeoutError", "ReplicasDifferError", "save", "load"]

_PROBE_PREFIX = ".fastpersist-probe-"
_HASH_SPAN = 64 << 10


class DistributedCheckpointError(FastPersistError, RuntimeError):
    """A collective save or load failed on some rank; raised on every rank.

    ``failures`` maps each failing rank (rank in the group) to its error, in words.
    On the failing rank itself the original exception is the ``__cause__``.
    """

    def __init__(self, message: str, failures: Optional[dict[int, str]] = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})


class ReplicasDifferError(DistributedCheckpointError):
    """The ranks of a collective save do not hold the same state (layout, Python values or
    tensor values); raised on every rank before anything is written under the final name.
    ``difference`` names the first difference in words (the tensor's key path in the
    state, or the file record, and the ranks). A framework adapter catching it lets its
    designated rank write its own state alone (``fastpersist/replicated.py``)."""

    def __init__(self, message: str, difference: str = "") -> None:
        super().__init__(message)
        self.difference = difference


class DistributedTimeoutError(DistributedCheckpointError, TimeoutError):
    """Some ranks did not reach a step of a collective save/load in time (died or hung);
    ``missing`` lists them (ranks in the group)."""

    def __init__(self, message: str, missing: Sequence[int]) -> None:
        super().__init__(message)
        self.missing = list(missing)


# --------------------------------------------------------------------------- coordination

_side_groups: dict[tuple, Any] = {}


def _drop_side_groups() -> None:
    """At exit, drop this module's references to its gloo side groups while the interpreter
    still runs, so that they are freed (their threads joined) then and not during interpreter
    finalization, where a freed gloo group can abort the process with "terminate called
    without an active exception" even after the user's ``destroy_process_group()`` (README's
    multi-rank example did, once, in CI)."""
    _side_groups.clear()


atexit.register(_drop_side_groups)
_op_counters: dict[tuple, int] = {}
_stale_marks: dict[tuple, list[str]] = {}
_announced: set[tuple] = set()

#: After a verdict on missing ranks, how long (at most, past the timeout) a survivor
#: waits for the other survivors to read it before raising (see :meth:`Coordinator._linger`).
VERDICT_GRACE_S = 10.0


def _default_store() -> Any:
    """The default process group's rendezvous store, or None (see ``_compat.default_store``)."""
    return _compat.default_store()


def check_group(group: Any) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "group= needs an initialized torch.distributed process group (torch.distributed.init_process_group); "
            "call fastpersist.save/load without group= in a single process"
        )
    if group is not None and dist.get_rank(group) < 0:
        raise RuntimeError("this process is not a member of the group passed as group=")


def _my_identity() -> str:
    """``HOST|PID|START`` of this process (see ``commit.identity``): lets a peer on the
    same host tell for sure that this process has exited."""
    host, start = commit.process_identity()
    return f"{host}|{os.getpid()}|{start}"


def _provably_dead(identity: Optional[str]) -> bool:
    """Whether the process ``identity`` names is known to have exited (same host and pid
    namespace only; anything else is "not known")."""
    if not identity:
        return False
    try:
        host, pid_s, start = identity.split("|")
        pid = int(pid_s)
    except ValueError:
        return False
    mine = commit.process_identity()[0]
    if host != mine or mine == UNKNOWN_HOST or start in ("", "0") or pid == os.getpid():
        return False
    fields = commit.stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return True
    try:
        return format(int(fields[19]), "x") != start
    except (ValueError, IndexError):  # pragma: no cover - malformed /proc
        return False


class Coordinator:
    """Status exchanges of one collective operation, with a timeout and a verdict on missing ranks.

    :meth:`gather` runs over a gloo side group of the same ranks (created once per
    group and timeout, used only from the caller's thread). :class:`StoreCoordinator`
    exchanges through the rendezvous store instead (background threads).

    When an exchange fails, :meth:`_lost` decides which ranks are missing: those
    without an arrival mark for the step by the deadline, or whose process is known to
    have exited (a peer on the same host; then no need to wait for the deadline). The
    first rank to decide publishes its verdict in the store (``compare_set``: the
    first one wins) and every other survivor adopts it, so every surviving rank
    raises the same error naming the same ranks. Survivors then wait (at most
    :data:`VERDICT_GRACE_S` past the deadline) until every survivor has read the
    verdict: the process hosting the store (rank 0, usually) must not leave before
    the others have read it. Without a store (or with the store gone) each rank
    raises its own local verdict.
    """

    kind = "side group"

    def __init__(self, group: Any, timeout: float, what: str) -> None:
        self.group = group
        self.what = what
        self.timeout = float(timeout)
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.global_ranks = list(dist.get_process_group_ranks(group))
        world = dist.group.WORLD
        gkey = (id(world), tuple(self.global_ranks))
        self.gkey = gkey
        self._ns = self._namespace()
        count = _op_counters.get(gkey + (self._ns,), 0) + 1
        _op_counters[gkey + (self._ns,)] = count
        self.tag = hashlib.blake2b(repr(self.global_ranks).encode(), digest_size=6).hexdigest()
        self.prefix = f"fastpersist/{self.tag}/{self._ns}{count}"
        self.store = _default_store()
        self._marks: list[str] = []
        self.started = time.monotonic()
        self.trace: list[tuple[str, float, float]] = []  # (step, arrived, left) per exchange
        self._first = True
        self._who: dict[int, Optional[str]] = {}
        self._announce(world)
        # Creating the side group (first operation on this group and timeout) waits for every
        # rank in the store: a rank that died or never calls must be named, not surface as
        # torch's raw DistStoreError.
        t0 = self.mark("join")
        try:
            self.side = self._side(world, gkey)
        except Exception as exc:  # noqa: BLE001
            raise self._lost("join", exc, t0) from exc

    def _namespace(self) -> str:
        return ""

    def _side(self, world: Any, gkey: tuple) -> Any:
        skey = gkey + (self.timeout,)
        side = _side_groups.get(skey)
        if side is None or side[0] is not world:
            pg = dist.new_group(
                ranks=self.global_ranks, backend="gloo", timeout=timedelta(seconds=self.timeout),
                use_local_synchronization=True,
            )
            side = _side_groups[skey] = (world, pg)
        return side[1]

    def _announce(self, world: Any) -> None:
        """Leave this process's identity in the store once per group (for :func:`_provably_dead`)."""
        akey = (id(world), self.tag, self.rank, os.getpid())
        if self.store is None or akey in _announced:
            return
        try:
            self.store.set(f"fastpersist/{self.tag}/who/{self.rank}", _my_identity())
            _announced.add(akey)
        except Exception:  # noqa: BLE001 - diagnosis only
            pass

    def name(self, rank: int) -> str:
        g = self.global_ranks[rank]
        return f"rank {rank}" if g == rank else f"rank {rank} (global rank {g})"

    def _key(self, step: str, rank: int) -> str:
        return f"{self.prefix}/{step}/{rank}"

    def gather(self, step: str, value: Any) -> list[Any]:
        """All ranks' ``value`` for ``step``, in rank order; raises :class:`DistributedTimeoutError`
        naming the ranks that did not arrive if the exchange fails."""
        t0 = self.mark(step)
        out: list[Any] = [None] * self.size
        try:
            dist.all_gather_object(out, value, group=self.side)
        except Exception as exc:  # noqa: BLE001
            raise self._lost(step, exc, t0) from exc
        self.trace.append((step, t0, time.monotonic()))
        self._passed_first()
        return out

    def phases(self, end: float) -> list[tuple[str, float, float]]:
        """``(step, local seconds before it, seconds waiting in its exchange)`` for every
        exchange so far, then ``("end", local seconds after the last one, 0)``."""
        out = []
        last = self.started
        for step, arrive, leave in self.trace:
            out.append((step, arrive - last, leave - arrive))
            last = leave
        out.append(("end", end - last, 0.0))
        return out

    def _passed_first(self) -> None:
        if self._first:
            self._first = False
            self._forget_previous()

    def mark(self, step: str, value: bytes = b"1") -> float:
        """Leave this rank's arrival mark for ``step`` in the store; returns the time (for :meth:`_lost`)."""
        t0 = time.monotonic()
        if self.store is not None:
            key = self._key(step, self.rank)
            try:
                self.store.set(key, value)
                self._marks.append(key)
            except Exception:  # noqa: BLE001 - diagnosis only
                pass
        return t0

    def _forget_previous(self) -> None:
        """Delete this rank's keys of the previous operation on this group: every rank has
        now passed the first exchange of this one, so nobody reads them any more."""
        old = _stale_marks.pop(self.gkey + (self._ns,), [])
        for key in old:
            try:
                self.store.delete_key(key)
            except Exception:  # noqa: BLE001
                break

    def finish(self) -> None:
        _stale_marks.setdefault(self.gkey + (self._ns,), []).extend(self._marks)
        self._marks = []

    def _identity_of(self, rank: int) -> Optional[str]:
        if rank not in self._who:
            key = f"fastpersist/{self.tag}/who/{rank}"
            self._who[rank] = self.store.get(key).decode() if self.store.check([key]) else None
        return self._who[rank]

    def _missing(self, step: str, deadline: float) -> list[int]:
        """The ranks missing at ``step``: the published verdict if there is one, else this
        rank's own (then published). Raises what the store raises."""
        store = self.store
        vkey = f"{self.prefix}/{step}/verdict"
        others = [r for r in range(self.size) if r != self.rank]
        pending = list(others)
        verdict: Optional[list[int]] = None
        delay = 0.005
        while True:
            if store.check([vkey]):
                verdict = _decode_ranks(store.get(vkey))
                break
            pending = [r for r in pending if not store.check([self._key(step, r)])]
            dead = [r for r in others if _provably_dead(self._identity_of(r))]
            if all(r in dead for r in pending) or time.monotonic() >= deadline:
                mine = sorted(set(pending) | set(dead))
                verdict = _decode_ranks(store.compare_set(vkey, "", _encode_ranks(mine)))  # first one wins
                break
            time.sleep(delay)
            delay = min(0.05, delay * 2)
        self._linger(vkey, self.size - len(verdict), deadline)
        return verdict

    def _linger(self, vkey: str, survivors: int, deadline: float) -> None:
        """Count this rank as having read the verdict; wait until every survivor has (bounded)."""
        ack = f"{vkey}/read"
        try:
            n = self.store.add(ack, 1)
            end = max(deadline, time.monotonic()) + min(VERDICT_GRACE_S, self.timeout)
            while n < survivors and time.monotonic() < end:
                time.sleep(0.02)
                n = self.store.add(ack, 0)
        except Exception:  # noqa: BLE001 - the store went away: nobody is left to read it
            pass

    def _lost(self, step: str, exc: BaseException, t0: float) -> DistributedTimeoutError:
        missing: Optional[list[int]] = None
        if self.store is not None:
            try:
                missing = self._missing(step, t0 + self.timeout)
            except Exception as store_exc:  # noqa: BLE001
                msg = (f"{self.what}: the exchange at step {step!r} failed ({exc}) and the rendezvous store is "
                       f"unreachable too ({store_exc}): the process hosting it (global rank 0, usually) has "
                       f"probably died. Check that process's log; the previous checkpoint at the path is untouched")
                return DistributedTimeoutError(msg, [0])
        if missing:
            who = ", ".join(self.name(r) for r in missing)
            msg = (f"{self.what}: {who} did not reach step {step!r} within {self.timeout:g} s "
                   f"(process died or hung; FASTPERSIST_DIST_TIMEOUT / Config.dist_timeout sets the limit); "
                   f"the exchange failed with: {exc}. The previous checkpoint at the path is untouched")
        elif missing is None:
            msg = (f"{self.what}: the exchange at step {step!r} failed within {self.timeout:g} s: {exc} "
                   "(which ranks are missing cannot be told: no rendezvous store)")
        else:
            msg = f"{self.what}: every rank reached step {step!r} but the exchange failed: {exc}"
        return DistributedTimeoutError(msg, missing or [])

    def check(self, step: str, values: list[Any], *, local: Optional[BaseException] = None, after: str = "") -> None:
        """Raise :class:`DistributedCheckpointError` on every rank if any rank reported a failure."""
        failures = {r: v for r, v in enumerate(values) if v}
        if not failures:
            return
        lines = "; ".join(f"{self.name(r)}: {why}" for r, why in failures.items())
        ranks = ", ".join(self.name(r) for r in failures)
        msg = f"{self.what} failed on {ranks} of {self.size} (step {step!r}): {lines}"
        if after:
            msg += f". {after}"
        raise DistributedCheckpointError(msg, failures) from local


def _encode_ranks(ranks: Sequence[int]) -> str:
    return "missing:" + ",".join(str(r) for r in ranks)


def _decode_ranks(raw: Any) -> list[int]:
    text = raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
    body = text.split(":", 1)[1] if ":" in text else ""
    return [int(r) for r in body.split(",") if r]


class StoreCoordinator(Coordinator):
    """A :class:`Coordinator` whose exchanges go through the rendezvous store only: for
    the background part of ``save_async(group=...)``, which runs on the finisher thread
    while the caller's thread may be running collectives of its own on any group. Store
    requests from several threads are safe; collectives from two threads on one group
    are not (their order would differ between ranks). Construct it on the caller's
    thread (it counts operations in call order, which every rank shares)."""

    kind = "store"

    def _namespace(self) -> str:
        return "async"

    def _side(self, world: Any, gkey: tuple) -> Any:
        return None

    def gather(self, step: str, value: Any) -> list[Any]:
        if self.store is None:
            raise DistributedCheckpointError(
                f"{self.what}: no rendezvous store (torch.distributed's default store is unavailable here); "
                "save_async(group=...) exchanges its status through it")
        t0 = self.mark(step, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        keys = [self._key(step, r) for r in range(self.size)]
        deadline = t0 + self.timeout
        delay = 0.002
        try:
            while not self.store.check(keys):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no status from every rank through the store within {self.timeout:g} s")
                if self.store.check([f"{self.prefix}/{step}/verdict"]):
                    raise TimeoutError("another rank found ranks missing")
                if any(_provably_dead(self._identity_of(r)) for r in range(self.size) if r != self.rank):
                    raise TimeoutError("a rank's process has exited")
                time.sleep(delay)
                delay = min(0.05, delay * 2)
            out = [pickle.loads(self.store.get(k)) for k in keys]
        except Exception as exc:  # noqa: BLE001
            raise self._lost(step, exc, t0) from exc
        self._passed_first()
        return out


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Local:
    """Runs one step's local work, keeping its exception to report and chain."""

    def __init__(self) -> None:
        self.exc: Optional[BaseException] = None

    def run(self, fn: Callable[[], Any]) -> Any:
        if self.exc is not None:
            return None
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            self.exc = exc
            return None

    @property
    def status(self) -> Optional[str]:
        return None if self.exc is None else _describe(self.exc)


# --------------------------------------------------------------------------- shared filesystem detection


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


# --------------------------------------------------------------------------- save


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
    co = Coordinator(group, cfg.dist_timeout, f"fastpersist.save({os.fspath(path)!r}) over {dist.get_world_size(group)} ranks")
    global _last_save_phases
    try:
        _save(co, obj, path, cfg, format)
    finally:
        co.finish()
        _last_save_phases = co.phases(time.monotonic())
        log.debug("%s: phases (step, local s, exchange s): %s", co.what, _last_save_phases)


_last_save_phases: list[tuple[str, float, float]] = []


def last_save_phases() -> list[tuple[str, float, float]]:
    """Where this rank's last collective save (``save(..., group=...)``) spent its time:
    ``(step, seconds of local work before the step's exchange, seconds in the exchange)``
    per exchange (``plan``: planning and digest; ``probe``: shared-filesystem detection;
    ``crc``: temporary file and partial CRCs; ``write``: this rank's slice; ``commit``: the
    leader's fsync, rename and directory fsync), then ``("end", seconds after the last
    exchange, 0)``. Waiting in an exchange is waiting for the slowest rank. For benchmarks."""
    return list(_last_save_phases)


def _plan(obj: Any, final: str, fmt: str, cfg: Any) -> tuple[Optional[split.Layout], int]:
    align = handles.alignment_for(os.path.dirname(final))
    plan = registry.FORMATS[fmt].plan
    assert plan is not None
    try:
        return split.Layout(plan(obj, align, cfg, target=final), fmt), align
    except UnsupportedLayoutError as e:  # torch's format only
        log.debug("fast torch layout not possible for %s (%s): group leaders write with torch's writer", final, e)
        return None, align


class _Agreed:
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
        return split.slice_bounds(self.layout.plan.file_size, len(self.mygroup), max(self.align, _PAGE))[
            self.mygroup.index(rank)]


def agree(co: Coordinator, obj: Any, path: Any, cfg: Any, format: Optional[str], loc: "Local") -> _Agreed:
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
    values = loc.run(lambda: _value_crcs(layout, cfg)) if layout is not None else None
    vdigest = _values_digest(values) if values is not None else None
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
            why = _first_value_difference(co, obj, layout, every)
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
    agreed = _Agreed(final, directory, fmt, layout, align, groups, mygroup, all(fallback), [v[4] for v in info])
    if layout is not None and values is not None:
        agreed.slot_crcs = _slot_crcs(layout, values)
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


def _value_crcs(layout: split.Layout, cfg: Any) -> list[int]:
    """CRC-32 of every payload extent (:func:`_payload_ranges` order): one read pass over the
    tensor bytes this rank would write, on the native handle's threads. The plan holds host
    addresses only (CUDA storages were staged to host memory when it was planned: ``_plan`` calls
    ``plan_torch`` without device sources), so the CRC covers exactly the bytes any rank
    would write and costs no device-to-host copy of its own."""

    ranges = [(ptr, n) for _i, ptr, n in _payload_ranges(layout)]
    if not ranges:
        return []
    return list(handles.handle_for(cfg).crc32_ranges(ranges))


def _values_digest(crcs: Sequence[int]) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(struct.pack(f"<{len(crcs)}I", *crcs))
    return h.hexdigest()


def _slot_crcs(layout: split.Layout, values: Sequence[int]) -> list[int]:
    """Every CRC slot's CRC-32, folded from the per-extent CRCs of :func:`_value_crcs` (the
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


def _first_value_difference(co: Coordinator, obj: Any, layout: split.Layout, every: list[Any]) -> str:
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


# The replica checks under public names, for the collective save to object storage
# (fastpersist.s3collective), which agrees on its plan and values the same way.
value_crcs = _value_crcs
values_digest = _values_digest
slot_crcs = _slot_crcs
first_value_difference = _first_value_difference


def create_temp(final: str, size: int) -> str:
    """The write group leader's temporary file next to ``final``, preallocated to ``size``."""
    commit.clean_stale_temps(os.path.dirname(final))
    name = commit.temp_path_for(final)
    fd = _sys.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        _preallocate(fd, size)
    except BaseException:
        os.close(fd)
        remove_temp(name)
        raise
    os.close(fd)
    return name


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
    lo, hi = split.slice_bounds(plan.file_size, len(mygroup), max(align, _PAGE))[mygroup.index(co.rank)]
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
        held = split.patch_blocks(plan.patches, lo, hi, _PAGE)
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


def commit_agreed(co: Coordinator, agreed: _Agreed, tmp: str, cfg: Any, loc: "Local") -> None:
    """Step 5: once every rank has written, each write group's leader puts its file in place.

    With one write group (a shared filesystem) that is fsync, rename, directory fsync.
    With several (node-local copies) the leaders first agree that every copy is
    durable, and each keeps a hard link to the previous file while renaming; if any
    leader's rename fails, the others put their previous file back, so the nodes never
    end with different checkpoints under the same name (a crash between the renames
    can still leave them different; the removed link is then a leftover temporary file).
    Raises :class:`DistributedCheckpointError` on every rank on failure."""
    final, directory = agreed.final, agreed.directory
    leader = agreed.leader == co.rank
    several = len(agreed.groups) > 1
    if several:
        if leader and cfg.fsync:
            loc.run(lambda: commit.fsync_path(tmp))
        ready = co.gather("ready", loc.status)
        try:
            co.check("ready", ready, local=loc.exc,
                     after="The temporary files were removed; the previous file at the path is untouched")
        except DistributedCheckpointError:
            if leader:
                remove_temp(tmp)
            raise
    state = {"renamed": False, "backup": None}

    def place() -> None:
        if cfg.fsync and not several:
            commit.fsync_path(tmp)
        commit.keep_mode(final, tmp)
        if several and os.path.exists(final):
            backup = commit.temp_path_for(final)
            try:
                os.link(final, backup)
                state["backup"] = backup
            except OSError as e:  # no hard links here: the previous file cannot be put back
                log.warning("%s: could not keep the previous %s while committing (%s); if another node's "
                            "commit fails, this node keeps the new file", co.what, final, e)
        _sys.rename(tmp, final)
        state["renamed"] = True
        if cfg.fsync:
            commit.fsync_dir_after_rename(final)  # its error says the new file is in place

    if leader:
        loc.run(place)
        if not state["renamed"]:
            remove_temp(tmp)
    committed = co.gather("commit", loc.status)
    failed = any(committed)
    after = "The temporary files were removed; the previous file at the path is untouched"
    if not several and any(v and v.startswith("DirectorySyncError") for v in committed):
        after = ("The new file is in place at the path (the previous one was replaced), but the fsync of its "
                 "directory failed, so the rename may not survive a crash; save again once the filesystem is healthy")
    if several and leader:
        backup = state["backup"]
        if failed and state["renamed"]:
            try:
                if backup is not None:
                    os.rename(backup, final)
                    after = f"Write groups {agreed.groups}: every group's previous file was put back"
                else:
                    after = (f"Write groups {agreed.groups}: this group's new file could not be rolled back "
                             "(no hard link of the previous one)")
                if cfg.fsync:
                    commit.fsync_dir(directory)
            except OSError as e:
                after = f"Write groups {agreed.groups}: putting the previous {final!r} back failed: {e}"
        elif backup is not None:
            remove_temp(backup)
    elif several and failed:
        after = f"Write groups {agreed.groups}: every group's previous file was put back"
    co.check("commit", committed, local=loc.exc, after=after)


def _preallocate(fd: int, size: int) -> None:
    """Give the temporary file its final size (blocks reserved where the filesystem can)."""
    if size <= 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (95, 22):  # EOPNOTSUPP, EINVAL: no fallocate here
            raise
        os.ftruncate(fd, size)


def save_fallback(co: Coordinator, obj: Any, final: Optional[str], cfg: Any, fmt: Optional[str], leader: bool,
                   loc: Local) -> None:
    """Objects the planner cannot lay out: each group leader saves alone with torch's writer."""

    if leader:
        loc.run(lambda: pipeline.save(obj, final, config=cfg, format=fmt))
    done = co.gather("commit", loc.status)
    co.check("commit", done, local=loc.exc)


# --------------------------------------------------------------------------- load


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
    t0 = co.mark("exchange")
    try:
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
    except Exception as exc:  # noqa: BLE001
        raise co._lost("exchange", exc, t0) from exc
    co.trace.append(("exchange", t0, time.monotonic()))


def _load_memfd(fd: int, fspath: str, cfg: Any, map_location: Any, local_load: Callable[[Any], Any]) -> Any:
    """Load the assembled bytes with the ordinary loader, through the memory file's /proc path."""

    proc = f"/proc/self/fd/{fd}"
    if registry.format_for(fspath) is registry.SAFETENSORS:
        return load_safetensors(proc, handles.handle_for(cfg, read=True), registry.safetensors_device(map_location),
                                checksum=cfg.checksum)
    return local_load(proc)
