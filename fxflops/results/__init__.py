"""Plain result records every stage hands to the next: per-node costs, per-module stats, the Estimate.

These are data only. `count` fills NodeCost, `tree` fills ModuleStats and the Estimate, `latency`
fills Measurements and ModuleStats.latency, and `report` reads them all. By stage: what capture
hands to count (captured), what count and tree produce (costs), the Estimate and Profile
(estimate), and what a sweep produces (sweep).

The names below are what the rest of fxflops imports from `fxflops.results`.
"""

from fxflops.results.captured import BACKWARD, FORWARD, PHASE, RECOMPUTE, Attempt, Captured, CountSource, ModuleInfo, WholeCall
from fxflops.results.parallel import Collective, RankRole
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
from fxflops.results.sweep import SweepFormula, SweepModule, SweepPoint, SweepResult

__all__ = [
    "BACKWARD", "COUNTED", "FORWARD", "PHASE", "RECOMPUTE", "ROOT_LABEL", "UNKNOWN", "UNKNOWN_RULE", "ZERO", "Attempt",
    "AttentionTotals", "Captured", "Collective", "CountSource", "Estimate", "Measurements", "ModuleInfo", "ModuleStats", "NodeCost",
    "OpTotals", "OptimizerStep", "Profile", "RankRole", "SweepFormula", "SweepModule", "SweepPoint", "SweepResult", "UnknownOp",
    "WholeCall", "attention_totals",
]
