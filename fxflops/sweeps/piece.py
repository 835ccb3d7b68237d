"""A piece of a sweep: one symbolic capture, its costs as expressions, and where they hold.

A `Piece` holds every node's cost as an expression in the named sizes and the conditions under
which the capture's path is the forward's path. It answers for one point: whether its conditions
hold there, the per-module formulas, the whole Estimate at the point, or only its totals and top
modules (each distinct expression evaluated once). `Sweep` keeps one piece per path it has seen.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from typing import Any

import sympy
import torch
from torch.utils._pytree import tree_map

from fxflops.capture.dynamic import SizePlan, holds, user_symbol
from fxflops.capture.lookups import position_lookups
from fxflops.capture.tensor_walk import tensors_in
from fxflops.results import Captured, Estimate, ModuleInfo, ModuleStats, NodeCost, SweepModule, SweepPoint
from fxflops.results.estimate import Deferred
from fxflops.rules.polynomial import Poly, PolyCount, plain
from fxflops.sweeps.compiled import Program
from fxflops.sweeps.expressions import CostTemplates, compile_expression, condition_text, plain_sympy, simple_bound
from fxflops.tree import owning_module, parent_name, totals_by, unknown_ops


class Piece:
    """One symbolic capture: every node's cost as an expression, and where those expressions hold."""

    def __init__(self, plan: SizePlan, captured: Captured, costs: list[NodeCost], value_sizes: bool = False) -> None:
        sizes = captured.sizes
        self.plan = plan  # its hints are the point it was captured at
        self.captured = captured
        # every node's cost as counted: under the sweep's sizes a count may be a PolyCount (a polynomial the
        # programs compile as it is); `costs` writes them as sympy when first read
        self._counted = costs
        self._costs: list[NodeCost] | None = None
        self.conditions: list[sympy.Basic] = sizes.conditions()
        # (frozen: a module whose params are an int is shared as it is)
        self.infos = {name: info if type(info.params) is int else
                      dataclasses.replace(info, params=sizes.expression(info.params))
                      for name, info in captured.modules.items()}
        self._templates: CostTemplates | None = None  # made on the first estimate()
        self._symbolic_params = any(not isinstance(info.params, int) for info in self.infos.values())
        self._terms: dict[str, tuple[Counter, Counter]] | None = None  # see _inclusive_terms
        self._at_depth: dict[int, tuple[list[str], Program]] = {}  # see _ranked_at
        # each region past a position table with its test at a point (compiled where it can be)
        self._regions = _symbolic_lookups(captured)
        self._lookups = [(compile_expression(region) or (lambda point, r=region: holds([r], point)), caution)
                         for region, caution in self._regions]
        self._holds: Program | None = None  # the conditions as one compiled check, made on first use
        self._programs: _Programs | None = None  # the costs compiled, made on the first point
        self._checks: list[_Check] | None = None  # counts not proven non-negative integers, made on the first point
        unbound = _free_names(costs, self.infos) - {user_symbol(name) for name in plan.names}
        # sizes made from tensor values (a router's picks: rows per expert), left free for the caller to bind
        self.free: tuple[str, ...] = tuple(sorted(map(str, unbound))) if value_sizes else ()
        if unbound and not value_sizes:
            raise ValueError(
                f"costs depend on sizes the capture could not name ({', '.join(sorted(map(str, unbound)))}): "
                "an op's output size depends on tensor values (nonzero, masked_select, unique). "
                "Sweep over inputs whose shapes fix every size, or use estimate() at each point.")

    @property
    def costs(self) -> list[NodeCost]:
        """Every node's cost, its counts ints or sympy expressions in the sweep's names (made on first read)."""
        if self._costs is None:
            self._costs = [_plain_cost(cost) for cost in self._counted]
        return self._costs

    def unknown(self) -> list[Any]:
        """The ops no rule counts (tree.unknown_ops of the costs)."""
        return unknown_ops(self._counted)

    def holds(self, point: Mapping[str, int]) -> bool:
        if self._holds is None:
            self._holds = Program(self.plan.names, conditions=self.conditions)
        return self._holds(*(point[name] for name in self.plan.names))

    def holds_on_arrays(self, sizes: Mapping[str, Any]) -> Any:
        """Whether the conditions hold at each point of arrays of sizes (a boolean array)."""
        if self._holds is None:
            self._holds = Program(self.plan.names, conditions=self.conditions)
        return self._holds.on_arrays(*(sizes[name] for name in self.plan.names))

    def describe(self) -> list[str]:
        """The conditions as text, e.g. 'seq >= 2', 'seq <= 1024'."""
        return list(dict.fromkeys(condition_text(condition) for condition in self.conditions))

    def bounds(self) -> dict[str, tuple[int, int | None]]:
        """Each name's range as the conditions on that name alone state it: {name: (least, most or None)}."""
        found = {name: [0, None] for name in self.plan.names}
        for condition in self.conditions:
            bound = simple_bound(condition)
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
        others = sum(1 for condition in self.conditions if simple_bound(condition) is None)
        return ", ".join(ranges) + (f" (and {others} more conditions, each checked per point)" if others else "")

    def formulas(self, quantity: str) -> dict[str, sympy.Expr]:
        """Module name -> inclusive formula of `quantity` (the root is "")."""
        if quantity == "params":
            return {name: sympy.sympify(info.params) for name, info in self.infos.items()}
        # each module's polynomial counts summed as polynomials (written as sympy once per module), its other
        # terms (ints, sympy) added to that
        own: dict[str, list[Any]] = {name: [Poly.of(0), []] for name in self.infos}
        field = "flops" if quantity.endswith("flops") else "macs"
        names = None
        for cost in self._counted:
            if quantity.startswith("fwd_") and cost.is_backward or quantity.startswith("bwd_") and not cost.is_backward:
                continue
            value = getattr(cost, field)
            entry = own[owning_module(cost.module, self.captured.aliases, self.infos)]
            if type(value) is PolyCount:
                entry[0] = entry[0] + value.poly
                names = value.names
            elif value != 0:
                entry[1].append(value)
        for name in reversed(list(own)):  # children come after their parents in pre-order
            parent = parent_name(name)
            if parent is not None and parent in own:
                own[parent][0] = own[parent][0] + own[name][0]
                own[parent][1].extend(own[name][1])
        totals = {name: sympy.Add(*([names.written(poly)] if poly.terms else []), *others)
                  for name, (poly, others) in own.items()}
        return {name: plain_sympy(expr) for name, expr in totals.items()}

    def estimate(self, point: Mapping[str, int], model_type: str, conventions: str, inputs: Any,
                 attention: str = "dense") -> Estimate:
        """The Estimate at `point`, what estimate() gives there: its totals from the compiled program at
        once; its modules, nodes and per-op tables (`Deferred`) on first read."""
        programs = self.programs()
        self.check(point)
        sizes = tuple(point[name] for name in self.plan.names)
        macs, flops, bwd_macs, bwd_flops, params = programs.totals(*sizes)
        captured = self.captured
        result = Estimate(
            model_type=model_type, method=captured.method, conventions=conventions, attention=attention,
            total_macs=macs, total_flops=flops, backward=captured.backward, bwd_macs=bwd_macs, bwd_flops=bwd_flops,
            total_params=params, modules=Deferred(lambda _: programs.modules(sizes, model_type)),
            nodes=Deferred(lambda _: self._node_costs(point)), by_op=_BY_OP, by_rule=_BY_RULE,
            unknown=list(programs.unknown), input_shapes=Deferred(lambda _: shapes_at(inputs, self.plan, point)),
            attempts=[(attempt.method, attempt.reason) for attempt in captured.attempts], dtype=captured.dtype,
            training=captured.training, cautions=self.cautions_at(point), aliases=dict(captured.aliases))
        return result

    def programs(self) -> _Programs:
        """The piece's costs compiled (made on first use)."""
        if self._programs is None:
            self._programs = _Programs(self)
        return self._programs

    def checks(self) -> list[_Check]:
        """The node counts sympy cannot prove non-negative integers at every point (a user rule's
        `input.shape[0] - 4`, or a float one rounded): each is checked at each point, as estimate() checks
        every count. Products of sizes (nearly every count) prove at once and cost nothing per point."""
        if self._checks is None:
            self._checks = _unproven(self._counted, self.captured)
        return self._checks

    def check(self, point: Mapping[str, int]) -> None:
        """Raise estimate()'s RuleEvaluationError where a node's count at `point` is no count."""
        for found in self.checks():
            found.at(point)

    def check_on_arrays(self, sizes: Mapping[str, Any]) -> None:
        """`check` at each point of arrays of sizes (each check over all points at once; the first point
        it fails at is the one named)."""
        import numpy as np

        for found in self.checks():
            if found.exact is None and type(found.value) is not int and found.value.is_integer:
                # an integer formula (b - 4): only its sign is in question, compiled and run on the arrays at once
                if found.program is None:
                    found.program = Program(tuple(sizes), [(0, {found.value: 1})])
                (values,) = found.program.on_arrays(*sizes.values())
                bad = values < 0
            else:  # a float's or an undecided one: each point through sympy (rare: a user rule's own formula)
                bad = np.frompyfunc(lambda *values, f=found: not f.holds(dict(zip(sizes, values))), len(sizes), 1)(
                    *sizes.values())
            failing = np.nonzero(np.asarray(bad, dtype=bool))
            if failing[0].size:
                found.at({name: int(np.asarray(array)[tuple(index[0] for index in failing)])
                          for name, array in sizes.items()})

    def _node_costs(self, point: Mapping[str, int]) -> list[NodeCost]:
        if self._templates is None:
            self._templates = CostTemplates(self._counted)
        return self._templates.costs(point)

    def totals(self, point: Mapping[str, int], model_type: str, depth: int, top: int) -> SweepPoint:
        """The totals `estimate(point)` gives (and its `top` modules at `depth`), without building it: the
        compiled totals, and the inclusive MACs and FLOPs of the modules at `depth` (one program a depth)."""
        programs = self.programs()
        self.check(point)
        sizes = tuple(point[name] for name in self.plan.names)
        macs, flops, bwd_macs, bwd_flops, params = programs.totals(*sizes)
        tops: tuple[SweepModule, ...] = ()
        if top > 0:
            named, program = self._ranked_at(depth)
            values = program(*sizes)
            ranked = sorted(range(len(named)), key=lambda index: (-values[2 * index], named[index]))
            tops = tuple(SweepModule(named[index], model_type if named[index] == "" else self.infos[named[index]].type,
                                     values[2 * index], values[2 * index + 1]) for index in ranked[:top])
        return SweepPoint(dict(point), macs, flops, params, bwd_macs, bwd_flops, tops, tuple(self.cautions_at(point)))

    def _ranked_at(self, depth: int) -> tuple[list[str], Program]:
        """The modules a point's top list ranks at `depth`, and one program of their inclusive MACs and
        FLOPs (module by module, in that order), as `tree.module_stats` sums them. Made once per depth."""
        found = self._at_depth.get(depth)
        if found is None:
            named = _at_depth(list(self.infos), depth)
            terms = self._inclusive_terms()
            outputs = [_weighted(terms[name][field]) for name in named for field in (0, 1)]
            found = self._at_depth[depth] = (named, Program(self.plan.names, outputs))
        return found

    def cautions_at(self, point: Mapping[str, int]) -> list[str]:
        """What a real forward would do differently at `point` (a lookup past a position table holds in a
        region of sizes)."""
        return self.captured.cautions + [caution for inside, caution in self._lookups if inside(point)]

    def cautions_on_arrays(self, sizes: Mapping[str, Any]) -> list[str]:
        """The cautions of any point of arrays of sizes (each lookup's once, if its region meets them)."""
        names = self.plan.names
        found = list(self.captured.cautions)
        for region, caution in self._regions:
            if Program(names, conditions=[region]).on_arrays(*(sizes[name] for name in names)).any():
                found.append(caution)
        return found

    def _inclusive_terms(self) -> dict[str, tuple[Counter, Counter]]:
        """Module -> (macs, flops), each {cost value: nodes with it} summed over the module's subtree as
        `tree.module_stats` sums them. Made once per piece, on first use."""
        if self._terms is None:
            own = {name: (Counter(), Counter()) for name in self.infos}
            for cost in self._counted:
                macs, flops = own[owning_module(cost.module, self.captured.aliases, self.infos)]
                macs[cost.macs] += 1
                flops[cost.flops] += 1
            for name in reversed(list(own)):  # children come after their parents in pre-order
                parent = parent_name(name)
                if parent is not None and parent in own:
                    for mine, child in zip(own[parent], own[name]):
                        mine.update(child)
            self._terms = own
        return self._terms


# a point's per-op and per-rule tables, summed from its nodes when first read
_BY_OP = Deferred(lambda estimate: totals_by(estimate.nodes, lambda cost: cost.op))
_BY_RULE = Deferred(lambda estimate: totals_by(estimate.nodes, lambda cost: cost.rule_key))

# what a module sums of its nodes, in this order (then its params): the fields of ModuleStats they fill
_OWN = ("macs", "flops", "bwd_macs", "bwd_flops", "bytes")


class _Programs:
    """A piece's costs compiled: the whole model's totals as one program, each module's own sums and
    params as another (summed up the tree as `tree.module_stats` sums them), its unknown ops (the same
    at every point)."""

    def __init__(self, piece: Piece) -> None:
        infos, aliases = piece.infos, piece.captured.aliases
        own = {name: [[0, Counter()] for _ in _OWN] for name in infos}
        for cost in piece._counted:
            sums = own[owning_module(cost.module, aliases, infos)]
            values = (cost.macs, cost.flops) + ((cost.macs, cost.flops) if cost.is_backward else (0, 0)) + (cost.bytes,)
            for entry, value in zip(sums, values):
                if type(value) is int:
                    entry[0] += value
                else:
                    entry[1][value] += 1
        whole = [[0, Counter()] for _ in _OWN[:4]]
        for sums in own.values():
            for total, (constant, weighted) in zip(whole, sums):
                total[0] += constant
                total[1].update(weighted)
        names = piece.plan.names
        root_params = infos[""].params
        self.totals = Program(names, [(constant, weighted) for constant, weighted in whole] + [_as_sum(root_params)])
        outputs = []
        for name, info in infos.items():
            outputs += [(constant, weighted) for constant, weighted in own[name]] + [_as_sum(info.params)]
        self._table = Program(names, outputs)
        calls = piece.captured.module_calls
        self._fixed = [(name, info.type, 0 if name == "" else name.count(".") + 1, calls.get(name, 0), info.extra_repr,
                        info.children, parent_name(name)) for name, info in infos.items()]
        self.unknown = tuple(piece.unknown())

    def modules(self, sizes: tuple[int, ...], model_type: str) -> dict[str, ModuleStats]:
        """Per-module stats at the point, equal to `tree.module_stats` of the costs evaluated there."""
        values = self._table(*sizes)
        stats: dict[str, ModuleStats] = {}
        width = len(_OWN) + 1
        for index, (name, kind, depth, calls, extra_repr, children, _) in enumerate(self._fixed):
            macs, flops, bwd_macs, bwd_flops, bytes_, params = values[index * width:(index + 1) * width]
            stats[name] = ModuleStats(
                name=name, type=model_type if name == "" else kind, depth=depth, params=params, macs=macs,
                flops=flops, self_macs=macs, self_flops=flops, calls=calls, extra_repr=extra_repr,
                children=list(children), bwd_macs=bwd_macs, bwd_flops=bwd_flops, self_bwd_macs=bwd_macs,
                self_bwd_flops=bwd_flops, bytes=bytes_, self_bytes=bytes_)
        for name, _, _, _, _, _, parent in reversed(self._fixed):  # children come after their parent in pre-order
            if parent is not None and parent in stats:
                mine, child = stats[parent], stats[name]
                mine.macs += child.macs
                mine.flops += child.flops
                mine.bwd_macs += child.bwd_macs
                mine.bwd_flops += child.bwd_flops
                mine.bytes += child.bytes
        stats[""].calls = max(stats[""].calls, 1)
        return stats


def _as_sum(value: Any) -> tuple[int, dict[Any, int]]:
    return (value, {}) if type(value) is int else (0, {value: 1})


def _weighted(counter: Counter) -> tuple[int, dict[Any, int]]:
    """{cost value: nodes with it} as a Program's sum: the int values added up, the expressions weighted."""
    constant = sum(value * count for value, count in counter.items() if type(value) is int)
    return constant, {value: count for value, count in counter.items() if type(value) is not int}


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


def _symbolic_lookups(captured: Captured) -> list[tuple[sympy.Basic, str]]:
    """Lookups at positions that depend on the sizes: (the region past the table, its caution),
    the caution stating that region (seq > 1024), so a point past a model's positions says so."""
    found = []
    for lookup in position_lookups(captured.graph_module):
        low, high = (plain_sympy(captured.sizes.expression(value)) for value in (lookup.low, lookup.high))
        if not (low.free_symbols or high.free_symbols):
            continue  # a fixed range: the capture's own caution, if any
        region = _either(sympy.Gt(high, lookup.rows - 1), sympy.Lt(low, lookup.least))
        if region == sympy.false:
            continue
        found.append((region, lookup.caution(low, high, condition_text(region))))
    return found


def _either(*conditions: sympy.Basic) -> sympy.Basic:
    """`sympy.simplify(Or(*conditions))`, without it where each condition is decided or linear in one size
    (`seq - 1 > 1023` is `seq > 1024`, as simplify writes it): simplify's first call in a process imports
    sympy.physics (0.1 s, a fifth of a GPT-2 sweep's capture) for what is one division here."""
    solved = [_solved(condition) for condition in conditions]
    if any(found is None for found in solved) or sum(found not in (sympy.true, sympy.false) for found in solved) > 1:
        return sympy.simplify(sympy.Or(*conditions))
    return sympy.Or(*solved)


# a relation and the one it becomes with its sides' sign flipped (a negative coefficient divided out)
_FLIPPED = {sympy.StrictGreaterThan: sympy.StrictLessThan, sympy.StrictLessThan: sympy.StrictGreaterThan,
            sympy.GreaterThan: sympy.LessThan, sympy.LessThan: sympy.GreaterThan}


def _solved(condition: sympy.Basic) -> sympy.Basic | None:
    """A decided condition as it is; `a*x + b OP c` (one size x, a and b numbers) as `x OP (c - b)/a`, the
    relation flipped where a < 0; None for anything else."""
    if condition in (sympy.true, sympy.false):
        return condition
    relation = type(condition)
    if relation not in _FLIPPED:
        return None
    difference = sympy.expand(condition.lhs - condition.rhs)
    if len(difference.free_symbols) != 1:
        return None
    (size,) = difference.free_symbols
    slope, rest = difference.coeff(size, 1), difference.coeff(size, 0)
    linear = slope.is_Rational and rest.is_Rational and slope != 0
    if not linear or sympy.expand(slope * size + rest - difference) != 0:
        return None
    bound = -rest / slope
    return relation(size, bound) if slope > 0 else _FLIPPED[relation](size, bound)


def _free_names(costs: list[NodeCost], infos: dict[str, ModuleInfo]) -> set[sympy.Symbol]:
    found: set[sympy.Symbol] = set()
    values = {value for c in costs for value in (c.macs, c.flops, c.bytes) if type(value) is not int}
    values.update(i.params for i in infos.values() if type(i.params) is not int)
    # each node's shapes once: a replayed block's copies share their reference's shape tuples (by identity),
    # and a large model's nodes hold tens of thousands of sizes
    shapes = {id(held): held for c in costs for held in (c.input_shapes, c.output_shapes)}
    values.update(size for held in shapes.values() for shape in held for size in shape if type(size) is not int)
    # each distinct expression once: sympy walks the whole tree for free_symbols on every ask, and a count's
    # shapes and costs repeat the same few (hashing one is cached)
    for value in values:
        if isinstance(value, sympy.Basic) or type(value) is PolyCount:
            found |= value.free_symbols
    return found


_FIELDS = tuple(field.name for field in dataclasses.fields(NodeCost))


def _plain_cost(cost: NodeCost) -> NodeCost:
    """The cost with its PolyCounts written as sympy (the same NodeCost where it holds none)."""
    written = {name: plain(value) for name in _FIELDS if type(value := getattr(cost, name)) is PolyCount}
    return dataclasses.replace(cost, **written) if written else cost


class _Check:
    """One node's count that is not proven a non-negative integer: checked at a point as check_count
    checks estimate()'s, raising its RuleEvaluationError (the rule, field, op and module, and the point)."""

    def __init__(self, cost: NodeCost, field: str, value: Any, exact: Any) -> None:
        self.cost, self.field = cost, field
        self.value = value.sympy() if type(value) is PolyCount else value  # the count as a formula (or an int)
        self.exact = exact  # the float a formula gave, before it was rounded into `value` (or None)
        self.program: Program | None = None  # `value` compiled over a grid's sizes, made on first use

    def problem(self, point: Mapping[str, int]) -> str | None:
        """What is wrong with the count at `point` (check_count's words), or None."""
        bound = {user_symbol(name): sympy.Integer(size) for name, size in point.items()}
        if self.exact is not None:
            number = float(sympy.sympify(self.exact).xreplace(bound))
            if not number.is_integer():
                return (f"{number!r} (a float), not a count: MACs and FLOPs must be non-negative integers "
                        "(use // or int() for a division)")
        count = sympy.sympify(self.value).xreplace(bound)
        if not count.is_Integer:
            return f"{count}, not a count: MACs and FLOPs must be non-negative integers"
        if count < 0:
            return f"{count}, a negative count: MACs and FLOPs must be non-negative integers"
        return None

    def holds(self, point: Mapping[str, int]) -> bool:
        return self.problem(point) is None

    def at(self, point: Mapping[str, int]) -> None:
        problem = self.problem(point)
        if problem is not None:
            from fxflops.results import ROOT_LABEL
            from fxflops.rules import RuleEvaluationError

            where = ", ".join(f"{name}={size}" for name, size in point.items())
            raise RuleEvaluationError(f"rule '{self.cost.rule}'", self.field, self.cost.op,
                                      f"its formula gave {problem}, at {where} of the sweep",
                                      self.cost.module or ROOT_LABEL)


def _unproven(counted: list[NodeCost], captured: Captured) -> list[_Check]:
    """The checks of the counts sympy cannot prove non-negative integers under the sizes' assumptions
    (each a positive integer); each distinct value is asked once."""
    rounded = getattr(captured.sizes, "rounded", {})
    proven: dict[Any, bool] = {}
    found = []
    for cost in counted:
        for field in ("macs", "flops"):
            value = getattr(cost, field)
            if type(value) is int:
                ok = value >= 0
            else:
                ok = proven.get(value)
                if ok is None:
                    ok = proven[value] = value not in rounded and _nonnegative_integer(value)
            if not ok:
                found.append(_Check(cost, field, value, rounded.get(value) if type(value) is not int else None))
    return found


def _nonnegative_integer(value: Any) -> bool:
    """Whether a count is a non-negative integer at every point: a polynomial with non-negative integer
    coefficients over sizes (the usual count) at once, anything else as sympy's assumptions prove it."""
    if type(value) is PolyCount:
        terms = value.terms()
        if all(type(c) is int and c >= 0 and all(isinstance(atom, sympy.Symbol) and atom.is_positive
                                                 and atom.is_integer for atom, _ in factors)
               for c, factors in terms):
            return True
        value = value.sympy()
    expr = sympy.sympify(value)
    return bool(expr.is_integer) and bool(expr.is_nonnegative)
