"""``fastpersist bench stream``: generate with a causal LM larger than the memory it runs under.

A LLaMA-shaped ``transformers`` model is built from a config (random weights, no
download) and written once as one ``.safetensors`` file (fastpersist's writer, with
CRC-32s). Then, each in a fresh process, interleaved round by round:

* ``fastpersist``: :func:`fastpersist.stream_weights` (blocks streamed with ``O_DIRECT``
  through a pinned ring, ``--prefetch`` blocks ahead, default 1), then ``generate``;
* ``accelerate``: Accelerate's big-model inference with disk offload
  (``load_checkpoint_and_dispatch`` with the blocks mapped to ``"disk"`` and an
  ``offload_folder``; the offloaded weights are read through memory maps);
* ``memory``: the model fully in memory (only without a limit: it does not fit);
* ``fio``: the disk's ``O_DIRECT`` sequential read (and write) in the same run
  (:class:`fastpersist.bench.fio.FioProbe`), one round per repeat.

Each model method runs under a memory cgroup (v1 ``memory.limit_in_bytes``, or v2
``memory.max``; the page cache counts against it) of ``--limit`` bytes and, unless
``--no-unlimited``, without one. Reported per run: tokens/s of ``generate`` (greedy,
``--new-tokens`` tokens after a ``--prompt``-token prompt, prefill included),
weight bytes streamed per second (fastpersist: bytes its reads moved during
``generate`` / its wall time), peak RSS (``VmHWM``) and the cgroup's peak usage;
the generated ids are compared across methods. DeepSpeed ZeRO-Inference is not
run: on a CPU-only machine its NVMe parameter offload needs the async_io op
(libaio) and a CUDA accelerator (see :func:`deepspeed_status`).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import fastpersist
from fastpersist import config as config_mod
from fastpersist import handles
from fastpersist.bench import report
from fastpersist.bench.fio import FioProbe
from fastpersist.machine import collect_machine_info
from fastpersist.bench.report import parent_dir, print_header, render_table
from fastpersist.commit import atomic_write
from fastpersist.formats.safetensors import plan_safetensors
from fastpersist.streaming import find_blocks, streamer_of

METHODS = ("fastpersist", "accelerate", "memory")

#: glibc's mmap threshold set in every run's environment (``MALLOC_MMAP_THRESHOLD_``; 0: glibc's
#: default). glibc raises its threshold to the size of each large block freed (up to 32 MiB), so
#: the per-layer weight copies Accelerate's disk offload makes at each forward (25 MB each here)
#: then come from the heap and stay there when freed: measured on the default model, its
#: anonymous memory grew from 0.52 GB after dispatch to 2.9 GB during ``generate`` (and the OOM
#: killer ended it under 1.17, 1.5 and 2 GiB limits); with a fixed 1 MiB threshold it stayed at
#: 0.57 GB. Every method gets the same setting; fastpersist's ring is its own mapping either way.
DEFAULT_MMAP_THRESHOLD = 1 << 20
_CGROUP_V1 = "/sys/fs/cgroup/memory"
_CGROUP_V2 = "/sys/fs/cgroup"


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class ModelShape:
    """The LLaMA-shaped model of the benchmark."""

    layers: int = 32
    hidden: int = 1536
    intermediate: int = 4096
    vocab: int = 8000
    heads: int = 12

    def config(self) -> Any:
        import transformers

        return transformers.LlamaConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.heads,
            max_position_embeddings=256, tie_word_embeddings=False,
        )

    def weight_bytes(self) -> int:
        """fp32 bytes of every weight (blocks, embeddings, head, norms)."""
        h, i, v = self.hidden, self.intermediate, self.vocab
        per_layer = 4 * h * h + 3 * h * i + 2 * h
        return 4 * (self.layers * per_layer + 2 * v * h + h)

    def block_bytes(self) -> int:
        h, i = self.hidden, self.intermediate
        return 4 * (4 * h * h + 3 * h * i + 2 * h)


def write_checkpoint(shape: ModelShape, path: str, seed: int = 0, shard_bytes: int = 256 << 20) -> int:
    """Build the model with random weights and write it as a sharded safetensors folder (what
    ``save_pretrained`` writes: shards of at most ``shard_bytes`` plus ``model.safetensors.index.json``),
    each shard in fastpersist's layout (aligned data, CRC-32s) with ``{"format": "pt"}``; total bytes.

    Shards keep Accelerate's setup within the memory limit: it reads a checkpoint one whole file at a time."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(shape.config())
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    groups: list[dict[str, Any]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if groups[-1] and size + n > shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += n
    os.makedirs(path, exist_ok=True)
    cfg = config_mod.resolve(None)
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        full = os.path.join(path, fname)
        plan = plan_safetensors(group, {"format": "pt"}, 4096, checksum=True)
        handle = handles.handle_for(cfg)
        atomic_write(full, lambda tmp: handle.write(tmp, plan.extents, plan.patches, plan.nslots, truncate=True,
                                                   fsync=cfg.fsync), fsync=cfg.fsync)
        del plan
        weight_map.update({k: fname for k in group})
        total += os.path.getsize(full)
    with open(os.path.join(path, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    del tensors, model
    return total


def deepspeed_status() -> str:
    """Why DeepSpeed ZeRO-Inference (ZeRO-3, parameters offloaded to NVMe) does or does not run here."""
    try:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.ops.op_builder import AsyncIOBuilder

        acc = get_accelerator().device_name()
        aio = AsyncIOBuilder().is_compatible(verbose=False)
    except Exception as e:  # noqa: BLE001 - any import/probe failure is the answer
        return f"not run: deepspeed unusable here ({type(e).__name__}: {e})"
    if acc != "cuda" or not aio:
        return (f"not run: ZeRO-Inference's NVMe parameter offload needs DeepSpeed's async_io op (libaio; "
                f"compatible here: {aio}) and a CUDA accelerator (here: {acc!r})")
    return "available (not part of this benchmark yet)"


# --------------------------------------------------------------------------- one run (child process)


def _vm(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _device_map(model: Any, blocks: list[Any]) -> dict[str, str]:
    """Accelerate device map: the blocks on "disk", every other module on "cpu"."""
    block_ids = {id(b) for b in blocks}
    out: dict[str, str] = {}

    def walk(m: Any, prefix: str) -> None:
        for name, child in m.named_children():
            full = prefix + name
            if id(child) in block_ids:
                out[full] = "disk"
            elif any(id(x) in block_ids for x in child.modules()):
                walk(child, full + ".")
            else:
                out[full] = "cpu"
        for name, _ in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False)):
            out[prefix + name] = "cpu"

    walk(model, "")
    return out


def child_main(argv: Sequence[str]) -> int:
    """``python -m fastpersist.bench.stream_bench METHOD JSON``: one run; prints one JSON line."""
    method, spec = argv[0], json.loads(argv[1])
    import torch
    import transformers
    from accelerate import init_empty_weights

    shape = ModelShape(**spec["shape"])
    ckpt = spec["checkpoint"]
    started = time.perf_counter()
    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(shape.config())
    model.eval()
    out: dict[str, Any] = {}
    if method == "fastpersist":
        fastpersist.stream_weights(model, ckpt, prefetch=spec["prefetch"])
    elif method == "accelerate":
        from accelerate import load_checkpoint_and_dispatch

        dm = _device_map(model, find_blocks(model))
        model = load_checkpoint_and_dispatch(model, ckpt, device_map=dm, offload_folder=spec["offload_folder"])
    elif method == "memory":
        from safetensors.torch import load_file

        sd: dict[str, Any] = {}
        for name in sorted(os.listdir(ckpt)):
            if name.endswith(".safetensors"):
                sd.update(load_file(os.path.join(ckpt, name)))
        model.load_state_dict(sd, strict=False, assign=True)
        model.tie_weights()
    else:
        raise SystemExit(f"unknown method {method!r}")
    out["setup_s"] = time.perf_counter() - started
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, shape.vocab, (1, spec["prompt"]), generator=g)
    s = streamer_of(model)
    before = s.bytes_read if s is not None else 0
    t0 = time.perf_counter()
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=spec["new_tokens"],
                             min_new_tokens=spec["new_tokens"], do_sample=False, pad_token_id=0)
    seconds = time.perf_counter() - t0
    new = gen.shape[1] - ids.shape[1]
    out.update(
        seconds=seconds, new_tokens=int(new), tokens_per_s=new / seconds,
        streamed_bytes=(s.bytes_read - before) if s is not None else None,
        read_gbps=(s.bytes_read / s.read_seconds / 1e9) if s is not None and s.read_seconds else None,
        peak_rss=_vm("VmHWM"), ids=gen[0].tolist(),
    )
    print("RESULT " + json.dumps(out), flush=True)
    return 0


# --------------------------------------------------------------------------- memory cgroup


class MemoryCgroup:
    """A memory cgroup of ``limit`` bytes for one child process (v1 or v2), removed by :meth:`close`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        name = f"fastpersist-stream-{os.getpid()}-{time.monotonic_ns()}"
        if os.path.isfile(os.path.join(_CGROUP_V1, "memory.limit_in_bytes")):
            self.version = 1
            self.path = os.path.join(_CGROUP_V1, name)
            os.mkdir(self.path)
            self._write("memory.limit_in_bytes", str(limit))
        elif os.path.isfile(os.path.join(_CGROUP_V2, "cgroup.controllers")):
            self.version = 2
            self.path = os.path.join(_CGROUP_V2, name)
            os.mkdir(self.path)
            self._write("memory.max", str(limit))
            try:
                self._write("memory.swap.max", "0")
            except OSError:
                pass
        else:
            raise OSError("no memory cgroup controller found (v1 /sys/fs/cgroup/memory or v2 /sys/fs/cgroup)")

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w", encoding="ascii") as f:
            f.write(value)

    def _read(self, name: str) -> Optional[int]:
        try:
            with open(os.path.join(self.path, name), encoding="ascii") as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def enter(self) -> None:
        """Move the calling process into the cgroup (``preexec_fn`` of the child)."""
        self._write("cgroup.procs", str(os.getpid()))

    def peak(self) -> Optional[int]:
        return self._read("memory.max_usage_in_bytes" if self.version == 1 else "memory.peak")

    def close(self) -> None:
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


def cgroup_status() -> str:
    """Whether a memory cgroup can be made here, and which version."""
    try:
        cg = MemoryCgroup(1 << 30)
    except OSError as e:
        return f"unavailable ({e})"
    v = cg.version
    cg.close()
    return f"v{v}"


@dataclass
class Run:
    method: str
    limit: Optional[int]
    ok: bool
    error: Optional[str] = None
    seconds: Optional[float] = None
    new_tokens: Optional[int] = None
    tokens_per_s: Optional[float] = None
    streamed_bytes: Optional[int] = None
    stream_gbps: Optional[float] = None
    read_gbps: Optional[float] = None  # fastpersist: bytes / time its reading thread spent reading
    setup_s: Optional[float] = None
    peak_rss: Optional[int] = None
    cgroup_peak: Optional[int] = None
    ids: Optional[list[int]] = None
    load: Optional[tuple[float, float, float]] = None  # os.getloadavg() at the start


def child_env(mmap_threshold: int) -> dict[str, str]:
    """The environment of a run: this one, with glibc's mmap threshold fixed at ``mmap_threshold``
    bytes (:data:`DEFAULT_MMAP_THRESHOLD`; 0 leaves glibc's dynamic threshold)."""
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    return env


def run_one(method: str, spec: dict[str, Any], limit: Optional[int], timeout: float,
            mmap_threshold: int = DEFAULT_MMAP_THRESHOLD) -> Run:
    """One method in a fresh process, under a memory cgroup of ``limit`` bytes (None: none)."""
    cg = MemoryCgroup(limit) if limit is not None else None
    load = os.getloadavg()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "fastpersist.bench.stream_bench", method, json.dumps(spec)],
            capture_output=True, text=True, timeout=timeout, preexec_fn=cg.enter if cg else None,
            env=child_env(mmap_threshold),
        )
        peak = cg.peak() if cg else None
    except subprocess.TimeoutExpired:
        return Run(method, limit, False, error=f"did not finish within {timeout:.0f} s", load=load)
    finally:
        if cg:
            cg.close()
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        why = "killed by SIGKILL (out of memory under the limit?)" if proc.returncode == -9 else \
            f"exit {proc.returncode}: {(proc.stderr.strip() or proc.stdout.strip())[-600:]}"
        return Run(method, limit, False, error=why, cgroup_peak=peak, load=load)
    r = json.loads(line[len("RESULT "):])
    gbps = r["streamed_bytes"] / r["seconds"] / 1e9 if r.get("streamed_bytes") else None
    return Run(method, limit, True, seconds=r["seconds"], new_tokens=r["new_tokens"],
               tokens_per_s=r["tokens_per_s"], streamed_bytes=r["streamed_bytes"], stream_gbps=gbps,
               read_gbps=r.get("read_gbps"),
               setup_s=r["setup_s"], peak_rss=r["peak_rss"], cgroup_peak=peak, ids=r["ids"], load=load)


# --------------------------------------------------------------------------- the benchmark


@dataclass
class StreamBenchResult:
    machine: Any
    shape: ModelShape
    checkpoint_bytes: int
    limit: Optional[int]
    prefetch: int
    prompt: int
    new_tokens: int
    runs: list[Run] = field(default_factory=list)
    fio: Any = None
    deepspeed: str = ""
    cgroup: str = ""
    order: list[list[str]] = field(default_factory=list)
    mmap_threshold: int = DEFAULT_MMAP_THRESHOLD

    def cases(self) -> list[tuple[str, Optional[int]]]:
        seen: list[tuple[str, Optional[int]]] = []
        for r in self.runs:
            if (r.method, r.limit) not in seen:
                seen.append((r.method, r.limit))
        return seen

    def of(self, method: str, limit: Optional[int]) -> list[Run]:
        return [r for r in self.runs if r.method == method and r.limit == limit]

    def median(self, method: str, limit: Optional[int], attr: str) -> Optional[float]:
        vals = [getattr(r, attr) for r in self.of(method, limit) if r.ok and getattr(r, attr) is not None]
        return statistics.median(vals) if vals else None

    def outputs_identical(self) -> Optional[bool]:
        ids = [r.ids for r in self.runs if r.ok and r.ids is not None]
        return all(i == ids[0] for i in ids) if ids else None

    def ratios(self) -> dict[str, Optional[float]]:
        def div(a: Optional[float], b: Optional[float]) -> Optional[float]:
            return a / b if a is not None and b else None

        fio_read = self.fio.read_gbps if self.fio is not None else None
        lim = self.limit
        return {
            "tokens_per_s_fastpersist_vs_accelerate_under_limit": div(
                self.median("fastpersist", lim, "tokens_per_s"), self.median("accelerate", lim, "tokens_per_s")),
            "stream_gbps_vs_fio_read_under_limit": div(self.median("fastpersist", lim, "stream_gbps"), fio_read),
            "stream_gbps_vs_fio_read_unlimited": div(self.median("fastpersist", None, "stream_gbps"), fio_read),
            "model_bytes_vs_limit": div(float(self.checkpoint_bytes), float(lim) if lim else None),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "benchmark": "stream",
            "machine": self.machine.to_dict() if self.machine is not None else None,
            "model": {**asdict(self.shape), "weight_bytes": self.shape.weight_bytes(),
                      "block_bytes": self.shape.block_bytes(), "checkpoint_bytes": self.checkpoint_bytes},
            "limit_bytes": self.limit, "prefetch": self.prefetch, "prompt_tokens": self.prompt,
            "new_tokens": self.new_tokens, "malloc_mmap_threshold": self.mmap_threshold, "cgroup": self.cgroup, "deepspeed_zero_inference": self.deepspeed,
            "runs": [{k: v for k, v in asdict(r).items() if k != "ids"} for r in self.runs],
            "medians": {f"{m}@{'limit' if lim else 'unlimited'}": {
                a: self.median(m, lim, a) for a in ("tokens_per_s", "stream_gbps", "read_gbps", "peak_rss", "cgroup_peak", "setup_s")
            } for m, lim in self.cases()},
            "fio": self.fio.to_dict() if self.fio is not None else None,
            "ratios": self.ratios(),
            "outputs_identical": self.outputs_identical(),
            "order": self.order,
        }


def run_stream_bench(
    directory: str,
    *,
    shape: ModelShape = ModelShape(),
    limit: Optional[int] = 1 << 30,
    unlimited: bool = True,
    methods: Sequence[str] = METHODS,
    prefetch: int = 1,
    prompt: int = 8,
    new_tokens: int = 4,
    repeat: int = 1,
    fio: bool = True,
    fio_size: Optional[int] = None,
    timeout: float = 900.0,
    progress: bool = True,
    keep: bool = False,
    mmap_threshold: int = DEFAULT_MMAP_THRESHOLD,
) -> StreamBenchResult:
    """Write the checkpoint, then ``repeat`` rounds of every (method, limit) and one fio round each."""
    def say(msg: str) -> None:
        if progress:
            print(f"[bench stream {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    work = tempfile.mkdtemp(prefix="fastpersist-stream-", dir=directory)
    result = StreamBenchResult(collect_machine_info(directory, probe_memory=False), shape, 0,
                               limit, prefetch, prompt, new_tokens)
    result.mmap_threshold = mmap_threshold
    result.deepspeed = deepspeed_status()
    result.cgroup = cgroup_status() if limit is not None else "not used"
    probe = None
    try:
        ckpt = os.path.join(work, "model")
        say(f"writing the checkpoint ({shape.weight_bytes() / 1e9:.2f} GB)")
        result.checkpoint_bytes = write_checkpoint(shape, ckpt)
        spec = {"shape": asdict(shape), "checkpoint": ckpt, "prefetch": prefetch, "prompt": prompt,
                "new_tokens": new_tokens, "offload_folder": os.path.join(work, "offload")}
        cases: list[tuple[str, Optional[int]]] = []
        if limit is not None:
            cases += [(m, limit) for m in methods if m != "memory"]
        if unlimited or limit is None:
            cases += [(m, None) for m in methods]
        if fio:
            probe = FioProbe(work, fio_size or min(result.checkpoint_bytes, 2 << 30))
            say("fio sweep")
            probe.sweep()
        for rnd in range(repeat):
            order: list[str] = []
            if probe is not None:
                say(f"round {rnd + 1}: fio")
                probe.round()
                order.append("fio")
            for m, lim in (cases if rnd % 2 == 0 else list(reversed(cases))):
                say(f"round {rnd + 1}: {m} {'limit ' + str(lim) if lim else 'no limit'} (load {os.getloadavg()[0]:.1f})")
                shutil.rmtree(spec["offload_folder"], ignore_errors=True)
                r = run_one(m, spec, lim, timeout, mmap_threshold)
                say(f"  -> {r.tokens_per_s and round(r.tokens_per_s, 3)} tok/s"
                    + (f", {r.stream_gbps:.2f} GB/s streamed" if r.stream_gbps else "") + ("" if r.ok else f" FAILED: {r.error}"))
                result.runs.append(r)
                order.append(f"{m}@{'limit' if lim else 'unlimited'}")
            result.order.append(order)
        if probe is not None:
            result.fio = probe.result
    finally:
        if probe is not None:
            probe.close()
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    return result


# --------------------------------------------------------------------------- report


def _gb(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def print_stream_report(result: StreamBenchResult, out: Any = None) -> None:
    """Machine header, model, the table, fio, ratios and notes."""
    out = out if out is not None else sys.stdout
    if result.machine is not None:
        print_header(result.machine.summary_lines(), out)
    s = result.shape
    print(f"Model      : LLaMA-shaped, {s.layers} layers, hidden {s.hidden}, intermediate {s.intermediate}, vocab "
          f"{s.vocab}, fp32: {result.checkpoint_bytes / 1e9:.2f} GB checkpoint ({s.block_bytes() / 1e6:.0f} MB per block)",
          file=out)
    lim = result.limit
    print(f"Limit      : {'none' if lim is None else f'{lim / 2**30:.2f} GiB memory cgroup ({result.cgroup})'}; "
          f"model / limit = {result.ratios()['model_bytes_vs_limit'] or 0:.2f}x", file=out)
    print(f"Generate   : prompt {result.prompt} tokens, {result.new_tokens} new tokens (greedy), prefetch "
          f"{result.prefetch}", file=out)
    mt = result.mmap_threshold
    print(f"Malloc     : every run with glibc's mmap threshold "
          + (f"fixed at {mt} B (MALLOC_MMAP_THRESHOLD_; --malloc-mmap-threshold 0 for glibc's default)" if mt
             else "at glibc's dynamic default"), file=out)
    rows = []
    fio_read = result.fio.read_gbps if result.fio is not None else None
    for m, l in result.cases():
        runs = result.of(m, l)
        ok = [r for r in runs if r.ok]
        tps = result.median(m, l, "tokens_per_s")
        gbps = result.median(m, l, "stream_gbps")
        rows.append([
            f"{m} ({'limit' if l else 'no limit'})",
            "-" if tps is None else f"{tps:.3f}",
            " ".join(f"{r.tokens_per_s:.3f}" for r in ok) or "-",
            "-" if gbps is None else f"{gbps:.2f}",
            "-" if gbps is None or not fio_read else f"{gbps / fio_read:.2f}x",
            "-" if result.median(m, l, "read_gbps") is None else f"{result.median(m, l, 'read_gbps'):.2f}",
            _gb(result.median(m, l, "peak_rss")),
            _gb(result.median(m, l, "cgroup_peak")),
            "-" if result.median(m, l, "setup_s") is None else f"{result.median(m, l, 'setup_s'):.1f}",
            f"{len(ok)}/{len(runs)}" + ("" if len(ok) == len(runs) else " (" + "; ".join(
                (r.error or "")[:80] for r in runs if not r.ok) + ")"),
        ])
    render_table("Generation with weights larger than memory",
                 ["method", "tok/s", "runs", "stream GB/s", "vs fio read", "read GB/s", "peak RSS GB", "cgroup peak GB",
                  "setup s", "ok"], rows, out)
    if result.fio is not None:
        f = result.fio
        print(f"fio        : O_DIRECT read {f.read_gbps and round(f.read_gbps, 2)} GB/s (rounds "
              f"{' '.join(f'{x:.2f}' for x in f.read_repeats)}), write {f.write_gbps and round(f.write_gbps, 2)} GB/s"
              + (f"; error: {f.error}" if f.error else ""), file=out)
    for k, v in result.ratios().items():
        print(f"{k:<51}: {'-' if v is None else f'{v:.2f}x'}", file=out)
    print(f"Outputs    : generated ids identical across methods: {result.outputs_identical()}", file=out)
    print(f"Load avg   : {' | '.join(f'{r.method}: {r.load[0]:.1f}' for r in result.runs if r.load)}", file=out)
    print(f"DeepSpeed  : ZeRO-Inference {result.deepspeed}", file=out)


def plot_stream(result: StreamBenchResult, path: str) -> None:
    """Bars: tokens/s per (method, limit); second panel: fastpersist's streamed GB/s against fio's read."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = result.cases()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{m}\n{'limit' if l else 'no limit'}" for m, l in cases]
    vals = [result.median(m, l, "tokens_per_s") or 0 for m, l in cases]
    ax1.bar(labels, vals, color=["#3b75af" if m == "fastpersist" else "#aaaaaa" for m, _ in cases])
    ax1.set_ylabel("tokens/s (median)")
    ax1.set_title("generate, weights streamed from disk")
    st = [(l, result.median("fastpersist", l, "stream_gbps") or 0) for m, l in cases if m == "fastpersist"]
    ax2.bar([("limit" if l else "no limit") for l, _ in st], [v for _, v in st], color="#3b75af")
    if result.fio is not None and result.fio.read_gbps:
        ax2.axhline(result.fio.read_gbps, color="#ef8636", linestyle=":", label=f"fio O_DIRECT read {result.fio.read_gbps:.2f} GB/s")
        ax2.legend(fontsize=8)
    ax2.set_ylabel("GB/s")
    ax2.set_title("fastpersist weight bytes streamed per second")
    fig.tight_layout()
    parent_dir(path)
    fig.savefig(path, format="png", dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI


def add_cli(bsub: Any, debug: Any, add_outputs: Any, size: Any, positive: Any) -> None:
    """Register ``fastpersist bench stream`` on the ``bench`` subparsers."""
    p = bsub.add_parser(
        "stream", parents=[debug],
        help="generate with a causal LM larger than a memory limit: fastpersist.stream_weights vs Accelerate's "
        "disk offload vs fully in memory, beside fio's O_DIRECT read",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--dir", required=True, help="directory on the disk to measure (the checkpoint goes there)")
    p.add_argument("--layers", type=positive, default=32)
    p.add_argument("--hidden", type=positive, default=1536)
    p.add_argument("--intermediate", type=positive, default=4096)
    p.add_argument("--vocab", type=positive, default=8000)
    p.add_argument("--heads", type=positive, default=12)
    p.add_argument("--limit", type=size, default=1 << 30, help="memory cgroup limit (default: 1GiB)")
    p.add_argument("--no-limit", action="store_true", help="run without a memory limit only")
    p.add_argument("--no-unlimited", action="store_true", help="run under the limit only")
    p.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    p.add_argument("--prefetch", type=positive, default=1,
                   help="fastpersist's prefetch (default: 1; under 1 GiB, 3 slots of 113 MB beside ~320 MB of "
                   "interpreter and libraries would leave the process at its limit)")
    p.add_argument("--prompt", type=positive, default=8, help="prompt tokens (default: 8)")
    p.add_argument("--new-tokens", type=positive, default=4, help="tokens to generate (default: 4)")
    p.add_argument("--repeat", type=positive, default=1, help="rounds (default: 1)")
    p.add_argument("--no-fio", action="store_true", help="skip fio")
    p.add_argument("--fio-size", type=size, default=None, help="bytes of fio's file (default: min(model, 2GiB))")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint")
    p.add_argument("--malloc-mmap-threshold", type=int, default=DEFAULT_MMAP_THRESHOLD, metavar="BYTES",
                   help="glibc's mmap threshold in every run (default: 1 MiB, so that freed per-layer copies of "
                   "Accelerate's offload go back to the system; 0: glibc's dynamic default, under which "
                   "Accelerate's memory grows to most of the model)")
    add_outputs(p, plot="write tokens/s and streamed GB/s charts (PNG)")
    p.set_defaults(func=cmd_bench_stream)


def cmd_bench_stream(args: Any) -> int:
    """``fastpersist bench stream``."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ValueError(f"--methods: unknown {bad}; choose from {','.join(METHODS)}")
    if not os.path.isdir(args.dir):
        raise FileNotFoundError(f"--dir {args.dir!r} does not exist")
    shape = ModelShape(args.layers, args.hidden, args.intermediate, args.vocab, args.heads)
    result = run_stream_bench(
        args.dir, shape=shape, limit=None if args.no_limit else args.limit, unlimited=not args.no_unlimited,
        methods=methods, prefetch=args.prefetch, prompt=args.prompt, new_tokens=args.new_tokens,
        repeat=args.repeat, fio=not args.no_fio, fio_size=args.fio_size, progress=not args.no_progress,
        keep=args.keep, mmap_threshold=args.malloc_mmap_threshold,
    )
    out = sys.stderr if args.json == "-" else sys.stdout
    print_stream_report(result, out)
    if args.json:
        report.write_json(result.to_dict(), args.json)
    if args.plot:
        plot_stream(result, args.plot)
        print(f"Plot       : {args.plot}", file=out)
    return 0 if all(r.ok for r in result.runs if r.method == "fastpersist") and result.outputs_identical() is not False else 1


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
