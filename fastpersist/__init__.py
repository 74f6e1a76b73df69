"""fastpersist: PyTorch checkpoints at the speed of the storage.

Public API::

    fastpersist.save(obj, path)          # drop-in for torch.save (file loads with stock torch.load)
    fastpersist.load(path)               # drop-in for torch.load, parallel O_DIRECT reads
    fastpersist.verify(path)             # checksum every payload byte
    fastpersist.save_file(tensors, path, metadata=None)  # drop-in for safetensors.torch.save_file
    fastpersist.load_file(path, device="cpu")            # drop-in for safetensors.torch.load_file
    fastpersist.load_model(model, path)                  # drop-in for safetensors.torch.load_model
    fastpersist.save_async(obj, path)    # background save, bytes as at the call (snapshot or lazy + guard)
    fastpersist.wait_durable()           # tiered s3:// saves (s3_local_dir): wait until every drain is in the store
    fastpersist.patch_torch_save()       # route torch.save/torch.load through fastpersist
    fastpersist.Config                   # engine, buffers, queue depth, threads, O_DIRECT, fsync, checksum
    fastpersist.io                       # low-level I/O handle, pinned tensors, byte views
    fastpersist.load_state_dict(model, path)  # read a checkpoint straight into a model's/optimizer's tensors
    fastpersist.open(path)               # lazy reader: keys()/info() from the index, get()/get_many() read only those
    fastpersist.stream_weights(model, path)   # run a model larger than memory: blocks' weights streamed from disk
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

from fastpersist import io  # noqa: E402
from fastpersist.api import load, load_file, load_model, save, save_file, verify  # noqa: E402
from fastpersist.asyncsave import SaveFuture, guard, save_async, wait_all  # noqa: E402
from fastpersist.config import Config  # noqa: E402
from fastpersist.patch import patch_torch_save, unpatch_torch_save  # noqa: E402
from fastpersist.s3tier import wait_durable  # noqa: E402
from fastpersist.lazy import CheckpointReader, open  # noqa: E402,A004
from fastpersist.loadinto import PartialLoadError, StateDictMismatchError, load_state_dict  # noqa: E402
from fastpersist.streaming import StreamingError, stream_weights  # noqa: E402

__all__ = [
    "CheckpointReader",
    "Config",
    "PartialLoadError",
    "StateDictMismatchError",
    "StreamingError",
    "load_state_dict",
    "open",
    "SaveFuture",
    "__version__",
    "io",
    "load",
    "load_file",
    "load_model",
    "guard",
    "patch_torch_save",
    "save",
    "save_file",
    "save_async",
    "stream_weights",
    "unpatch_torch_save",
    "verify",
    "wait_all",
    "wait_durable",
]

from fastpersist.patch import apply_env_patch  # noqa: E402

apply_env_patch()

#: subpackages that ``import fastpersist`` does not import (each pulls in more of torch or a
#: framework) but that resolve as attributes on first use: ``fastpersist.integrations.deepspeed``,
#: ``fastpersist.dcp.FastPersistWriter``
_LAZY_SUBPACKAGES = ("dcp", "distributed", "integrations")


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBPACKAGES:
        import importlib

        return importlib.import_module(f"fastpersist.{name}")
    raise AttributeError(f"module 'fastpersist' has no attribute {name!r}")
