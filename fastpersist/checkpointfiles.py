"""One checkpoint file per call, by location, blocking or in the background: a framework's
checkpoint-IO object over fastpersist.

A framework's checkpoint-IO hooks (save this dict to that path, load it, remove it) map
one to one onto :class:`CheckpointFiles`' methods, which adapters inherit. It writes local
paths and ``s3://`` URLs (:func:`fastpersist.locations.resolve`), with
:func:`fastpersist.save` or in the background with :func:`fastpersist.save_async`, and
keeps the bookkeeping a framework must never see: the saves still pending
(:class:`fastpersist.settle.PendingSaves`) are finished before a load or a removal, so
retention never deletes the previous checkpoint before the new one is durable; s3fs's
cached listings are refreshed after each save and removal; a pickled copy starts with no
pending saves (they stay with, and are finished by, the process that started them).
Locations of other URL schemes are the framework's own (:meth:`CheckpointFiles.passes_on`).
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Optional

from fastpersist import api, asyncsave, s3folder
from fastpersist.config import Config
from fastpersist.locations import forget_listings, resolve
from fastpersist.s3url import is_s3_url
from fastpersist.settle import PendingSaves

__all__ = ["CheckpointFiles", "finish_all"]

log = logging.getLogger(__name__)

#: every CheckpointFiles alive, for :func:`finish_all`
_alive: "weakref.WeakSet[CheckpointFiles]" = weakref.WeakSet()


def finish_all() -> None:
    """Finish the pending background saves of every :class:`CheckpointFiles` of this
    process (raises the first error)."""
    for files in list(_alive):
        files.finalize()


class CheckpointFiles:
    """Saves, loads and removals of checkpoint files through fastpersist.

    Args:
        async_save: write in the background with :func:`fastpersist.save_async`
            (default); ``False``: every save returns when the file is durable.
        mode: ``save_async``'s capture mode, ``"snapshot"`` (default) or ``"lazy"``.
        config: a :class:`fastpersist.Config` for every save and load.

    :attr:`counts` counts the calls by kind: ``save``, ``save_async``, ``save_group``
    (a file the ranks of a group wrote together), ``save_group_async``, ``load``,
    ``load_group``, and ``torch`` (calls passed on to the framework's own code).
    """

    def __init__(self, async_save: Optional[bool] = None, mode: str = "snapshot",
                 config: Optional[Config] = None) -> None:
        super().__init__()
        self.async_save = True if async_save is None else bool(async_save)
        self.mode = mode
        self.config = config
        self._pending = PendingSaves()
        #: saves/loads done by fastpersist in this process (sync, async, collective, load)
        self.counts = {"save": 0, "save_async": 0, "save_group": 0, "load": 0, "load_group": 0, "torch": 0}
        _alive.add(self)

    def passes_on(self, location: Any) -> bool:
        """Whether ``location`` is not one fastpersist writes (another URL scheme): then the
        caller's own code handles the call, after this object's pending saves finished
        (counted as ``torch``)."""
        if resolve(location) is not None:
            return False
        self.finalize()
        self.counts["torch"] += 1
        return True

    def save_file(self, obj: Any, location: Any) -> None:
        """Save ``obj`` to ``location`` (a local path or an ``s3://`` URL), creating its
        folder; in the background with :attr:`async_save` (an earlier save's error is raised
        here if it already failed)."""
        target = resolve(location)
        if target is None:
            raise ValueError(f"fastpersist does not write {location!r}: a local path or an s3:// URL")
        if not is_s3_url(target):
            os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
        if not self.async_save:
            api.save(obj, target, config=self.config)
            self.counts["save"] += 1
            forget_listings(target)
            return
        self._collect(block=False)
        self.track(asyncsave.save_async(obj, target, mode=self.mode, config=self.config))
        self.counts["save_async"] += 1

    def save_group_file(self, obj: Any, path: str, group: Any) -> None:
        """Save ``obj`` to the local ``path`` together with the other ranks of ``group``
        (every rank calls it; ``fastpersist.save(..., group=)``), in the background with
        :attr:`async_save`."""
        if self.async_save:
            self.track(asyncsave.save_async(obj, path, mode=self.mode, config=self.config, group=group))
            self.counts["save_group_async"] = self.counts.get("save_group_async", 0) + 1
        else:
            api.save(obj, path, config=self.config, group=group)

    def load_file(self, location: Any, *, map_location: Any = None, weights_only: Optional[bool] = None,
                  group: Any = None) -> Any:
        """Load ``location`` with :func:`fastpersist.load` once every pending save finished
        (``group``: the ranks of ``group`` read a local file once in total).
        ``FileNotFoundError`` names a missing file."""
        self.finalize()
        if is_s3_url(location) and group is None:  # fastpersist.load names a missing object
            self.counts["load"] += 1
            return api.load(str(location), map_location=map_location, weights_only=weights_only, config=self.config)
        target = resolve(location)
        if target is None:
            raise ValueError(f"fastpersist does not read {location!r}: a local path or an s3:// URL")
        asyncsave.wait_for_path(target)  # a pending save of another object
        if not os.path.exists(target):
            raise FileNotFoundError(f"Checkpoint file not found: {location}")
        self.counts["load" if group is None else "load_group"] += 1
        extra = {} if group is None else {"group": group}
        return api.load(target, map_location=map_location, weights_only=weights_only, config=self.config, **extra)

    def remove_object(self, location: Any) -> bool:
        """Remove ``location`` if it is an ``s3://`` object (no error when there is none),
        after every pending save finished; returns whether it was one (files are the
        framework's to remove, after the same wait)."""
        self.finalize()
        if not is_s3_url(location):
            return False
        s3folder.delete_object(str(location), config=self.config)
        forget_listings(str(location))
        return True

    def track(self, future: Any) -> None:
        """Finish ``future`` (a background save of a checkpoint file) with this object's own."""
        self._pending.add(future)

    def _collect(self, block: bool) -> None:
        """Drop finished futures, raising the first error; with ``block`` wait for all."""
        self._pending.collect(block=block, what="a checkpoint", logger=log,
                              on_settled=lambda f: forget_listings(str(getattr(f, "path", ""))))

    def finalize(self) -> None:
        """Wait until every checkpoint this object started is durable under its name."""
        self._collect(block=True)

    @property
    def pending(self) -> int:
        """How many background saves have not finished."""
        return self._pending.running()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_pending"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pending = PendingSaves()
        _alive.add(self)
