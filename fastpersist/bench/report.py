"""Presenting benchmark results: tables (rich when installed, else plain text), JSON, PNG charts."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Optional, Sequence, TextIO

from fastpersist.bench.io_bench import IOBenchResult
from fastpersist.bench.save_bench import SaveBenchResult
from fastpersist.units import format_block, format_bytes, ratio


def _num(value: Optional[float], digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def _ratio(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _runs(values: Sequence[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values) if values else "-"


#: the widest line a report prints (tables and wrapped text)
WIDTH = 100
_KEY = 13  # "Note       : " -- the key column of "Key : value" lines


def wrap_line(line: str, width: int = WIDTH) -> list[str]:
    """``line`` wrapped to ``width`` columns; a ``"Key        : value"`` line keeps its value indented."""
    import textwrap

    if len(line) <= width:
        return [line]
    indent = " " * _KEY if len(line) > _KEY and line[_KEY - 2:_KEY] == ": " else "  "
    return textwrap.wrap(line, width=width, subsequent_indent=indent, break_on_hyphens=False,
                         break_long_words=False) or [line]


def say(line: str, out: TextIO) -> None:
    """Print ``line`` wrapped to :data:`WIDTH` columns."""
    for part in wrap_line(line):
        print(part, file=out)


def render_table(
    title: str, headers: Sequence[str], rows: Sequence[Sequence[str]], out: Optional[TextIO] = None,
    width: int = WIDTH,
) -> None:
    """Print a table at most ``width`` columns wide: with rich when it is installed, else plain text.

    rich wraps the cells of every column but the first when the table would be
    wider; the plain table is as wide as its cells (keep them short).
    """
    out = out if out is not None else sys.stdout
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None  # type: ignore[assignment,misc]
    if Console is not None:
        table = Table(title=title, title_justify="left")
        for i, h in enumerate(headers):
            table.add_column(h, justify="left" if i == 0 else "right", no_wrap=i == 0)
        for row in rows:
            table.add_row(*row)
        Console(file=out, width=width).print(table)
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    print(title, file=out)
    print("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths))), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for row in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))), file=out)


def print_header(lines: Sequence[str], out: Optional[TextIO] = None) -> None:
    """Print the machine header (one fact per line, wrapped to :data:`WIDTH` columns)."""
    out = out if out is not None else sys.stdout
    for line in lines:
        say(line, out)
    print(file=out)


def print_save_report(result: SaveBenchResult, out: Optional[TextIO] = None, verbose: bool = False) -> None:
    """Machine header, workload, save and load tables beside their ceilings, verification and notes.

    Everything fits :data:`WIDTH` columns; ``verbose`` adds the expert detail
    (the memory probe, fio's whole sweep, the raw engine's settings), which
    the JSON always carries.
    """
    out = out if out is not None else sys.stdout
    print_header(result.machine.summary_lines(verbose) + [f"fastpersist: {result.engine}"], out)
    w = result.workload
    if w["kind"] == "small-tensors":
        desc = f"{w['small_tensors']} small tensors (1 KB - 1 MB)"
    else:
        m = w["model"]
        desc = (f"GPT training state: hidden {m['hidden']}, {m['layers']} layers, vocab {m['vocab']}, "
                f"{m['params'] / 1e6:.1f}M params (bf16 weights, fp32 master + Adam moments)")
    say(f"Workload   : {desc}; {w['tensors']} tensors, {format_bytes(w['tensor_bytes'])} of tensor data, "
        f"{w['non_tensor_leaves']} non-tensor leaves; dtypes {', '.join(w['dtypes'])}", out)
    say(f"Runs       : {result.repeat} per method, interleaved (each round runs every method once, in a "
        "shuffled order)", out)
    if result.load_process == "fresh":
        say("Loads      : each in a fresh Python process (what a resumed job sees; only the load call timed)", out)
    else:
        say("Loads      : in this process, round after round (freed memory reused by the allocators)", out)
    print(file=out)
    d = result.to_dict()
    w_ceiling, w_source = result.write_ceiling
    r_ceiling = d.get("read_ceiling_gbps")
    f = result.fio
    eng = result.engine_ceiling
    save_rows, load_rows = [], []
    for m in d["methods"]:
        if m["error"] and not m["save_seconds"]:
            save_rows.append([m["name"], "-", "-", "-", "-", "failed"])
            load_rows.append([m["name"], "-", "-", "-", "-"])
            continue
        save_rows.append([
            m["name"], _runs(m["save_gbps"]), _num(m["save_median_gbps"]), _ratio(m["save_vs_torch"]),
            _ratio(m["save_vs_write_ceiling"]),
            format_bytes(m["file_bytes"]) if m["file_bytes"] is not None else "-",
        ])
        load_rows.append([
            m["name"], _runs(m["load_gbps"]), _num(m["load_median_gbps"]), _ratio(m["load_vs_torch"]),
            _ratio(m["load_vs_read_ceiling"]),
        ])
    if f is not None and f.write_gbps:
        save_rows.append([_mark("fio, best config", w_source == "fio"), _runs(f.write_repeats), _num(f.write_gbps),
                          "", _ratio(ratio(f.write_gbps, w_ceiling)), ""])
    if eng is not None and eng.write_gbps:
        save_rows.append([_mark("raw engine", w_source == "engine"), _runs(eng.write_repeats),
                          _num(eng.write_gbps), "", _ratio(ratio(eng.write_gbps, w_ceiling)), ""])
    if f is not None and f.read_gbps:
        best = r_ceiling is not None and f.read_gbps >= r_ceiling
        load_rows.append([_mark("fio O_DIRECT read", best), _runs(f.read_repeats), _num(f.read_gbps), "",
                          _ratio(ratio(f.read_gbps, r_ceiling))])
    if f is not None and f.buffered_read_gbps:
        best = r_ceiling is not None and f.buffered_read_gbps >= r_ceiling and not (f.read_gbps or 0) >= r_ceiling
        load_rows.append([_mark("fio buffered read", best), _runs(f.buffered_read_repeats),
                          _num(f.buffered_read_gbps), "", _ratio(ratio(f.buffered_read_gbps, r_ceiling))])
    render_table("Durable save, GB/s (higher is better)",
                 ["method", "runs", "median", "vs torch", "vs ceiling", "file size"], save_rows, out)
    render_table("Cold load, GB/s (higher is better)",
                 ["method", "runs", "median", "vs torch", "vs ceiling"], load_rows, out)
    _print_ceilings(result, out, verbose)
    into = [m for m in d["methods"] if m.get("into_seconds")]
    if into:
        render_table("Cold load into an existing state, GB/s", ["method", "runs", "median", "vs torch"],
                     [[m["name"] if m["name"] != "torch" else "torch.load + copy_",
                       _runs(m["into_gbps"]), _num(m["into_median_gbps"]), _ratio(m["into_vs_torch"])]
                      for m in into], out)
    v = result.verification
    if v.get("checked"):
        if v.get("ok"):
            how = v.get("compared_by", "torch.equal each tensor; non-tensors ==")
            say(f"Verified   : {v['method']} load equals the original state "
                f"({v['tensors_compared']} tensors; {how})", out)
        else:
            say(f"Verified   : MISMATCH after {v['method']} load:", out)
            for p in v.get("problems", []):
                say(f"  - {p}", out)
    else:
        say("Verified   : not checked (fastpersist did not run)", out)
    if "into_ok" in v:
        if v["into_ok"]:
            say("Verified   : fastpersist load-into filled the state with the original values", out)
        else:
            say("Verified   : MISMATCH after fastpersist load-into:", out)
            for p in v.get("into_problems", []):
                say(f"  - {p}", out)
    for m in result.methods:
        if m.error:
            say(f"Error      : {m.name}: {m.error}", out)
    for note in result.notes:
        say(f"Note       : {note}", out)


def _mark(name: str, is_ceiling: bool) -> str:
    return f"{name} *" if is_ceiling else name


def _print_ceilings(result: SaveBenchResult, out: TextIO, verbose: bool) -> None:
    """What the ceilings are: which configurations, and what '*' marks in the tables."""
    f, eng = result.fio, result.engine_ceiling
    w_ceiling, w_source = result.write_ceiling
    if w_ceiling:
        say(f"Ceilings   : * marks the ceiling of each table. Write: {w_ceiling:.2f} GB/s, the higher of fio's "
            "best configuration and the raw engine (fastpersist.io writing one page-locked buffer of the same "
            "size: no serialization, no copy), each median of one run per round. Read: the higher of fio's "
            "O_DIRECT and buffered (page cache) reads.", out)
    elif f is not None and f.error:
        say(f"Ceilings   : not measured (fio: {f.error})", out)
    if f is not None and f.best_write is not None and f.best_read is not None:
        tried = len({(r.block_size, r.iodepth, r.numjobs, r.direct, r.ioengine) for r in f.runs if r.rw == "write"})
        say(f"fio        : best of {tried} write configurations: {f.best_write.describe()}; best read: "
            f"{f.best_read.describe()}; buffered read: psync direct=0 bs=1M, page cache dropped first", out)
        if verbose:
            n_sweep = len(f.runs) - 3 * len(f.write_repeats)
            for r in f.runs[:max(0, n_sweep)]:
                say(f"  sweep    : {r.rw:5s} {r.gbps:6.2f} GB/s  {r.describe()}", out)
            say(f"  command  : {f.command}", out)
    if eng is not None:
        if eng.error:
            say(f"Raw engine : failed ({eng.error})", out)
        elif verbose and eng.settings:
            say(f"Raw engine : {eng.settings}", out)
    if verbose and w_source:
        say(f"Write ceil.: from {'fio' if w_source == 'fio' else 'the raw engine'}", out)


def _print_fio(ceiling: Any, out: TextIO) -> None:
    if ceiling is None:
        return
    if ceiling.best_write is not None and ceiling.best_read is not None:
        bw, br = ceiling.best_write, ceiling.best_read

        def runs(xs: Sequence[float]) -> str:
            return " ".join(f"{x:.2f}" for x in xs)

        print(f"fio        : write {ceiling.write_gbps:.2f} GB/s (median of {runs(ceiling.write_repeats)}; "
              f"bs {format_block(bw.block_size)}, iodepth {bw.iodepth}, fresh file each), "
              f"read {ceiling.read_gbps:.2f} GB/s (median of {runs(ceiling.read_repeats)}; "
              f"bs {format_block(br.block_size)}, iodepth {br.iodepth}), "
              f"libaio, direct={'1' if bw.direct else '0'}", file=out)
        if ceiling.buffered_read_gbps:
            print(f"fio buffer.: read {ceiling.buffered_read_gbps:.2f} GB/s (median of "
                  f"{runs(ceiling.buffered_read_repeats)}; psync, bs 1M, direct=0, page cache dropped first)",
                  file=out)
    elif ceiling.error:
        print(f"fio        : not measured ({ceiling.error})", file=out)


def print_io_report(result: IOBenchResult, out: Optional[TextIO] = None) -> None:
    """Machine header, one row per configuration, fio ceiling and notes of an I/O benchmark."""
    out = out if out is not None else sys.stdout
    print_header(result.machine.summary_lines(), out)
    print(f"File       : {format_bytes(result.size)} per configuration, {result.repeat} run(s) each", file=out)
    print(file=out)
    d = result.to_dict()
    rows = []
    for r in d["runs"]:
        name = r["engine"] if r["engine_used"] in (None, r["engine"]) else f"{r['engine']} ({r['engine_used']})"
        cfg = [name, format_block(r["block_size"]), str(r["queue_depth"]), str(r["threads"]),
               "on" if r["direct"] else "off", "staged" if r["stage_reads"] else "direct"]
        if r["error"] and not r["write_seconds"]:
            rows.append(cfg + ["-", "-", "-", "-", "-", "-", "failed"])
            continue
        rows.append(cfg + [
            _runs(r["write_gbps"]), _num(r["write_median_gbps"]), _ratio(r["write_vs_fio"]),
            _runs(r["read_gbps"]), _num(r["read_median_gbps"]), _ratio(r["read_vs_fio"]),
            "ok" if r["verified"] else ("-" if r["verified"] is None else "MISMATCH"),
        ])
    if result.fio is not None and (result.fio.write_gbps or result.fio.read_gbps):
        f = result.fio
        rows.append(["fio (ceiling)", "", "", "", "on" if (f.best_write and f.best_write.direct) else "", "",
                     "", _num(f.write_gbps), "1.00x" if f.write_gbps else "-",
                     "", _num(f.read_gbps), "1.00x" if f.read_gbps else "-", ""])
    headers = ["engine", "block", "qd", "threads", "O_DIRECT", "reads", "write GB/s (runs)", "write median",
               "vs fio", "read GB/s (runs)", "read median", "vs fio", "data"]
    render_table("Write (incl. fsync) / cold read of one file", headers, rows, out)
    _print_fio(result.fio, out)
    for r in result.runs:
        if r.error:
            c = r.config
            print(f"Error      : {c.engine} block {format_block(c.block_size)} qd {c.queue_depth} "
                  f"threads {c.threads} direct {'on' if c.direct else 'off'}"
                  f"{' staged' if c.stage_reads else ''}: {r.error}", file=out)
    best_w, best_r = result.best()
    if best_w is not None and best_r is not None:
        c, e = best_w.config, best_r.config
        print(f"Best write : {best_w.write_median_gbps:.2f} GB/s with {c.engine}, block {format_block(c.block_size)}, "
              f"qd {c.queue_depth}, threads {c.threads}", file=out)
        print(f"Best read  : {best_r.read_median_gbps:.2f} GB/s with {e.engine}, block {format_block(e.block_size)}, "
              f"qd {e.queue_depth}, threads {e.threads}, reads {'staged' if e.stage_reads else 'direct'}", file=out)
    for note in result.notes:
        print(f"Note       : {note}", file=out)


def parent_dir(path: str) -> None:
    """Create the folder a result file goes into (``--json out/x.json`` on a fresh checkout)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)


def write_json(data: dict[str, Any], path: str) -> None:
    """Write ``data`` as indented JSON to ``path`` (``-`` for standard output)."""
    text = json.dumps(data, indent=2, sort_keys=False, default=str)
    if path == "-":
        sys.stdout.write(text + "\n")
        return
    parent_dir(path)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")


def _fio_lines(ax: Any, fio: Any, write_label: str, read_label: str) -> None:
    """fio's write and read ceilings as horizontal lines, in the bars' colours."""
    if fio is not None and fio.write_gbps:
        ax.axhline(fio.write_gbps, color="#3b75af", linestyle="--", linewidth=1.2,
                   label=f"{write_label} {fio.write_gbps:.2f} GB/s")
    if fio is not None and fio.read_gbps:
        ax.axhline(fio.read_gbps, color="#ef8636", linestyle=":", linewidth=1.2,
                   label=f"{read_label} {fio.read_gbps:.2f} GB/s")


def finish_plot(fig: Any, ax: Any, path: str) -> None:
    """Legend, grid, layout; write the PNG (creating its folder) and free the figure."""
    import matplotlib.pyplot as plt

    ax.legend(fontsize=8, loc="best")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    parent_dir(path)
    fig.savefig(path, format="png", dpi=120)
    plt.close(fig)


def plot_save(result: SaveBenchResult, path: str) -> None:
    """Bar chart of median save and load GB/s per method, the write and read ceilings as horizontal lines (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in result.methods if m.save_s]
    names = [m.name for m in methods]
    saves = [m.save_median_gbps or 0.0 for m in methods]
    loads = [m.load_median_gbps or 0.0 for m in methods]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(names) + 3), 4.5))
    xs = list(range(len(names)))
    width = 0.38
    ax.bar([x - width / 2 for x in xs], saves, width, label="durable save (median)", color="#3b75af")
    ax.bar([x + width / 2 for x in xs], loads, width, label="cold load (median)", color="#ef8636")
    w_ceiling, w_source = result.write_ceiling
    if w_ceiling:
        src = "fio's best config" if w_source == "fio" else "raw engine"
        ax.axhline(w_ceiling, color="#3b75af", linestyle="--", linewidth=1.2,
                   label=f"write ceiling {w_ceiling:.2f} GB/s (best of fio configs and raw engine: {src})")
    r_ceiling = result.fio.read_ceiling_gbps if result.fio is not None else None
    if r_ceiling:
        ax.axhline(r_ceiling, color="#ef8636", linestyle=":", linewidth=1.2,
                   label=f"read ceiling {r_ceiling:.2f} GB/s (best of fio O_DIRECT and buffered reads)")
    ax.set_xticks(xs)
    ax.set_xticklabels(names)
    ax.set_ylabel("GB/s")
    w = result.workload
    ax.set_title(f"Checkpoint save/load, {format_bytes(w['tensor_bytes'])}, {w['tensors']} tensors "
                 f"({result.machine.filesystem} on {result.machine.block_device or result.machine.mount_source})")
    finish_plot(fig, ax, path)


def plot_io(result: IOBenchResult, path: str) -> None:
    """Bar chart of median write and read GB/s per configuration, fio's ceiling as lines (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result.runs if r.write_s]
    labels = [
        f"{r.config.engine}\n{format_block(r.config.block_size)} qd{r.config.queue_depth} "
        f"t{r.config.threads}{'' if r.config.direct else ' buf'}{' stg' if r.config.stage_reads else ''}"
        for r in runs
    ]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(runs) + 3), 4.8))
    xs = list(range(len(runs)))
    width = 0.38
    ax.bar([x - width / 2 for x in xs], [r.write_median_gbps or 0.0 for r in runs], width,
           label="write (median)", color="#3b75af")
    ax.bar([x + width / 2 for x in xs], [r.read_median_gbps or 0.0 for r in runs], width,
           label="cold read (median)", color="#ef8636")
    _fio_lines(ax, result.fio, "fio write", "fio read")
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("GB/s")
    ax.set_title(f"fastpersist I/O, {format_bytes(result.size)} file "
                 f"({result.machine.filesystem} on {result.machine.block_device or result.machine.mount_source})")
    finish_plot(fig, ax, path)
