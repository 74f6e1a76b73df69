"""fastpersist's start-up hook: the no-code switches, run in every Python process.

Installed as the top-level module ``_fastpersist_startup`` together with
``fastpersist-startup.pth`` (``import _fastpersist_startup``), which Python's
``site`` runs at every interpreter start in the environment (torchrun, Lightning,
Accelerate and DeepSpeed launchers start ordinary interpreters, so their workers
run it too). It imports nothing but ``os`` and ``sys`` and never imports torch,
Lightning or fastpersist itself. It puts one import watcher at the front of
``sys.meta_path`` that acts when a watched module has *finished* executing:

* ``torch``, only when ``FASTPERSIST_PATCH_TORCH_SAVE`` is true (1/true/on/yes):
  ``fastpersist.patch_torch_save()`` runs right after ``import torch`` completes,
  so ``torch.save``/``torch.load`` on paths go through fastpersist in a program
  that never imports fastpersist.
* ``accelerate.accelerator`` / ``deepspeed.runtime.engine``, when
  ``FASTPERSIST_ACCELERATE`` / ``FASTPERSIST_DEEPSPEED`` or the torch.save switch is
  set: the adapter's ``install_from_env()`` runs (it reads its own variable first,
  so ``FASTPERSIST_ACCELERATE=0`` keeps Accelerate stock under the switch).
* ``deepspeed.runtime.engine``, always: ``DeepSpeedEngine._configure_checkpointing`` is
  wrapped so that an engine whose DeepSpeed config (JSON file or dict) has a top-level
  ``"fastpersist"`` key gets fastpersist's checkpoint engine
  (``fastpersist.integrations.deepspeed.apply_config``). fastpersist is imported only
  for an engine whose config has that key; the key wins over ``FASTPERSIST_DEEPSPEED``
  (``"fastpersist": false`` keeps DeepSpeed's own engine for that engine).
* ``lightning.pytorch.strategies`` / ``pytorch_lightning.strategies``, always:
  the strategy names of :data:`STRATEGIES` are registered in Lightning's
  ``StrategyRegistry`` as small factories; fastpersist is imported only when a
  Trainer asks for one of those names. (Lightning loads no entry points for
  strategies, only for callbacks, and those after the strategy is chosen.)

Set ``FASTPERSIST_STARTUP=0`` to turn the watcher off entirely. A failure inside
the hook never breaks the watched import: it is reported once as a warning. When
this module itself cannot be imported (an editable install whose checkout was
deleted), the ``.pth`` line stays silent, so that every interpreter start does not
print ``site``'s traceback, unless one of the switches is set: then it writes one
line to stderr saying the switches are off.
"""

# No "from __future__ import annotations" and no typing: each import costs start-up time
# in every interpreter of the environment. The adapters are imported by their installed
# name through importlib: this module runs as the top-level ``_fastpersist_startup``,
# where a relative import has no package to resolve against.
import os
import sys

ENV_SWITCH = "FASTPERSIST_PATCH_TORCH_SAVE"
ENV_STARTUP = "FASTPERSIST_STARTUP"
#: adapter module -> (the module whose import triggers it, its own variable)
ADAPTERS = {
    "accelerate": ("accelerate.accelerator", "FASTPERSIST_ACCELERATE"),
    "deepspeed": ("deepspeed.runtime.engine", "FASTPERSIST_DEEPSPEED"),
}
_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")

#: Strategy names registered in Lightning: name -> (class name in
#: fastpersist.integrations.lightning, constructor arguments, description).
STRATEGIES = {
    "ddp_fastpersist": ("FastPersistDDPStrategy", {}, "DDP; checkpoints written by all ranks through fastpersist"),
    "ddp_fastpersist_spawn": (
        "FastPersistDDPStrategy",
        {"start_method": "spawn"},
        "DDP (spawned processes); checkpoints written by all ranks through fastpersist",
    ),
    "ddp_fastpersist_fork": (
        "FastPersistDDPStrategy",
        {"start_method": "fork"},
        "DDP (forked processes); checkpoints written by all ranks through fastpersist",
    ),
    "fsdp_fastpersist": (
        "FastPersistFSDPStrategy",
        {},
        "FSDP; sharded checkpoints through fastpersist's DCP storage layer",
    ),
}

#: What the hook did in this process (``fastpersist info`` prints it).
state = {"torch_patched": False, "lightning_registered": [], "adapters": [], "errors": [],
         "deepspeed_config_hook": False}


def _flag(name):  # -> Optional[bool]; no typing import at start-up
    """True/False for a boolean variable, None when unset, empty or not a boolean
    (``import fastpersist`` reports a bad value; the hook stays out of the way)."""
    text = os.environ.get(name, "").strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    return None


def _warn(what: str, exc: BaseException) -> None:
    state["errors"].append(f"{what}: {exc!r}")
    try:
        import warnings

        warnings.warn(f"fastpersist start-up hook: {what}: {exc!r}", RuntimeWarning, stacklevel=2)
    except Exception:  # pragma: no cover - interpreter shutting down
        pass


def _patch_torch(_module: object) -> None:
    try:
        from fastpersist import patch

        patch.patch_torch_save()
        state["torch_patched"] = True
    except BaseException as e:  # never break "import torch"
        _warn(f"{ENV_SWITCH} is set but torch.save could not be patched", e)


def _adapter_installer(name: str):
    def run(_module: object) -> None:
        try:
            import importlib

            if importlib.import_module(f"fastpersist.integrations.{name}").install_from_env():
                state["adapters"].append(name)
        except BaseException as e:  # never break the framework's import
            _warn(f"could not switch on the fastpersist {name} adapter", e)

    return run


DEEPSPEED_CONFIG_KEY = "fastpersist"  # fastpersist.integrations.deepspeed.CONFIG_KEY


def wrap_deepspeed_engine(module: object) -> None:
    """Wrap ``module.DeepSpeedEngine._configure_checkpointing``: after DeepSpeed chose its
    checkpoint engine, an engine whose config has the ``"fastpersist"`` key gets
    fastpersist's (errors in that section, such as an unknown key, raise: the user asked)."""
    try:
        cls = getattr(module, "DeepSpeedEngine")
        original = cls._configure_checkpointing
        if getattr(original, "_fastpersist_config_hook", False):
            return

        def _configure_checkpointing(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            params = getattr(getattr(self, "_config", None), "_param_dict", None)
            if isinstance(params, dict) and DEEPSPEED_CONFIG_KEY in params:
                import importlib

                importlib.import_module("fastpersist.integrations.deepspeed").apply_config(self)
            return result

        _configure_checkpointing.__name__ = original.__name__
        _configure_checkpointing.__qualname__ = original.__qualname__
        _configure_checkpointing.__doc__ = original.__doc__
        _configure_checkpointing.__wrapped__ = original
        _configure_checkpointing._fastpersist_config_hook = True
        cls._configure_checkpointing = _configure_checkpointing
        state["deepspeed_config_hook"] = True
    except BaseException as e:  # never break "import deepspeed"
        _warn('could not install the DeepSpeed config hook (the "fastpersist" key)', e)


def _deepspeed_hooks(env_installer):
    def run(module: object) -> None:
        wrap_deepspeed_engine(module)
        if env_installer is not None:
            env_installer(module)

    return run


def _strategy_factory(package: str, class_name: str):
    def make(**kwargs: object) -> object:
        import importlib

        lightning = importlib.import_module("fastpersist.integrations.lightning")
        return getattr(lightning.classes_for(package), class_name)(**kwargs)

    make.__name__ = make.__qualname__ = class_name
    return make


def register_strategies(registry: object, package: str, factory=None) -> list:
    """Register :data:`STRATEGIES` in ``registry`` (names already there are kept);
    ``factory(package, class_name)`` makes the callable (default: lazy import)."""
    added = []
    for name, (class_name, init_params, description) in STRATEGIES.items():
        if name in registry:  # type: ignore[operator]
            continue
        make = (factory or _strategy_factory)(package, class_name)
        registry.register(name, make, description=description, **init_params)  # type: ignore[attr-defined]
        added.append(name)
    return added


def _register_lightning(module: object) -> None:
    try:
        package = module.__name__.rpartition(".strategies")[0]  # type: ignore[attr-defined]
        registry = getattr(module, "StrategyRegistry")
        state["lightning_registered"].extend(register_strategies(registry, package))
    except BaseException as e:  # never break "import lightning"
        _warn("could not register the fastpersist strategies in Lightning", e)


class _AfterExec:
    """Loader wrapper: runs the real loader, then the callback; the module keeps
    its real loader (``__loader__``, ``__spec__.loader``)."""

    def __init__(self, loader: object, callback) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec):
        return self._loader.create_module(spec)  # type: ignore[attr-defined]

    def exec_module(self, module) -> None:
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)  # type: ignore[attr-defined]
        self._callback(module)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)


class _Watcher:
    """A ``sys.meta_path`` entry that only answers for the watched module names."""

    def __init__(self) -> None:
        self.callbacks: dict = {}

    def find_spec(self, fullname: str, path=None, target=None):
        callback = self.callbacks.get(fullname)
        if callback is None:
            return None
        del self.callbacks[fullname]  # one-shot: the module is imported once
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _AfterExec(spec.loader, callback)
        return spec


_watcher = None


def install() -> None:
    """Put the watcher in place (idempotent); act at once on modules already imported."""
    global _watcher
    if _flag(ENV_STARTUP) is False or _watcher is not None:
        return
    watches = {
        "lightning.pytorch.strategies": _register_lightning,
        "pytorch_lightning.strategies": _register_lightning,
    }
    if _flag(ENV_SWITCH):
        watches["torch"] = _patch_torch
    for name, (trigger, variable) in ADAPTERS.items():
        if _flag(variable) or (_flag(ENV_SWITCH) and _flag(variable) is not False):
            watches[trigger] = _adapter_installer(name)
    trigger = ADAPTERS["deepspeed"][0]
    watches[trigger] = _deepspeed_hooks(watches.get(trigger))
    _watcher = _Watcher()
    for name, callback in watches.items():
        module = sys.modules.get(name)
        if module is not None and name != "torch":
            callback(module)
        elif module is not None and getattr(module, "save", None) is not None:
            callback(module)  # torch already fully imported
        else:
            _watcher.callbacks[name] = callback
    sys.meta_path.insert(0, _watcher)


if __name__ == "_fastpersist_startup":  # run by the .pth file, not when imported from the package
    install()
