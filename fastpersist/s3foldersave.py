"""A folder checkpoint that every rank of a job saves to object storage together, and its load.

A framework that saves a checkpoint *folder* from several processes (Accelerate's
``save_state``, DeepSpeed's tag directories) reaches ``s3://`` through
:func:`save_collective`: every rank writes its files with the framework's own save into a
local temporary directory (in ``TMPDIR``), uploads them, one object each, into one fresh
generation of the folder (:mod:`fastpersist.s3folder`; the leader's token, shared), and
the leader commits the folder (its manifest, written last). The ranks agree on the
outcome after each step (:func:`fastpersist.collectivedir.agree` over an
:class:`~fastpersist.collectivedir.Exchange`): a failure on any rank raises on every rank,
and the checkpoint committed in the folder before, if any, stays the one that loads.
:func:`local_copy` is the way back: the committed folder downloaded (every object checked
against the commit) into a local temporary directory that the framework loads from.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from typing import Any, Callable, Iterable, Iterator, Optional

from fastpersist import s3folder
from fastpersist.collectivedir import Exchange, agree, failed_elsewhere

__all__ = ["KEPT", "by_top_level", "local_copy", "put_files", "read_text", "save_collective", "save_tag",
           "tag_copy", "url_of"]

log = logging.getLogger("fastpersist.s3")

#: what a failed save leaves, as the errors say it (the default of ``kept``)
KEPT = "the checkpoint committed there before, if any, stays the one that loads"


def by_top_level(is_entry: Callable[[str], object]) -> Callable[[str], bool]:
    """An ``owns`` for :func:`save_collective`: an object of the folder is the framework's when
    the first component of its relative path is one of its checkpoint entries
    (``is_entry(name)``); the others (a user's ``config.json``) stay when the folder is
    saved again."""

    def owns(rel: str) -> bool:
        return bool(is_entry(rel.split("/", 1)[0]))

    return owns


def save_collective(target: Any, write: Callable[[str], object], *, exchange: Exchange, rank: int,
                    name: str = "checkpoint", owns: Optional[Callable[[str], bool]] = None, config: Any = None,
                    after_commit: Optional[Callable[[str], None]] = None, operation: str = "save",
                    peer: str = "rank", kept: str = KEPT, logger: logging.Logger = log) -> str:
    """Every rank: save the folder ``target`` (``s3://bucket/prefix``) together; returns its URL.

    Args:
        target: the folder's URL.
        write: ``write(local)`` writes this rank's files of the folder into the local
            directory ``local`` (``TMPDIR/fastpersist-XXXX/NAME``, not there yet: the
            framework's save makes it); every file under it is uploaded.
        exchange: how the ranks share their outcomes (every rank calls with its own).
        rank: this rank's index in ``exchange``; rank 0 (the leader) begins and commits the
            folder. A file that several ranks wrote (a replica) is uploaded by the lowest of
            them only.
        name: the last component of ``local``.
        owns: which objects outside the generations (files of the first format) the
            commit may delete (:func:`fastpersist.s3folder.commit`).
        config: a :class:`fastpersist.Config` (the uploads' threads, parts and timeouts).
        after_commit: ``after_commit(local)``, run by the leader once the folder is
            committed (objects beside the folder); its failure fails the save on every rank.
        operation: the saving call, in the errors (``"save_state"``).
        peer: what the errors call the other processes (``"rank"``, ``"process"``).
        kept: what a failure after the uploads began leaves, in the errors.

    Raises this rank's error, or ``RuntimeError`` naming the ranks that failed and why.
    The leader deletes the objects of a save that failed after the uploads began (best
    effort: what remains goes with the folder's next commit).
    """
    folder = str(s3folder.folder_url(target))
    tmp = tempfile.mkdtemp(prefix="fastpersist-")
    local = os.path.join(tmp, name)
    what = f"fastpersist: {operation} to {folder}"
    untouched = failed_elsewhere(what, peer=peer, after=f"{folder} is untouched")
    try:
        error: Optional[BaseException] = None
        try:
            write(local)
        except BaseException as e:  # noqa: BLE001 - every rank learns of it below
            error = e
        # nothing uploaded yet: the folder is untouched; every rank's files, to upload each once
        listings = agree(error, untouched, exchange=exchange, value=s3folder.local_files(local))
        others = {rel for listing in listings[:rank] for rel in listing}
        leader = rank == 0
        generation: Optional[str] = None
        if leader:
            try:  # the previous commit in the folder stands until this save's commit
                generation = s3folder.begin(folder, owns=owns, config=config)
            except BaseException as e:  # noqa: BLE001
                error = e
        generation = next(g for g in agree(error, untouched, exchange=exchange, value=generation) if g is not None)
        files: dict = {}
        try:
            files = s3folder.upload_files(local, folder, generation=generation, only=lambda rel: rel not in others,
                                          config=config)
        except BaseException as e:  # noqa: BLE001
            error = e
        uploaded = exchange.gather((error is None, files))
        if leader and all(ok for ok, _f in uploaded):
            try:
                s3folder.commit(folder, {k: v for _ok, part in uploaded for k, v in part.items()},
                                generation=generation, owns=owns, config=config)
                if after_commit is not None:
                    after_commit(local)
            except BaseException as e:  # noqa: BLE001
                error = e
        elif leader:
            with contextlib.suppress(Exception):
                s3folder.discard(folder, generation, config=config)
        if error is not None:
            logger.error("fastpersist: %s to %s failed (%s); %s", operation, folder, error, kept)
        agree(error, failed_elsewhere(what, peer=peer, after=kept), exchange=exchange)
        return folder
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def local_copy(target: Any, *, name: str = "checkpoint", config: Any = None) -> Iterator[str]:
    """The committed folder ``target`` downloaded into ``TMPDIR/fastpersist-XXXX/NAME``
    (every object checked against the commit: :func:`fastpersist.s3folder.download`), for
    the ``with`` block; removed afterwards. Raises
    :class:`~fastpersist.s3folder.UncommittedFolderError` for a folder without its commit."""
    tmp = tempfile.mkdtemp(prefix="fastpersist-")
    try:
        local = os.path.join(tmp, name)
        s3folder.download(target, local, config=config)
        yield local
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def put_files(target: Any, local_dir: str, names: Iterable[str], *, config: Any = None) -> list[str]:
    """Each of the files ``names`` of ``local_dir`` that exists, one small object under the
    folder ``target`` (files the framework writes beside its checkpoint folders, uploaded
    after their commit: DeepSpeed's ``zero_to_fp32.py``); returns the names uploaded."""
    done = []
    for name in names:
        path = os.path.join(local_dir, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                s3folder.put_small(s3folder.join(target, name), f.read(), config=config)
            done.append(name)
    return done


def read_text(url: str, *, config: Any = None) -> Optional[str]:
    """The text of the small object ``url`` (a pointer such as DeepSpeed's ``latest``),
    stripped; None when there is none."""
    try:
        return s3folder.get_small(url, config=config).decode().strip()
    except s3folder.UncommittedFolderError:
        raise
    except FileNotFoundError:
        return None


def save_tag(run: Any, tag: str, write: Callable[[str], object], *, pointer: Optional[str] = "latest",
             beside: Iterable[str] = (), config: Any = None, **kwargs: Any) -> str:
    """Every rank: :func:`save_collective` of the folder ``RUN/TAG`` of a run of tag folders
    (DeepSpeed's ``save_dir``); ``write(local_run)`` writes this rank's files into
    ``local_run/TAG``. After the commit the leader uploads the files ``beside`` of
    ``local_run`` that exist (:func:`put_files`), then writes the object ``RUN/POINTER``
    holding ``tag`` (last: the pointer only ever names a committed folder). The other
    arguments are :func:`save_collective`'s. Returns the folder's URL."""
    run = str(s3folder.folder_url(run))

    def after_commit(local: str) -> None:
        put_files(run, os.path.dirname(local), beside, config=config)
        if pointer is not None:
            s3folder.put_small(s3folder.join(run, pointer), tag.encode(), config=config)

    return save_collective(s3folder.join(run, tag), lambda local: write(os.path.dirname(local)), name=tag,
                           config=config, after_commit=after_commit, **kwargs)


@contextlib.contextmanager
def tag_copy(run: Any, tag: Any = None, *, pointer: str = "latest",
             config: Any = None) -> Iterator[Optional[tuple[str, str]]]:
    """``(local_run, tag)`` for the ``with`` block: the committed folder ``RUN/TAG`` downloaded
    into ``local_run/TAG`` (:func:`local_copy`); ``tag`` None: the one the object
    ``RUN/POINTER`` names. None when there is no pointer object (nothing to resume)."""
    if tag is None:
        tag = read_text(s3folder.join(run, pointer), config=config)
        if tag is None:
            yield None
            return
    tag = str(tag)
    with local_copy(s3folder.join(run, tag), name=tag, config=config) as local:
        yield os.path.dirname(local), tag


def url_of(run: Any, local_run: str, path: Any) -> Any:
    """A path the framework returned from its load of ``local_run`` (:func:`tag_copy`), as the
    URL of the same object under ``RUN``; anything but a ``str`` unchanged."""
    if not isinstance(path, str):
        return path
    return s3folder.join(run, os.path.relpath(path, local_run))
