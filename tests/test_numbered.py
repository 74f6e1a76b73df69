"""fastpersist.numbered: checkpoints numbered in one folder (Accelerate's automatic naming):
where checkpoint N goes, refused when it exists, staged one level up from the folder the
framework lists, and the oldest deleted only once the new one is durable. One process (a
world of one) through fastpersist.dirsave.save_directory, on real directories."""

from __future__ import annotations

import os
import pathlib
import re

import pytest

from fastpersist import dirsave
from fastpersist.collectivedir import WorldExchange
from fastpersist.numbered import NumberedDirs, checkpoint_dir

ENTRY = re.compile(r"model\.bin").fullmatch


def _save(staged: dirsave.CheckpointDir, data: bytes, seen: list, after=None) -> object:  # noqa: ANN001
    def write(staging):  # noqa: ANN001, ANN202 - the framework's call
        seen.append(staging)
        pathlib.Path(staging, "model.bin").parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(staging, "model.bin").write_bytes(data)
        return staging

    return dirsave.save_directory(staged, write, rank=0, committer=True, exchange=WorldExchange(),
                                  is_checkpoint_entry=ENTRY, what="a test checkpoint", operation="test_save",
                                  after=after)


def test_claim_names_stages_up_and_refuses_an_existing_number(tmp_path):
    folder = tmp_path / "proj" / "checkpoints"
    dirs = NumberedDirs(str(folder))
    assert dirs.is_member("checkpoint_12") and not dirs.is_member("checkpoint_x") and not dirs.is_member("ckpt_1")
    staged = dirs.claim(0, counter="self.save_iteration")
    assert folder.is_dir() and staged.final == str(folder / "checkpoint_0") == dirs.path(0)
    assert staged.stage_parent == str(tmp_path / "proj") and staged.siblings("checkpoint_7")
    seen: list = []
    assert _save(staged, b"zero", seen) == str(folder / "checkpoint_0")
    assert os.path.dirname(seen[0]) == str(tmp_path / "proj")  # staged beside the listed folder, never inside it
    assert os.listdir(folder) == ["checkpoint_0"] and (folder / "checkpoint_0" / "model.bin").read_bytes() == b"zero"
    with pytest.raises(ValueError) as info:
        dirs.claim(0, counter="self.save_iteration")
    assert str(folder / "checkpoint_0") in str(info.value) and "`self.save_iteration`" in str(info.value)
    assert NumberedDirs(str(folder), prefix="step-").path(3) == str(folder / "step-3")


def test_retention_keeps_the_newest_after_the_new_one_is_durable(tmp_path):
    folder = tmp_path / "checkpoints"
    assert NumberedDirs(str(folder)).retention() is None  # no limit: keep all
    dirs = NumberedDirs(str(folder), limit=2)
    pruned: list = []
    for n in range(4):
        after = dirs.retention()

        def spy(path: str, after=after) -> None:  # noqa: ANN001
            pruned.append(sorted(os.listdir(folder)))  # the new one is there before any deletion
            after(path)

        _save(dirs.claim(n), str(n).encode(), [], after=spy)
    assert pruned[2] == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    assert sorted(os.listdir(folder)) == ["checkpoint_2", "checkpoint_3"]
    assert (folder / "checkpoint_3" / "model.bin").read_bytes() == b"3"


def test_checkpoint_dir_makes_the_parent_and_stages_up_only_from_the_listed_folder(tmp_path):
    named = checkpoint_dir(tmp_path / "a" / "b" / "ckpt")
    assert (tmp_path / "a" / "b").is_dir() and named.stage_parent == str(tmp_path / "a" / "b")
    listed = tmp_path / "proj" / "checkpoints"
    inside = checkpoint_dir(str(listed / "mine"), listed=str(listed))
    assert listed.is_dir() and inside.stage_parent == str(tmp_path / "proj") and inside.siblings is None
    seen: list = []
    _save(inside, b"m", seen)
    assert os.listdir(listed) == ["mine"] and os.path.dirname(seen[0]) == str(tmp_path / "proj")
