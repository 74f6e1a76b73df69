"""fastpersist._compat: every private torch/CPython name is probed once, and a probe
that fails (missing name, changed signature, changed behaviour) turns into the
documented fallback with a logged reason, never into a failed save."""

from __future__ import annotations

import inspect
import io
import logging
import os
import pickle
import sys
import threading

import pytest
import torch

import fastpersist
from fastpersist import _compat
from fastpersist.errors import UnsupportedLayoutError
from fastpersist.formats import torchpickle, torchstream

LOGGER = "fastpersist.compat"


@pytest.fixture
def fresh(monkeypatch):
    """Forget every verdict for the test (the process's verdicts come back after it)."""
    monkeypatch.setattr(_compat, "_RESULTS", {})
    return monkeypatch


def _state():
    base = torch.arange(12, dtype=torch.float32)
    return {"w": base.view(3, 4), "view": base[2:7], "b": torch.ones(5, dtype=torch.int64), "step": 3}


def _save_and_check(tmp_path, caplog, feature: str, reason_part: str) -> None:
    """fastpersist.save goes through torch's writer, the file loads with torch.load
    with equal values, and the reason is logged once and reported."""
    calls = []
    real_save = torch.serialization.save

    def spy(*args, **kwargs):
        calls.append(args[1] if len(args) > 1 else kwargs.get("f"))
        return real_save(*args, **kwargs)

    state = _state()
    path = tmp_path / "ckpt.pt"
    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.DEBUG, logger=LOGGER):
        mp.setattr(torch.serialization, "save", spy)
        fastpersist.save(state, path)
        fastpersist.save(state, path)  # a second save: the probe is not run again, nothing logged again
    assert len(calls) == 2, "the save did not fall back to torch's writer"
    got = torch.load(path, weights_only=True)
    assert got.keys() == state.keys()
    for k in ("w", "view", "b"):
        assert torch.equal(got[k], state[k])
    assert got["step"] == 3
    assert got["w"].untyped_storage().data_ptr() == got["view"].untyped_storage().data_ptr()
    msgs = [r.getMessage() for r in caplog.records if r.name == LOGGER and feature in r.getMessage()]
    assert len(msgs) == 1, msgs
    assert reason_part in msgs[0]
    assert _compat.report()[feature].startswith("fallback: ")
    assert reason_part in _compat.report()[feature]


# ---------------------------------------------------------------- this torch


def _dcp_has_serialization_format() -> bool:
    from torch.distributed.checkpoint import FileSystemWriter

    return hasattr(FileSystemWriter("/nonexistent-fastpersist-probe"), "serialization_format")


def test_every_probe_passes_on_this_torch():
    rep = _compat.report()
    assert set(rep) == set(_compat._FEATURES)
    for name, st in rep.items():
        if name == "private_load_weights_only" and "weights_only" not in inspect.signature(torch.serialization._load).parameters:
            continue  # older torch (2.10 and before): its own torch.load passes none either
        if name == "dcp_storage_layer" and not _dcp_has_serialization_format():
            continue  # older torch (2.7): DCP writers without serialization_format; fastpersist.dcp uses stock
        assert st == "ok", (name, st)


def test_inventory_documents_every_feature():
    doc = _compat.__doc__
    for name in _compat._FEATURES:
        assert f"``{name}``" in doc, name


def test_accessors_return_torchs_objects():
    assert _compat.private_save() is torch.serialization._save
    assert _compat.weights_only_unpickler() is torch._weights_only_unpickler
    w = _compat.file_writer(io.BytesIO(), 4096)
    assert isinstance(w, torch._C.PyTorchFileWriter)
    assert _compat.default_to_weights_only(None) is True
    assert _compat.load_mmap_default() is False
    _compat.check_dill_version(pickle)


def test_each_probe_runs_once_even_from_many_threads(fresh):
    feat = _compat._FEATURES["pickler_persistent_id"]
    calls = []
    started = threading.Barrier(8)

    def counting():
        calls.append(1)
        feat.probe()

    fresh.setitem(_compat._FEATURES, feat.name, _compat._Feature(feat.name, counting, feat.fallback, feat.level))

    def worker():
        started.wait()
        for _ in range(50):
            assert _compat.ok(feat.name)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [1]


def test_streamed_save_uses_the_fast_path_here(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("fell back to torch.save although every probe passed")

    monkeypatch.setattr(torch.serialization, "save", refuse)
    fastpersist.save(_state(), tmp_path / "fast.pt")
    assert torch.equal(torch.load(tmp_path / "fast.pt", weights_only=True)["b"], torch.ones(5, dtype=torch.int64))


# ---------------------------------------------------------------- save path fallbacks


def test_private_save_changed_contract_falls_back(tmp_path, caplog, fresh):
    real = torch.serialization._save
    writer_type = torch._C.PyTorchFileWriter

    def changed(obj, zip_file, pickle_module, pickle_protocol, _disable_byteorder_record):
        # a torch whose _save wants its own writer: torch.save still works, our proxy does not
        if not isinstance(zip_file, writer_type):
            raise TypeError("_save() argument 'zip_file' must be PyTorchFileWriter")
        return real(obj, zip_file, pickle_module, pickle_protocol, _disable_byteorder_record)

    fresh.setattr(torch.serialization, "_save", changed)
    _save_and_check(tmp_path, caplog, "private_save", "TypeError: _save() argument 'zip_file'")


def test_private_save_renamed_parameters_fall_back(tmp_path, caplog, fresh):
    real = torch.serialization._save

    def renamed(obj, f, pickle_module, protocol, disable_byteorder):
        return real(obj, f, pickle_module, protocol, disable_byteorder)

    fresh.setattr(torch.serialization, "_save", renamed)
    _save_and_check(tmp_path, caplog, "private_save", "unknown signature")


def test_private_save_missing_is_refused(fresh):
    fresh.delattr(torch.serialization, "_save")  # (torch.save itself needs it too: no end-to-end save here)
    with pytest.raises(UnsupportedLayoutError, match="private_save unavailable"):
        torchstream.stream_torch(
            _state(), 4096, lambda batch: None, host_bytes=lambda s, keep: s.data_ptr(),
            capture_module=torchpickle.capture_module,
        )
    assert "AttributeError" in _compat.report()["private_save"]


def test_file_writer_without_alignment_argument_falls_back(tmp_path, caplog, fresh):
    real = torch._C.PyTorchFileWriter

    def old_writer(f, *args):
        # torch 2.6: no storage_alignment; here only torch.save's own calls work (a file
        # name, or the real file the fallback opens), not fastpersist's probe and sinks
        if not isinstance(f, (str, io.BufferedWriter)):
            raise TypeError("__init__(): incompatible constructor arguments")
        return real(f, *args)

    fresh.setattr(torch._C, "PyTorchFileWriter", old_writer)
    _save_and_check(tmp_path, caplog, "file_writer", "incompatible constructor arguments")
    assert _compat.report()["zip_layout"].startswith("fallback: ")


def test_read_only_persistent_id_falls_back(tmp_path, caplog, fresh):
    # CPython 3.13.0: Pickler.persistent_id could not be set per instance
    fresh.setattr(_compat, "_persistent_id_descriptor", lambda: pickle._Pickler.persistent_id)
    _save_and_check(tmp_path, caplog, "pickler_persistent_id", "without __set__")


def test_ignored_persistent_id_falls_back(tmp_path, caplog, fresh):
    class Ignored:
        def __set__(self, obj, value):  # accepted, never consulted
            pass

    fresh.setattr(_compat, "_persistent_id_descriptor", lambda: Ignored())
    _save_and_check(tmp_path, caplog, "pickler_persistent_id", "ignored the per-instance persistent_id")


def test_missing_serialization_config_refuses_the_fast_path(fresh):
    fresh.setitem(sys.modules, "torch.utils.serialization", None)  # torch 2.6: no such module
    st = _compat.status("storage_alignment_config")
    assert not st.ok and "ModuleNotFoundError" in st.reason
    with pytest.raises(UnsupportedLayoutError, match="unavailable on this torch"):
        torchstream.stream_torch(
            _state(), 4096, lambda batch: None, host_bytes=lambda s, keep: s.data_ptr(),
            capture_module=torchpickle.capture_module,
        )
    with pytest.raises(UnsupportedLayoutError, match="storage_alignment_config unavailable"):
        with _compat.save_storage_alignment(4096):
            pass
    ran = []
    with _compat.save_storage_alignment(4096, required=False):  # what torch.save's fallback needs
        ran.append(1)
    assert ran == [1]


def test_fast_pickle_probe_failure_uses_torchs_pickling(tmp_path, caplog, fresh):
    def changed():
        raise TypeError("_rebuild_tensor_v2() takes 7 positional arguments but 8 were given")

    fresh.setattr(torchpickle, "_compare_fast_pickling", changed)
    used = []
    real = torchpickle.capture_module
    fresh.setattr(torchpickle, "capture_module", lambda on_new=None: used.append(1) or real(on_new))
    state = _state()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        fastpersist.save(state, tmp_path / "plain.pt")
    assert used, "torch's own pickling was not used"
    got = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert torch.equal(got["w"], state["w"])
    assert any("fast_pickle" in r.getMessage() and "takes 7 positional" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- load-side probes


def test_private_load_without_weights_only_parameter_drops_it(fresh):
    real = torch.serialization._load

    def old_load(zip_file, map_location, pickle_module, pickle_file="data.pkl", overall_storage=None, **pickle_load_args):
        if "weights_only" in pickle_load_args:
            raise TypeError("Unpickler() got an unexpected keyword argument 'weights_only'")
        return real(zip_file, map_location, pickle_module, pickle_file, overall_storage, **pickle_load_args)

    fresh.setattr(torch.serialization, "_load", old_load)
    assert _compat.ok("private_load")
    assert not _compat.ok("private_load_weights_only")
    buf = io.BytesIO()
    torch.save({"x": torch.arange(3)}, buf)
    raw = buf.getvalue()
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    got = _compat.private_load()(
        _compat.file_reader(io.BytesIO(raw)), None, _compat.weights_only_unpickler(),
        overall_storage=data.untyped_storage(), weights_only=True, encoding="utf-8",
    )
    assert torch.equal(got["x"], torch.arange(3))


def test_private_load_with_unknown_signature_is_refused(fresh, caplog):
    def newer(archive, location, unpickler, **kwargs):
        raise AssertionError("not to be called")

    fresh.setattr(torch.serialization, "_load", newer)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with pytest.raises(UnsupportedLayoutError, match="unknown signature"):
            _compat.private_load()
    assert any("private_load" in r.getMessage() for r in caplog.records)


def test_private_load_asking_more_of_the_reader_is_refused(fresh):
    real = torch.serialization._load

    def newer(zip_file, map_location, pickle_module, *args, **kwargs):
        zip_file.get_record_crc32("data.pkl")  # a reader method our readers lack
        return real(zip_file, map_location, pickle_module, *args, **kwargs)

    fresh.setattr(torch.serialization, "_load", newer)
    assert not _compat.ok("private_load")
    assert "get_record_crc32" in _compat.status("private_load").reason


def test_small_load_helpers_fall_back(fresh):
    fresh.delattr(torch.serialization, "_check_dill_version")
    fresh.delattr(torch.serialization, "_default_to_weights_only")
    _compat.check_dill_version(pickle)  # no check, no error
    assert _compat.default_to_weights_only(None) is True
    assert _compat.default_to_weights_only(pickle) is False
    assert _compat.report()["check_dill_version"].startswith("fallback: ")


def test_weights_only_unpickler_missing_is_refused(fresh):
    fresh.delattr(torch, "_weights_only_unpickler")
    with pytest.raises(UnsupportedLayoutError, match="weights_only_unpickler"):
        _compat.weights_only_unpickler()
    assert not _compat.ok("private_load")


# ---------------------------------------------------------------- fork


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("lock", ["_LOCK", "CONFIG_LOCK"])
def test_child_forked_while_a_thread_holds_a_compat_lock_gets_it_unlocked(lock):
    held, release = threading.Event(), threading.Event()

    def holder():  # a probe running, or a save being planned, at the moment of the fork
        with getattr(_compat, lock):
            held.set()
            release.wait()

    t = threading.Thread(target=holder, daemon=True)
    t.start()
    held.wait()
    try:
        pid = os.fork()
        if pid == 0:  # child: both locks must be free, or this would hang
            code = 0 if getattr(_compat, lock).acquire(timeout=5) else 3
            os._exit(code)
    finally:
        release.set()
        t.join()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


# ---------------------------------------------------------------- collective saves: the rendezvous store


def test_default_store_is_none_without_a_process_group():
    if torch.distributed.is_initialized():  # pragma: no cover
        pytest.skip("a process group is initialized in this process")
    assert _compat.ok("default_store")
    assert _compat.default_store() is None


def test_default_store_returns_the_groups_store(fresh):
    dist = torch.distributed
    store = dist.HashStore()
    fresh.setattr(dist, "is_initialized", lambda: True)
    fresh.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    assert _compat.default_store() is store
    assert _compat.report()["default_store"] == "ok"


@pytest.mark.parametrize("case", ["missing", "takes-arguments", "not-a-store"])
def test_default_store_changed_falls_back_with_a_reason(fresh, caplog, case):
    dist = torch.distributed
    fresh.setattr(dist, "is_initialized", lambda: True)
    if case == "missing":
        fresh.delattr(dist.distributed_c10d, "_get_default_store")
        reason = "_get_default_store"
    elif case == "takes-arguments":
        fresh.setattr(dist.distributed_c10d, "_get_default_store", lambda group: dist.HashStore())
        reason = "takes arguments now (group)"
    else:
        fresh.setattr(dist.distributed_c10d, "_get_default_store", lambda: object())
        reason = "has no set, get, check, add, compare_set, delete_key"
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        assert _compat.default_store() is None
        assert _compat.default_store() is None  # probed once, logged once
    msgs = [r.getMessage() for r in caplog.records if r.name == LOGGER and "default_store" in r.getMessage()]
    assert len(msgs) == 1 and reason in msgs[0], msgs
    assert _compat.report()["default_store"].startswith("fallback: collective timeouts cannot name the missing ranks")


def test_distributed_reaches_the_store_only_through_compat():
    import fastpersist.coordinator as d

    src = inspect.getsource(d)
    assert "_get_default_store" not in src
    assert "_compat.default_store()" in src
