"""fastpersist.io: round trips through every engine, offsets, sizes, async, errors.

Every byte written is checked against Python's own file reads, and every file
Python writes is read back through the engines.
"""

from __future__ import annotations

import errno
import gc
import os
import random

import pytest
import torch

import fastpersist.io as fio

KiB = 1024
MiB = 1024 * 1024
SIZES = [0, 1, 4095, 4096, 4097, MiB + 3]
OFFSETS = [0, 3, 4096 + 17]
CPU_ENGINES = [e for e in fio.available_engines() if e != "cufile"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _data(n: int, seed: int = 0) -> bytes:
    return random.Random(seed * 1_000_003 + n).randbytes(n)


def _tensor(data: bytes) -> torch.Tensor:
    """A pageable uint8 tensor holding a copy of ``data``."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _memory(kind: str, n: int) -> torch.Tensor:
    """An uninitialised uint8 host tensor of ``n`` bytes of the given kind, filled with 0xA5."""
    if kind == "pageable":
        t = torch.empty(n, dtype=torch.uint8)
    elif kind == "pinned":
        t = fio.pinned_empty(n)
    elif kind == "misaligned":  # pinned memory one byte past a page boundary
        t = fio.pinned_empty(n + 1)[1:]
        assert n == 0 or t.data_ptr() % 4096 == 1
    else:
        raise AssertionError(kind)
    t.fill_(0xA5)
    return t


def _bytes(t: torch.Tensor) -> bytes:
    return fio.as_bytes(t.cpu()).numpy().tobytes()


# ---- engines and filesystem facts ----------------------------------------------------


def test_engines_listed() -> None:
    from fastpersist import _native

    engines = fio.available_engines()
    assert "psync" in engines
    assert set(engines) <= set(_native.ENGINES)
    assert ("cufile" in engines) == (fio.cufile_status() == "available")


def test_alignment_of(tmp_path) -> None:
    a = fio.alignment_of(tmp_path)
    assert a >= 4096 and a & (a - 1) == 0
    f = tmp_path / "f"
    f.write_bytes(b"x")
    assert fio.alignment_of(f) == a
    with pytest.raises(FileNotFoundError) as ei:
        fio.alignment_of(tmp_path / "missing")
    assert ei.value.filename == str(tmp_path / "missing")


@pytest.mark.parametrize("where", ["tmp", "shm"])
def test_direct_io_supported_matches_kernel(tmp_path, where) -> None:
    d = tmp_path if where == "tmp" else "/dev/shm"
    if where == "shm" and not os.path.isdir(d):
        pytest.skip("no /dev/shm")
    probe = os.path.join(d, f"probe-{os.getpid()}-{random.random()}")
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600))
        expected = True
    except OSError as e:
        assert e.errno == errno.EINVAL
        expected = False
    finally:
        if os.path.exists(probe):
            os.unlink(probe)
    assert fio.direct_io_supported(d) is expected


# ---- round trips ---------------------------------------------------------------------


@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("memory", ["pageable", "pinned", "misaligned"])
def test_roundtrip(tmp_path, engine, direct, size, offset, memory) -> None:
    data = _data(size, offset)
    src = _memory(memory, size)
    src.copy_(_tensor(data))
    path = tmp_path / "f.bin"
    h = fio.IOHandle(engine=engine, direct=direct)

    assert h.pwrite(src, path, offset) == size
    raw = path.read_bytes()
    assert len(raw) == (offset + size if size else 0)
    assert raw[offset:] == data
    assert raw[:offset] == bytes(len(raw[:offset]))  # the hole before the offset reads as zeros

    dst = _memory(memory, size)
    assert h.pread(dst, path, offset) == size
    assert _bytes(dst) == data
    assert _bytes(src) == data  # the source is never modified


@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("queue_depth", [2, 8])
@pytest.mark.parametrize("offset", [0, 3])
def test_roundtrip_many_chunks(tmp_path, engine, threads, queue_depth, offset) -> None:
    """1 MiB + 3 bytes in 64 KiB blocks: many I/Os in flight per op, split across threads."""
    data = _data(MiB + 3, threads)
    path = tmp_path / "f.bin"
    h = fio.IOHandle(engine=engine, block_size=64 * KiB, queue_depth=queue_depth, threads=threads)
    assert (h.get_thread_count(), h.get_queue_depth(), h.get_block_size()) == (
        threads,
        queue_depth,
        64 * KiB,
    )
    h.pwrite(_tensor(data), path, offset)
    assert path.read_bytes()[offset:] == data
    dst = fio.pinned_empty(len(data))
    h.pread(dst, path, offset)
    assert _bytes(dst) == data


@pytest.mark.slow
@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_roundtrip_large(tmp_path, engine) -> None:
    """~300 MiB with an unaligned tail, compared chunk by chunk with Python's reads."""
    size = 300 * MiB + 5
    period = _data(MiB + 3, 7)  # a period that is no multiple of any block size
    src = fio.pinned_empty(size)
    view = src.numpy()
    for start in range(0, size, len(period)):
        n = min(len(period), size - start)
        view[start : start + n] = memoryview(period)[:n]
    path = tmp_path / "big.bin"
    h = fio.IOHandle(engine=engine)
    h.pwrite(src, path)
    assert os.path.getsize(path) == size
    step = 16 * MiB
    with open(path, "rb") as f:
        for start in range(0, size, step):
            chunk = view[start : start + step].tobytes()
            assert f.read(step) == chunk, f"differs in [{start}, {start + step})"
    dst = torch.zeros(size, dtype=torch.uint8)
    h.pread(dst, path)
    assert torch.equal(dst, src)


@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize(
    "offset,length",
    [(0, None), (3, 4093), (4096 + 17, 10_000), (1, None), (8192, None), (4095, 2), (12_345, 1)],
)
def test_read_python_written_file(tmp_path, engine, direct, offset, length) -> None:
    """Files written by plain Python, read through the engines at unaligned offsets;
    the file size (3 * 64 KiB + 123) is no multiple of 4096, so reads to the end
    end in an unaligned tail."""
    data = _data(3 * 64 * KiB + 123, 1)
    path = tmp_path / "py.bin"
    with open(path, "wb") as f:
        f.write(data)
    n = len(data) - offset if length is None else length
    h = fio.IOHandle(engine=engine, direct=direct, block_size=64 * KiB)
    for memory in ("pageable", "pinned"):
        dst = _memory(memory, n)
        h.pread(dst, path, offset)
        assert _bytes(dst) == data[offset : offset + n]


@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("size", [4097, 3 * 4096 + 1, 2 * MiB - 1])
def test_unaligned_tail_exact_size(tmp_path, engine, size) -> None:
    """Only the tail is unaligned: the file ends exactly where the data does."""
    data = _data(size, 2)
    path = tmp_path / "tail.bin"
    fio.IOHandle(engine=engine, block_size=64 * KiB).pwrite(_tensor(data), path)
    assert os.path.getsize(path) == size
    assert path.read_bytes() == data


@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_pwrite_truncates_unless_told_not_to(tmp_path, engine) -> None:
    path = tmp_path / "t.bin"
    old = _data(10_000, 3)
    path.write_bytes(old)
    h = fio.IOHandle(engine=engine)
    new = _data(100, 4)
    h.pwrite(_tensor(new), path)  # truncate=True is the default
    assert path.read_bytes() == new

    path.write_bytes(old)
    h.pwrite(_tensor(new), path, 5000, truncate=False)
    assert path.read_bytes() == old[:5000] + new + old[5100:]

    path.write_bytes(old)
    h.pwrite(torch.empty(0, dtype=torch.uint8), path)  # an empty tensor still truncates
    assert path.read_bytes() == b""


@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_several_pwrites_build_one_file(tmp_path, engine) -> None:
    """Pieces of odd sizes at their offsets, written in a shuffled order."""
    sizes = [1, 4095, 4097, 5000, 8192, 3, 65_537, 12_288, 17]
    pieces = [_data(n, i) for i, n in enumerate(sizes)]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    order = list(range(len(sizes)))
    random.Random(5).shuffle(order)
    path = tmp_path / "pieces.bin"
    h = fio.IOHandle(engine=engine, block_size=16 * KiB)
    for i in order:
        h.pwrite(_tensor(pieces[i]), path, offsets[i], truncate=False)
    assert path.read_bytes() == b"".join(pieces)
    for i in order:
        dst = torch.empty(sizes[i], dtype=torch.uint8)
        h.pread(dst, path, offsets[i])
        assert _bytes(dst) == pieces[i]


@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("direct_fd", [False, True], ids=["fd", "fd-odirect"])
def test_file_descriptor_target(tmp_path, engine, direct_fd) -> None:
    """A caller's descriptor: used at the given offsets, never truncated, never closed."""
    path = tmp_path / "fd.bin"
    old = _data(20_000, 6)
    path.write_bytes(old)
    flags = os.O_RDWR | (os.O_DIRECT if direct_fd else 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        pytest.skip(f"cannot open with O_DIRECT here: {e}")
    try:
        h = fio.IOHandle(engine=engine)
        new = _data(4097, 7)
        h.pwrite(_tensor(new), fd, 4096 + 17)  # truncate=True does not apply to descriptors
        expected = old[: 4096 + 17] + new + old[4096 + 17 + 4097 :]
        assert path.read_bytes() == expected
        dst = torch.empty(len(expected) - 3, dtype=torch.uint8)
        h.pread(dst, fd, 3)
        assert _bytes(dst) == expected[3:]
        os.fstat(fd)  # still open
    finally:
        os.close(fd)


@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_pathlike_and_bytes_paths(tmp_path, engine) -> None:
    data = _data(5000, 8)
    h = fio.IOHandle(engine=engine)
    h.pwrite(_tensor(data), tmp_path / "a.bin")  # pathlib.Path
    h.pwrite(_tensor(data), os.fsencode(tmp_path / "b.bin"))  # bytes
    assert (tmp_path / "a.bin").read_bytes() == data == (tmp_path / "b.bin").read_bytes()


DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (33, 129)], ids=str)
def test_roundtrip_dtypes(tmp_path, dtype, shape) -> None:
    g = torch.Generator().manual_seed(11)
    src = torch.randint(0, 256, (*shape, dtype.itemsize), dtype=torch.uint8, generator=g)
    src = src.view(dtype).reshape(shape)  # random bit patterns, NaNs included
    path = tmp_path / "d.bin"
    h = fio.IOHandle()
    h.pwrite(src, path, 5)
    assert path.read_bytes()[5:] == _bytes(src)
    dst = torch.empty(shape, dtype=dtype)
    h.pread(dst, path, 5)
    assert torch.equal(fio.as_bytes(dst), fio.as_bytes(src))


def test_auto_engine_and_accessors(tmp_path) -> None:
    h = fio.IOHandle(block_size=128 * KiB, queue_depth=4, threads=3, direct=False)
    assert h.engine == "auto"
    assert (h.block_size, h.queue_depth, h.threads, h.direct) == (128 * KiB, 4, 3, False)
    assert h.get_intra_op_parallelism() == 3
    assert "auto" in repr(h)
    data = _data(300 * KiB, 9)
    h.pwrite(_tensor(data), tmp_path / "x")
    assert (tmp_path / "x").read_bytes() == data
    assert h.last_engine.split("-")[0] in fio.available_engines()


@pytest.mark.parametrize("engine", ["nope", "cufile-typo"])
def test_unknown_engine_is_value_error(engine) -> None:
    with pytest.raises(ValueError):
        fio.IOHandle(engine=engine)


@pytest.mark.parametrize(
    "kw",
    [{"block_size": 4096 + 1}, {"block_size": 0}, {"queue_depth": 0}, {"threads": 0}, {"max_async": 0}],
    ids=str,
)
def test_bad_settings_are_value_errors(kw) -> None:
    with pytest.raises(ValueError, match=next(iter(kw))):
        fio.IOHandle(**kw)


def test_from_config(tmp_path) -> None:
    from fastpersist.config import Config

    h = fio.IOHandle.from_config(Config(chunk_size=MiB, queue_depth=3, threads=1, direct=False))
    assert (h.block_size, h.queue_depth, h.threads, h.direct) == (MiB, 3, 1, False)
    data = _data(3 * MiB + 1, 10)
    h.pwrite(_tensor(data), tmp_path / "c")
    assert (tmp_path / "c").read_bytes() == data


# ---- /dev/shm (tmpfs) -----------------------------------------------------------


@pytest.fixture
def shm_dir(tmp_path):
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    d = os.path.join("/dev/shm", f"fastpersist-test-{os.getpid()}-{tmp_path.name}")
    os.makedirs(d)
    yield d
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    os.rmdir(d)


@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_tmpfs_roundtrip_with_direct_requested(shm_dir, engine) -> None:
    """tmpfs refuses O_DIRECT on older kernels: the engine must fall back and still work."""
    data = _data(MiB + 3, 12)
    path = os.path.join(shm_dir, "f.bin")
    h = fio.IOHandle(engine=engine, direct=True, block_size=256 * KiB)
    h.pwrite(_tensor(data), path, 3)
    with open(path, "rb") as f:
        assert f.read()[3:] == data
    dst = fio.pinned_empty(len(data))
    h.pread(dst, path, 3)
    assert _bytes(dst) == data


# ---- errors -----------------------------------------------------------------------


@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_non_contiguous_is_value_error(tmp_path, engine) -> None:
    h = fio.IOHandle(engine=engine)
    t = torch.arange(64, dtype=torch.float32).reshape(8, 8).t()
    with pytest.raises(ValueError, match="contiguous"):
        h.pwrite(t, tmp_path / "nc")
    assert not (tmp_path / "nc").exists()
    (tmp_path / "src").write_bytes(bytes(1024))
    with pytest.raises(ValueError, match="contiguous"):
        h.pread(t, tmp_path / "src")
    with pytest.raises(ValueError, match="contiguous"):
        h.async_pwrite(t[::2], tmp_path / "nc")
    assert h.pending() == 0


@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_missing_directory_is_file_not_found(tmp_path, engine, async_) -> None:
    h = fio.IOHandle(engine=engine)
    path = tmp_path / "no-such-dir" / "f.bin"
    with pytest.raises(FileNotFoundError) as ei:
        h.pwrite(torch.ones(10), path, async_=async_)
        h.wait()
    assert ei.value.errno == errno.ENOENT
    assert ei.value.filename == str(path)
    with pytest.raises(FileNotFoundError) as ei:
        h.pread(torch.ones(10), tmp_path / "missing.bin", async_=async_)
        h.wait()
    assert ei.value.filename == str(tmp_path / "missing.bin")


@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_write_to_directory_is_is_a_directory(tmp_path, engine) -> None:
    with pytest.raises(IsADirectoryError) as ei:
        fio.IOHandle(engine=engine).pwrite(torch.ones(10), tmp_path)
    assert ei.value.filename == str(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_read_only_file_is_permission_error(tmp_path, engine) -> None:
    path = tmp_path / "ro.bin"
    path.write_bytes(b"x")
    path.chmod(0o400)
    with pytest.raises(PermissionError) as ei:
        fio.IOHandle(engine=engine).pwrite(torch.ones(10), path)
    assert ei.value.filename == str(path)


@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize(
    "offset,length",
    [(0, 10_001), (9_000, 1_001), (10_000, 1), (20_000, 4096), (4096, 8192)],
)
def test_read_past_eof_is_eof_error(tmp_path, engine, direct, offset, length) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(_data(10_000, 13))
    h = fio.IOHandle(engine=engine, direct=direct)
    with pytest.raises(EOFError) as ei:
        h.pread(torch.empty(length, dtype=torch.uint8), path, offset)
    assert str(path) in str(ei.value)
    with pytest.raises(EOFError):
        h.async_pread(torch.empty(length, dtype=torch.uint8), path, offset)
        h.wait()
    # a read that ends exactly at the end of the file is fine
    dst = torch.empty(10_000 - 9_000, dtype=torch.uint8)
    h.pread(dst, path, 9_000)
    assert _bytes(dst) == path.read_bytes()[9_000:]


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_offset_is_value_error(tmp_path, bad) -> None:
    with pytest.raises(ValueError):
        fio.IOHandle().pwrite(torch.ones(4), tmp_path / "o", bad)


def test_bad_target_type_is_type_error() -> None:
    with pytest.raises(TypeError):
        fio.IOHandle().pwrite(torch.ones(4), 3.0)  # type: ignore[arg-type]


# ---- async ----------------------------------------------------------------------


@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("piece", [4096, 5000], ids=["aligned", "unaligned"])
def test_async_many_ops_into_one_file(tmp_path, engine, piece) -> None:
    n_ops = 80
    pieces = [_data(piece, i) for i in range(n_ops)]
    path = tmp_path / "one.bin"
    path.write_bytes(b"")
    h = fio.IOHandle(engine=engine, block_size=16 * KiB)
    for i, p in enumerate(pieces):
        if i % 2:
            assert h.pwrite(_tensor(p), path, i * piece, async_=True, truncate=False) == piece
        else:  # the DeepNVMe name, which never truncates (like DeepNVMe)
            assert h.async_pwrite(_tensor(p), path, i * piece) == piece
    assert h.pending() == n_ops
    assert h.wait() == n_ops
    assert h.pending() == 0
    assert path.read_bytes() == b"".join(pieces)

    dsts = [torch.empty(piece, dtype=torch.uint8) for _ in range(n_ops)]
    for i, d in enumerate(dsts):
        h.async_pread(d, path, i * piece)
    assert h.wait() == n_ops
    assert [_bytes(d) for d in dsts] == pieces
    assert h.wait() == 0


@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_async_many_files(tmp_path, engine) -> None:
    n_ops = 72
    sizes = [(i * 1237) % 20_000 for i in range(n_ops)]  # 0 included
    pieces = [_data(n, i) for i, n in enumerate(sizes)]
    h = fio.IOHandle(engine=engine, max_async=4)
    for i, p in enumerate(pieces):
        h.async_pwrite(_tensor(p), tmp_path / f"f{i}.bin")
    assert h.wait() == n_ops
    for i, p in enumerate(pieces):
        assert (tmp_path / f"f{i}.bin").read_bytes() == p


@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_async_keeps_tensors_alive(tmp_path, engine) -> None:
    """Tensors handed to async ops have no other reference; the handle must keep them."""
    h = fio.IOHandle(engine=engine, max_async=1)
    n_ops = 16
    for i in range(n_ops):
        h.async_pwrite(torch.full((MiB + 1,), i, dtype=torch.uint8), tmp_path / f"k{i}")
    gc.collect()
    # allocations that would reuse the tensors' memory if the handle had let it go
    clobber = [torch.full((MiB + 1,), 255, dtype=torch.uint8) for _ in range(n_ops)]
    assert h.wait() == n_ops
    del clobber
    for i in range(n_ops):
        assert (tmp_path / f"k{i}").read_bytes() == bytes([i]) * (MiB + 1)


@pytest.mark.parametrize("engine", CPU_ENGINES)
def test_async_error_surfaces_at_wait(tmp_path, engine) -> None:
    h = fio.IOHandle(engine=engine)
    good = [_data(5000, i) for i in range(10)]
    bad_path = tmp_path / "missing-dir" / "x.bin"
    for i, p in enumerate(good):
        h.async_pwrite(_tensor(p), tmp_path / f"g{i}.bin")
        if i == 4:
            h.async_pwrite(torch.ones(100), bad_path)  # returns at once
    with pytest.raises(FileNotFoundError) as ei:
        h.wait()
    assert ei.value.filename == str(bad_path)
    assert h.pending() == 0
    for i, p in enumerate(good):  # every other op ran to completion
        assert (tmp_path / f"g{i}.bin").read_bytes() == p
    # the handle stays usable
    h.async_pwrite(_tensor(good[0]), tmp_path / "after.bin")
    assert h.wait() == 1
    assert (tmp_path / "after.bin").read_bytes() == good[0]


def test_context_manager_waits(tmp_path) -> None:
    data = _data(3 * MiB, 14)
    with fio.IOHandle() as h:
        h.async_pwrite(_tensor(data), tmp_path / "cm.bin")
    assert h.pending() == 0
    assert (tmp_path / "cm.bin").read_bytes() == data


def test_deepnvme_names(tmp_path) -> None:
    h = fio.IOHandle()
    example = torch.empty(0, dtype=torch.float32)
    buf = h.new_cpu_locked_tensor(1000, example)
    assert buf.dtype == torch.float32 and buf.shape == (1000,)
    assert buf.data_ptr() % 4096 == 0
    buf.copy_(torch.arange(1000, dtype=torch.float32))
    path = str(tmp_path / "dn.bin")
    assert h.sync_pwrite(buf, path) == 4000
    out = torch.zeros(500, dtype=torch.float32)
    assert h.sync_pread(out, path, 2000) == 2000
    assert torch.equal(out, buf[500:])
    h.async_pwrite(buf, path, 4000)
    out2 = torch.zeros(1000, dtype=torch.float32)
    assert h.wait() == 1
    h.async_pread(out2, path, 4000)
    assert h.wait() == 1
    assert torch.equal(out2, buf)
    assert h.free_cpu_locked_tensor(buf) is True
    assert h.free_cpu_locked_tensor(buf) is False
    assert h.free_cpu_locked_tensor(torch.ones(3)) is False


# ---- CUDA tensors -------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("offset", [0, 4096 + 17])
def test_cuda_tensor_staged_roundtrip(tmp_path, engine, offset) -> None:
    src = torch.randint(0, 256, (MiB + 3,), dtype=torch.uint8, device="cuda")
    path = tmp_path / "cuda.bin"
    h = fio.IOHandle(engine=engine)
    h.pwrite(src, path, offset)
    assert path.read_bytes()[offset:] == _bytes(src)
    dst = torch.zeros_like(src)
    h.pread(dst, path, offset)
    assert torch.equal(dst, src)
    dst2 = torch.zeros(MiB + 3, dtype=torch.uint8, device="cuda")
    h.async_pread(dst2, path, offset)
    assert h.wait() == 1
    assert torch.equal(dst2, src)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("size", [0, 1, 4096, MiB + 3])
def test_cufile_roundtrip(tmp_path, size) -> None:
    if "cufile" not in fio.available_engines():
        pytest.skip(f"cuFile unavailable: {fio.cufile_status()}")
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    path = tmp_path / "gds.bin"
    h = fio.IOHandle(engine="cufile")
    h.pwrite(src, path)
    assert path.read_bytes() == _bytes(src)
    dst = torch.zeros_like(src)
    h.pread(dst, path)
    assert torch.equal(dst, src)
