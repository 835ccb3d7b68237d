"""What is known of a tensor's values without them: a range, and sizes made from such values at their bound.

A tensor the weights decide has no values in a capture (capture.input_values computes only what the inputs
and constants determine). Some ops still say where its values lie: an index `argmax` picks is below its dim's
size, a boolean is 0 or 1, a sum of n values in [a, b] lies in [n·a, n·b]. A `Bound` follows such values
through the ops that keep them (views, copies, casts, reductions, sums, clamps, arithmetic), so a size made
from them — `bincount`'s bins, `repeat_interleave`'s rows, `unique`'s values, a `.item()` read — is counted at
the largest it can be, and a caution names the bound and the op it comes from. Sizes made with no bound on the
values (`nonzero`: at most every element) are counted at the bound the op's own semantics give.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

_aten = torch.ops.aten


@dataclass(frozen=True)
class Bound:
    """Every value of a tensor lies in [low, high]; `origin` says which op (and module) makes it so."""

    low: int | float
    high: int | float
    origin: str

    def join(self, other: Bound) -> Bound:
        return Bound(min(self.low, other.low), max(self.high, other.high), self.origin or other.origin)

    def words(self) -> str:
        """The bound and where it comes from, for a caution."""
        return f"values in {_number(self.low)}..{_number(self.high)}" + (f", from {self.origin}" if self.origin else "")


BoundOf = Callable[[Any], "Bound | None"]  # a tensor's (or a Python number's) bound, None where none is known


def _number(value: int | float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _dim(args: tuple, kwargs: dict, position: int = 1, name: str = "dim", default: Any = None) -> Any:
    return args[position] if len(args) > position else kwargs.get(name, default)


def _size(tensor: torch.Tensor, dim: Any) -> int:
    """The size an index along `dim` (None: the flattened tensor) is below."""
    return int(tensor.numel()) if dim is None else int(tensor.shape[dim]) if tensor.dim() else 1


def _first(args: tuple, kwargs: dict, out: Any, bound_of: BoundOf, origin: str) -> Bound | None:
    return bound_of(args[0]) if args else None


def _union(values: Sequence[Any], bound_of: BoundOf) -> Bound | None:
    found = [bound_of(value) for value in values]
    if not found or any(bound is None for bound in found):
        return None
    joined = found[0]
    for bound in found[1:]:
        joined = joined.join(bound)
    return joined


def _index_below(args: tuple, kwargs: dict, out: Any, bound_of: BoundOf, origin: str) -> Bound:
    """argmax / argmin: an index below the dim's size (the flattened size without a dim)."""
    size = _size(args[0], _dim(args, kwargs))
    return Bound(0, max(size - 1, 0), f"an index {origin} picks among {size}")


def _sum(args: tuple, kwargs: dict, out: Any, bound_of: BoundOf, origin: str) -> Bound | None:
    bound = bound_of(args[0])
    if bound is None:
        return None
    summed = int(args[0].numel()) // max(int(out.numel()), 1)  # how many values each output adds
    return Bound(summed * bound.low, summed * bound.high, bound.origin)


def _cumsum(args: tuple, kwargs: dict, out: Any, bound_of: BoundOf, origin: str) -> Bound | None:
    bound = bound_of(args[0])
    if bound is None:
        return None
    length = _size(args[0], _dim(args, kwargs))
    return Bound(min(bound.low, length * bound.low), max(bound.high, length * bound.high), bound.origin)


def _count(args: tuple, kwargs: dict, out: Any, bound_of: BoundOf, origin: str) -> Bound | None:
    """How many of n elements something holds: 0..n (count_nonzero per output, bincount's and histc's bins)."""
    if _dim(args, kwargs, 1, "weights") is not None and origin.startswith("aten.bincount"):
        return None  # weighted: sums of the weights, not counts
    counted = int(args[0].numel())
    if origin.startswith("aten.count_nonzero"):
        counted //= max(int(out.numel()), 1)
    return Bound(0, counted, f"a count {origin} makes of {counted} elements")


def _arithmetic(combine: Callable[[float, float], float]) -> Callable[..., Bound | None]:
    """An elementwise op of two values whose extremes are at its operands' extremes (add, sub, mul)."""
    def rule(args: tuple, kwargs: dict, out: Any, bound_of: BoundOf, origin: str) -> Bound | None:
        a, b = bound_of(args[0]), bound_of(args[1]) if len(args) > 1 else None
        if a is None or b is None:
            return None
        alpha = kwargs.get("alpha", 1)
        b = b if alpha == 1 else Bound(*sorted((b.low * alpha, b.high * alpha)), b.origin)
        corners = [combine(x, y) for x in (a.low, a.high) for y in (b.low, b.high)]
        return Bound(min(corners), max(corners), a.origin or b.origin)
    return rule


def _reverse_subtract(args: tuple, kwargs: dict, out: Any, bound_of: BoundOf, origin: str) -> Bound | None:
    """rsub(self, other, alpha) = other - alpha * self: alpha scales the first argument, not the second."""
    a, b = bound_of(args[0]), bound_of(args[1]) if len(args) > 1 else None
    if a is None or b is None:
        return None
    alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
    scaled = sorted((a.low * alpha, a.high * alpha))
    return Bound(b.low - scaled[1], b.high - scaled[0], a.origin or b.origin)


def _clamp(args: tuple, kwargs: dict, out: Any, bound_of: BoundOf, origin: str) -> Bound | None:
    low, high = _dim(args, kwargs, 1, "min"), _dim(args, kwargs, 2, "max")
    if isinstance(low, torch.Tensor) or isinstance(high, torch.Tensor):
        return None
    bound = bound_of(args[0])
    if bound is None:  # clamp bounds what nothing else does (both ends given)
        if low is None or high is None:
            return None
        return Bound(low, high, f"the range {origin} clamps to")
    def clamped(value: int | float) -> int | float:  # clamp is monotonic: the ends go to the ends
        value = value if low is None else max(value, low)
        return value if high is None else min(value, high)

    return Bound(clamped(bound.low), clamped(bound.high), bound.origin)


def _remainder(args: tuple, kwargs: dict, out: Any, bound_of: BoundOf, origin: str) -> Bound | None:
    divisor = bound_of(args[1]) if len(args) > 1 else None
    if divisor is None or divisor.low <= 0:
        return None
    # the output's dtype decides: an int tensor % 2.5 is floating and reaches up to (not at) 2.5
    floating = out.is_floating_point() if isinstance(out, torch.Tensor) else isinstance(divisor.high, float)
    largest = divisor.high if floating else divisor.high - 1
    return Bound(0, largest, f"a remainder {origin} takes")


def _floor_divide(args: tuple, kwargs: dict, out: Any, bound_of: BoundOf, origin: str) -> Bound | None:
    a, b = bound_of(args[0]), bound_of(args[1]) if len(args) > 1 else None
    if a is None or b is None or b.low <= 0:
        return None
    corners = [x // y for x in (a.low, a.high) for y in (b.low, b.high)]
    return Bound(min(corners), max(corners), a.origin)


def _absolute(args: tuple, kwargs: dict, out: Any, bound_of: BoundOf, origin: str) -> Bound | None:
    bound = bound_of(args[0])
    if bound is None:
        return None
    low = 0 if bound.low <= 0 <= bound.high else min(abs(bound.low), abs(bound.high))
    return Bound(low, max(abs(bound.low), abs(bound.high)), bound.origin)


def _negative(args: tuple, kwargs: dict, out: Any, bound_of: BoundOf, origin: str) -> Bound | None:
    bound = bound_of(args[0])
    return None if bound is None else Bound(-bound.high, -bound.low, bound.origin)


def _where(args: tuple, kwargs: dict, out: Any, bound_of: BoundOf, origin: str) -> Bound | None:
    return _union(args[1:3], bound_of)


def _pair(args: tuple, kwargs: dict, out: Any, bound_of: BoundOf, origin: str) -> Bound | None:
    return _union(args[:2], bound_of)


def _concatenated(args: tuple, kwargs: dict, out: Any, bound_of: BoundOf, origin: str) -> Bound | None:
    return _union(list(args[0]), bound_of)


def _filled(args: tuple, kwargs: dict, out: Any, bound_of: BoundOf, origin: str) -> Bound | None:
    return _union([args[0], args[2]], bound_of) if len(args) > 2 else None  # masked_fill(self, mask, value)


# ops whose every output value is one of their first argument's values (views, copies, casts, selections,
# order statistics, reductions to an extreme)
_KEEP_VALUES = ("view", "_unsafe_view", "reshape", "alias", "clone", "_to_copy", "contiguous", "expand", "slice",
                "select", "squeeze", "unsqueeze", "permute", "t", "transpose", "flatten", "unflatten",
                "index_select", "gather", "index", "repeat", "flip", "roll", "narrow", "split", "split_with_sizes",
                "chunk", "unbind", "detach", "lift_fresh", "lift_fresh_copy", "amax", "amin", "max", "min",
                "masked_select", *("_unique2", "_unique", "unique_dim", "unique_consecutive"), "diagonal",
                "as_strided", "mean", "median", "nanmedian", "take", "take_along_dim", "movedim", "expand_copy",
                "view_copy", "permute_copy", "squeeze_copy", "unsqueeze_copy", "slice_copy", "select_copy",
                "aminmax", "cummax", "cummin", "kthvalue", "mode", "sort", "topk")
# of those, ops whose second output is an index along `dim` (sort, topk, and the extremes along a dim)
_INDEX_SECOND = {"max": 1, "min": 1, "sort": 1, "topk": 2, "cummax": 1, "cummin": 1, "kthvalue": 2, "mode": 1,
                 "median": 1, "nanmedian": 1}

# of those, ops whose later outputs are the inverse (an index into the kept values) and the counts
_UNIQUE = frozenset({"_unique2", "_unique", "unique_dim", "unique_consecutive"})

_ELEMENTWISE_EXTREMES = frozenset({"max", "min", "maximum", "minimum", "fmax", "fmin"})

# op (by its name) -> the bound of its outputs given its arguments'
RULES: Mapping[str, Callable[..., Bound | None]] = {
    **{name: _first for name in _KEEP_VALUES},
    "argmax": _index_below, "argmin": _index_below,
    "sum": _sum, "cumsum": _cumsum, "count_nonzero": _count, "bincount": _count, "histc": _count,
    "add": _arithmetic(lambda x, y: x + y), "sub": _arithmetic(lambda x, y: x - y),
    "rsub": _reverse_subtract, "mul": _arithmetic(lambda x, y: x * y),
    "clamp": _clamp, "clip": _clamp, "remainder": _remainder, "floor_divide": _floor_divide,
    "abs": _absolute, "neg": _negative, "where": _where, "cat": _concatenated, "stack": _concatenated,
    "masked_fill": _filled, **{name: _pair for name in ("maximum", "minimum", "fmax", "fmin")},
}
# ops that bound values from nothing known about their arguments' (an index, a count, a clamp)
SOURCES = frozenset({"argmax", "argmin", "count_nonzero", "bincount", "histc", "clamp", "clip", "nonzero",
                     "repeat_interleave", *_INDEX_SECOND, *_UNIQUE})


def output_bounds(func: Any, args: tuple, kwargs: dict, out: Any, bound_of: BoundOf,
                  origin: str) -> list[tuple[torch.Tensor, Bound]]:
    """The bound each tensor `func` made has by its rule, from its arguments' (`bound_of`)."""
    name = func.overloadpacket.__name__
    found: list[tuple[torch.Tensor, Bound]] = []
    if name in _INDEX_SECOND and isinstance(out, tuple | list) and len(out) > 1 and args:
        size = _size(args[0], _dim(args, kwargs, _INDEX_SECOND[name], "dim", -1))
        found.append((out[1], Bound(0, max(size - 1, 0), f"an index {origin} picks among {size}")))
        out = out[0]
    elif name in _UNIQUE and isinstance(out, tuple | list) and len(out) > 1 and args:
        # the values keep the input's bound; the inverse indexes the kept values (at most every element) and a
        # count is at most every element
        numel, values = int(args[0].numel()), bound_of(args[0])
        kept = numel  # an integer input kept by element keeps at most one of each value in its bound
        by_element = name != "unique_dim" and (name != "unique_consecutive" or _dim(args, kwargs, 3, "dim") is None)
        if by_element and values is not None and not args[0].is_floating_point() and not args[0].is_complex():
            kept = min(numel, int(values.high) - int(values.low) + 1)
        found.append((out[1], Bound(0, max(kept - 1, 0), f"an index {origin} gives among {kept} kept values")))
        found.extend((counts, Bound(0, numel, f"a count {origin} makes of {numel} elements")) for counts in out[2:3])
        out = out[0]
    elif name == "nonzero" and isinstance(out, torch.Tensor) and args:
        largest = max((int(s) for s in args[0].shape), default=1)
        found.append((out, Bound(0, largest - 1, f"an index {origin} finds")))
        return found
    elif name == "repeat_interleave" and isinstance(out, torch.Tensor) and args and len(args) == 1:
        found.append((out, Bound(0, max(int(args[0].numel()) - 1, 0), f"an index {origin} repeats")))
        return found
    rule = RULES.get(name)
    if name in _ELEMENTWISE_EXTREMES and len(args) > 1 and isinstance(args[1], torch.Tensor):
        rule = _pair  # max(a, b), minimum(a, b): one of the two at each place
    if rule is None:
        return found
    try:
        bound = rule(args, kwargs, out, bound_of, origin)
    except (TypeError, IndexError, ValueError, ZeroDivisionError, OverflowError, AttributeError):
        # arguments of a shape no rule reads (a Python number where a rule expects a tensor)
        return found
    if bound is not None:
        found.extend((tensor, bound) for tensor in pytree.tree_leaves(out) if isinstance(tensor, torch.Tensor))
    return found


# --- sizes made from values, at their bound --------------------------------------------------------


@dataclass(frozen=True)
class AtBound:
    """An op call shaped at its bound: the call to make instead (the same op with its size given, or
    masks as every index) or the outputs themselves (meta tensors), the size and why it is the bound."""

    size: int | float
    words: str
    call: tuple[Any, tuple, dict] | None = None
    metas: Any = None


@dataclass(frozen=True)
class EveryIndex:
    """Where a call at its bound takes an index tensor of `length` elements (the caller makes it, fake)."""

    length: int
    device: torch.device


def _meta(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def _distinct(source: torch.Tensor, bound: Bound | None) -> tuple[int, str]:
    """How many distinct values `source` holds at most: its elements, or its bound's integers."""
    kept, words = int(source.numel()), "at most every element distinct"
    if bound is not None and not source.is_floating_point() and bound.high - bound.low + 1 < kept:
        kept, words = int(bound.high - bound.low + 1), f"at most one of each value; {bound.words()}"
    return kept, words


def at_bound(func: Any, args: tuple, kwargs: dict, bound_of: BoundOf) -> AtBound | None:
    """`func` (whose output size, or a value read, depends on values nothing gave) at its largest, or None
    where no bound is known."""
    name = func.overloadpacket.__name__
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    source = args[0]
    if name == "nonzero":
        kept = int(source.numel())
        return AtBound(kept, "at most every element nonzero", metas=_meta((kept, source.dim()), torch.int64))
    if name == "masked_select":
        kept = int(torch.broadcast_shapes(source.shape, args[1].shape).numel())
        return AtBound(kept, "at most every element selected", metas=_meta((kept,), source.dtype))
    if name in ("_unique2", "_unique", "unique_consecutive"):
        # (runs of equal values: every element its own run, whatever values it holds)
        kept, words = _distinct(source, bound_of(source) if name != "unique_consecutive" else None)
        inverse = _dim(args, kwargs, 2 if name == "_unique2" else 1, "return_inverse", False)
        counts = _dim(args, kwargs, 3 if name == "_unique2" else 2, "return_counts", False)
        metas = [_meta((kept,), source.dtype), _meta(tuple(source.shape) if inverse else (0,), torch.int64)]
        if name != "_unique":
            metas.append(_meta((kept,) if counts else (0,), torch.int64))
        return AtBound(kept, words, metas=tuple(metas))
    if name == "unique_dim":
        dim = args[1] % source.dim()
        kept = int(source.shape[dim])
        shape = list(source.shape)
        shape[dim] = kept
        inverse, counts = _dim(args, kwargs, 3, "return_inverse", False), _dim(args, kwargs, 4, "return_counts", False)
        return AtBound(kept, f"at most every slice along dim {dim} distinct", metas=(
            _meta(shape, source.dtype), _meta((kept,) if inverse else (0,), torch.int64),
            _meta((kept,) if counts else (0,), torch.int64)))
    if name == "index":  # x[mask]: every element of a boolean mask without values selected
        indices = list(args[1])
        masks = [i for i, index in enumerate(indices) if isinstance(index, torch.Tensor)
                 and index.dtype in (torch.bool, torch.uint8)]
        if len(masks) != 1:
            return None
        mask = indices[masks[0]]
        kept = int(mask.numel())
        # the mask as the integer indices of all its elements, one per dim it spans (made by the caller)
        indices[masks[0]:masks[0] + 1] = [EveryIndex(kept, mask.device)] * mask.dim()
        return AtBound(kept, "at most every element of the mask selected", call=(func, (source, indices), {}))
    bound = bound_of(source)
    if bound is None or not math.isfinite(bound.high):
        return None
    if name == "bincount":
        weights, minlength = _dim(args, kwargs, 1, "weights"), _dim(args, kwargs, 2, "minlength", 0)
        bins = max(int(minlength or 0), int(bound.high) + 1)
        # the output's dtype as the op makes it: int64 counts, float32 weights' sums, any other weights' in float64
        dtype = torch.int64 if weights is None else torch.float32 if weights.dtype == torch.float32 else torch.float64
        return AtBound(bins, f"bins up to its largest value + 1; {bound.words()}", metas=_meta((bins,), dtype))
    if name == "repeat_interleave" and len(args) == 1 and bound.low >= 0:
        rows = int(source.numel()) * int(bound.high)
        return AtBound(rows, f"each of {int(source.numel())} repeats at its largest; {bound.words()}",
                       call=(func, (source,), {**kwargs, "output_size": rows}))
    if name in ("_local_scalar_dense", "item") and source.dtype != torch.bool:
        value = float(bound.high) if source.is_floating_point() else int(bound.high)
        return AtBound(value, f"its largest value; {bound.words()}")
    return None
