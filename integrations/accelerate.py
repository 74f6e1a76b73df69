"""Hugging Face Accelerate: ``save_state`` / ``load_state`` through fastpersist.

Turn it on with one line after creating the Accelerator::

    from fastpersist.integrations import accelerate as fp_accelerate
    fp_accelerate.enable(accelerator)

or with no code: ``FASTPERSIST_ACCELERATE=1`` in the environment (for example
``FASTPERSIST_ACCELERATE=1 accelerate launch --config_file x.yaml train.py``; Accelerate's
config file itself cannot carry it: Accelerate refuses unknown top-level keys and has
no key that sets the launched processes' environment); the variable is read by
:func:`install_from_env`, which fastpersist's start-up hook calls when
``accelerate.accelerator`` is imported. ``FASTPERSIST_PATCH_TORCH_SAVE=1`` turns it
on too, unless ``FASTPERSIST_ACCELERATE=0``.

What goes through fastpersist, for an enabled Accelerator: every file
``save_state``/``load_state`` write or read: the weights (``model.safetensors`` or
``pytorch_model.bin``), the optimizer, scheduler, sampler, dataloader, GradScaler
and RNG files and ``save_state``'s custom objects. The directory layout, the file
names and formats are Accelerate's own, so stock Accelerate (without fastpersist)
loads the result, and fastpersist loads stock checkpoints. ``model.safetensors``
carries Accelerate's ``{"format": "pt"}`` metadata (``fastpersist.save``'s default for
``.safetensors``), which transformers 4.x requires to load it.

How (the hook points): :mod:`accelerate.checkpointing` calls the module globals
``save``, ``load``, ``load_model`` and ``torch.save`` for every file.
:func:`install` replaces these four names *in that module only* with routers that
call fastpersist while an enabled Accelerator's ``save_state``/``load_state`` runs
and Accelerate's own functions otherwise; nothing else (not ``torch.save``, not
``accelerate.utils.save``) changes. :func:`enable` wraps the instance's
``save_state``/``load_state``; :func:`install_from_env` wraps them on the class.
Rank selection is Accelerate's: the main process writes shared files (the local
main process with ``save_on_each_node``), every process its RNG file.

Durability: each file is durable when written, and the checkpoint *directory* appears
in one step: every process writes into one hidden staging directory and the main
process swaps it in (:mod:`fastpersist.collectivedir`: a new directory by ``rename``,
an existing ``output_dir`` by ``renameat2(RENAME_EXCHANGE)``, or two renames where the
filesystem refuses it; killed saves' leftovers cleaned by the next ``save_state``). A
save that raises *or is killed* leaves the previous checkpoint exactly as it was. Files
of the previous checkpoint this save does not write again (Accelerate's names) go with
it; other entries (a user's ``config.json``) are carried over, as stock Accelerate
leaves them in place. The staging directory lives beside the final one, except for
``checkpoints/`` (automatic naming), whose every entry Accelerate parses as a checkpoint
number: then one level up, in the project directory. Not staged (files replaced in
place, each atomic; a warning): the staging parent on another filesystem, or the
working directory inside ``output_dir``.

What differs from stock ``save_state`` for the caller: nothing in the return value
(the final directory, as ``pathlib.Path``), ``save_iteration`` (counted only when
the checkpoint became visible) or retention, but the ``output_dir`` that Accelerate
hands to ``register_save_state_pre_hook`` hooks (and logs) is the staging directory:
files a hook writes there are part of the checkpoint, as they should be, but a hook
that records the path records one that exists only during the save. With
``ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=N)``
Accelerate deletes the oldest checkpoints *before* writing the new one (with
``total_limit=1`` a crash during the save leaves no checkpoint at all); an enabled
Accelerator deletes them only after the new checkpoint is durable, the same ones
Accelerate would have deleted. (Until the deletion there are ``N + 1``
checkpoints on disk.) With ``save_on_each_node`` each node's main process commits
its node's copy (on a shared filesystem the main process's commit is the only one).

Multiple processes (DDP, ``MULTI_CPU``/``MULTI_GPU``): the weights and optimizer
files, which every rank holds a replica of, are written by all ranks together
(``fastpersist.save(..., group=)``, one slice each) when this fastpersist has the
multi-rank save and the ranks checked that their replicas are identical; otherwise
the main process writes them. Other distributed types (FSDP, DeepSpeed,
Megatron-LM, XLA) keep Accelerate's own path for their model and optimizer files;
for DeepSpeed, enable :mod:`fastpersist.integrations.deepspeed` as well.

Object storage: ``save_state("s3://bucket/prefix/ckpt")`` / ``load_state(...)`` of an
enabled Accelerator: stock ``save_state`` writes into a local temporary directory (in
``TMPDIR``), every process uploads the files it wrote, one object each, and the main
process commits the folder (:mod:`fastpersist.s3folder`: a manifest of sizes and ETags
written last); ``load_state`` refuses a folder without its commit, downloads it into a
local temporary directory and loads it there (docs/objectstore.md, Accelerate).

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
import pathlib
import re
import shutil
import tempfile
import types
from collections import OrderedDict
from typing import Any, Callable, Iterator, Optional

import torch

import fastpersist
from fastpersist import dircommit, s3folder
from fastpersist.collectivedir import CollectiveDir
from fastpersist.commit import fsync_dir
from fastpersist.envflags import adapter_enabled
from fastpersist.errors import CheckpointFormatError, ChecksumError
from fastpersist.replicated import save_replicated
from fastpersist.s3url import is_s3_url

__all__ = ["ENV_VAR", "disable", "enable", "install", "install_from_env", "is_enabled"]

log = logging.getLogger(__name__)

#: The variable that turns the adapter on for every Accelerator of a process.
ENV_VAR = "FASTPERSIST_ACCELERATE"
_MARK = "_fastpersist_original"
_ENABLED_ATTR = "_fastpersist_enabled"

# The files of the load_state running in this thread/task that were corrupt or unreadable
# (None: none running). Accelerate 1.15's load_accelerator_state catches *every* exception
# of the RNG file's load, logs "Could not load random states" at INFO and resumes with the
# RNG state not restored; the wrapper raises what it swallowed (see _wrap_load_state).
_load_failures: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("fastpersist_accelerate_load",
                                                                               default=None)
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

        save_replicated(obj, f, group=dist.group.WORLD, writer=writer, format=fmt, config=s.config,
                        save=fastpersist.save)
    elif writer:
        fastpersist.save(obj, f, format=fmt, config=s.config)


def _load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
    s = _active.get()
    if s is None or not isinstance(f, (str, os.PathLike)):
        return _originals["load"](f, map_location=map_location, **kwargs)
    # accelerate.utils.load's semantics: weights_only by default, with Accelerate's
    # safe globals (numpy arrays and dtypes of the RNG states) allowed for the call.
    from accelerate.utils.other import TORCH_SAFE_GLOBALS

    old = torch.serialization.get_safe_globals()
    kwargs.setdefault("weights_only", True)
    torch.serialization.add_safe_globals(TORCH_SAFE_GLOBALS)
    try:
        return fastpersist.load(f, map_location=map_location, config=s.config, **kwargs)
    except (CheckpointFormatError, ChecksumError, OSError) as e:
        failures = _load_failures.get()
        if failures is not None and not isinstance(e, FileNotFoundError):  # a missing file: Accelerate's call
            failures.append((os.fspath(f), e))
        raise
    finally:
        torch.serialization.clear_safe_globals()
        if old:
            torch.serialization.add_safe_globals(old)


def _load_model(model: Any, filename: Any, strict: bool = True, device: Any = "cpu", **kwargs: Any) -> Any:
    s = _active.get()
    if s is None or set(kwargs) - {"backend"}:
        return _originals["load_model"](model, filename, strict=strict, device=device, **kwargs)
    return fastpersist.load_model(model, filename, strict=strict, device=str(device), config=s.config, **kwargs)


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


# ---------------------------------------------------------------- directory-level commit
# The staging/swap mechanics are fastpersist.dircommit's; what is Accelerate's is where the
# staging directory goes (_Layout) and which entries belong to a checkpoint.

_AUTO_NAME_RE = re.compile(r"checkpoint_[0-9]+")
# Entries of a directory save_state writes (Accelerate's names: weights, optimizer, scheduler,
# sampler, dataloader, GradScaler, RNG, custom objects; FSDP/DeepSpeed directories) and
# fastpersist's temporary files: in an output_dir being replaced, those the new checkpoint
# does not write again are stale state of the previous one and go with it.
_CHECKPOINT_ENTRY_RE = re.compile(
    r"(pytorch_model|model)(_fsdp)?(_[0-9]+)?(\.(safetensors|bin)(\.index\.json)?)?"
    r"|(optimizer|scheduler|sampler|dl_state_dict)(_[0-9]+)?(\.bin)?"
    r"|scaler\.pt|random_states_[0-9]+\.pkl|custom_checkpoint_[0-9]+\.pkl")


class _Layout(dircommit.StagedDir):
    """Where one save_state stages and commits (the mechanics: :class:`fastpersist.dircommit.StagedDir`).

    ``final``: the path stock Accelerate writes (and returns). The staging directory goes
    beside ``target`` (same filesystem, so the commit is a rename), except where the parent
    is the project's ``checkpoints/`` directory: Accelerate parses every entry there as a
    checkpoint number (``load_state()`` takes the largest, retention deletes the smallest, a
    name without a number makes both raise), so the staging directory goes one level up,
    into the project directory, which Accelerate never scans."""

    def __init__(self, acc: Any, final: str, auto: bool) -> None:
        self.auto = auto
        target = os.path.realpath(final)
        parent = os.path.dirname(target)
        ckpts = None
        if getattr(acc, "project_dir", None):
            ckpts = os.path.realpath(os.path.join(acc.project_dir, "checkpoints"))
        super().__init__(final, os.path.dirname(parent) if auto or parent == ckpts else parent)

    def clean_leftovers(self) -> None:  # type: ignore[override]
        """Remove the staging directories of killed saves of this name (any
        ``checkpoint_N`` with automatic naming); give back a previous directory that a
        killed fallback commit had moved aside and not replaced."""

        def restore_other(name: str) -> Optional[str]:
            if self.auto and _AUTO_NAME_RE.fullmatch(name):
                return os.path.join(self.parent, name)
            return None

        super().clean_leftovers(operation="save_state", logger=log, fsync_after_restore=True,
                                restore_other=restore_other)


def _final_location(location: Any, staging: str, final: str) -> Any:
    """What stock save_state returns (``save_accelerator_state``'s ``Path(output_dir)``),
    with the staging directory replaced by the final one."""
    path = os.fspath(location)
    moved = dircommit.rebase(path, staging, final)
    if moved is not None:
        path = moved
    return pathlib.Path(path) if isinstance(location, pathlib.PurePath) else path


def _retain(acc: Any, limit: Optional[int], location: str) -> None:
    """Accelerate's total_limit retention, run once ``location`` is durable (main process)."""
    if limit is None:
        return
    parent = os.path.join(acc.project_dir, "checkpoints")
    folders = [os.path.join(parent, d) for d in os.listdir(parent)]
    folders = [d for d in folders if os.path.realpath(d) != os.path.realpath(location)]
    excess = len(folders) + 1 - limit
    if excess > 0:
        folders.sort(key=_checkpoint_number)
        log.info("fastpersist: deleting %d old checkpoint(s) now that %s is durable", excess, location)
        for folder in folders[:excess]:
            shutil.rmtree(folder)
        fsync_dir(parent)


def _save_in_place(self: Any, original: Callable[..., Any], s: _Settings, output_dir: Any,
                   safe_serialization: bool, kwargs: dict) -> Any:
    """Accelerate's own directory handling, each file atomic (no staging: see _Layout.why_not_staged)."""
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
    self.wait_for_everyone()  # every rank's files are durable
    if self.is_main_process:
        dircommit.fsync_tree_and_parent(os.fspath(location))
        _retain(self, limit, os.fspath(location))
    self.wait_for_everyone()
    return location


def _failed_elsewhere(_ranks: list[int], message: str) -> RuntimeError:
    return RuntimeError(f"fastpersist: save_state failed on another process: {message}")


class _AccelerateExchange:
    """:class:`fastpersist.collectivedir.Exchange` over Accelerate's own object collectives."""

    def broadcast(self, value: Any) -> Any:
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([value])[0]

    def gather(self, value: Any) -> list[Any]:
        from accelerate.utils import gather_object

        return gather_object([value])


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
        if auto:  # stock save_state's own checks, before anything is written
            checkpoints = os.path.join(self.project_dir, "checkpoints")
            os.makedirs(checkpoints, exist_ok=True)
            final = os.path.join(checkpoints, f"checkpoint_{self.save_iteration}")
            if os.path.exists(final):
                raise ValueError(
                    f"Checkpoint directory {final} ({self.save_iteration}) already exists. Please manually override "
                    "`self.save_iteration` with what iteration to start with."
                )
        elif output_dir is None:
            return original(self, output_dir, safe_serialization, **kwargs)  # stock raises
        elif is_s3_url(output_dir):
            return _save_state_s3(self, original, s, str(output_dir), safe_serialization, kwargs)
        else:
            final = os.fspath(output_dir)
            os.makedirs(os.path.dirname(os.path.abspath(final)), exist_ok=True)
        layout = _Layout(self, final, auto)
        # The committer holds the directory's files: the main process, or with save_on_each_node
        # the main process of each node (whose disk may be its own).
        committer = self.is_local_main_process if pc.save_on_each_node else self.is_main_process
        if committer:
            layout.clean_leftovers()
        exchange = _AccelerateExchange()
        token = CollectiveDir.plan(layout, rank=self.process_index, committer=committer, exchange=exchange,
                                   check=self.is_main_process, operation="save_state", logger=log)
        if token is None:
            return _save_in_place(self, original, s, output_dir, safe_serialization, kwargs)
        stage = CollectiveDir(layout, token, committer=committer, rank=self.process_index, exchange=exchange,
                              is_checkpoint_entry=_CHECKPOINT_ENTRY_RE.fullmatch, what="an Accelerate checkpoint",
                              operation="save_state", logger=log, sync_tree=dircommit.fsync_tree_and_parent)
        iteration = pc.iteration
        limit = pc.total_limit if auto else None
        # Stock save_state, told to write the staging directory: no automatic naming (we did its
        # checks above; its retention runs once the new checkpoint is durable, below).
        pc.automatic_checkpoint_naming = False
        if auto:
            pc.total_limit = None
        try:
            with _routing(s):
                location = original(self, stage.staging, safe_serialization, **kwargs)
        except BaseException:
            pc.iteration = iteration
            if committer and os.path.isdir(stage.staging):
                log.error("fastpersist: save_state failed; removing its staging directory %s (%s is untouched)",
                          stage.staging, final)
                stage.discard()
            raise
        finally:
            pc.automatic_checkpoint_naming = auto
            if auto:
                pc.total_limit = limit
        self.wait_for_everyone()  # every rank's files are in the staging directory
        try:
            stage.commit(_failed_elsewhere, per_node=pc.save_on_each_node and self.num_processes > 1)
        finally:
            if not stage.visible:  # the previous checkpoint stays, as does iteration
                pc.iteration = iteration
        if self.is_main_process:
            _retain(self, limit, layout.target)
        self.wait_for_everyone()
        return _final_location(location, stage.staging, final)

    setattr(save_state, _MARK, original)
    return save_state


def _wrap_load_state(original: Callable[..., Any], settings: Callable[[Any], Optional[_Settings]]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_state(self: Any, *args: Any, **kwargs: Any) -> Any:
        s = settings(self)
        if s is None:
            return original(self, *args, **kwargs)
        install()
        input_dir = args[0] if args else kwargs.get("input_dir")
        if input_dir is not None and is_s3_url(input_dir):
            rest = {k: v for k, v in kwargs.items() if k != "input_dir"}
            return _load_state_s3(self, load_state, s.config, str(input_dir), args[1:], rest)
        failures: list = []
        token = _load_failures.set(failures)
        try:
            with _routing(s):
                result = original(self, *args, **kwargs)
        finally:
            _load_failures.reset(token)
        if failures:  # load_state returned: Accelerate caught these and went on without the file's state
            _raise_swallowed(failures)
        return result

    setattr(load_state, _MARK, original)
    return load_state


# ---------------------------------------------------------------- s3:// output_dir
# save_state("s3://bucket/prefix/ckpt"): every process runs stock save_state (its files
# through fastpersist, as for a local save) into a local temporary directory, then uploads
# the files it wrote, one object each, under a fresh generation of the URL's folder (the
# main process's token, shared); the main process then writes the folder's commit object
# (fastpersist.s3folder's manifest): until then the checkpoint previously committed at the
# URL, if any, stays the one that loads. load_state of the URL downloads the committed
# folder into a local temporary directory and loads it there.


def _gather_outcome(acc: Any, value: Any, error: Optional[BaseException]) -> list:
    from accelerate.utils import gather_object

    return gather_object([(value, None if error is None else f"{type(error).__name__}: {error}")])


def _accelerate_entry(rel: str) -> bool:
    """Whether an object under an s3:// checkpoint folder belongs to Accelerate (by its
    top-level name): the others (a user's config.json) stay when the folder is saved again."""
    return bool(_CHECKPOINT_ENTRY_RE.fullmatch(rel.split("/", 1)[0]))


def _save_state_s3(self: Any, original: Callable[..., Any], s: _Settings, url: str, safe_serialization: bool,
                   kwargs: dict) -> str:
    """``save_state`` into the ``s3://`` folder ``url`` (see above); returns ``url``."""
    url = str(s3folder.folder_url(url))
    tmp = tempfile.mkdtemp(prefix="fastpersist-accelerate-")
    local = os.path.join(tmp, "checkpoint")
    try:
        error: Optional[BaseException] = None
        try:
            with _routing(s):
                original(self, local, safe_serialization, **kwargs)
        except BaseException as e:  # noqa: BLE001 - every rank learns of it below
            error = e
        outcome = _gather_outcome(self, None, error)  # nothing uploaded yet: the folder is untouched
        failed = next((m for _v, m in outcome if m is not None), None)
        if error is not None:
            raise error
        if failed is not None:
            raise RuntimeError(f"fastpersist: save_state to {url} failed on another process: {failed}; "
                               f"{url} is untouched")
        generation: Optional[str] = None
        if self.is_main_process:
            try:  # the previous commit at the URL stands until this save's commit
                generation = s3folder.begin(url, owns=_accelerate_entry, config=s.config)
            except BaseException as e:  # noqa: BLE001
                error = e
        begun = _gather_outcome(self, generation, error)
        if error is not None:
            raise error
        failed = next((m for _v, m in begun if m is not None), None)
        if failed is not None:
            raise RuntimeError(f"fastpersist: save_state to {url} failed on the main process: {failed}")
        generation = next(v for v, _m in begun if v is not None)
        files: dict = {}
        try:
            files = s3folder.upload_files(local, url, generation=generation, config=s.config)
        except BaseException as e:  # noqa: BLE001
            error = e
        uploaded = _gather_outcome(self, files, error)
        failed = next((m for _v, m in uploaded if m is not None), None)
        if error is None and failed is None and self.is_main_process:
            merged: dict = {}
            for part, _m in uploaded:
                merged.update(part)
            try:
                s3folder.commit(url, merged, generation=generation, owns=_accelerate_entry, config=s.config)
            except BaseException as e:  # noqa: BLE001
                error = e
        committed = _gather_outcome(self, None, error)
        if error is not None:
            log.error("fastpersist: save_state to %s failed (%s); the checkpoint committed there before, if any, "
                      "stays the one that loads", url, error)
            raise error
        failed = failed or next((m for _v, m in committed if m is not None), None)
        if failed is not None:
            raise RuntimeError(f"fastpersist: save_state to {url} failed on another process: {failed}; the "
                               "checkpoint committed there before, if any, stays the one that loads")
        return url
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_state_s3(self: Any, load_state: Callable[..., Any], config: Any, url: str, args: tuple,
                   kwargs: dict) -> Any:
    """``load_state`` of the committed ``s3://`` folder ``url``: downloaded (every object
    checked against the commit object) into a local temporary directory, loaded from there."""
    tmp = tempfile.mkdtemp(prefix="fastpersist-accelerate-")
    try:
        local = os.path.join(tmp, "checkpoint")
        s3folder.download(url, local, config=config)
        return load_state(self, local, *args, **kwargs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _raise_swallowed(failures: list) -> None:
    """A corrupt or unreadable checkpoint file whose error Accelerate's load_state caught
    (the RNG file: it logs "Could not load random states" at INFO and resumes without
    it): never skipped quietly. Logged as an error naming every such file, then the first
    error is raised, so the resume fails instead of continuing from a partial state."""
    names = ", ".join(path for path, _e in failures)
    log.error("fastpersist: load_state: Accelerate skipped %d checkpoint file(s) it could not load (%s) and would "
              "resume without their state; failing the resume instead", len(failures), names)
    path, error = failures[0]
    error.add_note(f"fastpersist: Accelerate's load_state caught this error of {path} and went on without that "
                   "file's state (for random_states_*.pkl: the RNG state not restored); the resume fails instead. "
                   "Restore the file from a good copy, or resume from an earlier checkpoint")
    raise error


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
