#!/usr/bin/env bash
# safetensors' own torch tests (bindings/python/tests/test_pt_comparison.py and
# test_pt_model.py), stock or with fastpersist standing in for
# safetensors.torch.save_file/load_file/load_model (tools/compat/safetensors_plugin.py).
#
#   bash tools/compat/safetensors.sh SCRATCH stock|fastpersist
#
# Upstream ref: huggingface/safetensors commit 24b0b2857fef49be734b9ab72ce97c09bb25f5b9
# (2026-05-12; 0.8.0 has no tag in the mirror, and this commit's
# bindings/python/py_src/safetensors/torch.py is byte-identical to the installed
# safetensors 0.8.0's; v0.8.0-rc.0's differs). Fetched into SCRATCH/safetensors/ when
# missing, with network access:
#   git clone https://github.com/huggingface/safetensors SCRATCH/safetensors
#   git -C SCRATCH/safetensors checkout 24b0b2857fef49be734b9ab72ce97c09bb25f5b9
# or from a local mirror (FASTPERSIST_COMPAT_MIRROR=<path to a git dir>):
#   git --git-dir=$FASTPERSIST_COMPAT_MIRROR archive 24b0b2857fef49be734b9ab72ce97c09bb25f5b9 \
#       bindings/python/tests | tar -x -C SCRATCH/safetensors
# Writes SCRATCH/results/safetensors-MODE.xml; compare the two with
#   python tools/compat/compare.py SCRATCH/results/safetensors-stock.xml SCRATCH/results/safetensors-fastpersist.xml
set -euo pipefail

REF=24b0b2857fef49be734b9ab72ce97c09bb25f5b9
if [ $# -ne 2 ]; then
    echo "usage: $0 SCRATCH stock|fastpersist" >&2
    exit 2
fi
SCRATCH="$(mkdir -p "$1" && cd "$1" && pwd)"
MODE="$2"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SRC="$SCRATCH/safetensors"
TESTS="$SRC/bindings/python/tests"
PYTHON="${PYTHON:-python}"

if [ ! -f "$TESTS/test_pt_comparison.py" ]; then
    mkdir -p "$SRC"
    if [ -n "${FASTPERSIST_COMPAT_MIRROR:-}" ]; then
        git --git-dir="$FASTPERSIST_COMPAT_MIRROR" archive "$REF" bindings/python/tests | tar -x -C "$SRC"
    else
        rmdir "$SRC" 2>/dev/null || true
        git clone -q https://github.com/huggingface/safetensors "$SRC"
        git -C "$SRC" checkout -q "$REF"
    fi
fi

case "$MODE" in
    stock) plugin=() ;;
    fastpersist) plugin=(-p safetensors_plugin) ;;
    *) echo "MODE must be stock or fastpersist, not $MODE" >&2; exit 2 ;;
esac

mkdir -p "$SCRATCH/results" "$TESTS/data"
cd "$SRC/bindings/python"  # the tests write ./tests/data/... and ./tmp*.safetensors
rc=0
PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m pytest -q -p no:cacheprovider "${plugin[@]}" \
    --junitxml="$SCRATCH/results/safetensors-$MODE.xml" \
    tests/test_pt_comparison.py tests/test_pt_model.py || rc=$?
echo "results: $SCRATCH/results/safetensors-$MODE.xml (pytest exit status $rc)"
exit $rc
