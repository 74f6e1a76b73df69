"""Loading a safetensors file: one descriptor, native reads, CRC-32s checked as the bytes arrive.

:func:`load_safetensors` opens the file once and reads its header and its bytes through
that descriptor (a save that renames a new file over the path meanwhile cannot pair
one file's header with another's bytes). CPU loads read the whole file into one
page-aligned buffer, each tensor a storage of its own over its bytes there; CUDA loads
stream every tensor through the page-locked ring of :mod:`fastpersist.cudaload`
straight into device memory.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Protocol, Sequence, Union

import torch

from fastpersist import _native
from fastpersist.cudaload import RingItem, ring_read
from fastpersist.formats.safetensors import header as hdr
from fastpersist.formats.safetensors.crc import checksum_error, crc_problems, data_extents
from fastpersist.formats.safetensors.errors import SafetensorsFormatError
from fastpersist.formats.safetensors.header import SafetensorsHeader
from fastpersist.io import pinned_empty
from fastpersist.prefault import choose_pages
from fastpersist.readpolicy import borrow_reader, depth_auto, give_back_reader, plan_read, staging_auto

__all__ = ["Reader", "load_safetensors", "read_fd"]


class Reader(Protocol):
    """What a load or a verify reads with: a ``fastpersist._native.Handle``, or anything with its ``read``."""

    def read(self, target: Union[str, int], extents: Sequence[tuple[int, int, int, int]], nslots: int = 0) -> list[int]:
        ...


def _host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """A page-aligned uint8 tensor of at least ``nbytes`` (rounded up to 4096) bytes."""
    size = max(4096, -(-nbytes // 4096) * 4096)
    if pinned:
        return pinned_empty(size)

    # the page size fresh load buffers get here (fastpersist.prefault.huge_pages), set before the first touch
    return torch.frombuffer(choose_pages(_native.PinnedBuffer(size, 4096, lock=False)), dtype=torch.uint8)


def load_safetensors(
    path: Union[str, os.PathLike],
    handle: Reader,
    device: Union[str, int, torch.device] = "cpu",
    *,
    checksum: bool = True,
) -> dict[str, torch.Tensor]:
    """Load every tensor of a safetensors file, like ``safetensors.torch.load_file``.

    The file is read with one native read into one page-aligned host buffer; on CPU
    each returned tensor is a separate storage over its bytes in that buffer (the
    buffer lives as long as any of them). CUDA devices: the tensors' bytes go through
    the bounded page-locked ring of :mod:`fastpersist.cudaload` straight into device
    memory (:func:`_load_via_ring`). Other devices get copies (``.to(device)``).

    Args:
        path: the file.
        handle: a ``fastpersist._native.Handle`` (or anything with its ``read``).
        device: where the tensors go.
        checksum: if the file carries fastpersist CRC-32s, check them while reading.

    Raises:
        SafetensorsFormatError: the file is not valid safetensors (names the path).
        ChecksumError: a tensor's bytes do not match the CRC-32 recorded at save time.
        OSError, EOFError: reading failed.
    """
    path = os.fspath(path)
    # One descriptor for the header and the data: a save that renames a new file over
    # ``path`` meanwhile cannot pair this header with another file's bytes.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        header = hdr.read_header_fd(fd, path)
        device = torch.device(device) if not isinstance(device, torch.device) else device
        if device.type == "cuda" and hasattr(handle, "read_async"):
            return _load_via_ring(path, header, handle, device, checksum=checksum, fd=fd)
        base = _host_buffer(header.file_size, pinned=device.type != "cpu")
        base_ptr = base.data_ptr()

        check = checksum and header.crcs is not None
        extents, slots = data_extents(header, lambda off: base_ptr + off)
        reader, plan = _plan_reader(fd, header.file_size, handle)
        if check:
            read_extents = [(0, base_ptr, header.data_start, -1)] + extents
            crcs = read_fd(reader, fd, path, read_extents, len(slots))
            problems = crc_problems(header, slots, crcs)
            if problems:
                raise checksum_error(path, problems)
        else:
            read_fd(reader, fd, path, [(0, base_ptr, header.file_size, -1)], 0)
        if reader is not handle:
            give_back_reader(reader)
    finally:
        os.close(fd)

    try:
        return _tensors(header, base, device)
    except (RuntimeError, TypeError, ValueError, OverflowError) as exc:
        raise SafetensorsFormatError(f"{path}: cannot make tensors of the header's dtypes and shapes ({exc})", path) from exc


def read_fd(reader: Any, fd: int, path: str, extents: Sequence[tuple[int, int, int, int]], nslots: int) -> list[int]:
    """``reader.read`` through the load's descriptor ``fd``; errors name ``path`` (the
    native engine would name the descriptor's target, possibly ``... (deleted)``)."""
    try:
        return reader.read(fd, extents, nslots)
    except (EOFError, OSError) as e:
        raise _naming(e, path) from e


def _naming(e: BaseException, path: str) -> BaseException:
    """A read error through a descriptor of ``path``, naming ``path``."""
    if isinstance(e, EOFError):
        return EOFError(f"{path}: the file is shorter than its header says (truncated, or rewritten in place "
                        f"while loading): {e}")
    if isinstance(e, OSError) and e.errno is not None and e.filename != path:
        return type(e)(e.errno, e.strerror or str(e), path)
    return e



def _load_via_ring(path: str, header: SafetensorsHeader, handle: Any, device: torch.device, *,
                   checksum: bool, fd: Optional[int] = None) -> dict[str, torch.Tensor]:
    """Every tensor read through :func:`fastpersist.cudaload.ring_read` into its own
    ``device`` tensor (CRC-32s checked from the host windows when the file has them),
    no host copy of the file. Used for CUDA devices; works for any device (docs/gpu.md).

    ``fd``: the descriptor ``header`` was read through (:func:`load_safetensors`), so
    the data comes from the same file even if ``path`` is replaced meanwhile; None:
    ``path`` is opened here (callers that read ``header`` themselves)."""
    check = checksum and header.crcs is not None
    entries = sorted((e for e in header.tensors if e.nbytes), key=lambda e: e.begin)
    items = [RingItem(header.data_start + e.begin, header.data_start + e.begin, e.nbytes,
                      torch.empty(e.nbytes, dtype=torch.uint8, device=device)) for e in entries]
    own = fd is None
    rfd = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if fd is None else fd
    try:
        ring_read(rfd, handle, items, checksum=check)
    except (EOFError, OSError) as e:
        raise _naming(e, path) from e
    finally:
        if own:
            os.close(rfd)
    if check:
        by_name = {e.name: it.crc for e, it in zip(entries, items)}
        _extents, slots = data_extents(header, lambda off: 0)
        problems = crc_problems(header, slots, [by_name[e.name] for e in slots])
        if problems:
            raise checksum_error(path, problems)
    raw = {e.name: it.dest for e, it in zip(entries, items)}
    out: dict[str, torch.Tensor] = {}
    try:
        for e in header.tensors:
            if e.nbytes == 0:
                out[e.name] = torch.empty(e.torch_shape, dtype=e.torch_dtype, device=device)
            else:
                out[e.name] = raw[e.name].view(e.torch_dtype).view(e.torch_shape)
    except (RuntimeError, TypeError, ValueError, OverflowError) as exc:
        raise SafetensorsFormatError(f"{path}: cannot make tensors of the header's dtypes and shapes ({exc})", path) from exc
    return out


def _plan_reader(fd: int, nbytes: int, handle: Any) -> tuple[Any, Any]:
    """The handle a load of the file open as ``fd`` reads with (``handle`` itself, or a
    pooled one reading the way :func:`fastpersist.readpolicy.plan_read` chose) and the plan
    (None: ``handle`` as it is)."""
    mode = getattr(handle, "read_mode", None)
    if mode is None or not hasattr(handle, "stage_reads"):
        return handle, None  # a stand-in reader (tests): read with it as it is
    plan = plan_read(fd, nbytes, read_mode=mode, direct=handle.direct, stage=handle.stage_reads,
                     stage_auto=staging_auto(handle), depth_auto=depth_auto(handle))
    if plan.fits(handle):
        return handle, plan
    return borrow_reader(handle, plan), plan


def _tensors(header: SafetensorsHeader, base: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    buffer = base.numpy()
    for entry in header.tensors:
        dtype = entry.torch_dtype
        start = header.data_start + entry.begin
        if entry.nbytes == 0:
            tensor = torch.empty(entry.torch_shape, dtype=dtype)
        elif device.type == "cpu" and start % dtype.itemsize == 0:
            # its own storage over its bytes: saving one loaded tensor saves only its bytes
            tensor = torch.frombuffer(buffer, dtype=dtype, count=entry.nbytes // dtype.itemsize, offset=start)
        else:
            raw = base[start : start + entry.nbytes]
            if start % dtype.itemsize:
                raw = raw.clone()  # misaligned for its dtype (possible in files from other writers)
            tensor = raw.view(dtype)
        tensor = tensor.view(entry.torch_shape)
        out[entry.name] = tensor if device.type == "cpu" else tensor.to(device)
    return out
