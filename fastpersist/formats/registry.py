"""The formats behind one interface: which format a path is, and how to plan, write,
load and verify it.

A :class:`Format` is what the modes above need of a file format, and nothing else:

- ``plan(obj, alignment, cfg, metadata=, device_sources=, target=)``: the complete byte layout
  (a :class:`~fastpersist.formats.base.WritePlan`), for modes that stage or split the
  bytes themselves (async, collective). May raise ``UnsupportedLayoutError`` (torch's
  writer must lay the object out: the mode decides the fallback).
- ``writer(obj, final, alignment, cfg, metadata)``: for a blocking single-process save,
  a function writing the whole file to a temporary path; validation happens when the
  writer is made, before any file exists.
- ``load(path, cfg, request)``: ``torch.load``/``load_file`` semantics for a path.
- ``verify(path, handle)``: a :class:`~fastpersist.formats.base.VerifyResult`; malformed
  content is a ``"corrupt"`` result, never an exception.

:data:`FORMATS` maps names to formats; :func:`format_for` picks one by name or by the
path's suffix (``.safetensors``; everything else is torch's zip format, as ``torch.save``
writes whatever the name). A checkpoint *directory* is DCP's (:data:`DCP`, verify only).
A new format is one module and one entry here.
"""

from __future__ import annotations

import logging
import os
import pickle
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch

from fastpersist import _compat, handles
from fastpersist.errors import UnsupportedLayoutError
from fastpersist.formats import mmapload, safetensors, torchload, torchzip
from fastpersist.formats.base import VerifyResult, WritePlan
from fastpersist.formats.dcpverify import verify_dcp
from fastpersist.formats.torchverify import check_torch

log = logging.getLogger("fastpersist.api")

_TRUE = ("1", "y", "yes", "true")


@dataclass
class LoadRequest:
    """``torch.load``'s arguments for one load: the path as the caller gave it, and the
    caller's ``pickle_load_args`` as given, for torch's own loader when the fast path
    hands over."""

    path: Any = None
    map_location: Any = None
    pickle_module: Any = None
    weights_only: Optional[bool] = None
    mmap: Optional[bool] = None
    pickle_load_args: Optional[dict] = None

    def torch_load(self) -> Any:
        """The same load by ``torch.serialization.load`` (its behaviour and its errors)."""
        return torch.serialization.load(self.path, self.map_location, self.pickle_module, weights_only=self.weights_only,
                                        mmap=self.mmap, **dict(self.pickle_load_args or {}))


@dataclass(frozen=True)
class Format:
    """One file format (see the module docstring)."""

    name: str
    suffixes: tuple[str, ...]
    plan: Optional[Callable[..., WritePlan]]
    writer: Optional[Callable[..., Callable[[str], None]]]
    load: Optional[Callable[[str, Any, LoadRequest], Any]]
    verify: Callable[[str, Any], VerifyResult]


# ---------------------------------------------------------------------------- torch


def _plan_torch(obj: Any, alignment: int, cfg: Any, *, metadata: Optional[dict] = None,
                device_sources: Any = None, target: str = "") -> WritePlan:
    return torchzip.plan_torch(obj, alignment, fast=cfg.fast_pickle, device_sources=device_sources)


def _torch_writer(obj: Any, final: str, alignment: int, cfg: Any, metadata: Optional[dict]) -> Callable[[str], None]:
    if metadata is not None:
        raise TypeError(f"metadata= is for safetensors files; {final!r} is saved in torch's format")

    def write_stream(tmp: str) -> None:
        # A handle of its own (the stream collects its batches with wait()), lent from the
        # idle ones so that the save starts no threads; kept again only after a clean save.
        handle = handles.borrow_writer(cfg)
        torchzip.stream_save_torch(obj, tmp, handle, alignment, fsync=cfg.fsync, batch_bytes=torchzip.STREAM_BATCH,
                                   fast=cfg.fast_pickle)
        handles.give_back_writer(cfg, handle)

    return write_stream


def resolve_weights_only(weights_only: Optional[bool], pickle_module: Any) -> Optional[bool]:
    """``torch.load``'s resolution of ``weights_only`` (None: let torch decide and raise)."""
    not_set = weights_only is None
    if not_set:
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
            stacklevel=5,  # the caller of fastpersist.load
        )
        return False
    return bool(weights_only)


def mmap_wanted(mmap: Optional[bool]) -> bool:
    """``mmap`` as ``torch.load`` resolves it (None: torch's ``config.load.mmap``)."""
    if mmap is None:
        return _compat.load_mmap_default()
    return bool(mmap)


def _load_torch(fspath: str, cfg: Any, req: LoadRequest) -> Any:
    wo = resolve_weights_only(req.weights_only, req.pickle_module)
    if wo is None or (wo and req.pickle_module is not None):
        return req.torch_load()  # torch raises its own error for these combinations
    original = dict(req.pickle_load_args or {})
    pickle_load_args = dict(original)
    mmap = req.mmap
    if mmap is None:
        mmap = _compat.load_mmap_default()
    if mmap:
        if not os.path.isfile(fspath):
            return req.torch_load()  # missing file, directory, device ...: torch's behaviour and errors
        try:
            return mmapload.load_torch_mmap(fspath, req.map_location, req.pickle_module, weights_only=req.weights_only,
                                            handle=handles.handle_for(cfg, read=True), checksum=cfg.checksum,
                                            **original)
        except UnsupportedLayoutError as e:
            log.debug("checked mmap load not possible for %s (%s); using torch.serialization.load", fspath, e)
            return req.torch_load()
    if not os.path.isfile(fspath) or not torchzip.fast_load_supported() or not _compat.ok("weights_only_unpickler"):
        return req.torch_load()  # missing file, directory, device ...: torch's behaviour and errors
    module = _compat.weights_only_unpickler() if wo else (req.pickle_module or pickle)
    if not wo:
        _compat.check_dill_version(module)
    elif pickle_load_args:
        warnings.warn("pickle_load_args only works if `weights_only=False`.", stacklevel=4)  # load's caller
    pickle_load_args.setdefault("encoding", "utf-8")
    try:
        return torchzip.load_torch(fspath, handles.handle_for(cfg, read=True), req.map_location, module,
                                   weights_only=wo, checksum=cfg.checksum, **pickle_load_args)
    except UnsupportedLayoutError as e:
        log.debug("fast load not possible for %s (%s); using torch.serialization.load", fspath, e)
        return req.torch_load()
    except pickle.UnpicklingError:
        if not wo:
            raise
        # torch.load explains weights-only refusals (which globals, how to allow them):
        # let it produce that message.
        return req.torch_load()


def load_torch_in_memory(fspath: str, fd: int, memory: Any, cfg: Any, req: LoadRequest,
                         checked_crcs: Optional[Mapping[tuple[int, int], int]] = None) -> Any:
    """The fast load of a torch zip file whose bytes are all in ``memory`` already, and
    readable through ``fd`` (the collective load's assembled file, see
    :func:`fastpersist.formats.torchload.load_torch` with ``memory``): the storages are built over
    ``memory``, with the same checks as a load from the file. ``fspath`` names the file.
    ``checked_crcs``: CRC-32s of ranges of ``memory`` computed already (``load_torch``).

    Raises:
        UnsupportedLayoutError: a load this path does not take (what ``fastpersist.load``
            hands to ``torch.load`` or to the mmap loader, a weights-only refusal that
            torch explains, ``pickle_load_args`` with ``weights_only``): the caller loads
            the file from ``fd`` the ordinary way instead.
    """
    wo = resolve_weights_only(req.weights_only, req.pickle_module)
    if wo is None or (wo and req.pickle_module is not None):
        raise UnsupportedLayoutError("weights_only with a pickle_module: torch's loader decides")
    mmap = req.mmap if req.mmap is not None else _compat.load_mmap_default()
    if mmap:
        raise UnsupportedLayoutError("mmap load")
    if not torchzip.fast_load_supported() or not _compat.ok("weights_only_unpickler"):
        raise UnsupportedLayoutError("this torch's loader is not the one the fast reader serves")
    pickle_load_args = dict(req.pickle_load_args or {})
    if wo and pickle_load_args:
        raise UnsupportedLayoutError("pickle_load_args with weights_only (the ordinary load warns)")
    module = _compat.weights_only_unpickler() if wo else (req.pickle_module or pickle)
    if not wo:
        _compat.check_dill_version(module)
    pickle_load_args.setdefault("encoding", "utf-8")
    try:
        return torchload.load_torch(fspath, handles.handle_for(cfg, read=True), req.map_location, module,
                                    weights_only=wo, checksum=cfg.checksum, memory=memory, fd=fd,
                                    checked_crcs=checked_crcs, **pickle_load_args)
    except pickle.UnpicklingError as e:
        if not wo:
            raise
        raise UnsupportedLayoutError("a weights-only refusal (torch.load explains it)") from e


def _verify_torch(fspath: str, handle: Any) -> VerifyResult:
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


# ---------------------------------------------------------------------------- safetensors


def _plan_safetensors(obj: Any, alignment: int, cfg: Any, *, metadata: Optional[dict] = None,
                      device_sources: Any = None, target: str = "") -> WritePlan:
    if not isinstance(obj, dict):
        raise TypeError(f"saving {target!r} as safetensors needs a dict of tensors, got {type(obj).__name__}")
    return safetensors.plan_safetensors(obj, safetensors.safetensors_metadata(metadata), alignment,
                                        checksum=cfg.checksum, device_sources=device_sources)


def safetensors_writer(tensors: Any, final: str, alignment: int, cfg: Any,
                       metadata: Optional[dict]) -> Callable[[str], None]:
    """A blocking writer of ``tensors`` as safetensors with exactly ``metadata`` as
    ``__metadata__`` (None: none). Planned (and validated) now."""
    plan = safetensors.plan_safetensors(tensors, metadata, alignment, checksum=cfg.checksum)
    handle = handles.handle_for(cfg)

    def write(tmp: str) -> None:
        handle.write(tmp, plan.extents, plan.patches, plan.nslots, truncate=True, fsync=cfg.fsync)

    return write


def _safetensors_writer_default_metadata(tensors: Any, final: str, alignment: int, cfg: Any,
                                         metadata: Optional[dict]) -> Callable[[str], None]:
    return safetensors_writer(tensors, final, alignment, cfg, safetensors.safetensors_metadata(metadata))


def safetensors_device(map_location: Any) -> str:
    """The device a ``.safetensors`` load lands on for ``torch.load``'s ``map_location``."""
    if map_location is None:
        return "cpu"
    if isinstance(map_location, (str, bytes, torch.device)):
        return map_location.decode() if isinstance(map_location, bytes) else str(map_location)
    raise RuntimeError(
        "loading a safetensors file needs map_location as a device string or torch.device "
        f"(dict and callable map_location are not supported), got {type(map_location).__name__}"
    )


def _is_cpu(device: Any) -> bool:
    try:
        return torch.device(device).type == "cpu"
    except (RuntimeError, TypeError, ValueError):
        return False  # the regular path raises its error for it


def load_safetensors_file(fspath: str, device: Any, cfg: Any, mmap: Optional[bool]) -> dict:
    """Every tensor of a ``.safetensors`` file on ``device`` (a private mapping of the
    file when ``mmap`` resolves true and the device is the CPU)."""
    if mmap_wanted(mmap) and _is_cpu(device):
        return mmapload.load_safetensors_mmap(fspath, handles.handle_for(cfg, read=True), checksum=cfg.checksum)
    return safetensors.load_safetensors(fspath, handles.handle_for(cfg, read=True), device, checksum=cfg.checksum)


def _load_safetensors(fspath: str, cfg: Any, req: LoadRequest) -> Any:
    return load_safetensors_file(fspath, safetensors_device(req.map_location), cfg, req.mmap)


def _verify_safetensors(fspath: str, handle: Any) -> VerifyResult:
    st = safetensors.check_safetensors(fspath, handle)
    status = "corrupt" if st.problems else ("ok" if st.checked else "unchecked")
    problems = list(st.problems)
    if status == "unchecked":
        problems = [
            f"{fspath}: no fastpersist checksums in this safetensors file (not written by fastpersist, or "
            f"with checksums off): its structure is valid ({st.records} tensors), its bytes cannot be checked"
        ]
    return VerifyResult(ok=status == "ok", path=fspath, format="safetensors", records=st.records,
                        bytes=st.nbytes, problems=problems, status=status)


# ---------------------------------------------------------------------------- the table

TORCH = Format("torch", (), _plan_torch, _torch_writer, _load_torch, _verify_torch)
SAFETENSORS = Format("safetensors", (".safetensors",), _plan_safetensors, _safetensors_writer_default_metadata,
                     _load_safetensors, _verify_safetensors)
#: A ``torch.distributed.checkpoint`` directory: verified here, written and read by
#: ``fastpersist.dcp`` (DCP plans those files).
DCP = Format("dcp", (), None, None, None, verify_dcp)

#: The formats ``save``'s ``format=`` names.
FORMATS: dict[str, Format] = {f.name: f for f in (TORCH, SAFETENSORS)}


def format_for(path: str, format: Optional[str] = None) -> Format:
    """``format`` by name, or the format of ``path``'s suffix (torch's zip format when no
    suffix matches, as ``torch.save`` writes any name)."""
    if format is not None:
        if format not in FORMATS:
            raise ValueError(f"unknown format {format!r}; expected one of {tuple(FORMATS)}")
        return FORMATS[format]
    for f in FORMATS.values():
        if f.suffixes and path.endswith(f.suffixes):
            return f
    return TORCH
