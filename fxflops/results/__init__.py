"""Plain result records every stage hands to the next: per-node costs, per-module stats, the Estimate.

These are data only. `count` fills NodeCost, `tree` fills ModuleStats and the Estimate, `latency`
fills Measurements and ModuleStats.latency, and `report` reads them all. By stage: what capture
hands to count (captured), what count and tree produce (costs), the Estimate and Profile
(estimate), and what a sweep produces (sweep).

The names below are what the rest of fxflops imports from `fxflops.results`.
"""

from typing import TYPE_CHECKING, Any

from fxflops.results.captured import BACKWARD, FORWARD, PHASE, RECOMPUTE, Attempt, Captured, CountSource, ModuleInfo, WholeCall
from fxflops.results.costs import (
    COUNTED,
    ROOT_LABEL,
    UNKNOWN,
    UNKNOWN_RULE,
    ZERO,
    AttentionTotals,
    ModuleStats,
    NodeCost,
    OpTotals,
    OptimizerStep,
    UnknownOp,
    attention_totals,
)
from fxflops.results.estimate import Estimate, Measurements, Profile

if TYPE_CHECKING:
    from fxflops.results.parallel import Collective, RankRole
    from fxflops.results.sweep import SweepFormula, SweepModule, SweepPoint, SweepResult

# a sweep's records, imported on first use (PEP 562): an estimate does not make them, and their four
# dataclasses were ~2 ms of every first estimate's imports
_SWEEP = frozenset({"SweepFormula", "SweepModule", "SweepPoint", "SweepResult"})
# a parallel job's records, likewise: an estimate makes them only where its graph holds a collective or a plan
# was asked for (their two dataclasses: ~1 ms of a first estimate's imports)
_PARALLEL = frozenset({"Collective", "RankRole"})


def __getattr__(name: str) -> Any:
    if name in _SWEEP:
        from fxflops.results import sweep

        return getattr(sweep, name)
    if name in _PARALLEL:
        from fxflops.results import parallel

        return getattr(parallel, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKWARD", "COUNTED", "FORWARD", "PHASE", "RECOMPUTE", "ROOT_LABEL", "UNKNOWN", "UNKNOWN_RULE", "ZERO", "Attempt",
    "AttentionTotals", "Captured", "Collective", "CountSource", "Estimate", "Measurements", "ModuleInfo", "ModuleStats", "NodeCost",
    "OpTotals", "OptimizerStep", "Profile", "RankRole", "SweepFormula", "SweepModule", "SweepPoint", "SweepResult", "UnknownOp",
    "WholeCall", "attention_totals",
]
