"""Tensors that share memory: a model's tied weights.

A ``state_dict`` of a model with tied weights holds one tensor under several names.
safetensors refuses to save such a dict (:func:`shared_groups` finds them for the
planner's refusal), and its ``save_model``/``load_model`` keep one name per group
(:func:`duplicate_names`, used by :func:`fastpersist.load_model`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["covers_storage", "duplicate_names", "shared_groups"]


def shared_groups(tensors: dict[str, torch.Tensor]) -> list[list[str]]:
    """Groups of >= 2 names whose bytes overlap in the same storage."""
    by_storage: dict[tuple[Any, int], list[tuple[int, int, str]]] = {}
    for name, t in tensors.items():
        if t.device.type == "meta":
            continue
        nbytes = t.numel() * t.element_size()
        storage = t.untyped_storage()
        if nbytes == 0 or storage.data_ptr() == 0:
            continue
        by_storage.setdefault((t.device, storage.data_ptr()), []).append((t.data_ptr(), t.data_ptr() + nbytes, name))
    groups: list[list[str]] = []
    for spans in by_storage.values():
        spans.sort()
        current: list[str] = []
        stop = -1
        for begin, end, name in spans:
            if current and begin < stop:
                current.append(name)
            else:
                if len(current) > 1:
                    groups.append(sorted(current))
                current = [name]
            stop = max(stop, end)
        if len(current) > 1:
            groups.append(sorted(current))
    return groups


def covers_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is its storage's whole extent (the one name of a shared group that can stand for it)."""
    return t.data_ptr() == t.untyped_storage().data_ptr() and \
        t.numel() * t.element_size() == t.untyped_storage().nbytes()


def duplicate_names(state_dict: dict[str, torch.Tensor], preferred: Any = ()) -> dict[str, list[str]]:
    """For every group of names sharing bytes in ``state_dict`` (a model's tied weights),
    the name kept and the others, as ``safetensors.torch.save_model``/``load_model``
    choose them: among the names covering the whole storage, the first in sorted order
    of those in ``preferred`` (the names a file holds), else the first of all.

    Raises:
        RuntimeError: no name of a group covers its whole storage (safetensors' refusal).
    """
    preferred = set(preferred)
    out: dict[str, list[str]] = {}
    for group in shared_groups(state_dict):
        complete = sorted(n for n in group if covers_storage(state_dict[n]))
        if not complete:
            raise RuntimeError(
                f"tensors {group} share memory and none of them covers the whole storage: no name can stand for "
                "the others (safetensors refuses such a model too; see "
                "https://huggingface.co/docs/safetensors/torch_shared_tensors)")
        keep = next((n for n in complete if n in preferred), complete[0])
        out[keep] = [n for n in group if n != keep]
    return out
