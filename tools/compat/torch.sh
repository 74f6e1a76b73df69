#!/usr/bin/env bash
# torch's own serialization tests, stock and through the fastpersist switch.
#
#   bash tools/compat/torch.sh SCRATCH MODE        MODE: stock | fastpersist
#
# Upstream: pytorch/pytorch test/test_serialization.py at the commit of the installed torch
# (python -c "import torch; print(torch.version.git_version)"; torch 2.15.0:
# d0f2af8b66b20da4baa50644c0cd3f887a2eae2e). The file is expected at SCRATCH/torch/test_serialization.py;
# if it is missing it is fetched, with network access:
#   curl -fsSL https://raw.githubusercontent.com/pytorch/pytorch/<commit>/test/test_serialization.py \
#        -o SCRATCH/torch/test_serialization.py
# or, from a local git mirror of pytorch/pytorch (FASTPERSIST_COMPAT_MIRROR=<path to its git dir>):
#   git --git-dir "$FASTPERSIST_COMPAT_MIRROR" show <commit>:test/test_serialization.py
# FASTPERSIST_COMPAT_TORCH_FILE=<path> runs that file instead (a local copy, or an excerpt).
# The test file imports torch.testing._internal.common_utils, which ships in the torch wheel.
#
# "fastpersist" sets FASTPERSIST_PATCH_TORCH_SAVE=1: the start-up hook patches torch.save /
# torch.load in the pytest process as soon as torch is imported (no code change, no plugin).
# Results: SCRATCH/results/torch-MODE.xml; compare the two with
#   python tools/compat/compare.py SCRATCH/results/torch-stock.xml SCRATCH/results/torch-fastpersist.xml
# Extra pytest arguments: FASTPERSIST_COMPAT_PYTEST_ARGS (e.g. "-k 'not 2gb'"); time limit:
# FASTPERSIST_COMPAT_TIMEOUT seconds (default 3600).
set -euo pipefail

if [ $# -ne 2 ]; then
    echo "usage: $0 SCRATCH stock|fastpersist" >&2
    exit 2
fi
scratch=$(realpath -m "$1")
mode=$2
case "$mode" in
    stock) switch=0 ;;
    fastpersist) switch=1 ;;
    *) echo "$0: MODE must be stock or fastpersist, not '$mode'" >&2; exit 2 ;;
esac

python=${PYTHON:-python}
commit=$("$python" -c "import torch; print(torch.version.git_version)")
mkdir -p "$scratch/torch" "$scratch/results"
file=${FASTPERSIST_COMPAT_TORCH_FILE:-$scratch/torch/test_serialization.py}
if [ ! -f "$file" ]; then
    if [ -n "${FASTPERSIST_COMPAT_MIRROR:-}" ]; then
        git --git-dir "$FASTPERSIST_COMPAT_MIRROR" show "$commit:test/test_serialization.py" > "$file"
    else
        curl -fsSL "https://raw.githubusercontent.com/pytorch/pytorch/$commit/test/test_serialization.py" -o "$file"
    fi
fi

# the switch must be in the state the mode says, or the comparison means nothing
patched=$(FASTPERSIST_PATCH_TORCH_SAVE=$switch "$python" -c \
    "import torch; print(hasattr(torch.save, '_fastpersist_original'))")
want=$([ "$switch" = 1 ] && echo True || echo False)
if [ "$patched" != "$want" ]; then
    echo "$0: torch.save patched=$patched, expected $want for mode $mode (is fastpersist installed here?)" >&2
    exit 1
fi

xml="$scratch/results/torch-$mode.xml"
cd "$(dirname "$file")"
status=0
# FASTPERSIST_COMPAT_PYTEST_ARGS is split as the shell splits a command line, quotes
# included ("-k 'not 2gb and not mmap'" is two arguments), without running anything in it.
extra=()
if [ -n "${FASTPERSIST_COMPAT_PYTEST_ARGS:-}" ]; then
    mapfile -t extra < <("$python" -c 'import shlex, sys; print("\n".join(shlex.split(sys.argv[1])))' \
        "$FASTPERSIST_COMPAT_PYTEST_ARGS")
fi
FASTPERSIST_PATCH_TORCH_SAVE=$switch nice -n 10 timeout "${FASTPERSIST_COMPAT_TIMEOUT:-3600}" \
    "$python" -m pytest -q -p no:cacheprovider "$(basename "$file")" --junitxml="$xml" \
    "${extra[@]}" || status=$?
echo "$0: $mode: exit status $status, results in $xml"
# 1: some tests failed (compare the two runs); anything else: the run itself broke
[ "$status" -le 1 ] || exit "$status"
