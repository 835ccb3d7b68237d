"""The Sweep object: costs of one model over named input sizes, queried at points and over grids.

`sweep()` captures the model once with the named sizes symbolic and returns a `Sweep`. Its queries:
`at(**sizes)` (an Estimate, its totals from formulas compiled once), `formula()` (a sympy expression),
`explain()`, and over a grid `grid()` (numpy arrays of totals, every point at once), `table()`,
`points()` (streamed in constant memory) and `result()` (what the reports take). A point
outside every piece's conditions is captured again there, as a new piece (`fxflops.sweeps.piece`).
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import sympy
import torch

from fxflops.api import (
    Counting, UnknownOpsError, collector_paused, deep_enough, deep_models, normalize_inputs, warn_cautions, warn_unknown,
)
from fxflops.capture import uncompiled
from fxflops.capture.diagnosis import CaptureError
from fxflops.capture.dynamic import Dims, SizePlan, plan_from_dims
from fxflops.capture.methods import AUTO
from fxflops.capture.tensor_walk import tensors_in
from fxflops.optimizer import optimizer_step
from fxflops.results import CountSource, Estimate, SweepFormula, SweepPoint, SweepResult
from fxflops.rules import RuleSpec
from fxflops.sweeps.piece import Piece
from fxflops.tree import module_stats

QUANTITIES = ("macs", "flops", "params", "fwd_macs", "fwd_flops", "bwd_macs", "bwd_flops")

# the least value a named size is captured at first: a question whether a size is 1 that decides
# nothing is answered without a condition only when the answer is "no" (fxflops.capture.size_one), so
# a capture at 2 holds at 1 too unless the forward decides something there; one at 1 holds only at 1
_LEAST_SYMBOLIC = 2


class SweepCaptureError(RuntimeError):
    """The model could not be captured at a point of the sweep: says which sizes, on which axes."""


class Sweep:
    """Costs of one model over named input sizes, from one capture (more only where the model's path
    changes). `at(**sizes)` is an Estimate, `formula()` a sympy expression, `table(grid)` rows."""

    def __init__(self, model: torch.nn.Module, args: tuple, kwargs: dict, plan: SizePlan, counting: Counting,
                 options: dict[str, Any]) -> None:
        self.model_type = type(model).__name__
        self.names = plan.names
        self.example = dict(plan.hints)  # the example inputs' sizes
        self.pieces: list[Piece] = []
        self.cautions: dict[str, None] = {}  # distinct cautions of the points counted so far, in order
        self._model = model
        self._inputs = (args, kwargs)
        self.plan = plan  # the named axes (its hints: the example's sizes)
        self._counting = counting
        self._options = options  # method, backward, loss
        self._optimizer = options.pop("optimizer", None)
        strict = options.pop("strict", False)
        self._value_sizes = options.pop("value_sizes", False)
        first = _raised(self.example)
        try:
            self.pieces.append(self._capture(first))
        except Exception:
            if first == self.example:
                raise
            self.pieces.append(self._capture(self.example))  # the model insists on its example's sizes
        unknown = self.pieces[0].unknown()
        if strict and unknown:
            raise UnknownOpsError(unknown)
        warn_unknown(unknown)

    @property
    def conditions(self) -> list[str]:
        """Where `formula()` (the first piece's) holds: every condition, as text."""
        return self.pieces[0].describe()

    @property
    def holds_for(self) -> str:
        """Where `formula()` holds, in one line ("2 <= batch <= 15, size >= 64 (and 3 more conditions ...)")."""
        return self.pieces[0].summary()

    def point(self, sizes: Mapping[str, int], /) -> dict[str, int]:
        """A full point: the given sizes, the example's for the rest; unknown names are an error."""
        unknown = [name for name in sizes if name not in self.names]
        if unknown:
            raise ValueError(f"unknown size {', '.join(map(repr, unknown))}; this sweep's sizes: {', '.join(self.names)}")
        point = {**self.example, **sizes}
        for name, value in point.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"size {name} must be a non-negative int, got {value!r}")
        return point

    def piece(self, /, **sizes: int) -> Piece:
        """The piece whose conditions hold at the point, captured there if none does yet."""
        return self._piece_at(self.point(sizes))

    def _piece_at(self, point: dict[str, int]) -> Piece:
        for piece in self.pieces:
            if piece.holds(point):
                return piece
        return self._add_piece(point)

    def at(self, /, **sizes: int) -> Estimate:
        """The Estimate at these sizes (the example's for any not given): what estimate() gives there.

        Its totals are evaluated at once (compiled formulas: microseconds); its modules, nodes and
        per-op tables when first read."""
        point = self.point(sizes)
        with collector_paused():
            result = self._piece_at(point).estimate(point, self.model_type, self._counting.conventions, self._inputs,
                                                    self._counting.attention)
        if self._optimizer is not None:
            with deep_enough(self._model):
                result.optimizer = optimizer_step(self._optimizer, self._model)
        warn_cautions(result.cautions)
        return result

    def grid(self, /, **values: Iterable[int]) -> dict[str, Any]:
        """The totals at every combination of the given sizes (the example's for the others), at once:
        {each given name, "macs", "flops", "params" (and "bwd_macs", "bwd_flops" with a backward):
        numpy array}, each of shape (number of values of each name, in the order given).

        Exact, equal to `at()` at each point: int64 arrays where no value can overflow them, else
        arrays of Python ints. Each piece's compiled formulas run once over all the points they hold
        for; a point no piece holds for is captured as `at()` captures it."""
        import numpy as np

        self.point({name: 0 for name in values})  # unknown names: the error at()'s would be
        axes = [np.asarray(list(given), dtype=object) for given in values.values()]
        for name, given in zip(values, axes):
            for value in given:
                self.point({name: value})  # each value a non-negative int, or at()'s error
        meshed = np.meshgrid(*(axis.astype(np.int64) for axis in axes), indexing="ij") if axes else []
        shape = meshed[0].shape if meshed else ()
        sizes = {name: np.full(shape, value, dtype=np.int64) for name, value in self.example.items()}
        sizes.update(zip(values, meshed))
        quantities = ("macs", "flops", "bwd_macs", "bwd_flops", "params")
        found = {quantity: np.zeros(shape, dtype=np.int64) for quantity in quantities}
        remaining = np.ones(shape, dtype=bool)
        done = 0
        while remaining.any():
            for piece in self.pieces[done:]:
                inside = piece.holds_on_arrays(sizes) & remaining
                if inside.any():
                    at = {name: array[inside] for name, array in sizes.items()}
                    if piece.checks():
                        piece.check_on_arrays(at)
                    totals = piece.programs().totals.on_arrays(*(at[name] for name in self.names))
                    for quantity, array in zip(quantities, totals):
                        if array.dtype == object and found[quantity].dtype != object:
                            found[quantity] = found[quantity].astype(object)
                        found[quantity][inside] = array
                    self.cautions.update(dict.fromkeys(piece.cautions_on_arrays(at)))
                    remaining &= ~inside
            done = len(self.pieces)
            if remaining.any():  # the first point no piece holds for: captured there
                first = tuple(int(index[0]) for index in np.nonzero(remaining))
                self._piece_at({name: int(array[first]) for name, array in sizes.items()})
        if self.cautions:
            warn_cautions(list(self.cautions))
        result = {name: array for name, array in zip(values, meshed)}
        result.update((quantity, found[quantity]) for quantity in ("macs", "flops", "params"))
        if self.backward:
            result.update(bwd_macs=found["bwd_macs"], bwd_flops=found["bwd_flops"])
        return result

    def formula(self, /, quantity: str = "macs", module: str | None = None, **sizes: int) -> sympy.Expr:
        """`quantity` (macs, flops, params, fwd_/bwd_ macs and flops) as a sympy expression in the sizes'
        names, for the whole model or one module (inclusive). It holds where `conditions` do; give
        sizes to get the formula of the piece covering that point instead."""
        if quantity not in QUANTITIES:
            raise ValueError(f"quantity must be one of {', '.join(QUANTITIES)}; got {quantity!r}")
        piece = self.piece(**sizes) if sizes else self.pieces[0]
        formulas = piece.formulas(quantity)
        name = module or ""
        if name not in formulas:
            raise KeyError(f"no module {name!r} in {self.model_type}; modules are named as in named_modules()")
        return formulas[name]

    def explain(self, name: str = "", /, **sizes: int) -> Any:
        """Estimate.explain(name) with every size, bound value and count a formula in the sweep's named
        sizes (of the piece holding at `sizes`; default the first capture's, at the example)."""
        from fxflops.explain import explain

        piece = self.piece(**sizes) if sizes else self.pieces[0]
        captured = piece.captured
        modules = module_stats(piece.infos, captured.aliases, piece.costs, captured.module_calls, self.model_type)
        symbolic = types.SimpleNamespace(  # what explain() reads of an Estimate; totals stay formulas
            model_type=self.model_type, conventions=self._counting.conventions, nodes=piece.costs,
            modules=modules, aliases=captured.aliases, source=CountSource(captured, self._counting.table))
        return explain(symbolic, name)

    @property
    def backward(self) -> bool:
        """Whether the points count the backward too."""
        return bool(self._options["backward"])

    def table(self, grid: Mapping[str, Iterable[int]] | Iterable[Mapping[str, int]],
              columns: Callable[[Estimate], Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
        """One row per point: the sizes, then total MACs, FLOPs and params (or what `columns` picks
        from the point's Estimate).

        `grid` is {name: values} (every combination) or a list of points."""
        if columns is None:
            return [{**point.sizes, "macs": point.macs, "flops": point.flops, "params": point.params}
                    for point in self.points(grid, top=0)]
        return [{**self.point(point), **columns(self.at(**point))} for point in _each_point(grid)]

    def points(self, grid: Mapping[str, Iterable[int]] | Iterable[Mapping[str, int]], depth: int = 1,
               top: int = 3) -> Iterator[SweepPoint]:
        """The totals at each point of `grid`, one at a time (what `at()` gives there, and its `top`
        modules at `depth`): a grid of any size streams in constant memory."""
        for sizes in _each_point(grid):
            point = self.point(sizes)
            with collector_paused():
                found = self.piece(**point).totals(point, self.model_type, depth, top)
            self.cautions.update(dict.fromkeys(found.cautions))  # distinct ones: as few as the regions
            yield found

    def result(self, grid: Mapping[str, Iterable[int]] | Iterable[Mapping[str, int]], depth: int = 1,
               top: int = 3) -> SweepResult:
        """The formulas and the totals at every point of `grid` (see `points`), as the reports take them."""
        points = list(self.points(grid, depth, top))
        return SweepResult(model_type=self.model_type, names=self.names, example=dict(self.example),
                           formulas=self.merged_formulas(), points=points, captures=len(self.pieces),
                           backward=self.backward, depth=depth)

    def merged_formulas(self) -> list[SweepFormula]:
        """The whole model's formulas of every piece captured so far, pieces with equal formulas merged."""
        quantities = ["macs", "flops", "params"] + (["bwd_macs", "bwd_flops"] if self.backward else [])
        merged: dict[tuple, SweepFormula] = {}
        for piece in self.pieces:
            formulas = {quantity: str(piece.formulas(quantity)[""]) for quantity in quantities}
            entry = merged.setdefault(tuple(formulas.values()), SweepFormula(formulas, [], []))
            entry.holds_for.append(piece.summary())
            entry.conditions.append(piece.describe())
        return list(merged.values())

    def _add_piece(self, point: Mapping[str, int]) -> Piece:
        """A new piece holding at `point`: captured with its sizes below 2 raised to 2 (it then holds for
        sizes of 1 too unless the forward decides something from them), else at the point itself. A size
        is not raised where a piece already holds: that piece would be captured again, and it does not
        hold at `point`."""
        raised = dict(point)
        for name, size in point.items():
            candidate = {**raised, name: max(size, _LEAST_SYMBOLIC)}
            if not any(piece.holds(candidate) for piece in self.pieces):
                raised = candidate
        try:
            self.pieces.append(self._capture(raised))
        except Exception:
            if raised == point:
                raise
            # the model insists on the point's sizes
        else:
            if raised == point or self.pieces[-1].holds(point):
                return self.pieces[-1]
        self.pieces.append(self._capture(point))  # the raised one is kept: it holds where it holds
        return self.pieces[-1]

    def _capture(self, point: Mapping[str, int]) -> Piece:
        plan = self.plan.at(point)
        args, kwargs = self._inputs
        with collector_paused(), deep_enough(self._model):
            try:
                captured = self._counting.capture(self._model, args, kwargs, self._options["method"], sizes=plan,
                                                  backward=self._options["backward"], loss=self._options["loss"])
            except CaptureError as error:
                where = ", ".join(f"{name}={value}" for name, value in point.items())
                # values read from the inputs (capture.input_values) are the example's: a formula in the named
                # sizes cannot carry them, so a sweep does not compute them
                values = "; a sweep counts from shapes only and cannot take the inputs' values the forward reads: " \
                    "estimate() each point with its real inputs" if any(a.reads_values for a in error.attempts) else ""
                raise SweepCaptureError(f"{error.summary()}, with {where} ({self._axes_text()}){values}") from error
            costs = self._counting.count(captured, lazy=True)
        if self._counting.attention == "effective" and not self._value_sizes:  # value_sizes: the caller (the
            _refuse_data_masks(costs)  # meter) counts such masks on each batch's own (timing.data_masks)
        return Piece(plan, captured, costs, self._value_sizes)

    def _axes_text(self) -> str:
        shapes = [tuple(t.shape) for t in tensors_in(self._inputs)]
        named = [f"{name} on axis {axis} of input {index} {list(shapes[index])}"
                 for index, axes in self.plan.axes.items() for axis, name in axes.items()]
        return "; ".join(named)

    def __repr__(self) -> str:
        return (f"Sweep({self.model_type} over {', '.join(self.names)}; captured at {self.example}; "
                f"{len(self.pieces)} piece{'s' if len(self.pieces) != 1 else ''})")


@deep_models
def sweep(
    model: torch.nn.Module,
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    dims: Dims,
    input_shape: Sequence[int] | Sequence[Sequence[int]] | None = None,
    method: str = AUTO,
    conventions: str = "deepspeed",
    rules: Iterable[RuleSpec] | RuleSpec | None = None,
    leaf_modules: Iterable[type | str] | None = None,
    backward: bool = False,
    loss: Callable[[Any], torch.Tensor] | None = None,
    optimizer: str | torch.optim.Optimizer | None = None,
    attention: str = "dense",
    strict: bool = False,
    value_sizes: bool = False,
) -> Sweep:
    """Capture `model` once with the input sizes named in `dims` symbolic; see `Sweep`.

    `dims` maps a name to an axis of the example inputs, or to several axes that share the size:
    {"batch": 0, "seq": 1} for token ids and their mask, {"batch": 0, "size": (2, 3)} for square
    images. A name is carried by that axis of every input tensor whose size there equals the first
    such tensor's. The other arguments are estimate()'s; the eager method is the one that captures
    symbolic sizes, so `method` may be "auto" or "eager"; `strict=True` raises UnknownOpsError when the
    capture holds ops no rule counts, as estimate(strict=True) does. `value_sizes=True` keeps sizes an op
    makes from tensor values the capture does not know (`nonzero` over a router's picks: the rows each
    expert receives) as free symbols, named in each piece's `free`, for the caller to bind at each point
    (the meter binds the rows each module really received); by default such a size is an error.
    """
    if loss is not None and not backward:
        raise ValueError("loss= is what the backward differentiates: pass backward=True with it")
    args, kwargs = normalize_inputs(model, args, kwargs, input_shape)
    model = uncompiled(model)  # a torch.compile'd model: its original module, as estimate() counts it
    counting = Counting.prepare(conventions, rules, leaf_modules, attention)
    plan = plan_from_dims(args, kwargs, dims)
    options = {"method": method, "backward": backward, "loss": loss, "optimizer": optimizer, "strict": strict,
               "value_sizes": value_sizes}
    return Sweep(model, args, kwargs, plan, counting, options)


def _refuse_data_masks(costs: Sequence[Any]) -> None:
    """Under effective attention, an attention op whose mask the forward builds (`ones(L, L).tril()`, a
    flex block mask) but whose kept pairs are no formula in the sizes: estimate() counts the pairs it keeps
    from its values at each point, a sweep would count every pair, a different number. Refused, naming it.
    A mask from data the capture does not have (an input's) is counted dense by both: swept as it is."""
    from fxflops.rules.kept_pairs import DATA

    for cost in costs:
        if cost.attention is not None and cost.effective_macs is None and DATA not in cost.attention:
            module = f"module '{cost.module}'" if cost.module else "the root module"
            raise SweepCaptureError(
                f"{cost.op} in {module} has a mask whose kept (query, key) pairs depend on its values "
                f"({cost.attention}): under attention='effective' a sweep cannot count them from the sizes. "
                "Sweep with attention='dense' (every pair), or use estimate() at each point.")


def _raised(point: Mapping[str, int]) -> dict[str, int]:
    return {name: max(size, _LEAST_SYMBOLIC) for name, size in point.items()}


def grid_points(grid: Mapping[str, Iterable[int]] | Iterable[Mapping[str, int]]) -> list[dict[str, int]]:
    """Every combination of a {name: values} grid (the first name varies slowest), or a list of points."""
    return list(_each_point(grid))


def _each_point(grid: Mapping[str, Iterable[int]] | Iterable[Mapping[str, int]]) -> Iterator[dict[str, int]]:
    if isinstance(grid, Mapping):
        names = list(grid)
        for values in itertools.product(*(list(grid[n]) for n in names)):
            yield dict(zip(names, values))
    else:
        for point in grid:
            yield dict(point)
