"""``load_model`` into a model's own tensors: the safetensors-style surface over
:func:`fastpersist.loadinto.load_state_dict`.

``safetensors.torch.load_model`` reads the whole file into fresh tensors, then
``model.load_state_dict`` copies them into the model: the bytes cross memory twice and
the model's size is allocated a second time. Here, for a ``.safetensors`` file and a
model whose tensors are on the CPU, each tensor's bytes are read from the file straight
into the model's tensor (the native parallel reader; CRC-32s checked where the file has
them), with safetensors' rules kept: the file holds one name of each group of tied
weights, and the model's other names of the group count neither as missing nor, unless
the file has them too, as unexpected; a dtype that differs is converted, as
``Module.load_state_dict`` converts it; missing or unexpected names raise after the
load with ``strict``, listing them.

On a failure after reading started (an I/O error, a checksum that does not match) the
model is partly overwritten and :class:`fastpersist.loadinto.PartialLoadError` says
so (safetensors itself checks no checksum, and a read error in its memory map kills
the process with SIGBUS).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from fastpersist import loadinto
from fastpersist.tiedweights import duplicate_names


def tied_names_result(model: torch.nn.Module, missing_list: list[str], unexpected: list[str],
                      file_names: Any, strict: bool) -> tuple[set[str], list[str]]:
    """safetensors' result of ``load_model`` from a ``Module.load_state_dict(strict=False)``
    result: the model's tied names the file holds under another name of their group are
    not missing; those the file holds too are unexpected.

    Raises:
        RuntimeError: ``strict`` and a name is missing or unexpected (all are listed), or
            tied weights none of whose names covers their storage.
    """
    drop = duplicate_names(model.state_dict(), preferred=file_names)
    missing = set(missing_list)
    unexpected = list(unexpected)
    for names in drop.values():
        for name in names:
            if name in missing:
                missing.remove(name)
            else:
                unexpected.append(name)
    if strict and (missing or unexpected):
        error = f"Error(s) in loading state_dict for {model.__class__.__name__}:"
        if missing:
            error += "\n    Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(missing))
        if unexpected:
            error += "\n    Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(unexpected))
        raise RuntimeError(error)
    return missing, unexpected


def load_into_model(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], strict: bool = True
                    ) -> tuple[set[str], list[str]]:
    """``model.load_state_dict(state_dict)`` as ``safetensors.torch.load_model`` does it
    (the tied-names rule of :func:`tied_names_result`).

    Returns:
        ``(missing, unexpected)``: the model's names the file did not fill (a set, as
        safetensors returns it), the file's names the model did not use (a list).
    """
    missing_list, unexpected = model.load_state_dict(state_dict, strict=False)
    return tied_names_result(model, list(missing_list), list(unexpected), state_dict.keys(), strict)


def _all_on_cpu(model: torch.nn.Module) -> bool:
    return all(t.device.type == "cpu" for t in model.state_dict().values() if isinstance(t, torch.Tensor))


def load_model_in_place(model: torch.nn.Module, filename: Any, strict: bool, device: Any,
                        config: Any = None) -> Optional[tuple[set[str], list[str]]]:
    """``load_model`` of a local ``.safetensors`` file into a CPU model, read in place;
    None when that does not apply (another device, a torch file, a URL: the caller loads
    the file, then copies)."""
    if not isinstance(filename, (str, os.PathLike)) or not os.fsdecode(os.fspath(filename)).endswith(".safetensors"):
        return None
    if torch.device(device).type != "cpu" or not _all_on_cpu(model):
        return None
    result = loadinto.load_state_dict(model, filename, strict=False, cast=True, config=config)
    used = [k for k in model.state_dict() if k not in set(result.missing_keys)]
    return tied_names_result(model, list(result.missing_keys), list(result.unexpected_keys),
                             used + list(result.unexpected_keys), strict)
