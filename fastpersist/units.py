"""Byte sizes and rates as users type and read them (``1GiB``, ``8M``, ``2.5 GB/s``)."""

from __future__ import annotations

import re
import statistics
from typing import Optional, Sequence

# Bare K/M/G/T are binary (as in fio and dd); "KB/MB/GB" decimal; "KiB/MiB/GiB" binary.
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Parse a byte size such as ``"1GiB"``, ``"8M"``, ``"512k"``, ``"2GB"`` or ``"4096"``.

    Bare ``K/M/G/T`` and ``KiB/MiB/GiB/TiB`` are powers of 1024; ``KB/MB/GB/TB`` are
    powers of 1000. Raises ``ValueError`` naming the text when it is not a size.
    """
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ValueError(f"not a byte size: {text!r} (examples: 4096, 512K, 8MiB, 1GiB, 2GB)")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown size unit {unit!r} in {text!r} (use K, M, G, T, KiB, MiB, GiB, KB, MB, GB)")
    value = float(number) * factor
    if value != int(value):
        raise ValueError(f"byte size {text!r} is not a whole number of bytes")
    return int(value)


def parse_size_list(text: str) -> list[int]:
    """Parse a comma-separated list of byte sizes (``"1M,8M"``)."""
    items = [item for item in str(text).split(",") if item.strip()]
    if not items:
        raise ValueError(f"empty list of sizes: {text!r}")
    return [parse_size(item) for item in items]


def parse_int_list(text: str) -> list[int]:
    """Parse a comma-separated list of positive integers (``"4,8,16"``)."""
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not items:
        raise ValueError(f"empty list of integers: {text!r}")
    values = []
    for item in items:
        try:
            value = int(item)
        except ValueError:
            raise ValueError(f"not an integer: {item!r} in {text!r}") from None
        if value <= 0:
            raise ValueError(f"expected a positive integer, got {item!r} in {text!r}")
        values.append(value)
    return values


def format_bytes(nbytes: float) -> str:
    """Human-readable binary size: ``format_bytes(3 << 30) == "3.00 GiB"``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_block(nbytes: int) -> str:
    """Short block-size label: ``1M``, ``512K``, ``4096``."""
    for shift, unit in ((30, "G"), (20, "M"), (10, "K")):
        if nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return str(nbytes)


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal gigabytes per second (1 GB = 10**9 bytes), as disks are rated."""
    if seconds <= 0:
        return float("inf")
    return nbytes / seconds / 1e9


def median(values: Sequence[float]) -> Optional[float]:
    """Median of ``values``, or ``None`` for an empty sequence."""
    return statistics.median(values) if values else None


def ratio(value: Optional[float], reference: Optional[float]) -> Optional[float]:
    """``value / reference``, or ``None`` when either is missing or the reference is zero."""
    if value is None or reference is None or reference == 0:
        return None
    return value / reference
