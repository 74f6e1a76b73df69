"""fastpersist.locations: where a framework's checkpoint location is written, and waits for
its pending saves (real async saves held in flight until the test releases them)."""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path

import torch

import fastpersist
from fastpersist.locations import resolve, wait_for_file, wait_for_folder

from test_checkpointfiles import held, release_soon  # noqa: F401 (a fixture)


def test_resolve_local_paths_and_urls(tmp_path: Path) -> None:
    assert resolve("s3://bucket/run/a.ckpt") == "s3://bucket/run/a.ckpt"
    assert resolve(tmp_path / "a.ckpt") == str(tmp_path / "a.ckpt")
    assert resolve(f"file://{tmp_path}/a.ckpt") == f"{tmp_path}/a.ckpt"
    assert resolve(f"local://{tmp_path}/a.ckpt") == f"{tmp_path}/a.ckpt"
    assert resolve("relative/a.ckpt") == "relative/a.ckpt"
    for other in ("memory://x/a.ckpt", "gs://bucket/a.ckpt", None):
        assert resolve(other) is None


def test_waits_see_the_finished_file(tmp_path: Path, held: threading.Event) -> None:
    state = {"w": torch.arange(10)}
    path = tmp_path / "sub" / "a.ckpt"
    os.makedirs(path.parent)
    fastpersist.save_async(state, path)
    wait_for_file(tmp_path / "sub" / "other.ckpt")  # nothing pending there: returns while a.ckpt is held
    assert not path.exists()
    release_soon(held)
    wait_for_file(f"file://{path}")
    assert torch.equal(torch.load(path, weights_only=True)["w"], state["w"])


def test_wait_for_folder_sees_files_below_it(tmp_path: Path, held: threading.Event) -> None:
    os.makedirs(tmp_path / "sub")
    fastpersist.save_async({"w": torch.arange(3)}, tmp_path / "sub" / "b.ckpt")
    wait_for_folder(tmp_path / "elsewhere")
    assert not (tmp_path / "sub" / "b.ckpt").exists()
    release_soon(held)
    wait_for_folder(tmp_path)
    assert (tmp_path / "sub" / "b.ckpt").exists()


def test_waits_leave_other_objects_alone(tmp_path: Path) -> None:
    wait_for_file(io.BytesIO())  # no path: returns at once
    wait_for_file(None)
    wait_for_file("memory://x/a.ckpt")
    wait_for_folder(None)
