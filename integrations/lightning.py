"""Lightning checkpoints through fastpersist: Lightning's hooks translated into fastpersist calls.

``Trainer(plugins=[FastPersistCheckpointIO()])``, or ``Trainer(strategy="ddp_fastpersist")``
(also ``_spawn``, ``_fork``, and ``"fsdp_fastpersist"``; registered by the start-up hook, no
import needed). Lightning's own checks of checkpoint paths are wrapped to wait for pending
saves (:func:`remove_lightning_guards` undoes it). ``lightning`` and ``pytorch_lightning``
both work (:func:`classes_for`). docs/integrations.md and docs/compat.md (Lightning) say more.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import threading
import types
from typing import Any, Callable, Optional

import torch

import fastpersist
from fastpersist import checkpointfiles, dcpsave
from fastpersist.checkpointfiles import CheckpointFiles
from fastpersist.localpath import is_local, local_path
from fastpersist.locations import list_s3, wait_for_file, wait_for_folder
from fastpersist.ranks import world_group
from fastpersist.replicated import group_save_available
from fastpersist.replicatedcheckpoint import save_split
from fastpersist.s3url import is_s3_url
from fastpersist.wrappers import Wrappers, calling_first

from . import _startup

__all__ = ["FastPersistCheckpointIO", "FastPersistDDPStrategy", "FastPersistFSDPStrategy", "classes_for",
           "install_lightning_guards", "register_strategies", "remove_lightning_guards"]

HAS_ASYNC = hasattr(fastpersist, "save_async") and hasattr(fastpersist, "wait_all")
HAS_GROUP_SAVE = group_save_available()

_classes: dict[str, types.SimpleNamespace] = {}
_classes_lock = threading.Lock()
#: every Lightning function the adapter wrapped, for remove_lightning_guards()
_guards = Wrappers()
_installed: set[str] = set()


def finish_pending() -> None:
    """Finish the pending background saves of every :class:`FastPersistCheckpointIO`
    (raises the first error)."""
    checkpointfiles.finish_all()


def _fabric(package: str) -> str:
    return "lightning.fabric" if package.startswith("lightning.") else "lightning_fabric"


def _find_last(original: Any) -> Any:
    """``ModelCheckpoint._find_last_checkpoints`` (``ckpt_path="last"``): on ``s3://``, listed
    with the scheme kept (Lightning's own looks the names up on the local filesystem)."""
    @functools.wraps(original)
    def wrapper(self: Any, trainer: Any) -> Any:
        wait_for_folder(self.dirpath)
        resolve = getattr(self, "_ModelCheckpoint__resolve_ckpt_dir", None)
        folder = self.dirpath or (resolve(trainer) if resolve is not None else None)
        if folder is None or not is_s3_url(folder):
            return original(self, trainer)
        last = re.compile(rf"^{re.escape(self.CHECKPOINT_NAME_LAST)}(-(\d+))?$")
        return list_s3(str(folder), lambda name: os.path.splitext(name)[1] == self.FILE_EXTENSION
                       and last.match(os.path.splitext(name)[0]) is not None)
    return wrapper


def install_lightning_guards(package: str = "lightning.pytorch") -> None:
    """Make Lightning's checks of checkpoint paths wait for pending async saves, and
    ``save_last="link"`` link only finished files (idempotent; done when the classes for
    ``package`` are built). :func:`remove_lightning_guards` undoes it."""
    if package in _installed:
        return
    fabric = _fabric(package)
    mc = importlib.import_module(f"{package}.callbacks.model_checkpoint").ModelCheckpoint
    connector = importlib.import_module(f"{package}.trainer.connectors.checkpoint_connector")._CheckpointConnector
    torch_io = importlib.import_module(f"{fabric}.plugins.io.torch_io").TorchCheckpointIO
    cloud_io = importlib.import_module(f"{fabric}.utilities.cloud_io")
    _guards.wrap(mc, "_link_checkpoint", calling_first(lambda *_a, **_k: finish_pending()))
    _guards.wrap(mc, "file_exists", calling_first(lambda _self, filepath, *_a, **_k: wait_for_file(filepath)))
    _guards.wrap(mc, "_find_last_checkpoints", _find_last)
    _guards.wrap(connector, "_CheckpointConnector__max_ckpt_version_in_folder",
                 calling_first(lambda dir_path, *_a, **_k: wait_for_folder(dir_path)))
    for method in ("load_checkpoint", "remove_checkpoint"):  # a stock TorchCheckpointIO's
        _guards.wrap(torch_io, method, calling_first(lambda _self, path, *_a, **_k: wait_for_file(path)))
    original_load = cloud_io._load  # load_from_checkpoint; rebound where imported as pl_load
    if _guards.wrap(cloud_io, "_load", calling_first(lambda path_or_url, *_a, **_k: wait_for_file(path_or_url))):
        _guards.rebind(original_load, cloud_io._load, (package, fabric), skip=cloud_io)
    _installed.add(package)


def remove_lightning_guards() -> None:
    """Restore every Lightning function the adapter wrapped, for both packages. The adapter
    classes keep working; Lightning's own checks then no longer wait for pending async saves."""
    _guards.undo()
    _installed.clear()


def _define(package: str) -> types.SimpleNamespace:
    """Build the adapter classes against ``package`` (``"lightning.pytorch"`` or
    ``"pytorch_lightning"``), whose class hierarchies are distinct."""
    importlib.import_module(package)
    fabric = _fabric(package)
    CheckpointIO = importlib.import_module(f"{fabric}.plugins.io.checkpoint_io").CheckpointIO
    TorchCheckpointIO = importlib.import_module(f"{fabric}.plugins.io.torch_io").TorchCheckpointIO
    wrapper = importlib.import_module(f"{package}.plugins.io.wrapper")._WrappingCheckpointIO
    strategies = importlib.import_module(f"{package}.strategies")
    install_lightning_guards(package)

    class FastPersistCheckpointIO(CheckpointFiles, CheckpointIO):
        """Lightning ``CheckpointIO`` through fastpersist (arguments: :class:`CheckpointFiles`'s).
        With ``async_save`` (default) ``trainer.save_checkpoint(path)`` returns before ``path``
        exists: :meth:`finalize` (or the Trainer's teardown) finishes it. URLs other than
        ``s3://`` go to Lightning's ``TorchCheckpointIO``."""

        def __init__(self, async_save: Optional[bool] = None, mode: str = "snapshot", config: Any = None) -> None:
            super().__init__(async_save, mode, config)
            self._fallback = TorchCheckpointIO()

        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
            if storage_options is not None:
                raise TypeError(
                    f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by {type(self).__name__}"
                )
            if self.passes_on(path):
                return self._fallback.save_checkpoint(checkpoint, path)
            self.save_file(checkpoint, path)

        def load_checkpoint(self, path: Any, map_location: Optional[Any] = lambda storage, loc: storage,
                            weights_only: Optional[bool] = None) -> dict[str, Any]:
            if self.passes_on(path):
                return self._fallback.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
            return self.load_file(path, map_location=map_location, weights_only=weights_only)

        def remove_checkpoint(self, path: Any) -> None:
            if not self.remove_object(path):  # pending saves finished first: retention keeps the newest
                self._fallback.remove_checkpoint(path)

        def teardown(self) -> None:
            self.finalize()

    class FastPersistDDPStrategy(strategies.DDPStrategy):
        """DDP whose checkpoints every rank writes together (:func:`save_split`) and reads once
        in total; with one rank, an ``s3://`` path or another CheckpointIO, as stock DDP."""

        #: top-level checkpoint keys holding the replicated bulk tensors (never broadcast)
        _BULK_KEYS = ("state_dict", "optimizer_states")

        def __init__(self, *args: Any, checkpoint_io: Any = None, **kwargs: Any) -> None:
            super().__init__(*args, checkpoint_io=checkpoint_io or FastPersistCheckpointIO(), **kwargs)

        def _fastpersist_io(self) -> Any:
            io = self.checkpoint_io
            while isinstance(io, wrapper) and io.checkpoint_io is not None:
                io = io.checkpoint_io
            return io if isinstance(io, FastPersistCheckpointIO) else None

        def save_checkpoint(
            self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None
        ) -> None:
            io = self._fastpersist_io()
            group = world_group() if HAS_GROUP_SAVE else None
            if io is None or group is None or storage_options is not None or not is_local(filepath):
                return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            save_split(io, checkpoint, local_path(filepath), group=group, writer=self.is_global_zero,
                       bulk_keys=self._BULK_KEYS, label="ddp_fastpersist")

        def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
            io = self._fastpersist_io()
            group = world_group() if HAS_GROUP_SAVE else None
            if io is None or group is None or not is_local(checkpoint_path):
                return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
            return io.load_file(checkpoint_path, map_location=lambda storage, loc: storage, weights_only=weights_only,
                                group=group)

        def remove_checkpoint(self, filepath: Any) -> None:
            io = self._fastpersist_io()
            if io is not None:
                io.finalize()  # every rank: nothing of its own pending when rank 0 deletes
            super().remove_checkpoint(filepath)

    class FastPersistFSDPStrategy(strategies.FSDPStrategy):
        """FSDP whose sharded checkpoints (the default here) go through fastpersist's DCP storage
        layer (:func:`fastpersist.dcpsave.save_sharded`), full ones through the CheckpointIO."""

        def __init__(self, *args: Any, checkpoint_io: Any = None, state_dict_type: str = "sharded",
                     **kwargs: Any) -> None:
            super().__init__(*args, checkpoint_io=checkpoint_io or FastPersistCheckpointIO(),
                             state_dict_type=state_dict_type, **kwargs)
            #: sharded checkpoints written through ``FastPersistWriter`` by this strategy
            self.dcp_saves = 0

        def _setup_model(self, model: Any) -> Any:
            # Lightning passes device_id=None on CPU, which torch's FSDP refuses
            from torch.distributed.fsdp import FullyShardedDataParallel

            if self.root_device.type != "cpu" or any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
                return super()._setup_model(model)
            fsdp_module = importlib.import_module(f"{package}.strategies.fsdp")
            model = FullyShardedDataParallel(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=torch.device("cpu"),
                **self.kwargs,
            )
            fsdp_module._move_torchmetrics_to_device(model, self.root_device)
            fsdp_module._setup_activation_checkpointing(model, self._activation_checkpointing_kwargs)
            return model

        def save_checkpoint(
            self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None
        ) -> None:
            if self._state_dict_type == "sharded" and is_s3_url(filepath):
                raise ValueError(f"fsdp_fastpersist: sharded checkpoints cannot go to object storage yet ({filepath}); "
                                 "use a local dirpath, or state_dict_type='full' (one object through the "
                                 "CheckpointIO)")
            if self._state_dict_type != "sharded" or not dcpsave.available() or storage_options is not None:
                return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            folder = self.broadcast(filepath)
            shards = {"model": checkpoint.pop("state_dict")}
            shards.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
            meta_name = importlib.import_module(f"{package}.strategies.fsdp")._METADATA_FILENAME
            dcpsave.save_sharded(shards, folder, rest=checkpoint, rest_name=meta_name, writes_rest=self.global_rank == 0)
            self.dcp_saves += 1

    for cls in (FastPersistCheckpointIO, FastPersistDDPStrategy, FastPersistFSDPStrategy):
        _publish(cls, package)

    return types.SimpleNamespace(
        FastPersistCheckpointIO=FastPersistCheckpointIO,
        FastPersistDDPStrategy=FastPersistDDPStrategy,
        FastPersistFSDPStrategy=FastPersistFSDPStrategy,
        StrategyRegistry=strategies.StrategyRegistry,
        package=package,
    )


#: module-level name prefix of the classes built for each package (pickle finds them by
#: ``fastpersist.integrations.lightning.<prefix><class name>``; see ``__getattr__``)
_PREFIX = {"lightning.pytorch": "", "pytorch_lightning": "PL"}
_CLASS_NAMES = ("FastPersistCheckpointIO", "FastPersistDDPStrategy", "FastPersistFSDPStrategy")


def _publish(cls: type, package: str) -> None:
    """Give a class built by ``_define`` a module-level name, so that pickle (``ddp_spawn``'s
    launcher, ``pickle.dumps(trainer)``) finds it: ``FastPersistCheckpointIO`` for
    ``lightning.pytorch``, ``PLFastPersistCheckpointIO`` for ``pytorch_lightning``."""
    name = _PREFIX[package] + cls.__name__
    cls.__module__ = __name__
    cls.__qualname__ = name
    globals()[name] = cls


def __getattr__(name: str) -> Any:
    """``PLFastPersistCheckpointIO``... (and the plain names) built on first use, so an
    unpickling process that has not built them yet finds them."""
    for package, prefix in _PREFIX.items():
        if name.startswith(prefix) and name[len(prefix):] in _CLASS_NAMES and (prefix or name in _CLASS_NAMES):
            if prefix == "" and package not in _classes:
                continue
            return getattr(classes_for(package), name[len(prefix):])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def classes_for(package: str = "lightning.pytorch") -> types.SimpleNamespace:
    """The adapter classes for ``package`` (``"lightning.pytorch"`` or
    ``"pytorch_lightning"``), built once, with the strategy names registered."""
    with _classes_lock:
        ns = _classes.get(package)
        if ns is None:
            ns = _classes[package] = _define(package)
            register_strategies(ns)
        return ns


def register_strategies(ns: Optional[types.SimpleNamespace] = None) -> list[str]:
    """Register ``ddp_fastpersist``, ``ddp_fastpersist_spawn``, ``ddp_fastpersist_fork``
    and ``fsdp_fastpersist`` in the package's ``StrategyRegistry`` (replacing the
    start-up hook's lazy entries). Returns the names registered."""
    ns = ns or classes_for()
    registry = ns.StrategyRegistry
    for name in _startup.STRATEGIES:
        if name in registry:
            registry.remove(name)
    return _startup.register_strategies(registry, ns.package, lambda _pkg, cls_name: getattr(ns, cls_name))


def _default_package() -> str:
    try:
        importlib.import_module("lightning.pytorch")
        return "lightning.pytorch"
    except ImportError:
        return "pytorch_lightning"


_ns = classes_for(_default_package())
FastPersistCheckpointIO: Callable[..., Any] = _ns.FastPersistCheckpointIO
FastPersistDDPStrategy: Callable[..., Any] = _ns.FastPersistDDPStrategy
FastPersistFSDPStrategy: Callable[..., Any] = _ns.FastPersistFSDPStrategy
del _ns
