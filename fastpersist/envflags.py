"""On/off switches read from the environment by the framework adapters.

Each adapter has its own variable (``FASTPERSIST_ACCELERATE``, ``FASTPERSIST_DEEPSPEED``);
when it is unset or empty, the torch.save switch ``FASTPERSIST_PATCH_TORCH_SAVE`` decides,
so that one variable turns every adapter on while an adapter's own ``=0`` keeps that
framework stock.
"""

from __future__ import annotations

import os

from fastpersist.config import parse_bool

__all__ = ["SWITCH", "adapter_enabled"]

#: The variable that routes ``torch.save``/``torch.load`` through fastpersist; the
#: adapters' fallback.
SWITCH = "FASTPERSIST_PATCH_TORCH_SAVE"


def adapter_enabled(variable: str) -> bool:
    """Whether the adapter switched by ``variable`` is on: ``variable`` if set (not empty
    or blank), else :data:`SWITCH`, else False.

    Values are booleans (1/0, true/false, on/off, yes/no, any case); anything else raises
    ValueError naming the variable.
    """
    for name in (variable, SWITCH):
        raw = os.environ.get(name, "")
        if raw.strip():
            return parse_bool(name, raw)
    return False
