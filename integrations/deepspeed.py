"""DeepSpeed: a ``CheckpointEngine`` that writes and reads through fastpersist.

Turn it on with ``enable(engine)`` after ``deepspeed.initialize``, ``enable()`` before it,
``FASTPERSIST_DEEPSPEED=1`` (:func:`install_from_env`, called by the start-up hook) or the
DeepSpeed config's ``"fastpersist"`` key (:func:`apply_config`). What it does:
docs/integrations.md (DeepSpeed), docs/objectstore.md (DeepSpeed).

This module only translates DeepSpeed's ``CheckpointEngine`` contract onto
:class:`fastpersist.tagwrites.TagWrites`: ``create`` plans the tag directory's staging,
``makedirs`` and ``save`` write each file, ``commit`` settles, fsyncs, agrees with every
rank and swaps the directory in, and only then rank 0 replaces ``latest`` (atomically, once:
``engine.save_checkpoint`` is wrapped to call DeepSpeed's with ``save_latest=False``, so
DeepSpeed never rewrites it in place). An ``s3://`` save_dir:
:func:`fastpersist.s3foldersave.save_tag` around DeepSpeed's save.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import re
from typing import Any, Optional

import fastpersist
from fastpersist import s3folder, s3foldersave
from fastpersist.adaptersettings import find_section
from fastpersist.collectivedir import WorldExchange
from fastpersist.envflags import adapter_enabled
from fastpersist.ranks import global_rank, whole_world, world_size
from fastpersist.s3url import is_s3_url
from fastpersist.tagwrites import TagWrites
from fastpersist.wrappers import calling_after, lazy_attributes, on_failure, replace_argument, take_first, wrap_once

__all__ = ["CONFIG_KEY", "ENV_VAR", "FastPersistCheckpointEngine", "apply_config", "config_settings", "disable",
           "enable", "install_from_env"]

log = logging.getLogger(__name__)

ENV_VAR = "FASTPERSIST_DEEPSPEED"
#: Top-level key of the DeepSpeed config (JSON file or dict) read by :func:`apply_config`.
CONFIG_KEY = "fastpersist"
ENGINE_NAME = "FastPersistCheckpointEngine"
_REPLICATED = re.compile(r"mp_rank_\d+_model_states\.pt")
# Entries of a DeepSpeed tag directory (model states, ZeRO/expert optimizer files, the NVMe-offload copy)
_DS_ENTRY_RE = re.compile(r".*(model|optim)_states\.pt|offloaded_tensors", re.DOTALL)

_default_settings: Optional[dict] = None  # enable() with no engine: settings for new engines


@functools.cache
def _make_engine_class() -> type:
    # FastPersistCheckpointEngine subclasses DeepSpeed's class: made on first use, so
    # importing this module does not import DeepSpeed.
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    class FastPersistCheckpointEngine(CheckpointEngine):  # type: ignore[misc, valid-type]
        """DeepSpeed ``CheckpointEngine`` over :func:`fastpersist.save` / :func:`fastpersist.load`:
        ``config`` (a :class:`fastpersist.Config`), ``decoupled`` (background writes committed
        at the next step boundary), ``replica_group`` (the data-parallel ranks that write the
        model-states file together; None: data-parallel rank 0 alone)."""

        def __init__(self, config_params: Any = None, *, config: Any = None, decoupled: bool = False,
                     replica_group: Any = None) -> None:
            super().__init__(config_params)
            self.name = ENGINE_NAME
            self.config = config
            self.decoupled = bool(decoupled) and hasattr(fastpersist, "save_async")
            self.replica_group = replica_group
            # this rank's files of the checkpoint being written
            # (the model-states file: a replica, written by the replica group together where there is one)
            self._writes = TagWrites(is_checkpoint_entry=_DS_ENTRY_RE.fullmatch, what="a DeepSpeed checkpoint",
                                     operation="save_checkpoint", is_replica=_REPLICATED.fullmatch, logger=log)
            self._pending = self._writes.pending  # its background saves
            # set by enable() from the engine
            self.node_local = bool(getattr(config_params, "use_node_local_storage", False))
            self.local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
            self.nvme_offload = False
            self.saved: list[str] = []  #: paths this rank wrote or took part in, this checkpoint

        # -- the contract
        def create(self, info: Any) -> None:
            if self.decoupled and self._writes.uncommitted is not None:
                self.commit(self._writes.uncommitted)  # the previous decoupled checkpoint, not committed yet
            self.saved = []
            # staged where the tag directory exists on some rank and no rank sees a reason not to
            veto = "DeepSpeed copies the NVMe-offload files into the tag directory itself" if self.nvme_offload else None
            self._writes.open(info.save_dir, info.tag, node_local=self.node_local, local_rank=self.local_rank,
                              veto=veto, handle=info)

        def makedirs(self, path: str, exist_ok: bool = False) -> None:
            self._writes.makedirs(path, exist_ok)

        def is_data_parallel_writer(self, dp_rank: int) -> bool:
            return self.replica_group is not None or dp_rank == 0

        def save(self, state_dict: Any, path: str) -> None:
            self.saved.append(os.fspath(path))
            self._writes.save(state_dict, path, save=fastpersist.save, group=self.replica_group, config=self.config,
                              save_async=fastpersist.save_async if self.decoupled else None)  # a failure: at commit

        def load(self, path: str, map_location: Any = None) -> Any:
            return fastpersist.load(path, map_location=map_location, weights_only=False, config=self.config)

        def commit(self, info: Any) -> bool:
            # with no file of this save in the staging directory (save_16bit_model) it is removed;
            # `latest` replaced after it, where the save_checkpoint call asked (_with_atomic_latest)
            self._writes.commit(info.save_dir, info.tag, update_pointer=getattr(info, "save_latest", False))
            return True

        def _abandon(self, error: BaseException) -> None:
            """``save_checkpoint`` raised: never committed (decoupled: DeepSpeed's next commit fails)."""
            self._writes.abandon(error, deferred=self.decoupled)

        def is_decoupled(self) -> bool:
            return self.decoupled

        def get_commit_info(self) -> Any:
            return self._writes.uncommitted if self.decoupled else None

        def cleanup(self) -> None:
            if self._writes.uncommitted is not None and self.decoupled:
                self.commit(self._writes.uncommitted)

        def preserves_storage_sharing(self) -> bool:
            return True  # DeepSpeed clones views first, so the files match its own

    FastPersistCheckpointEngine.__module__ = __name__
    return FastPersistCheckpointEngine


__getattr__ = lazy_attributes(__name__, FastPersistCheckpointEngine=_make_engine_class)


def _replica_group_for(engine: Any) -> Any:
    """The data-parallel group whose ranks hold replicas of the model-states file, or None."""
    if world_size() == 1 or engine.zero_optimization_partition_weights() \
            or getattr(engine, "has_moe_layers", False) or engine.mp_world_size != 1 \
            or type(engine).__name__ == "PipelineEngine" or engine.use_node_local_storage():
        return None
    return whole_world(getattr(engine, "seq_data_parallel_group", None) or engine.data_parallel_group)


def _attach(engine: Any, *, config: Any = None, decoupled: bool = False, split_replicated: bool = True) -> Any:
    cls = _make_engine_class()
    old = getattr(engine, "checkpoint_engine", None)
    if old is not None and old.is_decoupled():
        old.cleanup()
    group = _replica_group_for(engine) if split_replicated else None
    ce = cls(getattr(engine, "_config", None), config=config, decoupled=decoupled, replica_group=group)
    ce.node_local = bool(engine.use_node_local_storage())
    ce.local_rank = int(getattr(engine, "local_rank", ce.local_rank) or 0)
    with contextlib.suppress(Exception):
        ce.nvme_offload = bool(engine.zero_nvme_offload_optimizer())
    engine.checkpoint_engine = ce
    if group is not None:
        engine.save_non_zero_checkpoint = True  # every data-parallel rank takes part in the model-states file
    wrap_once(engine, "save_checkpoint", functools.partial(_with_atomic_latest, engine))
    wrap_once(engine, "load_checkpoint", functools.partial(_with_s3_loads, engine))
    return ce


def _with_atomic_latest(engine: Any, original: Any) -> Any:
    """``engine.save_checkpoint`` that calls DeepSpeed's with ``save_latest=False`` (stock DeepSpeed
    rewrites ``latest`` in place after the commit: a crash between its truncation and its write
    leaves it empty); the checkpoint engine's commit replaces ``latest`` atomically instead, after
    the tag directory is committed (decoupled: at that later commit), where the caller's
    ``save_latest`` (DeepSpeed's default: True) asks for it. An ``s3://`` save_dir:
    :func:`_save_checkpoint_s3`."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_checkpoint(save_dir: str, *args: Any, **kwargs: Any) -> Any:
        if is_s3_url(save_dir):
            return _save_checkpoint_s3(engine, save_checkpoint, signature, (str(save_dir), *args), kwargs)
        ce = engine.checkpoint_engine
        writes = getattr(ce, "_writes", None)
        if not isinstance(writes, TagWrites):  # another checkpoint engine put in since: DeepSpeed's own way
            return original(save_dir, *args, **kwargs)
        wanted, args, kwargs = replace_argument(signature, (save_dir, *args), kwargs, "save_latest", False)
        with writes.asking_pointer(wanted), on_failure(ce._abandon):  # never committed: abandoned
            return original(*args, **kwargs)

    return save_checkpoint


# ---------------------------------------------------------------- s3:// save_dir
_ZERO_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # DeepSpeed copies them beside the tags


def _save_checkpoint_s3(engine: Any, local_save: Any, signature: inspect.Signature, args: tuple, kwargs: dict) -> Any:
    """``engine.save_checkpoint(*args, **kwargs)`` into the ``s3://`` folder ``args[0]``: DeepSpeed's save into
    a local save_dir on every rank, the tag folder committed together, then the ``latest`` object."""
    url, ce = args[0], engine.checkpoint_engine
    if ce.is_decoupled():
        raise ValueError(f"save_checkpoint to {url}: a decoupled checkpoint engine (enable(decoupled=True)) cannot "
                         "save to object storage yet; enable it with decoupled=False for s3:// save_dir")
    # read by DeepSpeed's signature as the local path does (a call it refuses raises its TypeError), no local `latest`
    wanted, args, kwargs = replace_argument(signature, args, kwargs, "save_latest", False)
    given, args, kwargs = replace_argument(signature, args, kwargs, "tag", None)
    tag = str(f"global_step{engine.global_steps}" if given is None else given)
    _, args, kwargs = replace_argument(signature, args, kwargs, "tag", tag)
    s3foldersave.save_tag(url, tag, lambda local_dir: local_save(local_dir, *args[1:], **kwargs),
                          pointer="latest" if wanted else None, beside=_ZERO_SCRIPTS, exchange=WorldExchange(),
                          rank=global_rank(), config=getattr(ce, "config", None), operation="save_checkpoint",
                          kept="`latest` still names the previous tag", logger=log)
    return True


def _with_s3_loads(engine: Any, original: Any) -> Any:
    """``load_checkpoint`` of an ``s3://`` load_dir: the tag given or the ``latest`` object's,
    its committed folder loaded from a local copy."""

    @functools.wraps(original)
    def load_checkpoint(load_dir: Any, *args: Any, **kwargs: Any) -> Any:
        if not is_s3_url(load_dir):
            return original(load_dir, *args, **kwargs)
        url = str(s3folder.folder_url(load_dir))
        tag, args, rest = take_first(args, kwargs, "tag")
        with s3foldersave.tag_copy(url, tag, config=getattr(engine.checkpoint_engine, "config", None)) as found:
            if found is None:
                log.warning("fastpersist: no `latest` object under %s: nothing to resume (as DeepSpeed without a "
                            "latest file)", url)
                return None, None
            local_dir, tag = found
            path, client = original(local_dir, tag, *args, **rest)
            return s3foldersave.url_of(url, local_dir, path), client

    return load_checkpoint


def enable(engine: Any = None, *, config: Any = None, decoupled: bool = False, split_replicated: bool = True) -> Any:
    """Make DeepSpeed checkpoints go through fastpersist: ``enable(engine)`` (after
    ``deepspeed.initialize``) replaces ``engine.checkpoint_engine`` and returns the new
    :class:`FastPersistCheckpointEngine`; ``enable()`` (before it) gives one to every engine
    initialized afterwards (``DeepSpeedEngine._configure_checkpointing`` wrapped), returns None.

    Args:
        config: a :class:`fastpersist.Config` for the saves and loads.
        decoupled: background writes committed at the next step boundary (needs
            ``fastpersist.save_async``; ignored without it).
        split_replicated: write the stages 0-2 model-states file from all data-parallel
            ranks together (docs/integrations.md, DeepSpeed).
    """
    settings = dict(config=config, decoupled=decoupled, split_replicated=split_replicated)
    if engine is not None:
        return _attach(engine, **settings)
    global _default_settings
    _default_settings = settings
    from deepspeed.runtime.engine import DeepSpeedEngine

    wrap_once(DeepSpeedEngine, "_configure_checkpointing", calling_after(_configured))
    return None


def _configured(engine: Any, *args: Any, **kwargs: Any) -> None:
    """After ``DeepSpeedEngine._configure_checkpointing``: the engine's own config decides, else enable()'s."""
    if config_settings(engine) is not None:
        apply_config(engine)
    elif _default_settings is not None:
        _attach(engine, **_default_settings)


def disable() -> None:
    """Engines initialized from now on keep DeepSpeed's own checkpoint engine
    (engines already enabled keep fastpersist's)."""
    global _default_settings
    _default_settings = None


def env_enabled() -> bool:
    """``FASTPERSIST_DEEPSPEED`` if set, else ``FASTPERSIST_PATCH_TORCH_SAVE``
    (booleans: 1/0, true/false, on/off, yes/no; anything else raises ValueError)."""
    return adapter_enabled(ENV_VAR)


def install_from_env() -> bool:
    """:func:`enable` for every engine of the process if :func:`env_enabled`. Idempotent;
    returns whether it is on. The start-up hook calls it."""
    if not env_enabled():
        return _default_settings is not None
    if _default_settings is None:
        enable()
    return True


def config_settings(engine_or_config: Any) -> Optional[dict]:
    """The ``"fastpersist"`` section of a DeepSpeed config (a ``DeepSpeedEngine``, a
    ``DeepSpeedConfig`` or the config dict), checked
    (:func:`fastpersist.adaptersettings.find_section`); None when the config has none."""
    params = getattr(engine_or_config, "_config", engine_or_config)
    return find_section(getattr(params, "_param_dict", params), key=CONFIG_KEY, where="DeepSpeed config")


def apply_config(engine: Any) -> Optional[Any]:
    """Give ``engine`` fastpersist's checkpoint engine if its DeepSpeed config's ``"fastpersist"``
    section says so; returns it, or None (DeepSpeed's own engine stays, whatever
    ``FASTPERSIST_DEEPSPEED`` says). Idempotent; the start-up hook calls it."""
    settings = config_settings(engine)
    if settings is None or not settings.pop("enabled"):
        return None
    current = getattr(engine, "checkpoint_engine", None)
    if getattr(current, "_fastpersist_from_config", False):
        return current
    ce = _attach(engine, **settings)
    ce._fastpersist_from_config = True
    log.info("fastpersist: DeepSpeed checkpoints through %s (DeepSpeed config key %r)", ENGINE_NAME, CONFIG_KEY)
    return ce
