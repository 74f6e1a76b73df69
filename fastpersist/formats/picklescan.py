"""What a torch pickle can do, decided without executing it.

``fastpersist.load`` unpickles while the tensor bytes are still being read, but
only when nothing that runs during unpickling can look at those bytes: a
``__setstate__`` or ``__reduce__`` callable of a user class, a sparse-tensor
validation, a byte swap... would see unread memory. :func:`scan_pickle` walks the
opcodes (``pickletools.genops``; nothing is imported or called) and reports every
global the pickle names; :func:`data_free` says whether all of them are known to
build objects without reading storage bytes.

It also collects every string literal of the pickle: a storage key that is not
among them cannot be asked for by a pickle whose globals are all data-free (its
persistent ids are built from literals), so such records need not be read. The
loader still reads any record it is asked for, so a wrong guess costs time, never
correctness.
"""

from __future__ import annotations

import pickletools
from dataclasses import dataclass, field
from typing import Optional

import torch

#: Globals that build objects without reading any storage's bytes while unpickling.
_DATA_FREE: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_parameter"),
        ("torch._utils", "_rebuild_parameter_with_state"),
        ("collections", "OrderedDict"),
        ("torch", "device"),
        ("torch", "Size"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "complex"),
        ("builtins", "slice"),
        ("builtins", "bytearray"),
        ("builtins", "bytes"),
        ("_codecs", "encode"),
    }
)


def _torch_dtype_names() -> frozenset[str]:
    return frozenset(n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype))


_DTYPE_NAMES = _torch_dtype_names()

_STRING_OPS = frozenset(
    {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}
)
_MEMO_PUT = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_MEMO_GET = frozenset({"GET", "BINGET", "LONG_BINGET"})


@dataclass
class PickleScan:
    """Result of :func:`scan_pickle`."""

    #: ``(module, name)`` of every global the pickle names; None when one could not
    #: be determined (a ``STACK_GLOBAL`` fed by computed values, an extension code).
    globals: Optional[set[tuple[str, str]]]
    #: every string literal (str and bytes decoded as latin-1), a superset of the storage keys
    strings: set[str] = field(default_factory=set)
    error: Optional[str] = None  #: why the opcodes could not be walked (malformed pickle)


def scan_pickle(data: bytes) -> PickleScan:
    """Walk the opcodes of ``data`` (never executing them)."""
    globals_: Optional[set[tuple[str, str]]] = set()
    strings: set[str] = set()
    memo: dict[object, Optional[str]] = {}
    recent: list[Optional[str]] = []  # values of the last pushes that STACK_GLOBAL may consume
    try:
        for op, arg, _pos in pickletools.genops(data):
            name = op.name
            if name in _STRING_OPS or name in ("BINBYTES", "SHORT_BINBYTES", "BINBYTES8"):
                text = arg if isinstance(arg, str) else bytes(arg).decode("latin-1")
                strings.add(text)
                recent.append(text)
            elif name in _MEMO_PUT:
                memo[arg] = recent[-1] if recent else None
            elif name == "MEMOIZE":
                memo[len(memo)] = recent[-1] if recent else None
            elif name in _MEMO_GET:
                recent.append(memo.get(arg))
            elif name in ("GLOBAL", "INST"):
                module, _, attr = str(arg).partition(" ")
                if globals_ is not None:
                    globals_.add((module, attr))
                recent.append(None)
            elif name == "STACK_GLOBAL":
                if len(recent) < 2 or recent[-1] is None or recent[-2] is None:
                    globals_ = None
                elif globals_ is not None:
                    globals_.add((recent[-2], recent[-1]))  # type: ignore[arg-type]
                recent.append(None)
            elif name in ("EXT1", "EXT2", "EXT4"):
                globals_ = None
                recent.append(None)
            elif name in ("FRAME", "PROTO"):
                pass
            else:
                recent.append(None)
            if len(recent) > 8:
                del recent[:-8]
    except Exception as e:  # noqa: BLE001 - any parse failure means "not understood"
        return PickleScan(globals=None, strings=strings, error=f"{type(e).__name__}: {e}")
    return PickleScan(globals=globals_, strings=strings)


def is_data_free_global(module: str, name: str) -> bool:
    """Whether the global ``module.name`` builds its object without reading storage bytes."""
    if (module, name) in _DATA_FREE:
        return True
    if module == "torch":
        # storage classes (torch.FloatStorage ...) are only looked up; dtypes are constants
        return name.endswith("Storage") or name in _DTYPE_NAMES
    return False


def data_free(scan: PickleScan) -> bool:
    """Whether unpickling can run before the storage bytes are in memory."""
    if scan.error is not None or scan.globals is None:
        return False
    return all(is_data_free_global(m, n) for m, n in scan.globals)
