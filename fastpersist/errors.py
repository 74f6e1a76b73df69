"""Exceptions raised by fastpersist beyond the ``OSError`` family of the native layer."""

from __future__ import annotations

from typing import Optional, Sequence


class FastPersistError(Exception):
    """Base class of fastpersist's own errors."""


class CheckpointFormatError(FastPersistError, ValueError):
    """A checkpoint file is malformed: truncated, corrupt, lying about its sizes, or
    not a checkpoint at all. The one exception type every reader (``load``,
    ``verify``, ``fastpersist.io`` helpers) raises for bad *content*; I/O failures
    stay ``OSError``. ``path`` names the file and ``offset`` (when known) the byte
    where the problem was found; the message says what is wrong.
    """

    def __init__(self, message: str, path: Optional[str] = None, offset: Optional[int] = None) -> None:
        super().__init__(message)
        self.path = path
        self.offset = offset


class ZipFormatError(CheckpointFormatError):
    """A file is not a consistent zip archive (truncated, corrupt, or not a zip at all),
    or a torch checkpoint whose records contradict each other or its pickle.

    ``path`` and ``offset`` name where the inconsistency was found.
    """


class ChecksumError(FastPersistError, ValueError):
    """Bytes read back do not match the CRC-32 recorded when the file was written.

    ``path`` is the file and ``records`` the names of the records (zip entries or
    tensors) whose checksum did not match.
    """

    def __init__(self, message: str, path: Optional[str] = None, records: Optional[list[str]] = None) -> None:
        super().__init__(message)
        self.path = path
        self.records = list(records or [])


class UnsupportedLayoutError(FastPersistError, RuntimeError):
    """The fast planner cannot lay out this object (for example quantized or nested
    tensors, which ``torch.serialization.skip_data`` refuses); callers fall back to
    torch's own writer."""


class DirectorySyncError(FastPersistError, OSError):
    """A save renamed its new file into place, then the fsync of the directory failed.

    The new file *is* at the path (a load now sees it) and the previous file is no
    longer there, but after a crash or power loss the directory may come back without
    the rename. ``errno`` is the fsync's; ``filename`` the saved file. Saving again
    once the filesystem is healthy makes the checkpoint durable.
    """



class ObjectStoreError(FastPersistError, OSError):
    """An object-store request failed for good (after the retries S3 practice allows:
    see docs/objectstore.md). ``url`` is the ``s3://bucket/key`` of the checkpoint,
    ``operation`` the S3 operation that failed (``UploadPart``, ``GetObject``, ...),
    ``code`` the store's error code (``NoSuchBucket``, ``AccessDenied``, ``SlowDown``,
    ... or the network error's name) and the message says what to do. A failed save has
    aborted its multipart upload: the object under ``url`` is the previous one, or none.
    """

    def __init__(self, message: str, url: str, operation: str, code: str = "") -> None:
        super().__init__(message)
        self.url = url
        self.operation = operation
        self.code = code

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple:
        # Picklable with its fields: DCP sends a rank's exception to the others
        # (CheckpointException.failures), and OSError's own reduction would call
        # __init__ with the message alone.
        return (type(self), (str(self), self.url, self.operation, self.code), dict(self.__dict__))


class DistributedCheckpointError(FastPersistError, RuntimeError):
    """A collective save or load failed on some rank; raised on every rank.

    ``failures`` maps each failing rank (rank in the group) to its error, in words.
    On the failing rank itself the original exception is the ``__cause__``.
    """

    def __init__(self, message: str, failures: Optional[dict[int, str]] = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})


class ReplicasDifferError(DistributedCheckpointError):
    """The ranks of a collective save do not hold the same state (layout, Python values or
    tensor values); raised on every rank before anything is written under the final name.
    ``difference`` names the first difference in words (the tensor's key path in the
    state, or the file record, and the ranks). A framework adapter catching it lets its
    designated rank write its own state alone (``fastpersist/replicated.py``)."""

    def __init__(self, message: str, difference: str = "") -> None:
        super().__init__(message)
        self.difference = difference


class DistributedTimeoutError(DistributedCheckpointError, TimeoutError):
    """Some ranks did not reach a step of a collective save/load in time (died or hung);
    ``missing`` lists them (ranks in the group)."""

    def __init__(self, message: str, missing: Sequence[int]) -> None:
        super().__init__(message)
        self.missing = list(missing)
