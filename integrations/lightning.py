"""Lightning checkpoints through fastpersist.

Two ways to turn it on, both keeping Lightning's own layout, retention and resume
(``ModelCheckpoint(save_top_k, save_last, every_n_train_steps)``, ``ckpt_path="last"``)::

    from fastpersist.integrations.lightning import FastPersistCheckpointIO
    trainer = Trainer(plugins=[FastPersistCheckpointIO()])     # any strategy that uses a CheckpointIO

    trainer = Trainer(strategy="ddp_fastpersist", devices=2)     # no import needed: see below

:class:`FastPersistCheckpointIO` writes every checkpoint file with
:func:`fastpersist.save` (aligned O_DIRECT, durable: fsync, rename, directory
fsync) or, when the installed fastpersist has :func:`fastpersist.save_async`, in the
background: the state is captured at the call (one copy into a bounded pool of
page-locked host memory; no extra copy on the GPU as Lightning's
``AsyncCheckpointIO`` makes) and written while training goes on. Pending saves are
finished before a checkpoint is loaded or removed (so retention never deletes the
previous checkpoint before the new one is durable), before ``ModelCheckpoint`` links
or copies ``last.ckpt`` (``save_last="link"``), and at teardown; their errors are
raised there. Loads go through :func:`fastpersist.load`. ``s3://`` paths
(``ModelCheckpoint(dirpath="s3://bucket/prefix")``, ``Trainer(default_root_dir=...)``,
``fit(ckpt_path="s3://...")``) go to object storage the same way: each ``.ckpt`` one
object, committed whole by its multipart upload (docs/objectstore.md); removals
delete the object. Lightning lists and checks such folders through fsspec, which needs
``s3fs`` installed. Other URLs (``gs://``, ...) go to Lightning's ``TorchCheckpointIO``.

Strategy names, registered in Lightning's ``StrategyRegistry``:

``"ddp_fastpersist"`` (also ``"ddp_fastpersist_spawn"``, ``"ddp_fastpersist_fork"``)
    :class:`FastPersistDDPStrategy`: DDP whose ``save_checkpoint`` runs on every rank
    (Lightning's own calls the CheckpointIO on rank 0 only) and splits the one
    replicated file across the ranks with ``fastpersist.save(..., group=...)``;
    resumes read the file once in total with ``fastpersist.load(..., group=...)``.
    If the installed fastpersist has no collective save, or the run has one
    process, rank 0 writes through :class:`FastPersistCheckpointIO`.
``"fsdp_fastpersist"``
    :class:`FastPersistFSDPStrategy`: FSDP whose sharded checkpoints
    (``state_dict_type="sharded"``, a directory) are written through
    ``fastpersist.dcp.FastPersistWriter`` (each rank writes its own shards; DCP's
    stock reader loads them); full checkpoints go through the CheckpointIO.

With a save in flight, Lightning's own checks of checkpoint paths see the finished
file: when the classes are built, the adapter wraps the few Lightning functions that
test, list or read checkpoint paths (``ModelCheckpoint.file_exists`` for the ``-vN``
version counter, ``_find_last_checkpoints``, the HPC folder listing, a stock
``TorchCheckpointIO``'s load and remove, ``cloud_io._load`` behind
``load_from_checkpoint``) so that they first wait for this process's pending saves of
that path or directory (:func:`fastpersist.asyncsave.wait_for_path`); see
docs/compat.md (Lightning). :func:`remove_lightning_guards` undoes it.

The classes are module-level names (``FastPersistCheckpointIO``..., and
``PLFastPersistCheckpointIO``... for ``pytorch_lightning``), so a Trainer holding them
pickles (``ddp_spawn``, ``ddp_fastpersist_spawn``).

The names are registered when this module is imported, and, with no import at
all, by fastpersist's start-up hook as soon as Lightning's strategies package is
imported (Lightning discovers no strategies through entry points; see
``integrations/_startup.py``). Both ``lightning`` and ``pytorch_lightning`` are
supported: :func:`classes_for` builds the classes for either package.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import re
import sys
import threading
import types
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import fastpersist
import fastpersist.asyncsave
from fastpersist.distributed import ReplicasDifferError
from fastpersist import s3folder
from fastpersist.localpath import is_local, local_path
from fastpersist.s3url import is_s3_url
from fastpersist.ranks import world_group
from fastpersist.replicated import group_save_available, rank0_if_different, save_replicated
from fastpersist.settle import PendingSaves
from fastpersist.wrappers import Wrappers

from . import _startup

log = logging.getLogger(__name__)

__all__ = [
    "FastPersistCheckpointIO",
    "FastPersistDDPStrategy",
    "FastPersistFSDPStrategy",
    "classes_for",
    "install_lightning_guards",
    "register_strategies",
    "remove_lightning_guards",
]

# Feature checks: the adapter uses what the installed fastpersist offers.
HAS_ASYNC = hasattr(fastpersist, "save_async") and hasattr(fastpersist, "wait_all")


HAS_GROUP_SAVE = group_save_available()


try:  # the DCP storage layer needs a torch whose torch.distributed.checkpoint it supports
    from fastpersist.dcp import FastPersistWriter as _FastPersistWriter
except ImportError:  # without it, fsdp_fastpersist saves through Lightning's own FSDP path
    _FastPersistWriter = None


def _dcp_writer() -> Optional[type]:
    return _FastPersistWriter


# Every FastPersistCheckpointIO alive, so that ModelCheckpoint's link of last.ckpt can
# finish their pending saves first.
_instances: "weakref.WeakSet[Any]" = weakref.WeakSet()
_classes: dict[str, types.SimpleNamespace] = {}
_classes_lock = threading.Lock()


def finish_pending() -> None:
    """Finish the pending background saves of every :class:`FastPersistCheckpointIO`
    (raises the first error)."""
    for io in list(_instances):
        io.finalize()


def _install_link_guard(callbacks_module: Any) -> None:
    """Make ``ModelCheckpoint._link_checkpoint`` (``save_last="link"``, and its copy
    fallback) finish pending saves first, so ``last.ckpt`` never names a file that is
    not complete yet. Installed once per Lightning package; a no-op for other
    CheckpointIOs (nothing pending)."""
    cls = getattr(callbacks_module, "ModelCheckpoint", None)

    def link(original: Any) -> Any:
        def _link_checkpoint(trainer: Any, filepath: str, linkpath: str) -> None:
            finish_pending()
            return original(trainer, filepath, linkpath)
        return _link_checkpoint

    if cls is not None:
        _guards.wrap(cls, "_link_checkpoint", link)


# ---- Lightning's own checks of checkpoint paths see pending async saves -------------------
#
# Lightning tests, lists and reads checkpoint paths itself (ModelCheckpoint's version counter,
# "last"/HPC resume, load_from_checkpoint, a stock TorchCheckpointIO's exists check). With a
# save of this process still in flight, each of those must see the finished file: the guards
# below wait for fastpersist's pending saves of that path (fastpersist.asyncsave.wait_for_path)
# or of that directory (wait_for_dir) and then run Lightning's code unchanged. When nothing
# is pending they cost one check of an empty list. remove_lightning_guards() undoes them.

#: every guard installed, for remove_lightning_guards()
_guards = Wrappers()


def _wait_path(path: Any) -> None:
    if path is not None and is_s3_url(path):
        fastpersist.asyncsave.wait_for_path(str(path))
    elif path is not None and is_local(path):
        fastpersist.asyncsave.wait_for_path(local_path(path))


def _wait_dir(path: Any) -> None:
    if path is not None and is_s3_url(path):
        fastpersist.asyncsave.wait_for_dir(str(path))
    elif path is not None and is_local(path):
        fastpersist.asyncsave.wait_for_dir(local_path(path))


def _forget_listings(path: str) -> None:
    """After a save or removal of an ``s3://`` object: drop what s3fs (Lightning's
    filesystem for such paths, through fsspec) has cached about its folder, so that
    ``ModelCheckpoint``'s existence checks and listings see the change."""
    if not is_s3_url(path) or "s3fs" not in sys.modules:
        return
    fs_class = getattr(sys.modules["s3fs"], "S3FileSystem", None)
    for fs in list(getattr(fs_class, "_cache", {}).values()):
        with contextlib.suppress(Exception):
            fs.invalidate_cache(path)


def _find_last_on_s3(callback: Any, folder: str) -> set[str]:
    """``ModelCheckpoint._find_last_checkpoints`` for an ``s3://`` folder. Lightning's own
    lists it with the callback's filesystem, which is the local one while ``dirpath`` is
    unresolved (``default_root_dir`` set, ``dirpath`` not), and keeps fsspec's names of
    the objects, which lack the scheme (``bucket/key``) and are then looked up on the
    local filesystem: no ``ckpt_path="last"`` resume from s3 at all."""
    from fsspec.core import url_to_fs  # noqa: PLC0415 - Lightning's own dependency

    _wait_dir(folder)
    fs, _path = url_to_fs(folder)
    pattern = re.compile(rf"^{re.escape(callback.CHECKPOINT_NAME_LAST)}(-(\d+))?$")
    if not fs.exists(folder):
        return set()
    found = set()
    for name in fs.ls(folder, detail=False, refresh=True):
        stem, ext = os.path.splitext(str(name).rsplit("/", 1)[-1])
        if ext == callback.FILE_EXTENSION and pattern.match(stem):
            found.add("s3://" + str(name).lstrip("/"))
    return found


def _install_path_guards(package: str, fabric: str) -> None:
    """Make Lightning's checks of checkpoint paths wait for pending async saves (see above)."""
    mc = importlib.import_module(f"{package}.callbacks.model_checkpoint").ModelCheckpoint
    connector = importlib.import_module(f"{package}.trainer.connectors.checkpoint_connector")._CheckpointConnector
    torch_io = importlib.import_module(f"{fabric}.plugins.io.torch_io").TorchCheckpointIO
    cloud_io = importlib.import_module(f"{fabric}.utilities.cloud_io")

    def file_exists(original: Any) -> Any:  # the -vN version counter (issue 23 case 1)
        @functools.wraps(original)
        def wrapper(self: Any, filepath: Any, trainer: Any) -> bool:
            _wait_path(filepath)
            return original(self, filepath, trainer)
        return wrapper

    def find_last(original: Any) -> Any:  # ckpt_path="last": lists dirpath
        @functools.wraps(original)
        def wrapper(self: Any, trainer: Any) -> Any:
            _wait_dir(self.dirpath)
            resolve = getattr(self, "_ModelCheckpoint__resolve_ckpt_dir", None)
            folder = self.dirpath or (resolve(trainer) if resolve is not None else None)
            if folder is not None and is_s3_url(folder):
                return _find_last_on_s3(self, str(folder))
            return original(self, trainer)
        return wrapper

    def max_version(original: Any) -> Any:  # ckpt_path="hpc", hpc_save_path: list the folder
        @functools.wraps(original)
        def wrapper(dir_path: Any, *args: Any, **kwargs: Any) -> Any:
            _wait_dir(dir_path)
            return original(dir_path, *args, **kwargs)
        return wrapper

    def io_method(original: Any) -> Any:  # a stock TorchCheckpointIO's load (exists check) / remove
        @functools.wraps(original)
        def wrapper(self: Any, path: Any, *args: Any, **kwargs: Any) -> Any:
            _wait_path(path)
            return original(self, path, *args, **kwargs)
        return wrapper

    def load(original: Any) -> Any:  # cloud_io._load: load_from_checkpoint and TorchCheckpointIO read
        @functools.wraps(original)
        def wrapper(path_or_url: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(path_or_url, (str, os.PathLike)):
                _wait_path(path_or_url)
            return original(path_or_url, *args, **kwargs)
        return wrapper

    _guards.wrap(mc, "file_exists", file_exists)
    _guards.wrap(mc, "_find_last_checkpoints", find_last)
    _guards.wrap(connector, "_CheckpointConnector__max_ckpt_version_in_folder", max_version)
    _guards.wrap(torch_io, "load_checkpoint", io_method)
    _guards.wrap(torch_io, "remove_checkpoint", io_method)
    original_load = cloud_io._load
    if _guards.wrap(cloud_io, "_load", load):  # and the modules that did "from cloud_io import _load as pl_load"
        _guards.rebind(original_load, cloud_io._load, (package, fabric), skip=cloud_io)


def remove_lightning_guards() -> None:
    """Restore every Lightning function the adapter wrapped (the path guards and the
    ``save_last="link"`` guard), for both packages. The adapter classes keep working;
    Lightning's own checks then no longer wait for pending async saves."""
    _guards.undo()
    _installed.clear()


_installed: set[str] = set()


def _unwrap(io: Any, wrapper_cls: type) -> Any:
    while isinstance(io, wrapper_cls) and io.checkpoint_io is not None:
        io = io.checkpoint_io
    return io


def install_lightning_guards(package: str = "lightning.pytorch") -> None:
    """Install the guards (idempotent): Lightning's checks of checkpoint paths wait for
    pending async saves, and ``save_last="link"`` links only finished files. Done when
    the adapter classes for ``package`` are built; :func:`remove_lightning_guards` undoes it."""
    if package in _installed:
        return
    fabric = "lightning.fabric" if package.startswith("lightning.") else "lightning_fabric"
    _install_link_guard(importlib.import_module(f"{package}.callbacks.model_checkpoint"))
    _install_path_guards(package, fabric)
    _installed.add(package)


def _define(package: str) -> types.SimpleNamespace:
    """Build the adapter classes against ``package`` (``"lightning.pytorch"`` or
    ``"pytorch_lightning"``), whose class hierarchies are distinct."""
    pl = importlib.import_module(package)
    fabric = "lightning.fabric" if package.startswith("lightning.") else "lightning_fabric"
    CheckpointIO = importlib.import_module(f"{fabric}.plugins.io.checkpoint_io").CheckpointIO
    TorchCheckpointIO = importlib.import_module(f"{fabric}.plugins.io.torch_io").TorchCheckpointIO
    wrapper = importlib.import_module(f"{package}.plugins.io.wrapper")._WrappingCheckpointIO
    strategies = importlib.import_module(f"{package}.strategies")
    install_lightning_guards(package)
    del pl

    class FastPersistCheckpointIO(CheckpointIO):
        """Lightning ``CheckpointIO`` that saves and loads through fastpersist.

        Args:
            async_save: write in the background with :func:`fastpersist.save_async`
                (default: when the installed fastpersist has it). ``False``: every
                save returns when the file is durable.
            mode: ``save_async``'s capture mode, ``"snapshot"`` (default) or ``"lazy"``.
            config: a :class:`fastpersist.Config` for every save and load.

        With ``async_save``, ``trainer.save_checkpoint(path)`` returns before ``path``
        exists; call :meth:`finalize` (or let the Trainer tear down) before reading it
        yourself. Loggers that upload checkpoint files in ``after_save_checkpoint``
        (``log_model="all"``) need ``async_save=False``.
        """

        def __init__(self, async_save: Optional[bool] = None, mode: str = "snapshot", config: Any = None) -> None:
            super().__init__()
            if async_save and not HAS_ASYNC:
                raise ValueError("async_save=True needs fastpersist.save_async, which this fastpersist lacks")
            self.async_save = HAS_ASYNC if async_save is None else bool(async_save)
            self.mode = mode
            self.config = config
            self._pending = PendingSaves()
            self._fallback = TorchCheckpointIO()
            #: saves/loads done by fastpersist in this process (sync, async, collective, load)
            self.counts = {"save": 0, "save_async": 0, "save_group": 0, "load": 0, "load_group": 0, "torch": 0}
            _instances.add(self)

        # -- saves
        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
            if storage_options is not None:
                raise TypeError(
                    f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by {type(self).__name__}"
                )
            if is_s3_url(path):
                target = str(path)
            elif not is_local(path):
                self.finalize()
                self.counts["torch"] += 1
                return self._fallback.save_checkpoint(checkpoint, path)
            else:
                target = local_path(path)
                os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
            if not self.async_save:
                fastpersist.save(checkpoint, target, config=self.config)
                self.counts["save"] += 1
                _forget_listings(target)
                return
            self._collect(block=False)
            self.track(fastpersist.save_async(checkpoint, target, mode=self.mode, config=self.config))
            self.counts["save_async"] += 1

        def track(self, future: Any) -> None:
            """Finish ``future`` (a background save of a checkpoint file) with this plugin's own."""
            self._pending.add(future)

        def _collect(self, block: bool) -> None:
            """Drop finished futures, raising the first error; with ``block`` wait for all."""
            self._pending.collect(block=block, what="a checkpoint", logger=log,
                                  on_settled=lambda f: _forget_listings(str(getattr(f, "path", ""))))

        def finalize(self) -> None:
            """Wait until every checkpoint this plugin started is durable under its name."""
            self._collect(block=True)

        def __getstate__(self) -> dict[str, Any]:
            # A pickled copy (ddp_spawn's launcher pickles the Trainer) starts with no
            # pending saves: those stay with, and are finished by, this process.
            state = self.__dict__.copy()
            del state["_pending"]
            return state

        def __setstate__(self, state: dict[str, Any]) -> None:
            self.__dict__.update(state)
            self._pending = PendingSaves()
            _instances.add(self)

        @property
        def pending(self) -> int:
            """How many background saves have not finished."""
            return self._pending.running()

        # -- loads and removals
        def load_checkpoint(
            self,
            path: Any,
            map_location: Optional[Any] = lambda storage, loc: storage,
            weights_only: Optional[bool] = None,
        ) -> dict[str, Any]:
            self.finalize()
            if is_s3_url(path):  # fastpersist.load names a missing object (a FileNotFoundError)
                self.counts["load"] += 1
                return fastpersist.load(str(path), map_location=map_location, weights_only=weights_only,
                                        config=self.config)
            if not is_local(path):
                self.counts["torch"] += 1
                return self._fallback.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
            target = local_path(path)
            fastpersist.asyncsave.wait_for_path(target)  # a pending save of another CheckpointIO
            if not os.path.exists(target):
                raise FileNotFoundError(f"Checkpoint file not found: {path}")
            self.counts["load"] += 1
            return fastpersist.load(target, map_location=map_location, weights_only=weights_only, config=self.config)

        def load_group(self, path: Any, group: Any, map_location: Any = None, weights_only: Optional[bool] = None) -> Any:
            """Collective load: the ranks of ``group`` read the file once in total."""
            self.finalize()
            target = local_path(path)
            fastpersist.asyncsave.wait_for_path(target)
            if not os.path.exists(target):
                raise FileNotFoundError(f"Checkpoint file not found: {path}")
            self.counts["load_group"] += 1
            return fastpersist.load(
                target, map_location=map_location, weights_only=weights_only, config=self.config, group=group
            )

        def remove_checkpoint(self, path: Any) -> None:
            # Retention: the checkpoint that replaces this one must be durable first.
            self.finalize()
            if is_s3_url(path):
                s3folder.delete_object(str(path), config=self.config)
                _forget_listings(str(path))
                return
            self._fallback.remove_checkpoint(path)

        def teardown(self) -> None:
            self.finalize()

    class FastPersistDDPStrategy(strategies.DDPStrategy):
        """DDP whose checkpoints every rank writes together through fastpersist.

        ``save_checkpoint`` is called by Lightning on every rank; with more than one
        rank and a fastpersist that has collective saves, all ranks write one ordinary
        torch file together, each rank a block-aligned slice (byte-identical to rank
        0's one-rank save), in the background when the CheckpointIO saves
        asynchronously (``fastpersist.save_async(..., group=WORLD)``; the default),
        else blocking. Otherwise (one rank, no collective saves, or a CheckpointIO that
        is not :class:`FastPersistCheckpointIO`) rank 0 saves through the
        CheckpointIO, as stock DDP does.

        The checkpoint's small parts (everything but ``state_dict`` and
        ``optimizer_states``: callback, loop and scheduler states, hyper-parameters)
        may differ between ranks, e.g. a ``ModelCheckpoint`` monitoring a metric
        logged without ``sync_dist``. The ranks compare a digest of them; when they
        differ, every rank takes rank 0's (broadcast; rank 0 takes the same unpickled
        copy) and the file holds rank 0's checkpoint (equal values on load; the pickle's
        memo may share fewer objects than rank 0's own save would), still written by
        all ranks. If the bulk tensors differ too (the
        collective save compares every tensor's CRC and raises
        :class:`~fastpersist.distributed.ReplicasDifferError`), rank 0 writes its own
        checkpoint alone through the CheckpointIO (in the background when it saves
        asynchronously) and a warning names the difference.
        """

        #: top-level checkpoint keys holding the replicated bulk tensors (never broadcast)
        _BULK_KEYS = ("state_dict", "optimizer_states")

        def __init__(self, *args: Any, checkpoint_io: Any = None, **kwargs: Any) -> None:
            super().__init__(*args, checkpoint_io=checkpoint_io or FastPersistCheckpointIO(), **kwargs)

        def _fastpersist_io(self) -> Any:
            io = _unwrap(self.checkpoint_io, wrapper)
            return io if isinstance(io, FastPersistCheckpointIO) else None

        def save_checkpoint(
            self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None
        ) -> None:
            io = self._fastpersist_io()
            group = world_group() if HAS_GROUP_SAVE else None
            if io is None or group is None or storage_options is not None or not is_local(filepath):
                return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            target = local_path(filepath)
            os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
            # (an earlier background save's uncollected error fails this save on every rank, at its
            # plan step: fastpersist.distributed)

            def save(obj: Any, path: str, group: Any = None, format: Any = None, config: Any = None) -> None:
                if group is None:  # the replicas differ: rank 0 writes its own checkpoint alone
                    io.save_checkpoint(checkpoint, path)
                elif io.async_save:
                    io.track(fastpersist.save_async(obj, path, mode=io.mode, config=io.config, group=group))
                    io.counts["save_group_async"] = io.counts.get("save_group_async", 0) + 1
                else:
                    fastpersist.save(obj, path, config=io.config, group=group)

            def differ(e: ReplicasDifferError) -> None:
                if self.is_global_zero:
                    warnings.warn(
                        f"ddp_fastpersist: the ranks' checkpoints for {target} differ beyond their small parts "
                        f"({e.difference or e}); rank 0 writes its own checkpoint alone (not split across ranks). "
                        "Make the replicas equal (e.g. DDP's broadcast_buffers) to get split saves",
                        RuntimeWarning, stacklevel=3)

            try:
                agreed = self._rank0_small_parts(checkpoint, group)
            except ReplicasDifferError as e:  # small parts that do not pickle on some rank
                differ(e)
                agreed = None
            if agreed is None:
                if self.is_global_zero:
                    io.save_checkpoint(checkpoint, target)
            elif save_replicated(agreed, target, group=group, writer=self.is_global_zero, save=save, on_differ=differ):
                io.counts["save_group"] += 1

        def _rank0_small_parts(self, checkpoint: dict[str, Any], group: Any) -> dict[str, Any]:
            """``checkpoint`` with its small parts (every top-level key but :attr:`_BULK_KEYS`)
            replaced by rank 0's when they differ between ranks, in rank 0's key order; the
            same object when they do not (then every rank writes its own, equal, replica)."""
            small = {k: v for k, v in checkpoint.items() if k not in self._BULK_KEYS}
            differ, (order, theirs) = rank0_if_different((list(checkpoint), small), group,
                                                         what="the checkpoint's small parts")
            if not differ:
                return checkpoint
            log.debug("ddp_fastpersist: the checkpoint's small parts differ between ranks; rank 0's are saved")
            return {k: (theirs[k] if k in theirs else checkpoint[k]) for k in order if k in theirs or k in checkpoint}

        def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
            io = self._fastpersist_io()
            group = world_group() if HAS_GROUP_SAVE else None
            if io is None or group is None or not is_local(checkpoint_path):
                return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
            return io.load_group(
                checkpoint_path, group, map_location=lambda storage, loc: storage, weights_only=weights_only
            )

        def remove_checkpoint(self, filepath: Any) -> None:
            io = self._fastpersist_io()
            if io is not None:
                io.finalize()  # every rank: nothing of its own pending when rank 0 deletes
            super().remove_checkpoint(filepath)

    FSDPStrategy = strategies.FSDPStrategy

    class FastPersistFSDPStrategy(FSDPStrategy):
        """FSDP whose sharded checkpoints go through fastpersist's DCP storage layer.

        ``state_dict_type="sharded"`` (the default here; Lightning's ``FSDPStrategy``
        defaults to ``"full"``): each rank writes its shards with
        ``torch.distributed.checkpoint.save(..., storage_writer=FastPersistWriter(dir))``
        (aligned, durable, checksummed; a stock DCP directory that Lightning's and
        DCP's own readers load), and rank 0 writes the remaining trainer state
        (``meta.pt``) with :func:`fastpersist.save`. ``state_dict_type="full"`` saves
        go through the CheckpointIO (:class:`FastPersistCheckpointIO` by default).
        Loads are Lightning's own (DCP's stock reader). Without ``fastpersist.dcp``
        sharded saves are Lightning's own.

        On CPU (``accelerator="cpu"``, gloo) the module is wrapped with
        ``device_id=torch.device("cpu")``: Lightning passes ``device_id=None`` there,
        and torch's FSDP then refuses ("FSDP needs a non-CPU accelerator device").
        (``Trainer(strategy="fsdp", accelerator="cpu")`` is refused by Lightning
        itself; ``strategy="fsdp_fastpersist"`` is not.)
        """

        def __init__(self, *args: Any, checkpoint_io: Any = None, state_dict_type: str = "sharded",
                     **kwargs: Any) -> None:
            super().__init__(*args, checkpoint_io=checkpoint_io or FastPersistCheckpointIO(),
                             state_dict_type=state_dict_type, **kwargs)
            #: sharded checkpoints written through ``FastPersistWriter`` by this strategy
            self.dcp_saves = 0

        def _setup_model(self, model: Any) -> Any:
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
            writer = _dcp_writer()
            if self._state_dict_type == "sharded" and is_s3_url(filepath):
                raise ValueError(f"fsdp_fastpersist: sharded checkpoints cannot go to object storage yet ({filepath}); "
                                 "use a local dirpath, or state_dict_type='full' (one object through the "
                                 "CheckpointIO)")
            if self._state_dict_type != "sharded" or writer is None or storage_options is not None:
                return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            import torch.distributed.checkpoint as dcp

            fsdp_module = importlib.import_module(f"{package}.strategies.fsdp")
            path = Path(self.broadcast(filepath))
            if path.is_file():
                path.unlink()
            path.mkdir(parents=True, exist_ok=True)
            converted = {"model": checkpoint.pop("state_dict")}
            converted.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
            dcp.save(converted, storage_writer=writer(path))
            if self.global_rank == 0:
                fastpersist.save(checkpoint, path / fsdp_module._METADATA_FILENAME)
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
    for name, (class_name, _params, _description) in _startup.STRATEGIES.items():
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
