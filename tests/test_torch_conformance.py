"""The torch.save/torch.load switch behaves as stock torch where torch users can tell
(issue 23, cases 7-10 and 14): files torch writes or changes through its own API load
as torch loads them, torch's serialization settings are honoured, the fast path's
verdicts do not depend on the caller's context, torch's exception types are kept, and
new files get the permissions ``open(path, "wb")`` gives them.

Every comparison is against stock torch in the same process (``torch.serialization``'s
own ``save``/``load``, which the switch never replaces).
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import fastpersist
from fastpersist import _compat
from fastpersist.errors import ChecksumError
from subprocs import flip_byte  # tests/ is on sys.path

stock_save = torch.serialization.save
stock_load = torch.serialization.load


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(23)
    return {
        "w": torch.randn(64, 32, generator=g),
        "b": torch.arange(7, dtype=torch.int64),
        "h": torch.randn(5, generator=g).to(torch.bfloat16),
        "step": 3,
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


@pytest.fixture
def switch() -> Iterator[None]:
    with fastpersist.patch_torch_save():
        yield


@contextlib.contextmanager
def crc32_off() -> Iterator[None]:
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _record_offset(path: Path, short: str) -> int:
    return torch._C.PyTorchFileReader(str(path)).get_record_offset(short)


# --------------------------------------------------------------------------- case 7: torch's own files load


def test_crc32_off_file_written_by_torch_loads_as_stock(tmp_path: Path, switch: None) -> None:
    p = tmp_path / "nocrc.pt"
    with crc32_off():
        stock_save(_state(), p)
    with zipfile.ZipFile(p) as z:
        assert {i.CRC for i in z.infolist()} == {0}
    assert _equal(torch.load(p), stock_load(p))
    assert _equal(fastpersist.load(p), stock_load(p))
    assert _equal(torch.load(p, mmap=True), stock_load(p, mmap=True))


def test_verify_calls_a_file_without_crcs_unchecked(tmp_path: Path) -> None:
    p = tmp_path / "nocrc.pt"
    with crc32_off():
        stock_save(_state(), p)
    result = fastpersist.verify(p)
    assert result.status == "unchecked" and not result.ok, result


def test_skip_data_file_written_by_torch_loads_as_stock(tmp_path: Path, switch: None) -> None:
    p = tmp_path / "skipped.pt"
    with torch.serialization.skip_data():
        stock_save(_state(), p)
    assert _equal(torch.load(p), stock_load(p))
    assert _equal(torch.load(p, mmap=True), stock_load(p, mmap=True))


@pytest.mark.parametrize("writer", ["switch", "torch"])
def test_map_shared_change_through_torch_is_loaded(tmp_path: Path, switch: None, writer: str) -> None:
    """torch's documented in-place update: mmap=True with MAP_SHARED, write into the tensor."""
    p = tmp_path / "shared.pt"
    (torch.save if writer == "switch" else stock_save)({"a": torch.zeros(1024), "b": torch.ones(3)}, p)
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        sd = torch.load(p, mmap=True)
        sd["a"].add_(5)
        del sd
    want = stock_load(p)
    assert torch.equal(want["a"], torch.full((1024,), 5.0))
    assert _equal(torch.load(p), want)
    assert _equal(fastpersist.load(p), want)
    assert _equal(torch.load(p, mmap=True), want)


def test_map_shared_release_keeps_the_archive_consistent(tmp_path: Path, switch: None) -> None:
    p = tmp_path / "released.pt"
    torch.save({"a": torch.zeros(16)}, p)
    with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
        torch.load(p, mmap=True)
    with zipfile.ZipFile(p) as z:
        assert z.testzip() is None  # every record, the rewritten serialization id included, matches its CRC
    assert fastpersist.verify(p).ok


def test_corruption_in_a_file_fastpersist_wrote_is_still_caught(tmp_path: Path, switch: None) -> None:
    p = tmp_path / "ours.pt"
    torch.save(_state(), p)
    flip_byte(p, _record_offset(p, "data/0") + 10, 0x01)
    with pytest.raises(ChecksumError):
        torch.load(p)
    with pytest.raises(ChecksumError):
        fastpersist.load(p)
    with pytest.raises(ChecksumError):
        torch.load(p, mmap=True)


def test_corrupt_pickle_of_a_torch_file_is_still_caught(tmp_path: Path, switch: None) -> None:
    """Nothing of torch's changes data.pkl in place: a mismatch there is corruption."""
    p = tmp_path / "theirs.pt"
    stock_save({"note": "x" * 200, "t": torch.ones(4)}, p)
    pkl = _record_offset(p, "data.pkl")
    raw = p.read_bytes()
    flip_byte(p, raw.index(b"xxxx", pkl) + 5, 0x01)
    with pytest.raises(ChecksumError):
        fastpersist.load(p, weights_only=False)


# --------------------------------------------------------------------------- case 8: torch's settings


def _pair(tmp_path: Path, name: str, save_args: tuple = (), **kwargs: Any) -> tuple[Path, Path]:
    """The same state saved by the switch and by stock torch (same base name: torch names
    the archive folder after the file)."""
    (tmp_path / "switch").mkdir(exist_ok=True)
    (tmp_path / "stock").mkdir(exist_ok=True)
    ours, theirs = tmp_path / "switch" / name, tmp_path / "stock" / name
    state = _state()
    with fastpersist.patch_torch_save():
        torch.save(state, ours, *save_args, **kwargs)
    stock_save(state, theirs, *save_args, **kwargs)
    return ours, theirs


def test_crc32_option_off_is_honoured(tmp_path: Path) -> None:
    with crc32_off():
        ours, theirs = _pair(tmp_path, "a.pt")
    with zipfile.ZipFile(ours) as z:
        assert {i.CRC for i in z.infolist()} == {0}
    assert ours.read_bytes() == theirs.read_bytes()
    assert _equal(stock_load(ours), stock_load(theirs))


def test_skip_data_save_is_honoured(tmp_path: Path) -> None:
    with torch.serialization.skip_data():
        ours, theirs = _pair(tmp_path, "a.pt")
    assert ours.read_bytes() == theirs.read_bytes()
    assert _equal(stock_load(ours), stock_load(theirs))


@pytest.mark.parametrize("alignment", [8192, 1 << 16])
def test_storage_alignment_power_of_two_is_honoured(tmp_path: Path, alignment: int) -> None:
    from torch.utils.serialization import config

    with config.patch({"save.storage_alignment": alignment}):
        ours, theirs = _pair(tmp_path, "a.pt")
    reader = torch._C.PyTorchFileReader(str(ours))
    assert reader.get_record(".storage_alignment") == str(alignment).encode()
    for name in reader.get_all_records():
        if name.startswith("data/"):
            assert reader.get_record_offset(name) % alignment == 0
    assert _equal(stock_load(ours), stock_load(theirs))
    with config.patch({"load.calculate_storage_offsets": True}):
        assert _equal(stock_load(ours, mmap=True), stock_load(theirs))


def test_storage_alignment_other_value_goes_to_torch(tmp_path: Path) -> None:
    from torch.utils.serialization import config

    with config.patch({"save.storage_alignment": 100}):
        ours, theirs = _pair(tmp_path, "a.pt")
    assert ours.read_bytes() == theirs.read_bytes()


def test_pinned_d2h_option_changes_nothing_written(tmp_path: Path) -> None:
    from torch.utils.serialization import config

    with config.patch({"save.use_pinned_memory_for_d2h": True}):
        ours, theirs = _pair(tmp_path, "a.pt")
    assert _equal(stock_load(ours), stock_load(theirs))


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((), {"_use_new_zipfile_serialization": False}),
        ((), {"pickle_protocol": 4}),
        ((pickle, 3), {}),
        ((), {"_disable_byteorder_record": True}),
    ],
)
def test_save_arguments_torch_writes_are_torch_bytes(tmp_path: Path, args: tuple, kwargs: dict) -> None:
    ours, theirs = _pair(tmp_path, "a.pt", args, **kwargs)
    assert ours.read_bytes() == theirs.read_bytes()
    assert _equal(stock_load(ours, weights_only=False), stock_load(theirs, weights_only=False))


# --------------------------------------------------------------------------- case 9: probes ignore the context


def test_first_load_inside_skip_data_does_not_turn_the_fast_path_off(tmp_path: Path, switch: None,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "a.pt"
    torch.save(_state(), p)
    _compat.reset()
    with torch.serialization.skip_data():
        got = torch.load(p)
        assert _equal(got, stock_load(p)) or got["w"].shape == (64, 32)  # torch's skip_data load
        fastpersist.load(p)  # the direct API too
    assert _compat.ok("private_load"), _compat.report()["private_load"]
    calls = []
    real = torch.serialization.load

    def counting(*a: Any, **k: Any) -> Any:
        calls.append(a[0] if a else k.get("f"))
        return real(*a, **k)

    monkeypatch.setattr(torch.serialization, "load", counting)
    assert _equal(torch.load(p), _state())
    assert calls == []  # the fast path, not torch's


def test_skip_data_load_through_switch_is_torchs(tmp_path: Path, switch: None) -> None:
    p = tmp_path / "a.pt"
    torch.save({"t": torch.ones(8)}, p)
    with torch.serialization.skip_data():
        got = torch.load(p)
    assert got["t"].shape == (8,)  # storages allocated, not filled: whatever torch returns


# --------------------------------------------------------------------------- case 10: torch's exception types


def _stock_error(fn: Any) -> type:
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value)


def test_save_into_missing_directory_raises_runtime_error(tmp_path: Path, switch: None) -> None:
    target = tmp_path / "missing" / "a.pt"
    assert issubclass(_stock_error(lambda: stock_save(torch.ones(2), target)), RuntimeError)
    with pytest.raises(RuntimeError) as info:
        torch.save(torch.ones(2), target)
    assert isinstance(info.value, FileNotFoundError)  # fastpersist's type too
    assert "missing" in str(info.value)
    with pytest.raises(RuntimeError):
        torch.save(torch.ones(2), str(target))


def test_save_to_a_directory_raises_runtime_error(tmp_path: Path, switch: None) -> None:
    assert issubclass(_stock_error(lambda: stock_save(torch.ones(2), tmp_path)), RuntimeError)
    with pytest.raises(RuntimeError) as info:
        torch.save(torch.ones(2), tmp_path)
    assert isinstance(info.value, OSError)


def test_load_of_a_damaged_zip_raises_runtime_error(tmp_path: Path, switch: None) -> None:
    p = tmp_path / "bad.pt"
    p.write_bytes(b"PK\x03\x04garbage" * 10)
    assert issubclass(_stock_error(lambda: stock_load(p)), RuntimeError)
    with pytest.raises(RuntimeError):
        torch.load(p)
    q = tmp_path / "cut.pt"
    stock_save(_state(), q)
    for cut in (30, 200):
        q.write_bytes(q.read_bytes()[:-cut])
        with pytest.raises(_stock_error(lambda: stock_load(q))):  # whatever stock raises, or a subclass
            torch.load(q)


def test_load_of_missing_file_and_directory_keep_torchs_types(tmp_path: Path, switch: None) -> None:
    for target in (tmp_path / "nothing.pt", tmp_path):
        want = _stock_error(lambda: stock_load(target))
        with pytest.raises(want):
            torch.load(target)


def test_dual_exceptions_pickle(tmp_path: Path, switch: None) -> None:
    with pytest.raises(RuntimeError) as info:
        torch.save(torch.ones(2), tmp_path / "missing" / "a.pt")
    back = pickle.loads(pickle.dumps(info.value))
    assert type(back) is type(info.value) and back.filename == info.value.filename


def _as_nobody(fn: Any) -> str:
    """Run ``fn()`` in a forked child that dropped root for uid/gid 65534; the name of
    the exception's classes it raised (their MRO, comma-separated), or "none"."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        out = "none"
        try:
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            fn()
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = ",".join(c.__name__ for c in type(e).__mro__)
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    got = b""
    while chunk := os.read(r, 4096):
        got += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return got.decode()


def test_save_into_unwritable_file_raises_runtime_error() -> None:
    """Permission denied: torch.save into a write-protected file, as a user that is not root
    (in a directory under the system temp dir: pytest's own is closed to other users)."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="fp-perm-"))
    d.chmod(0o777)
    try:
        _unwritable(d)
    finally:
        shutil.rmtree(d)


def _unwritable(tmp_path: Path) -> None:
    # Everything the calls import lazily is imported here first: the child, as uid 65534,
    # may not be allowed to read the Python installation.
    with fastpersist.patch_torch_save():
        torch.save(torch.ones(2), tmp_path / "warm.pt")
        torch.load(tmp_path / "warm.pt")
    p = tmp_path / "ro.pt"
    p.write_bytes(b"old")
    p.chmod(0o444)
    stock = _as_nobody(lambda: stock_save(torch.ones(2), p))
    assert "RuntimeError" in stock.split(","), stock

    def patched() -> None:
        with fastpersist.patch_torch_save():
            torch.save(torch.ones(2), p)

    got = _as_nobody(patched)
    assert "RuntimeError" in got.split(",") and "PermissionError" in got.split(","), got
    assert p.read_bytes() == b"old"

    # and a file that cannot be read: torch's PermissionError on load either way
    q = tmp_path / "secret.pt"
    stock_save(torch.ones(2), q)
    q.chmod(0o000)

    def patched_load() -> None:
        with fastpersist.patch_torch_save():
            torch.load(q)

    stock = _as_nobody(lambda: stock_load(q))
    assert stock.split(",")[0] == "PermissionError", stock
    assert "PermissionError" in _as_nobody(patched_load).split(",")


# --------------------------------------------------------------------------- case 14: file modes


def _mode(p: Path) -> int:
    return p.stat().st_mode & 0o777


def _make_all(d: Path) -> list[Path]:
    """One file of every kind fastpersist creates as a checkpoint, in ``d``."""
    state = {"t": torch.arange(10.0)}
    with fastpersist.patch_torch_save():
        torch.save(state, d / "switch.pt")
    fastpersist.save(state, d / "api.pt")
    fastpersist.save(state, d / "st.safetensors")
    fastpersist.save_async(state, d / "async.pt").wait()
    made = [d / "switch.pt", d / "api.pt", d / "st.safetensors", d / "async.pt"]
    import torch.distributed.checkpoint as dcp

    try:
        from fastpersist.dcp import FastPersistWriter
    except ImportError:  # the DCP layer needs a newer torch (FileSystemWriter's serialization_format)
        return made
    dcp.save({"m": torch.arange(5.0)}, storage_writer=FastPersistWriter(d / "dcp"), no_dist=True)
    return made + sorted((d / "dcp").iterdir())


@pytest.mark.parametrize("mask", [0o002, 0o022, 0o077])
def test_new_files_get_open_wb_permissions(tmp_path: Path, mask: int) -> None:
    with umask(mask):
        with open(tmp_path / "reference", "wb"):
            pass
        stock_save(torch.ones(1), tmp_path / "stock.pt")
        want = 0o666 & ~mask
        assert _mode(tmp_path / "reference") == want == _mode(tmp_path / "stock.pt")
        d = tmp_path / "out"
        d.mkdir()
        for p in _make_all(d):
            assert _mode(p) == want, (p.name, oct(_mode(p)), oct(want))


def test_collective_save_file_gets_open_wb_permissions(tmp_path: Path) -> None:
    import torch.distributed as dist

    store = tmp_path / "store"
    with umask(0o002):
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        try:
            fastpersist.save({"t": torch.ones(4)}, tmp_path / "group.pt", group=dist.group.WORLD)
        finally:
            dist.destroy_process_group()
    assert _mode(tmp_path / "group.pt") == 0o664


@pytest.mark.parametrize("mask", [0o002, 0o077])
def test_overwrite_keeps_the_existing_mode_as_torch_does(tmp_path: Path, mask: int) -> None:
    with umask(mask):
        for name, save in (("stock.pt", stock_save), ("ours.pt", fastpersist.save)):
            p = tmp_path / name
            p.write_bytes(b"old")
            p.chmod(0o640)
            save({"t": torch.ones(2)}, p)
            assert _mode(p) == 0o640, name


def test_every_fastpersist_writer_marks_its_files(tmp_path: Path) -> None:
    """Files of the async and collective saves are fastpersist's too: their CRCs bind loads
    (crcpolicy rule 2), so a flipped storage byte raises, where torch's file would load."""
    import torch.distributed as dist

    state = _state()
    fastpersist.save_async(state, tmp_path / "async.pt").wait()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        fastpersist.save(state, tmp_path / "group.pt", group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    for name in ("async.pt", "group.pt"):
        p = tmp_path / name
        flip_byte(p, _record_offset(p, "data/0") + 3, 0x01)
        with pytest.raises(ChecksumError):
            fastpersist.load(p)


def test_directory_sync_error_keeps_its_type_through_the_switch(tmp_path: Path, switch: None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """DirectorySyncError says "the new file is in place": the switch must not recast it."""
    import errno

    from fastpersist import commit
    from fastpersist.errors import DirectorySyncError

    def failing(directory: str) -> None:
        raise OSError(errno.EIO, "injected", directory)

    monkeypatch.setattr(commit, "fsync_dir", failing)
    with pytest.raises(DirectorySyncError) as info:
        torch.save({"t": torch.ones(2)}, tmp_path / "a.pt")
    assert type(info.value) is DirectorySyncError
    assert torch.equal(stock_load(tmp_path / "a.pt")["t"], torch.ones(2))
