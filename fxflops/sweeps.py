"""Sweeps: one capture with named sizes symbolic; formulas in them, and exact estimates at any point.

`sweep(model, args, dims={"batch": 0, "seq": 1})` captures the model's forward once with those input
axes symbolic (see `fxflops.capture.dynamic`). Every node's cost is then an expression in the names,
so `Sweep.at(seq=4096)` is an evaluation, not a capture, and `Sweep.formula()` is the sum. Where the
forward decided something from a size (a branch, a value it fixed), the capture's conditions say so;
a point outside them is captured again at that point, as its own piece, never extrapolated.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import types
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import sympy
import torch
from torch.utils._pytree import tree_map

from fxflops.api import Counting, collector_paused, deep_enough, deep_models, estimate, normalize_inputs, warn_cautions, warn_unknown
from fxflops.capture import uncompiled
from fxflops.capture.diagnosis import CaptureError
from fxflops.capture.dynamic import Dims, SizePlan, holds, plan_from_dims, user_symbol
from fxflops.capture.inputs import signature, tensors_in, to_meta
from fxflops.capture.lookups import position_lookups
from fxflops.capture.methods import AUTO
from fxflops.optimizer import optimizer_step
from fxflops.results import (
    Captured,
    CountSource,
    Estimate,
    ModuleInfo,
    NodeCost,
    SweepFormula,
    SweepModule,
    SweepPoint,
    SweepResult,
)
from fxflops.rules import RuleSpec
from fxflops.tree import build_estimate, module_stats, owning_module, parent_name, unknown_ops

QUANTITIES = ("macs", "flops", "params", "fwd_macs", "fwd_flops", "bwd_macs", "bwd_flops")

# the least value a named size is captured at: ShapeEnv fixes sizes 0 and 1 as constants, so a
# formula captured there would be valid only there
_LEAST_SYMBOLIC = 2


class SweepCaptureError(RuntimeError):
    """The model could not be captured at a point of the sweep: says which sizes, on which axes."""


class Piece:
    """One symbolic capture: every node's cost as an expression, and where those expressions hold."""

    def __init__(self, plan: SizePlan, captured: Captured, costs: list[NodeCost]) -> None:
        sizes = captured.sizes
        self.plan = plan  # its hints are the point it was captured at
        self.captured = captured
        self.costs = costs
        self.conditions: list[sympy.Basic] = sizes.conditions()
        self.infos = {name: dataclasses.replace(info, params=sizes.expression(info.params))
                      for name, info in captured.modules.items()}
        self._compiled = _compiled(costs)
        self._terms: dict[str, tuple[Counter, ...]] | None = None  # see _inclusive_terms
        self._at_depth: dict[int, list[str]] = {}  # depth -> the modules a point's top list ranks
        self._lookups = _symbolic_lookups(captured)
        checks = [compile_expression(condition) for condition in self.conditions]
        self._checks = None if any(check is None for check in checks) else checks
        unbound = _free_names(costs, self.infos) - {user_symbol(name) for name in plan.names}
        if unbound:
            raise ValueError(
                f"costs depend on sizes the capture could not name ({', '.join(sorted(map(str, unbound)))}): "
                "an op's output size depends on tensor values (nonzero, masked_select, unique). "
                "Sweep over inputs whose shapes fix every size, or use estimate() at each point.")

    def holds(self, point: Mapping[str, int]) -> bool:
        if self._checks is None:
            return holds(self.conditions, point)
        return all(check(point) for check in self._checks)

    def describe(self) -> list[str]:
        """The conditions as text, e.g. 'seq >= 2', 'seq <= 1024'."""
        return list(dict.fromkeys(_text(condition) for condition in self.conditions))

    def bounds(self) -> dict[str, tuple[int, int | None]]:
        """Each name's range as the conditions on that name alone state it: {name: (least, most or None)}."""
        found = {name: [0, None] for name in self.plan.names}
        for condition in self.conditions:
            bound = _simple_bound(condition)
            if bound is None or bound[0] not in found:
                continue
            name, least, most = bound
            if least is not None:
                found[name][0] = max(found[name][0], least)
            if most is not None:
                found[name][1] = most if found[name][1] is None else min(found[name][1], most)
        return {name: (least, most) for name, (least, most) in found.items()}

    def summary(self) -> str:
        """Where the piece holds, in one line: each name's range, and how many other conditions it checks."""
        ranges = []
        for name, (least, most) in self.bounds().items():
            if most is not None and least == most:
                ranges.append(f"{name} = {least}")
            elif most is not None:
                ranges.append(f"{least} <= {name} <= {most}")
            else:
                ranges.append(f"{name} >= {least}")
        others = sum(1 for condition in self.conditions if _simple_bound(condition) is None)
        return ", ".join(ranges) + (f" (and {others} more conditions, each checked per point)" if others else "")

    def formulas(self, quantity: str) -> dict[str, sympy.Expr]:
        """Module name -> inclusive formula of `quantity` (the root is "")."""
        if quantity == "params":
            return {name: sympy.sympify(info.params) for name, info in self.infos.items()}
        terms: dict[str, list[Any]] = defaultdict(list)
        field = "flops" if quantity.endswith("flops") else "macs"
        for cost in self.costs:
            if quantity.startswith("fwd_") and cost.is_backward or quantity.startswith("bwd_") and not cost.is_backward:
                continue
            value = getattr(cost, field)
            if value != 0:
                terms[owning_module(cost.module, self.captured.aliases, self.infos)].append(value)
        totals = {name: sympy.Add(*terms.get(name, ())) for name in self.infos}
        for name in reversed(list(totals)):  # children come after their parents in pre-order
            parent = parent_name(name)
            if parent is not None and parent in totals:
                totals[parent] = totals[parent] + totals[name]
        return {name: plain_sympy(expr) for name, expr in totals.items()}

    def estimate(self, point: Mapping[str, int], model_type: str, conventions: str, inputs: Any,
                 attention: str = "dense") -> Estimate:
        """The Estimate at `point`: every expression evaluated there."""
        value = _Evaluator(point, self._compiled)
        costs = [value.cost(cost) for cost in self.costs]
        infos = {name: dataclasses.replace(info, params=value(info.params)) if not isinstance(info.params, int)
                 else info for name, info in self.infos.items()}
        captured = dataclasses.replace(self.captured, modules=infos, sizes=None, cautions=self.cautions_at(point),
                                       input_shapes=shapes_at(inputs, self.plan, point))
        return build_estimate(model_type, captured, costs, conventions, attention)

    def totals(self, point: Mapping[str, int], model_type: str, depth: int, top: int) -> SweepPoint:
        """The totals `estimate(point)` gives (and its `top` modules at `depth`), without building it:
        each distinct cost expression evaluated once, times how many nodes of a module carry it."""
        value = _Evaluator(point, self._compiled)
        terms = self._inclusive_terms()

        def total(counter: Counter) -> int:
            return sum(count * value(expr) for expr, count in counter.items())

        macs, flops, bwd_macs, bwd_flops = (total(counter) for counter in terms[""])
        named = self._at_depth.get(depth)
        if named is None:
            named = self._at_depth[depth] = _at_depth(list(self.infos), depth)
        ranked = sorted(((total(terms[name][0]), name) for name in named), key=lambda item: (-item[0], item[1]))
        tops = tuple(SweepModule(name, model_type if name == "" else self.infos[name].type, module_macs,
                                 total(terms[name][1])) for module_macs, name in ranked[:max(top, 0)])
        return SweepPoint(dict(point), macs, flops, value(self.infos[""].params), bwd_macs, bwd_flops, tops,
                          tuple(self.cautions_at(point)))

    def cautions_at(self, point: Mapping[str, int]) -> list[str]:
        """What a real forward would do differently at `point` (a lookup past a position table holds in a
        region of sizes)."""
        return self.captured.cautions + [caution for region, caution in self._lookups if holds([region], point)]

    def _inclusive_terms(self) -> dict[str, tuple[Counter, ...]]:
        """Module -> (macs, flops, bwd_macs, bwd_flops), each {cost value: nodes with it} summed over the
        module's subtree as `tree.module_stats` sums them. Made once per piece, on first use."""
        if self._terms is None:
            own = {name: (Counter(), Counter(), Counter(), Counter()) for name in self.infos}
            for cost in self.costs:
                macs, flops, bwd_macs, bwd_flops = own[owning_module(cost.module, self.captured.aliases, self.infos)]
                macs[cost.macs] += 1
                flops[cost.flops] += 1
                if cost.is_backward:
                    bwd_macs[cost.macs] += 1
                    bwd_flops[cost.flops] += 1
            for name in reversed(list(own)):  # children come after their parents in pre-order
                parent = parent_name(name)
                if parent is not None and parent in own:
                    for mine, child in zip(own[parent], own[name]):
                        mine.update(child)
            self._terms = own
        return self._terms


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
        first = {name: max(size, _LEAST_SYMBOLIC) for name, size in self.example.items()}
        try:
            self.pieces.append(self._capture(first))
        except Exception:
            if first == self.example:
                raise
            self.pieces.append(self._capture(self.example))  # the model insists on its example's sizes
        warn_unknown(unknown_ops(self.pieces[0].costs), stacklevel=4)

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
        point = self.point(sizes)
        for piece in self.pieces:
            if piece.holds(point):
                return piece
        piece = self._capture(point)
        self.pieces.append(piece)
        return piece

    def at(self, /, **sizes: int) -> Estimate:
        """The Estimate at these sizes (the example's for any not given): what estimate() gives there."""
        point = self.point(sizes)
        with collector_paused():
            result = self.piece(**point).estimate(point, self.model_type, self._counting.conventions, self._inputs,
                                                  self._counting.attention)
        if self._optimizer is not None:
            with deep_enough(self._model):
                result.optimizer = optimizer_step(self._optimizer, self._model)
        warn_cautions(result.cautions)
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

    def _capture(self, point: Mapping[str, int]) -> Piece:
        plan = self.plan.at(point)
        args, kwargs = self._inputs
        with collector_paused(), deep_enough(self._model):
            try:
                captured = self._counting.capture(self._model, args, kwargs, self._options["method"], sizes=plan,
                                                  backward=self._options["backward"], loss=self._options["loss"])
            except CaptureError as error:
                where = ", ".join(f"{name}={value}" for name, value in point.items())
                raise SweepCaptureError(f"{error.summary()}, with {where} ({self._axes_text()})") from error
            return Piece(plan, captured, self._counting.count(captured))

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
) -> Sweep:
    """Capture `model` once with the input sizes named in `dims` symbolic; see `Sweep`.

    `dims` maps a name to an axis of the example inputs, or to several axes that share the size:
    {"batch": 0, "seq": 1} for token ids and their mask, {"batch": 0, "size": (2, 3)} for square
    images. A name is carried by that axis of every input tensor whose size there equals the first
    such tensor's. The other arguments are estimate()'s; the eager method is the one that captures
    symbolic sizes, so `method` may be "auto" or "eager".
    """
    if loss is not None and not backward:
        raise ValueError("loss= is what the backward differentiates: pass backward=True with it")
    args, kwargs = normalize_inputs(model, args, kwargs, input_shape)
    model = uncompiled(model)  # a torch.compile'd model: its original module, as estimate() counts it
    counting = Counting.prepare(conventions, rules, leaf_modules, attention)
    plan = plan_from_dims(args, kwargs, dims)
    options = {"method": method, "backward": backward, "loss": loss, "optimizer": optimizer}
    return Sweep(model, args, kwargs, plan, counting, options)


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


def _at_depth(names: list[str], depth: int) -> list[str]:
    """The modules `report.sweep.top_modules` ranks: those at `depth`, or the deepest there are."""
    depths = {name: 0 if name == "" else name.count(".") + 1 for name in names}
    deepest = max(depths.values())
    level = min(max(depth, 1), deepest) if deepest else 0
    return [name for name in names if depths[name] == level]


def shapes_at(inputs: Any, plan: SizePlan, point: Mapping[str, int]) -> Any:
    """The inputs' shapes (as Estimate.input_shapes holds them) with the named axes at `point`."""
    index = {id(tensor): i for i, tensor in enumerate(tensors_in(inputs))}
    return tree_map(lambda v: plan.shape_of(index[id(v)], v.shape, point) if isinstance(v, torch.Tensor) else v,
                    inputs)


class _Evaluator:
    """Evaluates cost expressions at one point, each distinct expression (and shape) once."""

    def __init__(self, point: Mapping[str, int], compiled: Mapping[Any, Callable[[Mapping[str, int]], int]]) -> None:
        self._point = dict(point)
        self._values = {user_symbol(name): sympy.Integer(value) for name, value in point.items()}
        self._compiled = compiled
        self._known: dict[Any, int] = {}
        self._shapes: dict[tuple, tuple] = {}

    def __call__(self, value: Any) -> int:
        if type(value) is int:
            return value
        found = self._known.get(value)
        if found is None:
            function = self._compiled.get(value)
            found = function(self._point) if function is not None else int(value.xreplace(self._values))
            self._known[value] = found
        return found

    def shapes(self, shapes: tuple[tuple[Any, ...], ...]) -> tuple[tuple[int, ...], ...]:
        found = self._shapes.get(shapes)
        if found is None:
            found = self._shapes[shapes] = tuple(tuple(self(size) for size in shape) for shape in shapes)
        return found

    def cost(self, c: NodeCost) -> NodeCost:
        # NodeCost built directly: dataclasses.replace costs 5x more, and a point has thousands of nodes
        return NodeCost(c.name, c.op, c.status, c.rule, c.module, c.module_type, self.shapes(c.input_shapes),
                        self.shapes(c.output_shapes), self(c.macs), self(c.flops), c.source, c.phase,
                        c.differentiates, self(c.bytes), *self._attention(c))

    def _attention(self, c: NodeCost) -> tuple[Any, ...]:
        if c.attention is None:
            return ()
        return (c.attention, *(None if value is None else self(value)
                               for value in (c.dense_macs, c.dense_flops, c.effective_macs, c.effective_flops)))


def compile_expression(expr: sympy.Basic) -> Callable[[Mapping[str, int]], int] | None:
    """A Python function computing an integer expression (or a condition on integers) exactly at a
    point ({name: value}), or None where it holds something else (then sympy evaluates it).

    Evaluating through sympy costs ~100 us an expression, and a point of a large model has hundreds."""
    from torch.utils._sympy.functions import CeilDiv, FloorDiv, Mod, PythonMod

    if isinstance(expr, sympy.Integer | sympy.logic.boolalg.BooleanAtom):
        value = int(expr) if isinstance(expr, sympy.Integer) else bool(expr)
        return lambda point: value
    if isinstance(expr, sympy.Symbol):
        name = expr.name
        return lambda point: point[name]
    parts = [compile_expression(arg) for arg in expr.args]
    if any(part is None for part in parts):
        return None
    if isinstance(expr, sympy.Add):
        return lambda point: sum(part(point) for part in parts)
    if isinstance(expr, sympy.Mul):
        return lambda point: math.prod(part(point) for part in parts)
    if isinstance(expr, sympy.Pow) and isinstance(expr.exp, sympy.Integer) and expr.exp >= 0:
        base, exponent = parts[0], int(expr.exp)
        return lambda point: base(point) ** exponent
    if isinstance(expr, sympy.And | sympy.Or):
        combine = all if isinstance(expr, sympy.And) else any
        return lambda point: combine(part(point) for part in parts)
    if isinstance(expr, sympy.Not):
        return lambda point: not parts[0](point)
    binary = {FloorDiv: operator.floordiv, CeilDiv: lambda a, b: -(-a // b), PythonMod: operator.mod,
              Mod: operator.mod, sympy.Max: max, sympy.Min: min, sympy.Eq: operator.eq, sympy.Ne: operator.ne,
              sympy.Lt: operator.lt, sympy.Le: operator.le, sympy.Gt: operator.gt, sympy.Ge: operator.ge}
    for kind, apply in binary.items():
        if isinstance(expr, kind) and len(parts) == 2:
            left, right = parts
            return lambda point: apply(left(point), right(point))
    return None


def _symbolic_lookups(captured: Captured) -> list[tuple[sympy.Basic, str]]:
    """Lookups at positions that depend on the sizes: (the region past the table, its caution),
    the caution stating that region (seq > 1024), so a point past a model's positions says so."""
    found = []
    for lookup in position_lookups(captured.graph_module):
        low, high = (plain_sympy(captured.sizes.expression(value)) for value in (lookup.low, lookup.high))
        if not (low.free_symbols or high.free_symbols):
            continue  # a fixed range: the capture's own caution, if any
        region = sympy.simplify(sympy.Or(sympy.Gt(high, lookup.rows - 1), sympy.Lt(low, lookup.least)))
        if region == sympy.false:
            continue
        found.append((region, lookup.caution(low, high, _text(region))))
    return found


def _compiled(costs: list[NodeCost]) -> dict[Any, Callable[[Mapping[str, int]], int]]:
    distinct = {value for c in costs for value in (c.macs, c.flops, c.bytes, *(s for shape in (*c.input_shapes, *c.output_shapes)
                                                                     for s in shape)) if type(value) is not int}
    found = {expr: compile_expression(expr) for expr in distinct}
    return {expr: function for expr, function in found.items() if function is not None}


def _free_names(costs: list[NodeCost], infos: dict[str, ModuleInfo]) -> set[sympy.Symbol]:
    found: set[sympy.Symbol] = set()
    values = [c.macs for c in costs] + [c.flops for c in costs] + [c.bytes for c in costs]
    values += [i.params for i in infos.values()]
    values += [size for c in costs for shape in (*c.input_shapes, *c.output_shapes) for size in shape]
    for value in values:
        if isinstance(value, sympy.Basic):
            found |= value.free_symbols
    return found


def plain_sympy(expr: Any) -> sympy.Expr:
    """torch's integer division functions rewritten as sympy's floor and ceiling, so a formula is
    plain sympy (printable, lambdify-able) and means what Python's // means on sizes."""
    from torch.utils._sympy.functions import CeilDiv, CleanDiv, FloorDiv, IntTrueDiv, Mod, PythonMod

    expr = sympy.sympify(expr)
    if not isinstance(expr, sympy.Basic) or not expr.free_symbols:
        return expr
    replacements = {
        FloorDiv: lambda a, b: sympy.floor(a / b),
        CleanDiv: lambda a, b: a / b,
        CeilDiv: lambda a, b: sympy.ceiling(a / b),
        IntTrueDiv: lambda a, b: a / b,
        PythonMod: lambda a, b: sympy.Mod(a, b),
        Mod: lambda a, b: sympy.Mod(a, b),
    }
    for function, plain in replacements.items():
        expr = expr.replace(lambda e, f=function: isinstance(e, f), lambda e, p=plain: p(*e.args))
    return expr


def _simple_bound(condition: sympy.Basic) -> tuple[str, int | None, int | None] | None:
    """(name, least, most) for a condition on one name against an integer (`seq <= 1024`), else None."""
    if not isinstance(condition, sympy.Rel) or isinstance(condition, sympy.Ne):
        return None
    lhs, rhs = condition.lhs, condition.rhs
    flipped = isinstance(lhs, sympy.Integer)
    if flipped:
        lhs, rhs = rhs, lhs
    if not isinstance(lhs, sympy.Symbol) or not isinstance(rhs, sympy.Integer):
        return None
    value = int(rhs)
    kind = type(condition)
    if flipped:
        kind = {sympy.Ge: sympy.Le, sympy.Le: sympy.Ge, sympy.Gt: sympy.Lt, sympy.Lt: sympy.Gt}.get(kind, kind)
    if kind is sympy.Eq:
        return lhs.name, value, value
    if kind is sympy.Ge:
        return lhs.name, value, None
    if kind is sympy.Gt:
        return lhs.name, value + 1, None
    if kind is sympy.Le:
        return lhs.name, None, value
    if kind is sympy.Lt:
        return lhs.name, None, value - 1
    return None


def _text(condition: sympy.Basic) -> str:
    condition = plain_sympy(condition)
    if isinstance(condition, sympy.Eq | sympy.Ne):
        return f"{condition.lhs} {'==' if isinstance(condition, sympy.Eq) else '!='} {condition.rhs}"
    return str(condition)


class SizeFamilies:
    """Estimates of a stream of calls (decode steps, a training loop's batches) that differ only in
    their tensors' sizes, from one capture per family instead of one per call.

    Calls of the same structure (the same tensors, ranks and dtypes, the same other arguments) are a
    family. Its first call is estimated plainly. The second names the axes that changed (axes whose
    sizes changed alike share a name, as a KV cache's layers do) and captures a sweep over them;
    every later call is a point of that sweep, as exact as estimate() there. A call that also changes
    another axis, or a sweep that cannot be captured, is estimated plainly.
    """

    def __init__(self, model: torch.nn.Module, **estimate_options: Any) -> None:
        self.model = model
        self.options = estimate_options
        self.captures = 0  # captures made: plain estimates plus sweep pieces
        self._families: dict[Any, _Family] = {}
        self._sweeps_possible = estimate_options.get("method", AUTO) in (AUTO, "eager")

    def estimate(self, args: tuple, kwargs: dict, backward: bool = False) -> Estimate:
        shapes = [tuple(t.shape) for t in tensors_in((args, kwargs))]
        family = self._families.setdefault((_structure((args, kwargs)), backward), _Family(shapes))
        if self._sweeps_possible and family.sweep is None and not family.failed and shapes != family.shapes:
            plan = _changed_axes(family.shapes, shapes)
            if plan is not None:
                try:
                    family.sweep = self._sweep(to_meta((tuple(args), dict(kwargs))), plan, backward)
                    self.captures += len(family.sweep.pieces)
                except Exception:  # noqa: BLE001 - this family is estimated call by call instead
                    family.failed = True
                    self.captures += 1
        point = family.point(shapes) if family.sweep is not None else None
        if point is not None:
            before = len(family.sweep.pieces)
            try:
                return family.sweep.at(**point)
            except Exception:  # noqa: BLE001 - a point the sweep cannot serve: estimate() tries every method
                pass
            finally:
                self.captures += len(family.sweep.pieces) - before
        self.captures += 1
        return estimate(self.model, tuple(args), dict(kwargs), backward=backward, **self.options)

    def _sweep(self, inputs: tuple[tuple, dict], plan: SizePlan, backward: bool) -> Sweep:
        options = {key: self.options.get(key) for key in ("conventions", "rules", "leaf_modules", "attention")}
        counting = Counting.prepare(options["conventions"] or "deepspeed", options["rules"], options["leaf_modules"],
                                    options["attention"] or "dense")
        args, kwargs = inputs
        return Sweep(self.model, args, kwargs, plan, counting,
                     {"method": self.options.get("method", AUTO), "backward": backward, "loss": None,
                      "optimizer": None})


class _Family:
    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        self.shapes = shapes  # the first call's input shapes
        self.sweep: Sweep | None = None
        self.failed = False

    def point(self, shapes: list[tuple[int, ...]]) -> dict[str, int] | None:
        """The sweep's point for these input shapes, or None if they differ from it elsewhere too."""
        plan = self.sweep.plan
        point: dict[str, int] = {}
        for index, (shape, first) in enumerate(zip(shapes, self.shapes)):
            named = plan.axes.get(index, {})
            for axis, (size, was) in enumerate(zip(shape, first)):
                name = named.get(axis)
                if name is None:
                    if size != was:
                        return None
                elif point.setdefault(name, size) != size:
                    return None
        return point


def _structure(value: Any) -> Any:
    """What a family shares: everything of a call's signature but its tensors' sizes."""
    def erase(leaf: Any) -> Any:
        if isinstance(leaf, tuple) and len(leaf) == 3 and isinstance(leaf[1], torch.dtype):
            return len(leaf[0]), leaf[1], leaf[2]  # a tensor: rank, dtype, device type
        if isinstance(leaf, tuple) and len(leaf) == 2 and isinstance(leaf[1], tuple):
            return leaf[0], tuple((len(shape), dtype) for shape, dtype in leaf[1])  # an object of tensors
        return leaf

    spec, leaves = signature(value)
    return spec, tuple(erase(leaf) for leaf in leaves)


def _changed_axes(first: list[tuple[int, ...]], now: list[tuple[int, ...]]) -> SizePlan | None:
    """A plan naming the axes whose sizes differ between two calls' input shapes (`size0`, `size1`, ...);
    axes that changed from the same size to the same size share a name. None if ranks differ."""
    if len(first) != len(now) or any(len(a) != len(b) for a, b in zip(first, now)):
        return None
    names: dict[tuple[int, int], str] = {}
    axes: dict[int, dict[int, str]] = {}
    for index, (before, after) in enumerate(zip(first, now)):
        for axis, change in enumerate(zip(before, after)):
            if change[0] != change[1]:
                name = names.setdefault(change, f"size{len(names)}")
                axes.setdefault(index, {})[axis] = name
    if not names:
        return None
    return SizePlan(axes, {name: after for (_, after), name in names.items()})
