"""The safetensors format: planner, loader and verifier (this module: the family's public names).

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of
JSON (``{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets"}}``,
which may end in spaces), then the tensors' bytes back to back, without holes,
``data_offsets`` being relative to the end of the header.

What fastpersist adds, within the format:

* the header is padded with spaces so that the data section starts at a multiple
  of the O_DIRECT alignment (4096 or the device's block size). The tensors stay
  back to back, as the format requires, so only the first tensor is aligned;
* when checksums are on, every tensor's entry carries one more key,
  ``"fastpersist.crc32"``: the CRC-32 of its bytes (8 lowercase hex digits). The
  native writer fills them in while it streams the data (``PATCH_HEX8`` patches), so
  the file is written in one pass. The first entry (in data order) also carries
  ``"fastpersist.header_crc32"``, a CRC-32 of the header's meaning (tensor names,
  dtypes, shapes, offsets and the whole ``__metadata__``; :func:`entries_header_crc32`),
  so a changed header is detected too. safetensors (its Rust ``TensorInfo`` has no
  ``deny_unknown_fields``), huggingface_hub, torch's DCP HF reader and every reader
  that picks ``dtype``/``shape``/``data_offsets`` by name ignore the extra keys, and
  ``__metadata__`` stays exactly the caller's: ``safe_open(...).metadata()`` returns
  what ``safetensors.torch.save_file`` would have written (``None`` without metadata),
  so transformers' check of ``metadata["format"]`` sees the caller's metadata only.
  A file with no tensors has no entry to carry checksums: it is "unchecked".

Files written by earlier fastpersist versions kept the CRCs in ``__metadata__``
(``"fastpersist.crc32"``: comma-separated, data order; ``"fastpersist.header_crc32"``);
they are still read and verified (:data:`CRC_METADATA_KEY`).

The family, bottom up: ``dtypes`` and ``errors``; ``header`` (the keys, the parse and
validation, the CRC-32s of the header's meaning); ``crc`` (recorded CRC-32s against the
bytes); ``plan`` (validation and layout of a write) and ``load``; ``verify``. Model-level
handling of tied weights is in :mod:`fastpersist.tiedweights`.
"""

from __future__ import annotations

from fastpersist.formats.safetensors.crc import checksum_error, crc_problems, data_extents
from fastpersist.formats.safetensors.dtypes import DTYPE_CODES
from fastpersist.formats.safetensors.errors import (MetaTensorError, SafetensorsFormatError, SafetensorsInputError,
                                                    SafetensorsValueError, UnsupportedDtypeError)
from fastpersist.formats.safetensors.header import (CRC_METADATA_KEY, ENTRY_CRC_KEY, ENTRY_HEADER_CRC_KEY,
                                                    HEADER_CRC_METADATA_KEY, MAX_HEADER_SIZE, SafetensorsHeader,
                                                    TensorEntry, entries_header_crc32, header_crc32, parse_header,
                                                    read_header, read_header_fd)
from fastpersist.formats.safetensors.load import load_safetensors
from fastpersist.formats.safetensors.plan import (DEFAULT_SAFETENSORS_METADATA, check_metadata, plan_safetensors,
                                                  safetensors_metadata)
from fastpersist.formats.safetensors.verify import (SafetensorsCheck, check_safetensors, has_checksums,
                                                    verify_safetensors)

__all__ = [
    "CRC_METADATA_KEY",
    "DEFAULT_SAFETENSORS_METADATA",
    "DTYPE_CODES",
    "ENTRY_CRC_KEY",
    "ENTRY_HEADER_CRC_KEY",
    "HEADER_CRC_METADATA_KEY",
    "MAX_HEADER_SIZE",
    "MetaTensorError",
    "SafetensorsCheck",
    "SafetensorsFormatError",
    "SafetensorsHeader",
    "SafetensorsInputError",
    "SafetensorsValueError",
    "TensorEntry",
    "UnsupportedDtypeError",
    "check_metadata",
    "check_safetensors",
    "checksum_error",
    "crc_problems",
    "data_extents",
    "entries_header_crc32",
    "has_checksums",
    "header_crc32",
    "load_safetensors",
    "parse_header",
    "plan_safetensors",
    "read_header",
    "read_header_fd",
    "safetensors_metadata",
    "verify_safetensors",
]
