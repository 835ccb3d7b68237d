"""Cost expressions of a sweep evaluated exactly and fast: compiled to Python, and conditions as text.

A sweep's per-node costs and its capture's conditions are sympy expressions in the named sizes.
`compile_expression` turns one into a Python function of a point, the `Evaluator` evaluates a
piece's expressions at one point (each distinct one once), `plain_sympy` rewrites torch's integer
division functions as plain sympy, and `simple_bound` / `condition_text` read a condition as a
range of one name or as text.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import sympy

from fxflops.capture.dynamic import user_symbol
from fxflops.results import NodeCost


class Evaluator:
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
