"""Run at the start of every Python process whose PYTHONPATH holds this folder: imports
each module named in ``FASTPERSIST_COMPAT_PLUGINS`` (comma-separated, e.g.
``lightning_plugin``), the suite's pytest plugin, whose import makes the substitution.

The suite scripts (``tools/compat/<suite>.sh``) set both in their fastpersist modes
(``compat_plugins`` in ``tools/compat/plugins.sh``) so that the substitution reaches the
processes an upstream suite starts itself: DCP's 2-rank tests and Lightning's
``ddp_spawn`` Trainers start their workers with multiprocessing's ``spawn``, fresh
interpreters that load no pytest plugin. A plugin that fails to import is reported by
``site`` on stderr ("Error in sitecustomize") and the process goes on stock, so the scripts'
runs are checked by ``tests/test_compat_tools.py``.
"""

import importlib
import os

for _name in filter(None, (n.strip() for n in os.environ.get("FASTPERSIST_COMPAT_PLUGINS", "").split(","))):
    importlib.import_module(_name)
