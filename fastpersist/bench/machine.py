"""The benchmarks' name for :mod:`fastpersist.machine` (what a run ran on), which moved out
of the benchmarks so that ``fastpersist info DIR`` describes the machine without loading them."""

from __future__ import annotations

from fastpersist.machine import MachineInfo, collect_machine_info, probe_direct_io

__all__ = ["MachineInfo", "collect_machine_info", "probe_direct_io"]
