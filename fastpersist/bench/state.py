"""Realistic training states to checkpoint: a GPT-style model with mixed-precision Adam.

:func:`build_training_state` makes what a Megatron/DeepSpeed-style trainer
saves: bf16 model weights, fp32 master weights, fp32 Adam moments (``exp_avg``,
``exp_avg_sq``) and per-parameter ``step`` counters, the optimizer's param
groups, a scheduler dict, RNG states and counters: hundreds of tensors of very
different sizes plus plain Python objects. :func:`build_small_tensors` makes the
opposite extreme: many small tensors. Both are deterministic for a seed.

Every object here loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import math
import random
import zlib
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Optional

import torch

#: Bytes per parameter: bf16 weight + fp32 master + fp32 exp_avg + fp32 exp_avg_sq.
BYTES_PER_PARAM = 2 + 4 + 4 + 4
_HIDDEN_LADDER = (64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192)
_MAX_VOCAB = 50304


@dataclass(frozen=True)
class GPTShape:
    """Dimensions of the GPT-style model (pre-LayerNorm blocks, 4x MLP, learned positions)."""

    hidden: int
    layers: int
    vocab: int
    positions: int

    @property
    def params(self) -> int:
        """Number of parameters."""
        h = self.hidden
        per_layer = 12 * h * h + 13 * h  # qkv 3h^2+3h, proj h^2+h, fc1 4h^2+4h, fc2 4h^2+h, 2 LayerNorms 4h
        return self.vocab * h + self.positions * h + self.layers * per_layer + 2 * h

    def to_dict(self) -> dict[str, int]:
        """JSON-serializable form (with the parameter count)."""
        d = asdict(self)
        d["params"] = self.params
        return d


def gpt_shape_for_bytes(total_bytes: int) -> GPTShape:
    """Pick a GPT shape whose checkpoint (:data:`BYTES_PER_PARAM` per parameter) is about ``total_bytes``.

    The widest hidden size that still gives at least 8 layers wins; the
    embedding takes roughly a fifth of the parameters, up to GPT-2's vocabulary.
    """
    if total_bytes <= 0:
        raise ValueError(f"checkpoint size must be positive, got {total_bytes}")
    target = max(total_bytes // BYTES_PER_PARAM, 1)
    best = None
    for h in _HIDDEN_LADDER:
        vocab = min(_MAX_VOCAB, max(64, int(0.2 * target / h) // 64 * 64))
        positions = min(2048, max(64, vocab // 8 // 64 * 64))
        per_layer = 12 * h * h + 13 * h
        rest = target - (vocab + positions + 2) * h
        layers = max(1, round(rest / per_layer)) if rest > 0 else 1
        shape = GPTShape(hidden=h, layers=layers, vocab=vocab, positions=positions)
        if best is None or layers >= 8:
            best = shape
        if layers < 8:
            break
    assert best is not None
    return best


def _param_specs(shape: GPTShape) -> list[tuple[str, tuple[int, ...]]]:
    h, specs = shape.hidden, []
    specs.append(("embed.tokens.weight", (shape.vocab, h)))
    specs.append(("embed.positions.weight", (shape.positions, h)))
    for i in range(shape.layers):
        p = f"layers.{i}."
        specs += [
            (p + "ln1.weight", (h,)),
            (p + "ln1.bias", (h,)),
            (p + "attn.qkv.weight", (3 * h, h)),
            (p + "attn.qkv.bias", (3 * h,)),
            (p + "attn.proj.weight", (h, h)),
            (p + "attn.proj.bias", (h,)),
            (p + "ln2.weight", (h,)),
            (p + "ln2.bias", (h,)),
            (p + "mlp.fc1.weight", (4 * h, h)),
            (p + "mlp.fc1.bias", (4 * h,)),
            (p + "mlp.fc2.weight", (h, 4 * h)),
            (p + "mlp.fc2.bias", (h,)),
        ]
    specs += [("final_ln.weight", (h,)), ("final_ln.bias", (h,))]
    return specs


def build_training_state(total_bytes: int, seed: int = 0, step: int = 1000) -> dict[str, Any]:
    """A GPT training checkpoint of about ``total_bytes`` tensor bytes (see module docstring).

    Layout::

        {"model": OrderedDict[name -> bf16],
         "master_weights": OrderedDict[name -> fp32],
         "optimizer": {"state": {i: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]},
         "lr_scheduler": {...}, "rng_state": {"python", "torch"},
         "iteration", "epoch", "consumed_samples", "args"}
    """
    shape = gpt_shape_for_bytes(total_bytes)
    gen = torch.Generator().manual_seed(seed)
    model: OrderedDict[str, torch.Tensor] = OrderedDict()
    master: OrderedDict[str, torch.Tensor] = OrderedDict()
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    decay, no_decay = [], []
    for index, (name, dims) in enumerate(_param_specs(shape)):
        fp32 = torch.empty(dims, dtype=torch.float32).uniform_(-0.05, 0.05, generator=gen)
        master[name] = fp32
        model[name] = fp32.to(torch.bfloat16)
        opt_state[index] = {
            "step": torch.tensor(float(step)),
            "exp_avg": torch.empty(dims, dtype=torch.float32).uniform_(-1e-3, 1e-3, generator=gen),
            "exp_avg_sq": torch.empty(dims, dtype=torch.float32).uniform_(0.0, 1e-6, generator=gen),
        }
        (no_decay if len(dims) == 1 else decay).append(index)
    lr = 3e-4 * min(1.0, step / 100) * 0.5 * (1 + math.cos(math.pi * step / 100000))
    groups = [
        {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": wd, "amsgrad": False,
         "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
         "fused": None, "initial_lr": 3e-4, "params": params}
        for wd, params in ((0.1, decay), (0.0, no_decay))
    ]
    rng = random.Random(seed)
    return {
        "model": model,
        "master_weights": master,
        "optimizer": {"state": opt_state, "param_groups": groups},
        "lr_scheduler": {
            "base_lrs": [3e-4, 3e-4], "last_epoch": step, "_step_count": step + 1,
            "_get_lr_called_within_step": False, "_last_lr": [lr, lr], "warmup_steps": 100,
            "total_steps": 100000,
        },
        "rng_state": {"python": rng.getstate(), "torch": gen.get_state()},
        "iteration": step,
        "epoch": 3,
        "consumed_samples": step * 512,
        "args": {"hidden_size": shape.hidden, "num_layers": shape.layers, "vocab_size": shape.vocab,
                 "max_position_embeddings": shape.positions, "precision": "bf16-mixed", "seed": seed},
    }


def build_small_tensors(
    count: int, seed: int = 0, min_bytes: int = 1024, max_bytes: int = 1 << 20
) -> dict[str, torch.Tensor]:
    """``count`` tensors of log-uniform random sizes in ``[min_bytes, max_bytes]`` (fp32/bf16/int64 mix)."""
    if count <= 0:
        raise ValueError(f"number of small tensors must be positive, got {count}")
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dtypes = (torch.float32, torch.bfloat16, torch.float32, torch.int64)
    out: dict[str, torch.Tensor] = {}
    lo, hi = math.log(min_bytes), math.log(max_bytes)
    for i in range(count):
        dtype = dtypes[i % len(dtypes)]
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = max(1, int(math.exp(rng.uniform(lo, hi))) // itemsize)
        if dtype.is_floating_point:
            t = torch.empty(numel, dtype=dtype).uniform_(-1, 1, generator=gen)
        else:
            t = torch.randint(-(2**40), 2**40, (numel,), dtype=dtype, generator=gen)
        out[f"tensor_{i:06d}"] = t
    return out


def iter_tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(dotted.key, tensor)`` for every tensor in nested dicts/lists/tuples."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from iter_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from iter_tensors(value, f"{prefix}.{i}" if prefix else str(i))


def tensor_bytes(obj: Any) -> int:
    """Total bytes of tensor data in ``obj`` (what a checkpoint has to move)."""
    return sum(t.numel() * t.element_size() for _, t in iter_tensors(obj))


def count_tensors(obj: Any) -> int:
    """Number of tensors in ``obj``."""
    return sum(1 for _ in iter_tensors(obj))


def flatten_tensors(obj: Any) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Flatten ``obj`` to ``{dotted.key: tensor}`` (for safetensors) and list the non-tensor leaves skipped.

    Dicts and lists are walked; any other leaf that is not a tensor (ints,
    floats, strings, tuples of numbers such as the Python RNG state) is
    skipped, and its dotted key returned in the second list.
    """
    flat: dict[str, torch.Tensor] = {}
    skipped: list[str] = []

    def walk(value: Any, key: str) -> None:
        if isinstance(value, torch.Tensor):
            flat[key] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(value, list) and any(isinstance(v, (torch.Tensor, dict, list)) for v in value):
            for i, v in enumerate(value):
                walk(v, f"{key}.{i}" if key else str(i))
        else:
            skipped.append(key)

    walk(obj, "")
    return flat, skipped


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Same structure as ``obj`` (dicts, ``OrderedDict``, lists, tuples), every tensor replaced by ``fn(tensor)``;
    other leaves are kept as they are."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, OrderedDict):
        return OrderedDict((k, map_tensors(v, fn)) for k, v in obj.items())
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(map_tensors(v, fn) for v in obj)
    return obj


def empty_like_state(obj: Any, device: Optional[str] = None) -> Any:
    """Same structure as ``obj``, every tensor replaced by an uninitialized tensor of its shape and dtype.

    Loaders that fill a given state in place (``torch.distributed.checkpoint``)
    need it; non-tensor leaves are kept as they are (the loader replaces them).
    ``device``: where the new tensors live (default: each tensor's own device;
    ``"cpu"`` materializes a :func:`skeleton`'s meta tensors).
    """
    if device is None:
        return map_tensors(obj, torch.empty_like)
    return map_tensors(obj, lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def zeros_like_state(obj: Any) -> Any:
    """:func:`empty_like_state` on the CPU, every tensor zero-filled: resident, as a live
    model's and optimizer's tensors are (the target of a load into an existing state)."""
    state = empty_like_state(obj, device="cpu")
    for _, t in iter_tensors(state):
        t.zero_()
    return state


def skeleton(obj: Any) -> Any:
    """``obj`` with every tensor replaced by a ``meta`` tensor of its shape and dtype (no data):
    the structure another process needs to build a state of the same shapes. Loads with
    ``torch.load(weights_only=True)`` when ``obj`` does."""
    return map_tensors(obj, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"))


@dataclass(frozen=True)
class TensorDigest:
    """What :func:`fingerprint` keeps of a tensor: dtype, shape, byte count and the CRC-32 of its bytes."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    crc32: int


def tensor_digest(t: torch.Tensor) -> TensorDigest:
    """The :class:`TensorDigest` of ``t`` (its bytes in row-major order, wherever it lives)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return TensorDigest(dtype=str(t.dtype).replace("torch.", ""), shape=tuple(t.shape),
                        nbytes=flat.numel(), crc32=zlib.crc32(memoryview(flat.numpy())))


def fingerprint(obj: Any) -> Any:
    """``obj`` with every tensor replaced by its :class:`TensorDigest`: small, picklable, and
    :func:`compare_states` of two fingerprints finds what it would find between the states
    (a byte difference in a tensor, a dtype or shape, a key, a non-tensor leaf)."""
    return map_tensors(obj, tensor_digest)


def compare_states(expected: Any, actual: Any, path: str = "", limit: int = 20) -> list[str]:
    """Differences between two nested states; ``[]`` when equal.

    Tensors must match in dtype, shape and every element (``torch.equal``);
    :class:`TensorDigest` leaves (:func:`fingerprint`) in dtype, shape and bytes;
    containers in type, keys and length; other leaves with ``==``. At most
    ``limit`` differences are listed.
    """
    problems: list[str] = []

    def add(msg: str) -> None:
        if len(problems) < limit:
            problems.append(msg)

    def walk(a: Any, b: Any, key: str) -> None:
        where = key or "<root>"
        if isinstance(a, TensorDigest):
            if not isinstance(b, TensorDigest):
                add(f"{where}: expected a tensor, got {type(b).__name__}")
            elif a.dtype != b.dtype or a.shape != b.shape:
                add(f"{where}: expected {a.dtype}{list(a.shape)}, got {b.dtype}{list(b.shape)}")
            elif a != b:
                add(f"{where}: tensor values differ (CRC-32 {a.crc32:08x}, got {b.crc32:08x})")
        elif isinstance(a, torch.Tensor):
            if not isinstance(b, torch.Tensor):
                add(f"{where}: expected a tensor, got {type(b).__name__}")
            elif a.dtype != b.dtype or a.shape != b.shape:
                add(f"{where}: expected {a.dtype}{list(a.shape)}, got {b.dtype}{list(b.shape)}")
            elif not torch.equal(a, b.to(a.device)):
                add(f"{where}: tensor values differ")
        elif isinstance(a, dict):
            if not isinstance(b, dict):
                add(f"{where}: expected a dict, got {type(b).__name__}")
                return
            if set(a) != set(b):
                add(f"{where}: keys differ: missing {sorted(map(str, set(a) - set(b)))[:5]}, "
                    f"extra {sorted(map(str, set(b) - set(a)))[:5]}")
            elif list(a) != list(b):
                add(f"{where}: same keys in a different order")
            for k in a:
                if k in b:
                    walk(a[k], b[k], f"{key}.{k}" if key else str(k))
        elif isinstance(a, (list, tuple)):
            if type(a) is not type(b) or len(a) != len(b):
                add(f"{where}: expected {type(a).__name__} of {len(a)}, got {type(b).__name__} "
                    f"of {len(b) if hasattr(b, '__len__') else '?'}")
                return
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{key}.{i}" if key else str(i))
        elif a != b:
            add(f"{where}: expected {a!r:.80}, got {b!r:.80}")

    walk(expected, actual, path)
    return problems


def touch_pages(obj: Any, page: int = 4096) -> int:
    """Read one byte of every ``page`` bytes of every tensor storage in ``obj`` (each
    storage once), so lazily mapped tensors (``mmap``) have their bytes in memory.
    Returns the number of bytes of storage touched."""
    seen: set[int] = set()
    total = 0
    for _, t in iter_tensors(obj):
        if t.device.type != "cpu" or t.layout != torch.strided:
            continue
        storage = t.untyped_storage()
        ptr, n = storage.data_ptr(), storage.nbytes()
        if n == 0 or ptr in seen:
            continue
        seen.add(ptr)
        raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (n,), (1,))
        int(raw[::page].sum())  # one byte per page; the sum keeps the reads from being skipped
        total += n
    return total


def copy_into(state: Any, loaded: Any) -> None:
    """``copy_`` every tensor of ``loaded`` into the tensor at the same place in ``state``
    (what ``Module.load_state_dict`` does with each parameter); non-tensors are left."""
    if isinstance(state, torch.Tensor):
        with torch.no_grad():
            state.copy_(loaded)
    elif isinstance(state, dict):
        for k, v in state.items():
            copy_into(v, loaded[k])
    elif isinstance(state, (list, tuple)):
        for a, b in zip(state, loaded):
            copy_into(a, b)
