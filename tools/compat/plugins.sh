# Sourced by the suite scripts. compat_plugins PLUGIN[,PLUGIN...]: the suite's pytest
# plugin(s) in this folder are imported at the start of every Python process of the run
# (spawn/sitecustomize.py reads FASTPERSIST_COMPAT_PLUGINS), the pytest process and the
# workers the upstream tests start themselves (multiprocessing spawn: no pytest plugin
# reaches those). Pass the same names to pytest with -p for its report header.
compat_plugins() {
  local here
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  export FASTPERSIST_COMPAT_PLUGINS="$1"
  export PYTHONPATH="$here/spawn:$here${PYTHONPATH:+:$PYTHONPATH}"
}
