"""Memory: the captured step read as a timeline of live tensors, its peak per rank, and the allowance.

`estimate_memory(captured, optimizer, options)` gives a `MemoryEstimate` (what `estimate(...,
memory=True).memory` holds); `formulas` keeps the hand formulas the estimates are checked against.
"""

from __future__ import annotations

from fxflops.memory.estimate import MemoryOptions, estimate_memory
from fxflops.memory.records import KINDS, Allowance, AllowanceBytes, MemoryEstimate, Point

__all__ = ["KINDS", "Allowance", "AllowanceBytes", "MemoryEstimate", "MemoryOptions", "Point", "estimate_memory"]
