"""Kept pairs: how many (query, key) pairs an attention op's mask lets through, read without data.

Dense attention computes every pair of the B.H.Lq.Lk grid; the fused kernels skip what a mask
rules out. What is knowable from the graph alone, this module knows:

- `is_causal=True`: SDPA's top-left aligned lower triangle (query i sees keys 0..i, as
  `torch.ones(Lq, Lk).tril()`), Lq = Lk or not; the efficient kernel's `custom_mask_type=2`
  (`causal_lower_right`) is `tril(diagonal=Lk - Lq)`.
- A mask the model builds from positions: `arange`s, offsets, `unsqueeze`/`expand`, comparisons
  and their `&` (causal, sliding window, transformers' `sdpa_mask`). The mask is read as a band of
  diagonals lo <= key - query <= hi, whose pair count has a closed form in the sizes, so it stays
  exact under a sweep's symbolic sizes.
- Any other mask built without data (no model input or parameter behind it): evaluated on real
  index tensors at the captured sizes and its True entries counted (a packed batch's block
  diagonal from positions); under symbolic sizes this reads as unknown.

A mask built with in-place ops (`triu_`, `add_`, `index_put_`) is unknown: its value depends on when it
is read, which the data flow does not say.

A mask that depends on data (a padding or document mask passed in) is unknown here: the pairs of
a concrete mask are `mask_kept_pairs(mask)`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

aten = torch.ops.aten

MAX_MASK_ELEMENTS = 1 << 24  # a mask evaluated on real index tensors: at most this many entries per value (16 Mi)

FULL = "full"  # no mask: every pair kept
CAUSAL = "causal"
MASK = "mask"  # a mask built without data that is not a band of diagonals
DATA = "mask from data"  # the kept pairs depend on tensor values the capture does not have


@dataclass(frozen=True)
class KeptPairs:
    """The pairs an attention call keeps over its B.H.Lq.Lk grid (None: not knowable without data),
    and what kept them, as reports name it ("causal", "sliding window 4096", "mask", ...)."""

    pairs: Any
    pattern: str


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


def mask_kept_pairs(mask: torch.Tensor, shape: tuple[int, ...] | None = None) -> int:
    """The (query, key) pairs a concrete attention mask keeps, broadcast to `shape` (B, H, Lq, Lk;
    default the mask's own): True entries of a boolean mask, entries above the dtype's lowest value
    (not -inf, not finfo.min) of an additive float mask."""
    kept = _kept(mask)
    shape = tuple(shape) if shape is not None else tuple(kept.shape)
    expanded = (1,) * (len(shape) - kept.ndim) + tuple(kept.shape)
    if len(expanded) != len(shape) or any(e not in (1, s) for e, s in zip(expanded, shape)):
        raise ValueError(f"a mask of shape {tuple(mask.shape)} does not broadcast to the attention grid {shape}")
    repeat = math.prod(s for e, s in zip(expanded, shape) if e == 1 and s != 1)
    return int(kept.sum()) * repeat


def block_mask_kept_pairs(block_mask: Any, shape: tuple[int, ...] | None = None) -> int:
    """The (query, key) pairs flex_attention computes under a BlockMask: its kept blocks (partial and
    full, as the mask's own kv_num_blocks and full_kv_num_blocks count them) x the block size, each
    block whole, as the kernels compute it; broadcast to `shape` (B, H, Lq, Lk) where the mask's batch
    or heads are 1. The counts are the mask function's at the mask's sizes, not data."""
    blocks = block_mask.kv_num_blocks.sum(dtype=torch.int64)
    if block_mask.full_kv_num_blocks is not None:
        blocks = blocks + block_mask.full_kv_num_blocks.sum(dtype=torch.int64)
    q_block, kv_block = block_mask.BLOCK_SIZE
    batch, heads = tuple(block_mask.kv_num_blocks.shape[:2])
    repeat = 1
    if shape is not None:
        for own, wanted in ((batch, shape[0]), (heads, shape[1])):
            if own not in (1, wanted):
                raise ValueError(f"a BlockMask of batch x heads {batch} x {heads} does not broadcast to {shape}")
            repeat *= wanted if own == 1 else 1
    return int(blocks) * q_block * kv_block * repeat


def _kept(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        return mask > torch.finfo(mask.dtype).min
    return mask != 0


# --- reading an attention call -------------------------------------------------------------------

# ops in the (batch, seq, heads, dim) layout; the others are (batch, heads, seq, dim)
_SEQ_FIRST = ("aten._flash_attention", "aten._efficient_attention")
_MASK_NAMES = ("attn_mask", "attn_bias", "bias")


def call_kept_pairs(op: str, names: Mapping[str, Any], nodes: Mapping[str, Any],
                    memo: dict[Any, KeptPairs], symbolic: bool) -> KeptPairs | None:
    """The kept pairs of one attention call, from its bound values (`names`) and the graph nodes
    that gave them (`nodes`, the same names bound to fx Nodes). None: every pair is kept.
    `symbolic`: the sizes are a sweep's, so only closed forms will do."""
    query, key = names.get("query"), names.get("key")
    if not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor):
        return None
    if op.startswith(_SEQ_FIRST):
        grid = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
    else:
        grid = (*query.shape[:-1], key.shape[-2])
    mask_name = next((name for name in _MASK_NAMES if isinstance(names.get(name), torch.Tensor)), None)
    if mask_name is None:
        if names.get("is_causal") is True or names.get("custom_mask_type") == 1:
            return KeptPairs(math.prod(grid[:-2]) * causal_pairs(grid[-2], grid[-1]), CAUSAL)
        if names.get("custom_mask_type") == 2:
            # causal_lower_right: torch.ones(Lq, Lk).tril(diagonal=Lk - Lq), the last query sees every key
            lq, lk = grid[-2], grid[-1]
            pattern = CAUSAL if _same(lq, lk) else f"{CAUSAL} (lower right)"
            return KeptPairs(math.prod(grid[:-2]) * band_pairs(lq, lk, None, lk - lq), pattern)
        return None
    node = nodes.get(mask_name)
    if not isinstance(node, torch.fx.Node):
        return KeptPairs(None, DATA)
    key_ = (node, tuple(str(size) for size in grid))
    if key_ not in memo:
        memo[key_] = _mask_pairs(node, grid, symbolic)
    return memo[key_]


def _mask_pairs(node: torch.fx.Node, grid: tuple[Any, ...], symbolic: bool) -> KeptPairs:
    if _changed_in_place(node):
        # the graph's data flow no longer says what the mask holds when the attention reads it
        return KeptPairs(None, f"{DATA} (built with in-place ops)")
    band = _band(node, grid)
    if band is not None and not band[2]:
        lo, hi, _ = band
        return KeptPairs(math.prod(grid[:-2]) * band_pairs(grid[-2], grid[-1], lo, hi), _band_name(lo, hi))
    # a band and'ed with something else: the band's name says what is known of it
    within = f"{_band_name(*band[:2])} & " if band is not None else ""
    if symbolic:
        return KeptPairs(None, f"{within}{MASK} (not a band of diagonals: counted at concrete sizes only)")
    try:
        mask = _evaluate(node, {})
    except _TooLarge:
        return KeptPairs(None, f"{within}{MASK} (too large to evaluate: over {MAX_MASK_ELEMENTS} entries)")
    except _NotKnowable:
        return KeptPairs(None, f"{within}{DATA}")
    return KeptPairs(mask_kept_pairs(mask, tuple(int(size) for size in grid)), MASK)


def _changed_in_place(node: torch.fx.Node) -> bool:
    """Whether an op that writes its input (`triu_`, `add_`, `index_put_`, an out= variant) writes
    anything the mask is built from, or a view of it: its value then depends on when it is read."""
    built_from, stack = set(), [node]
    while stack:  # the mask's ancestors
        current = stack.pop()
        if current not in built_from:
            built_from.add(current)
            stack.extend(current.all_input_nodes)
    stack = list(built_from)
    while stack:  # and their views, which share their storage
        for user in stack.pop().users:
            if user not in built_from and _is_view(user):
                built_from.add(user)
                stack.append(user)
    return any(_writes(user) for current in built_from for user in current.users)


def _schema(node: torch.fx.Node) -> Any:
    target = node.target
    return target._schema if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) else None


def _is_view(node: torch.fx.Node) -> bool:
    schema = _schema(node)
    return schema is not None and any(ret.alias_info is not None for ret in schema.returns)


def _writes(node: torch.fx.Node) -> bool:
    schema = _schema(node)
    return schema is not None and schema.is_mutable


KEEP, DROP, ADDITIVE = "keep", "drop", "additive"  # how a mask operand reads: True kept, True dropped, added


def masks_kept_pairs(masks: tuple[tuple[str, torch.fx.Node], ...], grid: tuple[Any, ...],
                     memo: dict[Any, KeptPairs], symbolic: bool) -> KeptPairs:
    """The pairs kept by all of `masks` (each (KEEP | DROP | ADDITIVE, node)) over `grid` (B, H, Lq, Lk):
    attention written as plain ops, whose scores a mask is added to, filled by or selected with."""
    key = (masks, tuple(str(size) for size in grid))
    if key not in memo:
        memo[key] = _masks_pairs(masks, grid, symbolic)
    return memo[key]


def _masks_pairs(masks: tuple[tuple[str, torch.fx.Node], ...], grid: tuple[Any, ...], symbolic: bool) -> KeptPairs:
    if len(masks) == 1 and masks[0][0] == KEEP:
        return _mask_pairs(masks[0][1], grid, symbolic)
    if any(_changed_in_place(node) for _, node in masks):
        return KeptPairs(None, f"{DATA} (built with in-place ops)")
    bands = [_band(node, grid) for how, node in masks if how == KEEP]
    if len(bands) == len(masks) and all(band is not None and not band[2] for band in bands):
        lo, hi = _intersect(bands)
        return KeptPairs(math.prod(grid[:-2]) * band_pairs(grid[-2], grid[-1], lo, hi), _band_name(lo, hi))
    if symbolic:
        return KeptPairs(None, f"{MASK} (not a band of diagonals: counted at concrete sizes only)")
    kept: torch.Tensor | None = None
    memo: dict[Any, Any] = {}
    try:
        for how, node in masks:  # broadcast among themselves only: the grid itself can be huge
            value = _evaluate(node, memo)
            value = ~value if how == DROP else _kept(value)
            kept = value if kept is None else kept & value
            if kept.numel() > MAX_MASK_ELEMENTS:
                raise _TooLarge(node)
    except _TooLarge:
        return KeptPairs(None, f"{MASK} (too large to evaluate: over {MAX_MASK_ELEMENTS} entries)")
    except (_NotKnowable, RuntimeError):
        return KeptPairs(None, DATA)
    return KeptPairs(mask_kept_pairs(kept, tuple(int(size) for size in grid)), MASK)


def _intersect(bands: list[Any]) -> tuple[Any, Any]:
    lo = hi = None
    for band_lo, band_hi, _ in bands:
        if band_lo is not None:
            lo = band_lo if lo is None else torch.sym_max(lo, band_lo)
        if band_hi is not None:
            hi = band_hi if hi is None else torch.sym_min(hi, band_hi)
    return lo, hi


def _band_name(lo: Any, hi: Any) -> str:
    if lo is None and hi == 0:
        return CAUSAL
    if hi == 0 and isinstance(lo, int):
        return f"sliding window {1 - lo}"
    if lo is None and hi is None:
        return FULL
    return f"band {'-inf' if lo is None else lo}..{'inf' if hi is None else hi}"


# --- masks as bands of diagonals ------------------------------------------------------------------
#
# A small abstract interpreter: an integer index tensor is an affine form c + sum(coef[d] * index along
# dim d), dims counted from the right so broadcasting lines them up; a boolean one is a conjunction of
# atoms "form >= 0". Anything else (an input, a gather, an `|`) ends the reading.


class _NotAffine(Exception):
    pass


@dataclass(frozen=True)
class _Affine:
    ndim: int
    coefs: tuple[tuple[int, Any], ...]  # (dim from the right, -1 = last; coefficient)
    const: Any


@dataclass(frozen=True)
class _Pred:
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


# --- masks evaluated on real index tensors --------------------------------------------------------


class _NotKnowable(Exception):
    pass


class _TooLarge(_NotKnowable):
    pass


# ops whose result reads only their inputs' shapes and dtypes, never their values
_SHAPE_ONLY = {aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.ones_like.default,
               aten.zeros_like.default, aten.full_like.default, aten.new_empty.default}
_UNDEFINED = {aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default, aten.empty_strided.default,
              aten.new_empty_strided.default}  # values no one can know


def _evaluate(node: Any, memo: dict[Any, Any]) -> Any:
    """The node's value computed on real CPU tensors; _NotKnowable when it needs data."""
    if isinstance(node, torch.fx.Node):
        if node not in memo:
            memo[node] = _evaluate_node(node, memo)
        return memo[node]
    if isinstance(node, list | tuple):
        return type(node)(_evaluate(item, memo) for item in node)
    if isinstance(node, torch.SymInt | torch.SymFloat | torch.SymBool):
        raise _NotKnowable(node)
    if isinstance(node, torch.device):
        return torch.device("cpu")
    if isinstance(node, torch.Tensor):
        raise _NotKnowable(node)
    return node


def _evaluate_node(node: torch.fx.Node, memo: dict[Any, Any]) -> Any:
    val = node.meta.get("val")
    if node.op != "call_function" or not callable(node.target):
        raise _NotKnowable(node)
    if isinstance(val, torch.Tensor) and math.prod(int(s) for s in val.shape) > MAX_MASK_ELEMENTS:
        raise _TooLarge(node)
    if node.target in _UNDEFINED or node.target is operator.getitem:
        raise _NotKnowable(node)
    if isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags:
        raise _NotKnowable(node)
    if node.target in _SHAPE_ONLY:
        args = tuple(_placeholder_like(arg) if isinstance(arg, torch.fx.Node) else _evaluate(arg, memo) for arg in node.args)
    else:
        args = _evaluate(node.args, memo)
    kwargs = {name: _evaluate(value, memo) for name, value in node.kwargs.items()}
    try:
        return node.target(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - whatever stops it, the mask is not known
        raise _NotKnowable(node) from error


def _placeholder_like(node: torch.fx.Node) -> torch.Tensor:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise _NotKnowable(node)
    return torch.zeros(tuple(int(s) for s in val.shape), dtype=val.dtype)
