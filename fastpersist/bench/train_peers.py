"""The checkpointers ``fastpersist bench train`` compares: one small class per method.

Each :class:`Saver` makes the method's checkpoint call, drains it at the end of a
run (counted as lost time), reads a checkpoint back for verification, and
releases what it holds. fastpersist's own methods and the peers users would pick:
``torch.save``, DCP's ``async_save`` (thread and process modes) and Lightning's
``AsyncCheckpointIO`` (see :mod:`fastpersist.bench.train_bench`); and the tiered mode
of ``s3://`` URLs (:class:`TieredSaver`) beside ``async-snapshot``.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

import fastpersist
from fastpersist import objectstore, s3client, s3journal
from fastpersist.s3url import parse


def str_keys(obj: Any) -> Any:
    """``obj`` with every dict key turned into a string (DCP stores the optimizer's integer keys as strings)."""
    if isinstance(obj, dict):
        return {str(k): str_keys(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(str_keys(v) for v in obj)
    return obj


def _result(future: Any) -> Any:
    """Wait for what ``dcp.async_save`` returned (a ``Future`` or an ``AsyncSaveResponse``)."""
    upload = getattr(future, "upload_completion", None)
    return (upload if upload is not None else future).result()


class Saver:
    """One method's checkpoint call, its drain, and how to read a checkpoint back for verification."""

    #: the checkpoint is a directory (DCP) rather than a file
    directory = False

    def save(self, state: Any, path: str) -> None:
        raise NotImplementedError

    def drain(self) -> None:
        """Wait until every checkpoint is written (counted as lost time)."""

    def load(self, path: str) -> Any:
        return torch.load(path, map_location="cpu", weights_only=False)

    def close(self) -> None:
        """Release what the saver holds (untimed)."""


class _TorchSaver(Saver):
    def save(self, state: Any, path: str) -> None:
        torch.save(state, path)


class _FastPersistSaver(Saver):
    def __init__(self, mode: Optional[str]) -> None:
        self.fp = fastpersist
        self.mode = mode

    def save(self, state: Any, path: str) -> None:
        if self.mode is None:
            self.fp.save(state, path)
        else:
            self.fp.save_async(state, path, mode=self.mode)

    def drain(self) -> None:
        self.fp.wait_all()

    def close(self) -> None:
        try:
            self.fp.wait_all()
        except Exception:  # noqa: BLE001 - the run's error is already recorded
            pass


class DcpAsyncSaver(Saver):
    directory = True

    def __init__(self, process: bool) -> None:
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        self.process = process
        self.future: Any = None
        self.stager: Any = None
        self.kwargs: dict[str, Any] = {"no_dist": True}
        if process:
            from torch.distributed.checkpoint.staging import DefaultStager
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            self.stager = DefaultStager(process_staging_options())
            self.kwargs = {"async_checkpointer_type": AsyncCheckpointerType.PROCESS, "async_stager": self.stager}

    def save(self, state: Any, path: str) -> None:
        import warnings

        if self.future is not None:  # DCP's documented use: the previous save done before the next
            _result(self.future)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.future = self.dcp.async_save(state, checkpoint_id=path, **self.kwargs)

    def drain(self) -> None:
        if self.future is not None:
            _result(self.future)
            self.future = None

    def load(self, path: str) -> Any:
        import warnings

        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        out = path + ".as-torch.pt"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp_to_torch_save(path, out)
        try:
            return torch.load(out, map_location="cpu", weights_only=False)
        finally:
            os.unlink(out)

    def close(self) -> None:
        try:
            self.drain()
        except Exception:  # noqa: BLE001 - the run's error is already recorded
            pass
        if self.stager is not None:
            self.stager.close()


class _LightningAsyncSaver(Saver):
    def __init__(self) -> None:
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

        self.io = AsyncCheckpointIO(TorchCheckpointIO())

    def save(self, state: Any, path: str) -> None:
        self.io.save_checkpoint(state, path)

    def drain(self) -> None:
        self.io.teardown()

    def close(self) -> None:
        try:
            self.io.teardown()
        except Exception:  # noqa: BLE001 - the run's error is already recorded
            pass


def process_staging_options() -> Any:
    """DCP's staging for the process mode: pinned memory (and async staging) where CUDA is
    available; torch 2.15's ``StagingOptions`` require CUDA for those, so on CPU: shared memory only."""
    from torch.distributed.checkpoint.staging import StagingOptions

    cuda = torch.cuda.is_available()
    return StagingOptions(use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=cuda,
                          use_non_blocking_copy=cuda)


class TieredSaver(Saver):
    """fastpersist's tiered mode: ``save_async`` to ``s3://`` with a local directory
    (``s3_local_dir``): the save lands on the local disk as ``async-snapshot``'s does and
    the upload drains in the background. :meth:`drain` waits for the local copies (the
    training's wait); :meth:`wait_durable` for the uploads (untimed); :meth:`load` reads
    the object itself, after checking it holds the local file's bytes exactly."""

    def __init__(self, prefix: str, local_dir: str) -> None:
        self.prefix = prefix.rstrip("/")
        self.local_dir = local_dir
        self.cfg = fastpersist.config.get_default().replace(s3_local_dir=local_dir, s3_keep_local=0,
                                                              s3_keep_remote=0)
        self.direct = self.cfg.replace(s3_local_dir=None)
        self.urls: list[str] = []

    def url(self, path: str) -> str:
        return f"{self.prefix}/{os.path.basename(path)}"

    def save(self, state: Any, path: str) -> None:
        self.urls.append(self.url(path))
        fastpersist.save_async(state, self.url(path), config=self.cfg)

    def drain(self) -> None:
        fastpersist.wait_all()

    def wait_durable(self) -> None:
        fastpersist.wait_durable()

    def load(self, path: str) -> Any:
        url = self.url(path)
        fastpersist.wait_durable(url)
        local = s3journal.local_path(parse(url), os.path.abspath(self.local_dir))
        with objectstore.fetch(url, config=self.direct) as got, open(local, "rb") as lf, open(got.path, "rb") as rf:
            while True:
                a, b = lf.read(1 << 24), rf.read(1 << 24)
                if a != b:
                    raise ValueError(f"{url} does not hold the bytes of its local copy {local}")
                if not a:
                    break
        return fastpersist.load(url, map_location="cpu", weights_only=False, config=self.direct)

    def close(self) -> None:
        try:
            fastpersist.wait_all()
            fastpersist.wait_durable()
        finally:
            c = s3client.client()
            for url in self.urls:
                u = parse(url)
                try:
                    c.delete_object(Bucket=u.bucket, Key=u.key)
                except Exception:  # noqa: BLE001 - cleanup of the benchmark's objects, best effort
                    pass


def make_saver(method: str, s3_prefix: Optional[str] = None, local_dir: Optional[str] = None) -> Optional[Saver]:
    if method == "none":
        return None
    if method == "torch.save":
        return _TorchSaver()
    if method == "fastpersist.save":
        return _FastPersistSaver(None)
    if method in ("async-snapshot", "async-lazy"):
        return _FastPersistSaver(method.split("-", 1)[1])
    if method in ("dcp.async_save", "dcp.async_save-process"):
        return DcpAsyncSaver(process=method.endswith("process"))
    if method == "lightning-async":
        return _LightningAsyncSaver()
    if method == "async-tiered":
        if not s3_prefix or not local_dir:
            raise ValueError("async-tiered needs an s3:// prefix (--s3) and a local directory")
        return TieredSaver(s3_prefix, local_dir)
    raise ValueError(f"unknown method {method!r}")


def unavailable(method: str) -> Optional[str]:
    """Why ``method`` cannot run in this installation (its library missing), or ``None``."""
    import importlib.util

    needs = {"lightning-async": "lightning", "dcp.async_save": "torch.distributed.checkpoint",
             "dcp.async_save-process": "torch.distributed.checkpoint"}.get(method)
    if needs is None:
        return None
    try:
        found = importlib.util.find_spec(needs) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return f"{needs} is not installed"
    if method.startswith("dcp") and not torch.distributed.is_available():
        return "torch.distributed is not available in this torch build"
    return None


def deepspeed_decoupled_status() -> str:
    """Why DeepSpeed's decoupled FastPersist checkpoint engine is not measured on this machine."""
    try:
        import deepspeed  # noqa: F401
    except ImportError as exc:
        return f"deepspeed not installed ({exc})"
    reasons = []
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible(verbose=False):
            reasons.append("its writer needs DeepSpeed's async_io op, JIT-built against libaio-dev, whose "
                           "headers are not on this machine (AsyncIOBuilder().is_compatible() is False)")
    except Exception as exc:  # noqa: BLE001 - any failure is the reason
        reasons.append(f"AsyncIOBuilder unavailable ({type(exc).__name__}: {exc})")
    if not torch.cuda.is_available():
        reasons.append("its FastFileWriter stages through accelerator pinned buffers and a byte-cast op built for "
                       "GPUs, and DecoupledCheckpointEngine runs inside an initialized DeepSpeed engine "
                       "(deepspeed.comm) with an aio/checkpoint writer config; no GPU here")
    return "; ".join(reasons) if reasons else ("its prerequisites are present, but this benchmark does not drive a "
                                               "DeepSpeed engine yet")


def stop_dcp_daemon() -> None:
    """Terminate DCP's checkpoint daemon process (torch keeps it in a module global until exit)."""
    try:
        from torch.distributed.checkpoint import _async_process_executor as ape
    except ImportError:
        return
    proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
    if proc is None:
        return
    ape._CHECKPOINT_PROCESS = None
    try:
        child = proc._save_process
        if child.is_alive():
            proc._send(ape._CheckpointSaveProcessControlOpts.TERMINATE)
            child.join(timeout=60)
        if child.is_alive():
            child.terminate()
        child.join()  # dead now: the object's own __del__ (at garbage collection) then does nothing
    except Exception:  # noqa: BLE001 - best effort at teardown
        pass
