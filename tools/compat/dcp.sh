#!/usr/bin/env bash
# DCP's file-system checkpoint test, stock and with fastpersist's DCP storage layer.
#
# Upstream: pytorch/pytorch test/distributed/checkpoint/test_file_system_checkpoint_cpu.py.
# The installed torch 2.15.0 was built from git d0f2af8b66b20da4baa50644c0cd3f887a2eae2e
# (python -c "import torch; print(torch.version.git_version)"); the copy we ran is the
# newest one stored for us, from commit 02dee1ad31d013c458c5071f1710da10a2d50392.
# Fetch (network): curl -fsSL -o SCRATCH/dcp/test_file_system_checkpoint_cpu.py \
#   https://raw.githubusercontent.com/pytorch/pytorch/$REF/test/distributed/checkpoint/test_file_system_checkpoint_cpu.py
# Fetch (mirror):  FASTPERSIST_COMPAT_MIRROR=/path/to/pytorch.git (archived at REF instead).
# Override REF with FASTPERSIST_COMPAT_REF (default: the installed torch's git version).
#
# Usage: bash tools/compat/dcp.sh SCRATCH MODE   (MODE: stock | fastpersist)
# fastpersist: tools/compat/dcp_plugin.py (pytest -p) replaces FileSystemWriter/FileSystemReader
# by fastpersist.dcp.FastPersistWriter/FastPersistReader, in the pytest process and (through
# compat_plugins, tools/compat/plugins.sh) in the ranks the 2-rank tests spawn.
# Writes SCRATCH/results/dcp-MODE.xml.
set -euo pipefail
SCRATCH=${1:?usage: dcp.sh SCRATCH stock|fastpersist}
MODE=${2:?usage: dcp.sh SCRATCH stock|fastpersist}
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/plugins.sh"
FILE=test/distributed/checkpoint/test_file_system_checkpoint_cpu.py
SRC="$SCRATCH/dcp"
if [ ! -f "$SRC/test_file_system_checkpoint_cpu.py" ]; then
  mkdir -p "$SRC"
  REF=${FASTPERSIST_COMPAT_REF:-$(python -c "import torch; print(torch.version.git_version)")}
  if [ -n "${FASTPERSIST_COMPAT_MIRROR:-}" ]; then
    git --git-dir="$FASTPERSIST_COMPAT_MIRROR" show "$REF:$FILE" > "$SRC/test_file_system_checkpoint_cpu.py"
  else
    curl -fsSL -o "$SRC/test_file_system_checkpoint_cpu.py" \
      "https://raw.githubusercontent.com/pytorch/pytorch/$REF/$FILE"
  fi
fi
mkdir -p "$SCRATCH/results"
PLUGIN=()
case "$MODE" in
  stock) ;;
  # compat_plugins: the same substitution in the ranks the 2-rank tests spawn (fresh
  # interpreters: no pytest plugin reaches them)
  fastpersist) PLUGIN=(-p dcp_plugin); compat_plugins dcp_plugin ;;
  *) echo "unknown MODE $MODE (stock | fastpersist)" >&2; exit 2 ;;
esac
export FASTPERSIST_PATCH_TORCH_SAVE=0 CUDA_VISIBLE_DEVICES=""
cd "$SRC"
python -m pytest -q -p no:cacheprovider --rootdir="$SRC" "${PLUGIN[@]}" test_file_system_checkpoint_cpu.py \
  --junitxml="$SCRATCH/results/dcp-$MODE.xml" "${@:3}" || true
