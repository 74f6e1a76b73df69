"""Exception types of the ``torch.save`` / ``torch.load`` switch: torch's types kept.

Where stock ``torch.save`` raises ``RuntimeError`` (its C++ zip writer reports every
failure to open or write the file that way: a missing parent directory, a directory
given as the path, permission denied, a full disk) and stock ``torch.load`` raises
``RuntimeError`` for a damaged zip archive, the patched functions raise an exception
that is *both* what fastpersist raises (``OSError`` with errno, path and offset;
:class:`~fastpersist.errors.CheckpointFormatError`; :class:`~fastpersist.errors.ChecksumError`)
and ``RuntimeError``. Code written against torch (``except RuntimeError``) and code
written against fastpersist (``except FileNotFoundError``, ``except OSError``,
``except ChecksumError``) both catch it.

Errors whose type already matches torch's (``FileNotFoundError`` for a missing file on
load, ``IsADirectoryError`` for a directory on load, pickling errors) pass unchanged, and
so do fastpersist's own ``OSError`` subclasses (``DirectorySyncError``: the new file *is* in
place, only the fsync of its directory failed; catching it as such must keep working).
The classes are defined at module level so that they pickle (multiprocessing workers).
"""

from __future__ import annotations

from typing import Optional

from fastpersist.errors import CheckpointFormatError, ChecksumError, FastPersistError, ZipFormatError

__all__ = [
    "TorchSaveOSError",
    "TorchSaveFileNotFoundError",
    "TorchSaveIsADirectoryError",
    "TorchSavePermissionError",
    "TorchLoadZipFormatError",
    "TorchLoadFormatError",
    "TorchLoadChecksumError",
    "for_torch_save",
    "for_torch_load",
]


class TorchSaveOSError(OSError, RuntimeError):
    """An I/O error of the patched ``torch.save`` (stock torch raises ``RuntimeError``)."""


class TorchSaveFileNotFoundError(FileNotFoundError, RuntimeError):
    """The patched ``torch.save``'s missing parent directory (stock: ``RuntimeError``)."""


class TorchSaveIsADirectoryError(IsADirectoryError, RuntimeError):
    """The patched ``torch.save`` given a directory (stock: ``RuntimeError``)."""


class TorchSavePermissionError(PermissionError, RuntimeError):
    """The patched ``torch.save`` refused by permissions (stock: ``RuntimeError``)."""


class TorchLoadZipFormatError(ZipFormatError, OSError, RuntimeError):
    """A damaged zip archive given to the patched ``torch.load``. Stock torch raises
    ``RuntimeError`` from its zip reader for most damage, and ``OSError`` (EINVAL, from
    seeking before the file's start) for an archive cut short: this is both."""

    def __init__(self, message: str, path: Optional[str] = None, offset: Optional[int] = None) -> None:
        ZipFormatError.__init__(self, message, path, offset)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class TorchLoadFormatError(CheckpointFormatError, RuntimeError):
    """A malformed checkpoint given to the patched ``torch.load`` (stock: ``RuntimeError``)."""


class TorchLoadChecksumError(ChecksumError, RuntimeError):
    """A CRC-32 mismatch in a file fastpersist wrote, found by the patched ``torch.load``
    (stock torch does not check CRCs; ``RuntimeError`` is what its reader raises for
    damaged archives)."""


_SAVE_OS = (
    (FileNotFoundError, TorchSaveFileNotFoundError),
    (IsADirectoryError, TorchSaveIsADirectoryError),
    (PermissionError, TorchSavePermissionError),
)


def for_torch_save(e: BaseException) -> Optional[BaseException]:
    """The exception the patched ``torch.save`` raises for ``e`` (None: raise ``e`` as it is)."""
    if not isinstance(e, OSError) or isinstance(e, (RuntimeError, FastPersistError)):
        return None  # e.g. DirectorySyncError: its own meaning (the file *is* in place) stays
    cls: type = TorchSaveOSError
    for base, dual in _SAVE_OS:
        if isinstance(e, base):
            cls = dual
            break
    if e.errno is None:
        new = cls(*e.args)
    elif e.filename is not None:
        new = cls(e.errno, e.strerror, e.filename)
    else:
        new = cls(e.errno, e.strerror)
    return new


def for_torch_load(e: BaseException) -> Optional[BaseException]:
    """The exception the patched ``torch.load`` raises for ``e`` (None: raise ``e`` as it is)."""
    if isinstance(e, RuntimeError):
        return None
    if isinstance(e, ChecksumError):
        return TorchLoadChecksumError(str(e), e.path, e.records)
    if isinstance(e, ZipFormatError):
        return TorchLoadZipFormatError(str(e), e.path, e.offset)
    if isinstance(e, CheckpointFormatError):
        return TorchLoadFormatError(str(e), e.path, e.offset)
    return None
