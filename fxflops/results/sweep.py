"""What a sweep produces: its formulas, and its totals at each point of a grid.

A `SweepResult` holds the merged formulas of a sweep's pieces (`SweepFormula`) and one `SweepPoint`
per grid point (its totals and top modules, `SweepModule`): what the sweep reports take, a grid
of 10,000 points without keeping 10,000 Estimates.
"""

from __future__ import annotations

from dataclasses import dataclass

@dataclass
class SweepFormula:
    """Formulas of one or more of a sweep's captures (pieces with the same formulas are merged)."""

    formulas: dict[str, str]  # "macs" | "flops" | "params" (| "bwd_macs" | "bwd_flops") -> sympy text
    holds_for: list[str]  # where they hold, one line per piece merged
    conditions: list[list[str]]  # each merged piece's conditions (all must hold), checked per point


@dataclass(frozen=True)
class SweepModule:
    """One of a point's top modules: its inclusive MACs and FLOPs there."""

    name: str
    type: str
    macs: int
    flops: int


@dataclass(frozen=True)
class SweepPoint:
    """A grid point's totals, equal to `Sweep.at(**sizes)`'s: what the sweep reports show of it.
    A grid keeps these, not whole Estimates (an Estimate holds every node; a grid can hold 10,000)."""

    sizes: dict[str, int]
    macs: int  # forward + backward, as Estimate.total_macs
    flops: int
    params: int
    bwd_macs: int = 0
    bwd_flops: int = 0
    top_modules: tuple[SweepModule, ...] = ()  # the top modules at the depth asked for, by MACs
    cautions: tuple[str, ...] = ()  # what a real forward would do differently there (a lookup past a table)

    @property
    def fwd_macs(self) -> int:
        return self.macs - self.bwd_macs

    @property
    def fwd_flops(self) -> int:
        return self.flops - self.bwd_flops


@dataclass
class SweepResult:
    """A sweep's formulas and its totals at a set of points, as the reports take them."""

    model_type: str
    names: tuple[str, ...]  # the named sizes, in the order the user gave them
    example: dict[str, int]  # the example inputs' sizes
    formulas: list[SweepFormula]  # the first is the formula at the example's sizes (captured first)
    points: list[SweepPoint]
    captures: int = 1  # pieces captured: more than one where a size changes the forward's path
    backward: bool = False  # the points count the backward too (bwd_macs, bwd_flops)
    depth: int = 1  # the depth of the points' top modules

    @property
    def cautions(self) -> list[str]:
        """Each distinct caution of any point (a lookup past a position table states its region)."""
        return list(dict.fromkeys(caution for point in self.points for caution in point.cautions))
