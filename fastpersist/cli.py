"""The ``fastpersist`` command: ``info [DIR]``, ``verify PATH...``, ``drain``, ``bench io``, ``bench save``, ``bench train``, ``bench dist``, ``bench sweep``.

Exit status: 0 success; 1 the command ran and found a problem (a checkpoint
that fails verification, data read back that differs from what was written,
fastpersist failing in a benchmark); 2 usage or I/O errors (bad arguments, a
missing file, an unwritable directory). ``verify`` also exits 3 (UNCHECKED) for a
file whose structure is valid but which carries no checksums to compare (a
safetensors file not written by fastpersist, a legacy torch file); malformed
content is always 1 (FAILED), never 2. Errors print one line; ``--debug``
prints the traceback too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import stat
import sys
import traceback
from typing import TYPE_CHECKING, Any, Optional, Sequence

import fastpersist
from fastpersist import _native, describe, objectstore, prefault, readpolicy, s3tier
from fastpersist._inputs import check_input
from fastpersist.commit import clean_stale_temps, scan_temps
from fastpersist.config import get_default
from fastpersist.errors import FastPersistError
from fastpersist.io import gpu_path
from fastpersist.machine import collect_machine_info
from fastpersist.units import format_bytes, parse_int_list, parse_size, parse_size_list
from fastpersist.verifytree import collect, is_dcp_dir

# The benchmarks (fastpersist.bench, several thousand lines and their dependencies) are not
# part of the library: they are imported inside the ``bench`` command's functions only, so
# that ``import fastpersist.cli``, ``fastpersist info`` and ``fastpersist verify`` never load
# them (tests/test_cli.py checks it). The bench subcommands' parsers are built only when the
# command line asks for ``bench`` (or by build_parser() with no argument: every command).

PROG = "fastpersist"
#: where ``bench save`` writes its chart unless told otherwise (``--plot``, ``--no-plot``)
SAVE_PLOT = "fastpersist-bench-save.png"


class UsageError(Exception):
    """A command-line value that is wrong (exit status 2)."""


def _size(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def _sizes(text: str) -> list[int]:
    try:
        values = parse_size_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    for v in values:
        if v <= 0 or v % 4096:
            raise argparse.ArgumentTypeError(f"block size {v} is not a positive multiple of 4096")
    return values


def _ints(text: str) -> list[int]:
    try:
        return parse_int_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _names(text: str) -> list[str]:
    return [] if text.strip().lower() in ("", "none") else [n.strip() for n in text.split(",") if n.strip()]


def _add_outputs(p: argparse.ArgumentParser, plot: str) -> None:
    """The output options every benchmark takes: --json, --plot (what the chart shows), --no-progress."""
    p.add_argument("--json", metavar="FILE", help="write results as JSON to FILE ('-': standard output)")
    p.add_argument("--plot", metavar="FILE.png", help=plot)
    p.add_argument("--no-progress", action="store_true", help="no progress display")


def build_parser(bench: bool = True) -> argparse.ArgumentParser:
    """The argument parser of the ``fastpersist`` command; with ``bench=False``, the
    ``bench`` command is listed but its subcommands (which import the benchmarks) are not built."""
    debug = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a subcommand's parser must not reset a --debug given before the subcommand
    # (the action object is shared by every parser built from this parent).
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="print tracebacks of errors")

    parser = argparse.ArgumentParser(
        prog=PROG, parents=[debug],
        description="fastpersist: PyTorch checkpoints at the speed of the storage.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("info", parents=[debug],
                       help="what a checkpoint holds; or version, engines, O_DIRECT and storage of a directory, "
                       "leftover temporary files",
                       description="fastpersist info CHECKPOINT: format, writer, tensors, bytes, dtypes and checksum "
                       "state of a checkpoint file or DCP directory (and of each checkpoint in a Lightning, "
                       "Accelerate or DeepSpeed folder). fastpersist info [DIR]: this installation and the storage "
                       "of DIR.")
    p.add_argument("dir_arg", nargs="?", metavar="PATH",
                   help="a checkpoint file or DCP directory, or a directory (same as --dir DIR)")
    p.add_argument("--verify", dest="check", action="store_true", default=None,
                   help="check every checkpoint's bytes against its CRC-32s (the default for a file or DCP "
                   "directory named; reads every byte)")
    p.add_argument("--no-verify", dest="check", action="store_false",
                   help="describe checkpoints from their index alone")
    p.add_argument("--dir", default=None, help="directory whose filesystem to describe and whose leftover "
                   "temporary files (.fp-tmp-*) to list (default: .)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--clean", action="store_true",
                   help="remove the leftover temporary files that the next save would remove")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser(
        "verify", parents=[debug], help="check a checkpoint is loadable and checksum every byte",
        description="Check that a checkpoint is a loadable torch or safetensors file and that every byte matches "
        "the checksum recorded when it was written.",
        epilog="exit status: 0 OK (loadable, every checksum matches); 1 FAILED (corrupt, malformed, or not a "
        "checkpoint); 3 UNCHECKED (valid structure but no checksums to compare: a safetensors file not written by "
        "fastpersist, a legacy torch file); 2 usage or I/O error (missing file, unreadable, a directory without "
        "checkpoints). Several files: 0 only if every one is OK, else the first that applies of 1, 2, 3.",
    )
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="checkpoint files (.pt/.pth/.ckpt/.bin/.pkl, .safetensors), DCP checkpoint directories, or "
                   "directories to search for them (Lightning, Accelerate, DeepSpeed checkpoint folders): every "
                   "checkpoint file found is verified, a line each; fastpersist's temporary files and staging "
                   "directories and files that are not checkpoints are listed as SKIPPED")
    p.add_argument("--json", action="store_true", help="print the result as JSON (one file: its result; "
                   "otherwise an object with status, exit_status, files, errors, skipped)")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "drain", parents=[debug], help="tiered s3:// mode: finish the drains to object storage left pending",
        description="Drain to object storage every checkpoint of the tiered mode's local directory still pending "
        "(left by a process that was killed, or whose drain failed), wait for them, and list the directory's "
        "checkpoints with their state (pending, durable). Drains that another running process owns are left to it.",
        epilog="exit status: 0 every drain finished; 1 a drain failed (its local copy is kept); 2 no local "
        "directory configured.",
    )
    p.add_argument("--local-dir", default=None, help="the tiered mode's local directory (default: "
                   "FASTPERSIST_S3_LOCAL_DIR)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=cmd_drain)

    bench_parser = sub.add_parser("bench", parents=[debug], help="benchmarks on your disk")
    if bench:
        _add_bench_parsers(bench_parser, debug)
    return parser


def _add_bench_parsers(bench: argparse.ArgumentParser, debug: argparse.ArgumentParser) -> None:
    """The subcommands of ``fastpersist bench`` (io, save, train, dist, stream, resume, sweep)."""
    from fastpersist.bench import resume_bench, stream_bench, sweep_bench

    bsub = bench.add_subparsers(dest="bench", metavar="BENCH")
    bsub.required = True

    p = bsub.add_parser(
        "io", parents=[debug],
        help="raw write / cold-read GB/s of the I/O engines (like DeepSpeed's ds_io), beside fio",
        description="Write then cold-read one large file per configuration through fastpersist.io.IOHandle "
        "from a pinned tensor; fio's O_DIRECT ceiling in the same run.",
    )
    p.add_argument("--dir", required=True, help="directory on the disk to measure")
    p.add_argument("--size", type=_size, default=parse_size("1GiB"), help="file size (default: 1GiB)")
    p.add_argument("--engines", type=_names, default=["aio", "psync"],
                   help="comma-separated engines: aio, psync, cufile, auto (default: aio,psync)")
    p.add_argument("--block-sizes", type=_sizes, default=[1 << 20, 8 << 20],
                   help="bytes per I/O, comma-separated (default: 1M,8M)")
    p.add_argument("--queue-depths", type=_ints, default=[4, 8, 16], help="I/Os in flight (default: 4,8,16)")
    p.add_argument("--threads", type=_ints, default=[1, 2], help="worker threads (default: 1,2)")
    p.add_argument("--direct", choices=("on", "off", "both"), default="on", help="O_DIRECT (default: on)")
    p.add_argument("--read-staging", choices=("auto", "on", "off", "both"), default="auto",
                   help="reads through the staging ring and copied out (on), straight into the destination "
                   "(off), both, or what loads do on this machine (auto, the default; see read_staging in "
                   "docs/config.md)")
    p.add_argument("--repeat", type=_positive, default=3, help="runs per configuration (default: 3)")
    p.add_argument("--no-fio", action="store_true", help="do not measure fio's ceiling")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: write/read a CUDA tensor (HBM <-> disk) per engine (cufile = GPUDirect Storage), "
                   "beside pinned D2H/H2D bandwidth and fio measured in the same run (default: cpu)")
    _add_outputs(p, plot="write a bar chart (PNG)")
    p.set_defaults(func=cmd_bench_io)

    p = bsub.add_parser(
        "save", parents=[debug],
        help="durable save / cold load of a training state vs torch.save, safetensors, DCP, fio",
        description="Checkpoint a GPT-style training state (or many small tensors) with fastpersist and "
        "its peers on the same disk, in the same run.",
    )
    p.add_argument("--dir", required=True, help="directory on the disk to measure, or s3://bucket/prefix (saves "
                   "and loads to object storage against the server's own ceiling and the s3 peers: "
                   "boto3, s3torchconnector, fsspec, dcp-fsspec)")
    p.add_argument("--size", type=_size, default=None,
                   help="checkpoint size (tensor bytes) of the training state (default: 512MiB, less where free "
                   "memory or disk is short; the report's first line says what it picked and what it will take; "
                   "256MiB for an s3:// --dir)")
    p.add_argument("--small-tensors", type=_positive, metavar="N",
                   help="instead of the training state, N tensors of random sizes 1 KB - 1 MB")
    p.add_argument("--peers", type=_names, default=["torch", "safetensors", "dcp", "fio"],
                   help="comma-separated peers: torch, safetensors, dcp, fio (the write and read ceilings: fio's "
                   "best of several configurations and fastpersist's raw engine), or none "
                   "(default: torch,safetensors,dcp,fio)")
    p.add_argument("--repeat", type=_positive, default=3, help="runs per method (default: 3)")
    p.add_argument("--json", metavar="FILE", help="write results as JSON to FILE ('-': standard output)")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help=f"where to write the bar chart (PNG; default: {SAVE_PLOT} in --dir, beside the runs' files)")
    p.add_argument("--no-plot", action="store_true", help="write no chart")
    p.add_argument("--no-progress", action="store_true", help="no progress display")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="expert detail in the report: fio's whole sweep, the raw engine's settings, the memory "
                   "probe (the JSON always has it)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint files of the last run")
    p.add_argument("--load-into", action="store_true",
                   help="also time a cold load into an existing state of the same shapes: "
                   "fastpersist.load_state_dict vs torch.load + copy_ (each round, same file)")
    p.add_argument("--load-process", choices=("fresh", "same"), default="fresh",
                   help="where the timed loads run: fresh, a new Python process for each load, as a resumed job "
                   "loads (the default; imports and setup untimed); same, this process round after round, where "
                   "freed memory is reused")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: save/load a CUDA state (fastpersist vs torch.save/torch.load, map_location='cuda'), "
                   "beside pinned D2H/H2D bandwidth and fio measured in the same run (default: cpu)")
    p.set_defaults(func=cmd_bench_save)

    # -- bench train (fastpersist.bench.train_bench) --
    p = bsub.add_parser(
        "train", parents=[debug],
        help="training time lost to checkpointing: torch.save, fastpersist (blocking, async snapshot, async lazy), "
        "DCP async_save (thread, process), Lightning AsyncCheckpointIO",
        description="Train a small GPT-style model (CUDA when present, else CPU), checkpoint model + optimizer "
        "every K steps with each method, and report per-step time and the training time lost to checkpointing.",
    )
    p.add_argument("--dir", required=True, help="directory the checkpoints go to")
    p.add_argument("--steps", type=_positive, default=30, help="training steps per method (default: 30)")
    p.add_argument("--every", type=_positive, default=5, help="checkpoint every K steps (default: 5)")
    p.add_argument("--layers", type=_positive, default=4, help="transformer layers (default: 4)")
    p.add_argument("--d-model", type=_positive, default=384, help="model width (default: 384)")
    p.add_argument("--vocab", type=_positive, default=8192, help="vocabulary size (default: 8192)")
    p.add_argument("--seq", type=_positive, default=128, help="sequence length (default: 128)")
    p.add_argument("--batch", type=_positive, default=8, help="batch size (default: 8)")
    p.add_argument("--methods", type=_names, default=None,
                   help="comma-separated: none, torch.save, fastpersist.save, async-snapshot, async-lazy, "
                   "dcp.async_save, dcp.async_save-process, lightning-async, async-tiered (needs --s3) (default: all; "
                   "the none baseline runs in every round anyway)")
    p.add_argument("--rounds", type=_positive, default=1,
                   help="rounds; each runs every method once plus the no-checkpoint baseline, in a seeded shuffled "
                   "order; figures are medians over rounds (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the rounds' shuffled orders (default: 0)")
    p.add_argument("--train-threads", type=_positive, default=None, metavar="N",
                   help="torch intra-op threads (torch.set_num_threads) of the training loop, the same for every "
                   "method and the baseline; below the core count it leaves cores to background checkpoint work, "
                   "as a GPU-bound step does (default: torch's default, left as it is)")
    p.add_argument("--s3", default=None, metavar="s3://BUCKET/PREFIX",
                   help="run async-tiered too: save_async to this prefix in the tiered mode (local copies in --dir, "
                   "the uploads drained in the background; each object read back and compared byte for byte, then "
                   "deleted)")
    _add_outputs(p, plot="step time over steps, checkpoints marked (PNG)")
    p.set_defaults(func=cmd_bench_train)

    # -- bench dist (fastpersist.bench.dist_bench) --
    p = bsub.add_parser(
        "dist", parents=[debug],
        help="N gloo ranks on this machine: replicated save/load through N ranks vs rank-0 torch.save and "
        "1-rank fastpersist; sharded state through DCP FileSystemWriter vs fastpersist.dcp",
        description="Spawn N ranks (gloo, CPU) on this machine and measure, interleaved in one run, durable "
        "saves and cold loads of a replicated training state (fastpersist.save(group=...), rank-0 torch.save, "
        "rank-0 fastpersist.save) and of a sharded state through DCP (FileSystemWriter vs FastPersistWriter).",
    )
    p.add_argument("--dir", required=True, help="directory on the disk to measure")
    p.add_argument("--ranks", type=_positive, default=2, help="processes in the group (default: 2)")
    p.add_argument("--size", type=_size, default=parse_size("1GiB"),
                   help="tensor bytes of the state (default: 1GiB; every rank holds a copy)")
    p.add_argument("--threads", type=_positive, default=None,
                   help="fastpersist threads and DCP thread_count per rank (default: Config.threads)")
    p.add_argument("--no-dcp", action="store_true", help="skip the DCP methods (replicated and sharded)")
    p.add_argument("--rank-bandwidth", type=_size, default=None, metavar="B",
                   help="put each rank in a cgroup of its own with a write and read limit of B bytes/s on the "
                   "target's device (e.g. 100MiB; root and a blkio/io cgroup controller needed), as if each rank "
                   "were a node with its own disk; use a RAM-backed disk so the limit alone sets the bandwidth")
    p.add_argument("--repeat", type=_positive, default=3, help="runs per method (default: 3)")
    _add_outputs(p, plot="write a bar chart (PNG)")
    p.add_argument("--keep", action="store_true", help="keep the files of the last round")
    p.set_defaults(func=cmd_bench_dist)

    stream_bench.add_cli(bsub, debug, _add_outputs, _size, _positive)
    resume_bench.add_cli(bsub, debug, _add_outputs, _size, _positive)
    sweep_bench.add_cli(bsub, debug, _add_outputs, _positive)


# ---- commands ---------------------------------------------------------------------


def cmd_info(args: argparse.Namespace) -> int:
    """``fastpersist info``: what this installation and the storage of ``--dir`` can do."""
    if args.dir_arg is not None and args.dir is not None and args.dir_arg != args.dir:
        raise UsageError(f"two directories given: {args.dir_arg!r} and --dir {args.dir!r} (give one)")
    if args.dir_arg is not None and args.dir is None and (
            os.path.isfile(args.dir_arg) or (os.path.isdir(args.dir_arg) and describe.is_checkpoint_path(args.dir_arg))):
        if not os.path.isdir(args.dir_arg) or is_dcp_dir(args.dir_arg):
            return _info_checkpoints(args, args.dir_arg, check=args.check is not False, machine=False)
        return _info_checkpoints(args, args.dir_arg, check=bool(args.check), machine=True)
    args.dir = args.dir_arg or args.dir or "."
    if objectstore.is_s3_url(args.dir):
        return _info_s3(args)
    return _info_machine(args)


def _info_checkpoints(args: argparse.Namespace, path: str, *, check: bool, machine: bool) -> int:
    """``fastpersist info CHECKPOINT``: :mod:`fastpersist.describe` of each checkpoint at
    ``path``; ``machine``: the storage lines of the directory first."""
    check_input(path, "info", directory_ok=True)
    found, skipped = describe.describe(path, check=check)
    if args.json:
        data: dict[str, Any] = {"checkpoints": [c.to_dict() for c in found],
                                "skipped": [{"path": p, "reason": r} for p, r in skipped]}
        print(json.dumps(data, indent=2))
    else:
        if machine:
            args.dir = path
            _info_machine(args)
            print()
        for i, c in enumerate(found):
            if i:
                print()
            for line in c.lines():
                print(line)
        if machine and not check:
            print("\n(checksums not checked: `fastpersist info --verify DIR` or `fastpersist verify DIR`)")
    return 1 if any(c.status == "corrupt" for c in found) else 0


def _info_machine(args: argparse.Namespace) -> int:
    """``fastpersist info [DIR]``: this installation and the storage of ``args.dir``."""
    info = collect_machine_info(args.dir)
    temps, temps_error = _temp_files(args.dir)
    removed: list[str] = []
    if args.clean and temps is not None:
        removed = clean_stale_temps(args.dir)
    compiled: Optional[list[str]] = None
    native_version: Optional[str] = None
    try:
        compiled = list(_native.ENGINES)
        native_version = str(getattr(_native, "__version__", "")) or None
    except ImportError:
        pass
    gpu = _gpu_path(args.dir)
    way = _read_way(args.dir)
    huge = prefault.huge_pages()
    if args.json:
        data = info.to_dict()
        data.update({"engines_compiled": compiled, "native_version": native_version})
        data["gpu_path"] = gpu if isinstance(gpu, str) else dataclasses.asdict(gpu)
        data["read_way"] = {"way": None, "why": way} if isinstance(way, str) else {"way": way.arm, "why": way.reason}
        data["load_huge_pages"] = {"on": huge[0], "why": huge[1]}
        data["temp_files"] = None if temps is None else [
            {"path": t.path, "size": t.size, "pid": t.pid, "state": t.state, "age_s": round(_age(t), 1),
             "removed_by_next_save": t.removable, "removed": t.path in removed, "reason": t.reason}
            for t in temps
        ]
        if temps_error:
            data["temp_files_error"] = temps_error
        print(json.dumps(data, indent=2))
        return 0
    lines = [f"fastpersist {info.fastpersist_version}" + (f" (native {native_version})" if native_version else "")]
    if compiled is not None:
        lines.append(f"Compiled   : {', '.join(compiled)}")
    lines += info.summary_lines()
    lines += [f"GPU path   : unknown ({gpu})"] if isinstance(gpu, str) else gpu.lines()
    lines.append(f"Load reads : unknown ({way})" if isinstance(way, str) else f"Load reads : {way.arm} ({way.reason})")
    pages = {True: "huge pages", False: "4 KiB pages", None: "huge or 4 KiB pages"}[huge[0]]
    lines.append(f"Load memory: {pages} ({huge[1]})")
    lines += _temp_lines(temps, temps_error, removed, args.clean)
    for line in lines:
        for piece in describe.wrap(line):  # within 100 columns
            print(piece)
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    """``fastpersist drain``: see :func:`fastpersist.s3tier.recover`."""
    cfg = get_default()
    if args.local_dir:
        cfg = cfg.replace(s3_local_dir=args.local_dir)
    root = s3tier.local_root(cfg)
    if root is None:
        raise UsageError("no local directory: give --local-dir DIR or set FASTPERSIST_S3_LOCAL_DIR")
    futures = s3tier.recover(root, cfg)
    failed = 0
    for f in futures:
        try:
            f.wait()
        except Exception as e:  # noqa: BLE001 - reported, the exit status says it
            failed += 1
            print(f"FAILED  {f.url}: {type(e).__name__}: {e}", file=sys.stderr)
    entries = s3tier.status(root)
    if args.json:
        print(json.dumps({"local_dir": root, "drained": len(futures), "failed": failed, "checkpoints": entries},
                         indent=2))
    else:
        print(f"Local directory: {root} ({len(futures)} drain(s) resumed, {failed} failed)")
        for e in entries:
            where = f"  local {e['local']}" if e["local"] else ""
            err = f"  last error: {e['error']}" if e["error"] and e["state"] != "durable" else ""
            print(f"  {e['state']:8s} {e['url']}{where}{err}")
    return 1 if failed else 0


def _info_s3(args: argparse.Namespace) -> int:
    """``fastpersist info s3://bucket/prefix``: the client, its settings, the bucket, and
    incomplete multipart uploads under the prefix (``--clean`` aborts them)."""
    data = objectstore.describe(args.dir, clean=args.clean)
    if args.json:
        print(json.dumps(data, indent=2, default=str))
        return 0
    print(f"Object store: {data['url']}")
    for name in ("client", "endpoint", "region", "addressing_style", "retries", "threads", "part_bytes", "bucket"):
        print(f"  {name:16s}: {data[name]}")
    uploads = data.get("incomplete_uploads")
    if uploads is not None:
        print(f"  incomplete multipart uploads under the prefix: {len(uploads)}"
              + ("" if args.clean or not uploads else " (--clean aborts them; so does the next save to each key)"))
        for u in uploads:
            state = " (aborted)" if u.get("aborted") else ""
            print(f"    s3://{data['url'].split('/')[2]}/{u['key']}  upload {u['upload_id']}{state}")
    return 0 if data["bucket"] == "reachable" else 2


def _gpu_path(directory: str) -> Any:
    """:func:`fastpersist.io.gpu_path` of ``directory`` under the default config, or why it is unknown."""
    try:
        cfg = get_default()
        return gpu_path(directory, engine=cfg.engine, checksum=cfg.checksum)
    except (ImportError, OSError) as e:
        return str(e)


def _read_way(directory: str) -> Any:
    """:func:`fastpersist.readpolicy.describe_dir` of ``directory`` under the default config
    (the way a load of a cold CPU checkpoint there reads), or why it is unknown."""
    try:
        return readpolicy.describe_dir(directory, get_default())
    except OSError as e:
        return str(e)


if TYPE_CHECKING:
    from fastpersist.commit import TempFile


def _temp_files(directory: str) -> tuple[Optional[list], Optional[str]]:
    """Leftover temporary files of saves in ``directory`` (None and why, if it cannot be listed)."""
    try:
        return scan_temps(directory), None
    except OSError as exc:
        return None, str(exc)


def _age(t: "TempFile") -> float:
    import time

    return max(0.0, time.time() - t.mtime)


def _temp_lines(temps: Optional[list], error: Optional[str], removed: list[str], clean: bool) -> list[str]:
    if temps is None:
        return [f"Temp files : cannot list ({error})"]
    if not temps:
        return ["Temp files : none (no leftovers of interrupted saves)"]
    total = sum(t.size for t in temps)
    n_removable = sum(t.removable for t in temps)
    lines = [f"Temp files : {len(temps)} leftover{'s' if len(temps) != 1 else ''} of saves, "
             f"{format_bytes(total)}; {n_removable} removed by the next save here"
             + (f", {len(removed)} removed now (--clean)" if clean else "")]
    for t in temps:
        if t.path in removed:
            action = "removed"
        elif t.removable:
            action = "next save removes it"
        else:
            action = "kept"
        lines.append(f"  {os.path.basename(t.path)}")
        lines.append(f"    {format_bytes(t.size)}, pid {t.pid}, {t.state}, {action}: {t.reason}")
    return lines


def _verify_one(path: str) -> dict:
    """:func:`fastpersist.verify` of one file or DCP directory as a JSON-ready dict with
    ``status``; content that escapes verify as an exception is still ``corrupt``."""
    try:
        result = fastpersist.verify(path)
    except (FastPersistError, UnicodeError) as exc:  # bad content that escaped verify: still FAILED, never 2
        if isinstance(exc, OSError):  # an object store's error (a missing object, refused credentials): 2
            raise
        return {"ok": False, "path": path, "format": "unknown", "records": 0, "bytes": 0, "problems": [str(exc)],
                "status": "corrupt", "notes": []}
    data = dataclasses.asdict(result)
    data["status"] = result.status
    return data


def _print_verify(data: dict) -> None:
    path, status = data["path"], data["status"]
    if status == "ok":
        print(f"OK: {path}: {data.get('records', 0)} records, {data.get('bytes', 0)} payload bytes checked "
              f"({data.get('format', '?')} format)")
    elif status == "unchecked":
        print(f"UNCHECKED: {path}: no checksums to verify ({data.get('format', '?')} format, "
              f"{data.get('records', 0)} records)")
        for problem in data["problems"]:
            print(f"  - {problem}")
    else:
        print(f"FAILED: {path}: {len(data['problems'])} problem(s)")
        for problem in data["problems"]:
            print(f"  - {problem}")
    for note in data.get("notes", []):
        print(f"  note: {note}")


#: Exit status of ``verify`` for several results: the worst one wins.
_VERIFY_RANK = {"corrupt": (4, 1), "error": (3, 2), "unchecked": (2, 3), "ok": (1, 0)}


def cmd_verify(args: argparse.Namespace) -> int:
    """``fastpersist verify PATH...``: every checkpoint file and DCP directory named, and
    those found in the directories named (:mod:`fastpersist.verifytree`), a line each.
    One exit status: 1 if any FAILED, else 2 if any could not be read (or a directory held
    no checkpoint), else 3 if any is UNCHECKED, else 0 (every one OK)."""
    paths = list(args.paths)
    single = len(paths) == 1 and (objectstore.is_s3_url(paths[0]) or not os.path.isdir(paths[0]))
    if single:  # one file: its errors are the command's (exit 2, one line), as before
        path = paths[0]
        if not objectstore.is_s3_url(path):
            check_input(path, "verify", directory_ok=True)  # the OS's error at once: ELOOP, a FIFO's ESPIPE
        data = _verify_one(path)
        if args.json:
            print(json.dumps(data, indent=2))
        else:
            _print_verify(data)
        return _VERIFY_RANK.get(data["status"], (4, 1))[1]
    results: list[dict] = []
    skipped: list[dict] = []
    errors: list[dict] = []
    debug = getattr(args, "debug", False)

    def error(path: str, exc: BaseException) -> None:
        if debug:
            traceback.print_exception(type(exc), exc, exc.__traceback__)
        errors.append({"path": path, "error": _describe(exc)})
        if not args.json:
            print(f"ERROR: {path}: {_describe(exc)}")

    for path in paths:
        if not objectstore.is_s3_url(path):
            try:
                check_input(path, "verify", directory_ok=True)
            except OSError as exc:  # missing, a link loop, a FIFO, a device: reported, the others still verified
                error(path, exc)
                continue
        if not objectstore.is_s3_url(path) and os.path.isdir(path) and not is_dcp_dir(path):
            tree = collect(path)
            targets = tree.targets
            for p, reason in tree.skipped:
                skipped.append({"path": p, "reason": reason})
                if not args.json:
                    print(f"SKIPPED: {p}: {reason}")
            if not targets:
                error(path, FileNotFoundError(2, "No checkpoint file or DCP checkpoint directory in this directory",
                                              path))
        else:
            targets = [path]
        for target in targets:
            try:
                data = _verify_one(target)
            except (OSError, EOFError, ValueError) as exc:
                error(target, exc)
                continue
            results.append(data)
            if not args.json:
                _print_verify(data)
    statuses = [r["status"] for r in results] + ["error"] * len(errors)
    worst = max(statuses, key=lambda st: _VERIFY_RANK.get(st, (4, 1))[0]) if statuses else "error"
    code = _VERIFY_RANK.get(worst, (4, 1))[1]
    counts = {st: sum(1 for r in results if r["status"] == st) for st in ("ok", "corrupt", "unchecked")}
    if args.json:
        print(json.dumps({"status": worst, "exit_status": code, "files": results, "errors": errors,
                          "skipped": skipped}, indent=2))
    else:
        print(f"{len(results)} checked: {counts['ok']} OK, {counts['corrupt']} FAILED, {counts['unchecked']} "
              f"UNCHECKED; {len(errors)} error(s), {len(skipped)} skipped")
    return code


def _json_to_stdout(args: argparse.Namespace) -> bool:
    return getattr(args, "json", None) == "-"


def _check_dir(path: str) -> str:
    if not os.path.isdir(path):
        raise UsageError(f"--dir {path!r} is not a directory (create it first)")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"--dir {path!r} is not writable")
    return path


def cmd_bench_io(args: argparse.Namespace) -> int:
    """``fastpersist bench io``: see :mod:`fastpersist.bench.io_bench`."""
    from fastpersist.bench import report
    from fastpersist.bench.io_bench import run_io_bench

    _check_dir(args.dir)
    if not args.engines:
        raise UsageError("--engines: give at least one engine")
    bad = sorted(set(args.engines) - {"auto", "aio", "psync", "cufile"})
    if bad:
        raise UsageError(f"--engines: unknown engine(s) {', '.join(bad)} (use aio, psync, cufile, auto)")
    if getattr(args, "device", "cpu") == "cuda":
        return _bench_gpu(args, "io")
    direct = {"on": [True], "off": [False], "both": [True, False]}[args.direct]
    staging = {"auto": None, "on": [True], "off": [False], "both": [False, True]}[args.read_staging]
    result = run_io_bench(
        args.dir, size=args.size, engines=args.engines, block_sizes=args.block_sizes,
        queue_depths=args.queue_depths, threads=args.threads, direct_modes=direct, stage_modes=staging,
        repeat=args.repeat,
        fio=not args.no_fio, progress=not args.no_progress,
    )
    out = sys.stderr if _json_to_stdout(args) else sys.stdout
    report.print_io_report(result, out)
    if args.json:
        report.write_json(result.to_dict(), args.json)
    if args.plot:
        report.plot_io(result, args.plot)
        print(f"Plot       : {args.plot}", file=out)
    mismatched = [r for r in result.runs if r.verified is False]
    return 1 if mismatched else 0


def cmd_bench_save(args: argparse.Namespace) -> int:
    """``fastpersist bench save``: see :mod:`fastpersist.bench.save_bench` (and
    :mod:`fastpersist.bench.s3_bench` for an ``s3://`` target)."""
    from fastpersist.bench import report
    from fastpersist.bench.conditions import Conditions, auto_size, plan_line
    from fastpersist.bench.s3_bench import S3_PEERS, run_s3_bench
    from fastpersist.bench.save_bench import PEERS, run_save_bench

    if objectstore.is_s3_url(args.dir):
        peers = list(S3_PEERS) if args.peers == list(PEERS) else args.peers
        bad = sorted(set(peers) - set(S3_PEERS))
        if bad:
            raise UsageError(f"--peers: unknown s3 peer(s) {', '.join(bad)} (use {', '.join(S3_PEERS)} or none)")
        return run_s3_bench(args.dir, size=args.size or parse_size("256MiB"), repeat=args.repeat, peers=peers,
                            out=sys.stderr if _json_to_stdout(args) else sys.stdout, json_path=args.json)
    _check_dir(args.dir)
    bad = sorted(set(args.peers) - set(PEERS))
    if bad:
        raise UsageError(f"--peers: unknown peer(s) {', '.join(bad)} (use {', '.join(PEERS)} or none)")
    conditions = Conditions.before()
    why = None
    if args.size is None:
        args.size, why = auto_size(args.dir) if args.small_tensors is None else (parse_size("512MiB"), None)
    if getattr(args, "device", "cpu") == "cuda":
        return _bench_gpu(args, "save")
    out = sys.stderr if _json_to_stdout(args) else sys.stdout
    if args.small_tensors is None:
        report.say(plan_line(args.size, why, 1 + len([p for p in args.peers if p != "fio"]), args.repeat,
                             "fio" in args.peers), out)
        out.flush()
    result = run_save_bench(
        args.dir, size=args.size, small_tensors=args.small_tensors, peers=args.peers, repeat=args.repeat,
        keep=args.keep, progress=not args.no_progress, load_into=args.load_into, load_process=args.load_process,
    )
    fresh = (result.machine.fresh_memory or {}).get("fresh_gbps_n")
    conditions.after(fresh, result.to_dict().get("read_ceiling_gbps"))
    report.print_save_report(result, out, verbose=args.verbose)
    for line in conditions.lines():
        report.say(line, out)
    if args.json:
        report.write_json(dict(result.to_dict(), conditions=conditions.to_dict()), args.json)
        if args.json != "-":
            _say_path("JSON", os.path.abspath(args.json), "(every run, the fio sweep, the machine)", out)
    if not args.no_plot:
        if args.plot is None:
            args.plot = os.path.join(args.dir, SAVE_PLOT)
        try:
            report.plot_save(result, args.plot)
        except ImportError as exc:  # the chart is a convenience: its absence does not fail the benchmark
            report.say(f"Plot       : not written ({exc}; pip install matplotlib)", out)
        except OSError as exc:
            report.say(f"Plot       : not written ({_describe(exc)}; choose another path with --plot FILE.png)", out)
        else:
            _say_path("Plot", os.path.abspath(args.plot), "(--plot FILE.png to choose, --no-plot for none)", out)
    fp = result.method("fastpersist")
    v = result.verification
    failed = fp is None or fp.error is not None or not v.get("ok", False) or v.get("into_ok") is False
    return 1 if failed else 0


def _say_path(key: str, path: str, hint: str, out: Any) -> None:
    """``Key        : path hint`` within 100 columns where it fits; else the path stays whole
    on the key's line and the hint goes on the next one, indented."""
    from fastpersist.bench import report

    line = f"{key:<11}: {path} {hint}"
    if len(line) <= report.WIDTH:
        print(line, file=out)
    else:
        print(f"{key:<11}: {path}", file=out)
        report.say(" " * 13 + hint, out)


def _bench_gpu(args: argparse.Namespace, kind: str) -> int:
    """``bench io/save --device cuda``: see :mod:`fastpersist.bench.gpu_bench`."""
    from fastpersist.bench import gpu_bench, report

    try:
        gpu_bench.require_cuda()
    except RuntimeError as e:
        raise UsageError(str(e)) from e
    if kind == "io":
        result = gpu_bench.run_gpu_io_bench(args.dir, size=args.size, engines=args.engines, repeat=args.repeat,
                                            fio=not args.no_fio)
    else:
        result = gpu_bench.run_gpu_save_bench(args.dir, size=args.size, repeat=args.repeat,
                                              fio="fio" in args.peers)
    out = sys.stderr if _json_to_stdout(args) else sys.stdout
    gpu_bench.print_gpu_report(result, out)
    if args.json:
        report.write_json(result.to_dict(), args.json)
    return 0 if result.verified else 1


def cmd_bench_train(args: argparse.Namespace) -> int:
    """``fastpersist bench train``: see :mod:`fastpersist.bench.train_bench`."""
    from fastpersist.bench import report
    from fastpersist.bench.train_bench import METHODS, plot_train, print_train_report, run_train_bench

    _check_dir(args.dir)
    methods = args.methods or list(METHODS)
    bad = sorted(set(methods) - set(METHODS))
    if bad:
        raise UsageError(f"--methods: unknown method(s) {', '.join(bad)} (use {', '.join(METHODS)})")
    if args.d_model % 64 and args.d_model % 6:
        raise UsageError("--d-model must be a multiple of 64 or of 6 (attention heads)")
    if args.s3 is not None and not objectstore.is_s3_url(args.s3):
        raise UsageError(f"--s3 takes an s3://bucket/prefix, not {args.s3!r}")
    result = run_train_bench(
        args.dir, steps=args.steps, every=args.every, layers=args.layers, d_model=args.d_model,
        heads=6 if args.d_model % 6 == 0 else args.d_model // 64, vocab=args.vocab, seq=args.seq,
        batch=args.batch, methods=methods, progress=not args.no_progress, rounds=args.rounds,
        train_threads=args.train_threads, seed=args.seed, s3=args.s3,
    )
    out = sys.stderr if _json_to_stdout(args) else sys.stdout
    print_train_report(result, out)
    if args.json:
        report.write_json(result.to_dict(), args.json)
    if args.plot:
        plot_train(result, args.plot)
        print(f"Plot       : {args.plot}", file=out)
    bad_runs = [r for r in result.runs if r.error is not None or r.verified is False]
    return 1 if bad_runs else 0


def cmd_bench_dist(args: argparse.Namespace) -> int:
    """``fastpersist bench dist``: see :mod:`fastpersist.bench.dist_bench`."""
    from fastpersist.bench import cgroup, report
    from fastpersist.bench.dist_bench import plot_dist, print_dist_report, run_dist_bench

    _check_dir(args.dir)
    if args.rank_bandwidth is not None:
        why = cgroup.unavailable_reason()
        if why:
            raise UsageError(f"--rank-bandwidth: cannot limit each rank's bandwidth here: {why}")
    result = run_dist_bench(
        args.dir, ranks=args.ranks, size=args.size, repeat=args.repeat, threads=args.threads,
        dcp=not args.no_dcp, keep=args.keep, progress=not args.no_progress, rank_bandwidth=args.rank_bandwidth,
    )
    out = sys.stderr if _json_to_stdout(args) else sys.stdout
    print_dist_report(result, out)
    if args.json:
        report.write_json(result.to_dict(), args.json)
    if args.plot:
        plot_dist(result, args.plot)
        print(f"Plot       : {args.plot}", file=out)
    v = result.verification
    group = result.method("fastpersist group")
    failed = (group is None or group.error is not None or not v.get("group_file_identical_to_one_rank")
              or not v.get("group_load_equals_state_on_every_rank"))
    return 1 if failed else 0


# ---- entry point ------------------------------------------------------------------


def _command_of(argv: Sequence[str]) -> Optional[str]:
    """The command word of ``argv`` (the first argument that is not an option), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``fastpersist`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(bench=_command_of(argv) == "bench")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code) if isinstance(exc.code, int) else 2
    debug = getattr(args, "debug", False)
    try:
        return int(args.func(args))
    except UsageError as exc:
        if debug:
            traceback.print_exc()
        parser.print_usage(sys.stderr)
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, EOFError, ValueError, ImportError) as exc:
        if debug:
            traceback.print_exc()
        print(f"{PROG}: error: {_describe(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename and exc.strerror:
        return f"{exc.strerror}: {exc.filename!r}"
    return f"{type(exc).__name__}: {exc}" if not isinstance(exc, OSError) else str(exc)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
