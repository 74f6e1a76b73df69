#!/usr/bin/env bash
# Rerun the upstream projects' own test suites, stock and with fastpersist substituted,
# and compare them (docs/compat.md holds the table this produces and explains every
# remaining difference).
#
#   bash tools/compat/run.sh SCRATCH [SUITE ...]
#
# SCRATCH: a directory outside the project for the fetched upstream files and the
# results (SCRATCH/<suite>/ and SCRATCH/results/<suite>-<mode>.xml). SUITE: any of
# the suites below (default: all). Each suite's own script (tools/compat/<suite>.sh)
# says which upstream ref it fetches and how; FASTPERSIST_COMPAT_MIRROR=<git dir>
# makes the git-based ones archive from a local mirror instead of cloning.
# Exit status: 1 if any suite has a test that passes stock and fails with fastpersist.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
scratch="${1:?usage: run.sh SCRATCH [SUITE ...]}"; shift
mkdir -p "$scratch/results"
scratch="$(cd "$scratch" && pwd)"

# suite: the modes it runs with fastpersist (stock always runs first)
declare -A MODES=(
    [torch]="fastpersist"
    [safetensors]="fastpersist"
    [lightning]="fastpersist fastpersist-sync"
    [accelerate]="fastpersist"
    [dcp]="fastpersist"
    [deepspeed]="fastpersist"
)
ORDER=(torch safetensors lightning accelerate dcp deepspeed)
suites=("$@")
[ ${#suites[@]} -eq 0 ] && suites=("${ORDER[@]}")

status=0
for suite in "${suites[@]}"; do
    if [ -z "${MODES[$suite]+x}" ]; then
        echo "unknown suite: $suite (known: ${ORDER[*]})" >&2; exit 2
    fi
    echo "== $suite: stock"
    bash "$here/$suite.sh" "$scratch" stock
    for mode in ${MODES[$suite]}; do
        echo "== $suite: $mode"
        bash "$here/$suite.sh" "$scratch" "$mode"
        echo "== $suite: stock vs $mode"
        python "$here/compare.py" "$scratch/results/$suite-stock.xml" "$scratch/results/$suite-$mode.xml" || status=1
    done
done
exit $status
