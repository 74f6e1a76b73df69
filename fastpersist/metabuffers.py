"""Values for a model's ``meta`` buffers that no checkpoint holds.

A model built under ``with torch.device("meta")`` has every tensor on ``meta``,
non-persistent buffers included (a LLaMA's rotary ``inv_freq``). Those buffers are not
in any ``state_dict`` file: the model computes them from its configuration when it is
built on a real device. :func:`recreate_meta_buffers` computes them again, in the two
ways a model can:

1. **The model's own initialiser**: a ``transformers`` model's ``_init_weights(module)``
   (transformers 5 computes rotary buffers there from the module's config). Used only
   for a module whose other tensors are all on ``meta`` (or absent), so it can
   overwrite nothing real; the buffer is filled with NaN first and taken only when the
   initialiser wrote every element (floating-point buffers).
2. **The module rebuilt from its config**: a module with no parameters at all and a
   ``config`` attribute (the rotary modules of transformers 4.x) is built again on the
   CPU as ``type(module)(module.config)``, and its buffers of the same names, shapes and
   dtypes are taken.

A buffer neither way produces stays on ``meta``, and its name is returned, so that
the caller can say which call to use instead (``accelerate.init_empty_weights()``,
which keeps buffers on the CPU while parameters go to ``meta``).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

log = logging.getLogger(__name__)


class _MetaBuffer:
    """One meta buffer object and every (module, attribute, full name) that holds it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.places: list[tuple[nn.Module, str, str]] = []

    @property
    def names(self) -> list[str]:
        return [name for _, _, name in self.places]

    def put(self, value: torch.Tensor) -> None:
        for module, attr, _ in self.places:
            module._buffers[attr] = value


def _missing_meta_buffers(model: nn.Module, in_checkpoint: Callable[[str], bool]) -> list[_MetaBuffer]:
    found: dict[int, _MetaBuffer] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        prefix = mname + "." if mname else ""
        for attr, buf in module._buffers.items():
            if buf is None or buf.device.type != "meta":
                continue
            found.setdefault(id(buf), _MetaBuffer(buf)).places.append((module, attr, prefix + attr))
    return [b for b in found.values() if not any(in_checkpoint(n) for n in b.names)]


def _owns_only_meta(module: nn.Module) -> bool:
    """True when every tensor the module itself holds (not its children's) is on meta."""
    own = list(module._parameters.values()) + list(module._buffers.values())
    return all(t is None or t.device.type == "meta" for t in own)


def _by_initialiser(model: nn.Module, module: nn.Module, bufs: list[_MetaBuffer]) -> list[_MetaBuffer]:
    """Way 1: ``model._init_weights(module)`` over NaN-filled placeholders. Returns the
    buffers it did not fill (they are put back on meta)."""
    init = getattr(model, "_init_weights", None)
    floating = [b for b in bufs if b.tensor.is_floating_point()]
    if not callable(init) or not floating or not _owns_only_meta(module):
        return bufs
    holders = {id(b): torch.full(b.tensor.shape, float("nan"), dtype=b.tensor.dtype) for b in floating}
    for b in floating:
        b.put(holders[id(b)])
    try:
        with torch.no_grad():
            init(module)
    except Exception as e:  # a model's initialiser that cannot run on this module: the next way, or the error
        log.debug("%s._init_weights(%s) failed: %r", type(model).__name__, type(module).__name__, e)
        for b in floating:
            b.put(b.tensor)
        return bufs
    left = [b for b in bufs if b not in floating]
    for b in floating:
        now = b.places[0][0]._buffers.get(b.places[0][1])
        value = now if now is not None and now.device.type == "cpu" else holders[id(b)]
        if value.shape == b.tensor.shape and value.dtype == b.tensor.dtype and not torch.isnan(value).any():
            b.put(value)
        else:
            b.put(b.tensor)
            left.append(b)
    return left


def _by_rebuild(module: nn.Module, bufs: list[_MetaBuffer]) -> list[_MetaBuffer]:
    """Way 2: a parameter-free module with a ``config`` built again on the CPU."""
    cfg = getattr(module, "config", None)
    if cfg is None or any(True for _ in module.parameters()):
        return bufs
    try:
        with torch.device("cpu"):
            fresh = type(module)(cfg)
    except Exception as e:  # its constructor takes more than the config
        log.debug("rebuilding %s from its config failed: %r", type(module).__name__, e)
        return bufs
    left = []
    for b in bufs:
        value = fresh._buffers.get(b.places[0][1])
        if (value is not None and value.device.type == "cpu" and value.shape == b.tensor.shape
                and value.dtype == b.tensor.dtype):
            b.put(value)
        else:
            left.append(b)
    return left


def recreate_meta_buffers(model: nn.Module, in_checkpoint: Callable[[str], bool]) -> list[str]:
    """Give CPU values to the meta buffers of ``model`` that the checkpoint does not hold
    (``in_checkpoint(name)`` is False for all their ``state_dict`` names), where the model
    can compute them (see the module's docstring for the two ways).

    Args:
        model: the model, typically built under ``with torch.device("meta")``.
        in_checkpoint: whether a full buffer name (``"model.rotary_emb.inv_freq"``) has a
            value in the checkpoint.

    Returns:
        The names of the meta buffers still without a value (empty when all were made).
    """
    groups: dict[int, tuple[nn.Module, list[_MetaBuffer]]] = {}
    for b in _missing_meta_buffers(model, in_checkpoint):
        owner = b.places[0][0]
        groups.setdefault(id(owner), (owner, []))[1].append(b)
    left: list[str] = []
    for module, bufs in groups.values():
        rest = _by_rebuild(module, _by_initialiser(model, module, bufs))
        made = [n for b in bufs if b not in rest for n in b.names]
        if made:
            log.debug("computed %s for a model built on meta", made)
        left.extend(n for b in rest for n in b.names)
    return left
