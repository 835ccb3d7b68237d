"""Masks read as bands of diagonals, and the pairs a band keeps in closed form.

A mask built from positions (`arange`s, offsets, `unsqueeze`/`expand`, comparisons and their `&`:
causal, sliding window, transformers' `sdpa_mask`) is read, without evaluating it, as the band
lo <= key - query <= hi. The pairs a band keeps over Lq queries and Lk keys have a closed form in
the sizes, so the count stays exact under a sweep's symbolic sizes (`band_pairs`, `causal_pairs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

aten = torch.ops.aten


def causal_pairs(lq: Any, lk: Any) -> Any:
    """Pairs of a top-left causal mask over Lq queries and Lk keys: sum over i < Lq of min(i + 1, Lk)."""
    return band_pairs(lq, lk, None, 0)


def band_pairs(lq: Any, lk: Any, lo: Any, hi: Any) -> Any:
    """(query i, key j) pairs with lo <= j - i <= hi, 0 <= i < Lq, 0 <= j < Lk; None = unbounded.

    Ints or SymInts (then a symbolic count, exact at every size)."""
    if hi == 0 and (lo is None or isinstance(lo, int) and lo <= 0) and _same(lq, lk):
        # square causal or sliding-window (W = 1 - lo keys): the short forms, readable as sweep formulas
        if lo is None:
            return lq * (lq + 1) // 2
        window = 1 - lo
        short = torch.sym_min(lq, window)  # rows before the window fills
        return short * (short + 1) // 2 + (lq - short) * window
    upper = _pairs_at_most(lq, lk, hi) if hi is not None else lq * lk
    if lo is None:
        return upper
    # an empty band (lo > hi) would come out negative
    return torch.sym_max(upper - _pairs_at_most(lq, lk, lo - 1), 0) if hi is not None else upper - _pairs_at_most(lq, lk, lo - 1)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt) and str(a.node.expr) == str(b.node.expr)


def _pairs_at_most(n: Any, m: Any, h: Any) -> Any:
    """Pairs with j - i <= h: the sum over i < n of clamp(i + h + 1, 0, m), in closed form."""
    c = h + 1
    first = _clamp(1 - c, 0, n)  # rows before it keep no key
    last = _clamp(m - c, first, n)  # rows from it on keep all m keys
    middle = last - first  # rows keeping i + c keys
    return (n - last) * m + middle * (first + c) + middle * (middle - 1) // 2


def _clamp(value: Any, low: Any, high: Any) -> Any:
    return torch.sym_min(torch.sym_max(value, low), high)


def _intersect(bands: list[Any]) -> tuple[Any, Any]:
    lo = hi = None
    for band_lo, band_hi, _ in bands:
        if band_lo is not None:
            lo = band_lo if lo is None else torch.sym_max(lo, band_lo)
        if band_hi is not None:
            hi = band_hi if hi is None else torch.sym_min(hi, band_hi)
    return lo, hi


# --- masks as bands of diagonals ------------------------------------------------------------------
#
# A small abstract interpreter: an integer index tensor is an affine form c + sum(coef[d] * index along
# dim d), dims counted from the right so broadcasting lines them up; a boolean one is a conjunction of
# atoms "form >= 0". Anything else (an input, a gather, an `|`) ends the reading.


class _NotAffine(Exception):
    pass


@dataclass(frozen=True)
class _Affine:
    """An affine form over a grid's indices: sum of coefficient x index, plus a constant."""

    ndim: int
    coefs: tuple[tuple[int, Any], ...]  # (dim from the right, -1 = last; coefficient)
    const: Any


@dataclass(frozen=True)
class _Pred:
    """A conjunction of affine forms, each >= 0, over a grid's indices."""

    ndim: int
    atoms: tuple[_Affine, ...]  # all hold: each form >= 0 (True when empty)
    partial: bool = False  # and'ed with something not read here (a mask from data): the atoms bound it


def _band(node: torch.fx.Node, grid: tuple[Any, ...]) -> tuple[Any, Any, bool] | None:
    """(lo, hi, partial) with the mask keeping exactly lo <= key - query <= hi (partial: only pairs
    within it, and'ed with a mask from data), or None when it is not read so."""
    try:
        value = _abstract(node, {})
    except (_NotAffine, TypeError, ValueError, IndexError):
        return None
    shape = getattr(node.meta.get("val"), "shape", None)
    if not isinstance(value, _Pred) or shape is None or len(shape) > len(grid):
        return None
    if any(atom.coefs for atom in value.atoms) and (len(shape) < 2 or str(shape[-2]) != str(grid[-2])
                                                     or str(shape[-1]) != str(grid[-1])):
        return None  # positions along a broadcast axis: not the grid's
    lo = hi = None
    for atom in value.atoms:
        coefs = {dim: coef for dim, coef in atom.coefs if not (isinstance(coef, int) and coef == 0)}
        if not coefs:  # the same for every pair: always true (dropped) or never (nothing kept)
            if not isinstance(atom.const, int):
                return None
            if atom.const >= 0:
                continue
            return 1, 0, value.partial
        if set(coefs) - {-1, -2}:
            return None
        q, k = coefs.get(-2, 0), coefs.get(-1, 0)
        if not (isinstance(q, int) and isinstance(k, int)) or q != -k or k not in (1, -1):
            return None  # only constraints on key - query
        if k == 1:  # (j - i) + c >= 0: j - i >= -c
            lo = -atom.const if lo is None else torch.sym_max(lo, -atom.const)
        else:  # c - (j - i) >= 0: j - i <= c
            hi = atom.const if hi is None else torch.sym_min(hi, atom.const)
    return lo, hi, value.partial


def _abstract(node: Any, memo: dict[Any, Any]) -> Any:
    if not isinstance(node, torch.fx.Node):
        if isinstance(node, bool):
            return node
        if isinstance(node, int | torch.SymInt):
            return node
        raise _NotAffine(node)
    if node in memo:
        return memo[node]
    value = _abstract_op(node, memo)
    memo[node] = value
    return value


_SAME = {aten.detach.default, aten.clone.default, aten.alias.default, aten.contiguous.default, aten.lift_fresh.default,
         aten.to.device, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.to.other}
_ARANGE = {aten.arange.default, aten.arange.start, aten.arange.start_step}
_COMPARE = {aten.ge.Tensor: "ge", aten.ge.Scalar: "ge", aten.gt.Tensor: "gt", aten.gt.Scalar: "gt",
            aten.le.Tensor: "le", aten.le.Scalar: "le", aten.lt.Tensor: "lt", aten.lt.Scalar: "lt"}
_AND = {aten.bitwise_and.Tensor, aten.logical_and.default, aten.__and__.Tensor}
_ONES = {aten.new_ones.default, aten.ones.default, aten.ones_like.default}
_EQUAL = {aten.eq.Tensor: True, aten.eq.Scalar: True, aten.ne.Tensor: False, aten.ne.Scalar: False}


def _abstract_op(node: torch.fx.Node, memo: dict[Any, Any]) -> Any:
    if node.op != "call_function":
        raise _NotAffine(node)
    target, args = node.target, node.args
    val = node.meta.get("val")
    ndim = val.ndim if isinstance(val, torch.Tensor) else 0
    if target in _ARANGE:
        start, end, step = _arange_args(args)
        if not isinstance(step, int):
            raise _NotAffine(node)
        del end
        return _Affine(1, ((-1, step),), start)
    if target in _SAME:
        value = _abstract(args[0], memo)
        if isinstance(value, _Pred) and val is not None and val.dtype != torch.bool:
            raise _NotAffine(node)  # a boolean mask turned into numbers is not read as one
        return value
    if target in _ONES and val is not None and val.dtype == torch.bool:
        return _Pred(ndim, ())
    if target is aten.unsqueeze.default:
        return _unsqueeze(_abstract(args[0], memo), args[1])
    if target is aten.slice.Tensor:
        return _slice(_abstract(args[0], memo), *args[1:])
    if target is aten.expand.default:
        return _widen(_abstract(args[0], memo), ndim, getattr(args[0].meta.get("val"), "shape", None))
    if target in (aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar):
        alpha = node.kwargs.get("alpha", 1)
        sign = 1 if target in (aten.add.Tensor, aten.add.Scalar) else -1
        return _combine(_abstract(args[0], memo), _abstract(args[1], memo), sign * alpha, ndim)
    if target in _COMPARE:
        return _compare(_COMPARE[target], _abstract(args[0], memo), _abstract(args[1], memo), ndim)
    if target is aten.diff.default:
        return _diff(node, memo, ndim)
    if target is aten.cumsum.default:
        return _cumsum(_abstract(args[0], memo), args[1] if len(args) > 1 else node.kwargs["dim"], ndim)
    if target is aten.index.Tensor:
        return _index(_abstract(args[0], memo), [None if i is None else _abstract(i, memo) for i in args[1]], ndim)
    if target in _EQUAL:
        return _equal(_EQUAL[target], _abstract(args[0], memo), _abstract(args[1], memo), ndim)
    if target in _AND:
        left, right = _readable(args[0], memo), _readable(args[1], memo)
        if not (isinstance(left, _Pred) or isinstance(right, _Pred)):
            raise _NotAffine(node)
        if left is None or right is None:  # one side is data: what the other keeps bounds the mask
            return _Pred(ndim, (left or right).atoms, partial=True)
        if not (isinstance(left, _Pred) and isinstance(right, _Pred)):
            raise _NotAffine(node)
        return _Pred(ndim, left.atoms + right.atoms, left.partial or right.partial)
    raise _NotAffine(node)


def _axis(dim: int, ndim: int) -> int:
    """A dim counted from the right, as forms count them."""
    return dim if dim < 0 else dim - ndim


def _without(form: _Affine, axis: int) -> _Affine:
    """The form at index 0 along `axis` (its coefficient there gone)."""
    return _Affine(form.ndim, tuple((d, c) for d, c in form.coefs if d != axis), form.const)


def _constant(form: _Affine) -> Any:
    """The form's value if it is the same everywhere (no index with a nonzero coefficient), else None;
    a size expression that simplifies to a number (s - (s - 1)) is that number."""
    if any(not (isinstance(c, int) and c == 0) for _, c in form.coefs):
        return None
    const = form.const
    if isinstance(const, torch.SymInt):
        known = const.node.maybe_as_int()
        return known if known is not None else const
    return const


def _truth(ndim: int, holds: bool) -> _Pred:
    return _Pred(ndim, () if holds else (_Affine(ndim, (), -1),))


def _diff(node: torch.fx.Node, memo: dict[Any, Any], ndim: int) -> _Affine:
    """torch.diff of an affine form along a dim: its coefficient there, everywhere — with a `prepend`
    only where the first difference (first value - prepend) is that coefficient too (transformers'
    packed-sequence test: position ids that step by 1 from a prepend of the first minus 1)."""
    args, kwargs = node.args, node.kwargs
    n, dim = (args[1] if len(args) > 1 else kwargs.get("n", 1)), (args[2] if len(args) > 2 else kwargs.get("dim", -1))
    prepend = args[3] if len(args) > 3 else kwargs.get("prepend")
    append = args[4] if len(args) > 4 else kwargs.get("append")
    value = _abstract(args[0], memo)
    if n != 1 or append is not None or not isinstance(value, _Affine):
        raise _NotAffine(node)
    axis = _axis(dim, value.ndim)
    step = dict(value.coefs).get(axis, 0)
    if prepend is not None:
        first = _combine(_without(value, axis), _without(_form(_abstract(prepend, memo), value.ndim), axis), -1,
                         value.ndim)
        if not (isinstance(_constant(first), int) and isinstance(step, int) and _constant(first) == step):
            raise _NotAffine(node)
    return _Affine(ndim, (), step)


def _cumsum(value: Any, dim: int, ndim: int) -> _Affine:
    """The running sum of a value that is the same everywhere (a constant flag or number) v: v(k + 1)."""
    if isinstance(value, _Pred):
        consts = [_constant(atom) for atom in value.atoms]
        if value.partial or not all(isinstance(c, int) for c in consts):
            raise _NotAffine(value)
        constant: Any = int(all(c >= 0 for c in consts))
    elif isinstance(value, _Affine) and isinstance(_constant(value), int):
        constant = _constant(value)
    else:
        raise _NotAffine(value)
    return _Affine(ndim, ((_axis(dim, ndim), constant),) if constant else (), constant)


def _index(value: Any, indices: list[Any], ndim: int) -> _Affine:
    """value[i0, i1, ...] with an index tensor for every dim: the form composed with the indices'."""
    if not isinstance(value, _Affine) or len(indices) != value.ndim or any(i is None for i in indices):
        raise _NotAffine(value)
    if not all(_never_negative(index) for index in indices):
        raise _NotAffine(indices)  # a negative index counts from the end: not the form's value there
    coefs = dict(value.coefs)
    found = _Affine(ndim, (), value.const)
    for position, index in enumerate(indices):
        coef = coefs.get(position - value.ndim, 0)
        if not (isinstance(coef, int) and coef == 0):
            found = _combine(found, index, coef, ndim)
    return found


def _never_negative(index: Any) -> bool:
    """Whether an index form is >= 0 at every position (positions count from 0)."""
    form = _form(index, 0)
    return isinstance(form.const, int) and form.const >= 0 and all(isinstance(c, int) and c >= 0 for _, c in form.coefs)


def _equal(equal: bool, left: Any, right: Any, ndim: int) -> _Pred:
    """a == b as the two atoms a - b >= 0 and b - a >= 0; a != b only where it is the same everywhere."""
    if isinstance(left, _Pred) or isinstance(right, _Pred):
        raise _NotAffine(left)
    difference = _combine(left, right, -1, ndim)
    constant = _constant(difference)
    if isinstance(constant, int):
        return _truth(ndim, (constant == 0) == equal)
    if not equal:
        raise _NotAffine(difference)
    return _Pred(ndim, (difference, _combine(0, difference, -1, ndim)))


def _readable(node: Any, memo: dict[Any, Any]) -> Any:
    """The node's abstract value, or None where it is not read (data, or ops this reading lacks)."""
    try:
        return _abstract(node, memo)
    except _NotAffine:
        return None


def _arange_args(args: tuple) -> tuple[Any, Any, Any]:
    if len(args) == 1:
        return 0, args[0], 1
    if len(args) == 2:
        return args[0], args[1], 1
    return args[0], args[1], args[2]


def _unsqueeze(value: Any, dim: int) -> Any:
    if not isinstance(value, _Affine | _Pred):
        raise _NotAffine(value)
    new = value.ndim + 1
    position = dim if dim >= 0 else dim + new
    inserted = position - new  # the new dim, from the right

    def move(form: _Affine) -> _Affine:
        coefs = tuple((d - 1 if d <= inserted else d, c) for d, c in form.coefs)  # dims left of it move left
        return _Affine(new, coefs, form.const)

    if isinstance(value, _Affine):
        return move(value)
    return _Pred(new, tuple(move(atom) for atom in value.atoms), value.partial)


def _slice(value: Any, dim: int = 0, start: Any = None, end: Any = None, step: int = 1) -> Any:
    """x[start::step] along `dim`: index k there reads position start + step * k."""
    del end  # where it stops is the output's shape, not its values
    if not isinstance(value, _Affine | _Pred):
        raise _NotAffine(value)
    axis = (dim if dim < 0 else dim - value.ndim)
    start = start or 0
    if isinstance(start, int) and start < 0:
        raise _NotAffine(start)  # counted from the end: needs the size

    def moved(form: _Affine) -> _Affine:
        coefs = dict(form.coefs)
        coef = coefs.get(axis, 0)
        if isinstance(coef, int) and coef == 0:
            return form
        coefs[axis] = coef * step
        return _Affine(form.ndim, tuple(sorted(coefs.items())), form.const + coef * start)

    if isinstance(value, _Affine):
        return moved(value)
    return _Pred(value.ndim, tuple(moved(atom) for atom in value.atoms), value.partial)


def _widen(value: Any, ndim: int, shape: Any = None) -> Any:
    """`value` expanded to `ndim` dims; an axis of size 1 in its input `shape` is repeated, so its
    only position, 0, is read everywhere along it: its coefficient goes."""
    if shape is None:
        raise _NotAffine(value)

    def repeated(form: _Affine) -> _Affine:
        coefs = tuple((d, c) for d, c in form.coefs if -d > len(shape) or str(shape[d]) != "1")
        return _Affine(max(ndim, form.ndim), coefs, form.const)

    if isinstance(value, _Affine):
        return repeated(value)
    if isinstance(value, _Pred):
        return _Pred(max(ndim, value.ndim), tuple(repeated(atom) for atom in value.atoms), value.partial)
    raise _NotAffine(value)


def _form(value: Any, ndim: int) -> _Affine:
    if isinstance(value, _Affine):
        return value
    if isinstance(value, int | torch.SymInt) and not isinstance(value, bool):
        return _Affine(ndim, (), value)
    raise _NotAffine(value)


def _combine(left: Any, right: Any, scale: Any, ndim: int) -> _Affine:
    """left + scale * right, for affine forms or integers."""
    a, b = _form(left, ndim), _form(right, ndim)
    coefs = dict(a.coefs)
    for dim, coef in b.coefs:
        coefs[dim] = coefs.get(dim, 0) + scale * coef
    return _Affine(ndim, tuple(sorted(coefs.items())), a.const + scale * b.const)


def _compare(how: str, left: Any, right: Any, ndim: int) -> _Pred:
    if isinstance(left, _Pred) or isinstance(right, _Pred):
        raise _NotAffine(how)
    difference = _combine(left, right, -1, ndim)  # left - right
    if how in ("le", "lt"):
        difference = _combine(0, difference, -1, ndim)  # right - left
    if how in ("gt", "lt"):  # integers: x > 0 is x - 1 >= 0
        difference = _Affine(ndim, difference.coefs, difference.const - 1)
    return _Pred(ndim, (difference,))
