#!/usr/bin/env bash
# DeepSpeed's checkpoint tests that run on CPU, stock and with fastpersist's checkpoint engine.
#
# Upstream: deepspeedai/DeepSpeed at commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641 (HEAD of
# master, version.txt 0.19.6; the installed 0.19.8 is not stored/tagged), directory tests/.
# Fetch (network):  git clone https://github.com/deepspeedai/DeepSpeed SCRATCH/ds-src &&
#                   git -C SCRATCH/ds-src checkout edaa7221267 && mv SCRATCH/ds-src/tests SCRATCH/deepspeed
# Fetch (mirror):   FASTPERSIST_COMPAT_MIRROR=/path/to/DeepSpeed.git bash tools/compat/deepspeed.sh SCRATCH MODE
#
# Usage: bash tools/compat/deepspeed.sh SCRATCH MODE [pytest args]   (MODE: stock | fastpersist)
# Test files: $DS_TESTS (default below: the CPU-capable checkpoint tests). DeepSpeed runs with
# DS_ACCELERATOR=cpu (gloo/ccl-less CPU accelerator). fastpersist: FASTPERSIST_DEEPSPEED=1, read
# by fastpersist's start-up hook in the test process and in every rank DeepSpeed's
# DistributedTest starts, so every engine gets FastPersistCheckpointEngine.
# Writes SCRATCH/results/deepspeed-MODE.xml.
set -euo pipefail
SCRATCH=${1:?usage: deepspeed.sh SCRATCH stock|fastpersist}
MODE=${2:?usage: deepspeed.sh SCRATCH stock|fastpersist}
REF=edaa7221267243c7be7fb49c5d5f5c4fb97b4641
SRC="$SCRATCH/deepspeed"
if [ ! -f "$SRC/unit/common.py" ]; then
  mkdir -p "$SRC"
  if [ -n "${FASTPERSIST_COMPAT_MIRROR:-}" ]; then
    git --git-dir="$FASTPERSIST_COMPAT_MIRROR" archive "$REF" tests/ | tar -x -C "$SRC" --strip-components=1
  else
    tmp=$(mktemp -d)
    git clone -q https://github.com/deepspeedai/DeepSpeed "$tmp/ds"
    git -C "$tmp/ds" checkout -q "$REF"
    cp -r "$tmp/ds/tests/." "$SRC/"
    rm -rf "$tmp"
  fi
fi
mkdir -p "$SCRATCH/results"
case "$MODE" in
  stock) export FASTPERSIST_DEEPSPEED=0 FASTPERSIST_PATCH_TORCH_SAVE=0 ;;
  fastpersist) export FASTPERSIST_DEEPSPEED=1 ;;
  *) echo "unknown MODE $MODE (stock | fastpersist)" >&2; exit 2 ;;
esac
export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1
DS_TESTS=${DS_TESTS:-"unit/checkpoint/test_latest_checkpoint.py unit/checkpoint/test_tag_validation.py unit/checkpoint/test_lr_scheduler.py unit/checkpoint/test_other_optimizer.py unit/checkpoint/test_shared_weights.py unit/checkpoint/test_zero_optimizer.py"}
cd "$SRC"
# shellcheck disable=SC2086
python -m pytest -q -p no:cacheprovider --rootdir="$SRC" $DS_TESTS \
  --junitxml="$SCRATCH/results/deepspeed-$MODE.xml" "${@:3}" || true
