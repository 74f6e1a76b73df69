"""Hugging Face Accelerate: ``save_state`` / ``load_state`` through fastpersist.

Turn it on with ``enable(accelerator)``, or with ``FASTPERSIST_ACCELERATE=1`` (read by
:func:`install_from_env`, which the start-up hook calls when ``accelerate.accelerator`` is
imported). What it does: docs/integrations.md (Accelerate), docs/objectstore.md (Accelerate).

This module only translates. :mod:`accelerate.checkpointing` calls its module globals
``save``, ``load``, ``load_model`` and ``torch.save`` for every file: :func:`install`
replaces them *in that module only* with routers (:class:`fastpersist.routing.Routes`) that
call fastpersist while an enabled Accelerator's ``save_state``/``load_state`` runs. The
wrapped ``save_state`` (:class:`fastpersist.methodswitch.MethodSwitch`) is
:func:`fastpersist.dirsave.save_directory` (automatic naming:
:class:`fastpersist.numbered.NumberedDirs`; ``s3://``:
:func:`fastpersist.s3foldersave.save_collective`) around stock ``save_state``.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch

import fastpersist
from fastpersist import dirsave, s3foldersave, swallowed
from fastpersist.collectivedir import ListExchange
from fastpersist.envflags import adapter_enabled
from fastpersist.methodswitch import MethodSwitch
from fastpersist.numbered import NumberedDirs, checkpoint_dir
from fastpersist.replicated import save_replicated
from fastpersist.routing import Routes, setting
from fastpersist.s3url import is_s3_url
from fastpersist.wrappers import ModuleWith, take_first

__all__ = ["ENV_VAR", "disable", "enable", "install", "install_from_env", "is_enabled"]

log = logging.getLogger(__name__)

#: The variable that turns the adapter on for every Accelerator of a process.
ENV_VAR = "FASTPERSIST_ACCELERATE"

# accelerate.checkpointing's routed names; their settings: the save_state/load_state running in this thread/task
_routes = Routes("fastpersist_accelerate")
# Entries of a directory save_state writes (weights, optimizer, scheduler, sampler, dataloader,
# GradScaler, RNG, custom objects; FSDP/DeepSpeed directories): the others are carried over.
_CHECKPOINT_ENTRY_RE = re.compile(
    r"(pytorch_model|model)(_fsdp)?(_[0-9]+)?(\.(safetensors|bin)(\.index\.json)?)?"
    r"|(optimizer|scheduler|sampler|dl_state_dict)(_[0-9]+)?(\.bin)?"
    r"|scaler\.pt|random_states_[0-9]+\.pkl|custom_checkpoint_[0-9]+\.pkl")


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
    s = _routes.settings()
    if s is None or not isinstance(f, (str, os.PathLike)):
        return _routes.original("save")(obj, f, save_on_each_node=save_on_each_node,
                                        safe_serialization=safe_serialization)
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType
    from accelerate.utils.other import clean_state_dict_for_safetensors

    state = PartialState()
    if state.distributed_type == DistributedType.XLA:  # tensors must leave the XLA device first
        return _routes.original("save")(obj, f, save_on_each_node=save_on_each_node,
                                        safe_serialization=safe_serialization)
    if safe_serialization and isinstance(obj, OrderedDict):
        obj = clean_state_dict_for_safetensors(obj)
    fmt = "safetensors" if safe_serialization else "torch"
    writer = state.is_local_main_process if save_on_each_node else state.is_main_process
    if s.split and not save_on_each_node and state.num_processes > 1 and _replica_file(os.path.basename(f)) \
            and state.distributed_type in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        import torch.distributed as dist

        save_replicated(obj, f, group=dist.group.WORLD, writer=writer, format=fmt, config=s.config,
                        save=fastpersist.save)
    elif writer:
        fastpersist.save(obj, f, format=fmt, config=s.config)


def _load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
    s = _routes.settings()
    if s is None or not isinstance(f, (str, os.PathLike)):
        return _routes.original("load")(f, map_location=map_location, **kwargs)
    # accelerate.utils.load's semantics: weights_only by default, with Accelerate's
    # safe globals (numpy arrays and dtypes of the RNG states) allowed for the call.
    from accelerate.utils.other import TORCH_SAFE_GLOBALS

    old = torch.serialization.get_safe_globals()
    kwargs.setdefault("weights_only", True)
    torch.serialization.add_safe_globals(TORCH_SAFE_GLOBALS)
    try:  # corrupt or unreadable: raised after load_state even if Accelerate catches it
        with swallowed.recording(f):
            return fastpersist.load(f, map_location=map_location, config=s.config, **kwargs)
    finally:
        torch.serialization.clear_safe_globals()
        if old:
            torch.serialization.add_safe_globals(old)


def _load_model(model: Any, filename: Any, strict: bool = True, device: Any = "cpu", **kwargs: Any) -> Any:
    s = _routes.settings()
    if s is None or set(kwargs) - {"backend"}:
        return _routes.original("load_model")(model, filename, strict=strict, device=device, **kwargs)
    return fastpersist.load_model(model, filename, strict=strict, device=str(device), config=s.config, **kwargs)


def _torch_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
    # torch.save inside accelerate.checkpointing (GradScaler, RNG and dataloader states)
    s = _routes.settings()
    if s is None or args or kwargs or not isinstance(f, (str, os.PathLike)):
        return _routes.original("torch").save(obj, f, *args, **kwargs)
    fastpersist.save(obj, f, format="torch", config=s.config)


# ---------------------------------------------------------------- installation


def install() -> None:
    """Put the routers into ``accelerate.checkpointing`` (idempotent). They call
    Accelerate's own functions unless an enabled Accelerator is saving or loading,
    so installing alone changes nothing."""
    import accelerate.checkpointing as ckpt

    if not _routes.installed():
        _routes.install(ckpt, save=_save, load=_load, load_model=_load_model,
                        torch=ModuleWith(ckpt.torch, save=_torch_save))


def _uninstall() -> None:
    """Give accelerate.checkpointing its names back (tests)."""
    import accelerate.checkpointing as ckpt

    _routes.uninstall(ckpt)


def _exchange() -> ListExchange:
    """:class:`fastpersist.collectivedir.Exchange` over Accelerate's own object collectives."""
    from accelerate.utils import broadcast_object_list, gather_object

    return ListExchange(broadcast_object_list, gather_object)


def _wrap_save_state(original: Callable[..., Any], settings: Callable[[Any], Optional[_Settings]]) -> Callable[..., Any]:
    @functools.wraps(original)
    def save_state(self: Any, output_dir: Optional[str] = None, safe_serialization: bool = True, **kwargs: Any) -> Any:
        s = settings(self)
        if s is None:
            return original(self, output_dir, safe_serialization, **kwargs)
        install()
        pc = self.project_configuration
        auto = bool(pc.automatic_checkpoint_naming)
        if auto and is_s3_url(self.project_dir):
            raise ValueError(f"save_state: automatic_checkpoint_naming with an s3:// project_dir ({self.project_dir}) "
                             "is not supported: pass the checkpoint's URL, save_state('s3://bucket/prefix/step-N')")
        checkpoints = os.path.join(self.project_dir, "checkpoints") if self.project_dir is not None else None
        numbered = NumberedDirs(checkpoints, limit=pc.total_limit) if auto and checkpoints is not None else None
        if numbered is not None:  # stock save_state's own checks, before anything is written
            staged = numbered.claim(self.save_iteration, counter="self.save_iteration")
        elif output_dir is None or auto:  # automatic naming without a project_dir: stock raises
            return original(self, output_dir, safe_serialization, **kwargs)
        elif is_s3_url(output_dir):
            return _save_state_s3(self, original, s, str(output_dir), safe_serialization, kwargs)
        else:
            staged = checkpoint_dir(output_dir, listed=checkpoints)
        iteration = pc.iteration

        def write(staging: Optional[str]) -> Any:
            # stock save_state, its retention after the commit; into staging: its naming off too
            stock = {"total_limit": None} if auto else {}
            if staging is not None:
                stock["automatic_checkpoint_naming"] = False
            with _routes.active(s), setting(pc, **stock):
                return original(self, output_dir if staging is None else staging, safe_serialization, **kwargs)

        def rollback() -> None:
            pc.iteration = iteration

        return dirsave.save_directory(
            staged, write, rank=self.process_index, exchange=_exchange(), rollback=rollback,
            # each node's main process holds its node's files with save_on_each_node
            committer=self.is_local_main_process if pc.save_on_each_node else self.is_main_process,
            per_node=pc.save_on_each_node and self.num_processes > 1, remove_new_on_failure=auto,
            is_checkpoint_entry=_CHECKPOINT_ENTRY_RE.fullmatch, what="an Accelerate checkpoint",
            operation="save_state", peer="process", logger=log,
            after=None if numbered is None else numbered.retention(logger=log))

    return save_state


def _wrap_load_state(original: Callable[..., Any], settings: Callable[[Any], Optional[_Settings]]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_state(self: Any, *args: Any, **kwargs: Any) -> Any:
        s = settings(self)
        if s is None:
            return original(self, *args, **kwargs)
        install()
        input_dir, rest_args, rest = take_first(args, kwargs, "input_dir")
        if input_dir is not None and is_s3_url(input_dir):
            with s3foldersave.local_copy(str(input_dir), config=s.config) as local:
                return load_state(self, local, *rest_args, **rest)
        # Accelerate 1.15's load_accelerator_state catches every exception of the RNG file's load
        with swallowed.watching("Accelerate's load_state", hint=" (for random_states_*.pkl: the RNG state not "
                                "restored)", logger=log), _routes.active(s):
            return original(self, *args, **kwargs)

    return load_state


def _save_state_s3(self: Any, original: Callable[..., Any], s: _Settings, url: str, safe_serialization: bool,
                   kwargs: dict) -> str:
    """``save_state`` into the ``s3://`` folder ``url``: stock save_state into a local temporary
    directory on every process, then uploaded and committed together; returns the folder's URL."""

    def write(local: str) -> None:
        with _routes.active(s):
            original(self, local, safe_serialization, **kwargs)

    return s3foldersave.save_collective(url, write, exchange=_exchange(), rank=self.process_index,
                                        owns=s3foldersave.by_top_level(_CHECKPOINT_ENTRY_RE.fullmatch),
                                        config=s.config, operation="save_state", peer="process", logger=log)


# save_state/load_state wrapped per Accelerator (enable) or on the class (install_from_env); their settings on
# the Accelerator (the class switch's default: fastpersist's default configuration, split replicas)
_switch = MethodSwitch("_fastpersist_enabled", {"save_state": _wrap_save_state, "load_state": _wrap_load_state},
                       default=lambda: _Settings(None, True))


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
    _switch.enable(accelerator, _Settings(config, split_replicated))
    return accelerator


def disable(accelerator: Any) -> None:
    """Undo :func:`enable` for ``accelerator`` (the class-level switch stays)."""
    _switch.disable(accelerator)


def is_enabled(accelerator: Any) -> bool:
    """Whether ``accelerator.save_state``/``load_state`` go through fastpersist."""
    return _switch.settings(accelerator, class_on=_class_enabled) is not None


_class_enabled = False  # install_from_env switched the class on


def env_enabled() -> bool:
    """``FASTPERSIST_ACCELERATE`` if set, else ``FASTPERSIST_PATCH_TORCH_SAVE``
    (booleans: 1/0, true/false, on/off, yes/no; anything else raises ValueError)."""
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

    _switch.enable_class(Accelerator)
    install()
    _class_enabled = True
    return True
