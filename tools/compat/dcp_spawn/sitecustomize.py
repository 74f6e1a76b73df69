"""Run at the start of every Python process whose PYTHONPATH holds this folder, which
``tools/compat/dcp.sh`` puts there in its ``fastpersist`` mode: the substitution of
``dcp_plugin`` (DCP's FileSystemWriter/FileSystemReader -> fastpersist's) in the processes
the upstream suite starts itself. Its 2-rank tests (``MultiProcessTestCase``) start their
ranks with multiprocessing's ``spawn``: fresh interpreters that load no pytest plugin and
import the test module, and with it the stock classes, anew."""

import dcp_plugin  # noqa: F401 - the substitution happens on import
