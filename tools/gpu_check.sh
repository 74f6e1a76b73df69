#!/usr/bin/env bash
# One-command check of fastpersist's GPU path, for the few minutes a GPU machine is lent.
#
#   bash tools/gpu_check.sh OUTDIR [--size SIZE] [--scratch DIR] [--python PY]
#                                  [--no-build] [--steps a,b,...] [--budget SECONDS]
#
# Steps, in this order (--steps picks a subset; names as below):
#   env        GPU, driver, CUDA, torch, the scratch filesystem, whether libcufile loads
#   build      pip install --no-build-isolation --no-deps -e .  (the GPU machine's own
#              packages: it reaches no registry); --no-build skips it
#   gpu-tests  every test marked gpu (tests/test_gpu_path.py)
#   cpu-tests  the CUDA-related CPU tests (staging, load ring, path choice, CLI, no-init, pinned)
#   ceiling    the disk's O_DIRECT write and read (dd, 8 MiB blocks) on the scratch directory
#   bench-save fastpersist bench save --device cuda (pinned D2H/H2D ceilings, torch.save/torch.load)
#   bench-io   fastpersist bench io --device cuda, engines psync, aio, cufile
#   bench-train fastpersist bench train on the GPU: torch.save, fastpersist.save, async snapshot,
#              DCP async_save against the no-checkpoint loop (a 635 MiB checkpoint; 4 layers
#              below --size 512MiB)
#   stream     stream_weights(device="cuda") generate against the same model in GPU memory
#   read-depth the scratch disk's hardware queues and the load read depth they choose, against a
#              fixed 16 (docs/experiments/read_depth.py, 256 MiB and 1 GiB; no GPU needed)
#
# Without a CUDA device every step that needs one prints "SKIP (no CUDA device: ...)"; the
# others run. Each step has its own time limit, and the whole run a budget (--budget, default
# 420 s): a step that would start past the budget is skipped with a line saying so, so the
# script ends with its summary instead of being killed. --size scales bench-save, bench-io and
# ceiling (default 1GiB; 256MiB for a quick look). On an H200 VM (16 cores, virtio disk at
# 1-1.6 GB/s) the whole default run took 208 s, the build 15 s.
#
# On the device tool's machines (only 8 files come back from $OUT): run it on /tmp/gc, then
#   tar czf $OUT/gc.tgz -C /tmp gc
#
# Writes under OUTDIR: one NN-step.log per step, bench JSON files, summary.txt (one line per
# step: status, seconds) and summary.json. Exit status: 0 when no step failed (skips are not
# failures), 1 otherwise, 2 for a usage error.
set -uo pipefail

usage() { sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

[ $# -ge 1 ] || usage
OUTDIR="$1"; shift
case "$OUTDIR" in -*) usage ;; esac
SIZE="1GiB"; SCRATCH=""; PY="${PYTHON:-python3}"; BUILD=1; BUDGET=420
ALL_STEPS="env,build,gpu-tests,cpu-tests,ceiling,bench-save,bench-io,bench-train,stream,read-depth"
STEPS="$ALL_STEPS"
while [ $# -gt 0 ]; do
    case "$1" in
        --size) SIZE="$2"; shift 2 ;;
        --scratch) SCRATCH="$2"; shift 2 ;;
        --python) PY="$2"; shift 2 ;;
        --no-build) BUILD=0; shift ;;
        --steps) STEPS="$2"; shift 2 ;;
        --budget) BUDGET="$2"; shift 2 ;;
        -h|--help) usage ;;
        *) echo "gpu_check: unknown argument $1" >&2; usage ;;
    esac
done
for s in ${STEPS//,/ }; do
    case ",$ALL_STEPS," in *",$s,"*) ;; *) echo "gpu_check: unknown step $s (steps: $ALL_STEPS)" >&2; exit 2 ;; esac
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$OUTDIR" || exit 2
OUTDIR="$(cd "$OUTDIR" && pwd)"
MADE_SCRATCH=0
if [ -z "$SCRATCH" ]; then SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/fp-gpu-check.XXXXXX")" && MADE_SCRATCH=1; fi
mkdir -p "$SCRATCH" || exit 2
SCRATCH="$(cd "$SCRATCH" && pwd)"
cd "$ROOT" || exit 2
export PYTHONUNBUFFERED=1

# Bytes of --size (fastpersist's own parser, so 1GiB, 512M, 8MiB all work).
SIZE_BYTES="$("$PY" - "$SIZE" <<'PY' 2>/dev/null
import sys
try:
    from fastpersist.units import parse_size
except Exception:
    import re
    m = re.fullmatch(r"(\d+)([KMG]i?B?)?", sys.argv[1], re.I)
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[(m.group(2) or "")[:1].lower()]
    print(int(m.group(1)) * mult)
else:
    print(parse_size(sys.argv[1]))
PY
)" || { echo "gpu_check: --size $SIZE is not a size" >&2; exit 2; }
[ -n "$SIZE_BYTES" ] || { echo "gpu_check: --size $SIZE is not a size" >&2; exit 2; }

START=$SECONDS
N=0
FAILED=0
: > "$OUTDIR/summary.txt"
echo "[" > "$OUTDIR/summary.json.part"

# The libcufile of the nvidia-cufile wheel, when the loader's path does not hold one.
if [ -z "${FASTPERSIST_CUFILE_LIB:-}" ]; then
    lib="$("$PY" - <<'PY' 2>/dev/null
import glob, os
try:
    import nvidia
except ImportError:
    raise SystemExit
for base in list(nvidia.__path__):
    hits = sorted(glob.glob(os.path.join(base, "**", "libcufile.so*"), recursive=True))
    hits = [h for h in hits if "rdma" not in os.path.basename(h)]
    if hits:
        print(hits[0])
        break
PY
)"
    [ -n "$lib" ] && export FASTPERSIST_CUFILE_LIB="$lib"
fi

has_cuda() {
    "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
}
if has_cuda; then CUDA=1; NOCUDA=""; else
    CUDA=0
    NOCUDA="$("$PY" -c 'import torch; print("torch.cuda.is_available() is False; torch", torch.__version__, "built for CUDA", torch.version.cuda)' 2>&1 | tail -n 1)"
fi

record() {  # name status seconds note
    printf '%-12s %-8s %5ss  %s\n' "$1" "$2" "$3" "$4" | tee -a "$OUTDIR/summary.txt"
    local note="${4//\\/\\\\}"; note="${note//\"/\\\"}"
    printf '  {"step": "%s", "status": "%s", "seconds": %s, "note": "%s"},\n' "$1" "$2" "$3" "$note" \
        >> "$OUTDIR/summary.json.part"
}

# run_step NAME LIMIT NEEDS_CUDA COMMAND...: runs COMMAND with its output in NN-NAME.log.
run_step() {
    local name="$1" limit="$2" needs_cuda="$3"; shift 3
    case ",$STEPS," in *",$name,"*) ;; *) return 0 ;; esac
    N=$((N + 1))
    local log; log="$OUTDIR/$(printf '%02d' "$N")-$name.log"
    if [ "$needs_cuda" = 1 ] && [ "$CUDA" = 0 ]; then
        echo "SKIP (no CUDA device: $NOCUDA)" > "$log"
        record "$name" SKIP 0 "no CUDA device: $NOCUDA"
        return 0
    fi
    local used=$((SECONDS - START)) left
    left=$((BUDGET - used))
    if [ "$left" -lt 10 ]; then
        echo "SKIP (budget: ${used}s of ${BUDGET}s used)" > "$log"
        record "$name" SKIP 0 "budget: ${used}s of ${BUDGET}s used"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit ${limit}s): $*" | tee "$log"
    local t0=$SECONDS rc
    # timeout runs programs, not shell functions: the steps run in a child bash (exported below)
    timeout --kill-after=10 "$limit" bash -o pipefail -c '"$@"' step "$@" >> "$log" 2>&1
    rc=$?
    local dt=$((SECONDS - t0))
    if [ $rc -eq 0 ]; then
        record "$name" PASS "$dt" "$(basename "$log")"
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        FAILED=1
        record "$name" TIMEOUT "$dt" "killed at its ${limit}s limit; see $(basename "$log")"
        tail -n 25 "$log" | sed 's/^/    | /'
    else
        FAILED=1
        record "$name" FAIL "$dt" "exit $rc; see $(basename "$log")"
        tail -n 25 "$log" | sed 's/^/    | /'
    fi
}

step_env() {
    echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "host: $(uname -srm); $(nproc) cores; $(awk '/MemTotal/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo)"
    if command -v nvidia-smi > /dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
            --format=csv,noheader || true
    else
        echo "nvidia-smi: not found"
    fi
    "$PY" - <<'PY'
import os, platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "CUDA build", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs")
try:
    import fastpersist, fastpersist.io as fio
    print("fastpersist", fastpersist.__version__, "engines", fio.available_engines())
    print("cufile:", fio.cufile_status(), "| FASTPERSIST_CUFILE_LIB =", os.environ.get("FASTPERSIST_CUFILE_LIB"))
except Exception as e:  # not built yet: the build step comes next
    print("fastpersist: not importable yet:", type(e).__name__, e)
PY
    echo "scratch: $SCRATCH"
    df -hT "$SCRATCH" | tail -n 1
    findmnt -no SOURCE,FSTYPE,OPTIONS -T "$SCRATCH" 2>/dev/null || true
    command -v fio > /dev/null && fio --version || echo "fio: not found (dd gives the O_DIRECT ceiling)"
    return 0
}

step_build() {
    CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$PY" -m pip install --no-build-isolation --no-deps -e . &&
        "$PY" -c 'import fastpersist, fastpersist.io as f; print("built:", f.available_engines(), "cufile:", f.cufile_status())'
}

pytest_args() {  # xdist where it is installed
    if "$PY" -c 'import xdist' 2>/dev/null; then echo "-n $(( $(nproc) > 8 ? 8 : $(nproc) ))"; fi
}

step_gpu_tests() {
    # shellcheck disable=SC2046
    "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider --junitxml="$OUTDIR/gpu-tests.xml" tests/test_gpu_path.py
}

step_cpu_tests() {
    # shellcheck disable=SC2046
    "$PY" -m pytest -q -rs -p no:cacheprovider $(pytest_args) --junitxml="$OUTDIR/cpu-tests.xml" \
        tests/test_cuda_stage.py tests/test_cuda_load_ring.py tests/test_gpu_path_choice.py tests/test_gpu_cli.py \
        tests/test_cuda_not_initialised.py tests/test_pinned.py
}

step_ceiling() {
    # dd with O_DIRECT, 8 MiB blocks: the disk's write (fsync'd) and read ceiling for --size.
    local f="$SCRATCH/fp-gpu-check-dd.bin" count=$(( (SIZE_BYTES + (8 << 20) - 1) / (8 << 20) ))
    local w r
    w="$(dd if=/dev/zero of="$f" bs=8M count="$count" oflag=direct conv=fsync 2>&1 | tail -n 1)" || return 1
    r="$(dd if="$f" of=/dev/null bs=8M iflag=direct 2>&1 | tail -n 1)" || return 1
    rm -f "$f"
    echo "dd O_DIRECT write: $w"
    echo "dd O_DIRECT read : $r"
    "$PY" - "$w" "$r" "$OUTDIR/ceiling.json" <<'PY'
import json, re, sys
def gbps(line):  # "N bytes (...) copied, T s, X GB/s"
    m = re.match(r"(\d+) bytes.*copied, ([\d.]+) s", line)
    return round(int(m.group(1)) / float(m.group(2)) / 1e9, 3) if m else None
out = {"tool": "dd bs=8M O_DIRECT", "write_gbps": gbps(sys.argv[1]), "read_gbps": gbps(sys.argv[2])}
json.dump(out, open(sys.argv[3], "w"), indent=2)
print(out)
PY
}

fp() { "$PY" -m fastpersist "$@"; }

step_bench_save() {
    fp bench save --dir "$SCRATCH" --device cuda --size "$SIZE" --repeat 3 --json "$OUTDIR/bench-save.json"
}

step_bench_io() {
    fp bench io --dir "$SCRATCH" --device cuda --size "$SIZE" --repeat 3 --engines psync,aio,cufile \
        --json "$OUTDIR/bench-io.json"
}

step_bench_train() {
    # 55M parameters, a 635 MiB checkpoint (model + Adam): 52 s on an H200 VM for the four
    # methods and the baseline. A 12-layer, 1024-wide model (about 1.8 GiB) ran past 116 s
    # there, so larger --size values keep this model; below 512MiB a smaller one.
    local d=768 layers=6
    [ "$SIZE_BYTES" -lt $((512 << 20)) ] && { d=384; layers=4; }
    fp bench train --dir "$SCRATCH" --steps 40 --every 10 --layers "$layers" --d-model "$d" --seq 512 \
        --batch 16 --methods torch.save,fastpersist.save,async-snapshot,dcp.async_save --no-progress \
        --json "$OUTDIR/bench-train.json"
}

step_stream() {
    "$PY" - "$SCRATCH" "$OUTDIR/stream.json" <<'PY'
"""stream_weights(device="cuda") against the same model in GPU memory: same greedy tokens."""
import json, os, sys, time
import torch, transformers
import fastpersist
scratch, out = sys.argv[1], sys.argv[2]
cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                               num_attention_heads=16, num_key_value_heads=16, vocab_size=8000,
                               tie_word_embeddings=False)
torch.manual_seed(0)
ref = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
path = os.path.join(scratch, "fp-gpu-check-model.safetensors")
fastpersist.save({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
ref = ref.cuda()
prompt = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1)).cuda()
def gen(m):
    torch.cuda.synchronize(); t = time.perf_counter()
    with torch.no_grad():
        ids = m.generate(prompt, max_new_tokens=16, do_sample=False)
    torch.cuda.synchronize()
    return ids, time.perf_counter() - t
want, t_mem = gen(ref)
del ref; torch.cuda.empty_cache()
import accelerate
with accelerate.init_empty_weights():
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
model = fastpersist.stream_weights(model, path, device="cuda")
got, t_stream = gen(model)
same = torch.equal(want, got)
res = {"model_bytes": os.path.getsize(path), "new_tokens": 16, "memory_s": round(t_mem, 3),
       "stream_s": round(t_stream, 3), "same_tokens": same,
       "stream_weight_gbps": round(os.path.getsize(path) * 16 / t_stream / 1e9, 3)}
print(res)
json.dump(res, open(out, "w"), indent=2)
os.remove(path)
sys.exit(0 if same else 1)
PY
}

step_read_depth() {
    # The load read depth the scratch disk gets (one hardware queue: 2, else 16) against a
    # fixed 16, cold, interleaved, in one process and in fresh processes (docs/experiments/read_depth.py).
    local dev queues
    dev="$(stat -c '%Hd:%Ld' "$SCRATCH")"
    queues="$(ls -d /sys/dev/block/"$dev"/mq/[0-9]* /sys/dev/block/"$dev"/../mq/[0-9]* 2>/dev/null | wc -l)"
    echo "scratch device $dev: $queues hardware queue(s)"
    fp info --dir "$SCRATCH" | sed -n '/^Load reads/,/^Load memory/p' | sed '$d'
    "$PY" docs/experiments/read_depth.py --dir "$SCRATCH/fp-gpu-check-depth" --sizes 256MiB,1GiB --rounds 4 &&
        "$PY" docs/experiments/read_depth.py --dir "$SCRATCH/fp-gpu-check-depth" --sizes 1GiB --rounds 2 --fresh
}

export PY OUTDIR SCRATCH SIZE SIZE_BYTES
export -f step_env step_build pytest_args step_gpu_tests step_cpu_tests step_ceiling fp step_bench_save \
    step_bench_io step_bench_train step_stream step_read_depth
echo "gpu_check: OUTDIR $OUTDIR, scratch $SCRATCH, size $SIZE ($SIZE_BYTES bytes), budget ${BUDGET}s," \
     "CUDA $([ "$CUDA" = 1 ] && echo yes || echo "no ($NOCUDA)")"
run_step env 60 0 step_env
if [ "$BUILD" = 1 ]; then
    run_step build 240 0 step_build
    # A failed build leaves nothing to test.
    if grep -q '^build  *\(FAIL\|TIMEOUT\)' "$OUTDIR/summary.txt"; then STEPS="env,build"; fi
fi
run_step gpu-tests 180 1 step_gpu_tests
run_step cpu-tests 150 0 step_cpu_tests
run_step ceiling 60 0 step_ceiling
run_step bench-save 120 1 step_bench_save
run_step bench-io 90 1 step_bench_io
run_step bench-train 150 1 step_bench_train
run_step stream 90 1 step_stream
run_step read-depth 120 0 step_read_depth

sed '$ s/,$//' "$OUTDIR/summary.json.part" > "$OUTDIR/summary.json" && echo "]" >> "$OUTDIR/summary.json"
rm -f "$OUTDIR/summary.json.part"
echo "gpu_check: $((SECONDS - START))s in all; $([ $FAILED = 0 ] && echo "no step failed" || echo "FAILED steps above")" \
    | tee -a "$OUTDIR/summary.txt"
rm -rf "$SCRATCH"/fp-gpu-check-* 2>/dev/null
[ "$MADE_SCRATCH" = 1 ] && rm -rf "$SCRATCH"
exit $FAILED
