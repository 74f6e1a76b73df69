"""Pickle modules handed to ``torch.serialization._save`` by the torch-format planner.

torch's ``_save`` builds its pickler by subclassing ``pickle_module.Pickler`` and
asks it for a *persistent id* of every object; storages get
``("storage", <type>, key, location, numel)`` and their bytes become the records
``data/<key>``. The planner needs to know the moment each storage is named, so it
always passes a pickle module of its own. There are two:

* :func:`capture_module` wraps torch's ``persistent_id`` and reports each new
  storage. Everything else is torch's: ``Tensor.__reduce_ex__``, its
  ``TypedStorage`` wrappers, key assignment.
* :func:`fast_capture_module` does the same work without torch's per-tensor
  Python frames, which dominate a state of many small tensors (``__reduce_ex__``
  alone is ~14 us a tensor). A ``reducer_override`` returns the very reduction
  ``Tensor._reduce_ex_internal`` returns for a plain dense CPU/CUDA tensor
  (anything else goes to torch), and the persistent id of every storage,
  whatever its origin, is computed here with torch's rules (dtype check, keys
  in first-seen order, ``location_tag``), so keys come from one counter.

The fast module is used only when :func:`fast_pickling_ok` has pickled a probe
state (every dtype, views, shared storages, conj/neg bits, parameters, bare
storages) both ways in this process and found the two ``data.pkl`` identical
byte for byte; a torch whose serializer changed falls back to the plain one.
That check is the ``fast_pickle`` feature of :mod:`fastpersist._compat`, which
lists the private torch names the fast module uses; both modules install their
``persistent_id`` through :func:`fastpersist._compat.set_persistent_id`.
"""

from __future__ import annotations

import collections
import io
import logging
import pickle
import types
import warnings
import zipfile
from typing import Any, Callable, Optional

import torch

from fastpersist import _compat

log = logging.getLogger(__name__)

OnNew = Callable[[str, torch.UntypedStorage], None]

#: Exact types that are never storages (torch's persistent_id returns None for them).
_PLAIN_TYPES = frozenset(
    {str, bytes, int, float, bool, type(None), tuple, list, dict, collections.OrderedDict, torch.Size, torch.dtype, torch.device}
)


def _is_storage_pid(pid: Any) -> bool:
    return type(pid) is tuple and len(pid) == 5 and pid[0] == "storage"


def capture_module(on_new: Optional[OnNew] = None) -> Any:
    """A pickle module whose Pickler reports each storage torch's ``persistent_id`` names.

    torch's ``_save`` subclasses ``pickle_module.Pickler`` and overrides
    ``persistent_id`` with a method; the bound method is wrapped per instance through
    ``pickle.Pickler``'s C-level ``persistent_id`` attribute, which the C pickler
    consults (:func:`fastpersist._compat.set_persistent_id`), so torch's own logic (storage dedup, keys, dtype checks) is unchanged.
    ``on_new(key, untyped_storage)`` runs once per key, when it is first named.
    """

    class CapturePickler(pickle.Pickler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            inner = self.persistent_id
            plain = _PLAIN_TYPES
            seen: set[str] = set()

            def persistent_id(obj: Any) -> Any:
                # torch's persistent_id answers None for everything but storages; the
                # pickler asks about every object (~20 per tensor), so skip the
                # Python frames for the types that dominate a state dict.
                if type(obj) in plain:
                    return None
                pid = inner(obj)
                if pid is not None and _is_storage_pid(pid):
                    key = str(pid[2])
                    if on_new is not None and key not in seen:
                        seen.add(key)
                        on_new(key, obj._untyped_storage if isinstance(obj, torch.storage.TypedStorage) else obj)
                return pid

            _compat.set_persistent_id(self, persistent_id)

    return types.SimpleNamespace(__name__="fastpersist_capture", Pickler=CapturePickler, Unpickler=pickle.Unpickler)


class _StorageRef:
    """Stands for a tensor's storage in a fast reduction; only ``persistent_id`` sees it."""

    __slots__ = ("storage", "typed")

    def __init__(self, storage: torch.UntypedStorage, typed: Optional[torch.dtype]) -> None:
        self.storage = storage
        self.typed = typed  # the dtype of a TypedStorage; None: an UntypedStorage (v3 rebuild)


class _Tables:
    """Per-dtype answers torch recomputes for every tensor (built once per process)."""

    def __init__(self) -> None:
        self.v3 = frozenset(torch.storage._new_dtypes())
        names = torch.storage._dtype_to_storage_type_map()
        self.storage_type = {dt: getattr(torch, name) for dt, name in names.items()}
        self.itemsize = {dt: torch._utils._element_size(dt) for dt in names}
        self.untyped_type = torch.serialization.normalize_storage_type(torch.UntypedStorage)


_TABLES: Optional[_Tables] = None


def _tables() -> _Tables:
    global _TABLES
    if _TABLES is None:
        _TABLES = _Tables()
    return _TABLES


def fast_capture_module(on_new: Optional[OnNew] = None) -> Any:
    """A pickle module producing torch's ``data.pkl`` with less Python work per tensor.

    Same contract as :func:`capture_module`; only use it after
    :func:`fast_pickling_ok` returned True in this process.
    """
    tables = _tables()
    v3 = tables.v3
    storage_types = tables.storage_type
    itemsize = tables.itemsize
    untyped_type = tables.untyped_type
    Tensor = torch.Tensor
    TypedStorage = torch.storage.TypedStorage
    strided = torch.strided
    rebuild_v2 = torch._utils._rebuild_tensor_v2
    rebuild_v3 = torch._utils._rebuild_tensor_v3
    tensor_metadata = torch._C._get_tensor_metadata
    location_tag = torch.serialization.location_tag
    OrderedDict = collections.OrderedDict
    plain = _PLAIN_TYPES | {Tensor}

    class FastPickler(pickle.Pickler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            inner = self.persistent_id
            id_map: dict[int, str] = {}
            storage_dtypes: dict[int, torch.dtype] = {}
            locations: dict[torch.device, str] = {}

            def storage_pid(storage: Any, dtype: torch.dtype, stype: Any, numel: int, fake: Any = None) -> tuple:
                # torch.serialization._save's persistent_id, for a storage of every kind
                device = storage.device
                if device.type != "meta":
                    ptr = storage.data_ptr()
                    if ptr:
                        if storage_dtypes.setdefault(ptr, dtype) != dtype:
                            raise RuntimeError(
                                "Cannot save multiple tensors or storages that view the same data as different types"
                            )
                cdata = storage._cdata
                key = id_map.get(cdata)
                if key is None:
                    key = id_map[cdata] = str(len(id_map))
                    if on_new is not None:
                        on_new(key, storage)
                if fake is not None:
                    location = str(fake)
                else:
                    location = locations.get(device)
                    if location is None:
                        location = locations[device] = location_tag(storage)
                return ("storage", stype, key, location, numel)

            def persistent_id(obj: Any) -> Any:
                t = type(obj)
                if t is _StorageRef:
                    st = obj.storage
                    dt = obj.typed
                    if dt is None:
                        return storage_pid(st, torch.uint8, untyped_type, st.nbytes())
                    return storage_pid(st, dt, storage_types[dt], st.nbytes() // itemsize[dt])
                if t in plain:
                    return None
                if isinstance(obj, TypedStorage):
                    fake = getattr(obj, "_fake_device", None)
                    return storage_pid(
                        obj._untyped_storage, obj.dtype, getattr(torch, obj._pickle_storage_type()), obj._size(), fake
                    )
                if torch.is_storage(obj):
                    fake = getattr(obj, "_fake_device", None)
                    return storage_pid(obj, torch.uint8, torch.serialization.normalize_storage_type(t), obj.nbytes(), fake)
                pid = inner(obj)
                if pid is not None:
                    # a torch whose persistent_id knows more than storages: keys would clash
                    raise pickle.PicklingError(f"unexpected persistent id {pid!r} for {t.__name__}")
                return None

            _compat.set_persistent_id(self, persistent_id)

        def reducer_override(self, obj: Any) -> Any:
            # Tensor._reduce_ex_internal's last branch, for the tensors that reach it
            # with nothing else to do: a plain dense CPU/CUDA tensor without Python
            # state or backward hooks. Everything else: torch's own __reduce_ex__.
            if type(obj) is not Tensor:
                return NotImplemented
            if (
                obj._backward_hooks
                or not (obj.is_cpu or obj.is_cuda)
                or obj.layout is not strided
                or obj.is_quantized
                or obj.is_nested
                or obj.__dict__
            ):
                return NotImplemented
            dtype = obj.dtype
            storage = obj.untyped_storage()
            if dtype in v3:
                args: tuple = (
                    _StorageRef(storage, None), obj.storage_offset(), tuple(obj.size()), obj.stride(),
                    obj.requires_grad, OrderedDict(), dtype,
                )
                func = rebuild_v3
            else:
                if dtype not in storage_types:
                    return NotImplemented
                args = (
                    _StorageRef(storage, dtype), obj.storage_offset(), tuple(obj.size()), obj.stride(),
                    obj.requires_grad, OrderedDict(),
                )
                func = rebuild_v2
            metadata = tensor_metadata(obj)
            if metadata:
                args = args + (metadata,)
            return (func, args)

    return types.SimpleNamespace(__name__="fastpersist_fast", Pickler=FastPickler, Unpickler=pickle.Unpickler)


def probe_state() -> Any:
    """A small object with every kind of tensor and storage the fast pickler must get right."""
    base = torch.arange(24, dtype=torch.float32)
    state: dict[str, Any] = {
        "base": base,
        "view": base[3:11],
        "transposed": base.view(4, 6).t(),
        "strided": base[::5],
        "again": base,
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 3),
        "grad": torch.ones(2, 2, requires_grad=True),
        "param": torch.nn.Parameter(torch.ones(3)),
        "conj": torch.complex(torch.ones(2), torch.ones(2)).conj(),
        "neg": torch._neg_view(torch.complex(torch.ones(2), torch.ones(2))),
        "untyped": torch.arange(6, dtype=torch.uint8).untyped_storage(),
        "typed": base._typed_storage(),
        "list": [torch.zeros(1, dtype=torch.int8), (torch.ones(1, dtype=torch.bool), 7)],
        "od": collections.OrderedDict(a=torch.ones(1, dtype=torch.int64), b="x"),
        "bytes_shared": torch.zeros(8, dtype=torch.uint8).view(torch.uint8)[2:],
    }
    tables = _tables()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "experimental dtype" and deprecation notices
        for dt in sorted(set(tables.storage_type) | tables.v3, key=str):
            try:
                state[f"dtype_{dt}"] = torch.zeros(2, dtype=dt)
            except (RuntimeError, TypeError):  # no dense zeros for this dtype (quantized)
                continue
    return state


def data_pkl(obj: Any, pickle_module: Any = pickle) -> bytes:
    """The ``data.pkl`` record ``torch.save(obj, ...)`` writes with ``pickle_module``."""
    buf = io.BytesIO()
    torch.serialization.save(obj, buf, pickle_module=pickle_module)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        (name,) = [n for n in z.namelist() if n.endswith("/data.pkl")]
        return z.read(name)


def _compare_fast_pickling() -> None:
    """The ``fast_pickle`` probe of :mod:`fastpersist._compat`: raises unless
    :func:`fast_capture_module` writes torch's ``data.pkl`` for :func:`probe_state`."""
    state = probe_state()
    if data_pkl(state, fast_capture_module()) != data_pkl(state):
        raise _compat.Unavailable("this torch's data.pkl differs from the fast pickler's")


def fast_pickling_ok() -> bool:
    """Whether :func:`fast_capture_module` writes the same ``data.pkl`` as torch here
    (checked once per process, see :func:`fast_pickle_ok`)."""
    return fast_pickle_ok()


def pick_capture_module(on_new: Optional[OnNew] = None) -> Any:
    """The fast capture module when it is verified for this torch, else the plain one."""
    return fast_capture_module(on_new) if fast_pickling_ok() else capture_module(on_new)


@_compat.feature("fast_pickle", "torch's Tensor.__reduce_ex__ pickles tensors (slower)", logging.INFO)
def _probe_fast_pickle() -> None:
    _compat.require("pickler_persistent_id")
    _compare_fast_pickling()


def fast_pickle_ok() -> bool:
    """Whether the fast pickler writes torch's ``data.pkl`` byte for byte here."""
    return _compat.ok("fast_pickle")
