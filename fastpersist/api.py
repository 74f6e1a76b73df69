"""Public entry points: :func:`save`, :func:`load`, :func:`verify`, :func:`save_file`,
:func:`load_file`.

The facade every surface calls (the package's names, the ``torch.save`` switch, the
adapters): it checks the arguments the way ``torch.save``/``torch.load``/safetensors do
and hands each call to the mode that runs it: the collective save or load of
:mod:`fastpersist.collectivesave` / :mod:`fastpersist.collectiveload` when a process ``group`` is given, the single-process
pipeline of :mod:`fastpersist.pipeline` otherwise.

``save`` writes a torch zip file (or a ``.safetensors`` file) with aligned
O_DIRECT writes, atomically: the bytes go to a temporary file in the target
directory, which is fsync'ed and renamed over the target, and the directory is
fsync'ed. ``load`` reads the whole file with one parallel native read and hands
it to torch's own unpickling, with ``torch.load``'s semantics (``map_location``,
``weights_only``, ``mmap``). ``verify`` checksums every byte of a file.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Union

import torch

from fastpersist import collectiveload, collectivesave, modelload, pending, pipeline, s3collective
from fastpersist.s3url import is_s3_url
from fastpersist.formats.base import VerifyResult
from fastpersist.formats.registry import FORMATS as _FORMAT_TABLE
from fastpersist.formats.safetensors import DEFAULT_SAFETENSORS_METADATA, safetensors_metadata
from fastpersist.modelload import load_into_model
from fastpersist.formats.zipindex import starts_like_zip

__all__ = ["DEFAULT_SAFETENSORS_METADATA", "FORMATS", "VerifyResult", "load", "load_file", "load_model",
           "safetensors_metadata",
           "save", "save_file", "verify"]

PathLike = Union[str, "os.PathLike[str]"]
MapLocation = Union[None, str, torch.device, dict, Callable[..., Any]]

#: The names ``save``'s ``format=`` takes.
FORMATS = tuple(_FORMAT_TABLE)


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
            same (replicated) object and write one file together; see :mod:`fastpersist.collectivesave`
            (to an ``s3://`` URL: one multipart upload with parts from every rank, see
            :mod:`fastpersist.s3collective`).
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
        if is_s3_url(path):  # one multipart upload, its parts from every rank
            return s3collective.save(obj, path, group=group, config=config, format=format)
        return collectivesave.save(obj, path, group=group, config=config, format=format)
    pipeline.save(obj, path, config=config, format=format, metadata=metadata)


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
    pipeline.save_file(tensors, filename, metadata, config=config)


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
    return pipeline.load_file(filename, device, backend=backend, config=config)


def load_model(model: torch.nn.Module, filename: PathLike, strict: bool = True,
               device: Union[str, int, torch.device] = "cpu", *, backend: str = "mmap",
               config: Any = None) -> tuple[set[str], list[str]]:
    """Drop-in for ``safetensors.torch.load_model``: the tensors of a ``.safetensors``
    file (read as :func:`load_file` reads it) into ``model``. The file holds one name
    of each group of tied weights (what ``safetensors.torch.save_model`` writes); the
    model's other names of the group count neither as missing nor, unless the file
    has them too, as unexpected.

    Returns:
        ``(missing, unexpected)``: the model's names the file did not fill (a set, as
        safetensors returns it), the file's names the model did not use (a list).

    Raises:
        RuntimeError: ``strict`` and a name is missing or unexpected (all are listed),
            or tied weights none of whose names covers their storage.
        ValueError: a torch checkpoint that is not a flat dict of tensors (a Lightning
            or training checkpoint: the message names :func:`load_state_dict`).
        Everything :func:`load_file` raises.

    A torch checkpoint (a zip file, what ``torch.save``/``fastpersist.save`` write) of a
    state dict is loaded too (``weights_only``, onto ``device``), with the same rules.
    """
    if isinstance(filename, (str, bytes, os.PathLike)) and starts_like_zip(filename):
        if isinstance(device, int) and not isinstance(device, bool):
            device = f"cuda:{device}"
        state = load(filename, map_location=device, weights_only=True, config=config)
        if not (isinstance(state, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in state.items())):
            keys = sorted(map(str, state))[:6] if isinstance(state, dict) else []
            raise ValueError(
                f"{os.fsdecode(os.fspath(filename))}: a torch checkpoint, but not a flat dict of tensors "
                f"(a {type(state).__name__}{' with keys ' + ', '.join(keys) if keys else ''}); read the part that "
                "holds the weights with fastpersist.load_state_dict(model, path, key='state_dict') (the key of "
                "that part: 'state_dict' in Lightning checkpoints)")
        return load_into_model(model, state, strict)
    if not is_s3_url(filename):
        done = modelload.load_model_in_place(model, filename, strict, device, config)
        if done is not None:
            return done
    state_dict = pipeline.load_file(filename, device, backend=backend, config=config)
    return load_into_model(model, state_dict, strict)


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
    pending.wait_before_reading(path)
    if group is not None:  # every rank of the group calls it; see fastpersist.collectiveload
        if is_s3_url(path):
            return s3collective.load(path, map_location, pickle_module, group=group, weights_only=weights_only,
                                     mmap=mmap, config=config, **pickle_load_args)
        return collectiveload.load(path, map_location, pickle_module, group=group, weights_only=weights_only, mmap=mmap,
                                config=config, **pickle_load_args)
    return pipeline.load(path, map_location, pickle_module, weights_only=weights_only, mmap=mmap, config=config,
                         **pickle_load_args)


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
    return pipeline.verify(path, config=config)
