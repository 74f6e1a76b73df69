"""Every private torch / CPython API fastpersist relies on, probed once each, in one place.

The fast save and load paths reach into torch's serializer: its private ``_save`` and
``_load``, its C++ zip writer and reader, the weights-only unpickler, and CPython's
C pickler. None of these is a stable API. This module probes each *feature* once per
process, lazily, by calling it on a tiny input (so a changed signature shows up as
the ``TypeError`` it raises, not as a failed save later), caches the verdict, and
logs the reason once when a feature is unusable. Callers ask it for the private
object (:func:`private_save`, :func:`file_writer`, ...) and get either the object or
:class:`~fastpersist.errors.UnsupportedLayoutError`, the exception on which
``fastpersist.save`` falls back to ``torch.save`` and ``fastpersist.load`` to
``torch.load``. :func:`report` lists every feature's status.

Inventory (``name``: where used; what for; fallback when the probe fails)

Save path (``fastpersist.save``, torch format):

``private_save`` -- ``torch.serialization._save(obj, zip_file, pickle_module,
    pickle_protocol, _disable_byteorder_record)``: ``formats/torchstream.py``
    (:func:`stream_torch`). torch's own pickling and record order, written into a
    proxy zip writer (``write_record``, ``write_record_metadata``). Probe: the
    parameter names, then a call on a one-tensor dict under ``skip_data`` with a
    recording zip writer (``data.pkl`` written, ``data/0`` announced by size).
    Fallback: the whole save goes to torch's writer (``torch.save``).
``skip_data`` -- ``torch.serialization.skip_data()`` (public since torch 2.6, but
    young): torchstream. Pickle without tensor bytes (storages become
    ``write_record_metadata`` calls). Probe: part of ``private_save``'s call.
    Fallback: ``torch.save``.
``storage_alignment_config`` -- ``torch.utils.serialization.config`` and its
    ``save.storage_alignment`` entry, changed through ``config.patch``:
    torchstream (and ``api._save_with_torch``). ``_save`` writes the
    ``.storage_alignment`` record from it, which ``torch.load``'s
    ``calculate_storage_offsets`` mode trusts. Probe: read, patch, read back.
    Fallback: the fast path is off (``torch.save``); torch's writer keeps its
    default 64-byte alignment (:func:`save_storage_alignment` with
    ``required=False``).
``file_writer`` -- ``torch._C.PyTorchFileWriter(file_like, compute_crc32,
    storage_alignment)`` (the third argument is recent) with ``write_record``,
    ``write_record_metadata``, ``write_end_of_file``: ``formats/zipwriter.py``
    (``torch_version_record``, ``run_layouts``: the reference for the layout
    check) and torchstream's ``_TorchRecords`` (records laid out by torch).
    Probe: a two-record archive into ``BytesIO``, payload aligned, read back by
    ``zipfile``. Fallback: ``torch.save``.
``pickler_persistent_id`` -- the C-level ``pickle.Pickler.persistent_id``
    descriptor, set per instance with ``__set__``: ``formats/torchpickle.py``
    (both capture picklers). torch's ``_save`` subclasses our Pickler and defines
    ``persistent_id`` as a method; the per-instance value set through the
    descriptor wraps it and is what the C pickler calls. (CPython 3.13.0 made the
    attribute read-only, 3.13.1 restored it.) Probe: a subclass with a
    ``persistent_id`` method, the descriptor set on an instance, one dump and
    load. Fallback: ``torch.save``.
``zip_layout`` -- no private name of its own: ``zipwriter.MinizLayout`` writes the
    bytes of ``PyTorchFileWriter``; needs ``file_writer``. Probe:
    ``zipwriter._probe`` (both writers on a probe sequence, byte for byte).
    Fallback: torch's ``PyTorchFileWriter`` lays out the records (slower).
``fast_pickle`` -- ``torch._utils._rebuild_tensor_v2`` / ``_rebuild_tensor_v3``,
    ``torch._utils._element_size``, ``torch._C._get_tensor_metadata``,
    ``torch.storage._new_dtypes``, ``torch.storage._dtype_to_storage_type_map``,
    ``torch.serialization.location_tag`` / ``normalize_storage_type`` (no
    underscore, undocumented), ``Tensor._backward_hooks``,
    ``UntypedStorage._cdata``, ``TypedStorage._untyped_storage`` /
    ``_pickle_storage_type()`` / ``_size()`` / ``_fake_device``; in the probe
    state ``torch._neg_view`` and ``Tensor._typed_storage()``: torchpickle's
    ``fast_capture_module`` (torch's tensor reduction without its per-tensor
    Python frames). Probe: ``torchpickle.fast_pickling_ok``'s comparison (a
    state with every dtype and view kind pickled both ways, ``data.pkl``
    identical). Fallback: torch's own ``Tensor.__reduce_ex__`` through
    ``capture_module`` (slower for many small tensors).

Load path (``fastpersist.load``; probes offered here for ``formats/torchload.py``,
``formats/torchverify.py`` and ``api.py``, which call torch directly today):

``private_load`` -- ``torch.serialization._load(zip_file, map_location,
    pickle_module, pickle_file=, overall_storage=, **pickle_load_args)`` and the
    reader interface it calls (``has_record``, ``get_record``,
    ``get_record_offset``, ``get_record_header_offset``,
    ``get_record_offset_no_read``, ``serialization_id``, ``get_all_records``,
    ``get_storage_from_record(name, nbytes, storage_type)``):
    ``formats/torchload.py`` (unpickle with torch's rules from a reader of ours
    over bytes we read). Probe: the parameters, then a weights-only call on a
    ``torch.save``'d file through a reader with exactly those methods (and with
    ``overall_storage`` where ``_load`` takes it). Fallback:
    ``torch.serialization.load``.
``private_load_weights_only`` -- ``_load``'s keyword ``weights_only`` (recent;
    torch 2.6-2.10 have none: their ``torch.load`` passes none and the unpickler
    module decides). Probe: the signature. Fallback: :func:`private_load` drops
    the argument, as that torch's ``torch.load`` does.
``file_reader`` -- ``torch._C.PyTorchFileReader(file_like)``:
    ``formats/torchverify.py`` (probes which archive versions torch reads) and
    the ``private_load`` probe. Probe: open a ``torch.save``'d ``BytesIO``, read
    ``data.pkl`` and a record offset. Fallback: ``torch.serialization.load``.
``weights_only_unpickler`` -- the module ``torch._weights_only_unpickler``
    (``Unpickler``, ``load``): ``api.load`` passes it as the pickle module when
    ``weights_only``. Probe: load a small pickle with it. Fallback:
    ``torch.serialization.load``.
``check_dill_version`` -- ``torch.serialization._check_dill_version(module)``:
    ``api.load`` (torch.load's check before unpickling with a custom module).
    Probe: call with ``pickle``. Fallback: no check (it only rejects old dill).
``default_to_weights_only`` -- ``torch.serialization._default_to_weights_only(
    pickle_module)``: ``api._resolve_weights_only``. Probe: call with ``None``,
    a bool back. Fallback: ``pickle_module is None`` (torch >= 2.6's rule).
``load_mmap_config`` -- ``torch.utils.serialization.config.load.mmap``:
    ``api.load`` (the default of ``mmap``). Probe: read it. Fallback: ``False``.

Guarded where they are used (no feature here): ``torch._guards.detect_fake_mode``
(torchload: any error means "no fake mode"), ``torch._utils._element_size``
(torchverify: sizes of storage classes named in a pickle), and the names
``torch._utils._rebuild_tensor_v2`` / ``_rebuild_parameter`` /
``_rebuild_parameter_with_state`` as strings (``formats/picklescan.py``: a
pickle naming anything else is not overlapped with the read, the safe side).
``patch.py`` uses no private name (``inspect.signature(torch.serialization.save)``
is public). ``config.py``, ``formats/base.py`` and ``bench/`` use none.

Collective saves and loads (``group=``; their exchanges in ``fastpersist.coordinator``):

``default_store`` -- ``torch.distributed.distributed_c10d._get_default_store()``:
    the default process group's rendezvous store (``set``, ``get``, ``check``,
    ``add``, ``compare_set``, ``delete_key``), where ranks leave arrival marks, the
    published verdict on which ranks are missing, and (``save_async(group=)``) the
    background status exchanges. Probe: the name is callable with no argument;
    when a default process group is initialized, the call returns an object with
    those methods. Fallback: :func:`default_store` returns None; collective
    saves and loads still work and still time out, but a timeout cannot name
    the missing ranks, and ``save_async(group=...)`` raises (it needs the store).

DCP storage layer (``fastpersist.dcp``, ``formats/dcpverify.py``): ``dcp_storage_layer``
(DCP's ``_StorageInfo`` and the ``FileSystemWriter``/``Reader`` attributes it reads;
described with its probe in the block at the end of this module).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import pickle
import struct
import sys
import threading
import zipfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from fastpersist.errors import UnsupportedLayoutError

log = logging.getLogger("fastpersist.compat")

__all__ = [
    "Status",
    "check_dill_version",
    "default_store",
    "default_to_weights_only",
    "file_reader",
    "file_writer",
    "load_mmap_default",
    "ok",
    "private_load",
    "private_save",
    "report",
    "require",
    "reset",
    "save_storage_alignment",
    "set_persistent_id",
    "skip_data",
    "status",
    "weights_only_unpickler",
]


class Unavailable(Exception):
    """Raised by a probe: the feature exists but does not behave as fastpersist needs."""


@dataclass(frozen=True)
class Status:
    """Verdict of one probe. ``reason`` is empty when ``ok``."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class _Feature:
    name: str
    probe: Callable[[], None]
    fallback: str
    level: int  # logging level of the one message when the probe fails


class _ForkSafeRLock:
    """A ``threading.RLock`` that a forked child gets back unlocked.

    A thread of the parent may hold it (planning a save, running a probe) at the
    moment another thread forks; the child has no such thread, so an inherited
    locked lock would hang its first save forever. ``os.register_at_fork`` gives
    the child a fresh lock (what a thread held is then unfinished work of the
    parent: a probe verdict not yet cached is probed again in the child).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def _after_fork_in_child(self) -> None:
        self._lock = threading.RLock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()


_FEATURES: dict[str, _Feature] = {}
_RESULTS: dict[str, Status] = {}
_LOCK = _ForkSafeRLock()  # probes may need other probes

#: Serializes changes to torch's process-wide serialization config
#: (``save.storage_alignment``): planners and the torch.save fallback take turns.
CONFIG_LOCK = _ForkSafeRLock()

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_LOCK._after_fork_in_child)
    os.register_at_fork(after_in_child=CONFIG_LOCK._after_fork_in_child)


def feature(name: str, fallback: str, level: int = logging.WARNING) -> Callable[[Callable[[], None]], Callable[[], None]]:
    def register(fn: Callable[[], None]) -> Callable[[], None]:
        _FEATURES[name] = _Feature(name, fn, fallback, level)
        return fn

    return register


def status(name: str) -> Status:
    """The (cached) verdict of feature ``name``; the probe runs on the first call."""
    res = _RESULTS.get(name)
    if res is not None:
        return res
    feat = _FEATURES[name]
    with _LOCK:
        res = _RESULTS.get(name)
        if res is None:
            try:
                with _neutral():
                    feat.probe()
                res = Status(True)
            except Exception as e:  # any surprise (AttributeError, ImportError, TypeError, ...) -> fallback
                reason = str(e) if isinstance(e, Unavailable) else f"{type(e).__name__}: {e}"
                reason = " ".join(reason.split())[:300]  # one line (pybind's TypeErrors span many)
                res = Status(False, reason)
                log.log(feat.level, "fastpersist: %s unavailable on this torch (%s); %s", name, reason, feat.fallback)
            _RESULTS[name] = res
    return res


_TLS_DEFAULTS = (("skip_data", False), ("materialize_fake_tensors", False), ("map_location", None))


@contextlib.contextmanager
def _neutral() -> Iterator[None]:
    """Run a probe as on a fresh thread, whatever the caller's context: torch's
    thread-local serialization state (``skip_data()``, ``materialize_fake_tensors``,
    ``map_location``) at its defaults, no fake-tensor mode, the CPU as default device.
    A verdict is cached for the whole process, so it must not depend on the context of
    the call that happened to probe first (a ``torch.load`` inside ``skip_data()`` once
    turned the fast load path off for good). Process-wide settings
    (``set_crc32_options``, ``torch.utils.serialization.config``) are not touched (other
    threads may be saving); the probes do not depend on them."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "serialization"):
        yield
        return
    tls = getattr(torch.serialization, "_serialization_tls", None)
    saved = []
    for name, value in _TLS_DEFAULTS:
        if tls is not None and hasattr(tls, name):
            saved.append((name, getattr(tls, name)))
            setattr(tls, name, value)
    try:
        with contextlib.ExitStack() as stack:
            try:
                from torch._subclasses.fake_tensor import unset_fake_temporarily

                stack.enter_context(unset_fake_temporarily())
            except Exception:  # noqa: BLE001 - private API: without it, no fake mode to leave
                pass
            try:
                stack.enter_context(torch.device("cpu"))
            except Exception:  # noqa: BLE001 - torch without device context managers
                pass
            yield
    finally:
        for name, value in saved:
            setattr(tls, name, value)


def ok(name: str) -> bool:
    """Whether feature ``name`` works here."""
    return status(name).ok


def require(name: str) -> None:
    """Raise :class:`UnsupportedLayoutError` (the cue to fall back to torch) unless ``name`` works."""
    st = status(name)
    if not st.ok:
        raise UnsupportedLayoutError(f"{name} unavailable on this torch ({st.reason})")


def report() -> dict[str, str]:
    """Every feature's status: ``"ok"`` or ``"fallback: <what is used instead> (<why>)"``."""
    out = {}
    for name, feat in _FEATURES.items():
        st = status(name)
        out[name] = "ok" if st.ok else f"fallback: {feat.fallback} ({st.reason})"
    return out


def reset(name: Optional[str] = None) -> None:
    """Forget the verdict of ``name`` (all features when None): the next use probes again.
    For tests that change torch under fastpersist."""
    with _LOCK:
        if name is None:
            _RESULTS.clear()
        else:
            _RESULTS.pop(name, None)


def _torch() -> Any:
    import torch

    return torch


def _saved_bytes(obj: Any) -> bytes:
    torch = _torch()
    buf = io.BytesIO()
    torch.serialization.save(obj, buf)
    return buf.getvalue()


def _params(fn: Any) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as e:
        raise Unavailable(f"no inspectable signature ({e})") from e


# --------------------------------------------------------------------------- save path

_SAVE_PARAMS = ["obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record"]


class _RecordingZip:
    """The zip writer interface ``_save`` writes through, recording the calls."""

    def __init__(self) -> None:
        self.records: dict[str, bytes] = {}
        self.metadata: dict[str, int] = {}

    def write_record(self, name: str, data: Any, nbytes: int) -> None:
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(memoryview(data).cast("B"))
        self.records[name] = raw[:nbytes]

    def write_record_metadata(self, name: str, nbytes: int) -> None:
        self.metadata[name] = nbytes


@feature("private_save", "saves use torch.save")
def _probe_private_save() -> None:
    torch = _torch()
    fn = torch.serialization._save
    params = list(_params(fn))
    if params[:5] != _SAVE_PARAMS:
        raise Unavailable(f"torch.serialization._save{tuple(params)} has an unknown signature")
    skip = torch.serialization.skip_data
    z = _RecordingZip()
    with skip():
        fn({"t": torch.arange(3, dtype=torch.float32)}, z, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    if "data.pkl" not in z.records or z.metadata != {"data/0": 12}:
        raise Unavailable(
            f"torch.serialization._save under skip_data wrote records {sorted(z.records)}, metadata {z.metadata}"
        )


def private_save() -> Callable[..., None]:
    """``torch.serialization._save``, checked; else :class:`UnsupportedLayoutError`."""
    require("private_save")
    return _torch().serialization._save


def skip_data() -> Any:
    """``torch.serialization.skip_data()`` (checked with ``private_save``)."""
    require("private_save")
    return _torch().serialization.skip_data()


@feature("storage_alignment_config", "saves use torch.save, whose storages keep torch's default alignment")
def _probe_storage_alignment_config() -> None:
    from torch.utils.serialization import config

    before = int(config.save.storage_alignment)
    other = 4096 if before != 4096 else 8192
    with CONFIG_LOCK, config.patch({"save.storage_alignment": other}):
        if int(config.save.storage_alignment) != other:
            raise Unavailable("config.patch did not change save.storage_alignment")
    if int(config.save.storage_alignment) != before:
        raise Unavailable("config.patch did not restore save.storage_alignment")


@contextlib.contextmanager
def save_storage_alignment(alignment: int, *, required: bool = True) -> Iterator[None]:
    """Hold :data:`CONFIG_LOCK` and set torch's ``save.storage_alignment`` to
    ``alignment`` for the block (the value ``_save`` records in ``.storage_alignment``
    and torch's own writer aligns storages to).

    Without that config: :class:`UnsupportedLayoutError` when ``required``, else the
    block runs unchanged (torch's default alignment; logged once).
    """
    # The verdict first: its probe takes CONFIG_LOCK itself (lock order: probes, then config).
    if not ok("storage_alignment_config"):
        if required:
            require("storage_alignment_config")
        with CONFIG_LOCK:
            yield
        return
    from torch.utils.serialization import config

    # Set and restored by hand under the lock: config.patch builds a class per call, 50-70 us
    # of every save (a few percent of a 1 MiB save).
    with CONFIG_LOCK:
        before = config.save.storage_alignment
        if before == alignment:
            yield
            return
        config.save.storage_alignment = alignment
        try:
            yield
        finally:
            config.save.storage_alignment = before


@feature("file_writer", "saves use torch.save")
def _probe_file_writer() -> None:
    torch = _torch()
    buf = io.BytesIO()
    w = torch._C.PyTorchFileWriter(buf, True, 4096)
    w.write_record("a", b"xy", 2)
    w.write_record_metadata("data/0", 8)
    w.write_end_of_file()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        infos = {i.filename.split("/", 1)[-1]: i for i in z.infolist()}
        if z.read(infos["a"].filename) != b"xy":
            raise Unavailable("PyTorchFileWriter wrote a wrong record")
        info = infos["data/0"]
        if info.file_size != 8:
            raise Unavailable(f"PyTorchFileWriter's metadata record has {info.file_size} bytes, not 8")
    raw = buf.getvalue()
    name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
    if (info.header_offset + 30 + name_len + extra_len) % 4096:
        raise Unavailable("PyTorchFileWriter ignored storage_alignment")


def file_writer(sink: Any, alignment: int) -> Any:
    """``torch._C.PyTorchFileWriter(sink, True, alignment)``, checked; else
    :class:`UnsupportedLayoutError`."""
    require("file_writer")
    return _torch()._C.PyTorchFileWriter(sink, True, alignment)


def _persistent_id_descriptor() -> Any:
    return pickle.Pickler.persistent_id


@feature("pickler_persistent_id", "saves use torch.save")
def _probe_pickler_persistent_id() -> None:
    desc = _persistent_id_descriptor()
    setter = getattr(desc, "__set__", None)
    if setter is None:
        raise Unavailable(f"pickle.Pickler.persistent_id is a {type(desc).__name__} without __set__")

    class Sub(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:  # what torch's _save defines
            return None

    buf = io.BytesIO()
    p = Sub(buf, protocol=2)
    setter(p, lambda obj: "pid" if obj == "marker" else None)
    p.dump(["marker", 1])

    class Loader(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            return ("loaded", pid)

    got = Loader(io.BytesIO(buf.getvalue())).load()
    if got != [("loaded", "pid"), 1]:
        raise Unavailable(f"the pickler ignored the per-instance persistent_id ({got!r})")


def set_persistent_id(pickler: Any, fn: Callable[[Any], Any]) -> None:
    """Make the C pickler ``pickler`` call ``fn`` for persistent ids (overriding a
    subclass method), checked; else :class:`UnsupportedLayoutError`."""
    require("pickler_persistent_id")
    _persistent_id_descriptor().__set__(pickler, fn)


# --------------------------------------------------------------------------- load path


@feature("file_reader", "loads use torch.serialization.load")
def _probe_file_reader() -> None:
    torch = _torch()
    raw = _saved_bytes({"t": torch.arange(4, dtype=torch.int32)})
    r = torch._C.PyTorchFileReader(io.BytesIO(raw))
    if not r.has_record("data.pkl") or not r.get_record("data.pkl"):
        raise Unavailable("PyTorchFileReader found no data.pkl")
    if not 0 < r.get_record_offset("data/0") < len(raw):
        raise Unavailable("PyTorchFileReader returned a record offset outside the file")


def file_reader(file_like: Any) -> Any:
    """``torch._C.PyTorchFileReader(file_like)``, checked; else :class:`UnsupportedLayoutError`."""
    require("file_reader")
    return _torch()._C.PyTorchFileReader(file_like)


class _DuckReader:
    """A zip reader that is not torch's: the methods fastpersist's own readers
    (``formats/torchload.py``'s ``_Reader``) implement, answered by a real
    ``PyTorchFileReader``. A torch whose ``_load`` calls anything else fails the probe."""

    def __init__(self, reader: Any) -> None:
        self._r = reader

    def has_record(self, name: str) -> bool:
        return self._r.has_record(name)

    def get_record(self, name: str) -> Any:
        return self._r.get_record(name)

    def get_record_offset(self, name: str) -> int:
        return self._r.get_record_offset(name)

    def get_record_header_offset(self, name: str) -> int:
        return self._r.get_record_header_offset(name)

    def get_record_offset_no_read(self, current: int, name: str, numel: int, alignment: int) -> int:
        return self._r.get_record_offset_no_read(current, name, numel, alignment)

    def serialization_id(self) -> str:
        return self._r.serialization_id()

    def get_all_records(self) -> list:
        return self._r.get_all_records()

    def get_storage_from_record(self, name: str, nbytes: int, storage_type: Any) -> Any:
        return self._r.get_storage_from_record(name, nbytes, storage_type)


@feature("private_load", "loads use torch.serialization.load")
def _probe_private_load() -> None:
    torch = _torch()
    params = _params(torch.serialization._load)
    if not {"zip_file", "map_location", "pickle_module"} <= set(params):
        raise Unavailable(f"torch.serialization._load{tuple(params)} has an unknown signature")
    require("file_reader")
    require("weights_only_unpickler")
    want = {"t": torch.arange(4, dtype=torch.int32), "v": torch.ones(3, dtype=torch.float64)[1:]}
    raw = _saved_bytes(want)
    reader = _DuckReader(torch._C.PyTorchFileReader(io.BytesIO(raw)))
    got = _load_caller(torch.serialization._load)(
        reader, "cpu", torch._weights_only_unpickler, weights_only=True, encoding="utf-8"
    )
    if not (torch.equal(got["t"], want["t"]) and torch.equal(got["v"], want["v"])):
        raise Unavailable("torch.serialization._load returned wrong values")
    if "overall_storage" in params:  # the one-buffer form (storages sliced out of one storage)
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        got = _load_caller(torch.serialization._load)(
            torch._C.PyTorchFileReader(io.BytesIO(raw)), "cpu", torch._weights_only_unpickler,
            overall_storage=data.untyped_storage(), weights_only=True, encoding="utf-8",
        )
        if not torch.equal(got["t"], want["t"]):
            raise Unavailable("torch.serialization._load with overall_storage returned wrong values")


@feature(
    "private_load_weights_only",
    "torch.serialization._load is called without weights_only, as this torch's own torch.load calls it",
    logging.DEBUG,
)
def _probe_private_load_weights_only() -> None:
    params = _params(_torch().serialization._load)
    p = params.get("weights_only")
    if p is None or p.kind not in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
        raise Unavailable("torch.serialization._load has no weights_only parameter")


def _load_caller(fn: Callable[..., Any]) -> Callable[..., Any]:
    if ok("private_load_weights_only"):
        return fn

    def call(*args: Any, weights_only: bool = False, **kwargs: Any) -> Any:
        # This torch's torch.load passes no weights_only to _load: the unpickler
        # module (torch._weights_only_unpickler or not) is what decides.
        return fn(*args, **kwargs)

    return call


def private_load() -> Callable[..., Any]:
    """``torch.serialization._load``, checked; else :class:`UnsupportedLayoutError`.

    The result takes ``weights_only=`` on every torch: where ``_load`` has no such
    parameter (torch 2.10 and older) it is dropped, as that torch's ``torch.load`` does.
    """
    require("private_load")
    return _load_caller(_torch().serialization._load)


@feature("weights_only_unpickler", "loads use torch.serialization.load")
def _probe_weights_only_unpickler() -> None:
    mod = _torch()._weights_only_unpickler
    if not (callable(getattr(mod, "Unpickler", None)) and callable(getattr(mod, "load", None))):
        raise Unavailable("torch._weights_only_unpickler has no Unpickler/load")
    if mod.Unpickler(io.BytesIO(pickle.dumps({"a": [1, 2.5]}, protocol=2)), encoding="utf-8").load() != {"a": [1, 2.5]}:
        raise Unavailable("torch._weights_only_unpickler returned wrong values")


def weights_only_unpickler() -> Any:
    """The module ``torch._weights_only_unpickler``, checked; else :class:`UnsupportedLayoutError`."""
    require("weights_only_unpickler")
    return _torch()._weights_only_unpickler


@feature("check_dill_version", "no dill version check before unpickling", logging.DEBUG)
def _probe_check_dill_version() -> None:
    _torch().serialization._check_dill_version(pickle)


def check_dill_version(pickle_module: Any) -> None:
    """torch.load's check of ``pickle_module`` (rejects old dill); a no-op without it."""
    if ok("check_dill_version"):
        _torch().serialization._check_dill_version(pickle_module)


@feature("default_to_weights_only", "weights_only defaults to (pickle_module is None)", logging.DEBUG)
def _probe_default_to_weights_only() -> None:
    got = _torch().serialization._default_to_weights_only(None)
    if not isinstance(got, bool):
        raise Unavailable(f"torch.serialization._default_to_weights_only(None) returned {got!r}")


def default_to_weights_only(pickle_module: Any) -> bool:
    """torch.load's default for ``weights_only`` given ``pickle_module``."""
    if ok("default_to_weights_only"):
        return bool(_torch().serialization._default_to_weights_only(pickle_module))
    return pickle_module is None


@feature("load_mmap_config", "mmap defaults to False", logging.DEBUG)
def _probe_load_mmap_config() -> None:
    from torch.utils.serialization import config

    if not isinstance(config.load.mmap, bool):
        raise Unavailable(f"config.load.mmap is {config.load.mmap!r}")


def load_mmap_default() -> bool:
    """``torch.utils.serialization.config.load.mmap`` (what ``torch.load`` uses when
    ``mmap`` is not given); False without that config."""
    if ok("load_mmap_config"):
        from torch.utils.serialization import config

        return bool(config.load.mmap)
    return False


# --------------------------------------------------------------------------- collective saves

_STORE_METHODS = ("set", "get", "check", "add", "compare_set", "delete_key")


@feature(
    "default_store",
    "collective timeouts cannot name the missing ranks, and save_async(group=...) is refused",
)
def _probe_default_store() -> None:
    import torch.distributed as dist

    get = dist.distributed_c10d._get_default_store
    if not callable(get):
        raise Unavailable("torch.distributed.distributed_c10d._get_default_store is not callable")
    required = [p for p in _params(get).values()
                if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required:
        raise Unavailable(f"_get_default_store takes arguments now ({', '.join(p.name for p in required)})")
    if dist.is_available() and dist.is_initialized():
        store = get()
        lacking = [m for m in _STORE_METHODS if not callable(getattr(store, m, None))]
        if lacking:
            raise Unavailable(f"the default store ({type(store).__name__}) has no {', '.join(lacking)}")


def default_store() -> Any:
    """The default process group's rendezvous store (``torch.distributed``'s private
    ``_get_default_store``), or None where this torch offers none (the feature's
    probe failed, logged once) or no default process group is initialized."""
    if not ok("default_store"):
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception as e:  # noqa: BLE001 - an initialized group without a store
        log.debug("fastpersist: no default store (%s: %s)", type(e).__name__, e)
        return None
    if any(not callable(getattr(store, m, None)) for m in _STORE_METHODS):
        return None
    return store


# --------------------------------------------------------------------------- DCP storage layer
# (fastpersist.dcp, fastpersist.formats.dcpverify; self-contained block)
#
# ``dcp_storage_layer`` -- ``torch.distributed.checkpoint.filesystem._StorageInfo``
#     (``relative_path``, ``offset``, ``length``, ``transform_descriptors``: the
#     per-item record that stock ``FileSystemReader`` looks up in ``.metadata``; our
#     files must carry exactly this class for the stock reader), the attributes of
#     ``FileSystemWriter`` / ``FileSystemReader`` that ``fastpersist.dcp`` reads
#     (``path``, ``sync_files``, ``thread_count``, ``single_file_per_rank``,
#     ``transforms.extensions``, ``serialization_format``, ``rank``,
#     ``use_collectives``; the reader's ``storage_data``) and the ``.prefix`` of the
#     plan's ``_StoragePrefix``. The per-item CRC-32 rides on the ``_StorageInfo`` as
#     an extra instance attribute (``fastpersist_crc32``), which pickling keeps and
#     stock unpickling restores without looking at it. Probe: construct both
#     classes, pickle a ``_StorageInfo`` with the attribute and read it back.
#     Fallback: ``fastpersist.dcp`` writes and reads exactly as the stock classes
#     (it calls their methods), with no CRCs.

DCP_CRC_ATTR = "fastpersist_crc32"


@feature("dcp_storage_layer", "fastpersist.dcp writes and reads through DCP's stock FileSystemWriter/Reader")
def _probe_dcp_storage_layer() -> None:
    from torch.distributed.checkpoint import filesystem as fsmod

    info = fsmod._StorageInfo("__0_0.distcp", 4032, 1234)
    setattr(info, DCP_CRC_ATTR, 0xDEADBEEF)
    back = pickle.loads(pickle.dumps(info))
    if type(back) is not fsmod._StorageInfo:
        raise Unavailable("_StorageInfo does not survive pickling")
    if (back.relative_path, back.offset, back.length) != ("__0_0.distcp", 4032, 1234):
        raise Unavailable("_StorageInfo lost its fields through pickling")
    if getattr(back, DCP_CRC_ATTR, None) != 0xDEADBEEF:
        raise Unavailable("_StorageInfo drops extra attributes when pickled")
    if getattr(back, "transform_descriptors", None):
        raise Unavailable("_StorageInfo has transform descriptors by default")
    w = fsmod.FileSystemWriter("/nonexistent-fastpersist-probe")
    for name in ("path", "sync_files", "thread_count", "single_file_per_rank", "overwrite", "transforms",
                 "serialization_format", "rank", "use_collectives"):
        if not hasattr(w, name):
            raise Unavailable(f"FileSystemWriter has no attribute {name!r}")
    if not hasattr(w.transforms, "extensions"):
        raise Unavailable("FileSystemWriter.transforms has no extensions")
    if w.serialization_format != fsmod.SerializationFormat.TORCH_SAVE:
        raise Unavailable("FileSystemWriter's default serialization format is not TORCH_SAVE")
    if fsmod._StoragePrefix("__0_").prefix != "__0_":
        raise Unavailable("_StoragePrefix has no prefix")
    r = fsmod.FileSystemReader("/nonexistent-fastpersist-probe")
    if not isinstance(getattr(r, "storage_data", None), dict):
        raise Unavailable("FileSystemReader has no storage_data dict")


def dcp_storage_info(relative_path: str, offset: int, length: int, crc: Optional[int]) -> Any:
    """A stock ``_StorageInfo`` for an item, carrying ``crc`` (checked feature)."""
    require("dcp_storage_layer")
    from torch.distributed.checkpoint import filesystem as fsmod

    info = fsmod._StorageInfo(relative_path, offset, length)
    if crc is not None:
        setattr(info, DCP_CRC_ATTR, int(crc))
    return info


def dcp_storage_crc(info: Any) -> Optional[int]:
    """The CRC-32 fastpersist recorded on a ``_StorageInfo``; None for stock checkpoints."""
    crc = getattr(info, DCP_CRC_ATTR, None)
    return int(crc) if isinstance(crc, int) else None
