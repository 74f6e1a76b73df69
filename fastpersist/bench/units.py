"""The benchmarks' name for :mod:`fastpersist.units` (byte sizes and rates), which moved
out of the benchmarks so that ``fastpersist info`` uses it without loading them."""

from __future__ import annotations

from fastpersist.units import (
    format_block,
    format_bytes,
    gbps,
    median,
    parse_int_list,
    parse_size,
    parse_size_list,
    ratio,
)

__all__ = ["format_block", "format_bytes", "gbps", "median", "parse_int_list", "parse_size", "parse_size_list",
           "ratio"]
