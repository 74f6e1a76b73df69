"""pytest plugin (``-p dcp_plugin``): DCP's stock FileSystemWriter/FileSystemReader replaced by
fastpersist's FastPersistWriter/FastPersistReader wherever the upstream test reaches them: the
names ``torch.distributed.checkpoint.FileSystemWriter``/``FileSystemReader`` (and in
``.filesystem``), and the classes ``dcp.save``/``dcp.load`` pick for a ``checkpoint_id`` path
(``torch.distributed.checkpoint._storage_utils``). Loaded before the test module is imported."""

import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint._storage_utils as storage_utils
import torch.distributed.checkpoint.filesystem as filesystem

from fastpersist.dcp import FastPersistReader, FastPersistWriter

for module in (dcp, filesystem, storage_utils):
    module.FileSystemWriter = FastPersistWriter
    module.FileSystemReader = FastPersistReader


def pytest_report_header(config):  # noqa: ARG001 - pytest hook signature
    return "fastpersist: DCP FileSystemWriter/FileSystemReader -> fastpersist.dcp.FastPersistWriter/Reader"
