"""A small, safe expression language for cost formulas in rule files.

Formulas are a subset of Python expressions parsed with `ast` and evaluated by walking the tree,
never with `eval`, so a rule file cannot run code. The same walk works on plain ints and on
symbolic sizes (torch.SymInt), because it only applies Python's operators to the values.
"""

from __future__ import annotations

import ast
import functools
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch


class FormulaError(ValueError):
    """A formula that does not parse, uses something not allowed, or fails on its inputs."""


def numel(value: Any) -> Any:
    """Number of elements of a tensor, a shape, or 0 for None."""
    if hasattr(value, "shape"):
        return prod(value.shape)
    if isinstance(value, list | tuple):
        if any(hasattr(item, "shape") for item in value):
            raise FormulaError("numel() of a tuple of tensors: index it first, e.g. numel(out[0])")
        return prod(value)
    return 0  # None or a Python scalar: no tensor, no elements


def prod(values: Sequence[Any]) -> Any:
    result: Any = 1
    for value in values:
        result = result * value
    return result


def einsum_macs(equation: str, operands: Sequence[Any]) -> Any:
    """Multiply-accumulates of an einsum contracted pairwise left to right, as torch.einsum does.

    Each pairwise step is one batched matmul over the labels the pair shares and still needs
    (kept) or sums away (contracted); a label found in only one operand and needed nowhere else is
    summed before the matmul, which is an addition, not a MAC.
    """
    operands = _flatten_operands(operands)
    lhs, arrow, rhs = equation.replace(" ", "").partition("->")
    terms = lhs.split(",")
    if len(terms) != len(operands):
        raise FormulaError(f"einsum '{equation}' names {len(terms)} operands, got {len(operands)}")
    widest = max((len(op.shape) - len(t.replace("...", "")) for t, op in zip(terms, operands) if "..." in t), default=0)
    ellipsis = "".join(chr(0x100 + i) for i in range(widest))  # stand-in labels for broadcast dims
    terms = [_expand_ellipsis(t, len(op.shape), ellipsis) for t, op in zip(terms, operands)]
    if arrow:
        output = set(_expand_ellipsis(rhs, len(ellipsis) + len(rhs.replace("...", "")), ellipsis))
    else:
        letters = "".join(terms)
        output = set(ellipsis) | {c for c in letters if letters.count(c) == 1}
    sizes: dict[str, Any] = {}
    for term, operand in zip(terms, operands):
        for label, size in zip(term, operand.shape):
            if sizes.get(label) in (None, 1):
                sizes[label] = size
    labels = [set(term) for term in terms]
    total: Any = 0
    current = labels[0]
    for index in range(1, len(labels)):
        needed_later = output.union(*labels[index + 1 :])
        other = labels[index]
        involved = {c for c in current if c in other or c in needed_later}
        involved |= {c for c in other if c in current or c in needed_later}
        total = total + prod(sizes[c] for c in sorted(involved))
        current = {c for c in involved if c in needed_later}
    return total


def fft_flops(shape: Sequence[Any], dims: Any, real: bool, lengths: Sequence[Any] | None = None) -> Any:
    """FLOPs of an FFT over `dims` of a signal of `shape`, summed over the dims: each 1-D transform of
    length N costs 5 N log2 N (radix-2 Cooley-Tukey's count; rounded down when N is not a power of two),
    half that when the signal is real on one side (rfft, irfft, hfft, ihfft), times the transforms
    along that dim. `lengths` replaces the sizes of `dims` (torch's n= and s=; -1 keeps one); `dims`
    None means the last len(lengths) dims, or all of them, as in torch.fft.fftn."""
    shape = list(shape)
    if dims is None:
        dims = range(len(shape) - len(lengths), len(shape)) if lengths is not None else range(len(shape))
    dims = [dim % len(shape) for dim in ([dims] if isinstance(dims, int) else dims)]
    for dim, length in zip(dims, lengths or ()):
        if length is not None and not (isinstance(length, int) and length == -1):
            shape[dim] = length
    total: Any = 0
    for dim in dims:
        total = total + prod(shape) // shape[dim] * _fft_line_flops(shape[dim], real)
    return total


def _fft_line_flops(length: Any, real: bool) -> Any:
    if _symbolic(length):  # log2(1) is 0: no branch, which would fix the size
        return torch.sym_int(5 * length * torch._sym_log2(torch.sym_float(length)) / (2 if real else 1))
    return int(5 * length * math.log2(length) / (2 if real else 1)) if length > 1 else 0


def is_complex(value: Any) -> bool:
    """Whether a value holds complex numbers (a complex FFT input, as against a real one)."""
    return value.is_complex() if isinstance(value, torch.Tensor) else isinstance(value, complex)


def _flatten_operands(operands: Sequence[Any]) -> list[Any]:
    # torch.einsum takes operands as varargs or as one list
    flat: list[Any] = []
    for operand in operands:
        flat.extend(_flatten_operands(operand) if isinstance(operand, list | tuple) else [operand])
    return flat


def _expand_ellipsis(term: str, ndim: int, ellipsis: str) -> str:
    if "..." not in term:
        return term
    head, tail = term.split("...")
    count = ndim - len(head) - len(tail)
    return head + ellipsis[len(ellipsis) - count :] + tail


def _bounded_pow(base: Any, exponent: Any) -> Any:
    # a rule file must not be able to stall the loader with 10 ** 10 ** 10
    if isinstance(exponent, int) and abs(exponent) > 64:
        raise FormulaError(f"exponent {exponent} is too large (at most 64)")
    return base**exponent


def floating(value: Any) -> bool:
    """Whether a value holds floating-point (or complex) numbers: integer and bool work is not FLOPs."""
    if isinstance(value, torch.Tensor):
        return value.is_floating_point() or value.is_complex()
    return isinstance(value, float | complex)


def _extreme(builtin: Callable[..., Any], pick: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    """Python's min or max, but over symbolic sizes torch's, which keeps them symbolic (Python's
    compares them, which fixes a branch)."""
    def extreme(*values: Any) -> Any:
        items = list(values[0]) if len(values) == 1 and not _symbolic(values[0]) else list(values)
        if not any(_symbolic(item) for item in items):
            return builtin(*values)
        return functools.reduce(pick, items)
    return extreme


def _symbolic(value: Any) -> bool:
    return isinstance(value, torch.SymInt | torch.SymFloat)


def _to_int(value: Any) -> Any:
    """int(), keeping a symbolic size symbolic (rounded toward zero, as int() rounds)."""
    if isinstance(value, torch.SymInt):
        return value
    if isinstance(value, torch.SymFloat):
        return torch.sym_int(value)
    return int(value)


HELPERS: dict[str, Callable[..., Any]] = {
    "numel": numel,
    "prod": prod,
    "len": len,
    "min": _extreme(min, torch.sym_min),
    "max": _extreme(max, torch.sym_max),
    "sum": sum,
    "abs": abs,
    "int": _to_int,
    "ceil": math.ceil,
    "einsum_macs": einsum_macs,
    "fft_flops": fft_flops,
    "floating": floating,
    "is_complex": is_complex,
}

_ATTRIBUTES = {"shape", "ndim"}

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Div: operator.truediv,
    ast.Mod: operator.mod,
    ast.Pow: lambda base, exponent: _bounded_pow(base, exponent),
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_}
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


class Formula:
    """A parsed, validated formula; call `evaluate(names)` to compute it."""

    def __init__(self, source: str) -> None:
        if not isinstance(source, str):
            raise FormulaError(f"a formula must be a string, got {type(source).__name__}: {source!r}")
        self.source = source
        self._tree, self.names = _parse(source)

    def evaluate(self, names: Mapping[str, Any]) -> Any:
        try:
            return _Evaluator(names).visit(self._tree.body)
        except FormulaError:
            raise
        except Exception as error:  # a formula failing on odd inputs must say which formula
            raise FormulaError(f"formula {self.source!r} failed: {type(error).__name__}: {error}") from None

    def __repr__(self) -> str:
        return f"Formula({self.source!r})"


@functools.lru_cache(maxsize=4096)
def _parse(source: str) -> tuple[ast.Expression, frozenset[str]]:
    """The checked syntax tree and free names of a formula (a rule and its presets share formulas)."""
    try:
        # parenthesized so a formula may span lines in a TOML multi-line string
        tree = ast.parse("(" + source.strip() + "\n)", mode="eval")
    except SyntaxError as error:
        raise FormulaError(f"formula {source!r} does not parse: {error.msg}") from None
    names = set()
    for node in ast.walk(tree):
        _check_allowed(node, source)
        if isinstance(node, ast.Name) and node.id not in HELPERS:
            names.add(node.id)
    return tree, frozenset(names)


def _check_allowed(node: ast.AST, source: str) -> None:
    if not isinstance(node, _ALLOWED_NODES):
        raise FormulaError(f"formula {source!r}: {type(node).__name__} is not allowed in a formula")
    if isinstance(node, ast.Attribute) and node.attr not in _ATTRIBUTES:
        raise FormulaError(f"formula {source!r}: attribute '.{node.attr}' is not allowed (only .shape, .ndim)")
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in HELPERS:
            raise FormulaError(
                f"formula {source!r}: call to '{ast.unparse(node.func)}' is not allowed "
                f"(helpers: {', '.join(sorted(HELPERS))})"
            )
        if node.keywords:
            raise FormulaError(f"formula {source!r}: keyword arguments are not allowed")


class _Evaluator:
    def __init__(self, names: Mapping[str, Any]) -> None:
        self.names = names

    def visit(self, node: ast.AST) -> Any:
        return getattr(self, f"visit_{type(node).__name__}")(node)

    def visit_Constant(self, node: ast.Constant) -> Any:
        return node.value

    def visit_Name(self, node: ast.Name) -> Any:
        if node.id in HELPERS:
            return HELPERS[node.id]
        if node.id in self.names:
            return self.names[node.id]
        if node.id in ("True", "False", "None"):
            return {"True": True, "False": False, "None": None}[node.id]
        known = ", ".join(sorted(self.names)) or "none"
        raise FormulaError(f"name '{node.id}' is not defined here (known names: {known})")

    def visit_Attribute(self, node: ast.Attribute) -> Any:
        value = self.visit(node.value)
        if node.attr == "shape":
            return tuple(value.shape) if hasattr(value, "shape") else tuple(value)
        return value.ndim if hasattr(value, "ndim") else len(value)

    def visit_BinOp(self, node: ast.BinOp) -> Any:
        return _BINARY[type(node.op)](self.visit(node.left), self.visit(node.right))

    def visit_UnaryOp(self, node: ast.UnaryOp) -> Any:
        return _UNARY[type(node.op)](self.visit(node.operand))

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
        return HELPERS[node.func.id](*(self.visit(arg) for arg in node.args))
