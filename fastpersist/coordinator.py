"""The collective transport: status exchanges between the ranks of a ``torch.distributed``
group, with a timeout and a verdict on the ranks that did not arrive.

Used by every collective operation: the collective save and load
(:mod:`fastpersist.collectivesave`, :mod:`fastpersist.collectiveload`), the background part of
``save_async(group=...)`` (:class:`StoreCoordinator`) and the collective save to object
storage (:mod:`fastpersist.s3collective`).

Timeouts: the exchanges run on a gloo group of the same ranks created with
``Config.dist_timeout`` (``FASTPERSIST_DIST_TIMEOUT``, default 600 s); its creation
(the first collective save or load on a group) is guarded like an exchange, so a
rank that died before the operation or never calls it is named too. Before each
exchange a rank leaves an arrival mark in the process group's rendezvous store; when
an exchange fails (a peer's connection closed, or the timeout passed), the rank
waits for the marks until the timeout and raises
:class:`~fastpersist.errors.DistributedTimeoutError` naming the ranks that never arrived.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import pickle
import time
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence

import torch.distributed as dist

from fastpersist import _compat, commit
from fastpersist.commit import UNKNOWN_HOST
from fastpersist.errors import DistributedCheckpointError, DistributedTimeoutError

log = logging.getLogger(__name__)

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


def operation_name(verb: str, target: Any, group: Any) -> str:
    """How errors name a collective operation: ``fastpersist.VERB('TARGET') over N ranks``."""
    return f"fastpersist.{verb}({os.fspath(target)!r}) over {dist.get_world_size(group)} ranks"


@contextlib.contextmanager
def collective(verb: str, target: Any, group: Any, timeout: float,
               phases: Optional[list[tuple[str, float, float]]] = None) -> Iterator[Coordinator]:
    """The :class:`Coordinator` of one collective operation (named by :func:`operation_name`),
    finished when the block ends, however it ends. ``phases``, when given, is replaced in
    place by the operation's :meth:`Coordinator.phases` (what ``last_save_phases()`` and
    ``last_load_phases()`` report) and logged at debug level."""
    co = Coordinator(group, timeout, operation_name(verb, target, group))
    try:
        yield co
    finally:
        co.finish()
        if phases is not None:
            phases[:] = co.phases(time.monotonic())
            log.debug("%s: phases (step, local s, exchange s): %s", co.what, phases)


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

    def exchange(self, step: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` (the caller's own collectives, e.g. broadcasts of bulk bytes on
        :attr:`side` or the user's group) as the exchange ``step``: with its arrival mark
        and trace, and a failure raised as :meth:`gather` raises it, naming the ranks
        that did not arrive."""
        t0 = self.mark(step)
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            raise self._lost(step, exc, t0) from exc
        self.trace.append((step, t0, time.monotonic()))

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


def describe(exc: BaseException) -> str:
    """``TypeName: message`` of ``exc``, as the ranks report errors to each other."""
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
        return None if self.exc is None else describe(self.exc)
