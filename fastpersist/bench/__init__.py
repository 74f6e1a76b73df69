"""Benchmarks users run on their own disks (``fastpersist bench io`` / ``fastpersist bench save``).

* :func:`fastpersist.bench.io_bench.run_io_bench`: raw write / cold-read GB/s of
  :class:`fastpersist.io.IOHandle` over engines, block sizes, queue depths,
  threads and O_DIRECT on/off, beside fio's ceiling (like DeepSpeed's ``ds_io``).
* :func:`fastpersist.bench.save_bench.run_save_bench`: durable save and cold load
  of a realistic training state with fastpersist, ``torch.save``, safetensors and
  ``torch.distributed.checkpoint``, beside fio's ceiling.

Both return result objects with ``to_dict()`` (JSON) and are printed by
:mod:`fastpersist.bench.report`. Every run prints the machine first
(:mod:`fastpersist.bench.machine`). See ``docs/benchmarks.md``.
"""

from __future__ import annotations

from fastpersist.bench.io_bench import run_io_bench
from fastpersist.bench.save_bench import run_save_bench

__all__ = ["run_io_bench", "run_save_bench"]


def __getattr__(name: str):  # lazy: importing the CLI must not import every benchmark
    if name == "run_io_bench":
        return run_io_bench
    if name == "run_save_bench":
        return run_save_bench
    raise AttributeError(f"module 'fastpersist.bench' has no attribute {name!r}")
