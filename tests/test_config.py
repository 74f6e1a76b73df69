"""Config: validation, FASTPERSIST_* parsing, the cached default, and the generated docs."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from fastpersist import config as fpconfig
from fastpersist.config import ENV_VARS, Config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _fresh_default(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ENV_VARS:
        monkeypatch.delenv(var.name, raising=False)
    fpconfig.reset_default()
    yield
    fpconfig.reset_default()


def test_defaults() -> None:
    assert Config() == Config(
        engine="auto", chunk_size=8 << 20, queue_depth=8, read_queue_depth=None, read_staging="auto", threads=2,
        direct=True, fsync=True, checksum=True, max_async=2,
    )


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": 5000}, "multiple of 4096"),
        ({"chunk_size": -4096}, "chunk_size"),
        ({"queue_depth": 1}, "queue_depth"),
        ({"read_queue_depth": 1}, "read_queue_depth"),
        ({"threads": 0}, "threads"),
        ({"max_async": 0}, "max_async"),
        ({"engine": "uring"}, "engine"),
        ({"engine": "AIO"}, "engine"),
        ({"read_staging": "yes"}, "read_staging"),
        ({"read_staging": True}, "read_staging"),
    ],
)
def test_invalid_values_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Config(**changes)
    with pytest.raises(ValueError, match=message):
        Config().replace(**changes)


def test_types_are_checked() -> None:
    with pytest.raises(TypeError, match="direct"):
        Config(direct=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="threads"):
        Config(threads=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="threads"):
        Config(threads=True)  # type: ignore[arg-type]


def test_frozen_and_replace() -> None:
    base = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.threads = 4  # type: ignore[misc]
    new = base.replace(threads=4, fsync=False)
    assert (new.threads, new.fsync) == (4, False)
    assert (base.threads, base.fsync) == (2, True)
    with pytest.raises(TypeError, match="no field.*thread_count"):
        base.replace(thread_count=4)


def test_handle_kwargs_build_a_native_handle() -> None:
    native = pytest.importorskip("fastpersist._native", reason="native extension not built")
    cfg = Config(engine="psync", chunk_size=1 << 20, queue_depth=4, threads=3, direct=False, max_async=5)
    kwargs = cfg.handle_kwargs()
    assert set(kwargs) == {"engine", "chunk_size", "queue_depth", "threads", "direct", "max_async"}
    h = native.Handle(**kwargs)
    assert (h.engine, h.chunk_size, h.queue_depth, h.threads, h.direct) == ("psync", 1 << 20, 4, 3, False)
    reader = native.Handle(**cfg.replace(read_queue_depth=6).handle_kwargs(read=True))
    assert (reader.engine, reader.queue_depth, reader.threads) == ("psync", 6, 3)
    for mode, staged in (("on", True), ("off", False)):
        kw = cfg.replace(read_staging=mode).handle_kwargs(read=True)
        assert kw["stage_reads"] is staged and native.Handle(**kw).stage_reads is staged
    assert "stage_reads" not in cfg.replace(read_staging="on").handle_kwargs()  # writers never stage reads


@pytest.mark.parametrize("hypervisor", [True, False])
def test_auto_read_staging_follows_the_hypervisor_flag(monkeypatch: pytest.MonkeyPatch, hypervisor: bool) -> None:
    monkeypatch.setattr(fpconfig, "under_hypervisor", lambda: hypervisor)
    assert Config().stages_reads() is hypervisor
    assert Config().handle_kwargs(read=True)["stage_reads"] is hypervisor
    assert Config(read_staging="on").stages_reads() is True
    assert Config(read_staging="off").stages_reads() is False


KVM_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge hypervisor lahf_lm abm
bugs\t\t: spectre_v1

processor\t: 1
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge hypervisor lahf_lm abm
"""


@pytest.mark.parametrize(
    "text,expected",
    [
        (KVM_CPUINFO, True),
        (KVM_CPUINFO.replace(" hypervisor", ""), False),
        ("flags\t\t: fpu hypervisorx vme\n", False),  # whole words only
        ("model name\t: hypervisor edition\nflags\t: fpu\n", False),  # only the flags line counts
        ("", False),  # no /proc/cpuinfo (or not Linux)
        ("Features\t: fp asimd evtstrm\n", False),  # arm64 has no such flag
    ],
)
def test_cpu_flags_say_hypervisor(text: str, expected: bool) -> None:
    assert fpconfig.cpu_flags_say_hypervisor(text) is expected


def test_under_hypervisor_reads_this_machine() -> None:
    with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
        expected = fpconfig.cpu_flags_say_hypervisor(f.read())
    assert fpconfig.under_hypervisor() is expected


# ---------------------------------------------------------------------------
# Environment variables.


def test_table_covers_every_field_once() -> None:
    fields = [v.field for v in ENV_VARS if v.field is not None]
    assert sorted(fields) == sorted(f.name for f in dataclasses.fields(Config))
    names = [v.name for v in ENV_VARS]
    assert len(set(names)) == len(names) and all(n.startswith("FASTPERSIST_") for n in names)
    assert {"FASTPERSIST_PATCH_TORCH_SAVE", "FASTPERSIST_FAULT"} <= set(names)


@pytest.mark.parametrize(
    "raw,expected",
    [
        ("8388608", 8 << 20),
        ("8M", 8 << 20),
        ("8m", 8 << 20),
        ("8MiB", 8 << 20),
        ("8 MiB", 8 << 20),
        ("8MB", 8 << 20),
        ("1G", 1 << 30),
        ("1GiB", 1 << 30),
        ("512K", 512 << 10),
        ("4k", 4096),
        (" 16M ", 16 << 20),
    ],
)
def test_chunk_size_spellings(raw: str, expected: int) -> None:
    assert Config.from_env(environ={"FASTPERSIST_CHUNK_SIZE": raw}).chunk_size == expected


@pytest.mark.parametrize("raw,expected", [(s, True) for s in ("1", "true", "TRUE", "On", "yes", " YES ")] + [
    (s, False) for s in ("0", "false", "False", "OFF", "no", "No")
])
def test_boolean_spellings(raw: str, expected: bool) -> None:
    for var, field in (("FASTPERSIST_DIRECT", "direct"), ("FASTPERSIST_FSYNC", "fsync"), ("FASTPERSIST_CHECKSUM", "checksum")):
        assert getattr(Config.from_env(environ={var: raw}), field) is expected


def test_every_variable_applies() -> None:
    env = {
        "FASTPERSIST_ENGINE": "PSync",
        "FASTPERSIST_CHUNK_SIZE": "1M",
        "FASTPERSIST_QUEUE_DEPTH": "16",
        "FASTPERSIST_READ_QUEUE_DEPTH": "32",
        "FASTPERSIST_THREADS": "4",
        "FASTPERSIST_DIRECT": "off",
        "FASTPERSIST_FSYNC": "no",
        "FASTPERSIST_CHECKSUM": "0",
        "FASTPERSIST_MAX_ASYNC": "3",
        "FASTPERSIST_READ_STAGING": "Off",
    }
    assert Config.from_env(environ=env) == Config(
        engine="psync", chunk_size=1 << 20, queue_depth=16, read_queue_depth=32, read_staging="off", threads=4,
        direct=False, fsync=False, checksum=False, max_async=3,
    )


@pytest.mark.parametrize(
    "raw,expected", [("auto", "auto"), (" AUTO ", "auto"), ("on", "on"), ("1", "on"), ("true", "on"), ("off", "off"),
                     ("0", "off"), ("no", "off")],
)
def test_read_staging_spellings(raw: str, expected: str) -> None:
    assert Config.from_env(environ={"FASTPERSIST_READ_STAGING": raw}).read_staging == expected


def test_unset_or_empty_keeps_base() -> None:
    base = Config(threads=7)
    assert Config.from_env(base, environ={"FASTPERSIST_THREADS": ""}) == base
    assert Config.from_env(base, environ={"FASTPERSIST_FSYNC": "0"}) == base.replace(fsync=False)


@pytest.mark.parametrize(
    "var,raw",
    [
        ("FASTPERSIST_ENGINE", "uring"),
        ("FASTPERSIST_CHUNK_SIZE", "lots"),
        ("FASTPERSIST_CHUNK_SIZE", "5000"),
        ("FASTPERSIST_CHUNK_SIZE", "8X"),
        ("FASTPERSIST_CHUNK_SIZE", "-8M"),
        ("FASTPERSIST_QUEUE_DEPTH", "1"),
        ("FASTPERSIST_QUEUE_DEPTH", "eight"),
        ("FASTPERSIST_THREADS", "0"),
        ("FASTPERSIST_THREADS", "2.5"),
        ("FASTPERSIST_DIRECT", "maybe"),
        ("FASTPERSIST_FSYNC", "2"),
        ("FASTPERSIST_CHECKSUM", "y"),
        ("FASTPERSIST_MAX_ASYNC", "0"),
        ("FASTPERSIST_READ_STAGING", "sometimes"),
    ],
)
def test_invalid_variable_names_variable_and_value(var: str, raw: str) -> None:
    with pytest.raises(ValueError) as e:
        Config.from_env(environ={var: raw})
    assert var in str(e.value) and repr(raw) in str(e.value)


def test_from_env_reads_os_environ_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPERSIST_THREADS", "5")
    assert Config.from_env().threads == 5
    monkeypatch.setenv("FASTPERSIST_THREADS", "6")
    assert Config.from_env().threads == 6


def test_fault_spec_is_syntax_checked() -> None:
    fault = next(v for v in ENV_VARS if v.name == "FASTPERSIST_FAULT")
    assert fault.parse(fault.name, "write:3:EIO") == "write:3:EIO"
    assert fault.parse(fault.name, "read:1:eintr:5") == "read:1:eintr:5"
    with pytest.raises(ValueError, match="FASTPERSIST_FAULT"):
        fault.parse(fault.name, "write:three:EIO")


# ---------------------------------------------------------------------------
# The cached default and override().


def test_get_default_is_cached_until_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPERSIST_QUEUE_DEPTH", "12")
    first = fpconfig.get_default()
    assert first.queue_depth == 12
    monkeypatch.setenv("FASTPERSIST_QUEUE_DEPTH", "20")
    assert fpconfig.get_default() is first
    fpconfig.reset_default()
    assert fpconfig.get_default().queue_depth == 20


def test_get_default_reports_bad_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPERSIST_ENGINE", "nope")
    with pytest.raises(ValueError, match="FASTPERSIST_ENGINE"):
        fpconfig.get_default()


def test_override_nests_and_restores() -> None:
    outer_default = fpconfig.get_default()
    with fpconfig.override(fsync=False) as a:
        assert fpconfig.get_default() is a and a.fsync is False
        with fpconfig.override(threads=6) as b:
            assert fpconfig.get_default() == outer_default.replace(fsync=False, threads=6) == b
        assert fpconfig.get_default() is a
    assert fpconfig.get_default() == outer_default


def test_override_restores_after_error_and_rejects_bad_values() -> None:
    before = fpconfig.get_default()
    with pytest.raises(RuntimeError):
        with fpconfig.override(threads=3):
            raise RuntimeError("boom")
    assert fpconfig.get_default() == before
    with pytest.raises(ValueError):
        with fpconfig.override(queue_depth=1):
            pass  # pragma: no cover
    assert fpconfig.get_default() == before


def test_override_is_visible_to_other_threads() -> None:
    seen: list[Any] = []
    with fpconfig.override(max_async=4):
        t = threading.Thread(target=lambda: seen.append(fpconfig.get_default().max_async))
        t.start()
        t.join()
    assert seen == [4]


# ---------------------------------------------------------------------------
# Documentation.


def test_docs_page_is_generated_from_the_table() -> None:
    text = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert text == fpconfig.markdown(), "docs/config.md is stale: run `python -m fastpersist.config --markdown > docs/config.md`"
    for var in ENV_VARS:
        assert f"`{var.name}`" in text


def test_markdown_command_prints_the_page() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTPERSIST_")}
    out = subprocess.run(
        [sys.executable, "-m", "fastpersist.config", "--markdown"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert out.stdout == fpconfig.markdown()


def _record_new_handles(monkeypatch: pytest.MonkeyPatch, prop: str) -> list:
    """From now on, every native Handle made appends its ``prop`` to the returned
    list (and fastpersist's cache of handles starts empty)."""
    native = pytest.importorskip("fastpersist._native", reason="native extension not built")
    from fastpersist import handles

    made: list = []
    real = native.Handle

    def recording_handle(*args, **kwargs):
        h = real(*args, **kwargs)
        made.append(getattr(h, prop))
        return h

    monkeypatch.setattr(native, "Handle", recording_handle)
    monkeypatch.setattr(handles, "_handles", {})
    return made


def test_loads_and_verify_use_the_read_queue_depth(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import fastpersist

    made = _record_new_handles(monkeypatch, "queue_depth")
    cfg = Config(queue_depth=3, read_queue_depth=5, chunk_size=64 << 10)
    path = tmp_path / "c.pt"
    state = {"w": torch.arange(100_000, dtype=torch.float32)}
    fastpersist.save(state, path, config=cfg)
    assert made and set(made) == {3}
    made.clear()
    assert torch.equal(fastpersist.load(path, config=cfg)["w"], state["w"])
    assert fastpersist.verify(path, config=cfg).ok
    assert made and set(made) == {5}


@pytest.mark.parametrize("mode,staged", [("on", True), ("off", False)])
def test_loads_and_verify_honour_read_staging(tmp_path, monkeypatch: pytest.MonkeyPatch, mode: str, staged: bool) -> None:
    import torch

    import fastpersist

    cfg = Config(read_staging=mode, chunk_size=64 << 10)
    path = tmp_path / "c.pt"
    state = {"w": torch.arange(100_000, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)}
    fastpersist.save(state, path, config=cfg)
    made = _record_new_handles(monkeypatch, "stage_reads")
    got = fastpersist.load(path, config=cfg)
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
    assert fastpersist.verify(path, config=cfg).ok
    assert made and set(made) == {staged}  # also the overlapped loader's own reader handle


def test_read_queue_depth_none_is_chosen_per_device_and_auto_in_the_environment() -> None:
    assert Config().read_queue_depth is None
    assert Config().handle_kwargs(read=True)["queue_depth"] == fpconfig.DEFAULT_READ_QUEUE_DEPTH
    assert Config(read_queue_depth=4).handle_kwargs(read=True)["queue_depth"] == 4
    assert Config.from_env(environ={"FASTPERSIST_READ_QUEUE_DEPTH": "auto"}).read_queue_depth is None
    assert Config.from_env(environ={"FASTPERSIST_READ_QUEUE_DEPTH": " AUTO "}).read_queue_depth is None
    assert Config.from_env(environ={"FASTPERSIST_READ_QUEUE_DEPTH": "4"}).read_queue_depth == 4
    with pytest.raises(ValueError, match="FASTPERSIST_READ_QUEUE_DEPTH"):
        Config.from_env(environ={"FASTPERSIST_READ_QUEUE_DEPTH": "1"})
    with pytest.raises(ValueError, match="FASTPERSIST_READ_QUEUE_DEPTH"):
        Config.from_env(environ={"FASTPERSIST_READ_QUEUE_DEPTH": "deep"})
    with pytest.raises(TypeError, match="read_queue_depth"):
        Config(read_queue_depth="auto")  # type: ignore[arg-type]
