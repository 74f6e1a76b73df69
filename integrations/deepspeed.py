"""DeepSpeed: a ``CheckpointEngine`` that writes and reads through fastpersist.

Turn it on for one engine, after ``deepspeed.initialize``::

    from fastpersist.integrations import deepspeed as fp_deepspeed
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=ds_config, ...)
    fp_deepspeed.enable(engine)

for every engine created afterwards, before ``deepspeed.initialize``::

    fp_deepspeed.enable()

or with no code: ``FASTPERSIST_DEEPSPEED=1`` (``FASTPERSIST_PATCH_TORCH_SAVE=1`` turns
it on too, unless ``FASTPERSIST_DEEPSPEED=0``), read by :func:`install_from_env`,
which fastpersist's start-up hook calls when ``deepspeed.runtime.engine`` is imported.

What goes through fastpersist: every file ``engine.save_checkpoint`` /
``load_checkpoint`` (and ``save_16bit_model``) write or read through the engine's
checkpoint engine: the model-states files, the ZeRO optimizer partitions
(``zero_pp_rank_*_optim_states.pt``), MoE expert files. The files are DeepSpeed's
(same names, torch's zip format), so ``engine.load_checkpoint`` of stock DeepSpeed
and ``zero_to_fp32.py`` read them unchanged. Not through fastpersist: the
``latest`` file and the copied ``zero_to_fp32.py`` script (small, written by the
engine itself), NVMe-offload swap files.

The ``CheckpointEngine`` contract, as DeepSpeed's ``save_checkpoint`` drives it:
``create(info)`` at the start, ``save(state_dict, path)`` per file on the ranks that
own it, ``commit(info)`` on every rank, then rank 0 writes ``latest``.
:class:`FastPersistCheckpointEngine` makes each file durable as it is written
(temporary file, fsync, rename, directory fsync) and ``commit`` is where the
checkpoint as a whole becomes durable: every rank finishes its pending writes,
fsyncs the tag directory, and the ranks exchange their outcome; if any rank
failed, every rank raises and ``latest`` is not touched. Rank 0 then writes
``latest`` itself, atomically and durably, before DeepSpeed rewrites it in place
with the same tag (stock DeepSpeed writes ``latest`` right after rank 0's own
commit, while other ranks may still be writing their partitions). So ``latest``
never names a checkpoint that is not complete on every rank.

With ``decoupled=True`` (and a fastpersist with ``save_async``) the engine is a
decoupled one in DeepSpeed's sense: ``save`` snapshots the state and returns, the
writes overlap the following forward/backward, and DeepSpeed calls ``commit``
(then writes ``latest``) at the next optimizer step boundary or at
``engine.destroy()``.

Which rank writes what: ZeRO partitions and stage-3 model-states files are unique
to their rank and written by it alone. The model-states file of stages 0-2, which
every data-parallel rank holds a replica of, is written by all of them together
(``fastpersist.save(..., group=)``, one slice each) when this fastpersist has the
multi-rank save and the replicas are identical (DeepSpeed does not broadcast
buffers such as BatchNorm statistics; when they differ, data-parallel rank 0
writes the file, as stock DeepSpeed does). Only for plain data parallelism (no
model/pipeline parallelism, no MoE).
"""

from __future__ import annotations

import functools
import logging
import os
import re
from typing import Any, Optional

import fastpersist
from fastpersist.commit import atomic_write, fsync_dir

__all__ = ["ENV_VAR", "FastPersistCheckpointEngine", "disable", "enable", "install_from_env"]

log = logging.getLogger(__name__)

ENV_VAR = "FASTPERSIST_DEEPSPEED"
_SWITCH = "FASTPERSIST_PATCH_TORCH_SAVE"
ENGINE_NAME = "FastPersistCheckpointEngine"
_MARK = "_fastpersist_original"
_REPLICATED = re.compile(r"mp_rank_\d+_model_states\.pt")

_default_settings: Optional[dict] = None  # enable() with no engine: settings for new engines


def _checkpoint_engine_base() -> type:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    return CheckpointEngine


def _make_engine_class() -> type:
    base = _checkpoint_engine_base()

    class FastPersistCheckpointEngine(base):  # type: ignore[misc, valid-type]
        """DeepSpeed ``CheckpointEngine`` over :func:`fastpersist.save` / :func:`fastpersist.load`.

        Args:
            config_params: DeepSpeed's config (unused; the signature DeepSpeed's engines share).
            config: a :class:`fastpersist.Config` (default: fastpersist's default).
            decoupled: write in the background (``fastpersist.save_async``) and let
                DeepSpeed commit at the next step boundary; see the module docstring.
            replica_group: a ``torch.distributed`` group of the data-parallel ranks
                that hold replicas of the model-states file, to write it together;
                None: rank 0 of the data-parallel group writes it alone.
        """

        def __init__(self, config_params: Any = None, *, config: Any = None, decoupled: bool = False,
                     replica_group: Any = None) -> None:
            super().__init__(config_params)
            self.name = ENGINE_NAME
            self.config = config
            self.decoupled = bool(decoupled) and hasattr(fastpersist, "save_async")
            self.replica_group = replica_group
            self._pending: list[Any] = []
            self._dirs: set[str] = set()
            self._commit_info: Any = None
            self.saved: list[str] = []  #: paths this rank wrote or took part in, this checkpoint

        # -- the contract
        def create(self, info: Any) -> None:
            self._commit_info = info
            self._dirs = set()
            self.saved = []

        def makedirs(self, path: str, exist_ok: bool = False) -> None:
            os.makedirs(path, exist_ok=exist_ok)
            self._dirs.add(os.path.abspath(path))

        def is_data_parallel_writer(self, dp_rank: int) -> bool:
            return self.replica_group is not None or dp_rank == 0

        def save(self, state_dict: Any, path: str) -> None:
            self._dirs.add(os.path.dirname(os.path.abspath(path)))
            self.saved.append(os.fspath(path))
            if self.replica_group is not None and _REPLICATED.fullmatch(os.path.basename(path)):
                import torch.distributed as dist

                from fastpersist.integrations._replicated import save_replicated

                writer = dist.get_rank(self.replica_group) == 0
                save_replicated(state_dict, path, group=self.replica_group, writer=writer, format="torch",
                                config=self.config)
            elif self.decoupled:
                self._pending.append(fastpersist.save_async(state_dict, path, config=self.config, format="torch"))
            else:
                fastpersist.save(state_dict, path, config=self.config, format="torch")

        def load(self, path: str, map_location: Any = None) -> Any:
            return fastpersist.load(path, map_location=map_location, weights_only=False, config=self.config)

        def commit(self, info: Any) -> bool:
            error: Optional[BaseException] = None
            try:
                pending, self._pending = self._pending, []
                # Every pending save settles before commit returns (none may still rename files
                # of this tag afterwards); the first error is raised, the others are logged.
                errors = []
                for fut in pending:
                    try:
                        fut.wait()
                    except Exception as e:  # noqa: BLE001 - collected, the first one raised
                        errors.append(e)
                for e in errors[1:]:
                    log.error("fastpersist DeepSpeed engine: another save of checkpoint %r failed too: %s",
                              info.tag, e)
                if errors:
                    raise errors[0]
                tag_dir = os.path.abspath(os.path.join(info.save_dir, str(info.tag)))
                for d in sorted(self._dirs | ({tag_dir} if os.path.isdir(tag_dir) else set())):
                    if os.path.isdir(d):
                        fsync_dir(d)
                fsync_dir(os.path.abspath(info.save_dir))
            except BaseException as e:  # reported to every rank below
                error = e
            failed = _gather_failures(error)
            self._commit_info = None
            if failed:
                if error is not None:
                    raise error
                raise RuntimeError(f"checkpoint {info.tag!r} in {info.save_dir!r} failed on rank(s) {failed}; "
                                   "'latest' was not updated")
            if getattr(info, "save_latest", False) and _global_rank() == 0:
                _write_latest(info.save_dir, str(info.tag))
            return True

        def is_decoupled(self) -> bool:
            return self.decoupled

        def get_commit_info(self) -> Any:
            return self._commit_info if self.decoupled else None

        def cleanup(self) -> None:
            if self._commit_info is not None and self.decoupled:
                self.commit(self._commit_info)

        def preserves_storage_sharing(self) -> bool:
            return True  # DeepSpeed clones views first, so the files match its own

    FastPersistCheckpointEngine.__module__ = __name__
    return FastPersistCheckpointEngine


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _gather_failures(error: Optional[BaseException]) -> list[int]:
    """Every rank's outcome of commit, on every rank: the ranks that failed."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [0] if error is not None else []
    outcomes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, None if error is None else repr(error))
    return [r for r, o in enumerate(outcomes) if o is not None]


def _write_latest(save_dir: str, tag: str) -> None:
    """``latest`` = ``tag``, atomically and durably (DeepSpeed then rewrites the same bytes)."""
    final = os.path.join(save_dir, "latest")

    def write(tmp: str) -> None:
        with open(tmp, "w") as fd:
            fd.write(tag)
            fd.flush()
            os.fsync(fd.fileno())

    atomic_write(final, write)


_engine_class: Optional[type] = None


def __getattr__(name: str) -> Any:
    # FastPersistCheckpointEngine subclasses DeepSpeed's class: made on first use, so
    # importing this module does not import DeepSpeed.
    global _engine_class
    if name == "FastPersistCheckpointEngine":
        if _engine_class is None:
            _engine_class = _make_engine_class()
        return _engine_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _replica_group_for(engine: Any) -> Any:
    """The data-parallel group whose ranks hold replicas of the model-states file, or None."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if engine.zero_optimization_partition_weights() or getattr(engine, "has_moe_layers", False):
        return None
    if engine.mp_world_size != 1 or type(engine).__name__ == "PipelineEngine" or engine.use_node_local_storage():
        return None
    group = getattr(engine, "seq_data_parallel_group", None) or engine.data_parallel_group
    if dist.get_world_size(group) != dist.get_world_size():
        return None
    return group


def _attach(engine: Any, *, config: Any = None, decoupled: bool = False, split_replicated: bool = True) -> Any:
    cls = __getattr__("FastPersistCheckpointEngine")
    old = getattr(engine, "checkpoint_engine", None)
    if old is not None and old.is_decoupled():
        old.cleanup()
    group = _replica_group_for(engine) if split_replicated else None
    ce = cls(getattr(engine, "_config", None), config=config, decoupled=decoupled, replica_group=group)
    engine.checkpoint_engine = ce
    if group is not None:
        engine.save_non_zero_checkpoint = True  # every data-parallel rank takes part in the model-states file
    if not hasattr(engine.save_checkpoint, _MARK):
        engine.save_checkpoint = _with_durable_latest(engine, engine.save_checkpoint)
    return ce


def _with_durable_latest(engine: Any, original: Any) -> Any:
    """After save_checkpoint: fsync the ``latest`` file DeepSpeed rewrote in place."""

    @functools.wraps(original)
    def save_checkpoint(save_dir: str, *args: Any, **kwargs: Any) -> Any:
        result = original(save_dir, *args, **kwargs)
        latest = os.path.join(save_dir, "latest")
        if engine.global_rank == 0 and os.path.isfile(latest) and not engine.checkpoint_engine.is_decoupled():
            fd = os.open(latest, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return result

    setattr(save_checkpoint, _MARK, original)
    return save_checkpoint


def enable(engine: Any = None, *, config: Any = None, decoupled: bool = False, split_replicated: bool = True) -> Any:
    """Make DeepSpeed checkpoints go through fastpersist.

    ``enable(engine)`` (after ``deepspeed.initialize``) replaces ``engine.checkpoint_engine``
    and returns the new :class:`FastPersistCheckpointEngine`. ``enable()`` (before
    ``deepspeed.initialize``) makes every engine initialized afterwards use one
    (``deepspeed.runtime.engine.DeepSpeedEngine._configure_checkpointing`` is wrapped)
    and returns None.

    Args:
        config: a :class:`fastpersist.Config` for the saves and loads.
        decoupled: background writes committed at the next step boundary (needs
            ``fastpersist.save_async``; ignored without it).
        split_replicated: write the stages 0-2 model-states file from all
            data-parallel ranks together (see the module docstring).
    """
    settings = dict(config=config, decoupled=decoupled, split_replicated=split_replicated)
    if engine is not None:
        return _attach(engine, **settings)
    global _default_settings
    _default_settings = settings
    from deepspeed.runtime.engine import DeepSpeedEngine

    if not hasattr(DeepSpeedEngine._configure_checkpointing, _MARK):
        original = DeepSpeedEngine._configure_checkpointing

        @functools.wraps(original)
        def _configure_checkpointing(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            if _default_settings is not None:
                _attach(self, **_default_settings)
            return result

        setattr(_configure_checkpointing, _MARK, original)
        DeepSpeedEngine._configure_checkpointing = _configure_checkpointing
    return None


def disable() -> None:
    """Engines initialized from now on keep DeepSpeed's own checkpoint engine
    (engines already enabled keep fastpersist's)."""
    global _default_settings
    _default_settings = None


def env_enabled() -> bool:
    """``FASTPERSIST_DEEPSPEED`` if set, else ``FASTPERSIST_PATCH_TORCH_SAVE``
    (booleans: 1/0, true/false, on/off, yes/no; anything else raises ValueError)."""
    from fastpersist.integrations._env import adapter_enabled

    return adapter_enabled(ENV_VAR)


def install_from_env() -> bool:
    """:func:`enable` for every engine of the process if :func:`env_enabled`. Idempotent;
    returns whether it is on. fastpersist's start-up hook calls this when
    ``deepspeed.runtime.engine`` has been imported."""
    if not env_enabled():
        return _default_settings is not None
    if _default_settings is None:
        enable()
    return True
