"""Public entry points: :func:`save`, :func:`load`, :func:`verify`.

``save`` writes a torch zip file (or a ``.safetensors`` file) with aligned
O_DIRECT writes, atomically: the bytes go to a temporary file in the target
directory, which is fsync'ed and renamed over the target, and the directory is
fsync'ed. ``load`` reads the whole file with one parallel native read and hands
it to torch's own unpickling, with ``torch.load``'s semantics (``map_location``,
``weights_only``, ``mmap``). ``verify`` checksums every byte of a file.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import warnings
from dataclasses import dataclass, field
from typing import TypeVar, Any, Callable, Optional, Union

import torch

from fastpersist.commit import atomic_write, fsync_path, resolve_target
from fastpersist.errors import UnsupportedLayoutError
from fastpersist.formats import torchzip

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]
MapLocation = Union[None, str, torch.device, dict, Callable[..., Any]]

T = TypeVar("T")

FORMATS = ("torch", "safetensors")
#: Bytes laid out before a batch goes to the disk while torch is still pickling.
_STREAM_BATCH = 256 << 20
_TRUE = ("1", "y", "yes", "true")

_handles: dict[tuple, Any] = {}
_handles_lock = threading.Lock()


def _forget_handles_in_child() -> None:
    """A forked child starts with no cached handles and a fresh lock (a parent
    thread may have held the old one at the fork). The native handles are
    fork-safe on their own (``_native.pyi``); dropping them just lets the child
    build its own threads once, when it first saves or loads."""
    global _handles_lock
    _handles_lock = threading.Lock()
    _handles.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_handles_in_child)


def _config(config: Any) -> Any:
    if config is not None:
        return config
    from fastpersist.config import get_default

    return get_default()


def _handle(config: Any, *, read: bool = False) -> Any:
    """A native Handle for ``config``'s I/O settings (one per distinct setting, reused);
    ``read``: for loads and verification (``config.read_queue_depth``)."""
    from fastpersist import _native

    kwargs = config.handle_kwargs(read=read)
    # read_staging "auto" lets read_mode "auto" measure staged against zero-copy reads
    # (fastpersist.io.plan_read); such a handle is a different one from an explicit setting's
    stage_auto = read and config.read_staging == "auto"
    key = (*sorted(kwargs.items()), ("stage_auto", stage_auto))
    with _handles_lock:
        h = _handles.get(key)
        if h is None:
            h = _handles[key] = _native.Handle(**kwargs)
            if stage_auto:
                from fastpersist.io import mark_staging_auto

                mark_staging_auto(h)  # the handle lives in _handles for the life of the process
        return h


def _alignment(directory: str) -> int:
    """Where storages start: a multiple of the directory's O_DIRECT alignment (at least
    4096) and of torch's ``config.save.storage_alignment`` when that is a larger power of two."""
    from fastpersist import _native

    align = max(4096, int(_native.alignment_of(directory)))
    try:
        from torch.utils.serialization import config

        wanted = config.save.storage_alignment
    except (ImportError, AttributeError):  # pragma: no cover - torch older than 2.6
        return align
    if isinstance(wanted, int) and wanted > align and wanted & (wanted - 1) == 0 and align & (align - 1) == 0:
        return wanted
    return align


def _format_of(path: str, format: Optional[str]) -> str:
    if format is not None:
        if format not in FORMATS:
            raise ValueError(f"unknown format {format!r}; expected one of {FORMATS}")
        return format
    return "safetensors" if path.endswith(".safetensors") else "torch"


def _is_path(f: Any) -> bool:
    return isinstance(f, (str, os.PathLike))


def _naming_final(final: str, write: Callable[[str], T]) -> Callable[[str], T]:
    """Wrap a temp-file writer so that its ``OSError`` names the file the user asked
    for; the message keeps the temporary name, offset and length from the native layer."""

    def wrapped(tmp: str) -> T:
        try:
            return write(tmp)
        except OSError as e:
            if e.errno is None:
                raise
            raise type(e)(e.errno, f"{e.strerror or e} (saving {final!r} via temporary file {tmp!r}; "
                          f"the previous file at this path is untouched)", final) from e

    return wrapped


def _native_write(handle: Any, plan: Any, final: str, fsync: bool) -> Callable[[str], list[int]]:
    return _naming_final(
        final, lambda tmp: handle.write(tmp, plan.extents, plan.patches, plan.nslots, truncate=True, fsync=fsync)
    )


#: ``__metadata__`` of a ``.safetensors`` file fastpersist.save writes when the caller gives none:
#: what transformers' ``save_pretrained`` and Accelerate's ``save`` write (transformers 4.x
#: refuses files whose metadata has no known ``format``; Accelerate warns on files without metadata).
DEFAULT_SAFETENSORS_METADATA = {"format": "pt"}


def safetensors_metadata(metadata: Optional[dict]) -> dict:
    """The ``__metadata__`` :func:`save` writes for ``metadata``: the caller's entries,
    with ``"format": "pt"`` added unless they set ``"format"`` themselves.

    Anything but None or a dict is returned as it is, for the planner to refuse with
    safetensors' error at the point safetensors checks it (after the tensors).
    """
    if metadata is not None and not isinstance(metadata, dict):
        return metadata  # type: ignore[return-value]
    out = dict(DEFAULT_SAFETENSORS_METADATA)
    out.update(metadata or {})
    return out


def save(obj: Any, path: PathLike, *, config: Any = None, format: Optional[str] = None, group: Any = None,
         metadata: Optional[dict] = None) -> None:
    """Save ``obj`` to ``path`` like ``torch.save``, at the speed of the storage.

    Args:
        obj: anything ``torch.save`` accepts. For ``.safetensors`` (or
            ``format="safetensors"``) a ``dict[str, Tensor]``.
        path: the destination file (str or os.PathLike). File-like objects are not
            supported: use ``torch.save`` for those.
        config: a :class:`fastpersist.Config`; default: ``fastpersist.config.get_default()``.
        format: ``"torch"`` or ``"safetensors"``; default: by extension.
        group: a ``torch.distributed`` process group whose ranks all call ``save`` with the
            same (replicated) object and write one file together; see :mod:`fastpersist.distributed`.
        metadata: safetensors only: the file's ``__metadata__`` (str -> str), with
            ``"format": "pt"`` added unless it sets ``"format"`` (no metadata: ``{"format":
            "pt"}``, as transformers' ``save_pretrained`` writes; transformers 4.x refuses
            metadata without a known format). :func:`save_file` writes exactly what
            ``safetensors.torch.save_file`` would.

    The file appears under ``path`` only when complete and durable (temporary file,
    fsync, rename, fsync of the directory). On any error the temporary file is
    removed, the previous file at ``path`` is left untouched, and the error
    (``OSError`` with errno, path and offset for I/O failures) is raised.
    A pending :func:`fastpersist.save_async` to the same file is waited for first (the
    newer call's state ends up in the file), and an earlier async save's error that
    nobody collected is raised here, before anything is written.
    Tensor payloads start at multiples of the directory's O_DIRECT alignment; the
    result loads with stock ``torch.load`` (or ``safetensors``).
    """
    if group is not None:
        if metadata is not None:
            raise TypeError("fastpersist.save(..., group=...) takes no metadata (group saves write {'format': 'pt'})")
        return __import__("fastpersist.distributed").distributed.save(obj, path, group=group, config=config, format=format)
    if not _is_path(path):
        raise TypeError(
            f"fastpersist.save writes to a file path (str or os.PathLike), got {type(path).__name__}; "
            "for file-like objects such as io.BytesIO use torch.save"
        )
    cfg = _config(config)
    final = resolve_target(path)
    from fastpersist import asyncsave

    asyncsave.before_blocking_save(final)
    fmt = _format_of(final, format)
    align = _alignment(os.path.dirname(final))
    if fmt == "safetensors":
        _save_safetensors(obj, final, safetensors_metadata(metadata), cfg, align)
        return
    else:
        from fastpersist import _native

        if metadata is not None:
            raise TypeError(f"metadata= is for safetensors files; {final!r} is saved in torch's format")

        def write_stream(tmp: str) -> None:
            # A handle of its own: the stream collects its batches with wait().
            handle = _native.Handle(**cfg.handle_kwargs())
            torchzip.stream_save_torch(
                obj, tmp, handle, align, fsync=cfg.fsync, batch_bytes=_STREAM_BATCH, fast=cfg.fast_pickle
            )

        try:
            atomic_write(final, _naming_final(final, write_stream), fsync=cfg.fsync)
        except UnsupportedLayoutError as e:
            log.debug("fast torch layout not possible for %s (%s); writing with torch's writer", final, e)
            _save_with_torch(obj, final, align, cfg)
        return


def _save_safetensors(tensors: Any, final: str, metadata: Optional[dict], cfg: Any, align: int) -> None:
    """Write ``tensors`` to ``final`` (resolved) as safetensors with exactly ``metadata``
    (None: no ``__metadata__``)."""
    from fastpersist.formats.safetensors import plan_safetensors

    plan = plan_safetensors(tensors, metadata, align, checksum=cfg.checksum)
    atomic_write(final, _native_write(_handle(cfg), plan, final, cfg.fsync), fsync=cfg.fsync)
    del plan


def save_file(tensors: dict, filename: PathLike, metadata: Optional[dict] = None, *, config: Any = None) -> None:
    """Drop-in for ``safetensors.torch.save_file``: the same file contents for a reader
    (names, dtypes, shapes, bytes, and ``__metadata__`` exactly ``metadata``: none when
    None), the same validation and exception types, written the fastpersist way
    (aligned O_DIRECT writes, temporary file + fsync + rename, per-tensor CRC-32s in
    the tensors' entries for :func:`verify`/:func:`load`).

    Differences on purpose: the header is padded with spaces so the data starts at a
    multiple of 4096 (the bytes of the file differ from safetensors', not what any
    reader returns); a tensor named ``__metadata__`` is refused (``ValueError``:
    safetensors writes a file it cannot read back); I/O errors are ``OSError`` subclasses
    naming the path (safetensors raises ``SafetensorError``).

    Raises:
        ValueError: not a dict of tensors, a non-contiguous or sparse tensor.
        RuntimeError: tensors share memory (use ``safetensors.torch.save_model``, which
            calls ``save_file`` and so works with this one substituted).
        TypeError: a name or ``metadata`` that is not str (-> str), a path that is not
            str or os.PathLike.
        KeyError (an ``UnsupportedDtypeError``, also a ValueError): a dtype safetensors lacks.
        NotImplementedError: a meta tensor.
    """
    if isinstance(filename, bytes) or not _is_path(filename):
        raise TypeError(f"argument 'filename': expected str or os.PathLike object, not {type(filename).__name__}")
    cfg = _config(config)
    final = resolve_target(filename)
    from fastpersist import asyncsave

    asyncsave.before_blocking_save(final)
    _save_safetensors(tensors, final, metadata, cfg, _alignment(os.path.dirname(final)))


#: ``backend=`` values ``safetensors.torch.load_file`` accepts.
_ST_BACKENDS = ("mmap", "pread")


def load_file(filename: PathLike, device: Union[str, int, torch.device] = "cpu", *, backend: str = "mmap",
              config: Any = None) -> dict:
    """Drop-in for ``safetensors.torch.load_file``: every tensor of a ``.safetensors``
    file (any writer's) on ``device``, read with fastpersist's parallel reads, with the
    file's fastpersist CRC-32s checked when it has them (``config.checksum``).

    ``device``: ``"cpu"``, a device string, a CUDA index (``int``) or a
    ``torch.device``; ``backend``: ``"mmap"`` or ``"pread"`` as safetensors accepts
    (both read the same way here: the tensors own their memory).

    Raises:
        FileNotFoundError, OSError: the file cannot be read.
        fastpersist.formats.safetensors.SafetensorsFormatError: not a valid
            safetensors file (a ``safetensors.SafetensorError`` and a ``ValueError``).
        fastpersist.errors.ChecksumError: a tensor does not match its recorded CRC-32.
        TypeError: ``filename`` is not str or os.PathLike.
    """
    from fastpersist.formats.safetensors import SafetensorsValueError, load_safetensors

    if not _is_path(filename) and not isinstance(filename, bytes):
        raise TypeError(f"argument 'filename': expected str, bytes or os.PathLike object, not {type(filename).__name__}")
    if backend not in _ST_BACKENDS:
        raise SafetensorsValueError(f'backend "{backend}" is invalid (expected one of: "mmap", "pread")')
    if isinstance(device, int) and not isinstance(device, bool):
        device = f"cuda:{device}"
    try:
        target = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise SafetensorsValueError(f"device {device} is invalid ({e})") from None
    fspath = os.fsdecode(os.fspath(filename))
    cfg = _config(config)
    if _mmap_wanted(None) and target.type == "cpu":
        from fastpersist.formats import mmapload

        return mmapload.load_safetensors_mmap(fspath, _handle(cfg, read=True), checksum=cfg.checksum)
    return load_safetensors(fspath, _handle(cfg, read=True), target, checksum=cfg.checksum)


def _save_with_torch(obj: Any, final: str, alignment: int, cfg: Any) -> None:
    """Fallback: torch's own writer (still aligned, atomic and durable)."""
    from fastpersist import _compat

    def write(tmp: str) -> None:
        # torch names the archive after a path's file name up to its last dot, and
        # refuses an empty name ("invalid file name"): a temporary name such as
        # ".fp-tmp-HASH-..." has none. Given an open file, torch names it "archive",
        # as for every file object (torch.load reads any name).
        with open(tmp, "wb") as f, _compat.save_storage_alignment(alignment, required=False):
            torch.serialization.save(obj, f)
        if cfg.fsync:
            fsync_path(tmp)

    atomic_write(final, write, fsync=cfg.fsync)


def _resolve_weights_only(weights_only: Optional[bool], pickle_module: Any) -> Optional[bool]:
    """``torch.load``'s resolution of ``weights_only`` (None: let torch decide and raise)."""
    not_set = weights_only is None
    if not_set:
        from fastpersist import _compat

        weights_only = _compat.default_to_weights_only(pickle_module)
    force = os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE
    force_no = os.getenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0").lower() in _TRUE
    if force and force_no:
        return None
    if force:
        return True
    if force_no and not_set:
        warnings.warn(
            "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set and weights_only was not passed: loading with weights_only=False.",
            UserWarning,
            stacklevel=3,
        )
        return False
    return bool(weights_only)


def _safetensors_device(map_location: MapLocation) -> str:
    if map_location is None:
        return "cpu"
    if isinstance(map_location, (str, bytes, torch.device)):
        return map_location.decode() if isinstance(map_location, bytes) else str(map_location)
    raise RuntimeError(
        "loading a safetensors file needs map_location as a device string or torch.device "
        f"(dict and callable map_location are not supported), got {type(map_location).__name__}"
    )


def _mmap_wanted(mmap: Optional[bool]) -> bool:
    """``mmap`` as ``torch.load`` resolves it (None: torch's ``config.load.mmap``)."""
    if mmap is None:
        from fastpersist import _compat

        return _compat.load_mmap_default()
    return bool(mmap)


def _is_cpu(device: str) -> bool:
    try:
        return torch.device(device).type == "cpu"
    except (RuntimeError, TypeError, ValueError):
        return False  # the regular path raises its error for it


def _wait_pending(path: Any, tree: bool = False) -> None:
    """Wait for this process's pending async saves of ``path`` (a path; file objects are
    left alone), and with ``tree`` of files below it when it is a directory: a read right
    after ``save_async`` sees the finished file, whoever started that save."""
    if not _is_path(path):
        return
    from fastpersist import asyncsave

    asyncsave.wait_for_path(path)
    if tree and os.path.isdir(path):
        asyncsave.wait_for_dir(path)


def load(
    path: Any,
    map_location: MapLocation = None,
    pickle_module: Any = None,
    *,
    weights_only: Optional[bool] = None,
    mmap: Optional[bool] = None,
    config: Any = None,
    group: Any = None,
    **pickle_load_args: Any,
) -> Any:
    """Load a checkpoint like ``torch.load``, reading it with parallel O_DIRECT I/O.

    Same arguments and semantics as ``torch.load`` (``map_location``,
    ``pickle_module``, ``weights_only`` with its default and the
    ``TORCH_FORCE_[NO_]WEIGHTS_ONLY_LOAD`` variables, ``mmap``, ``encoding`` ...).
    ``.safetensors`` files return a ``dict[str, Tensor]``.

    The file is opened once and every read of the load goes through that
    descriptor, so a save renaming a new file over ``path`` meanwhile cannot mix
    two checkpoints. Storages of 1 MiB or more are read into buffers of their own
    (a kept tensor keeps only its storage alive); smaller ones share one buffer.
    Every storage the pickle asks for must exist and hold exactly the bytes it
    claims, and local headers must agree with the central directory; with
    ``config.checksum`` every record read has its CRC-32 checked before anything
    is returned, by this rule (:mod:`fastpersist.formats.crcpolicy`): a recorded
    CRC of 0 means none was computed (torch's ``set_crc32_options(False)`` and
    ``skip_data()`` write 0) and is not checked; a mismatch raises
    :class:`~fastpersist.errors.ChecksumError` in a file fastpersist wrote, and in
    any file when it is outside the storage records; a mismatch confined to the
    storages of a file torch wrote (changed in place through a ``MAP_SHARED`` mmap
    load, which torch documents) is loaded as ``torch.load`` loads it, with a
    warning in the log. A ``MAP_SHARED`` mmap load (``mmap=True`` under
    ``torch.serialization.set_default_mmap_options(mmap.MAP_SHARED)``) of a file
    fastpersist wrote releases it from its CRCs first (later loads treat it as
    torch's). Unpickling overlaps the read only when the pickle's globals are
    all known not to read tensor bytes (see ``fastpersist.formats.picklescan``).

    Raises:
        fastpersist.errors.CheckpointFormatError: the file is malformed (truncated,
            lying sizes, missing records ...); the message names the path and what is wrong.
        fastpersist.errors.ChecksumError: a record does not match its CRC-32.
        OSError: I/O errors, with path, offset and errno.

    ``mmap=True`` (or torch's ``config.load.mmap`` default) returns tensors over a
    private mapping of the file, as ``torch.load(mmap=True)`` does, after checking
    it: the zip index, the sizes the pickle claims and (``config.checksum``) the
    CRC-32 of every record torch will use, computed over a mapping of the same
    descriptor that torch then loads (see ``fastpersist.formats.mmapload``);
    ``.safetensors`` files are mapped the same way onto the CPU. File-like objects,
    legacy (non-zip) files, compressed or encrypted archives, meta/fake-tensor
    loads and TorchScript archives go to ``torch.serialization.load`` unchanged.
    """
    _wait_pending(path)
    if group is not None:  # every rank of the group calls it; see fastpersist.distributed
        return __import__("fastpersist.distributed").distributed.load(path, map_location, pickle_module, group=group, weights_only=weights_only, mmap=mmap, config=config, **pickle_load_args)
    original = dict(pickle_load_args)

    def torch_load() -> Any:
        return torch.serialization.load(
            path, map_location, pickle_module, weights_only=weights_only, mmap=mmap, **original
        )

    if not _is_path(path):
        return torch_load()
    fspath = os.fsdecode(os.fspath(path))
    cfg = _config(config)
    if fspath.endswith(".safetensors"):
        from fastpersist.formats.safetensors import load_safetensors

        device = _safetensors_device(map_location)
        if _mmap_wanted(mmap) and _is_cpu(device):
            from fastpersist.formats import mmapload

            return mmapload.load_safetensors_mmap(fspath, _handle(cfg, read=True), checksum=cfg.checksum)
        return load_safetensors(fspath, _handle(cfg, read=True), device, checksum=cfg.checksum)

    wo = _resolve_weights_only(weights_only, pickle_module)
    if wo is None or (wo and pickle_module is not None):
        return torch_load()  # torch raises its own error for these combinations
    from fastpersist import _compat

    if mmap is None:
        mmap = _compat.load_mmap_default()
    if mmap:
        if not os.path.isfile(fspath):
            return torch_load()  # missing file, directory, device ...: torch's behaviour and errors
        from fastpersist.formats import mmapload

        try:
            return mmapload.load_torch_mmap(fspath, map_location, pickle_module, weights_only=weights_only,
                                            handle=_handle(cfg, read=True), checksum=cfg.checksum, **original)
        except UnsupportedLayoutError as e:
            log.debug("checked mmap load not possible for %s (%s); using torch.serialization.load", fspath, e)
            return torch_load()
    if not os.path.isfile(fspath) or not torchzip.fast_load_supported() or not _compat.ok("weights_only_unpickler"):
        return torch_load()  # missing file, directory, device ...: torch's behaviour and errors
    module = _compat.weights_only_unpickler() if wo else (pickle_module or pickle)
    if not wo:
        _compat.check_dill_version(module)
    elif pickle_load_args:
        warnings.warn("pickle_load_args only works if `weights_only=False`.", stacklevel=2)
    pickle_load_args.setdefault("encoding", "utf-8")
    try:
        return torchzip.load_torch(
            fspath, _handle(cfg, read=True), map_location, module, weights_only=wo, checksum=cfg.checksum, **pickle_load_args
        )
    except UnsupportedLayoutError as e:
        log.debug("fast load not possible for %s (%s); using torch.serialization.load", fspath, e)
        return torch_load()
    except pickle.UnpicklingError:
        if not wo:
            raise
        # torch.load explains weights-only refusals (which globals, how to allow them):
        # let it produce that message.
        return torch_load()


@dataclass
class VerifyResult:
    """Outcome of :func:`verify`.

    ``status`` is one of:

    * ``"ok"``: the file is a loadable checkpoint and every byte matched the
      checksum recorded when it was written (``ok`` is true);
    * ``"corrupt"``: the file is damaged, malformed, or not a checkpoint at all
      (``problems`` says what is wrong);
    * ``"unchecked"``: the structure is valid as far as it can be checked, but the
      file carries no checksums to compare its bytes with (a ``.safetensors``
      file not written by fastpersist, or a legacy non-zip torch file);
      ``problems`` says so. ``ok`` is false: nothing vouches for the bytes.

    ``bool(result)`` is ``result.ok``.
    """

    ok: bool
    path: str
    format: str
    records: int = 0  #: zip records or safetensors tensors checked
    bytes: int = 0  #: payload bytes checksummed (0 when none were)
    problems: list[str] = field(default_factory=list)
    status: str = "ok"  #: "ok", "corrupt" or "unchecked"
    #: Remarks that do not make the file corrupt: storages whose location tag this
    #: machine cannot restore without ``map_location`` (e.g. ``cuda:7`` with fewer GPUs).
    notes: list[str] = field(default_factory=list)

    @property
    def checked(self) -> bool:
        """Whether the file's bytes could be compared with recorded checksums."""
        return self.status != "unchecked"

    def __bool__(self) -> bool:
        return self.ok


def verify(path: PathLike, *, config: Any = None) -> VerifyResult:
    """Check that the file at ``path`` is a loadable checkpoint whose bytes match the
    checksums stored in it.

    Torch zip files: the zip index is checked as strictly as torch's reader would
    (and more), the records torch needs are looked up (``data.pkl``, ``version``,
    every storage the pickle references, with its size), and every record is read
    natively and its CRC-32 compared with the central directory; data descriptors
    must agree. ``.safetensors`` files: the header is validated (dtypes, shapes,
    offsets, sizes); files written by fastpersist carry per-tensor CRCs in their
    metadata and every tensor is checksummed; files without them are
    ``"unchecked"``.

    A recorded CRC-32 of 0 means torch computed none (``set_crc32_options(False)``,
    ``skip_data()``): such a file is ``"unchecked"``, not ``"corrupt"``. A storage
    whose bytes differ from a nonzero CRC is ``"corrupt"`` whoever wrote the file
    (verify cannot tell damage from an in-place change through a ``MAP_SHARED`` mmap
    load, which ``load`` tolerates in files torch wrote: see
    :mod:`fastpersist.formats.crcpolicy`).

    Malformed content never raises: it is a ``"corrupt"`` result naming the problem.

    Raises:
        FileNotFoundError / OSError: the file cannot be read.
    """
    fspath = os.fsdecode(os.fspath(path))
    _wait_pending(fspath, tree=True)
    if not os.path.exists(fspath):
        raise FileNotFoundError(2, "No such file to verify", fspath)
    handle = _handle(_config(config), read=True)
    if os.path.isdir(fspath):  # a torch.distributed.checkpoint directory
        from fastpersist.formats.dcpverify import verify_dcp
        return verify_dcp(fspath, handle)
    if fspath.endswith(".safetensors"):
        from fastpersist.formats.safetensors import check_safetensors

        st = check_safetensors(fspath, handle)
        status = "corrupt" if st.problems else ("ok" if st.checked else "unchecked")
        problems = list(st.problems)
        if status == "unchecked":
            problems = [
                f"{fspath}: no fastpersist checksums in this safetensors file (not written by fastpersist, or "
                f"with checksums off): its structure is valid ({st.records} tensors), its bytes cannot be checked"
            ]
        return VerifyResult(ok=status == "ok", path=fspath, format="safetensors", records=st.records,
                            bytes=st.nbytes, problems=problems, status=status)
    from fastpersist.formats.torchverify import check_torch

    check = check_torch(fspath, handle)
    status = "unchecked" if not check.checked else ("corrupt" if check.problems else "ok")
    return VerifyResult(
        ok=status == "ok",
        path=fspath,
        format="torch",
        records=check.records,
        bytes=check.nbytes if check.checked else 0,
        problems=check.problems,
        status=status,
        notes=list(getattr(check, "notes", [])),
    )
