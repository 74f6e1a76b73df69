"""What a torch pickle can do, decided without running any of its code.

``fastpersist.load`` unpickles while the tensor bytes are still being read, but
only when nothing that runs during unpickling can look at those bytes: a
``__setstate__`` or ``__reduce__`` callable of a user class, a sparse-tensor
validation, a byte swap... would see unread memory. :func:`scan_pickle` runs the
pickle's opcodes with C pickle's ``Unpickler`` in which *every* global resolves to
an inert stand-in class (``find_class`` imports nothing) and every persistent id
is only recorded; it reports every global the pickle names and every storage it
refers to. :func:`data_free` says whether all those globals are known to build
objects without reading storage bytes.

The storages it reports are exactly those torch's unpickler will ask for (the
persistent ids are built by the same opcodes), so records outside that set need
not be read. The loader still reads any record it is asked for, so a wrong
answer here costs time, never correctness.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
from dataclasses import dataclass, field
from typing import Any, Optional

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


class StandIn:
    """What every global resolves to during the dry run: accepts any construction,
    call, state and items, and does nothing. One shared instance (cheap)."""

    def __new__(cls, *_args: Any, **_kwargs: Any) -> "StandIn":
        return ONE

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def __call__(self, *_args: Any, **_kwargs: Any) -> "StandIn":
        return self

    def __setstate__(self, _state: Any) -> None:
        pass

    def __setitem__(self, _key: Any, _value: Any) -> None:
        pass

    def append(self, _item: Any) -> None:
        pass

    def extend(self, _items: Any) -> None:
        pass

    def add(self, _item: Any) -> None:
        pass


ONE = object.__new__(StandIn)


def _argument_widths() -> list[Optional[int]]:
    """Per opcode byte: the width of its fixed argument (>= 0), or how its argument is
    delimited (-1: up to a newline, -2: two lines, -3/-4/-5: a length of 1/4/8 bytes
    first); None for bytes that are no opcode."""
    out: list[Optional[int]] = [None] * 256
    counted = {pickletools.TAKEN_FROM_ARGUMENT1: -3, pickletools.TAKEN_FROM_ARGUMENT4: -4,
               pickletools.TAKEN_FROM_ARGUMENT4U: -4, pickletools.TAKEN_FROM_ARGUMENT8U: -5}
    for op in pickletools.opcodes:
        a = op.arg
        out[ord(op.code)] = 0 if a is None else a.n if a.n >= 0 else counted.get(a.n, -1)
    out[ord("c")] = out[ord("i")] = -2  # GLOBAL, INST: module and name lines
    return out


_WIDTHS = _argument_widths()
_LONG_BINPUT, _PUT, _STOP = ord("r"), ord("p"), ord(".")


def unbounded_allocation(data: bytes) -> Optional[str]:
    """Why C pickle's ``Unpickler`` would allocate far more than ``data`` holds, or None.

    Its memo is an array: a ``LONG_BINPUT``/``PUT`` to index ``i`` grows it to ``2 * i``
    slots and zeroes them (a 4-byte index of 1,263,614,577: 20 GB written, the process
    OOM-killed), where torch's weights-only unpickler (a dict memo) answers at once.
    A counted argument (bytes, string, bytearray) longer than the rest of the pickle is
    allocated before the read that fails. Python's pickler never writes either: memo
    indices count up from 0, one per ``PUT``. A walk over the opcodes (no object
    built); malformed input past that is left to the unpickler's own error."""
    n = len(data)
    i = 0
    widths = _WIDTHS
    unpack = struct.unpack_from
    find = data.find
    while i < n:
        c = data[i]
        i += 1
        w = widths[c]
        if w is None:
            return None
        if w >= 0:
            if c == _LONG_BINPUT and i + 4 <= n and unpack("<I", data, i)[0] > n:
                return f"memo index {unpack('<I', data, i)[0]} at byte {i - 1} of a {n}-byte pickle"
            if c == _STOP:
                return None
            i += w
        elif w == -1 or w == -2:
            j = find(b"\n", i)
            if w == -2 and j >= 0:
                j = find(b"\n", j + 1)
            if j < 0:
                return None
            if c == _PUT:
                try:
                    if int(data[i:j]) > n:
                        return f"memo index {int(data[i:j])} at byte {i - 1} of a {n}-byte pickle"
                except ValueError:
                    return None
            i = j + 1
        else:
            size = {-3: 1, -4: 4, -5: 8}[w]
            if i + size > n:
                return None
            length = data[i] if size == 1 else unpack("<i" if c in (ord("T"), ord("\x8b")) else "<I" if size == 4 else "<Q",
                                                       data, i)[0]
            if length > n - i - size:
                return f"an argument of {length} bytes at byte {i - 1} of a {n}-byte pickle"
            i += size + max(length, 0)
    return None


class DryUnpickler(pickle.Unpickler):
    """Runs a pickle with every global replaced by a :class:`StandIn` subclass that
    carries the global's name (``ref``), recording each global and each persistent
    id. Nothing is imported and no checkpoint code runs.

    ``bound_memo``: refuse (ValueError from :meth:`load`) a pickle that would make C
    pickle allocate far beyond its size (:func:`unbounded_allocation`). Only a load whose
    next step is C pickle anyway (``weights_only=False``: torch's unpickler makes the same
    allocation) may skip that walk over the opcodes."""

    def __init__(self, data: bytes, *, bound_memo: bool = True) -> None:
        super().__init__(io.BytesIO(data), encoding="latin1")
        self._data = data if bound_memo else None
        self.globals: dict[tuple[str, str], type] = {}
        self.storages: dict[str, Any] = {}
        self.pids: list[Any] = []

    def load(self) -> Any:
        if self._data is not None:
            why = unbounded_allocation(self._data)
            if why is not None:
                raise ValueError(f"the pickle would make the unpickler allocate beyond its size ({why})")
        return super().load()

    def find_class(self, module: str, name: str) -> Any:
        ref = (str(module), str(name))
        cls = self.globals.get(ref)
        if cls is None:
            cls = self.globals[ref] = type("_Global", (StandIn,), {"ref": ref})
        return cls

    def persistent_load(self, pid: Any) -> Any:
        self.pids.append(pid)
        if isinstance(pid, tuple) and len(pid) == 5:
            self.storages[f"{pid[2]}"] = pid[4]  # the key as torch formats it ("data/{key}")
        return ONE


@dataclass
class PickleScan:
    """Result of :func:`scan_pickle`."""

    #: ``(module, name)`` of every global the pickle names; None when it could not be run
    globals: Optional[set[tuple[str, str]]]
    #: storage key -> element count of every persistent id (None: not known)
    storages: Optional[dict[str, Any]] = None
    #: every persistent id as the pickle built it; globals in it are classes with a
    #: ``ref`` attribute ``(module, name)``, other computed values the stand-in
    pids: list[Any] = field(default_factory=list)
    error: Optional[str] = None  #: why the pickle could not be run (malformed ...)

    @property
    def keys(self) -> Optional[set[str]]:
        """Storage keys the pickle refers to (None: unknown)."""
        return None if self.storages is None else set(self.storages)


def scan_pickle(data: bytes, *, bound_memo: bool = True) -> PickleScan:
    """Run the pickle ``data`` with inert stand-ins for every global (see the module docstring);
    ``bound_memo`` as for :class:`DryUnpickler` (a pickle refused there is "not understood")."""
    dry = DryUnpickler(data, bound_memo=bound_memo)
    try:
        dry.load()
    except Exception as e:  # noqa: BLE001 - any failure means "not understood"
        return PickleScan(globals=None, error=f"{type(e).__name__}: {e}")
    return PickleScan(globals=set(dry.globals), storages=dry.storages, pids=dry.pids)


def global_ref(obj: Any) -> Optional[tuple[str, str]]:
    """``(module, name)`` when ``obj`` is what a global resolved to in the dry run, else None."""
    ref = getattr(obj, "ref", None) if isinstance(obj, type) and issubclass(obj, StandIn) else None
    return ref if isinstance(ref, tuple) else None


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
