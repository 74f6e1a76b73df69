"""The adapters' on/off variables: an adapter's own variable wins, else the torch.save switch."""

from __future__ import annotations

import os

SWITCH = "FASTPERSIST_PATCH_TORCH_SAVE"


def adapter_enabled(variable: str) -> bool:
    """``variable`` if set, else ``FASTPERSIST_PATCH_TORCH_SAVE`` (booleans: 1/0,
    true/false, on/off, yes/no; anything else raises ValueError naming the variable)."""
    from fastpersist.config import parse_bool

    for name in (variable, SWITCH):
        raw = os.environ.get(name, "")
        if raw.strip():
            return parse_bool(name, raw)
    return False
