"""Collective saves and loads of replicated state over a ``torch.distributed`` group: the
public names, as documented (``fastpersist.distributed.DistributedCheckpointError``).

``fastpersist.save(obj, path, group=g)`` and ``fastpersist.load(path, group=g)`` are the
calls users make; how they run is in :mod:`fastpersist.collectivesave` and
:mod:`fastpersist.collectiveload`, the exchanges between the ranks in
:mod:`fastpersist.coordinator`, the errors in :mod:`fastpersist.errors`.
"""

from __future__ import annotations

from fastpersist.collectiveload import last_load_phases, load
from fastpersist.collectivesave import last_save_phases, save
from fastpersist.errors import DistributedCheckpointError, DistributedTimeoutError, ReplicasDifferError

__all__ = ["DistributedCheckpointError", "DistributedTimeoutError", "ReplicasDifferError", "save", "load",
           "last_save_phases", "last_load_phases"]
