#!/usr/bin/env bash
# Accelerate's own checkpoint tests, stock and with fastpersist's Accelerate adapter.
#
# Upstream: huggingface/accelerate at commit 16cb6eb80dd9aa8b4df1a63ef57863e455d53b83
# (HEAD of main, version 1.15.0.dev0; 1.15.0 itself is not tagged), files
# tests/test_state_checkpointing.py and tests/test_accelerator.py (plus tests/ helpers they import).
# Fetch (network):   git clone https://github.com/huggingface/accelerate SCRATCH/accelerate-src &&
#                    git -C SCRATCH/accelerate-src checkout 16cb6eb80dd9 && mkdir -p SCRATCH/accelerate && mv SCRATCH/accelerate-src/tests SCRATCH/accelerate/
# Fetch (mirror):    FASTPERSIST_COMPAT_MIRROR=/path/to/accelerate.git bash tools/compat/accelerate.sh SCRATCH MODE
#
# Usage: bash tools/compat/accelerate.sh SCRATCH MODE   (MODE: stock | fastpersist)
# fastpersist: FASTPERSIST_ACCELERATE=1, read by fastpersist's start-up hook in every process
# (the test processes and any subprocess they launch). Writes SCRATCH/results/accelerate-MODE.xml.
set -euo pipefail
SCRATCH=${1:?usage: accelerate.sh SCRATCH stock|fastpersist}
MODE=${2:?usage: accelerate.sh SCRATCH stock|fastpersist}
REF=16cb6eb80dd9aa8b4df1a63ef57863e455d53b83
SRC="$SCRATCH/accelerate"
# The tests go to SRC/tests (a package): a folder named "accelerate" on sys.path would shadow the library.
if [ ! -f "$SRC/tests/test_state_checkpointing.py" ]; then
  mkdir -p "$SRC"
  if [ -n "${FASTPERSIST_COMPAT_MIRROR:-}" ]; then
    git --git-dir="$FASTPERSIST_COMPAT_MIRROR" archive "$REF" tests/ | tar -x -C "$SRC"
  else
    tmp=$(mktemp -d)
    git clone -q https://github.com/huggingface/accelerate "$tmp/a"
    git -C "$tmp/a" checkout -q "$REF"
    cp -r "$tmp/a/tests" "$SRC/"
    rm -rf "$tmp"
  fi
fi
mkdir -p "$SCRATCH/results"
case "$MODE" in
  stock) export FASTPERSIST_ACCELERATE=0 FASTPERSIST_PATCH_TORCH_SAVE=0 ;;
  fastpersist) export FASTPERSIST_ACCELERATE=1 ;;
  *) echo "unknown MODE $MODE (stock | fastpersist)" >&2; exit 2 ;;
esac
export CUDA_VISIBLE_DEVICES="" ACCELERATE_USE_CPU=1
cd "$SRC"
# -p no:cacheprovider: nothing written into the upstream tree; rootdir SRC so test ids are stable.
python -m pytest -q -p no:cacheprovider --rootdir="$SRC" \
  tests/test_state_checkpointing.py tests/test_accelerator.py \
  --junitxml="$SCRATCH/results/accelerate-$MODE.xml" "${@:3}" || true
