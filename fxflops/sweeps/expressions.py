"""Cost expressions of a sweep evaluated exactly and fast: compiled to Python, and conditions as text.

A sweep's per-node costs and its capture's conditions are sympy expressions in the named sizes.
`compile_expression` turns one into a Python function of a point, `CostTemplates` fills a piece's
node costs at one point (each distinct expression evaluated once), `plain_sympy` rewrites torch's integer
division functions as plain sympy, and `simple_bound` / `condition_text` read a condition as a
range of one name or as text.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy

from fxflops.capture.dynamic import user_symbol
from fxflops.results import NodeCost
from fxflops.rules.polynomial import PolyCount


class _Slot(int):
    """A symbolic value's place in a point's list of values (an int, so it indexes that list directly)."""


_NODE_FIELDS = tuple(field.name for field in dataclasses.fields(NodeCost))
_SHAPES = ("input_shapes", "output_shapes")  # evaluated size by size, each distinct tuple once
# NodeCost's frozen __init__ sets each field through object.__setattr__ (~3 us a node, and a point of a
# ResNet-50 has 442 nodes); a node is built by filling its __dict__, which is all that __init__ does
_PLAIN_DATACLASS = not hasattr(NodeCost, "__post_init__") and not hasattr(NodeCost, "__slots__")


class CostTemplates:
    """A piece's node costs with every distinct symbolic value (costs and shape sizes) numbered once, so
    the costs at a point are one list of values, each distinct expression evaluated once, filled into
    the nodes, without looking an expression up per use."""

    def __init__(self, costs: Sequence[NodeCost]) -> None:
        self._slots: dict[Any, _Slot] = {}
        self._functions: list[Callable[[Mapping[str, int]], int]] = []
        self._shape_ids: dict[tuple, int] = {}
        self._shapes: list[tuple[tuple[Any, ...], ...]] = []
        self._nodes = [self._node(cost) for cost in costs]

    def costs(self, point: Mapping[str, int]) -> list[NodeCost]:
        """Every node's cost at `point`: its numbers and shape sizes evaluated there, the rest as captured."""
        values = [function(point) for function in self._functions]
        shapes = [tuple(tuple(values[size] if type(size) is _Slot else size for size in shape) for shape in shapes)
                  for shapes in self._shapes]
        found = []
        for fixed, numbers, inputs, outputs in self._nodes:
            fields = dict(fixed)
            for name, slot in numbers:
                fields[name] = values[slot]
            fields["input_shapes"], fields["output_shapes"] = shapes[inputs], shapes[outputs]
            found.append(_node_cost(fields))
        return found

    def _node(self, cost: NodeCost) -> tuple[dict[str, Any], tuple[tuple[str, _Slot], ...], int, int]:
        # every field a formula in the sizes is evaluated at the point (counts, an attention's dense and
        # effective readings, its kept pairs), whichever fields those are: a point's node holds what
        # estimate()'s holds there, field by field; the rest (names, rule, source, phase ...) as captured
        fixed, numbers = {}, []
        for name in _NODE_FIELDS:
            value = getattr(cost, name)
            if name not in _SHAPES and (type(value) is PolyCount or isinstance(value, sympy.Basic)):
                numbers.append((name, self._slot(value)))
            else:
                fixed[name] = value
        return fixed, tuple(numbers), self._shape_id(cost.input_shapes), self._shape_id(cost.output_shapes)

    def _slot(self, expr: Any) -> _Slot:
        slot = self._slots.get(expr)
        if slot is None:
            slot = self._slots[expr] = _Slot(len(self._functions))
            if type(expr) is PolyCount:
                function = _compiled_count(expr) or _by_sympy(expr.sympy())
            else:
                function = compile_expression(expr) or _by_sympy(expr)
            self._functions.append(function)
        return slot

    def _shape_id(self, shapes: tuple[tuple[Any, ...], ...]) -> int:
        found = self._shape_ids.get(shapes)
        if found is None:
            found = self._shape_ids[shapes] = len(self._shapes)
            self._shapes.append(tuple(tuple(size if type(size) is int else self._slot(size) for size in shape)
                                      for shape in shapes))
        return found


def _compiled_count(count: PolyCount) -> Callable[[Mapping[str, int]], int] | None:
    """A count kept as a polynomial, as a Python function of a point (None where an atom has no Python form)."""
    products = []
    for coefficient, factors in count.terms():
        compiled = []
        for atom, power in factors:
            function = (lambda point, value=atom: value) if type(atom) is int else compile_expression(atom)
            if function is None:
                return None
            compiled.append((function, power))
        products.append((coefficient, compiled))
    return lambda point: sum(coefficient * math.prod(function(point) ** power for function, power in compiled)
                             for coefficient, compiled in products)


def _node_cost(fields: dict[str, Any]) -> NodeCost:
    if not _PLAIN_DATACLASS:
        return NodeCost(**fields)
    node = object.__new__(NodeCost)
    node.__dict__.update(fields)
    return node


def _by_sympy(expr: Any) -> Callable[[Mapping[str, int]], int]:
    """An expression compile_expression could not compile, evaluated by sympy at a point."""
    import sympy

    return lambda point: int(expr.xreplace({user_symbol(name): sympy.Integer(value) for name, value in point.items()}))


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


def simple_bound(condition: sympy.Basic) -> tuple[str, int | None, int | None] | None:
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


def condition_text(condition: sympy.Basic) -> str:
    condition = plain_sympy(condition)
    if isinstance(condition, sympy.Eq | sympy.Ne):
        return f"{condition.lhs} {'==' if isinstance(condition, sympy.Eq) else '!='} {condition.rhs}"
    return str(condition)
