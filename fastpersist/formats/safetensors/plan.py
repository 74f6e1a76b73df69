"""Planning a safetensors write: validation as safetensors does it, and the byte layout.

:func:`plan_safetensors` checks its input as ``safetensors.torch.save_file`` does (same
checks, same order, same exception types) and lays the file out for the native writer
without copying any tensor's bytes: the header (padded with spaces so that the data
starts at a multiple of the O_DIRECT alignment), then the tensors back to back in
safetensors' order. With checksums on, every entry gets a placeholder for the CRC-32
of its bytes, which the writer fills in while it streams the data (``PATCH_HEX8``), and
the first entry the CRC-32 of the header's meaning.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional

import torch

from fastpersist.cudastage import DeviceSources
from fastpersist.formats.base import PATCH_HEX8, WritePlan
from fastpersist.formats.safetensors.dtypes import CODE_RANK, DTYPE_CODES, PACKED
from fastpersist.formats.safetensors.errors import (MetaTensorError, SafetensorsInputError, SafetensorsValueError,
                                                    UnsupportedDtypeError)
from fastpersist.formats.safetensors.header import ENTRY_CRC_KEY, ENTRY_HEADER_CRC_KEY, LENGTH, entries_header_crc32
from fastpersist.tiedweights import shared_groups

__all__ = ["DEFAULT_SAFETENSORS_METADATA", "check_metadata", "plan_safetensors", "safetensors_metadata"]


#: ``__metadata__`` of a ``.safetensors`` file fastpersist.save writes when the caller gives none:
#: what transformers' ``save_pretrained`` and Accelerate's ``save`` write (transformers 4.x
#: refuses files whose metadata has no known ``format``; Accelerate warns on files without metadata).
DEFAULT_SAFETENSORS_METADATA = {"format": "pt"}


def safetensors_metadata(metadata: Optional[dict]) -> dict:
    """The ``__metadata__`` :func:`fastpersist.save` writes for ``metadata``: the caller's
    entries, with ``"format": "pt"`` added unless they set ``"format"`` themselves.

    Anything but None or a dict is returned as it is, for the planner to refuse with
    safetensors' error at the point safetensors checks it (after the tensors).
    """
    if metadata is not None and not isinstance(metadata, dict):
        return metadata  # type: ignore[return-value]
    out = dict(DEFAULT_SAFETENSORS_METADATA)
    out.update(metadata or {})
    return out


def _check_inputs(tensors: Any) -> None:
    """safetensors' first checks, in its order: a dict, of tensors, dense."""
    if not isinstance(tensors, dict):
        raise SafetensorsInputError(f"Expected a dict of [str, torch.Tensor] but received {type(tensors)}")
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"Key `{name}` is invalid, expected torch.Tensor but received {type(value)}")
    sparse = [name for name, value in tensors.items() if value.layout != torch.strided]
    if sparse:
        raise ValueError(
            f"You are trying to save a sparse tensors: `{sparse}` which this library does not support."
            " You can make it a dense tensor before saving with `.to_dense()` but be aware this might"
            " make a much larger file than needed."
        )


def _check_names(tensors: dict[Any, torch.Tensor]) -> None:
    """Tensor names: str (safetensors' ``TypeError`` otherwise), never ``__metadata__``."""
    for name in tensors:
        if not isinstance(name, str):
            raise TypeError(f"argument 'tensor_dict': safetensors tensor names must be str, got "
                            f"{type(name).__name__} {name!r}")
        if name == "__metadata__":
            # safetensors writes such a file, and then cannot read it back
            raise ValueError("'__metadata__' is reserved by the safetensors format and cannot name a tensor")


def check_metadata(metadata: Any) -> None:
    """safetensors' rule for ``metadata``: None or a dict of str to str.

    Raises:
        TypeError: anything else (as safetensors raises it).
    """
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise TypeError(f"argument 'metadata': metadata must be a dict of str to str or None, "
                            f"not {type(metadata).__name__}")
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"argument 'metadata': metadata must map str to str; got {key!r}: {value!r}")



def _prepare(name: str, t: torch.Tensor, keep_device: Any = None) -> torch.Tensor:
    """Validate one tensor and return a CPU tensor whose memory holds exactly its bytes
    (a tensor on its own device when ``keep_device(storage)`` says so: a device source)."""
    # safetensors' order: contiguity, then the copy to CPU (torch refuses meta tensors),
    # then its dtype table
    if not t.is_contiguous():
        raise ValueError(
            f"You are trying to save a non contiguous tensor: `{name}`, which safetensors does not allow. "
            "If it is a view of another tensor, save the full tensor and slice it after loading; "
            "otherwise call `.contiguous()` on it before saving."
        )
    if t.device.type == "meta":
        raise MetaTensorError(f"Cannot copy out of meta tensor; no data! (tensor `{name}` is on the meta device "
                              "and has no data to save)")
    if t.dtype not in DTYPE_CODES:
        supported = ", ".join(str(d).replace("torch.", "") for d in DTYPE_CODES)
        raise UnsupportedDtypeError(
            f"Tensor `{name}` has dtype {t.dtype}, which safetensors cannot store (supported: {supported})")
    t = t.detach()
    if t.device.type != "cpu" and not (keep_device is not None and keep_device(t.untyped_storage())):
        t = t.to("cpu")  # staged; the native writer reads host memory
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def _header_shape(code: str, t: torch.Tensor) -> list[int]:
    shape = list(t.shape)
    if code == PACKED:
        if not shape:
            raise SafetensorsValueError("a 0-d float4_e2m1fn_x2 tensor cannot be stored in safetensors "
                                       "(two values per byte)")
        shape[-1] *= 2
    return shape


def plan_safetensors(
    tensors: dict[str, torch.Tensor],
    metadata: Optional[dict[str, str]] = None,
    alignment: int = 4096,
    *,
    checksum: bool = True,
    device_sources: Any = None,
) -> WritePlan:
    """Lay out a safetensors file for the native writer, copying no tensor bytes.

    Validation matches ``safetensors.torch.save_file`` (same checks, same order, same
    exception types): a dict of str to dense, contiguous tensors; tensors that share
    memory are refused (save one of them, or use ``safetensors.torch.save_model``);
    ``metadata`` maps str to str. Non-CPU tensors are copied to CPU first.

    Args:
        tensors: name -> tensor.
        metadata: the file's ``__metadata__``, written exactly as given (``None``: no
            ``__metadata__``, as ``save_file`` does; ``fastpersist.save`` passes
            ``{"format": "pt"}`` by default, see :func:`safetensors_metadata`).
        alignment: the data section starts at a multiple of ``lcm(alignment, 8)``.
        checksum: record a CRC-32 per tensor in its entry (:data:`ENTRY_CRC_KEY`) and
            one of the header in the first entry (:data:`ENTRY_HEADER_CRC_KEY`).
        device_sources: a predicate on storages (e.g.
            :func:`fastpersist.cudastage.is_cuda_storage`): tensors it accepts are not
            copied to CPU but recorded in a :class:`fastpersist.cudastage.DeviceSources`
            (in ``keepalive``); such a plan must be written by
            :func:`fastpersist.cudastage.stream_plan`.

    Returns:
        A :class:`~fastpersist.formats.base.WritePlan` whose crc slots are the
        non-empty tensors in data order (``slot_names``).

    Raises:
        ValueError, TypeError, NotImplementedError, KeyError: invalid input, as
            safetensors raises them (see :class:`SafetensorsInputError`,
            :class:`UnsupportedDtypeError`, :class:`MetaTensorError`).
        RuntimeError: tensors share memory.
    """
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"alignment must be a positive int, not {alignment!r}")
    _check_inputs(tensors)
    shared = shared_groups(tensors)
    if shared:
        raise RuntimeError(
            f"Some tensors share memory, this would duplicate them on disk and they would no longer share after "
            f"loading: {shared}. Save only one of each group (and rebuild the others after loading), or use "
            "`safetensors.torch.save_model`, which drops the duplicates. "
            "More information at https://huggingface.co/docs/safetensors/torch_shared_tensors"
        )

    prepared = {name: _prepare(name, t, device_sources) for name, t in tensors.items()}
    _check_names(tensors)
    check_metadata(metadata)
    sources: Any = None
    if device_sources is not None:
        sources = DeviceSources()
    order = sorted(prepared, key=lambda n: (CODE_RANK[DTYPE_CODES[prepared[n].dtype]], n))

    entries: dict[str, Any] = {}
    layout: list[tuple[str, torch.Tensor, int, int]] = []  # name, tensor, begin, nbytes
    offset = 0
    for name in order:
        t = prepared[name]
        code = DTYPE_CODES[t.dtype]
        nbytes = t.numel() * t.element_size()
        entries[name] = {"dtype": code, "shape": _header_shape(code, t), "data_offsets": [offset, offset + nbytes]}
        layout.append((name, t, offset, nbytes))
        offset += nbytes
    data_size = offset

    # The JSON, member by member, so that the byte position of each CRC placeholder is known.
    def dumps(value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")

    members: list[bytes] = []
    if metadata is not None:
        members.append(b'"__metadata__":' + dumps(dict(metadata)))
    header_crc = b""
    if checksum and entries:
        crc = entries_header_crc32({n: (e["dtype"], e["shape"], e["data_offsets"]) for n, e in entries.items()},
                                   None if metadata is None else dict(metadata))
        header_crc = dumps(ENTRY_HEADER_CRC_KEY) + b':"' + f"{crc:08x}".encode() + b'"'
    crc_at: dict[str, int] = {}  # name -> offset of its 8 placeholder digits in the JSON text
    position = 1  # after "{"
    for index, name in enumerate(order):
        member = dumps(name) + b":" + dumps(entries[name])[:-1]  # without the closing "}"
        if checksum:
            member += b"," + dumps(ENTRY_CRC_KEY) + b':"'
            crc_at[name] = position + sum(len(m) + 1 for m in members) + len(member)
            member += b'00000000"'
            if index == 0:
                member += b"," + header_crc
        members.append(member + b"}")
    text = b"{" + b",".join(members) + b"}"

    unit = alignment * 8 // math.gcd(alignment, 8)
    data_start = -(-(LENGTH.size + len(text)) // unit) * unit
    header_len = data_start - LENGTH.size
    header = bytearray(LENGTH.pack(header_len) + text + b" " * (header_len - len(text)))
    header_t = torch.frombuffer(header, dtype=torch.uint8)

    extents: list[tuple[int, int, int, int]] = [(0, header_t.data_ptr(), data_start, -1)]
    patches: list[tuple[int, int, int]] = []
    slot_names: list[str] = []
    for name, t, begin, nbytes in layout:
        if nbytes == 0:
            continue  # its CRC is 0: the placeholder already says 00000000
        slot = len(slot_names) if checksum else -1
        ptr = t.data_ptr()
        if sources is not None and device_sources(t.untyped_storage()):
            ptr = sources.add(t.reshape(-1).view(torch.uint8))
        extents.append((data_start + begin, ptr, nbytes, slot))
        if checksum:
            patches.append((LENGTH.size + crc_at[name], slot, PATCH_HEX8))
            slot_names.append(name)

    return WritePlan(
        extents=extents,
        patches=patches,
        nslots=len(slot_names),
        file_size=data_start + data_size,
        keepalive=[header, header_t, prepared] + ([sources] if sources is not None and len(sources) else []),
        slot_names=slot_names,
    )
