"""Atomic replacement of a checkpoint *directory*, shared by the Accelerate and DeepSpeed adapters.

A save into a directory that exists writes a hidden sibling, the staging directory
``.fastpersist-staging-NAME-TOKEN`` (TOKEN: 16 hex digits), and :func:`swap_in`
makes it the directory in one step: entries of the previous directory that are no
part of a checkpoint are carried over (:func:`carry_over`), everything is fsynced,
the two directories are exchanged with ``renameat2(RENAME_EXCHANGE)``
(:func:`fastpersist.commit.exchange_paths`), the parents are fsynced, and the
previous copy, now under the staging name, is left for the caller to remove. Where
the filesystem refuses RENAME_EXCHANGE the previous directory is renamed to
``.fastpersist-old-NAME-TOKEN`` and the new one renamed in; a process killed between
the two renames leaves no directory, its previous copy under that name, which
:func:`clean_leftovers` (run by the next save) renames back.

:class:`StagedDir` bundles these steps for one directory (its staging and moved-aside
names, the checks, the cleanup, the swap and the removal of the previous copy);
:func:`rebase` maps paths between the final and the staging directory.

What counts as a checkpoint entry, where the staging directory goes (the
``stage_parent`` of :class:`StagedDir`), who commits (ranks) and what a failure before
the swap removes stay with each adapter.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
from typing import Callable, Optional

from fastpersist import _sys
from fastpersist.commit import (
    EXCHANGE_REFUSED,
    TMP_MARKER,
    clean_stale_temps_below,
    exchange_paths,
    fsync_dir,
    fsync_path,
)

__all__ = ["LEFTOVER_RE", "StagedDir", "parse_leftover", "carry_over", "clean_leftovers", "fsync_tree",
           "fsync_tree_and_parent", "old_name", "rebase", "short_name", "staging_name", "swap_in", "why_not_staged"]

STAGING_PREFIX = ".fastpersist-staging-"
OLD_PREFIX = ".fastpersist-old-"
#: ``.fastpersist-staging-ENC-TOKEN`` (a save's directory while it is written) and
#: ``.fastpersist-old-ENC-TOKEN`` (the previous directory, moved aside where RENAME_EXCHANGE is
#: refused). ENC is the directory's name, each byte as two letters a-p: no part of the name and
#: no digit appears, so code that lists the parent and parses names (Lightning's ``hpc_ckpt_N``,
#: ``checkpoint_N``, ``epoch=N``) never takes a staging directory for a checkpoint, and a killed
#: save's leftovers can still be given back to their name.
LEFTOVER_RE = re.compile(r"\.fastpersist-(?P<kind>staging|old)-(?P<enc>(?:[a-p]{2})+)-(?P<token>[0-9a-f]{16})")
#: the names of earlier releases, ``.fastpersist-staging-NAME-TOKEN`` (cleaned up only)
_PLAIN_LEFTOVER_RE = re.compile(r"\.fastpersist-(?P<kind>staging|old)-(?P<name>.+)-(?P<token>[0-9a-f]{16})", re.DOTALL)
NAME_ROOM = 100  #: bytes of a name kept by :func:`short_name` (encoded twice as long; NAME_MAX is 255)


def short_name(name: str) -> str:
    """``name`` as it may appear in a staging name: itself, or (too long for NAME_MAX with the
    prefix, encoding and token) a prefix of it, ``~`` and 16 hex digits of its SHA-256."""
    raw = os.fsencode(name)
    if len(raw) <= NAME_ROOM:
        return name
    return os.fsdecode(raw[:NAME_ROOM - 17]).rstrip("\udcff") + "~" + hashlib.sha256(raw).hexdigest()[:16]


def _encode(name: str) -> str:
    return "".join(chr(97 + (b >> 4)) + chr(97 + (b & 15)) for b in os.fsencode(name))


def _decode(enc: str) -> str:
    return os.fsdecode(bytes(((ord(enc[i]) - 97) << 4) | (ord(enc[i + 1]) - 97) for i in range(0, len(enc), 2)))


def staging_name(name: str, token: str) -> str:
    """``.fastpersist-staging-ENC-TOKEN`` (``name`` as given: shorten it first if needed)."""
    return f"{STAGING_PREFIX}{_encode(name)}-{token}"


def old_name(name: str, token: str) -> str:
    """``.fastpersist-old-ENC-TOKEN`` (``name`` as given: shorten it first if needed)."""
    return f"{OLD_PREFIX}{_encode(name)}-{token}"


def parse_leftover(entry: str) -> Optional[tuple[str, str]]:
    """``(kind, name)`` of a staging (``"staging"``) or moved-aside (``"old"``) directory
    name of this or an earlier release, or None for any other name."""
    m = LEFTOVER_RE.fullmatch(entry)
    if m is not None:
        return m["kind"], _decode(m["enc"])
    m = _PLAIN_LEFTOVER_RE.fullmatch(entry)
    return None if m is None else (m["kind"], m["name"])


def why_not_staged(target: str, stage_parent: Optional[str] = None) -> Optional[str]:
    """None where a directory staged in ``stage_parent`` (default: beside ``target``) can
    replace ``target`` by rename; else the reason, in words: the two parents are on
    different filesystems, or ``target`` exists and is not a directory, is a mount
    point, or holds the working directory (swapping it would leave the process in a
    deleted directory). ``target`` has its symbolic links resolved."""
    parent = os.path.dirname(target)
    try:
        if stage_parent is not None and os.stat(parent).st_dev != os.stat(stage_parent).st_dev:
            return f"{parent} and {stage_parent} are on different filesystems"
        if os.path.lexists(target):
            if not os.path.isdir(target):
                return f"{target} exists and is not a directory"
            if os.stat(target).st_dev != os.stat(parent).st_dev:
                return f"{target} is a mount point"
            cwd = os.path.realpath(os.getcwd())
            if cwd == target or cwd.startswith(target.rstrip(os.sep) + os.sep):
                return f"the working directory is inside {target}"
    except OSError as e:
        return str(e)
    return None


def fsync_tree(directory: str) -> None:
    """fsync every file and directory under ``directory`` (bottom-up), ``directory`` last;
    not its parent. Files fastpersist wrote are clean already; this covers the others
    (carried over, written by other code paths)."""
    for root, _dirs, files in os.walk(directory, topdown=False):
        for name in files:
            path = os.path.join(root, name)
            if os.path.isfile(path) and not os.path.islink(path):
                fsync_path(path)
        fsync_dir(root)


def fsync_tree_and_parent(directory: str) -> None:
    """:func:`fsync_tree` of ``directory``, then fsync its parent (so that ``directory``'s
    own entry is durable too)."""
    fsync_tree(directory)
    fsync_dir(os.path.dirname(os.path.abspath(directory)))


def rebase(path: "os.PathLike[str] | str", root: str, new_root: str) -> Optional[str]:
    """``path`` moved from under ``root`` to the same relative place under ``new_root``:
    ``new_root`` for ``root`` itself, ``new_root/REL`` for ``root/REL``, None for a path
    outside ``root``. Both ``path`` and ``root`` are compared as absolute paths (symbolic
    links not resolved)."""
    p = os.path.abspath(os.fspath(path))
    r = os.path.abspath(root)
    if p == r:
        return new_root
    prefix = r.rstrip(os.sep) + os.sep
    if p.startswith(prefix):
        return os.path.join(new_root, p[len(prefix):])
    return None


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def carry_over(old_dir: str, new_dir: str, is_checkpoint_entry: Callable[[str], object], *,
               what: str, logger: logging.Logger) -> None:
    """Entries of ``old_dir`` (the directory being replaced) that ``new_dir`` lacks and that
    are no checkpoint entries (``is_checkpoint_entry(name)`` false: a user's notes,
    ``config.json``, logs) go into ``new_dir`` as hard links (copies where the filesystem
    has none; symbolic links as links), so ``old_dir`` stays whole until the swap.
    Checkpoint entries the new save did not write again are stale and dropped, as are
    fastpersist's temporary files. ``what`` names the checkpoint in the log
    (``"an Accelerate checkpoint"``)."""
    for name in os.listdir(old_dir):
        dst = os.path.join(new_dir, name)
        if os.path.lexists(dst) or is_checkpoint_entry(name) or (name.startswith(".") and TMP_MARKER in name):
            continue
        src = os.path.join(old_dir, name)
        logger.info("fastpersist: keeping %s (not part of %s) in the new checkpoint", src, what)
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
        elif os.path.isdir(src):
            shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(src, dst)


def swap_in(staging: str, target: str, old: str, is_checkpoint_entry: Callable[[str], object], *, what: str,
            logger: logging.Logger, on_visible: Callable[[], object],
            sync_tree: Callable[[str], None] = fsync_tree) -> Optional[str]:
    """Make the directory ``staging`` visible as ``target`` in one step.

    ``target`` missing: ``staging`` is fsynced (``sync_tree``) and renamed to it. Else
    entries of ``target`` that are no checkpoint entries are carried into ``staging``
    (:func:`carry_over`), ``staging`` is fsynced and the two are exchanged
    (RENAME_EXCHANGE), or, where that is refused, ``target`` is renamed to ``old`` (a
    sibling of ``staging``) and ``staging`` to ``target`` (the first rename is undone if
    the second fails). ``on_visible()`` is called as soon as ``target`` names the new
    directory; then the parents of ``target`` and ``staging`` are fsynced.

    Returns the path that holds the previous directory now (``staging`` or ``old``), for
    the caller to remove, or None where ``target`` did not exist. An exception before
    ``on_visible()`` leaves ``target`` as it was (``staging`` stays: the caller removes it);
    one after it (an fsync) leaves the new directory in place.
    """
    parents = [os.path.dirname(target)]
    if os.path.dirname(staging) != parents[0]:
        parents.append(os.path.dirname(staging))
    if not os.path.lexists(target):
        sync_tree(staging)
        _sys.rename(staging, target)
        on_visible()
        for d in parents:
            fsync_dir(d)
        return None
    carry_over(target, staging, is_checkpoint_entry, what=what, logger=logger)
    sync_tree(staging)
    try:
        exchange_paths(staging, target)
    except OSError as e:
        if e.errno not in EXCHANGE_REFUSED:
            raise
        # No RENAME_EXCHANGE here: move the previous directory aside, then rename the new one
        # in. Killed between the two, target is missing and the previous copy waits under
        # .fastpersist-old-NAME-TOKEN; the next save (clean_leftovers) or the user renames it back.
        logger.info("fastpersist: RENAME_EXCHANGE refused (%s); replacing %s with two renames", e, target)
        _sys.rename(target, old)
        try:
            _sys.rename(staging, target)
        except BaseException:
            os.rename(old, target)  # the undo: not a fault point (an injected fault tests the step it undoes)
            raise
        leftover = old
    else:
        leftover = staging  # the staging name holds the previous directory now
    on_visible()
    for d in parents:
        fsync_dir(d)
    return leftover


def clean_leftovers(directory: str, restore_to: Callable[[str], Optional[str]], *, operation: str,
                    logger: logging.Logger, fsync_after_restore: bool) -> None:
    """Remove the staging directories of killed saves in ``directory`` and give back
    previous directories that a killed fallback commit had moved aside.

    Only directories (never symbolic links) whose names match :data:`LEFTOVER_RE` and
    whose NAME is ours are touched: ``restore_to(NAME)`` is the path the directory NAME
    belongs at, or None for a name that is not ours. An ``old`` copy is renamed back
    there when nothing is there (then, with ``fsync_after_restore``, that path's parent
    is fsynced at once); every other match is removed. ``directory`` is fsynced at the
    end if anything changed. Never raises: problems are logged as warnings.
    ``operation`` names the saving call in the log (``"save_state"``).
    """
    try:
        entries = os.listdir(directory)
    except OSError:
        return
    changed = False
    for entry in entries:
        parsed = parse_leftover(entry)
        dest = None if parsed is None else restore_to(parsed[1])
        if parsed is None or dest is None:
            continue
        path = os.path.join(directory, entry)
        if os.path.islink(path) or not os.path.isdir(path):
            continue
        try:
            if parsed[0] == "old" and not os.path.lexists(dest):
                logger.warning("fastpersist: a %s was killed while replacing %s: restoring the previous copy "
                               "from %s", operation, dest, path)
                _sys.rename(path, dest)
                if fsync_after_restore:
                    fsync_dir(os.path.dirname(dest))
            else:
                logger.info("fastpersist: removing %s, left by a %s that did not finish", path, operation)
                shutil.rmtree(path)
            changed = True
        except OSError as e:
            logger.warning("fastpersist: could not clean up %s: %s", path, e)
    if changed:
        with contextlib.suppress(OSError):
            fsync_dir(directory)


class StagedDir:
    """A save that replaces the directory ``final`` in one step, through a staging directory.

    ``target`` is ``final`` with symbolic links resolved (what is renamed or swapped: a
    symlinked checkpoint directory keeps its link); ``parent`` and ``name`` are its parent
    and name, ``short`` the name as staging names carry it (:func:`short_name`). The
    staging directory for a save's ``token`` (16 hex digits every rank of the save agrees
    on) is :meth:`staging` in ``stage_parent``, which defaults to ``parent``; the adapter
    chooses another (same filesystem) where the parent is a directory its framework lists.
    """

    def __init__(self, final: str, stage_parent: Optional[str] = None) -> None:
        self.final = final
        self.target = os.path.realpath(final)
        self.parent, self.name = os.path.split(self.target)
        self.short = short_name(self.name)
        self._given_stage_parent = stage_parent
        self.stage_parent = self.parent if stage_parent is None else stage_parent

    def staging(self, token: str) -> str:
        """The staging directory of the save ``token``."""
        return os.path.join(self.stage_parent, staging_name(self.short, token))

    def old(self, token: str) -> str:
        """Where the previous directory goes when RENAME_EXCHANGE is refused."""
        return os.path.join(self.stage_parent, old_name(self.short, token))

    def why_not_staged(self) -> Optional[str]:
        """None where the save can be staged and committed by rename; else the reason
        (:func:`why_not_staged`; a ``stage_parent`` given is checked to be on the same
        filesystem)."""
        return why_not_staged(self.target, self._given_stage_parent)

    def clean_leftovers(self, *, operation: str, logger: logging.Logger, fsync_after_restore: bool,
                        restore_other: Optional[Callable[[str], Optional[str]]] = None) -> None:
        """:func:`clean_leftovers` in ``stage_parent`` for the leftovers of this directory
        (NAME is :attr:`short`, restored to :attr:`target`) and of the names for which
        ``restore_other(NAME)`` gives a path (where they are restored to).

        First, the temporary files of dead processes' saves are removed from the
        directory that holds :attr:`target` and its siblings (and ``stage_parent``), and
        from the directories directly inside them
        (:func:`fastpersist.commit.clean_stale_temps_below`): a save killed while writing
        a checkpoint directory of its own (a new DeepSpeed tag, a new ``checkpoint_N``)
        leaves its temporary file where no later save writes."""
        for root in dict.fromkeys((self.parent, self.stage_parent)):
            for path in clean_stale_temps_below(root):
                logger.info("fastpersist: removed %s, the temporary file of a killed save", path)

        def restore_to(name: str) -> Optional[str]:
            if name == self.short:
                return self.target
            return None if restore_other is None else restore_other(name)

        clean_leftovers(self.stage_parent, restore_to, operation=operation, logger=logger,
                        fsync_after_restore=fsync_after_restore)

    def discard(self, token: str) -> bool:
        """Remove the staging directory of ``token`` (a failed or empty save; the target is
        untouched) and fsync ``stage_parent`` (errors ignored). Returns whether there was
        one (a directory, not a symbolic link)."""
        staging = self.staging(token)
        if not os.path.isdir(staging) or os.path.islink(staging):
            return False
        shutil.rmtree(staging, ignore_errors=True)
        with contextlib.suppress(OSError):
            fsync_dir(self.stage_parent)
        return True

    def commit(self, token: str, is_checkpoint_entry: Callable[[str], object], *, what: str, operation: str,
               logger: logging.Logger, on_visible: Callable[[], object] = lambda: None,
               sync_tree: Callable[[str], None] = fsync_tree) -> None:
        """Make the staging directory of ``token`` the target in one step (:func:`swap_in`,
        same arguments), then remove the previous copy and fsync ``stage_parent``.

        Failing to remove the previous copy (an NFS ``.nfsXXXX`` file, a read-only
        subdirectory) does not fail the commit: the new directory is in place; it is logged
        as a warning, and the copy, under one of our names, goes with the next save's
        :meth:`clean_leftovers`. ``operation`` names that save in the warning. An exception
        before ``on_visible()`` leaves the target as it was and the staging directory in
        place (the caller removes it: :meth:`discard`).
        """
        previous = swap_in(self.staging(token), self.target, self.old(token), is_checkpoint_entry, what=what,
                           logger=logger, on_visible=on_visible, sync_tree=sync_tree)
        if previous is None:
            return
        try:
            shutil.rmtree(previous)
            fsync_dir(self.stage_parent)
        except OSError as e:
            logger.warning("fastpersist: %s is in place; could not remove the previous copy %s (%s); the next "
                           "%s removes it", self.target, previous, e, operation)
