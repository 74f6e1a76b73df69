"""Run a model larger than memory: stream each block's weights from disk just before
its forward (the ZeRO-Inference technique), with plain PyTorch or transformers::

    from accelerate import init_empty_weights
    with init_empty_weights():                      # parameters on "meta": no memory
        model = AutoModelForCausalLM.from_config(config)
    fastpersist.stream_weights(model, "ckpt_dir/")  # sharded safetensors, .safetensors or torch zip
    out = model.generate(ids, max_new_tokens=20)    # bit-identical to the model fully in memory

How it works (docs/streaming.md has the design):

* The *blocks* are the model's repeated layers: the largest ``nn.ModuleList`` whose
  children all have one type (or the modules the caller passes as ``blocks=``).
  Everything else (embeddings, final norm, head) is *resident*: read once, at the
  call, into ordinary memory (on ``device``).
* A ring of ``prefetch + 1`` page-aligned, page-locked slots (:func:`fastpersist.io.pinned_empty`),
  each the size of the largest block, holds the streamed weights. A forward
  pre-hook on block ``i`` waits for its read, points its parameters at views of
  its slot and starts the reads of the next ``prefetch`` blocks (cyclically: after
  the last block come the first ones, for the next token); a forward hook puts its
  parameters back on ``meta`` and frees the slot. So memory stays at the resident
  part plus ``prefetch + 1`` blocks, whatever the model's size.
* Reads go through the checkpoint index of :func:`fastpersist.open` (torch zip files
  and safetensors files) with the native parallel reader, ``O_DIRECT`` (never the
  page cache: ``read_mode="direct"``), each record's CRC-32 checked where the file
  has one (torch zip files: every record; safetensors files written by fastpersist:
  a ``"fastpersist.crc32"`` field in each tensor's header entry). A block whose read fails raises
  :class:`StreamingError` from its pre-hook, before its forward runs: no output is
  computed from bytes that were not checked.
* Reads run on one background thread per model (the native reader releases the
  GIL), in block order.
* ``device="cuda"``: each slot's bytes are copied to a device slot on a side stream
  once read, and the compute stream waits for that copy (an event) before the
  block's forward. Checked on a GPU: the same greedy tokens as the model held in GPU
  memory (docs/gpu.md).

Inference only: the streamed parameters do not require grad and are gone after
each block's forward.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from fastpersist import _native
from fastpersist import config as config_mod
from fastpersist.errors import FastPersistError
from fastpersist.formats.torchindex import CheckpointFile, Piece, TensorInfo, open_checkpoint
from fastpersist.io import pinned_empty
from fastpersist.metabuffers import recreate_meta_buffers

__all__ = ["Streamer", "StreamingError", "find_blocks", "stream_weights", "streamer_of"]

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]
_ALIGN = 4096
_INDEX_NAME = "model.safetensors.index.json"
_ATTR = "_fastpersist_streamer"


class StreamingError(FastPersistError, RuntimeError):
    """The checkpoint does not fit the model (missing tensors, shapes, dtypes), or a
    block's weights could not be read (I/O error, truncated file, checksum mismatch):
    raised before the block computes anything. ``__cause__`` is the original error."""


# --------------------------------------------------------------------------- checkpoint


class _Checkpoint:
    """Tensor name -> (open file, its index entry), over one file or a sharded folder."""

    def __init__(self, path: PathLike, checksum: bool) -> None:
        self.path = os.fsdecode(os.fspath(path))
        self.files: list[CheckpointFile] = []
        self.where: dict[str, tuple[CheckpointFile, TensorInfo]] = {}
        try:
            for p in self._file_paths():
                f = open_checkpoint(p, checksum=checksum)
                self.files.append(f)
                for name, info in f.tensors.items():
                    self.where.setdefault(name, (f, info))
        except BaseException:
            self.close()
            raise

    def _file_paths(self) -> list[str]:
        if not os.path.isdir(self.path):
            return [self.path]
        index = os.path.join(self.path, _INDEX_NAME)
        if os.path.exists(index):
            try:
                with open(index, encoding="utf-8") as fh:
                    weight_map = json.load(fh)["weight_map"]
                shards = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise StreamingError(f"{index}: not a readable sharded-checkpoint index ({type(e).__name__}: {e})") from e
            missing = [s for s in shards if not os.path.isfile(os.path.join(self.path, s))]
            if missing:
                raise StreamingError(f"{self.path}: shard(s) {missing} named in {_INDEX_NAME} are missing")
            return [os.path.join(self.path, s) for s in shards]
        single = [n for n in sorted(os.listdir(self.path)) if n.endswith(".safetensors")]
        if len(single) == 1:
            return [os.path.join(self.path, single[0])]
        raise StreamingError(f"{self.path}: a folder needs {_INDEX_NAME} (or exactly one .safetensors file); "
                             f"found {len(single)} .safetensors files and no index")

    def close(self) -> None:
        files, self.files = self.files, []
        for f in files:
            try:
                os.close(f.fd)
            except OSError:
                pass


# --------------------------------------------------------------------------- blocks


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated layers: the children of its largest ``nn.ModuleList`` (by
    parameter elements, meta tensors included) whose children all have one type and
    hold parameters. ``ValueError`` if there is none."""
    best: Optional[nn.ModuleList] = None
    best_size = 0
    for _, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) < 2:
            continue
        if len({type(c) for c in m}) != 1:
            continue
        size = sum(p.numel() for p in m.parameters())
        if size > best_size:
            best, best_size = m, size
    if best is None:
        raise ValueError(f"{type(model).__name__}: no nn.ModuleList of identical layers with parameters found; "
                         "pass blocks=[...] (the modules to stream, in execution order)")
    return list(best)


@dataclass
class _Slot:
    """Where one tensor of a block goes: its owner module(s), its bytes in the slot."""

    places: list[tuple[nn.Module, str, bool]]  # (module, attribute, is parameter)
    name: str  # its name in the checkpoint
    file: CheckpointFile
    info: TensorInfo
    offset: int  # byte offset in the slot
    meta: list[Any]  # the original (meta) tensors, put back after the forward


@dataclass
class _Block:
    index: int
    module: nn.Module
    tensors: list[_Slot] = field(default_factory=list)
    nbytes: int = 0  # slot bytes the block uses


# --------------------------------------------------------------------------- the streamer


class Streamer:
    """The streaming state of one model (see :func:`stream_weights`); :func:`streamer_of`
    returns it. ``bytes_read`` / ``read_seconds``: what the block reads moved and how long
    the reading thread spent on them (for throughput figures). :meth:`close` removes the
    hooks and frees the ring (the blocks' parameters stay on ``meta``)."""

    def __init__(self, model: nn.Module, ckpt: _Checkpoint, blocks: list[_Block], prefetch: int,
                 device: torch.device, handle: Any) -> None:
        self.model = model
        self.ckpt = ckpt
        self.blocks = blocks
        self.prefetch = prefetch
        self.device = device
        self.handle = handle
        self.slot_bytes = max((b.nbytes for b in blocks), default=0)
        self.nslots = min(prefetch + 1, len(blocks))
        self.bytes_read = 0
        self.read_seconds = 0.0
        self.reads = 0  #: block reads completed (counted on the reading thread)
        self.submitted = 0  #: block reads submitted (counted by the ring, on the caller's thread)
        self._cuda = device.type == "cuda"
        self._host = [_pinned(self.slot_bytes, self._cuda) for _ in range(self.nslots)]
        self._dev = ([torch.empty(self.slot_bytes, dtype=torch.uint8, device=device) for _ in range(self.nslots)]
                     if self._cuda else self._host)
        self._side = torch.cuda.Stream(device=device) if self._cuda else None
        self._released: list[Any] = [None] * self.nslots  # cuda: event after the compute last used the slot
        self._free = list(range(self.nslots))
        self._inflight: dict[int, tuple[int, Future]] = {}  # block -> (slot, read)
        self._bound: dict[int, int] = {}  # block -> slot
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastpersist-stream")
        self._hooks = []
        for b in blocks:
            self._hooks.append(b.module.register_forward_pre_hook(self._make_pre(b.index)))
            self._hooks.append(b.module.register_forward_hook(self._make_post(b.index)))

    # -- hooks ---------------------------------------------------------------------------

    def _make_pre(self, i: int) -> Any:
        def pre(module: nn.Module, args: Any) -> None:
            self.before(i)
        return pre

    def _make_post(self, i: int) -> Any:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            self.after(i)
        return post

    def before(self, i: int) -> None:
        """Block ``i`` is about to run: its weights in place (waiting for their read),
        the next ``prefetch`` blocks' reads started."""
        if i not in self._bound:
            if i not in self._inflight:
                self._drain()  # out of the predicted order: finish what is in flight, read this one now
                self._submit(i)
            slot, fut = self._inflight.pop(i)
            try:
                event = fut.result()
            except BaseException as e:
                self._free.append(slot)
                self._drain()
                raise StreamingError(f"{self.ckpt.path}: reading the weights of block {i} "
                                     f"({type(self.blocks[i].module).__name__}) failed, nothing was computed "
                                     f"from them: {type(e).__name__}: {e}") from e
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
            self._bind(i, slot)
            self._bound[i] = slot
        n = len(self.blocks)
        for k in range(1, self.prefetch + 1):
            j = (i + k) % n
            if j == i or j in self._bound or j in self._inflight:
                continue
            if not self._free:
                break
            self._submit(j)

    def after(self, i: int) -> None:
        """Block ``i`` finished its forward: parameters back to ``meta``, slot free."""
        slot = self._bound.pop(i, None)
        if slot is None:
            return
        self._unbind(i)
        if self._cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self._released[slot] = ev
        self._free.append(slot)
        # start the next block's read now if the pre-hook of i could not (ring was full)
        n = len(self.blocks)
        for k in range(1, self.prefetch + 1):
            j = (i + k) % n
            if j in self._bound or j in self._inflight:
                continue
            if not self._free:
                break
            self._submit(j)
            break

    # -- reads ---------------------------------------------------------------------------

    def _submit(self, i: int) -> None:
        slot = self._free.pop(0)
        self.submitted += 1
        released, self._released[slot] = self._released[slot], None
        self._inflight[i] = (slot, self._pool.submit(self._read, i, slot, released))

    def _drain(self) -> None:
        for j, (slot, fut) in list(self._inflight.items()):
            try:
                fut.result()
            except BaseException:  # noqa: BLE001 - reported when (if) block j runs
                pass
            del self._inflight[j]
            self._free.append(slot)

    def _read(self, i: int, slot: int, released: Any) -> Any:
        """On the reading thread: block ``i``'s records into host slot ``slot`` (CRC-checked),
        then (CUDA) the copy to the device slot on the side stream; returns its event."""
        b = self.blocks[i]
        host = self._host[slot]
        base = host.data_ptr()
        per_file: dict[int, tuple[CheckpointFile, dict[str, list[Piece]]]] = {}
        for t in b.tensors:
            if t.info.nbytes == 0:
                continue
            wants = per_file.setdefault(id(t.file), (t.file, {}))[1]
            wants.setdefault(t.info.record, []).append(Piece(t.info.byte_offset, t.info.nbytes, base + t.offset))
        started = time.perf_counter()
        nbytes = 0
        for f, wants in per_file.values():
            for record, pieces in wants.items():
                pieces.sort(key=lambda p: p.start)
                nbytes += sum(p.length for p in pieces)
            f.read(wants, self.handle)
        with self._lock:
            self.bytes_read += nbytes
            self.read_seconds += time.perf_counter() - started
            self.reads += 1
        if not self._cuda:
            return None
        assert self._side is not None
        with torch.cuda.device(self.device), torch.cuda.stream(self._side):  # this thread's device may differ
            if released is not None:
                self._side.wait_event(released)  # the compute stream is done with the old contents
            self._dev[slot][: b.nbytes].copy_(host[: b.nbytes], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self._side)
        ev.synchronize()  # the host slot is free again once the copy is done (releases the GIL)
        return ev

    # -- binding ---------------------------------------------------------------------------

    def _bind(self, i: int, slot: int) -> None:
        buf = self._dev[slot]
        for t in self.blocks[i].tensors:
            info = t.info
            view = buf[t.offset : t.offset + info.nbytes].view(info.dtype).view(info.shape)
            param = nn.Parameter(view, requires_grad=False)
            for module, attr, is_param in t.places:
                if is_param:
                    module._parameters[attr] = param
                else:
                    module._buffers[attr] = view

    def _unbind(self, i: int) -> None:
        for t in self.blocks[i].tensors:
            for (module, attr, is_param), meta in zip(t.places, t.meta):
                if is_param:
                    module._parameters[attr] = meta
                else:
                    module._buffers[attr] = meta

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Remove the hooks, wait for reads in flight, free the ring (idempotent)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._drain()
        for i in list(self._bound):
            self._unbind(i)
        self._bound.clear()
        self._pool.shutdown(wait=True)
        self._host = []
        self._dev = []
        self.ckpt.close()
        if getattr(self.model, _ATTR, None) is self:
            delattr(self.model, _ATTR)

    def __repr__(self) -> str:
        return (f"<fastpersist.Streamer {len(self.blocks)} blocks, {self.nslots} slots of {self.slot_bytes} bytes, "
                f"prefetch={self.prefetch}, device={self.device}>")


def _pinned(nbytes: int, cuda: bool) -> torch.Tensor:
    return pinned_empty(max(nbytes, 1), register_cuda=cuda)


def streamer_of(model: nn.Module) -> Optional[Streamer]:
    """The :class:`Streamer` that :func:`stream_weights` attached to ``model`` (None if none)."""
    return getattr(model, _ATTR, None)


# --------------------------------------------------------------------------- entry point


def _tensor_places(model: nn.Module) -> dict[int, tuple[Any, list[tuple[str, nn.Module, str, bool]]]]:
    """id(tensor) -> (tensor, [(full name, module, attribute, is parameter)]) for every
    parameter and buffer (tied tensors: one entry, several places)."""
    out: dict[int, tuple[Any, list[tuple[str, nn.Module, str, bool]]]] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        prefix = mname + "." if mname else ""
        for attr, p in m._parameters.items():
            if p is not None:
                out.setdefault(id(p), (p, []))[1].append((prefix + attr, m, attr, True))
        for attr, bt in m._buffers.items():
            if bt is not None:
                out.setdefault(id(bt), (bt, []))[1].append((prefix + attr, m, attr, False))
    return out


def _check(name: str, t: torch.Tensor, info: TensorInfo, path: str) -> Optional[str]:
    if tuple(t.shape) != tuple(info.shape):
        return f"{name}: shape {tuple(info.shape)} in {path}, {tuple(t.shape)} in the model"
    if t.dtype != info.dtype:
        return f"{name}: dtype {info.dtype} in {path}, {t.dtype} in the model (build the model in the checkpoint's dtype)"
    if not info.contiguous:
        return f"{name}: not contiguous in {path} (save contiguous tensors)"
    return None


def stream_weights(
    model: nn.Module,
    checkpoint: PathLike,
    *,
    prefetch: int = 2,
    device: Union[str, torch.device, None] = None,
    blocks: Optional[Sequence[nn.Module]] = None,
    config: Any = None,
) -> nn.Module:
    """Make ``model`` run with its repeated blocks' weights streamed from ``checkpoint``.

    Args:
        model: an ``nn.Module``, typically built on ``meta`` (``accelerate.init_empty_weights``
            or ``with torch.device("meta")``). Parameters and persistent buffers are
            taken from the checkpoint by their ``state_dict`` names; tied parameters (one
            object under two names) need only one name in the file; a ``model.tie_weights()``
            (transformers) is called first. Buffers that are
            not in the file (rotary ``inv_freq``) keep their values; where they are on
            meta, the model computes them again if it can
            (:func:`fastpersist.metabuffers.recreate_meta_buffers`), else the call is refused.
        checkpoint: a torch zip file (``fastpersist.save`` / ``torch.save`` of the state
            dict), a ``.safetensors`` file, or a folder with ``model.safetensors.index.json``
            and its shards (``save_pretrained``), or with one ``.safetensors`` file.
        prefetch: blocks whose reads are in flight while one computes (>= 1). Memory:
            ``prefetch + 1`` slots of the largest block's size.
        device: where the model computes (default: CPU). ``"cuda"``: resident weights go
            to the GPU, streamed ones through the pinned ring and a side stream.
        blocks: the modules to stream, in execution order (default: :func:`find_blocks`).
        config: a :class:`fastpersist.Config` for the reader (engine, queue depth,
            threads, ``checksum``); its ``read_mode`` is forced to ``"direct"``, and
            ``read_staging="auto"`` becomes ``"off"`` (reads land straight in the ring).

    Returns:
        ``model`` itself, its resident weights loaded, hooks installed
        (:func:`streamer_of` gives the :class:`Streamer`).

    Raises:
        StreamingError: tensors missing from the checkpoint, shapes or dtypes that differ,
            a meta buffer with no value in the file; at run time, a block whose read failed.
        fastpersist.errors.CheckpointFormatError, ChecksumError: a malformed (e.g.
            truncated) or corrupt file, found while indexing or reading the resident part.
        OSError: the files cannot be read.
    """
    import dataclasses

    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
        raise ValueError(f"prefetch must be an int >= 1, got {prefetch!r}")
    if streamer_of(model) is not None:
        raise ValueError("this model already streams its weights; streamer_of(model).close() first")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {dev}")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    cfg = dataclasses.replace(config_mod.resolve(config), read_mode="direct")
    if cfg.read_staging == "auto":  # zero-copy into the ring: a staging ring (128 MiB) would cost more than a block
        cfg = dataclasses.replace(cfg, read_staging="off")
    handle = _native.Handle(**cfg.handle_kwargs(read=True))
    tie = getattr(model, "tie_weights", None)
    if callable(tie):  # transformers ties the head to the embeddings here (meta models are built untied)
        tie()
    block_modules = list(blocks) if blocks is not None else find_blocks(model)
    if not block_modules:
        raise ValueError("blocks is empty")
    ckpt = _Checkpoint(checkpoint, cfg.checksum)
    try:
        recreate_meta_buffers(model, lambda name: name in ckpt.where)
        return _setup(model, ckpt, block_modules, prefetch, dev, handle)
    except BaseException:
        ckpt.close()
        raise


def _setup(model: nn.Module, ckpt: _Checkpoint, block_modules: list[nn.Module], prefetch: int,
           dev: torch.device, handle: Any) -> nn.Module:
    owner: dict[int, int] = {}  # id(tensor) -> block index
    for bi, bm in enumerate(block_modules):
        for t in list(bm.parameters(recurse=True)) + list(bm.buffers(recurse=True)):
            owner.setdefault(id(t), bi)
    places = _tensor_places(model)
    blocks = [_Block(i, m) for i, m in enumerate(block_modules)]
    resident: list[tuple[Any, list[tuple[str, nn.Module, str, bool]], CheckpointFile, TensorInfo]] = []
    problems: list[str] = []
    for tid, (t, where) in places.items():
        found = next((ckpt.where[n] for n, *_ in where if n in ckpt.where), None)
        names = [n for n, *_ in where]
        if found is None:
            if t.device.type == "meta":
                what = "buffer" if not where[0][3] else "parameter"
                problems.append(f"{names[0]}: a {what} on the meta device with no entry in the checkpoint"
                                + (" that the model cannot compute (no _init_weights for it, and its module cannot be "
                                   "rebuilt from a config): build the model with accelerate.init_empty_weights(), "
                                   "which keeps buffers real" if what == "buffer" else ""))
            continue
        f, info = found
        bad = _check(names[0], t, info, f.path)
        if bad:
            problems.append(bad)
            continue
        if tid in owner:
            b = blocks[owner[tid]]
            outside = [n for n, m, *_ in where if not any(m is mm for mm in block_modules[b.index].modules())]
            if outside:
                problems.append(f"{names[0]}: streamed with block {b.index} but also used outside it as {outside}")
                continue
            b.tensors.append(_Slot([(m, a, p) for _, m, a, p in where], names[0], f, info, -1,
                                   [m._parameters[a] if p else m._buffers[a] for _, m, a, p in where]))
        else:
            resident.append((t, where, f, info))
    if problems:
        raise StreamingError(f"{ckpt.path} does not fit {type(model).__name__} (nothing was read):\n\t"
                             + "\n\t".join(problems[:20]) + (f"\n\t... and {len(problems) - 20} more" if len(problems) > 20 else ""))
    for b in blocks:
        _layout(b)
    _load_resident(resident, dev, handle)
    # buffers not in the checkpoint (already real) follow the model to its device
    for tid, (t, where) in places.items():
        if tid in owner or t.device.type == "meta" or t.device == dev or any(tid == id(r[0]) for r in resident):
            continue
        moved = t.to(dev)
        param = nn.Parameter(moved, requires_grad=t.requires_grad)
        for _, m, a, p in where:
            if p:
                m._parameters[a] = param
            else:
                m._buffers[a] = moved
    for b in blocks:  # streamed tensors start (and rest) on meta
        for s in b.tensors:
            for k, ((m, a, p), old) in enumerate(zip(s.places, s.meta)):
                if old.device.type != "meta":
                    meta = torch.empty_like(old, device="meta")
                    meta = nn.Parameter(meta, requires_grad=False) if p else meta
                    s.meta[k] = meta
                    if p:
                        m._parameters[a] = meta
                    else:
                        m._buffers[a] = meta
    streamer = Streamer(model, ckpt, blocks, prefetch, dev, handle)
    setattr(model, _ATTR, streamer)
    log.debug("%r", streamer)
    return model


def _layout(b: _Block) -> None:
    """Slot offsets of a block's tensors. Per file: where the block's tensors lie densely in
    the file and 64-byte aligned, the slot mirrors the file's layout modulo 4096, so the
    read of the whole run is one contiguous mapping and its aligned middle lands by
    O_DIRECT straight in the slot (zero-copy); otherwise each tensor at a 4096-aligned
    offset (the engine bounces what is misaligned through its own buffers)."""
    pos = 0
    by_file: dict[int, list[_Slot]] = {}
    for t in b.tensors:
        by_file.setdefault(id(t.file), []).append(t)
    for ts in by_file.values():
        ts.sort(key=lambda t: t.info.file_offset)
        start = ts[0].info.file_offset // _ALIGN * _ALIGN
        end = max(t.info.file_offset + t.info.nbytes for t in ts)
        dense = sum(t.info.nbytes for t in ts)
        overlap = any(y.info.file_offset < x.info.file_offset + x.info.nbytes for x, y in zip(ts, ts[1:]))
        base = -(-pos // _ALIGN) * _ALIGN
        if (not overlap and all(t.info.file_offset % 64 == 0 for t in ts if t.info.nbytes)
                and end - start <= dense + dense // 8 + 2 * _ALIGN):
            for t in ts:
                t.offset = base + t.info.file_offset - start
            pos = base + end - start
        else:
            for t in ts:
                t.offset = -(-pos // _ALIGN) * _ALIGN
                pos = t.offset + t.info.nbytes
    b.nbytes = pos


def _load_resident(resident: list[tuple[Any, list[tuple[str, nn.Module, str, bool]], CheckpointFile, TensorInfo]],
                   dev: torch.device, handle: Any) -> None:
    """Read every resident tensor once (CRC-checked) into fresh host memory, then place it."""
    per_file: dict[int, tuple[CheckpointFile, dict[str, list[Piece]]]] = {}
    fresh: list[torch.Tensor] = []
    for t, where, f, info in resident:
        host = torch.empty(info.shape, dtype=info.dtype)
        fresh.append(host)
        if info.nbytes:
            per_file.setdefault(id(f), (f, {}))[1].setdefault(info.record, []).append(
                Piece(info.byte_offset, info.nbytes, host.data_ptr()))
    for f, wants in per_file.values():
        for pieces in wants.values():
            pieces.sort(key=lambda p: p.start)
            for a, b in zip(pieces, pieces[1:]):
                if b.start < a.start + a.length:
                    raise StreamingError(f"{f.path}: two tensors of the model overlap in one record; "
                                         "save the state dict with tensors of their own")
        f.read(wants, handle)
    with torch.no_grad():
        for (t, where, f, info), host in zip(resident, fresh):
            value = host.to(dev) if dev.type != "cpu" else host
            param = nn.Parameter(value, requires_grad=False)  # one object for every place (tied stays tied)
            for _, m, a, p in where:
                if p:
                    m._parameters[a] = param
                else:
                    m._buffers[a] = value
