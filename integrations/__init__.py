"""Framework adapters: ``fastpersist.integrations.<name>``.

One module per framework, each thin (it translates the framework's save/load calls
into :func:`fastpersist.save` / :func:`fastpersist.save_async` / :func:`fastpersist.load`):

- :mod:`fastpersist.integrations.lightning`: ``FastPersistCheckpointIO`` and the
  ``"ddp_fastpersist"`` / ``"fsdp_fastpersist"`` strategy names.
- :mod:`fastpersist.integrations.accelerate`: ``enable(accelerator)`` or
  ``FASTPERSIST_ACCELERATE=1``: ``save_state``/``load_state`` through fastpersist.
- :mod:`fastpersist.integrations.deepspeed`: ``FastPersistCheckpointEngine``,
  ``enable(engine)`` / ``enable()`` or ``FASTPERSIST_DEEPSPEED=1``.

The source lives in the top-level ``integrations/`` folder of the repository; a wheel
installs it as ``fastpersist/integrations/`` (``wheel.force-include`` in
pyproject.toml), and in a source tree or an editable install
``fastpersist/integrations/__init__.py`` points the package at that folder.
``_startup.py`` is the start-up hook (installed as the top-level module
``_fastpersist_startup`` with ``fastpersist-startup.pth``).
"""

import importlib as _importlib
import types as _types

#: the adapters, importable as attributes after ``import fastpersist`` alone
#: (``fastpersist.integrations.accelerate.enable(accelerator)``): imported on first use,
#: so that no framework is imported before it is asked for
ADAPTERS = ("accelerate", "deepspeed", "lightning")


def __getattr__(name: str) -> _types.ModuleType:
    if name in ADAPTERS:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
