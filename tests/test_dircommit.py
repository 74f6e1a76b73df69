"""fastpersist.dircommit: the directory-level commit the Accelerate and DeepSpeed adapters share."""

from __future__ import annotations

import errno
import logging
import os
import types

import pytest

from fastpersist import dircommit

log = logging.getLogger("test_dircommit")
TOKEN = "0123456789abcdef"


def _write(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _read(path) -> str:
    with open(path) as f:
        return f.read()


def _tree(root) -> dict:
    """{relative path: content} of the regular files under root."""
    out = {}
    for d, _dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(d, name)
            out[os.path.relpath(p, root)] = _read(p)
    return out


def _is_entry(name: str) -> bool:
    return name.endswith(".pt")


def _dirs(tmp_path):
    """parent/ckpt (previous checkpoint: a.pt, stale.pt, notes.txt) and its staging sibling (new a.pt)."""
    target = str(tmp_path / "ckpt")
    staging = str(tmp_path / dircommit.staging_name("ckpt", TOKEN))
    old = str(tmp_path / dircommit.old_name("ckpt", TOKEN))
    _write(os.path.join(target, "a.pt"), "A old")
    _write(os.path.join(target, "stale.pt"), "stale")
    _write(os.path.join(target, "notes.txt"), "notes")
    _write(os.path.join(staging, "a.pt"), "A new")
    return target, staging, old


def _exchange_supported(tmp_path) -> bool:
    a, b = tmp_path / "xa", tmp_path / "xb"
    a.mkdir()
    b.mkdir()
    try:
        dircommit.exchange_paths(str(a), str(b))
    except OSError as e:
        if e.errno in dircommit.EXCHANGE_REFUSED:
            return False
        raise
    finally:
        a.rmdir()
        b.rmdir()
    return True


def test_swap_exchanges_the_two_directories(tmp_path, monkeypatch):
    if not _exchange_supported(tmp_path):
        pytest.skip("this filesystem refuses RENAME_EXCHANGE")
    target, staging, old = _dirs(tmp_path)
    notes_inode = os.stat(os.path.join(target, "notes.txt")).st_ino
    calls, visible = [], []
    real = dircommit.exchange_paths
    monkeypatch.setattr(dircommit, "exchange_paths", lambda a, b: (calls.append((a, b)), real(a, b)))
    previous = dircommit.swap_in(staging, target, old, _is_entry, what="a test checkpoint", logger=log,
                                 on_visible=lambda: visible.append(True))
    assert calls == [(staging, target)]
    assert visible == [True]
    # the new checkpoint, with the non-checkpoint entry carried over as a hard link; stale.pt gone
    assert _tree(target) == {"a.pt": "A new", "notes.txt": "notes"}
    assert os.stat(os.path.join(target, "notes.txt")).st_ino == notes_inode
    # the previous checkpoint, whole, under the staging name, for the caller to remove
    assert previous == staging
    assert _tree(staging) == {"a.pt": "A old", "stale.pt": "stale", "notes.txt": "notes"}
    assert not os.path.lexists(old)


def test_swap_into_missing_target_is_a_rename(tmp_path):
    target, staging, old = _dirs(tmp_path)
    import shutil

    shutil.rmtree(target)
    visible, synced = [], []
    previous = dircommit.swap_in(staging, target, old, _is_entry, what="a test checkpoint", logger=log,
                                 on_visible=lambda: visible.append(True), sync_tree=synced.append)
    assert previous is None and visible == [True] and synced == [staging]
    assert _tree(target) == {"a.pt": "A new"}
    assert not os.path.lexists(staging)


def test_swap_falls_back_to_two_renames_when_exchange_is_refused(tmp_path, monkeypatch):
    target, staging, old = _dirs(tmp_path)
    calls, visible = [], []

    def refuse(a, b):
        calls.append((a, b))
        raise OSError(errno.EINVAL, "Invalid argument", a, None, b)

    monkeypatch.setattr(dircommit, "exchange_paths", refuse)
    previous = dircommit.swap_in(staging, target, old, _is_entry, what="a test checkpoint", logger=log,
                                 on_visible=lambda: visible.append(True))
    assert calls == [(staging, target)] and visible == [True]
    assert _tree(target) == {"a.pt": "A new", "notes.txt": "notes"}
    assert previous == old
    assert _tree(old) == {"a.pt": "A old", "stale.pt": "stale", "notes.txt": "notes"}
    assert not os.path.lexists(staging)


def test_fallback_puts_the_previous_directory_back_when_the_second_rename_fails(tmp_path, monkeypatch):
    target, staging, old = _dirs(tmp_path)
    monkeypatch.setattr(dircommit, "exchange_paths",
                        lambda a, b: (_ for _ in ()).throw(OSError(errno.ENOSYS, "no renameat2", a, None, b)))
    real_rename = os.rename

    def rename(src, dst):
        if src == staging:
            raise OSError(errno.EIO, "injected", src)
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    visible = []
    with pytest.raises(OSError, match="injected"):
        dircommit.swap_in(staging, target, old, _is_entry, what="a test checkpoint", logger=log,
                          on_visible=lambda: visible.append(True))
    monkeypatch.undo()
    assert visible == []
    assert _tree(target) == {"a.pt": "A old", "stale.pt": "stale", "notes.txt": "notes"}
    assert not os.path.lexists(old)
    assert os.path.isdir(staging)  # the caller removes it


def test_other_exchange_errors_raise_before_anything_is_visible(tmp_path, monkeypatch):
    target, staging, old = _dirs(tmp_path)

    def fail(a, b):
        raise OSError(errno.EACCES, "Permission denied", a, None, b)

    monkeypatch.setattr(dircommit, "exchange_paths", fail)
    visible = []
    with pytest.raises(PermissionError):
        dircommit.swap_in(staging, target, old, _is_entry, what="a test checkpoint", logger=log,
                          on_visible=lambda: visible.append(True))
    assert visible == []
    assert _tree(target) == {"a.pt": "A old", "stale.pt": "stale", "notes.txt": "notes"}
    assert not os.path.lexists(old)


def test_carry_over_keeps_other_entries_and_drops_checkpoint_ones(tmp_path):
    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    _write(str(old_dir / "model.pt"), "old model")
    _write(str(old_dir / "gone.pt"), "stale")
    _write(str(old_dir / "notes.txt"), "notes")
    _write(str(old_dir / "logs" / "run.log"), "log")
    _write(str(old_dir / ".model.pt.fp-tmp-1-0000000000-0-deadbeef"), "temp")
    _write(str(old_dir / "config.json"), "old config")
    os.symlink("notes.txt", old_dir / "link")
    _write(str(new_dir / "model.pt"), "new model")
    _write(str(new_dir / "config.json"), "new config")  # written by the new save: not replaced
    dircommit.carry_over(str(old_dir), str(new_dir), _is_entry, what="a test checkpoint", logger=log)
    assert sorted(os.listdir(new_dir)) == ["config.json", "link", "logs", "model.pt", "notes.txt"]
    assert _read(new_dir / "model.pt") == "new model"
    assert _read(new_dir / "config.json") == "new config"
    assert os.path.islink(new_dir / "link") and os.readlink(new_dir / "link") == "notes.txt"
    assert os.stat(new_dir / "notes.txt").st_ino == os.stat(old_dir / "notes.txt").st_ino
    assert _read(new_dir / "logs" / "run.log") == "log"
    assert len(os.listdir(old_dir)) == 7  # the previous directory stays whole


def test_clean_leftovers_restores_an_old_copy_when_the_target_is_missing(tmp_path):
    moved = tmp_path / dircommit.old_name("ckpt", TOKEN)
    _write(str(moved / "a.pt"), "A")
    target = str(tmp_path / "ckpt")
    dircommit.clean_leftovers(str(tmp_path), lambda name: target if name == "ckpt" else None,
                              operation="save", logger=log, fsync_after_restore=True)
    assert _tree(target) == {"a.pt": "A"}
    assert not os.path.lexists(moved)


def test_clean_leftovers_never_restores_a_symbolic_link(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    _write(str(elsewhere / "x"), "not ours")
    link = tmp_path / dircommit.old_name("ckpt", TOKEN)
    os.symlink(elsewhere, link)
    target = str(tmp_path / "ckpt")
    dircommit.clean_leftovers(str(tmp_path), lambda name: target if name == "ckpt" else None,
                              operation="save", logger=log, fsync_after_restore=True)
    assert not os.path.lexists(target)
    assert os.path.islink(link) and _read(elsewhere / "x") == "not ours"


def test_clean_leftovers_restores_into_another_directory(tmp_path):
    # Accelerate: the old copy waits in the project directory, its checkpoint belongs in checkpoints/
    (tmp_path / "checkpoints").mkdir()
    moved = tmp_path / dircommit.old_name("checkpoint_3", TOKEN)
    _write(str(moved / "a.pt"), "A")
    dircommit.clean_leftovers(str(tmp_path), lambda name: str(tmp_path / "checkpoints" / name),
                              operation="save", logger=log, fsync_after_restore=True)
    assert _tree(tmp_path / "checkpoints" / "checkpoint_3") == {"a.pt": "A"}
    assert not os.path.lexists(moved)


def test_clean_leftovers_removes_an_old_copy_when_the_target_exists(tmp_path):
    moved = tmp_path / dircommit.old_name("ckpt", TOKEN)
    _write(str(moved / "a.pt"), "older")
    _write(str(tmp_path / "ckpt" / "a.pt"), "current")
    dircommit.clean_leftovers(str(tmp_path), lambda name: str(tmp_path / name) if name == "ckpt" else None,
                              operation="save", logger=log, fsync_after_restore=False)
    assert _tree(tmp_path / "ckpt") == {"a.pt": "current"}
    assert not os.path.lexists(moved)


def test_clean_leftovers_touches_only_our_own_names(tmp_path):
    ours = tmp_path / dircommit.staging_name("ckpt", TOKEN)
    _write(str(ours / "a.pt"), "partial")
    keep = {
        dircommit.staging_name("other", TOKEN): "dir",  # another directory's save
        ".fastpersist-staging-ckpt-0123456789abcde": "dir",  # 15 hex digits
        ".fastpersist-staging-ckpt-0123456789ABCDEF": "dir",  # not lower-case hex
        "fastpersist-staging-ckpt-" + TOKEN: "dir",  # no leading dot
        ".fastpersist-partial-ckpt-" + TOKEN: "dir",  # neither staging nor old
        dircommit.old_name("ckpt", "fedcba9876543210"): "file",  # ours, but a file
        "ckpt": "dir",
    }
    for name, kind in keep.items():
        if kind == "dir":
            _write(str(tmp_path / name / "x"), name)
        else:
            _write(str(tmp_path / name), name)
    elsewhere = tmp_path / "elsewhere"
    _write(str(elsewhere / "x"), "not ours")
    link = dircommit.staging_name("ckpt", "fedcba9876543210")
    os.symlink(elsewhere, tmp_path / link)  # ours by name, but a link: neither followed nor removed
    dircommit.clean_leftovers(str(tmp_path), lambda name: str(tmp_path / name) if name == "ckpt" else None,
                              operation="save", logger=log, fsync_after_restore=False)
    assert not os.path.lexists(ours)
    assert sorted(os.listdir(tmp_path)) == sorted(list(keep) + ["elsewhere", link])
    assert _read(elsewhere / "x") == "not ours"


def test_names_and_leftover_pattern():
    s, o = dircommit.staging_name("hpc_ckpt_3.ckpt", TOKEN), dircommit.old_name("hpc_ckpt_3.ckpt", TOKEN)
    assert s.startswith(".fastpersist-staging-") and o.startswith(".fastpersist-old-")
    for kind, name in (("staging", s), ("old", o)):
        assert dircommit.parse_leftover(name) == (kind, "hpc_ckpt_3.ckpt")
        # no part of the name and no digit before the token: Lightning's hpc_ckpt_N parsing,
        # checkpoint_N / epoch=N patterns never take a staging directory for a checkpoint
        assert "hpc_ckpt" not in name and "ckpt" not in name
        assert not any(c.isdigit() for c in name[: -len(TOKEN)])
    # earlier releases' names (the name in plain) are still recognised, for cleanup
    assert dircommit.parse_leftover(".fastpersist-staging-ckpt-1-" + TOKEN) == ("staging", "ckpt-1")
    assert dircommit.parse_leftover(".fastpersist-old-checkpoint_3-" + TOKEN) == ("old", "checkpoint_3")
    assert dircommit.parse_leftover(".fastpersist-staging-ckpt-" + TOKEN[:-1]) is None
    assert dircommit.short_name("last") == "last"
    long_a, long_b = "é" * 150 + "a", "é" * 150 + "b"
    sa, sb = dircommit.short_name(long_a), dircommit.short_name(long_b)
    assert sa != sb and sa == dircommit.short_name(long_a)
    assert len(os.fsencode(sa)) <= dircommit.NAME_ROOM and sa.startswith("é" * 10)
    assert len(os.fsencode(dircommit.staging_name(sa, TOKEN))) <= 255
    assert dircommit.parse_leftover(dircommit.old_name(sa, TOKEN)) == ("old", sa)


def test_lightning_hpc_listing_ignores_a_staging_leftover(tmp_path):
    """A killed directory save of hpc_ckpt_3.ckpt (Lightning's DeepSpeed strategy saves a
    directory per checkpoint) leaves its staging directory until the next save; Lightning's
    HPC resume parses every name holding 'hpc_ckpt_' and must still find hpc_ckpt_1."""
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    (tmp_path / "hpc_ckpt_1.ckpt").mkdir()
    (tmp_path / dircommit.staging_name("hpc_ckpt_3.ckpt", TOKEN)).mkdir()
    assert _CheckpointConnector._CheckpointConnector__max_ckpt_version_in_folder(str(tmp_path)) == 1


def test_adapters_use_the_shared_names(tmp_path):
    """The adapters' staged directories (Accelerate's through dirsave.CheckpointDir, DeepSpeed's
    tag directories through StagedDir) name their staging and moved-aside directories with
    dircommit's names (shortened first where too long), so one cleanup recognises both."""
    from fastpersist.dirsave import CheckpointDir

    out = tmp_path / "out"
    layout = CheckpointDir(str(out))
    assert layout.staging(TOKEN) == str(tmp_path / dircommit.staging_name("out", TOKEN))
    assert layout.old(TOKEN) == str(tmp_path / dircommit.old_name("out", TOKEN))
    auto = CheckpointDir(str(tmp_path / "checkpoints" / "checkpoint_2"), listed=str(tmp_path / "checkpoints"))
    assert auto.staging(TOKEN) == str(tmp_path / dircommit.staging_name("checkpoint_2", TOKEN))
    tag = "t" * 300
    stage = dircommit.StagedDir(str(tmp_path / tag))
    import hashlib

    short = "t" * 83 + "~" + hashlib.sha256(tag.encode()).hexdigest()[:16]
    assert stage.staging(TOKEN) == str(tmp_path / dircommit.staging_name(short, TOKEN))
    assert stage.old(TOKEN) == str(tmp_path / dircommit.old_name(short, TOKEN))


def test_why_not_staged(tmp_path, monkeypatch):
    tmp_path = type(tmp_path)(os.path.realpath(tmp_path))  # the working-directory check compares real paths
    target = tmp_path / "ckpt"
    assert dircommit.why_not_staged(str(target)) is None  # missing: a rename
    assert dircommit.why_not_staged(str(target), str(tmp_path)) is None
    target.write_text("x")
    assert dircommit.why_not_staged(str(target)) == f"{target} exists and is not a directory"
    target.unlink()
    (target / "sub").mkdir(parents=True)
    assert dircommit.why_not_staged(str(target)) is None
    monkeypatch.chdir(target / "sub")
    assert dircommit.why_not_staged(str(target)) == f"the working directory is inside {target}"
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        st = real_stat(path, *args, **kwargs)
        if os.fspath(path) == str(tmp_path / "elsewhere"):
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev + 1) + tuple(st)[3:])
        return st

    (tmp_path / "elsewhere").mkdir()
    monkeypatch.setattr(os, "stat", stat)
    assert (dircommit.why_not_staged(str(target), str(tmp_path / "elsewhere"))
            == f"{tmp_path} and {tmp_path / 'elsewhere'} are on different filesystems")


@pytest.mark.parametrize("with_parent", [False, True], ids=["fsync_tree", "fsync_tree_and_parent"])
def test_fsync_tree_syncs_every_file_and_directory_bottom_up(tmp_path, monkeypatch, with_parent):
    # fsync_tree: every file (not a link) and every directory, bottom-up, not the parent;
    # fsync_tree_and_parent: the same, then the parent (which holds the tree's name) last.
    root = tmp_path / "root"
    _write(str(root / "a"), "a")
    _write(str(root / "sub" / "b"), "b")
    os.symlink("a", root / "link")
    files, dirs = [], []
    monkeypatch.setattr(dircommit, "fsync_path", files.append)
    monkeypatch.setattr(dircommit, "fsync_dir", dirs.append)
    (dircommit.fsync_tree_and_parent if with_parent else dircommit.fsync_tree)(str(root))
    assert sorted(files) == [str(root / "a"), str(root / "sub" / "b")]
    assert dirs == [str(root / "sub"), str(root)] + ([str(tmp_path)] if with_parent else [])


# ---- StagedDir, rebase, fsync_tree_and_parent: the steps both adapters compose


def test_rebase_maps_paths_under_root_only(tmp_path):
    root, new = str(tmp_path / "tag"), str(tmp_path / ".staging")
    assert dircommit.rebase(root, root, new) == new
    assert dircommit.rebase(root + "/", root, new) == new
    assert dircommit.rebase(os.path.join(root, "a", "b.pt"), root, new) == os.path.join(new, "a", "b.pt")
    assert dircommit.rebase(os.path.join(root, "a", "..", "c.pt"), root, new) == os.path.join(new, "c.pt")
    assert dircommit.rebase(root + "2/x.pt", root, new) is None  # a sibling that shares the prefix
    assert dircommit.rebase(str(tmp_path / "other"), root, new) is None
    import pathlib

    assert dircommit.rebase(pathlib.Path(root) / "m.pt", root, new) == os.path.join(new, "m.pt")


def test_rebase_compares_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert dircommit.rebase("tag/x.pt", str(tmp_path / "tag"), "/new") == "/new/x.pt"
    assert dircommit.rebase(str(tmp_path / "tag" / "x.pt"), "tag", "/new") == "/new/x.pt"


def test_staged_dir_names(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink("real", tmp_path / "link")
    s = dircommit.StagedDir(str(tmp_path / "link"))
    assert (s.target, s.parent, s.name) == (os.path.realpath(real), os.path.realpath(tmp_path), "real")
    assert s.stage_parent == s.parent
    assert s.staging(TOKEN) == os.path.join(s.parent, dircommit.staging_name("real", TOKEN))
    assert s.old(TOKEN) == os.path.join(s.parent, dircommit.old_name("real", TOKEN))
    long = dircommit.StagedDir(str(tmp_path / ("x" * 250)), stage_parent=str(tmp_path / "up"))
    assert long.short == dircommit.short_name("x" * 250) != "x" * 250
    assert long.staging(TOKEN) == str(tmp_path / "up" / dircommit.staging_name(long.short, TOKEN))


def test_staged_dir_checks_a_given_stage_parent(tmp_path, monkeypatch):
    tmp_path = type(tmp_path)(os.path.realpath(tmp_path))
    (tmp_path / "elsewhere").mkdir()
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        st = real_stat(path, *args, **kwargs)
        if os.fspath(path) == str(tmp_path / "elsewhere"):
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev + 1) + tuple(st)[3:])
        return st

    monkeypatch.setattr(os, "stat", stat)
    assert dircommit.StagedDir(str(tmp_path / "ckpt")).why_not_staged() is None
    why = dircommit.StagedDir(str(tmp_path / "ckpt"), str(tmp_path / "elsewhere")).why_not_staged()
    assert why == f"{tmp_path} and {tmp_path / 'elsewhere'} are on different filesystems"
    (tmp_path / "ckpt").write_text("x")
    assert dircommit.StagedDir(str(tmp_path / "ckpt")).why_not_staged() == f"{tmp_path / 'ckpt'} exists and is not a directory"


def test_staged_dir_clean_leftovers_restores_its_own_and_the_other_names(tmp_path):
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    s = dircommit.StagedDir(str(ckpts / "checkpoint_4"), stage_parent=str(tmp_path))
    (tmp_path / dircommit.old_name("checkpoint_4", TOKEN)).mkdir()
    (tmp_path / dircommit.old_name("checkpoint_2", TOKEN)).mkdir()
    (tmp_path / dircommit.staging_name("checkpoint_3", TOKEN)).mkdir()
    (tmp_path / dircommit.staging_name("unrelated", TOKEN)).mkdir()
    s.clean_leftovers(operation="test save", logger=log, fsync_after_restore=True,
                      restore_other=lambda name: str(ckpts / name) if name.startswith("checkpoint_") else None)
    assert sorted(os.listdir(ckpts)) == ["checkpoint_2", "checkpoint_4"]  # both moved-aside copies back
    assert sorted(os.listdir(tmp_path)) == sorted(["checkpoints", dircommit.staging_name("unrelated", TOKEN)])
    # without restore_other only its own name is touched
    (tmp_path / dircommit.staging_name("checkpoint_3", TOKEN)).mkdir()
    s.clean_leftovers(operation="test save", logger=log, fsync_after_restore=False)
    assert dircommit.staging_name("checkpoint_3", TOKEN) in os.listdir(tmp_path)


def test_staged_dir_discard(tmp_path):
    s = dircommit.StagedDir(str(tmp_path / "ckpt"))
    assert s.discard(TOKEN) is False  # nothing staged
    _write(os.path.join(s.staging(TOKEN), "a.pt"), "a")
    assert s.discard(TOKEN) is True
    assert not os.path.lexists(s.staging(TOKEN))
    (tmp_path / "real").mkdir()
    os.symlink("real", s.staging(TOKEN))
    assert s.discard(TOKEN) is False and os.path.islink(s.staging(TOKEN))  # never follows a link


def test_staged_dir_commit_into_a_new_directory(tmp_path):
    s = dircommit.StagedDir(str(tmp_path / "ckpt"))
    _write(os.path.join(s.staging(TOKEN), "a.pt"), "A new")
    visible = []
    s.commit(TOKEN, _is_entry, what="a test checkpoint", operation="test save", logger=log,
             on_visible=lambda: visible.append(True))
    assert visible == [True] and _tree(tmp_path / "ckpt") == {"a.pt": "A new"}
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


@pytest.mark.parametrize("exchange", [True, False])
def test_staged_dir_commit_replaces_and_removes_the_previous_copy(tmp_path, monkeypatch, exchange):
    if exchange and not _exchange_supported(tmp_path):
        pytest.skip("this filesystem refuses RENAME_EXCHANGE")
    target, staging, old = _dirs(tmp_path)
    if not exchange:
        monkeypatch.setattr(dircommit, "exchange_paths",
                            lambda a, b: (_ for _ in ()).throw(OSError(errno.EINVAL, "refused", a, None, b)))
    s = dircommit.StagedDir(target)
    assert s.staging(TOKEN) == staging and s.old(TOKEN) == old
    synced = []
    s.commit(TOKEN, _is_entry, what="a test checkpoint", operation="test save", logger=log,
             sync_tree=synced.append)
    assert synced == [staging]
    assert _tree(target) == {"a.pt": "A new", "notes.txt": "notes"}
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # the previous copy is gone


def test_staged_dir_commit_survives_a_previous_copy_that_cannot_be_removed(tmp_path, monkeypatch, caplog):
    import shutil

    target, staging, _old = _dirs(tmp_path)
    real = shutil.rmtree

    def rmtree(path, *a, **kw):
        raise OSError(errno.EBUSY, "Device or resource busy (injected)", os.fspath(path))

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    s = dircommit.StagedDir(target)
    with caplog.at_level(logging.WARNING, logger=log.name):
        s.commit(TOKEN, _is_entry, what="a test checkpoint", operation="test save", logger=log)
    monkeypatch.setattr(shutil, "rmtree", real)
    assert _tree(target) == {"a.pt": "A new", "notes.txt": "notes"}
    leftovers = [n for n in os.listdir(tmp_path) if n != "ckpt"]
    assert len(leftovers) == 1 and dircommit.parse_leftover(leftovers[0])[1] == "ckpt"
    assert "could not remove the previous copy" in caplog.text and "the next test save removes it" in caplog.text
    s.clean_leftovers(operation="test save", logger=log, fsync_after_restore=False)
    assert os.listdir(tmp_path) == ["ckpt"]


def test_staged_dir_commit_failure_leaves_the_target_and_the_staging_directory(tmp_path, monkeypatch):
    target, staging, _old = _dirs(tmp_path)
    monkeypatch.setattr(dircommit, "exchange_paths",
                        lambda a, b: (_ for _ in ()).throw(OSError(errno.EACCES, "Permission denied", a, None, b)))
    s = dircommit.StagedDir(target)
    visible = []
    with pytest.raises(PermissionError):
        s.commit(TOKEN, _is_entry, what="a test checkpoint", operation="test save", logger=log,
                 on_visible=lambda: visible.append(True))
    assert visible == []
    assert _tree(target) == {"a.pt": "A old", "stale.pt": "stale", "notes.txt": "notes"}
    assert os.path.isdir(staging) and s.discard(TOKEN) and not os.path.lexists(staging)
