"""Lazy and partial loads: :func:`open` a checkpoint, list its tensors from the index,
read only the ones asked for (like ``safetensors.safe_open``, for both formats)::

    with fastpersist.open("ckpt.pt") as f:
        for name in f.keys():                # "state_dict.fc.weight", ... (no payload read)
            print(name, f.info(name).shape)
        w = f.get("state_dict.fc.weight")   # reads that tensor's record only
        layer = f.get_many([n for n in f.keys() if n.startswith("state_dict.layers.3.")])

Names are the dotted paths of the tensors in the saved object (see
:mod:`fastpersist.formats.torchindex`); a ``.safetensors`` file's names are its own.
The reader holds one file descriptor until :meth:`CheckpointReader.close` (or the
end of the ``with`` block): a save renaming a new file over the path meanwhile does
not change what it reads.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Iterator, Optional, Union

import torch

from fastpersist import config as config_mod
from fastpersist import handles, pending
from fastpersist._inputs import check_input
from fastpersist.formats.torchindex import CheckpointFile, TensorInfo, open_checkpoint

__all__ = ["CheckpointReader", "open"]

PathLike = Union[str, "os.PathLike[str]"]


class CheckpointReader:
    """An open checkpoint; see :func:`open`. Usable as a context manager."""

    def __init__(self, file: CheckpointFile, handle: Any) -> None:
        self._f: Optional[CheckpointFile] = file
        self._handle = handle
        self.path = file.path
        self.format = file.format  #: ``"torch"`` or ``"safetensors"``

    # -- context manager ---------------------------------------------------------

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def close(self) -> None:
        """Close the file descriptor (idempotent). Tensors already returned stay valid."""
        f, self._f = self._f, None
        if f is not None:
            os.close(f.fd)

    @property
    def closed(self) -> bool:
        return self._f is None

    def _file(self) -> CheckpointFile:
        if self._f is None:
            raise ValueError(f"I/O operation on a closed checkpoint reader ({self.path})")
        return self._f

    # -- the index -----------------------------------------------------------------

    def keys(self) -> list[str]:
        """Names of the tensors, in the order of the saved object (safetensors: data
        order). Ambiguous names (two paths formatting alike) are listed once."""
        f = self._file()
        out = list(f.tensors)
        out.extend(n for n in f.ambiguous if n not in f.tensors)
        return out

    def __contains__(self, name: object) -> bool:
        f = self._file()
        return name in f.tensors or name in f.ambiguous

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def info(self, name: str) -> TensorInfo:
        """dtype, shape, stride, byte size and where the tensor lies in the file, from
        the index alone. ``KeyError`` for an unknown name; ``AmbiguousNameError`` (a
        ``KeyError``) for a name that stands for several tensors."""
        return self._file().info(name)

    def metadata(self) -> Optional[dict[str, str]]:
        """A safetensors file's ``__metadata__`` (None if it has none); None for torch files."""
        f = self._file()
        return dict(f.metadata) if f.metadata is not None else None

    def object(self) -> Any:
        """The torch file's saved object with every tensor on the ``meta`` device (its
        structure and non-tensor values, no payload read); None for safetensors."""
        return self._file().obj

    # -- reading ---------------------------------------------------------------------

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name``, equal to what ``torch.load`` (or safetensors) returns for
        it; reads only its record. Every call reads anew and returns new memory."""
        return self.get_many([name])[name]

    def get_many(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors, with one parallel read of only their records (a record
        shared by several of them is read once, and they share its storage as they do
        after ``torch.load``)."""
        f = self._file()
        infos = {n: f.info(n) for n in names}
        records = f.read_records({i.record for i in infos.values()}, self._handle)
        return {n: f.tensor_from_record(i, records[i.record]) for n, i in infos.items()}

    def get_slice(self, name: str) -> Any:  # pragma: no cover - not offered
        """Not offered (safetensors' ``safe_open`` has it): a record's CRC-32 covers all its
        bytes, so a checked slice costs the same read as the whole tensor. Use
        ``get(name)[index]``. Raises ``NotImplementedError``."""
        raise NotImplementedError(f"{self.path!r}: get_slice({name!r}) is not offered; get({name!r}) the tensor "
                                  "and index it (a checked read covers the whole record anyway)")

    def __repr__(self) -> str:
        state = "closed" if self._f is None else f"{len(self._f.tensors)} tensors"
        return f"<fastpersist.CheckpointReader {self.path!r} ({self.format}, {state})>"


def open(path: PathLike, *, config: Any = None) -> CheckpointReader:  # noqa: A001 - like safe_open/open
    """Open a checkpoint (torch zip file or ``.safetensors``) for lazy, partial reads.

    Only the index is read: for torch files the zip central directory and the
    pickle, unpickled with ``weights_only`` rules into meta tensors (no payload read);
    for safetensors files the header. :meth:`CheckpointReader.get` and
    :meth:`~CheckpointReader.get_many` then read only the records of the tensors
    named, with the native parallel reader, checking each record's local header
    and (``config.checksum``) CRC-32.

    Args:
        path: the file.
        config: a :class:`fastpersist.Config` (I/O settings, ``checksum``).

    Raises:
        fastpersist.errors.UnsupportedLayoutError: a file this reader cannot index
            lazily (legacy non-zip torch files, compressed records, TorchScript,
            quantized or sparse tensors): use ``fastpersist.load``.
        fastpersist.errors.CheckpointFormatError: the file is malformed.
        fastpersist.errors.ChecksumError: the pickle or header fails its CRC-32.
        pickle.UnpicklingError: the pickle holds what ``weights_only`` refuses.
        OSError: the file cannot be read.
    """
    cfg = config_mod.resolve(config)
    fspath = os.fsdecode(os.fspath(path))
    pending.wait_before_reading(fspath)
    check_input(fspath, "open")  # a FIFO would block open_checkpoint's open(); a device is no checkpoint
    file = open_checkpoint(fspath, checksum=cfg.checksum)
    return CheckpointReader(file, handles.handle_for(cfg, read=True))

