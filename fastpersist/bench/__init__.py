"""Benchmarks users run on their own disks (``fastpersist bench io|save|train|dist|stream``).

Nothing in the library imports this package: ``fastpersist.cli`` loads it only when the
``bench`` command runs (``fastpersist bench ...``), and importing it loads no benchmark.

* :func:`fastpersist.bench.io_bench.run_io_bench`: raw write / cold-read GB/s of
  :class:`fastpersist.io.IOHandle` over engines, block sizes, queue depths,
  threads and O_DIRECT on/off, beside fio's ceiling (like DeepSpeed's ``ds_io``).
* :func:`fastpersist.bench.save_bench.run_save_bench`: durable save and cold load
  of a realistic training state with fastpersist, ``torch.save``, safetensors and
  ``torch.distributed.checkpoint``, beside fio's ceiling.

Both return result objects with ``to_dict()`` (JSON) and are printed by
:mod:`fastpersist.bench.report`. Every run prints the machine first
(:mod:`fastpersist.machine`). See ``docs/benchmarks.md``.
"""
