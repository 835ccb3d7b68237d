"""Sweeps: one capture with named sizes symbolic; formulas in them, and exact estimates at any point.

`sweep(model, args, dims={"batch": 0, "seq": 1})` captures the model's forward once with those input
axes symbolic (see `fxflops.capture.dynamic`). Every node's cost is then an expression in the names,
so `Sweep.at(seq=4096)` is an evaluation, not a capture, and `Sweep.formula()` is the sum. Where the
forward decided something from a size (a branch, a value it fixed), the capture's conditions say so;
a point outside them is captured again at that point, as its own piece, never extrapolated.

The package: `core` (the Sweep object, `sweep()`, grids), `piece` (one symbolic capture and its
evaluation at a point), `compiled` (a piece's costs as one generated Python function, on ints or
numpy arrays), `expressions` (cost expressions compiled and conditions read) and
`families` (a stream of calls counted one capture per family of sizes).
"""

from fxflops.sweeps.core import QUANTITIES, Sweep, SweepCaptureError, grid_points, sweep
from fxflops.sweeps.expressions import compile_expression, plain_sympy
from fxflops.sweeps.families import SizeFamilies
from fxflops.sweeps.piece import Piece, shapes_at

__all__ = ["QUANTITIES", "Piece", "SizeFamilies", "Sweep", "SweepCaptureError", "compile_expression", "grid_points",
           "plain_sympy", "shapes_at", "sweep"]
