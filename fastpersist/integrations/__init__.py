"""Framework adapters: ``fastpersist.integrations.<name>`` (see ``integrations/__init__.py``).

In a wheel this file is replaced by the top-level ``integrations/__init__.py`` and the
adapters sit beside it. In a source tree or an editable install the adapters stay in
the repository's top-level ``integrations/`` folder: this file adds that folder to the
package's search path.
"""

import importlib as _importlib
import os as _os
import types as _types

_root = _os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
_src = _os.path.join(_root, "integrations")
# Only a fastpersist source tree (never some other top-level "integrations" package
# that happens to sit beside an installed fastpersist).
if _os.path.isfile(_os.path.join(_src, "_startup.py")) and _os.path.isdir(_os.path.join(_root, "native")):
    if _src not in __path__:
        __path__.append(_src)
del _os, _root, _src


#: the adapters, importable as attributes after ``import fastpersist`` alone
#: (``fastpersist.integrations.accelerate.enable(accelerator)``): imported on first use,
#: so that no framework is imported before it is asked for
ADAPTERS = ("accelerate", "deepspeed", "lightning")


def __getattr__(name: str) -> _types.ModuleType:
    if name in ADAPTERS:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
