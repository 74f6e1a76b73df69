"""A faster weights-only unpickler for the pickles of plain tensor state.

``torch.load(weights_only=True)`` runs every opcode of ``data.pkl`` through
``torch._weights_only_unpickler.Unpickler``: pure Python, a chain of about thirty
comparisons per opcode, a linear search of the allowed globals for every
``REDUCE``, and three fake-mode checks per tensor. For a state of many small
tensors that is most of a load: 20,000 tensors took 2.0-2.4 s to unpickle on
the reference VM, about as long as reading their 3 GB.

:func:`unpickle` does the same work for the subset of pickles that
``torch.save`` writes for dicts and lists of plain CPU tensors, and nothing
else. It mirrors torch's unpickler opcode by opcode (the same type checks for
``APPEND``/``SETITEM`` targets, the same ``BINPERSID`` checks, torch's own
``persistent_load`` logic) with fewer steps per opcode, and accepts only three
kinds of global: ``torch._utils._rebuild_tensor_v2``, ``collections.OrderedDict``
and torch's storage types. Whatever it does not handle exactly as torch would
(another global, ``BUILD``, ``NEWOBJ``, tensor metadata or hooks, a storage
that is not on the CPU, a protocol other than 2, any malformed input) raises
:class:`NotFast` before a result is returned, and the caller runs torch's own
unpickler from the start instead. So the result is always what torch's
unpickler returns, or torch's unpickler runs and gives its own answer.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from struct import unpack_from
from typing import Any, Callable

import torch

from fastpersist import _compat

__all__ = ["NotFast", "unpickle"]


class NotFast(Exception):
    """This pickle needs torch's unpickler (not an error: the caller falls back)."""


_REBUILD = ("torch._utils", "_rebuild_tensor_v2")
_ODICT = ("collections", "OrderedDict")


def _storage_types() -> dict[tuple[str, str], Any]:
    """``(module, name)`` -> the object torch's weights-only unpickler resolves it to, for storage types."""
    allowed = _compat.weights_only_unpickler()._get_allowed_globals()
    out: dict[tuple[str, str], Any] = {}
    for full, obj in allowed.items():
        module, _, name = full.rpartition(".")
        if name.endswith("Storage") and module == "torch":
            out[(module, name)] = obj
    return out


_STORAGES: dict[tuple[str, str], Any] = {}


def _fast_rebuild_tensor_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                       backward_hooks: Any, metadata: Any = None) -> torch.Tensor:
    """``torch._utils._rebuild_tensor_v2`` for a CPU ``TypedStorage``, without its fake-mode check
    (the caller checked once that no fake mode is active)."""
    if type(storage) is not torch.storage.TypedStorage or metadata:
        raise NotFast("tensor with metadata, or not over a typed storage")
    untyped = storage._untyped_storage
    if untyped.device.type != "cpu":
        raise NotFast("storage not on the CPU")
    t = torch.empty((0,), dtype=storage.dtype, device="cpu").set_(untyped, storage_offset, size, stride)
    t.requires_grad = requires_grad
    t._backward_hooks = backward_hooks
    return t


def unpickle(data: bytes, get_storage: Callable[[str, int], torch.Tensor], *, encoding: str = "utf-8") -> Any:
    """Unpickle ``data`` (a torch ``data.pkl``) as torch's weights-only unpickler would, with
    storages mapped to the CPU; ``get_storage(name, nbytes)`` returns the record's bytes as
    a uint8 tensor (it checks that the record holds ``nbytes``).

    Raises :class:`NotFast` for anything outside the subset described in the module
    docstring (the caller then runs torch's unpickler); errors of ``get_storage``
    (I/O, checksums) propagate as they are.
    """
    if not _STORAGES:
        _STORAGES.update(_storage_types())
    storages = _STORAGES
    typed_storage = torch.storage.TypedStorage
    untyped_type = torch.UntypedStorage
    element_size = torch._utils._element_size
    decode_ascii = torch.serialization._maybe_decode_ascii
    uint8 = torch.uint8
    loaded: dict[Any, Any] = {}

    def persistent_load(pid: Any) -> Any:
        # torch.serialization._load's persistent_load, for storages restored on the CPU
        if type(pid) is not tuple or len(pid) != 5 or decode_ascii(pid[0]) != "storage":
            raise NotFast("persistent id that is not a storage")
        storage_type, key, location, numel = pid[1], pid[2], pid[3], pid[4]
        dtype = uint8 if storage_type is untyped_type else storage_type.dtype
        nbytes = numel * element_size(dtype)
        ts = loaded.get(key)
        if ts is None:
            if decode_ascii(location) != "cpu":
                raise NotFast(f"storage saved on {location!r}")
            raw = get_storage(f"data/{key}", nbytes)
            ts = typed_storage(wrap_storage=raw._typed_storage()._untyped_storage, dtype=dtype, _internal=True)
            loaded[key] = ts
        elif ts.dtype != dtype:
            raise NotFast("record referenced under two dtypes")
        return ts

    try:
        return _run(data, persistent_load, storages, encoding)
    except NotFast:
        raise
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - malformed input: torch's unpickler gives its own error
        raise NotFast(f"{type(e).__name__}: {e}") from e


def _run(data: bytes, persistent_load: Callable[[Any], Any], storages: dict[tuple[str, str], Any],
         encoding: str) -> Any:
    read_global = _compat.weights_only_unpickler()._read_global_instruction
    # The stack holds torch's own function (a pickle may put the global itself into its
    # result); REDUCE of it runs the fast equivalent.
    rebuild = torch._utils._rebuild_tensor_v2
    fast_rebuild = _fast_rebuild_tensor_v2
    odict = OrderedDict
    set_targets = (dict, OrderedDict, Counter)
    memo: dict[int, Any] = {}
    metastack: list[list[Any]] = []
    stack: list[Any] = []
    append = stack.append
    pos = 0
    n = len(data)
    while True:
        if pos >= n:
            raise EOFError
        op = data[pos]
        pos += 1
        if op == 0x71:  # BINPUT
            memo[data[pos]] = stack[-1]
            pos += 1
        elif op == 0x58:  # BINUNICODE
            size = unpack_from("<I", data, pos)[0]
            pos += 4
            if pos + size > n:
                raise NotFast("truncated string")
            append(str(data[pos:pos + size], "utf-8", "surrogatepass"))
            pos += size
        elif op == 0x68:  # BINGET
            append(memo[data[pos]])
            pos += 1
        elif op == 0x28:  # MARK
            metastack.append(stack)
            stack = []
            append = stack.append
        elif op == 0x4B:  # BININT1
            append(data[pos])
            pos += 1
        elif op == 0x4A:  # BININT
            append(unpack_from("<i", data, pos)[0])
            pos += 4
        elif op == 0x74:  # TUPLE
            items = stack
            stack = metastack.pop()
            append = stack.append
            append(tuple(items))
        elif op == 0x52:  # REDUCE
            args = stack.pop()
            func = stack[-1]
            if func is rebuild:
                stack[-1] = fast_rebuild(*args)
            elif func is odict:
                stack[-1] = odict(*args)
            else:
                raise NotFast("REDUCE of a callable outside the fast subset")
        elif op == 0x51:  # BINPERSID
            pid = stack.pop()
            append(persistent_load(pid))
        elif op == 0x89:  # NEWFALSE
            append(False)
        elif op == 0x88:  # NEWTRUE
            append(True)
        elif op == 0x29:  # EMPTY_TUPLE
            append(())
        elif op == 0x85:  # TUPLE1
            stack[-1] = (stack[-1],)
        elif op == 0x86:  # TUPLE2
            stack[-2:] = [(stack[-2], stack[-1])]
        elif op == 0x87:  # TUPLE3
            stack[-3:] = [(stack[-3], stack[-2], stack[-1])]
        elif op == 0x72:  # LONG_BINPUT
            memo[unpack_from("<I", data, pos)[0]] = stack[-1]
            pos += 4
        elif op == 0x6A:  # LONG_BINGET
            append(memo[unpack_from("<I", data, pos)[0]])
            pos += 4
        elif op == 0x75:  # SETITEMS
            items = stack
            stack = metastack.pop()
            append = stack.append
            target = stack[-1]
            if type(target) not in set_targets:
                raise NotFast("SETITEMS on something that is not a dict")
            for i in range(0, len(items), 2):
                target[items[i]] = items[i + 1]
        elif op == 0x73:  # SETITEM
            v = stack.pop()
            k = stack.pop()
            target = stack[-1]
            if type(target) not in set_targets:
                raise NotFast("SETITEM on something that is not a dict")
            target[k] = v
        elif op == 0x5D:  # EMPTY_LIST
            append([])
        elif op == 0x7D:  # EMPTY_DICT
            append({})
        elif op == 0x61:  # APPEND
            item = stack.pop()
            target = stack[-1]
            if type(target) is not list:
                raise NotFast("APPEND to something that is not a list")
            target.append(item)
        elif op == 0x65:  # APPENDS
            items = stack
            stack = metastack.pop()
            append = stack.append
            target = stack[-1]
            if type(target) is not list:
                raise NotFast("APPENDS to something that is not a list")
            target.extend(items)
        elif op == 0x4E:  # NONE
            append(None)
        elif op == 0x4D:  # BININT2
            append(unpack_from("<H", data, pos)[0])
            pos += 2
        elif op == 0x47:  # BINFLOAT
            append(unpack_from(">d", data, pos)[0])
            pos += 8
        elif op == 0x8A:  # LONG1
            size = data[pos]
            pos += 1
            if pos + size > n:
                raise NotFast("truncated long")
            append(int.from_bytes(data[pos:pos + size], "little", signed=True))
            pos += size
        elif op == 0x55:  # SHORT_BINSTRING
            size = data[pos]
            pos += 1
            if pos + size > n:
                raise NotFast("truncated string")
            raw = data[pos:pos + size]
            pos += size
            append(raw if encoding == "bytes" else raw.decode(encoding, "strict"))
        elif op == 0x8F:  # EMPTY_SET
            append(set())
        elif op == 0x63:  # GLOBAL
            end1 = data.find(b"\n", pos)
            end2 = data.find(b"\n", end1 + 1) if end1 >= 0 else -1
            if end2 < 0:
                raise NotFast("truncated GLOBAL")
            lines = iter((data[pos:end1 + 1], data[end1 + 1:end2 + 1]))
            module, name = read_global(lambda: next(lines))  # torch's own decoding and name mapping
            pos = end2 + 1
            ref = (module, name)
            if ref == _REBUILD:
                append(rebuild)
            elif ref == _ODICT:
                append(odict)
            elif ref in storages:
                append(storages[ref])
            else:
                raise NotFast(f"global {module}.{name} outside the fast subset")
        elif op == 0x80:  # PROTO
            if data[pos] != 2:
                raise NotFast("pickle protocol other than 2 (torch warns about it)")
            pos += 1
        elif op == 0x2E:  # STOP
            return stack.pop()
        else:
            raise NotFast(f"opcode {op:#04x} outside the fast subset")
