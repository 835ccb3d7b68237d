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


# Bounds that keep a hostile or mistaken formula from stalling or exhausting the process. Each is
# checked before the operation that could exceed it (a power's size is estimated from its operands'
# bit lengths, a repetition's from the sequence's length), so refusing costs microseconds. The
# shipped rules stay far inside them: at most 850 characters, 470 nodes and depth 20.
MAX_SOURCE = 2_000  # characters of one formula
MAX_NODES = 1_000  # syntax tree nodes of one formula
MAX_DEPTH = 100  # syntax tree nesting (the evaluator recurses about twice per level)
MAX_INT_BITS = 256  # bits of any integer a formula makes (2**256 ~ 1e77; a count is below 2**80)
MAX_EXPONENT = 64  # the right operand of **
MAX_LENGTH = 10_000  # characters of a string, items of a list or tuple a formula makes


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
        result = _multiply(result, value)
    return result


def _sum(values: Sequence[Any], start: Any = 0) -> Any:
    """sum(), each step bounded (Python's would concatenate lists without limit)."""
    return functools.reduce(_add, values, start)


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


def trilinear_counts(i1: Any, i2: Any, i3: Any, expand1: Sequence[int], expand2: Sequence[int],
                     expand3: Sequence[int], sumdim: Sequence[int], unroll_dim: int = 1) -> tuple[Any, Any]:
    """(MACs, other FLOPs) of aten._trilinear (nn.Bilinear's kernel, and its gradients) as torch runs it:
    for each index of `unroll_dim`, i1 times i2 summed over the summed dims i3 is expanded in, then that
    times i3 summed over the rest (sumproduct_pair each time). A step that sums is a MAC per product
    term, one that sums nothing plain multiplies; a summed dim only one side has is summed on that side
    first (adds); each slice is added into the zeroed output."""
    total_dim = len(i1.shape) + len(expand1)
    expands = [{dim % total_dim for dim in expand} for expand in (expand1, expand2, expand3)]
    if all(unroll_dim in expand for expand in expands):
        return 0, 0  # torch's loop over the unrolled dim runs zero times
    shapes = [_unsqueezed(list(t.shape), sorted(expand)) for t, expand in zip((i1, i2, i3), expands)]
    unrolled = _max([shape[unroll_dim] for shape, expand in zip(shapes, expands) if unroll_dim not in expand])
    for shape in shapes:
        shape[unroll_dim] = 1  # each step works on one slice (narrow)
    summed = {dim % total_dim for dim in sumdim} - {unroll_dim}
    first_sums = {dim for dim in summed if dim in expands[2]}
    macs1, other1, buffer = _sumproduct_pair(shapes[0], shapes[1], first_sums)
    macs2, other2, out_slice = _sumproduct_pair(buffer, shapes[2], summed - first_sums)
    adds = prod(size for dim, size in enumerate(out_slice) if dim not in summed)
    return _multiply(unrolled, _add(macs1, macs2)), _multiply(unrolled, _add(_add(other1, other2), adds))


def _sumproduct_pair(left: list[Any], right: list[Any], sums: set[int]) -> tuple[Any, Any, list[Any]]:
    """(MACs, other FLOPs, result shape with the summed dims kept as 1) of aten's sumproduct_pair."""
    left, right = list(left), list(right)
    pre_sums: Any = 0
    for dim in sums:  # a summed dim only one side has is summed there first
        if left[dim] != 1 and right[dim] == 1:
            pre_sums = _add(pre_sums, prod(left) - prod(left) // left[dim])
            left[dim] = 1
        elif right[dim] != 1 and left[dim] == 1:
            pre_sums = _add(pre_sums, prod(right) - prod(right) // right[dim])
            right[dim] = 1
    terms = prod(_max(a, b) for a, b in zip(left, right))
    contracted = any(left[dim] != 1 for dim in sums)
    result = [1 if dim in sums else _max(a, b) for dim, (a, b) in enumerate(zip(left, right))]
    return (terms, pre_sums, result) if contracted else (0, _add(terms, pre_sums), result)


def _unsqueezed(shape: list[Any], expand: Sequence[int]) -> list[Any]:
    for dim in expand:  # ascending, as aten unsqueezes
        shape.insert(dim, 1)
    return shape


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
    # a rule file must not be able to stall the process with 10 ** 10 ** 10: sizes are checked first
    _refuse_tensor(base, exponent)
    if _plain_int(exponent):
        if abs(exponent) > MAX_EXPONENT:
            raise FormulaError(f"exponent {_short(exponent)} is too large (at most {MAX_EXPONENT})")
        if _plain_int(base) and exponent > 0 and (base.bit_length() - 1) * exponent + 1 > MAX_INT_BITS:
            raise FormulaError(
                f"{_short(base)} ** {exponent} would have about {base.bit_length() * exponent} bits "
                f"(at most {MAX_INT_BITS})"
            )
    return _bounded(base**exponent)


def _multiply(left: Any, right: Any) -> Any:
    _refuse_tensor(left, right)
    for sequence, count in ((left, right), (right, left)):
        if isinstance(sequence, _SEQUENCES):
            if _symbolic(count):
                raise FormulaError("repeating a sequence a symbolic number of times is not allowed")
            if _plain_int(count) and len(sequence) * count > MAX_LENGTH:
                raise FormulaError(
                    f"a {type(sequence).__name__} of length {len(sequence)} repeated {count} times would have "
                    f"length {len(sequence) * count} (at most {MAX_LENGTH})"
                )
    if _plain_int(left) and _plain_int(right) and left.bit_length() + right.bit_length() > MAX_INT_BITS + 1:
        raise FormulaError(
            f"{_short(left)} * {_short(right)} would have about {left.bit_length() + right.bit_length()} bits "
            f"(at most {MAX_INT_BITS})"
        )
    return _bounded(left * right)


def _add(left: Any, right: Any) -> Any:
    _refuse_tensor(left, right)
    if isinstance(left, _SEQUENCES) and isinstance(right, _SEQUENCES) and len(left) + len(right) > MAX_LENGTH:
        raise FormulaError(f"concatenating would make length {len(left) + len(right)} (at most {MAX_LENGTH})")
    return _bounded(left + right)


def _modulo(left: Any, right: Any) -> Any:
    if isinstance(left, str | bytes):
        raise FormulaError("string formatting with % is not allowed")
    return _arithmetic(operator.mod)(left, right)


def _arithmetic(op: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def checked(left: Any, right: Any) -> Any:
        _refuse_tensor(left, right)
        return _bounded(op(left, right))
    return checked


def _plain_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_SEQUENCES = (str, bytes, list, tuple)


def _bounded(value: Any) -> Any:
    """The value, if within the bounds every value a formula makes must keep."""
    kind = type(value)
    if kind is int:
        if value.bit_length() > MAX_INT_BITS:
            raise FormulaError(f"an integer of {value.bit_length()} bits (at most {MAX_INT_BITS})")
    elif kind is float:
        if not math.isfinite(value):
            raise FormulaError(f"float overflow ({value})")
    elif kind is complex:
        raise FormulaError(f"complex result {_short(value)}")
    elif kind in _SEQUENCES and len(value) > MAX_LENGTH:
        raise FormulaError(f"a {kind.__name__} of length {len(value)} (at most {MAX_LENGTH})")
    return value


def _refuse_tensor(*values: Any) -> None:
    # arithmetic on a tensor would compute on it (real weights under annotate()): formulas take sizes
    if any(isinstance(value, torch.Tensor) for value in values):
        raise FormulaError("arithmetic on a tensor is not allowed: use its .shape, .ndim or numel()")


def _short(value: Any, limit: int = 60) -> str:
    """repr() cut to a readable length: error messages quote values and formulas."""
    return clip(repr(value), limit)


def clip(text: str, limit: int = 200) -> str:
    """Text cut to a readable length for a one-line message."""
    return text if len(text) <= limit else f"{text[: limit - 30]}...{text[-10:]} ({len(text)} characters)"


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


_max = _extreme(max, torch.sym_max)  # a broadcast size (one side 1, or both equal), kept symbolic

HELPERS: dict[str, Callable[..., Any]] = {
    "numel": numel,
    "prod": prod,
    "len": len,
    "min": _extreme(min, torch.sym_min),
    "max": _max,
    "sum": _sum,
    "abs": abs,
    "int": _to_int,
    "ceil": math.ceil,
    "einsum_macs": einsum_macs,
    "fft_flops": fft_flops,
    "trilinear_counts": trilinear_counts,
    "floating": floating,
    "is_complex": is_complex,
}

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

    def evaluate(self, names: Mapping[str, Any]) -> Any:
        tree = self._checked()[0]  # outside the try: a formula that does not parse says so once
        try:
            return _Evaluator(names).visit(tree.body)
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
        return _bounded(HELPERS[node.func.id](*(self.visit(arg) for arg in node.args)))
