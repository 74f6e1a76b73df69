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
engine itself into ``save_dir``, beside the tag directories), NVMe-offload swap files.

The ``CheckpointEngine`` contract, as DeepSpeed's ``save_checkpoint`` drives it:
``create(info)`` at the start, ``save(state_dict, path)`` per file on the ranks that
own it, ``commit(info)`` on every rank, then rank 0 writes ``latest``. Each file is
durable as it is written; ``commit`` makes the checkpoint durable as a whole: every
rank settles its pending writes (:func:`fastpersist.settle.settle`), fsyncs the tag
directory, and the ranks exchange their outcome; if any rank failed (a failed
``save`` is reported here, so that no rank waits for one that raised), every rank
raises and ``latest`` is not touched. Rank 0 then writes ``latest`` atomically and
durably (:func:`fastpersist.commit.write_small_file`) before DeepSpeed rewrites it in
place with the same tag, so ``latest`` never names a checkpoint that is not complete on
every rank.

Saving again under a tag whose directory exists (a fixed ``tag="last"``; Lightning's
``DeepSpeedStrategy``, whose tag is always ``checkpoint``) replaces the directory in
one step, since ``latest`` already names it (:mod:`fastpersist.collectivedir`): the
save's files go to the same relative paths in a hidden sibling, swapped in after every
rank succeeded; files that are no part of a DeepSpeed checkpoint (not
``*model_states.pt``/``*optim_states.pt``/``offloaded_tensors``) are carried over,
stale ones (another world size's partitions) go. A save that raises on any rank, or is
killed part-way, leaves the previous checkpoint as it was. A new tag directory is
written directly (``latest`` is its commit). Not staged (a warning): a tag directory
that is a mount point or holds the working directory, and ZeRO NVMe optimizer offload
(DeepSpeed copies its swap files into the tag directory itself). With
``checkpoint.use_node_local_storage`` each node's local rank 0 swaps its node's copy
(not tested here: one machine).

With ``decoupled=True`` (and a fastpersist with ``save_async``) the engine is a
decoupled one in DeepSpeed's sense: ``save`` snapshots the state and returns, the
writes overlap the following forward/backward, and DeepSpeed calls ``commit``
(then writes ``latest``) at the next optimizer step boundary or at
``engine.destroy()``. A save into an existing tag directory stays staged until that
commit (the tag directory holds the previous checkpoint meanwhile); a second
``save_checkpoint`` before it first commits the pending one.

Object storage: ``engine.save_checkpoint("s3://bucket/run", tag)`` runs DeepSpeed's
save into a local temporary save_dir, every rank uploads the files of the tag it wrote
(one object each, under ``s3://bucket/run/TAG/``), rank 0 commits the tag folder
(:mod:`fastpersist.s3folder`'s manifest) and writes the ``latest`` object last, so
``latest`` only ever names a committed tag; ``load_checkpoint("s3://bucket/run")``
downloads the committed tag into a local temporary directory and loads it there
(docs/objectstore.md, DeepSpeed). Not with ``decoupled=True``.

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

import contextlib
import functools
import logging
import os
import re
import shutil
import tempfile
from typing import Any, Optional

import fastpersist
from fastpersist import dircommit, s3folder
from fastpersist.collectivedir import CollectiveDir, agree
from fastpersist.commit import fsync_dir, fsync_path, write_small_file
from fastpersist.envflags import adapter_enabled
from fastpersist.ranks import all_gather, global_rank, world_size
from fastpersist.replicated import save_replicated
from fastpersist.settle import PendingSaves, settle
from fastpersist.s3url import is_s3_url

__all__ = ["CONFIG_KEY", "ENV_VAR", "FastPersistCheckpointEngine", "apply_config", "config_settings", "disable",
           "enable", "install_from_env"]

log = logging.getLogger(__name__)

ENV_VAR = "FASTPERSIST_DEEPSPEED"
#: Top-level key of the DeepSpeed config (JSON file or dict) read by :func:`apply_config`.
CONFIG_KEY = "fastpersist"
_CONFIG_FIELDS = ("enabled", "decoupled", "split_replicated", "config")
ENGINE_NAME = "FastPersistCheckpointEngine"
_MARK = "_fastpersist_original"
_REPLICATED = re.compile(r"mp_rank_\d+_model_states\.pt")
# Entries of a tag directory that belong to a DeepSpeed checkpoint (model states, ZeRO/expert
# optimizer files, expert and pipeline-layer files, the NVMe-offload copy): in a tag directory
# being replaced, those the new save does not write again are stale and go with the old copy.
_DS_ENTRY_RE = re.compile(r".*(model|optim)_states\.pt|offloaded_tensors", re.DOTALL)

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
            self._pending = PendingSaves()
            self._dirs: set[str] = set()
            self._commit_info: Any = None
            self._stage: Optional[_Stage] = None  # this save's staging directory, if it is staged
            self._save_error: Optional[BaseException] = None  # first failed save() of this checkpoint
            # Set by enable() from the engine: each node's local rank 0 commits with node-local
            # storage; DeepSpeed copies NVMe-offload files into the tag directory itself.
            self.node_local = bool(getattr(config_params, "use_node_local_storage", False))
            self.local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
            self.nvme_offload = False
            self.saved: list[str] = []  #: paths this rank wrote or took part in, this checkpoint

        # -- the contract
        def create(self, info: Any) -> None:
            if self.decoupled and self._commit_info is not None:
                # The previous decoupled checkpoint was not committed yet (no step since): first
                # commit it (a new save waits for the previous one).
                self.commit(self._commit_info)
            self._commit_info = info
            self._dirs = set()
            self.saved = []
            self._save_error = None
            self._stage = None
            self._stage = self._plan_stage(info)

        def _committer(self) -> bool:
            """Whether this rank swaps the staging directory in: global rank 0, or with
            node-local storage each node's local rank 0."""
            return self.local_rank == 0 if self.node_local else global_rank() == 0

        def _plan_stage(self, info: Any) -> Optional[_Stage]:
            """Every rank: whether this save is staged (the tag directory exists on some rank,
            and no rank sees a reason not to), and the staging directory's token (rank 0's)."""
            staged = dircommit.StagedDir(_tag_dir(info))
            committer = self._committer()
            if committer:
                staged.clean_leftovers(operation="save_checkpoint", logger=log, fsync_after_restore=False)
            veto = "DeepSpeed copies the NVMe-offload files into the tag directory itself" if self.nvme_offload else None
            token = CollectiveDir.plan(staged, rank=global_rank(), committer=committer, veto=veto, existing_only=True,
                                       operation=f"checkpoint {info.tag!r}", logger=log)
            return None if token is None else _Stage(info, token, committer)

        def makedirs(self, path: str, exist_ok: bool = False) -> None:
            staged = self._stage.redirect(path) if self._stage is not None else None
            if staged is not None:
                os.makedirs(staged, exist_ok=True)  # every rank makes the same staging directory
            else:
                os.makedirs(path, exist_ok=exist_ok)
            self._dirs.add(os.path.abspath(staged or path))

        def is_data_parallel_writer(self, dp_rank: int) -> bool:
            return self.replica_group is not None or dp_rank == 0

        def save(self, state_dict: Any, path: str) -> None:
            self.saved.append(os.fspath(path))
            staged = self._stage.redirect(path) if self._stage is not None else None
            if staged is not None:
                # The same relative path in the staging directory (its folders exist in the tag
                # directory being replaced, where DeepSpeed may not have made them again).
                os.makedirs(os.path.dirname(staged), exist_ok=True)
                path = staged
            self._dirs.add(os.path.dirname(os.path.abspath(path)))
            try:
                self._save(state_dict, path)
            except Exception as e:  # noqa: BLE001 - raised by commit, on every rank
                # Reported at commit, where every rank learns of it: raising here would leave the
                # other ranks waiting in commit's exchange for this one.
                log.error("fastpersist DeepSpeed engine: saving %s failed: %s", path, e)
                if self._save_error is None:
                    self._save_error = e

        def _save(self, state_dict: Any, path: str) -> None:
            if self.replica_group is not None and _REPLICATED.fullmatch(os.path.basename(path)):
                import torch.distributed as dist

                writer = dist.get_rank(self.replica_group) == 0
                save_replicated(state_dict, path, group=self.replica_group, writer=writer, format="torch",
                                config=self.config, save=fastpersist.save)
            elif self.decoupled:
                self._pending.add(fastpersist.save_async(state_dict, path, config=self.config, format="torch"))
            else:
                fastpersist.save(state_dict, path, config=self.config, format="torch")

        def load(self, path: str, map_location: Any = None) -> Any:
            return fastpersist.load(path, map_location=map_location, weights_only=False, config=self.config)

        def commit(self, info: Any) -> bool:
            error: Optional[BaseException] = None
            stage = self._stage if self._stage is not None and self._stage.matches(info) else None
            try:
                # Every pending save settles before commit returns (none may still rename files
                # of this tag afterwards); the first error is raised, the others are logged.
                first = [] if self._save_error is None else [self._save_error]
                self._save_error = None
                settle(self._pending.take(), errors=first, what=f"checkpoint {info.tag!r}", logger=log)
                tag_dir = _tag_dir(info)
                for d in sorted(self._dirs | ({tag_dir} if os.path.isdir(tag_dir) else set())):
                    if os.path.isdir(d):
                        fsync_dir(d)
                fsync_dir(os.path.abspath(info.save_dir))
            except BaseException as e:  # reported to every rank below
                error = e
            self._commit_info = None
            self._stage = None

            def elsewhere(failed: list[int], _message: str, what: str = "") -> RuntimeError:
                return RuntimeError(f"checkpoint {info.tag!r} in {info.save_dir!r}{what} failed on rank(s) {failed}; "
                                    "'latest' was not updated")

            if stage is None:
                agree(error, elsewhere)
            elif stage.agree(error, elsewhere):
                stage.commit(lambda f, m: elsewhere(f, m, ": replacing the tag directory"),
                             per_node=self.node_local and world_size() > 1, missing_ok=True)
            elif stage.committer:
                stage.discard()  # nothing of this save went into the tag directory (save_16bit_model)
            if getattr(info, "save_latest", False) and global_rank() == 0:
                write_small_file(os.path.join(info.save_dir, "latest"), str(info.tag).encode())
            return True

        def _abandon(self, error: BaseException) -> None:
            """``save_checkpoint`` raised (before or in commit): this checkpoint is never committed.
            Decoupled: the commit DeepSpeed still makes at the next step fails on every rank."""
            if self.decoupled:
                if self._commit_info is not None and self._save_error is None:
                    self._save_error = error
            else:
                self._commit_info = None
                self._stage = None  # its staging directory goes with the next save into this tag

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


def _tag_dir(info: Any) -> str:
    return os.path.abspath(os.path.join(os.fspath(info.save_dir), str(info.tag)))


class _Stage(CollectiveDir):
    """One save into an existing tag directory, staged beside it (:mod:`fastpersist.collectivedir`):
    every path DeepSpeed hands to ``save``/``makedirs`` under ``save_dir/tag`` goes to the same
    relative path in the staging directory. Entries of the previous tag directory that are no
    part of a DeepSpeed checkpoint (a user's notes) are carried over; DeepSpeed's files the new
    save did not write again (another world size's partitions) go with the previous copy."""

    def __init__(self, info: Any, token: str, committer: bool) -> None:
        self.save_dir = os.fspath(info.save_dir)
        self.tag = str(info.tag)
        # long tags are shortened in the staging names (NAME_MAX), with a digest of the whole tag
        super().__init__(dircommit.StagedDir(_tag_dir(info)), token, committer=committer, rank=global_rank(),
                         is_checkpoint_entry=_DS_ENTRY_RE.fullmatch, what="a DeepSpeed checkpoint",
                         operation="save_checkpoint", logger=log)

    def matches(self, info: Any) -> bool:
        return os.fspath(info.save_dir) == self.save_dir and str(info.tag) == self.tag


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
    ce.node_local = bool(engine.use_node_local_storage())
    ce.local_rank = int(getattr(engine, "local_rank", ce.local_rank) or 0)
    with contextlib.suppress(Exception):
        ce.nvme_offload = bool(engine.zero_nvme_offload_optimizer())
    engine.checkpoint_engine = ce
    if group is not None:
        engine.save_non_zero_checkpoint = True  # every data-parallel rank takes part in the model-states file
    if not hasattr(engine.save_checkpoint, _MARK):
        engine.save_checkpoint = _with_durable_latest(engine, engine.save_checkpoint)
    if not hasattr(engine.load_checkpoint, _MARK):
        engine.load_checkpoint = _with_s3_loads(engine, engine.load_checkpoint)
    return ce


def _with_durable_latest(engine: Any, original: Any) -> Any:
    """After save_checkpoint: fsync the ``latest`` file DeepSpeed rewrote in place."""

    @functools.wraps(original)
    def save_checkpoint(save_dir: str, *args: Any, **kwargs: Any) -> Any:
        if is_s3_url(save_dir):
            return _save_checkpoint_s3(engine, save_checkpoint, str(save_dir), args, kwargs)
        try:
            result = original(save_dir, *args, **kwargs)
        except BaseException as e:
            abandon = getattr(engine.checkpoint_engine, "_abandon", None)
            if abandon is not None:
                abandon(e)
            raise
        latest = os.path.join(save_dir, "latest")
        if engine.global_rank == 0 and os.path.isfile(latest) and not engine.checkpoint_engine.is_decoupled():
            fsync_path(latest)
        return result

    setattr(save_checkpoint, _MARK, original)
    return save_checkpoint


# ---------------------------------------------------------------- s3:// save_dir
# save_checkpoint("s3://bucket/run", tag): every rank runs DeepSpeed's own save (its files
# through this checkpoint engine) into a local temporary save_dir, then uploads the files
# of TAG it wrote, one object each, under a fresh generation of s3://bucket/run/TAG/ (rank
# 0's token, shared); rank 0 commits the tag folder (fastpersist.s3folder's manifest: a
# reused tag's previous commit stands until then), then writes the ``latest`` object: the tag
# DeepSpeed's load_checkpoint resumes from is always a committed one. load_checkpoint of
# the URL reads ``latest`` (or the tag given), downloads the committed tag folder into a
# local temporary directory and loads it there.

_ZERO_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def _agree(error: Optional[BaseException], value: Any = None) -> list:
    """Every rank's ``(value, error message)``: no rank goes on alone after a failure."""
    return all_gather((value, None if error is None else f"{type(error).__name__}: {error}"))


def _raise_agreed(error: Optional[BaseException], outcome: list, url: str, after: str) -> None:
    if error is not None:
        raise error
    failed = next((m for _v, m in outcome if m is not None), None)
    if failed is not None:
        raise RuntimeError(f"fastpersist: save_checkpoint to {url} failed on another rank: {failed}; {after}")


def _save_checkpoint_s3(engine: Any, local_save: Any, url: str, args: tuple, kwargs: dict) -> Any:
    """``engine.save_checkpoint`` into the ``s3://`` folder ``url`` (see above)."""
    ce = engine.checkpoint_engine
    if ce.is_decoupled():
        raise ValueError(f"save_checkpoint to {url}: a decoupled checkpoint engine (enable(decoupled=True)) cannot "
                         "save to object storage yet; enable it with decoupled=False for s3:// save_dir")
    url = str(s3folder.folder_url(url))
    call = dict(zip(("tag", "client_state", "save_latest", "exclude_frozen_parameters"), args))
    call.update(kwargs)
    tag = call.get("tag")
    tag = call["tag"] = str(f"global_step{engine.global_steps}" if tag is None else tag)  # DeepSpeed's default
    save_latest = bool(call.get("save_latest", True))
    call["save_latest"] = False  # no local `latest`: the object is written below, last
    folder = s3folder.join(url, tag)
    tmp = tempfile.mkdtemp(prefix="fastpersist-deepspeed-")
    config = getattr(ce, "config", None)
    try:
        error: Optional[BaseException] = None
        try:  # DeepSpeed's own save, into a local save_dir (no local `latest` needed)
            local_save(tmp, **call)
        except BaseException as e:  # noqa: BLE001 - every rank learns of it below
            error = e
        _raise_agreed(error, _agree(error), url, f"{folder} is untouched")
        rank0 = global_rank() == 0
        generation: Optional[str] = None
        if rank0:
            try:  # a tag saved again: its previous commit stands until this save's commit
                generation = s3folder.begin(folder, config=config)
            except BaseException as e:  # noqa: BLE001
                error = e
        begun = _agree(error, generation)
        _raise_agreed(error, begun, url, f"{folder} is untouched")
        generation = next(v for v, _m in begun if v is not None)
        files: dict = {}
        try:
            files = s3folder.upload_files(os.path.join(tmp, tag), folder, generation=generation, config=config)
        except BaseException as e:  # noqa: BLE001
            error = e
        uploaded = _agree(error, files)
        if error is None and all(m is None for _v, m in uploaded) and rank0:
            merged: dict = {}
            for part, _m in uploaded:
                merged.update(part)
            try:
                s3folder.commit(folder, merged, generation=generation, config=config)
                for script in _ZERO_SCRIPTS:  # DeepSpeed's copy beside the tags (zero_to_fp32.py)
                    path = os.path.join(tmp, script)
                    if os.path.isfile(path):
                        with open(path, "rb") as f:
                            s3folder.put_small(s3folder.join(url, script), f.read(), config=config)
                if save_latest:
                    s3folder.put_small(s3folder.join(url, "latest"), tag.encode(), config=config)
            except BaseException as e:  # noqa: BLE001
                error = e
        if error is not None:
            log.error("fastpersist: save_checkpoint to %s failed (%s); `latest` still names the previous tag",
                      folder, error)
        _raise_agreed(error, _agree(error) + uploaded, url, "`latest` still names the previous tag")
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _with_s3_loads(engine: Any, original: Any) -> Any:
    """``load_checkpoint`` of an ``s3://`` load_dir: the tag from the ``latest`` object
    (or the one given), its committed folder downloaded into a local temporary
    directory (every object checked against the commit object) and loaded there."""

    @functools.wraps(original)
    def load_checkpoint(load_dir: Any, *args: Any, **kwargs: Any) -> Any:
        if not is_s3_url(load_dir):
            return original(load_dir, *args, **kwargs)
        url = str(s3folder.folder_url(load_dir))
        config = getattr(engine.checkpoint_engine, "config", None)
        tag = _arg(args, kwargs, 0, "tag", None)
        if tag is None:
            try:
                tag = s3folder.get_small(s3folder.join(url, "latest"), config=config).decode().strip()
            except s3folder.UncommittedFolderError:
                raise
            except FileNotFoundError:
                log.warning("fastpersist: no `latest` object under %s: nothing to resume (as DeepSpeed without a "
                            "latest file)", url)
                return None, None
        tag = str(tag)
        tmp = tempfile.mkdtemp(prefix="fastpersist-deepspeed-")
        try:
            s3folder.download(s3folder.join(url, tag), os.path.join(tmp, tag), config=config)
            rest = {k: v for k, v in kwargs.items() if k != "tag"}
            path, client = original(tmp, tag, *args[1:], **rest)
            if isinstance(path, str):
                path = s3folder.join(url, os.path.relpath(path, tmp))
            return path, client
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    setattr(load_checkpoint, _MARK, original)
    return load_checkpoint


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
            if config_settings(self) is not None:  # the engine's own config decides
                apply_config(self)
            elif _default_settings is not None:
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


def config_settings(engine_or_config: Any) -> Optional[dict]:
    """The ``"fastpersist"`` section of a DeepSpeed config, checked: None when the config has
    none, else ``{"enabled": bool, "decoupled": bool, "split_replicated": bool, "config":
    fastpersist.Config or None}``. Takes a ``DeepSpeedEngine``, a ``DeepSpeedConfig`` or the
    config dict. The section is ``true``/``false`` or an object with the keys ``enabled``
    (default true), ``decoupled`` (default false), ``split_replicated`` (default true) and
    ``config`` (keyword arguments of :class:`fastpersist.Config`). Anything else raises
    ValueError naming the key (DeepSpeed itself ignores unknown keys without a word)."""
    params = getattr(engine_or_config, "_config", engine_or_config)
    params = getattr(params, "_param_dict", params)
    if not isinstance(params, dict) or CONFIG_KEY not in params:
        return None
    section = params[CONFIG_KEY]
    if isinstance(section, bool):
        section = {"enabled": section}
    if not isinstance(section, dict):
        raise ValueError(f'DeepSpeed config: "{CONFIG_KEY}" must be true, false or an object with the keys '
                         f"{', '.join(_CONFIG_FIELDS)}; got {section!r}")
    unknown = sorted(set(section) - set(_CONFIG_FIELDS))
    if unknown:
        raise ValueError(f'DeepSpeed config: unknown key(s) {unknown} in "{CONFIG_KEY}" '
                         f"(known: {', '.join(_CONFIG_FIELDS)})")
    out: dict = {}
    for key, default in (("enabled", True), ("decoupled", False), ("split_replicated", True)):
        value = section.get(key, default)
        if not isinstance(value, bool):
            raise ValueError(f'DeepSpeed config: "{CONFIG_KEY}.{key}" must be true or false, got {value!r}')
        out[key] = value
    cfg = section.get("config")
    if cfg is not None and not isinstance(cfg, dict):
        raise ValueError(f'DeepSpeed config: "{CONFIG_KEY}.config" must be an object of fastpersist.Config '
                         f"fields, got {cfg!r}")
    try:
        out["config"] = None if cfg is None else fastpersist.Config(**cfg)
    except TypeError as e:
        raise ValueError(f'DeepSpeed config: "{CONFIG_KEY}.config": {e}') from None
    return out


def apply_config(engine: Any) -> Optional[Any]:
    """Give ``engine`` fastpersist's checkpoint engine if its DeepSpeed config says so (the
    ``"fastpersist"`` section, see :func:`config_settings`); returns the engine attached, or
    None (no section, or ``"enabled": false``: DeepSpeed's own engine stays, whatever
    ``FASTPERSIST_DEEPSPEED`` says). Idempotent. fastpersist's start-up hook calls it at the
    end of every ``DeepSpeedEngine._configure_checkpointing`` whose config has the section."""
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
