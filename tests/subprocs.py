"""Helpers shared by the tests: independent child processes run side by side, a byte
of a file flipped in place, and a checkpoint's tensors by their documented names.

The suite runs one test at a time, so while a test waits on a child that imports torch
(seconds each) the machine's other cores are idle: children that share nothing (no file,
no object key, no port) can run at the same time without changing what each one does.
"""

from __future__ import annotations

import os
import socket
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Callable, Sequence, TypeVar

T = TypeVar("T")

#: at most this many children at once (each one's torch import holds a few hundred MB)
MAX_AT_ONCE = 4


def side_by_side(calls: Sequence[Callable[[], T]]) -> list["Future[T]"]:
    """Run the calls (each one a test's independent child process or processes) several at a
    time: at least two, at most one per core and :data:`MAX_AT_ONCE`. Returns once all have
    ended; a future's ``result()`` gives that call's value or raises its exception."""
    if not calls:
        return []
    workers = max(1, min(len(calls), MAX_AT_ONCE, max(2, os.cpu_count() or 2)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return [pool.submit(c) for c in calls]


def run_all(commands: Sequence[Sequence[str]], **kwargs: Any) -> list[subprocess.CompletedProcess]:
    """``subprocess.run(command, **kwargs)`` for every command, side by side
    (:func:`side_by_side`); the results in the commands' order. For children that are
    independent of each other: each sees what it would see alone."""
    return [f.result() for f in side_by_side([partial(subprocess.run, list(c), **kwargs) for c in commands])]


def free_ports(n: int) -> list[int]:
    """``n`` different free TCP ports of 127.0.0.1 (for children started side by side)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:  # all bound at once: n different ports
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def flip_byte(path: Any, offset: int, mask: int = 0x40) -> None:
    """XOR the byte at ``offset`` of the file at ``path`` with ``mask`` (a corrupt byte)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def tensors_by_name(obj: Any, prefix: str = "", out: Any = None) -> dict:
    """The tensors of ``obj`` by fastpersist's documented naming (dict keys and list
    indices joined with ".", as ``fastpersist.open(...).keys()`` gives them)."""
    import torch

    out = {} if out is None else out
    if isinstance(obj, torch.Tensor):
        out[prefix[:-1]] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            tensors_by_name(v, f"{prefix}{k}.", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            tensors_by_name(v, f"{prefix}{i}.", out)
    return out
