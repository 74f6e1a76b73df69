"""The ``torch.save`` switch writes into open files (issue 27): ``with open(name, "wb") as f:
torch.save(state, f)`` goes through fastpersist, byte for byte what a path save writes,
with the file object left where torch leaves it; every other file-like object goes to torch."""

from __future__ import annotations

import errno
import io
import os
import pickle
import tempfile
import threading
import types
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

import fastpersist
from fastpersist import openfile, patch
from fastpersist.testing import inject_fault

ORIGINAL_SAVE = torch.serialization.save
ORIGINAL_LOAD = torch.serialization.load


@pytest.fixture(autouse=True)
def _unpatched() -> Iterator[None]:
    fastpersist.unpatch_torch_save()
    yield
    fastpersist.unpatch_torch_save()
    torch.save, torch.load = ORIGINAL_SAVE, ORIGINAL_LOAD


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The descriptors the switch wrote into itself (``openfile.save_into_fd`` calls)."""
    seen: list[int] = []
    real = openfile.save_into_fd

    def spy(obj: Any, fd: int, **kw: Any) -> int:
        seen.append(fd)
        return real(obj, fd, **kw)

    monkeypatch.setattr(openfile, "save_into_fd", spy)
    return seen


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 33, generator=g)
    return {
        "w": base,
        "view": base[3:9, 1:],  # a view sharing base's storage
        "i8": torch.randint(-100, 100, (5000,), dtype=torch.int8, generator=g),
        "bf16": torch.randn(17, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0),
        "meta": {"step": 7, "name": "x", "lr": 1e-3},
    }


def _assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    else:
        assert a == b


def _path_bytes(obj: Any, directory: Path) -> bytes:
    ref = directory / "by-path.pt"
    fastpersist.save(obj, ref)
    return ref.read_bytes()


def _stock_bytes(obj: Any, directory: Path) -> bytes:
    ref = directory / "stock.pt"
    with open(ref, "wb") as f:
        ORIGINAL_SAVE(obj, f)
    return ref.read_bytes()


# ------------------------------------------------------------------------ taken


def _open_wb(p: Path) -> Any:
    return open(p, "wb")


def _open_w_plus(p: Path) -> Any:
    return open(p, "w+b")


def _open_xb(p: Path) -> Any:
    return open(p, "xb")


def _open_unbuffered(p: Path) -> Any:
    return open(p, "wb", buffering=0)


def _open_r_plus_empty(p: Path) -> Any:
    p.write_bytes(b"")
    return open(p, "r+b")


def _open_fsspec(p: Path) -> Any:
    fsspec = pytest.importorskip("fsspec")
    return fsspec.open(f"file://{p}", "wb").open()


def _open_fsspec_no_autocommit(p: Path) -> Any:
    pytest.importorskip("fsspec")
    from fsspec.implementations.local import LocalFileSystem

    return LocalFileSystem().open(str(p), "wb", autocommit=False)


TAKEN: dict[str, Callable[[Path], Any]] = {
    "wb": _open_wb,
    "w+b": _open_w_plus,
    "xb": _open_xb,
    "wb-buffering0": _open_unbuffered,
    "r+b-empty": _open_r_plus_empty,
    "fsspec-local": _open_fsspec,
    "fsspec-local-no-autocommit": _open_fsspec_no_autocommit,
}


@pytest.mark.parametrize("kind", sorted(TAKEN))
def test_open_file_written_by_fastpersist(kind: str, tmp_path: Path, calls: list[int]) -> None:
    """The file holds exactly what ``fastpersist.save`` writes to a path (not what stock
    torch writes), stock ``torch.load`` reads it back equal, and the object's position is
    the archive's end: writing more and closing behave as after stock torch."""
    obj = _state()
    expected = _path_bytes(obj, tmp_path)
    assert expected != _stock_bytes(obj, tmp_path)  # the two writers are told apart by bytes
    target = tmp_path / "ckpt.pt"
    fastpersist.patch_torch_save()
    f = TAKEN[kind](target)
    try:
        torch.save(obj, f)
        assert f.tell() == len(expected)
        f.write(b"TRAILER")
        assert f.tell() == len(expected) + 7
    finally:
        f.close()
    if kind == "fsspec-local-no-autocommit":
        f.commit()
    assert len(calls) == 1
    data = target.read_bytes()
    assert data[: len(expected)] == expected and data[len(expected):] == b"TRAILER"
    target.write_bytes(expected)
    _assert_same(ORIGINAL_LOAD(target, weights_only=True), obj)


def test_read_back_through_the_same_object(tmp_path: Path, calls: list[int]) -> None:
    """A ``w+b`` file read back through the caller's own object after the save sees the
    archive (the writer's descriptor and the caller's share the inode)."""
    obj = _state()
    expected = _path_bytes(obj, tmp_path)
    fastpersist.patch_torch_save()
    with open(tmp_path / "rw.pt", "w+b") as f:
        torch.save(obj, f)
        f.seek(0)
        assert f.read() == expected
        f.seek(0)
        _assert_same(ORIGINAL_LOAD(f, weights_only=True), obj)
    assert calls


def test_write_protected_file_goes_to_torch(tmp_path: Path, calls: list[int]) -> None:
    """A file open for writing whose permissions no longer allow opening it for writing
    (made read-only after the open) cannot be reopened by the writer: torch writes through
    the caller's descriptor, as stock torch does."""
    if os.geteuid() == 0:
        pytest.skip("root opens write-protected files")
    p = tmp_path / "wp.pt"
    fastpersist.patch_torch_save()
    with open(p, "wb") as f:
        p.chmod(0o444)
        torch.save({"a": torch.ones(3)}, f)
    assert calls == []
    assert torch.equal(ORIGINAL_LOAD(p)["a"], torch.ones(3))


def test_reopen_refused_goes_to_torch(tmp_path: Path, calls: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Where ``/proc/self/fd/N`` cannot be reopened for writing (as root, simulated: a
    filesystem or permission that refuses it), the save is torch's, not an error."""
    real_open = os.open

    def refusing(path: Any, flags: int, *a: Any, **k: Any) -> int:
        if str(path).startswith("/proc/self/fd/"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", refusing)
    p = tmp_path / "np.pt"
    fastpersist.patch_torch_save()
    with open(p, "wb") as f:
        assert "cannot be reopened" in patch.open_file_target(f)[1]
        torch.save({"a": torch.ones(3)}, f)
    monkeypatch.undo()
    assert calls == []
    assert torch.equal(ORIGINAL_LOAD(p)["a"], torch.ones(3))


def test_length_is_the_archive(tmp_path: Path, calls: list[int]) -> None:
    """No padding beyond the archive's end (O_DIRECT writes whole blocks): the file is
    exactly as long as the path save's, closed without writing more."""
    obj = {"t": torch.arange(12345, dtype=torch.float64)}
    expected = _path_bytes(obj, tmp_path)
    fastpersist.patch_torch_save()
    with open(tmp_path / "a.pt", "wb") as f:
        torch.save(obj, f)
        assert os.fstat(f.fileno()).st_size == len(expected) == f.tell()
    assert (tmp_path / "a.pt").read_bytes() == expected
    assert calls


def test_second_save_into_the_same_object_goes_to_torch(tmp_path: Path, calls: list[int]) -> None:
    """After the first save the position is at the end: a second ``torch.save`` into the
    same file object appends, as torch does, and both archives read back with torch."""
    fastpersist.patch_torch_save()
    with open(tmp_path / "two.pt", "wb") as f:
        torch.save({"a": torch.ones(3)}, f)
        end = f.tell()
        torch.save({"b": torch.zeros(2)}, f)
    assert len(calls) == 1
    data = (tmp_path / "two.pt").read_bytes()
    assert torch.equal(ORIGINAL_LOAD(io.BytesIO(data[:end]))["a"], torch.ones(3))
    assert torch.equal(ORIGINAL_LOAD(io.BytesIO(data[end:]))["b"], torch.zeros(2))


def test_tmpfs_without_o_direct(calls: list[int]) -> None:
    """On a filesystem without O_DIRECT (tmpfs) the engine writes buffered, as path saves
    into it do: the same bytes as a path save there."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    obj = _state()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        expected = _path_bytes(obj, Path(d))
        fastpersist.patch_torch_save()
        with open(os.path.join(d, "x.pt"), "wb") as f:
            torch.save(obj, f)
            assert f.tell() == len(expected)
        assert Path(d, "x.pt").read_bytes() == expected
    assert calls


# ---------------------------------------------------------------------- refused


class _MyWriter(io.BufferedWriter):
    pass


def _refused_cases(tmp_path: Path) -> dict[str, Callable[[], tuple[Any, Callable[[], bytes]]]]:
    """name -> a function opening the object; returns it and a reader of what was written."""
    p = tmp_path / "r.pt"

    def bytesio() -> tuple[Any, Callable[[], bytes]]:
        b = io.BytesIO()
        return b, b.getvalue

    def append() -> tuple[Any, Callable[[], bytes]]:
        p.unlink(missing_ok=True)
        return open(p, "ab"), p.read_bytes

    def offset() -> tuple[Any, Callable[[], bytes]]:
        f = open(p, "wb")
        f.write(b"HEADER")
        return f, p.read_bytes

    def offset_flushed() -> tuple[Any, Callable[[], bytes]]:
        f = open(p, "wb")
        f.write(b"HEADER")
        f.flush()
        return f, p.read_bytes

    def non_empty() -> tuple[Any, Callable[[], bytes]]:
        p.write_bytes(b"x" * 100000)
        return open(p, "r+b"), p.read_bytes

    def subclass() -> tuple[Any, Callable[[], bytes]]:
        return _MyWriter(io.FileIO(p, "w")), p.read_bytes

    def unlinked() -> tuple[Any, Callable[[], bytes]]:
        f = tempfile.TemporaryFile(dir=tmp_path)

        def read() -> bytes:
            f.seek(0)
            return f.read()

        return f, read

    return {"BytesIO": bytesio, "append": append, "offset": offset, "offset-flushed": offset_flushed,
            "non-empty-r+b": non_empty, "BufferedWriter-subclass": subclass, "unlinked-TemporaryFile": unlinked}


REFUSED = ["BytesIO", "append", "offset", "offset-flushed", "non-empty-r+b", "BufferedWriter-subclass",
           "unlinked-TemporaryFile"]


@pytest.mark.parametrize("kind", REFUSED)
def test_refused_kinds_go_to_torch(kind: str, tmp_path: Path, calls: list[int]) -> None:
    """What the switch writes into such an object is what stock torch writes (same bytes,
    same position), and fastpersist's writer is never called."""
    obj = _state()
    results = []
    for patched in (False, True):
        if patched:
            fastpersist.patch_torch_save()
        f, read = _refused_cases(tmp_path)[kind]()
        try:
            torch.save(obj, f)
            pos = f.tell()
            f.flush()
            results.append((read(), pos))
        finally:
            if not isinstance(f, io.BytesIO):
                f.close()
        fastpersist.unpatch_torch_save()
    assert results[0] == results[1]
    assert calls == []


def test_read_only_file_goes_to_torch(tmp_path: Path, calls: list[int]) -> None:
    p = tmp_path / "ro.pt"
    p.write_bytes(b"")
    errors = []
    for patched in (False, True):
        if patched:
            fastpersist.patch_torch_save()
        with open(p, "rb") as f, pytest.raises(Exception) as info:
            torch.save({"a": torch.ones(2)}, f)
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1]
    assert calls == []


def test_pipe_goes_to_torch(calls: list[int]) -> None:
    """A pipe is written by torch (streamed to the reader), never by fastpersist."""
    obj = _state()
    got: list[bytes] = []
    for patched in (False, True):
        if patched:
            fastpersist.patch_torch_save()
        r, w = os.pipe()
        chunks: list[bytes] = []
        reader = threading.Thread(target=lambda r=r, chunks=chunks: chunks.append(os.fdopen(r, "rb").read()))
        reader.start()
        with open(w, "wb") as f:
            torch.save(obj, f)
        reader.join(timeout=60)
        got.append(b"".join(chunks))
    assert got[0] == got[1] and got[0]
    assert calls == []
    _assert_same(ORIGINAL_LOAD(io.BytesIO(got[1]), weights_only=True), obj)


def test_custom_pickle_module_goes_to_torch(tmp_path: Path, calls: list[int]) -> None:
    """A pickle_module other than torch's default (``pickle`` itself is the default, and
    taken) or a non-default protocol: torch writes, as for paths."""
    custom = types.ModuleType("custom_pickle")
    custom.__dict__.update({k: v for k, v in vars(pickle).items() if not k.startswith("__")})
    fastpersist.patch_torch_save()
    with open(tmp_path / "p.pt", "wb") as f:
        torch.save({"a": torch.ones(2)}, f, pickle_module=custom)
    with open(tmp_path / "q.pt", "wb") as f:
        torch.save({"a": torch.ones(2)}, f, pickle_protocol=4)
    assert calls == []
    fastpersist.unpatch_torch_save()
    with open(tmp_path / "s.pt", "wb") as f:
        torch.save({"a": torch.ones(2)}, f, pickle_module=custom)
    assert (tmp_path / "p.pt").read_bytes() == (tmp_path / "s.pt").read_bytes()


def test_torch_settings_go_to_torch(tmp_path: Path, calls: list[int]) -> None:
    """torch's serialization settings that change the bytes (here ``skip_data``) make the
    save torch's, as for paths."""
    fastpersist.patch_torch_save()
    with torch.serialization.skip_data(), open(tmp_path / "s.pt", "wb") as f:
        torch.save({"a": torch.ones(2)}, f)
    assert calls == []


def test_open_file_target_reasons(tmp_path: Path) -> None:
    """The selection says why an object is refused."""
    with open(tmp_path / "a", "wb") as f:
        assert patch.open_file_target(f) == (f, "")
        f.write(b"x")
        assert "position" in patch.open_file_target(f)[1]
    assert "BytesIO is not one of open()" in patch.open_file_target(io.BytesIO())[1]
    with open(tmp_path / "a", "ab") as f:
        assert "append" in patch.open_file_target(f)[1]
    with open(tmp_path / "a", "rb") as f:
        assert "BufferedReader" in patch.open_file_target(f)[1]
    with open(tmp_path / "a", "rb", buffering=0) as f:  # FileIO, read-only
        assert "not open for writing" in patch.open_file_target(f)[1]
    f = open(tmp_path / "c", "wb")
    f.close()
    assert "closed" in patch.open_file_target(f)[1]


# ------------------------------------------------------------------------ faults


@pytest.mark.parametrize("op", ["write", "fsync"])
def test_fault_mid_write_raises_clearly(op: str, tmp_path: Path, calls: list[int]) -> None:
    """An I/O error while writing into the open file: an OSError that is also torch's
    RuntimeError, with errno, the file's name and that it is partly written."""
    obj = {f"t{i}": torch.full((1 << 18,), float(i)) for i in range(16)}  # 16 MiB
    fastpersist.patch_torch_save()
    target = tmp_path / "fault.pt"
    with open(target, "wb") as f:
        with inject_fault(op, 1, "EIO"), pytest.raises(OSError) as info:
            torch.save(obj, f)
        assert f.tell() == os.fstat(f.fileno()).st_size
    e = info.value
    assert isinstance(e, RuntimeError)
    assert e.errno == errno.EIO
    assert e.filename == str(target)
    assert "partly written" in str(e) and str(target) in str(e)
    assert calls
    # the next save into a fresh open file works
    with open(target, "wb") as f:
        torch.save(obj, f)
    _assert_same(ORIGINAL_LOAD(target, weights_only=True), obj)
