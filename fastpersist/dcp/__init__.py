"""fastpersist as the storage layer of ``torch.distributed.checkpoint`` (DCP).

For state that is unique per rank (FSDP, DTensor, ZeRO partitions), DCP plans,
records metadata and reshards; fastpersist moves the bytes::

    import torch.distributed.checkpoint as dcp
    from fastpersist.dcp import FastPersistWriter, FastPersistReader

    dcp.save(state, storage_writer=FastPersistWriter("ckpt/step100"))
    dcp.load(state, storage_reader=FastPersistReader("ckpt/step100"))
    fut = dcp.async_save(state, storage_writer=FastPersistWriter("ckpt/step200"))

The directory is a stock DCP checkpoint (``FileSystemReader`` reads it without
fastpersist), with every item at an aligned offset and a CRC-32 per item recorded
in ``.metadata``; ``fastpersist.verify(directory)`` checks them.
"""

from fastpersist.dcp._reader import FastPersistReader
from fastpersist.dcp._writer import FastPersistWriter

__all__ = ["FastPersistReader", "FastPersistWriter"]
