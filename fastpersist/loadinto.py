"""Load a checkpoint straight into the tensors a model (or optimizer) already has.

``fastpersist.load_state_dict(model, "ckpt.pt")`` reads each parameter's and buffer's
bytes from the file directly into that tensor's memory with the native parallel
reader: no intermediate copy of the file, no fresh allocation whose first touch
costs page faults. Then ``model.load_state_dict`` runs as usual on tensors that
alias the parameters (torch's ``copy_`` skips a copy of a tensor onto itself), so
its hooks and result are torch's.

Before any byte reaches the model, every entry is checked: names (``strict``, as
``Module.load_state_dict``), shapes, and dtypes (a different dtype is an error
unless ``cast=True``). Only the records the model needs are read; with
``config.checksum`` each one has its CRC-32 checked. A failure after reading
started raises :class:`PartialLoadError`, which says the model was partly
overwritten.

Where the bytes cannot land in place (a non-contiguous tensor on either side, a
cast, a non-CPU target, two targets wanting overlapping bytes), the record is
read into a scratch buffer of its size and copied. Legacy (non-zip) torch files,
compressed or TorchScript archives, byte-swapped files and files whose tensors the
index cannot describe are loaded with ``torch.load(weights_only=True)`` and copied
(same checks, same result).
"""

from __future__ import annotations

import collections
import logging
import os
import re
from collections.abc import Mapping
from typing import Any, NamedTuple, Optional, Union

import torch

from fastpersist import _native, handles, objectstore, s3tier
from fastpersist.prefault import choose_pages
from fastpersist import config as config_mod
from fastpersist.errors import CheckpointFormatError, FastPersistError, UnsupportedLayoutError
from fastpersist.formats.torchindex import (
    CheckpointFile,
    Piece,
    TensorInfo,
    open_checkpoint,
    step,
    tensor_leaves,
    tensor_name,
)

__all__ = ["IncompatibleKeys", "PartialLoadError", "StateDictMismatchError", "load_state_dict"]

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]
_PAGE = 4096
#: Scratch buffers (records that cannot be read in place) are read in batches of at most this many bytes.
SCRATCH_BATCH = 256 << 20


class IncompatibleKeys(NamedTuple):
    """Keys the target has and the file lacks, and the other way round (like the
    result of ``Module.load_state_dict``)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class StateDictMismatchError(FastPersistError, RuntimeError):
    """The file does not fit the target (missing or unexpected keys with ``strict``,
    shapes or dtypes that differ); raised before any byte was read into the target."""


class PartialLoadError(FastPersistError, OSError):
    """Reading into the target failed after reading had started: the target was
    partly overwritten (some tensors hold the file's bytes, others their old ones,
    possibly one half of each). ``path``, ``offset`` (when known) and ``errno`` (for
    I/O errors) say where; ``__cause__`` is the original error. Load again from a
    good file before using the target."""

    def __init__(self, message: str, path: str, offset: Optional[int], errno: Optional[int]) -> None:
        if errno is not None:
            super().__init__(errno, message, path)
        else:
            super().__init__(message)
        self.path = path
        self.offset = offset


# --------------------------------------------------------------------------- targets


def _flatten(obj: Any, out: dict[str, torch.Tensor]) -> None:
    """Every tensor of ``obj`` into ``out`` under its name (the names ``fastpersist.open`` gives)."""
    for keys, t in tensor_leaves(obj):
        out[tensor_name(keys)] = t


def _keys_error(what: str, missing: list[str], unexpected: list[str]) -> StateDictMismatchError:
    msgs = []
    if unexpected:
        msgs.append("Unexpected key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in unexpected)))
    if missing:
        msgs.append("Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing)))
    return StateDictMismatchError(
        "Error(s) in loading state_dict for {}:\n\t{}\n(nothing was read into it)".format(what, "\n\t".join(msgs))
    )


def _check_entries(what: str, path: str, pairs: list[tuple[str, torch.Tensor, Any]], cast: bool) -> None:
    """Shapes and dtypes of every (name, target, file tensor info or tensor)."""
    problems = []
    for name, t, src in pairs:
        shape, dtype = tuple(src.shape), src.dtype
        if tuple(t.shape) != shape:
            problems.append(f"size mismatch for {name}: copying a param with shape {torch.Size(shape)} from "
                            f"checkpoint, the shape in current model is {t.shape}.")
        elif dtype != t.dtype and not cast:
            problems.append(f"dtype mismatch for {name}: the checkpoint holds {dtype}, the target is {t.dtype} "
                            "(pass cast=True to convert, as Module.load_state_dict would)")
    if problems:
        raise StateDictMismatchError(
            f"Error(s) in loading state_dict for {what} from {path}:\n\t" + "\n\t".join(problems)
            + "\n(nothing was read into it)"
        )


# --------------------------------------------------------------------------- the read


class _Plan:
    """Where every wanted record goes: pieces straight into targets, or a scratch
    buffer with copies afterwards."""

    def __init__(self, f: CheckpointFile) -> None:
        self.f = f
        self.pieces: dict[str, list[tuple[Piece, torch.Tensor]]] = {}
        self.scratch: dict[str, list[tuple[torch.Tensor, TensorInfo]]] = {}
        self.dupes: list[tuple[torch.Tensor, torch.Tensor]] = []  # (target, source target): copy after the read
        self.keep: list[Any] = []

    def add(self, t: torch.Tensor, info: TensorInfo) -> None:
        if info.numel == 0:
            return
        direct = (
            type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.dtype == info.dtype
            and t.layout == torch.strided and t.is_contiguous() and info.contiguous
            and not t.is_conj() and not t.is_neg()
        )
        if info.record in self.scratch or not direct:
            self._to_scratch(info.record)
            self.scratch[info.record].append((t, info))
            return
        piece = Piece(info.byte_offset, info.nbytes, t.data_ptr())
        pieces = self.pieces.setdefault(info.record, [])
        for p, other in pieces:
            if p.start == piece.start and p.length == piece.length:
                self.dupes.append((t, other))  # same bytes wanted twice (tied in the file only)
                return
            if p.start < piece.start + piece.length and piece.start < p.start + p.length:
                self._to_scratch(info.record)
                self.scratch[info.record].append((t, info))
                return
        pieces.append((piece, t))

    def _to_scratch(self, record: str) -> None:
        if record in self.scratch:
            return
        moved = self.pieces.pop(record, [])
        self.scratch[record] = []
        for p, t in moved:
            info = self._info_of(record, p)
            self.scratch[record].append((t, info))
        for t, other in list(self.dupes):
            if any(other is tt for _, tt in moved):
                self.dupes.remove((t, other))
                info = self._info_of(record, next(p for p, tt in moved if tt is other))
                self.scratch[record].append((t, info))

    def _info_of(self, record: str, p: Piece) -> TensorInfo:
        return self._direct_info[(record, p.start, p.length)]

    _direct_info: dict[tuple[str, int, int], TensorInfo]

    def execute(self, handle: Any, what: str) -> None:
        """Read: the direct pieces and the first scratch records in one native read, the
        other scratch records in batches of at most :data:`SCRATCH_BATCH` bytes (so
        scratch memory stays bounded, e.g. for a model on a GPU); copies after each."""
        wants: dict[str, list[Piece]] = {}
        for record, items in self.pieces.items():
            wants[record] = sorted((p for p, _ in items), key=lambda p: p.start)
        batches: list[list[str]] = [[]]
        size = 0
        for record in sorted(self.scratch, key=lambda n: self.f.records[n].offset):
            n = self.f.records[record].size
            if batches[-1] and size + n > SCRATCH_BATCH:
                batches.append([])
                size = 0
            batches[-1].append(record)
            size += n
        try:
            for i, batch in enumerate(batches):
                self._read_batch(wants if i == 0 else {}, batch, handle)
            with torch.no_grad():
                for t, other in self.dupes:
                    t.copy_(other)
        except Exception as e:  # noqa: BLE001 - every failure after the read began
            errno = getattr(e, "errno", None) if isinstance(e, OSError) else None
            offset = getattr(e, "offset", None)
            if offset is None:
                m = re.search(r"offset (\d+)", str(e))
                offset = int(m.group(1)) if m else None
            raise PartialLoadError(
                f"{self.f.path}: loading into {what} failed after reading had started, so {what} was partly "
                f"overwritten (some tensors hold the checkpoint's bytes, others their old ones); load again from "
                f"a good copy before using it. Cause: {type(e).__name__}: {e}",
                self.f.path, offset, errno,
            ) from e

    def _read_batch(self, wants: dict[str, list[Piece]], scratch: list[str], handle: Any) -> None:
        wants = dict(wants)
        buffers: dict[str, torch.Tensor] = {}
        for record in scratch:
            r = self.f.records[record]
            if r.size == 0:
                buffers[record] = torch.empty(0, dtype=torch.uint8)
                continue
            lead = r.offset % _PAGE
            buf = choose_pages(_native.PinnedBuffer(-(-(lead + r.size) // _PAGE) * _PAGE, _PAGE, False))
            buffers[record] = torch.frombuffer(buf, dtype=torch.uint8, count=r.size, offset=lead)
            wants[record] = [Piece(0, r.size, buf.ptr + lead)]
        if wants:
            self.f.read(wants, handle, into_existing=True)
        with torch.no_grad():
            for record in scratch:
                for t, info in self.scratch[record]:
                    t.copy_(self.f.tensor_from_record(info, buffers[record]).detach())


def _plan(f: CheckpointFile, pairs: list[tuple[str, torch.Tensor, TensorInfo]]) -> _Plan:
    plan = _Plan(f)
    plan._direct_info = {}
    seen: dict[tuple[int, int, torch.dtype, tuple, tuple, torch.device], int] = {}
    unique: list[tuple[torch.Tensor, TensorInfo]] = []
    for _, t, info in pairs:
        try:
            where = t.untyped_storage().data_ptr() if t.numel() and t.layout == torch.strided else id(t)
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage of their own
            where = id(t)
        key = (where, t.storage_offset() if where != id(t) else 0, t.dtype, tuple(t.shape),
               tuple(t.stride()) if t.layout == torch.strided else (), t.device)
        if key in seen:  # tied in the target: the same memory, read once (the last name wins, as in torch)
            unique[seen[key]] = (t, info)
            continue
        seen[key] = len(unique)
        unique.append((t, info))
    for t, info in unique:
        plan._direct_info[(info.record, info.byte_offset, info.nbytes)] = info
        plan.add(t, info)
    return plan


# --------------------------------------------------------------------------- entry point


def load_state_dict(
    target: Any,
    path: PathLike,
    *,
    strict: bool = True,
    key: Any = None,
    cast: bool = False,
    config: Any = None,
) -> Any:
    """Read a checkpoint's tensors straight into ``target``'s existing tensors.

    Args:
        target: an ``nn.Module`` (its ``state_dict()`` entries are filled, then
            ``target.load_state_dict`` runs on tensors aliasing them), a
            ``torch.optim.Optimizer`` (existing state tensors of matching shape and
            dtype are filled in place, the rest read fresh, then
            ``optimizer.load_state_dict``), or a dict (possibly nested, with lists)
            of tensors, filled in place.
        path: a torch checkpoint (zip; legacy files go through ``torch.load``) or a
            ``.safetensors`` file.
        strict: like ``Module.load_state_dict``: keys the target has and the file
            lacks (missing) or the other way round (unexpected) are an error, raised
            before anything is read. With ``strict=False`` missing targets keep their
            values and unexpected file entries are not read. Ignored for optimizers.
        key: the part of the saved object holding the state dict: a top-level key
            (``"state_dict"`` for Lightning checkpoints, ``"model"``), a dotted path
            (``"module.encoder"``) or a tuple of keys. Torch files only.
        cast: if a file tensor's dtype differs from the target's, convert it (through
            a scratch buffer) instead of raising.
        config: a :class:`fastpersist.Config` (I/O settings, ``checksum``).

    Returns:
        For a module, what ``Module.load_state_dict`` returns (``missing_keys``,
        ``unexpected_keys``; unexpected keys are the file's entries that were not
        read). For a dict, an :class:`IncompatibleKeys`. For an optimizer, None.

    Raises:
        StateDictMismatchError: (a ``RuntimeError``, like torch's) missing or
            unexpected keys with ``strict``, shape or dtype mismatches: nothing was
            read into the target.
        PartialLoadError: (an ``OSError``) reading failed after it had started (I/O
            error, truncated file, checksum mismatch): the target was partly
            overwritten; the message names the path, offset and errno.
        fastpersist.errors.CheckpointFormatError, ChecksumError: the file is
            malformed (found before anything was read into the target).
        pickle.UnpicklingError: the pickle holds what ``weights_only`` refuses.
    """
    if objectstore.is_s3_url(path):
        cfg = config_mod.resolve(config)

        def remote() -> Any:  # fetched into memory by ranged GETs, then read from there
            got, checked_cfg = objectstore.fetch_for_reading(path, config=cfg)
            with got:
                try:
                    return load_state_dict(target, got.path, strict=strict, key=key, cast=cast,
                                           config=checked_cfg)
                except Exception as e:  # noqa: BLE001 - re-raised, naming the URL
                    objectstore.name_url_in_error(e, got.path, got.url)
                    raise

        return s3tier.read_best(path, cfg, lambda local: load_state_dict(target, local, strict=strict, key=key,
                                                                         cast=cast, config=cfg), remote)
    cfg = config_mod.resolve(config)
    fspath = os.fsdecode(os.fspath(path))
    if not isinstance(target, (torch.nn.Module, torch.optim.Optimizer, Mapping)):
        raise TypeError(f"load_state_dict fills an nn.Module, an Optimizer or a dict of tensors, "
                        f"not a {type(target).__name__}")
    try:
        f = open_checkpoint(fspath, checksum=cfg.checksum)
    except UnsupportedLayoutError as e:
        log.debug("%s: no tensor index (%s); loading with torch.load and copying", fspath, e)
        return _load_with_torch(target, fspath, strict=strict, key=key, cast=cast)
    try:
        handle = handles.handle_for(cfg, read=True)
        if isinstance(target, torch.optim.Optimizer):
            return _into_optimizer(target, f, key, cast, handle)
        return _into_module_or_dict(target, f, strict, key, cast, handle)
    finally:
        os.close(f.fd)


def _what(target: Any) -> str:
    return type(target).__name__


def _into_module_or_dict(target: Any, f: CheckpointFile, strict: bool, key: Any, cast: bool, handle: Any) -> Any:
    sub, found, ambiguous = f.tensors_under(key)
    extra: dict[str, Any] = {}  # non-tensor state_dict entries (get_extra_state)
    module_sd: dict[str, Any] = dict(target.state_dict()) if isinstance(target, torch.nn.Module) else {}
    if isinstance(target, torch.nn.Module):
        expected: dict[str, torch.Tensor] = {}
        for k, v in module_sd.items():
            if isinstance(v, torch.Tensor):
                expected[k] = v
            elif isinstance(sub, Mapping) and k in sub:
                extra[k] = _materialize(f, sub[k], handle)
    else:
        expected = {}
        _flatten(target, expected)
    what = _what(target)
    bad = [n for n in ambiguous if n in expected]
    if bad:
        raise StateDictMismatchError(f"{f.path}: the names {bad} stand for several tensors in the checkpoint "
                                     "(keys that format to the same dotted name); nothing was read")
    missing = [k for k in (module_sd or expected) if k not in found and k not in extra]
    inside_extra = tuple(k + "." for k in extra)
    unexpected = [k for k in found if k not in expected and not (inside_extra and k.startswith(inside_extra))]
    unexpected += [k for k in ambiguous if k not in expected]
    if strict and (missing or unexpected):
        raise _keys_error(what, missing, unexpected)
    pairs = [(k, expected[k], found[k]) for k in expected if k in found]
    _check_entries(what, f.path, pairs, cast)
    plan = _plan(f, pairs)
    plan.execute(handle, "the " + ("model" if isinstance(target, torch.nn.Module) else "target dict"))
    if isinstance(target, torch.nn.Module):
        filled: Any = collections.OrderedDict(
            (k, expected[k] if k in expected else extra[k]) for k in module_sd if k in found or k in extra
        )
        meta = getattr(sub, "_metadata", None)
        if meta is not None:
            filled._metadata = meta
        result = target.load_state_dict(filled, strict=strict)
        if unexpected:
            result.unexpected_keys.extend(k for k in unexpected if k not in result.unexpected_keys)
        return result
    return IncompatibleKeys(missing, unexpected)


def _materialize(f: CheckpointFile, obj: Any, handle: Any) -> Any:
    """``obj`` (part of the file's object) with its tensors read (fresh memory)."""
    names = {id(t): f.meta_ids[id(t)] for _keys, t in tensor_leaves(obj) if id(t) in f.meta_ids}
    if not names:
        return obj
    infos = {n: f.info(n) for n in names.values()}
    records = f.read_records({i.record for i in infos.values()}, handle)

    def replace(t: torch.Tensor) -> Any:
        n = names.get(id(t))
        if n is None:
            raise UnsupportedLayoutError("a tensor without a name of its own")
        return f.tensor_from_record(infos[n], records[infos[n].record])

    return f.rebuild(obj, replace)


def _into_optimizer(opt: torch.optim.Optimizer, f: CheckpointFile, key: Any, cast: bool, handle: Any) -> None:
    sub, found, ambiguous = f.tensors_under(key)
    if not isinstance(sub, Mapping) or "param_groups" not in sub or "state" not in sub:
        raise StateDictMismatchError(f"{f.path}: the checkpoint{'' if key is None else f'[{key!r}]'} is not an "
                                     "optimizer state dict (no 'state' and 'param_groups'); pass key=")
    if ambiguous:
        raise StateDictMismatchError(f"{f.path}: the names {ambiguous} stand for several tensors of the optimizer "
                                     "state (keys that format to the same dotted name); nothing was read")
    groups = opt.param_groups
    saved = sub["param_groups"]
    if not isinstance(saved, (list, tuple)) or not all(isinstance(s, Mapping) for s in saved):
        raise StateDictMismatchError(f"{f.path}: the checkpoint's param_groups is not a list of dicts")
    if len(groups) != len(saved) or any(len(g["params"]) != len(s.get("params", ())) for g, s in zip(groups, saved)):
        raise StateDictMismatchError(f"{f.path}: the optimizer's parameter groups do not match the checkpoint's "
                                     "(number of groups or of parameters per group); nothing was read")
    current: dict[str, torch.Tensor] = {}
    _flatten({"state": opt.state_dict()["state"]}, current)
    pairs = []
    fresh: list[str] = []
    for name, info in found.items():
        t = current.get(name)
        if t is not None and tuple(t.shape) == info.shape and (t.dtype == info.dtype or cast):
            pairs.append((name, t, info))
        else:
            fresh.append(name)
    plan = _plan(f, pairs)
    reader_names = {found[n].record for n in fresh}
    records = f.read_records(reader_names, handle) if reader_names else {}  # before anything is overwritten
    plan.execute(handle, "the optimizer state")
    by_name = {n: t for n, t, _ in pairs}
    for n in fresh:
        by_name[n] = f.tensor_from_record(found[n], records[found[n].record])
    prefix = f.select(key)[1]

    def replace(t: torch.Tensor) -> Any:
        name = f.meta_ids.get(id(t))
        if name is None or name[len(prefix):] not in by_name:
            raise StateDictMismatchError(f"{f.path}: a tensor of the optimizer state has no name of its own")
        return by_name[name[len(prefix):]]

    opt.load_state_dict(f.rebuild(sub, replace))


def _load_with_torch(target: Any, path: str, *, strict: bool, key: Any, cast: bool) -> Any:
    """Legacy and other files without an index: ``torch.load(weights_only=True)``, then
    the same checks and copies."""
    import struct

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (IndexError, KeyError, struct.error, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointFormatError(f"{path}: not a loadable checkpoint (torch.load failed: "
                                    f"{type(e).__name__}: {e})", path) from e
    if key is not None and key != ():
        for part in key if isinstance(key, tuple) else (key,):
            obj, _ = step(obj, part, path, key)
    if isinstance(target, torch.optim.Optimizer):
        target.load_state_dict(obj)
        return None
    found: dict[str, torch.Tensor] = {}
    _flatten(obj, found)
    if isinstance(target, torch.nn.Module):
        expected: dict[str, torch.Tensor] = dict(target.state_dict())
    else:
        expected = {}
        _flatten(target, expected)
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    what = _what(target)
    if strict and (missing or unexpected):
        raise _keys_error(what, missing, unexpected)
    pairs = [(k, expected[k], found[k]) for k in expected if k in found]
    _check_entries(what, path, pairs, cast)
    if isinstance(target, torch.nn.Module):
        sub = collections.OrderedDict((k, found[k]) for k in expected if k in found)
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            sub._metadata = meta
        result = target.load_state_dict(sub, strict=strict)
        result.unexpected_keys.extend(k for k in unexpected if k not in result.unexpected_keys)
        return result
    with torch.no_grad():
        for _, t, src in pairs:
            t.copy_(src)
    return IncompatibleKeys(missing, unexpected)
