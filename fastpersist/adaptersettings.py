"""The ``"fastpersist"`` section of a framework's own configuration, checked.

A framework whose configuration file is read by fastpersist (DeepSpeed's JSON config)
turns an adapter on there with a section that is ``true``/``false`` or an object with the
keys ``enabled`` (default true), ``decoupled`` (default false), ``split_replicated``
(default true) and ``config`` (keyword arguments of :class:`fastpersist.Config`).
:func:`parse_section` checks it; anything else raises ``ValueError`` naming the key, since
frameworks tend to ignore unknown keys without a word.
"""

from __future__ import annotations

from typing import Any, Optional

from fastpersist.config import Config

__all__ = ["FIELDS", "find_section", "parse_section"]

#: the keys of the section's object form
FIELDS = ("enabled", "decoupled", "split_replicated", "config")
_FLAGS = (("enabled", True), ("decoupled", False), ("split_replicated", True))


def parse_section(section: Any, *, key: str, where: str) -> dict:
    """``{"enabled": bool, "decoupled": bool, "split_replicated": bool, "config": Config or
    None}`` of the section ``section`` (see the module docstring). ``key``: the section's
    name and ``where``: the configuration's, in the errors (``"fastpersist"``, ``"DeepSpeed
    config"``)."""
    if isinstance(section, bool):
        section = {"enabled": section}
    if not isinstance(section, dict):
        raise ValueError(f'{where}: "{key}" must be true, false or an object with the keys {", ".join(FIELDS)}; '
                         f"got {section!r}")
    unknown = sorted(set(section) - set(FIELDS))
    if unknown:
        raise ValueError(f'{where}: unknown key(s) {unknown} in "{key}" (known: {", ".join(FIELDS)})')
    out: dict = {}
    for name, default in _FLAGS:
        value = section.get(name, default)
        if not isinstance(value, bool):
            raise ValueError(f'{where}: "{key}.{name}" must be true or false, got {value!r}')
        out[name] = value
    cfg = section.get("config")
    if cfg is not None and not isinstance(cfg, dict):
        raise ValueError(f'{where}: "{key}.config" must be an object of fastpersist.Config fields, got {cfg!r}')
    try:
        out["config"] = None if cfg is None else Config(**cfg)
    except TypeError as e:
        raise ValueError(f'{where}: "{key}.config": {e}') from None
    return out


def find_section(params: Any, *, key: str, where: str) -> Optional[dict]:
    """:func:`parse_section` of ``params[key]``, where ``params`` (a framework's configuration
    as a dict) has that key; None for a configuration without it, or one that is no dict."""
    if not isinstance(params, dict) or key not in params:
        return None
    return parse_section(params[key], key=key, where=where)
