"""``fastpersist bench sweep``: save and cold load at every size, against torch, interleaved.

For each size (default 1 MiB to 2 GiB, fewer on a machine with little memory or disk),
a state of 8 float32 tensors of that total size is saved and loaded, in each round in
turn (the order alternates between rounds), by:

* ``torch``: ``torch.save`` to a file, then ``fsync`` of the file (what a user adds to
  make it durable); the cold load is ``torch.load(weights_only=True)``;
* ``fastpersist``: ``fastpersist.save`` (temporary file, fsync, rename, directory fsync)
  and ``fastpersist.load`` with the default config.

Before every load the file's pages are dropped from the page cache
(``posix_fadvise(DONTNEED)``; on a memory filesystem there is nothing to drop). With
``--busy``, a CPU-bound process (a Python busy loop per ``--busy`` count) runs beside
the measurement the whole time, as a training job's data loader or another job would.
Reported per size: the median milliseconds of each side and fastpersist's speedup
(torch's time / fastpersist's: above 1.0 fastpersist is faster); ``--json`` keeps every
round's figures and the conditions (machine, filesystem, the read way loads take).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence, TextIO

import torch

import fastpersist
from fastpersist import readpolicy
from fastpersist.config import get_default
from fastpersist.bench.fsutil import drop_page_cache
from fastpersist.machine import collect_machine_info, memory_bytes
from fastpersist.bench.report import write_json
from fastpersist.units import format_bytes, median, parse_size_list

#: The default sizes, largest first cut to what the machine holds (:func:`default_sizes`).
SIZES = "1MiB,4MiB,16MiB,64MiB,256MiB,1GiB,2GiB"
_TENSORS = 8


@dataclass
class SizeResult:
    """One size: every round's seconds per method and operation."""

    nbytes: int
    save: dict[str, list[float]] = field(default_factory=dict)  #: method -> seconds per round
    load: dict[str, list[float]] = field(default_factory=dict)

    def speedup(self, op: str) -> Optional[float]:
        """torch's median time / fastpersist's, for ``op`` ``"save"`` or ``"load"``."""
        runs = getattr(self, op)
        t, f = median(runs.get("torch", [])), median(runs.get("fastpersist", []))
        return None if not t or not f else t / f


@dataclass
class SweepResult:
    """``fastpersist bench sweep``'s figures and conditions."""

    directory: str
    rounds: int
    busy: int
    read_way: str
    machine: dict[str, Any]
    sizes: list[SizeResult] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for s, d in zip(self.sizes, data["sizes"]):
            d["save_speedup"], d["load_speedup"] = s.speedup("save"), s.speedup("load")
        return data


def default_sizes(directory: str) -> list[int]:
    """:data:`SIZES` without those above a quarter of the memory or of the free space of
    ``directory`` (two files of each size are kept at a time, and the loads need memory)."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    mem = memory_bytes() or (8 << 30)
    cap = min(free, mem) // 4
    sizes = [s for s in parse_size_list(SIZES) if s <= cap]
    return sizes or [parse_size_list(SIZES)[0]]


def _state(nbytes: int) -> dict[str, torch.Tensor]:
    per = max(nbytes // _TENSORS // 4, 1)
    return {f"layer{i}.weight": torch.randn(per) for i in range(_TENSORS)}


def _torch_save(state: dict[str, torch.Tensor], path: str) -> None:
    torch.save(state, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _timed(fn: Any, *args: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def _busy_processes(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def run_sweep(directory: str, sizes: Sequence[int], *, rounds: int = 3, busy: int = 0,
              out: Optional[TextIO] = None) -> SweepResult:
    """Measure every size of ``sizes`` (bytes) ``rounds`` times in ``directory`` (files
    ``sweep-torch.pt`` and ``sweep-fastpersist.pt``, removed at the end), with ``busy``
    CPU-bound processes beside; progress lines go to ``out``."""
    os.makedirs(directory, exist_ok=True)
    plan = readpolicy.describe_dir(directory, get_default())
    info = collect_machine_info(directory, probe_memory=False)
    result = SweepResult(os.path.abspath(directory), rounds, busy, f"{plan.arm} ({plan.reason})", info.to_dict())
    paths = {"torch": os.path.join(directory, "sweep-torch.pt"),
             "fastpersist": os.path.join(directory, "sweep-fastpersist.pt")}
    savers = {"torch": _torch_save, "fastpersist": fastpersist.save}
    loaders = {"torch": lambda p: torch.load(p, weights_only=True), "fastpersist": fastpersist.load}
    hogs = _busy_processes(busy)
    try:
        for nbytes in sizes:
            state = _state(nbytes)
            res = SizeResult(nbytes, {m: [] for m in paths}, {m: [] for m in paths})
            for method in paths:  # a first save of each outside the figures: files exist, handles built
                savers[method](state, paths[method])
            for r in range(rounds):
                order = list(paths) if r % 2 == 0 else list(reversed(paths))
                for method in order:
                    seconds, _ = _timed(savers[method], state, paths[method])
                    res.save[method].append(seconds)
                for method in order:
                    # every method's file, not only the one about to load: a file written through the
                    # page cache (torch.save's) would otherwise hand its load the pages its eviction
                    # just freed, while a file written with O_DIRECT frees nothing, and on a VM whose
                    # free memory goes back to the host, pages not recycled that way fill several
                    # times slower (measured: the same 1 GiB loads 0.30x torch's this way and 1.1x
                    # with both files evicted before each load)
                    for p in paths.values():
                        drop_page_cache(p)
                    gc.collect()
                    seconds, loaded = _timed(loaders[method], paths[method])
                    res.load[method].append(seconds)
                    if set(loaded) != set(state):
                        raise RuntimeError(f"{method} loaded keys {sorted(loaded)} for {sorted(state)}")
                    del loaded
            result.sizes.append(res)
            if out is not None:
                print(_row(res), file=out, flush=True)
            del state
            gc.collect()
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        for p in paths.values():
            try:
                os.unlink(p)
            except OSError:
                pass
    return result


HEADER = (f"{'size':>9} | {'torch.save+fsync':>16} {'fp.save':>9} {'speedup':>7} | "
          f"{'torch.load':>10} {'fp.load':>9} {'speedup':>7}")


def _ms(values: Sequence[float]) -> str:
    m = median(values)
    return "-" if m is None else f"{m * 1e3:.1f} ms"


def _x(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _row(s: SizeResult) -> str:
    return (f"{format_bytes(s.nbytes):>9} | {_ms(s.save['torch']):>16} {_ms(s.save['fastpersist']):>9} "
            f"{_x(s.speedup('save')):>7} | {_ms(s.load['torch']):>10} {_ms(s.load['fastpersist']):>9} "
            f"{_x(s.speedup('load')):>7}")


def print_sweep(result: SweepResult, out: TextIO) -> None:
    """The table: one row per size, medians of the rounds and fastpersist's speedups."""
    print(f"directory  : {result.directory} ({result.machine.get('filesystem', '?')})", file=out)
    print(f"rounds     : {result.rounds}, interleaved; cold loads (page cache dropped before each); "
          f"{result.busy} CPU-bound process(es) beside", file=out)
    print(f"load reads : {result.read_way}", file=out)
    print(HEADER, file=out)
    for s in result.sizes:
        print(_row(s), file=out)


def _size_list(text: str) -> list[int]:
    import argparse

    try:
        values = parse_size_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return values


def add_cli(bsub: Any, debug: Any, add_outputs: Any, positive: Any) -> None:
    """Register ``fastpersist bench sweep`` on the ``bench`` subparsers."""
    p = bsub.add_parser(
        "sweep", parents=[debug],
        help="save and cold load at every size (1 MiB to 2 GiB) against torch.save+fsync and torch.load, "
        "interleaved; --busy runs a CPU-bound process beside",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--dir", required=True, help="directory on the disk to measure")
    p.add_argument("--sizes", type=_size_list, default=None,
                   help=f"comma-separated total sizes (default: {SIZES}, those above a quarter of the memory "
                   "or of the free space left out)")
    p.add_argument("--rounds", type=positive, default=4,
                   help="rounds per size (default: 4; the two methods' order alternates, so an even count gives "
                   "each the first place equally often)")
    p.add_argument("--busy", type=int, nargs="?", const=1, default=0, metavar="N",
                   help="run N CPU-bound processes beside the measurement (default without the option: 0; "
                   "--busy alone: 1)")
    add_outputs(p, plot="(not drawn for this benchmark)")
    p.set_defaults(func=cmd_bench_sweep)


def cmd_bench_sweep(args: Any) -> int:
    """``fastpersist bench sweep``."""
    sizes = args.sizes or default_sizes(args.dir)
    to_stdout = args.json == "-"
    progress = None if (args.no_progress or to_stdout) else sys.stderr
    if progress is not None:
        print(HEADER, file=progress, flush=True)
    result = run_sweep(args.dir, sizes, rounds=args.rounds, busy=max(args.busy, 0), out=progress)
    if to_stdout:
        import json

        print(json.dumps(result.to_dict(), indent=2))
    else:
        print_sweep(result, sys.stdout)
        if args.json:
            write_json(result.to_dict(), args.json)
    return 0
