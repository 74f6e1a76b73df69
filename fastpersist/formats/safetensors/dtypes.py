"""The safetensors dtype codes and their torch dtypes.

A header names each tensor's dtype by a code (``"F32"``, ``"BF16"``, ...). The table
below maps every code to its torch dtype and its bits per element; its order is the
order in which safetensors writes tensors of different dtypes (its dtype enum,
descending), which the planner follows so that files match safetensors' byte for byte.
"""

from __future__ import annotations

import torch

__all__ = ["CODE_BITS", "CODE_RANK", "CODE_TO_DTYPE", "DTYPE_CODES", "PACKED"]

# (code, torch dtype attribute, bits per element), in safetensors' write order.
_DTYPE_TABLE: tuple[tuple[str, str, int], ...] = (
    ("U64", "uint64", 64),
    ("I64", "int64", 64),
    ("F64", "float64", 64),
    ("C64", "complex64", 64),
    ("F32", "float32", 32),
    ("U32", "uint32", 32),
    ("I32", "int32", 32),
    ("BF16", "bfloat16", 16),
    ("F16", "float16", 16),
    ("U16", "uint16", 16),
    ("I16", "int16", 16),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz", 8),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz", 8),
    ("F8_E8M0", "float8_e8m0fnu", 8),
    ("F8_E4M3", "float8_e4m3fn", 8),
    ("F8_E5M2", "float8_e5m2", 8),
    ("I8", "int8", 8),
    ("U8", "uint8", 8),
    ("F4", "float4_e2m1fn_x2", 4),  # torch packs two values per element; header counts values
    ("BOOL", "bool", 8),
)

#: torch dtype -> safetensors dtype code, for the dtypes this torch build has.
DTYPE_CODES: dict[torch.dtype, str] = {}
#: safetensors dtype code -> torch dtype (the inverse of :data:`DTYPE_CODES`).
CODE_TO_DTYPE: dict[str, torch.dtype] = {}
#: safetensors dtype code -> bits per element as the header counts elements.
CODE_BITS: dict[str, int] = {}
#: safetensors dtype code -> its rank in safetensors' write order (lower: written first).
CODE_RANK: dict[str, int] = {}
for _rank, (_code, _attr, _bits) in enumerate(_DTYPE_TABLE):
    _dt = getattr(torch, _attr, None)
    if isinstance(_dt, torch.dtype):
        DTYPE_CODES[_dt] = _code
        CODE_TO_DTYPE[_code] = _dt
        CODE_BITS[_code] = _bits
        CODE_RANK[_code] = _rank
del _rank, _code, _attr, _bits, _dt

#: The one sub-byte dtype code: the header shape's last dimension is twice torch's.
PACKED = "F4"
