#!/usr/bin/env bash
# Lightning's upstream checkpoint tests, stock or with fastpersist's CheckpointIO as the default.
#
# Upstream: Lightning-AI/pytorch-lightning tag 2.6.5 (installed: lightning 2.6.6, which has no
# tag in the mirror), tests/tests_pytorch (its conftest.py, helpers/) and tests/legacy.
#   git clone --depth 1 -b 2.6.5 https://github.com/Lightning-AI/pytorch-lightning SCRATCH/lightning
# or, from a local git mirror (FASTPERSIST_COMPAT_MIRROR=<git dir>), an index-only checkout
# (git archive of tests/ trips over missing LFS blobs in some mirrors).
# Extra test packages: cloudpickle pytest-rerunfailures tensorboard "jsonargparse[signatures]".
#
# fastpersist modes: tools/compat/lightning_plugin.py, in the pytest process (-p) and, through
# compat_plugins (tools/compat/plugins.sh), in the workers ddp_spawn Trainers start.
#
# Usage: bash tools/compat/lightning.sh SCRATCH MODE
#   MODE: stock | fastpersist (async saves, the default) | fastpersist-sync (async_save=False)
# Writes SCRATCH/results/lightning-MODE.xml.
set -euo pipefail
SCRATCH=${1:?usage: lightning.sh SCRATCH stock|fastpersist|fastpersist-sync}
MODE=${2:?usage: lightning.sh SCRATCH stock|fastpersist|fastpersist-sync}
REF=2.6.5
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/plugins.sh"
SRC="$SCRATCH/lightning"
if [ ! -f "$SRC/tests/tests_pytorch/conftest.py" ]; then
  mkdir -p "$SRC"
  if [ -n "${FASTPERSIST_COMPAT_MIRROR:-}" ]; then
    G="$FASTPERSIST_COMPAT_MIRROR"
    export GIT_INDEX_FILE="$SCRATCH/.lightning-index"
    git --git-dir="$G" --work-tree="$SRC" read-tree "$REF"
    git --git-dir="$G" ls-tree -r --name-only "$REF" tests/tests_pytorch tests/__init__.py tests/legacy \
      | (cd "$SRC" && xargs git --git-dir="$G" --work-tree="$SRC" checkout-index -f --)
    git --git-dir="$G" show "$REF:pyproject.toml" > "$SRC/pyproject.toml"
    unset GIT_INDEX_FILE
  else
    rm -rf "$SRC"
    git clone --depth 1 -b "$REF" https://github.com/Lightning-AI/pytorch-lightning "$SRC"
  fi
fi
mkdir -p "$SCRATCH/results"
TESTS=(tests/tests_pytorch/checkpointing/ tests/tests_pytorch/plugins/test_checkpoint_io_plugin.py
       tests/tests_pytorch/trainer/connectors/test_checkpoint_connector.py)
ARGS=(-q -p no:cacheprovider --junitxml="$SCRATCH/results/lightning-$MODE.xml")
case "$MODE" in
  stock) ;;
  # compat_plugins: the plugin also in the workers of ddp_spawn Trainers (fresh interpreters)
  fastpersist) export FASTPERSIST_COMPAT_LIGHTNING=async; ARGS+=(-p lightning_plugin); compat_plugins lightning_plugin ;;
  fastpersist-sync) export FASTPERSIST_COMPAT_LIGHTNING=sync; ARGS+=(-p lightning_plugin); compat_plugins lightning_plugin ;;
  *) echo "MODE must be stock, fastpersist or fastpersist-sync" >&2; exit 2 ;;
esac
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
cd "$SRC"
nice -n 10 python -m pytest "${ARGS[@]}" "${TESTS[@]}" || true
