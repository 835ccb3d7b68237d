"""A small, safe expression language for cost formulas in rule files.

Formulas are a subset of Python expressions parsed with `ast` and evaluated by walking the tree,
never with `eval`, so a rule file cannot run code. The same walk works on plain ints and on
symbolic sizes (torch.SymInt), because it only applies Python's operators to the values.

This module parses and checks a formula (`Formula`) and evaluates it; the helpers a formula may call
are in `fxflops.rules.formula_helpers`, the bounded operators it applies in `fxflops.rules.formula_bounds`.
"""

from __future__ import annotations

import ast
import functools
import operator
from collections.abc import Mapping
from typing import Any

from fxflops.rules.formula_bounds import (
    FormulaError,
    _add,
    _arithmetic,
    _bounded,
    _bounded_pow,
    _modulo,
    _multiply,
    _refuse_tensor,
    _short,
    clip,
)
from fxflops.rules.formula_helpers import HELPERS, numel, own_numel
from fxflops.rules.polynomial import lifted, lifted_numel, unlifted

# Bounds on a formula's syntax, checked before anything is evaluated (the values it makes are bounded
# in formula_bounds). The shipped rules stay far inside them: at most 850 characters, 470 nodes and depth 20.
MAX_SOURCE = 2_000  # characters of one formula
MAX_NODES = 1_000  # syntax tree nodes of one formula
MAX_DEPTH = 100  # syntax tree nesting (the evaluator recurses about twice per level)

_ATTRIBUTES = {"shape", "ndim"}

_BINARY = {
    ast.Add: _add,
    ast.Sub: _arithmetic(operator.sub),
    ast.Mult: _multiply,
    ast.FloorDiv: _arithmetic(operator.floordiv),
    ast.Div: _arithmetic(operator.truediv),
    ast.Mod: _modulo,
    ast.Pow: _bounded_pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_}
_CONSTANTS = (int, float, str, bool, type(None))
_COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
_ALLOWED_NODES = (
    ast.Expression, ast.Load, ast.Constant, ast.Name, ast.Tuple, ast.List, ast.Slice, ast.Subscript,
    ast.Attribute, ast.Call, ast.BinOp, ast.UnaryOp, ast.Compare, ast.BoolOp, ast.IfExp, ast.And, ast.Or,
    *_BINARY, *_UNARY, *_COMPARE,
)
# allowed nodes with nothing more to check (Attribute, Constant and Call are checked further)
_PLAIN_NODES = frozenset(_ALLOWED_NODES) - {ast.Attribute, ast.Constant, ast.Call}


class Formula:
    """A parsed, validated formula; call `evaluate(names)` to compute it."""

    def __init__(self, source: str, lazy: bool = False) -> None:
        """`lazy`: check and parse on first use instead of now (the shipped table, which the test suite
        checks, so that a process pays only for the formulas its ops need: parsing all costs ~0.25 s)."""
        if not isinstance(source, str):
            raise FormulaError(f"a formula must be a string, got {type(source).__name__}: {_short(source)}")
        self.source = source
        self._parsed: tuple[ast.Expression, frozenset[str]] | None = None if lazy else _parse(source)

    @property
    def names(self) -> frozenset[str]:
        """The free names of the formula (the helpers excluded)."""
        return self._checked()[1]

    def _checked(self) -> tuple[ast.Expression, frozenset[str]]:
        if self._parsed is None:
            self._parsed = _parse(self.source)
        return self._parsed

    def evaluate(self, names: Mapping[str, Any], lift: bool = False) -> Any:
        """The formula's value. `lift`: symbolic sizes are added and multiplied as polynomials, and a
        count's value may be a `fxflops.rules.polynomial.SizeValue` (what `count.nodes.to_count` takes);
        otherwise SymInts throughout, as torch computes them."""
        tree = self._checked()[0]  # outside the try: a formula that does not parse says so once
        try:
            found = _Evaluator(names, lift).visit(tree.body)
            return found if lift else unlifted(found)
        except FormulaError as error:
            raise FormulaError(f"formula {_short(self.source, 200)}: {error}") from None
        except Exception as error:  # a formula failing on odd inputs must say which formula
            raise FormulaError(
                f"formula {_short(self.source, 200)} failed: {type(error).__name__}: {clip(str(error))}"
            ) from None

    def __repr__(self) -> str:
        return f"Formula({self.source!r})"


@functools.lru_cache(maxsize=4096)
def _parse(source: str) -> tuple[ast.Expression, frozenset[str]]:
    """The checked syntax tree and free names of a formula (a rule and its presets share formulas)."""
    if len(source) > MAX_SOURCE:
        raise FormulaError(f"formula of {len(source)} characters is too long (at most {MAX_SOURCE})")
    try:
        # parenthesized so a formula may span lines in a TOML multi-line string
        tree = ast.parse("(" + source.strip() + "\n)", mode="eval")
    except SyntaxError as error:
        raise FormulaError(f"formula {_short(source, 200)} does not parse: {error.msg}") from None
    except (RecursionError, MemoryError):
        raise FormulaError(f"formula {_short(source, 200)} is nested too deeply to parse") from None
    names = set()
    nodes = 0
    stack: list[tuple[ast.AST, int]] = [(tree.body, 1)]
    while stack:  # iterative: a formula nested deeper than Python's recursion limit must not crash the check
        node, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise FormulaError(f"formula {_short(source, 200)} has more than {MAX_NODES} syntax nodes")
        if depth > MAX_DEPTH:
            raise FormulaError(f"formula {_short(source, 200)} is nested more than {MAX_DEPTH} deep")
        kind = type(node)
        if kind is ast.Name:
            if node.id not in HELPERS:
                names.add(node.id)
        elif kind not in _PLAIN_NODES:
            _check_allowed(node, source)
        for field_name in node._fields:
            child = getattr(node, field_name)
            if type(child) is list:
                stack.extend((item, depth + 1) for item in child if isinstance(item, ast.AST))
            elif isinstance(child, ast.AST) and not isinstance(child, ast.expr_context):
                stack.append((child, depth + 1))
    return tree, frozenset(names)


def _check_allowed(node: ast.AST, source: str) -> None:
    if not isinstance(node, _ALLOWED_NODES):
        raise FormulaError(f"formula {_short(source, 200)}: {type(node).__name__} is not allowed in a formula")
    if isinstance(node, ast.Attribute) and node.attr not in _ATTRIBUTES:
        raise FormulaError(f"formula {_short(source, 200)}: attribute '.{node.attr}' is not allowed (only .shape, .ndim)")
    if isinstance(node, ast.Constant):
        if not isinstance(node.value, _CONSTANTS):
            raise FormulaError(f"formula {_short(source, 200)}: a {type(node.value).__name__} constant is not allowed")
        try:
            _bounded(node.value)
        except FormulaError as error:
            raise FormulaError(f"formula {_short(source, 200)}: constant {error}") from None
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in HELPERS:
            raise FormulaError(
                f"formula {_short(source, 200)}: call to '{clip(ast.unparse(node.func), 60)}' is not allowed "
                f"(helpers: {', '.join(sorted(HELPERS))})"
            )
        if node.keywords:
            raise FormulaError(f"formula {_short(source, 200)}: keyword arguments are not allowed")


class _Evaluator:
    def __init__(self, names: Mapping[str, Any], lift: bool = False) -> None:
        self.names = names
        self.lift = lift  # symbolic sizes read from names and shapes as SizeValues

    def visit(self, node: ast.AST) -> Any:
        return getattr(self, f"visit_{type(node).__name__}")(node)

    def visit_Constant(self, node: ast.Constant) -> Any:
        return node.value

    def visit_Name(self, node: ast.Name) -> Any:
        if node.id in HELPERS:
            return HELPERS[node.id]
        if node.id in self.names:
            return lifted(self.names[node.id]) if self.lift else self.names[node.id]
        if node.id in ("True", "False", "None"):
            return {"True": True, "False": False, "None": None}[node.id]
        known = ", ".join(sorted(self.names)) or "none"
        raise FormulaError(f"name '{node.id}' is not defined here (known names: {known})")

    def visit_Attribute(self, node: ast.Attribute) -> Any:
        value = self.visit(node.value)
        if node.attr == "shape":
            shape = tuple(value.shape) if hasattr(value, "shape") else tuple(value)
            return lifted(shape) if self.lift else shape
        return value.ndim if hasattr(value, "ndim") else len(value)

    def visit_BinOp(self, node: ast.BinOp) -> Any:
        return _BINARY[type(node.op)](self.visit(node.left), self.visit(node.right))

    def visit_UnaryOp(self, node: ast.UnaryOp) -> Any:
        operand = self.visit(node.operand)
        if not isinstance(node.op, ast.Not):
            _refuse_tensor(operand)
        return _UNARY[type(node.op)](operand)

    def visit_BoolOp(self, node: ast.BoolOp) -> Any:
        is_and = isinstance(node.op, ast.And)
        value: Any = is_and
        for operand in node.values:
            value = self.visit(operand)
            if bool(value) != is_and:
                return value
        return value

    def visit_Compare(self, node: ast.Compare) -> Any:
        left = self.visit(node.left)
        for op, comparator in zip(node.ops, node.comparators):
            right = self.visit(comparator)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True

    def visit_IfExp(self, node: ast.IfExp) -> Any:
        return self.visit(node.body) if self.visit(node.test) else self.visit(node.orelse)

    def visit_Subscript(self, node: ast.Subscript) -> Any:
        return self.visit(node.value)[self.visit(node.slice)]

    def visit_Slice(self, node: ast.Slice) -> slice:
        parts = (node.lower, node.upper, node.step)
        return slice(*(self.visit(part) if part is not None else None for part in parts))

    def visit_Tuple(self, node: ast.Tuple) -> tuple:
        return tuple(self.visit(element) for element in node.elts)

    def visit_List(self, node: ast.List) -> list:
        return [self.visit(element) for element in node.elts]

    def visit_Call(self, node: ast.Call) -> Any:
        helper = HELPERS[node.func.id]
        args = [self.visit(arg) for arg in node.args]
        if self.lift:
            if helper is numel and len(args) == 1 and own_numel(args[0]):
                return lifted_numel(args[0])  # the product of its sizes' polynomials (numel()'s, made on need)
            return lifted(_bounded(helper(*args)))
        return _bounded(helper(*args))
