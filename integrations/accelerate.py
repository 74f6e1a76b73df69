"""Hugging Face Accelerate: ``save_state`` / ``load_state`` through fastpersist.

Turn it on with one line after creating the Accelerator::

    from fastpersist.integrations import accelerate as fp_accelerate
    fp_accelerate.enable(accelerator)

or with no code: ``FASTPERSIST_ACCELERATE=1`` in the environment (for example in the
``environment`` section ``accelerate config`` writes, or
``FASTPERSIST_ACCELERATE=1 accelerate launch train.py``); the variable is read by
:func:`install_from_env`, which fastpersist's start-up hook calls when
``accelerate.accelerator`` is imported. ``FASTPERSIST_PATCH_TORCH_SAVE=1`` turns it
on too, unless ``FASTPERSIST_ACCELERATE=0``.

What goes through fastpersist, for an enabled Accelerator: every file
``save_state``/``load_state`` write or read: the weights (``model.safetensors`` or
``pytorch_model.bin``), the optimizer, scheduler, sampler, dataloader, GradScaler
and RNG files and ``save_state``'s custom objects. The directory layout, the file
names and formats are Accelerate's own, so stock Accelerate (without fastpersist)
loads the result, and fastpersist loads stock checkpoints. One difference in the
bytes: ``model.safetensors`` carries no ``{"format": "pt"}`` metadata entry
(``safetensors`` and Accelerate do not need it).

How (the hook points): :mod:`accelerate.checkpointing` calls the module globals
``save``, ``load``, ``load_model`` and ``torch.save`` for every file.
:func:`install` replaces these four names *in that module only* with routers that
call fastpersist while an enabled Accelerator's ``save_state``/``load_state`` runs
and Accelerate's own functions otherwise; nothing else (not ``torch.save``, not
``accelerate.utils.save``) changes. :func:`enable` wraps the instance's
``save_state``/``load_state``; :func:`install_from_env` wraps them on the class.
Rank selection is Accelerate's: the main process writes shared files (the local
main process with ``save_on_each_node``), every process its RNG file.

Durability and retention: each file is durable when written (fastpersist's
temporary file, fsync, rename, directory fsync); after all ranks finished, the main
process fsyncs every file and directory of the new checkpoint and its parent.
With ``ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=N)``
Accelerate deletes the oldest checkpoints *before* writing the new one (with
``total_limit=1`` a crash during the save leaves no checkpoint at all); an enabled
Accelerator deletes them only after the new checkpoint is durable, the same ones
Accelerate would have deleted. (Until the deletion there are ``N + 1``
checkpoints on disk.) If a save with automatic naming raises, the main process
removes the incomplete ``checkpoint_N`` it had started, so ``load_state()`` without a
path resumes from the previous checkpoint and the next ``save_state`` can write
``checkpoint_N`` again. A process killed during ``save_state`` (no exception) still
leaves the incomplete directory, as stock Accelerate does; every file in it is
whole, but it may lack files (remove it, or pass the previous directory to
``load_state``). Saving into a fixed ``output_dir`` replaces its files one by one:
each is whole, but a failure part-way leaves a mix of two steps.

Multiple processes (DDP, ``MULTI_CPU``/``MULTI_GPU``): the weights and optimizer
files, which every rank holds a replica of, are written by all ranks together
(``fastpersist.save(..., group=)``, one slice each) when this fastpersist has the
multi-rank save and the ranks checked that their replicas are identical; otherwise
the main process writes them. Other distributed types (FSDP, DeepSpeed,
Megatron-LM, XLA) keep Accelerate's own path for their model and optimizer files;
for DeepSpeed, enable :mod:`fastpersist.integrations.deepspeed` as well.

FSDP is not routed through :mod:`fastpersist.dcp` yet: Accelerate runs FSDP only on
accelerators (on CPU, ``Accelerator(cpu=True, fsdp_plugin=...)`` silently stays
``MULTI_CPU`` with DDP, and ``accelerate launch --use_fsdp`` refuses without a
device), so it could not be tested here. The hook point when it is:
``accelerate.utils.fsdp_utils`` imports ``torch.distributed.checkpoint`` inside each
save/load function and looks up ``FileSystemWriter``/``FileSystemReader`` on it at
call time, so those two attributes, swapped for ``FastPersistWriter``/``Reader``
while an enabled ``save_state``/``load_state`` runs, are the narrowest place.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import re
import shutil
import types
from collections import OrderedDict
from typing import Any, Callable, Iterator, Optional

import fastpersist
from fastpersist.commit import fsync_dir, fsync_path

__all__ = ["ENV_VAR", "disable", "enable", "install", "install_from_env", "is_enabled"]

log = logging.getLogger(__name__)

#: The variable that turns the adapter on for every Accelerator of a process.
ENV_VAR = "FASTPERSIST_ACCELERATE"
_SWITCH = "FASTPERSIST_PATCH_TORCH_SAVE"
_MARK = "_fastpersist_original"
_ENABLED_ATTR = "_fastpersist_enabled"

# The settings of the save_state/load_state running in this thread/task (None: not ours).
_active: contextvars.ContextVar[Optional["_Settings"]] = contextvars.ContextVar("fastpersist_accelerate", default=None)
_originals: dict[str, Any] = {}


class _Settings:
    def __init__(self, config: Any, split: bool) -> None:
        self.config = config
        self.split = split


# ---------------------------------------------------------------- routers
# Each has the signature of the name it replaces in accelerate.checkpointing.


def _replica_file(name: str) -> bool:
    """Files that hold state every DDP rank has a replica of: weights and optimizer."""
    return bool(re.fullmatch(r"(model|pytorch_model)(_\d+)?\.(safetensors|bin)|optimizer(_\d+)?\.bin", name))


def _save(obj: Any, f: Any, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
    s = _active.get()
    if s is None or not isinstance(f, (str, os.PathLike)):
        return _originals["save"](obj, f, save_on_each_node=save_on_each_node, safe_serialization=safe_serialization)
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    from accelerate.utils.other import clean_state_dict_for_safetensors

    state = PartialState()
    if state.distributed_type == DistributedType.XLA:  # tensors must leave the XLA device first
        return _originals["save"](obj, f, save_on_each_node=save_on_each_node, safe_serialization=safe_serialization)
    if safe_serialization and isinstance(obj, OrderedDict):
        obj = clean_state_dict_for_safetensors(obj)
    fmt = "safetensors" if safe_serialization else "torch"
    writer = state.is_local_main_process if save_on_each_node else state.is_main_process
    if (
        s.split
        and not save_on_each_node
        and state.num_processes > 1
        and state.distributed_type in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
        and _replica_file(os.path.basename(os.fspath(f)))
    ):
        import torch.distributed as dist

        from fastpersist.integrations._replicated import save_replicated

        save_replicated(obj, f, group=dist.group.WORLD, writer=writer, format=fmt, config=s.config)
    elif writer:
        fastpersist.save(obj, f, format=fmt, config=s.config)


def _load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
    s = _active.get()
    if s is None or not isinstance(f, (str, os.PathLike)):
        return _originals["load"](f, map_location=map_location, **kwargs)
    # accelerate.utils.load's semantics: weights_only by default, with Accelerate's
    # safe globals (numpy arrays and dtypes of the RNG states) allowed for the call.
    import torch
    from accelerate.utils.other import TORCH_SAFE_GLOBALS

    old = torch.serialization.get_safe_globals()
    kwargs.setdefault("weights_only", True)
    torch.serialization.add_safe_globals(TORCH_SAFE_GLOBALS)
    try:
        return fastpersist.load(f, map_location=map_location, config=s.config, **kwargs)
    finally:
        torch.serialization.clear_safe_globals()
        if old:
            torch.serialization.add_safe_globals(old)


def _load_model(model: Any, filename: Any, strict: bool = True, device: Any = "cpu", **kwargs: Any) -> Any:
    s = _active.get()
    try:
        from safetensors.torch import _remove_duplicate_names
    except ImportError:  # pragma: no cover - a safetensors without the helper
        _remove_duplicate_names = None
    if s is None or _remove_duplicate_names is None or kwargs:
        return _originals["load_model"](model, filename, strict=strict, device=device, **kwargs)
    # safetensors.torch.load_model, reading the file with fastpersist.
    state_dict = fastpersist.load(filename, map_location=str(device), config=s.config)
    to_removes = _remove_duplicate_names(model.state_dict(), preferred_names=state_dict.keys())
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = set(missing)
    for group in to_removes.values():
        for name in group:
            if name not in missing:
                unexpected.append(name)
            else:
                missing.remove(name)
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict for {model.__class__.__name__}: "
            f"missing keys {sorted(missing)}, unexpected keys {sorted(unexpected)}"
        )
    return missing, unexpected


class _TorchForCheckpointing:
    """Stands for ``torch`` inside ``accelerate.checkpointing`` (GradScaler, RNG and
    dataloader states are written with ``torch.save`` there): ``save`` is routed,
    every other attribute is torch's."""

    def __init__(self, torch_module: Any) -> None:
        self.__dict__["_torch"] = torch_module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._torch, name, value)

    def __repr__(self) -> str:
        return f"<torch, with save routed by fastpersist.integrations.accelerate: {self._torch!r}>"

    def save(self, obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        s = _active.get()
        if s is None or args or kwargs or not isinstance(f, (str, os.PathLike)):
            return self._torch.save(obj, f, *args, **kwargs)
        fastpersist.save(obj, f, format="torch", config=s.config)


# ---------------------------------------------------------------- installation


def install() -> None:
    """Put the routers into ``accelerate.checkpointing`` (idempotent). They call
    Accelerate's own functions unless an enabled Accelerator is saving or loading,
    so installing alone changes nothing."""
    import accelerate.checkpointing as ckpt

    if "save" in _originals:
        return
    _originals.update(save=ckpt.save, load=ckpt.load, load_model=ckpt.load_model, torch=ckpt.torch)
    ckpt.save = _save
    ckpt.load = _load
    ckpt.load_model = _load_model
    ckpt.torch = _TorchForCheckpointing(ckpt.torch)


def _uninstall() -> None:
    """Give accelerate.checkpointing its names back (tests)."""
    import accelerate.checkpointing as ckpt

    for name, value in _originals.items():
        setattr(ckpt, name, value)
    _originals.clear()


@contextlib.contextmanager
def _routing(settings: _Settings) -> Iterator[None]:
    token = _active.set(settings)
    try:
        yield
    finally:
        _active.reset(token)


def _checkpoint_number(folder: str) -> int:
    # Accelerate's sort key for automatically named checkpoints (save_state's _inner).
    return list(map(int, re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", folder)))[0]


def _fsync_tree(directory: str) -> None:
    """fsync every file and directory under ``directory`` (bottom-up), then its parent.
    Files fastpersist wrote are clean already; this also covers files written by
    other paths (FSDP/DeepSpeed engines, user hooks)."""
    for root, _dirs, files in os.walk(directory, topdown=False):
        for name in files:
            path = os.path.join(root, name)
            if os.path.isfile(path) and not os.path.islink(path):
                fsync_path(path)
        fsync_dir(root)
    fsync_dir(os.path.dirname(os.path.abspath(directory)))


def _wrap_save_state(original: Callable[..., Any], settings: Callable[[Any], Optional[_Settings]]) -> Callable[..., Any]:
    @functools.wraps(original)
    def save_state(self: Any, output_dir: Optional[str] = None, safe_serialization: bool = True, **kwargs: Any) -> Any:
        s = settings(self)
        if s is None:
            return original(self, output_dir, safe_serialization, **kwargs)
        install()
        pc = self.project_configuration
        limit = pc.total_limit if pc.automatic_checkpoint_naming else None
        new_dir = (os.path.join(self.project_dir, "checkpoints", f"checkpoint_{self.save_iteration}")
                   if pc.automatic_checkpoint_naming else None)
        fresh = new_dir is not None and not os.path.exists(new_dir)
        if limit is not None:
            pc.total_limit = None  # retention runs below, once the new checkpoint is durable
        try:
            with _routing(s):
                location = original(self, output_dir, safe_serialization, **kwargs)
        except BaseException:
            if fresh and self.is_main_process and new_dir is not None and os.path.isdir(new_dir):
                # A partial checkpoint_N would be what a default load_state() resumes from, and
                # the next save_state (same N: Accelerate counts only successful saves) would
                # refuse to write into it: remove it, the previous checkpoints stay.
                log.error("fastpersist: save_state failed; removing the incomplete %s (the previous checkpoints "
                          "are untouched)", new_dir)
                shutil.rmtree(new_dir, ignore_errors=True)
                with contextlib.suppress(OSError):
                    fsync_dir(os.path.dirname(new_dir))
            raise
        finally:
            if limit is not None:
                pc.total_limit = limit
        location = os.fspath(location)
        self.wait_for_everyone()  # every rank's files are durable
        if self.is_main_process:
            _fsync_tree(location)
            if limit is not None:
                parent = os.path.join(self.project_dir, "checkpoints")
                folders = [os.path.join(parent, d) for d in os.listdir(parent)]
                folders = [d for d in folders if os.path.abspath(d) != os.path.abspath(location)]
                excess = len(folders) + 1 - limit
                if excess > 0:
                    folders.sort(key=_checkpoint_number)
                    log.info("fastpersist: deleting %d old checkpoint(s) now that %s is durable", excess, location)
                    for folder in folders[:excess]:
                        shutil.rmtree(folder)
                    fsync_dir(parent)
        self.wait_for_everyone()
        return location

    setattr(save_state, _MARK, original)
    return save_state


def _wrap_load_state(original: Callable[..., Any], settings: Callable[[Any], Optional[_Settings]]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_state(self: Any, *args: Any, **kwargs: Any) -> Any:
        s = settings(self)
        if s is None:
            return original(self, *args, **kwargs)
        install()
        with _routing(s):
            return original(self, *args, **kwargs)

    setattr(load_state, _MARK, original)
    return load_state


def _instance_settings(accelerator: Any) -> Optional[_Settings]:
    return getattr(accelerator, _ENABLED_ATTR, None)


def enable(accelerator: Any, *, config: Any = None, split_replicated: bool = True) -> Any:
    """Route ``accelerator.save_state``/``load_state`` through fastpersist; returns
    ``accelerator``. Idempotent (a second call updates the settings).

    Args:
        accelerator: an ``accelerate.Accelerator``.
        config: a :class:`fastpersist.Config` for these saves and loads (default:
            fastpersist's default configuration).
        split_replicated: with several DDP processes, write the weights and optimizer
            files from all ranks together (when the ranks' replicas are identical).
    """
    install()
    settings = _Settings(config, split_replicated)
    object.__setattr__(accelerator, _ENABLED_ATTR, settings)
    cls = type(accelerator)
    if not hasattr(accelerator.save_state, _MARK):
        wrapped = _wrap_save_state(cls.save_state, _instance_settings)
        object.__setattr__(accelerator, "save_state", types.MethodType(wrapped, accelerator))
    if not hasattr(accelerator.load_state, _MARK):
        wrapped = _wrap_load_state(cls.load_state, _instance_settings)
        object.__setattr__(accelerator, "load_state", types.MethodType(wrapped, accelerator))
    return accelerator


def disable(accelerator: Any) -> None:
    """Undo :func:`enable` for ``accelerator`` (the class-level switch stays)."""
    object.__setattr__(accelerator, _ENABLED_ATTR, None)


def is_enabled(accelerator: Any) -> bool:
    """Whether ``accelerator.save_state``/``load_state`` go through fastpersist."""
    if _class_enabled:
        return _class_settings(accelerator) is not None
    return _instance_settings(accelerator) is not None


_class_enabled = False


def _class_settings(accelerator: Any) -> Optional[_Settings]:
    # Enabled for every instance, with enable()'s settings where given; None after disable().
    return getattr(accelerator, _ENABLED_ATTR, _Settings(None, True))


def env_enabled() -> bool:
    """``FASTPERSIST_ACCELERATE`` if set, else ``FASTPERSIST_PATCH_TORCH_SAVE``
    (booleans: 1/0, true/false, on/off, yes/no; anything else raises ValueError)."""
    from fastpersist.integrations._env import adapter_enabled

    return adapter_enabled(ENV_VAR)


def install_from_env() -> bool:
    """If :func:`env_enabled`, wrap ``Accelerator.save_state``/``load_state`` on the
    class, so every Accelerator of the process saves through fastpersist (an
    Accelerator created before the call included). Idempotent; returns whether the
    class-level switch is on. fastpersist's start-up hook calls this when
    ``accelerate.accelerator`` has been imported."""
    global _class_enabled
    if not env_enabled():
        return _class_enabled
    from accelerate.accelerator import Accelerator

    if not hasattr(Accelerator.save_state, _MARK):
        Accelerator.save_state = _wrap_save_state(Accelerator.save_state, _class_settings)
    if not hasattr(Accelerator.load_state, _MARK):
        Accelerator.load_state = _wrap_load_state(Accelerator.load_state, _class_settings)
    install()
    _class_enabled = True
    return True
