"""The helpers a formula may call (`numel`, `prod`, `min`, `max`, `einsum_macs`, `fft_flops`, ...): the
HELPERS table, the only functions a rule file can name.

Each works on ints and on symbolic sizes alike (min and max over SymInts stay symbolic), and builds
its results with the bounded arithmetic of `fxflops.rules.formula_bounds`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from fxflops.rules.formula_bounds import FormulaError, _add, _multiply, _symbolic
from fxflops.rules.polynomial import SizeValue, unlifted


def numel(value: Any) -> Any:
    """Number of elements of a tensor, a shape, or 0 for None."""
    if own_numel(value):
        # the tensor's own count: the product of its sizes from 1 in axis order, as prod() below makes it
        # (the same expression under named sizes), which torch made and kept with the tensor; prod() redoes
        # it a multiplication a size, each through torch's symbolic wrapper (10-20 us) under named sizes
        return value.numel()
    if hasattr(value, "shape"):
        return prod(value.shape)
    if isinstance(value, list | tuple):
        if any(hasattr(item, "shape") for item in value):
            raise FormulaError("numel() of a tuple of tensors: index it first, e.g. numel(out[0])")
        return prod(value)
    return 0  # None or a Python scalar: no tensor, no elements


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter, FakeTensor)  # types whose numel() is their sizes' product


def own_numel(value: Any) -> bool:
    """Whether numel() of `value` is the tensor's own numel(): the product of its sizes."""
    return type(value) in _PLAIN_TENSORS and value.layout is torch.strided and not value.is_nested


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
    length = unlifted(length)
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
        return functools.reduce(pick, [unlifted(item) for item in items])
    return extreme


def _to_int(value: Any) -> Any:
    """int(), keeping a symbolic size symbolic (rounded toward zero, as int() rounds)."""
    if isinstance(value, torch.SymInt | SizeValue):
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
