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

A mask that depends on data (a padding or document mask passed in) is unknown here, at concrete and
symbolic sizes alike ("mask from data"): the pairs of a concrete mask are `mask_kept_pairs(mask)`.

This module reads an attention call (its mask arguments, or the masks attention written as plain ops
applies) and names what kept the pairs; the band reading and its closed forms are in
`fxflops.rules.mask_bands`, masks counted from their values in `fxflops.rules.mask_values`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fxflops.rules import mask_values  # its MAX_MASK_ELEMENTS read at call time: one limit, wherever it is set
from fxflops.rules.mask_bands import _band, _intersect, _same, band_pairs, causal_pairs
from fxflops.rules.mask_values import _evaluate, _kept, _NotKnowable, _TooLarge, mask_kept_pairs, reads_data
from fxflops.threads import one_thread
from fxflops.rules.mask_values import block_mask_kept_pairs  # noqa: F401 - imported from here (flex_attention capture)

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


# ops in the (batch, seq, heads, dim) layout (the others are (batch, heads, seq, dim)), and the names
# attention ops give their mask argument
SEQ_FIRST = ("aten._flash_attention", "aten._efficient_attention")
MASK_NAMES = ("attn_mask", "attn_bias", "bias")


def attention_grid(op: str, names: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """The (batch, heads, Lq, Lk) grid of (query, key) pairs an attention call scores (ints or SymInts), or
    None where its query and key are not tensors."""
    query, key = names.get("query"), names.get("key")
    if not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor):
        return None
    if op.startswith(SEQ_FIRST):
        return query.shape[0], query.shape[2], query.shape[1], key.shape[1]
    return (*query.shape[:-1], key.shape[-2])


def call_kept_pairs(op: str, names: Mapping[str, Any], nodes: Mapping[str, Any],
                    memo: dict[Any, KeptPairs], symbolic: bool) -> KeptPairs | None:
    """The kept pairs of one attention call, from its bound values (`names`) and the graph nodes
    that gave them (`nodes`, the same names bound to fx Nodes). None: every pair is kept.
    `symbolic`: the sizes are a sweep's, so only closed forms will do."""
    grid = attention_grid(op, names)
    if grid is None:
        return None
    mask_name = next((name for name in MASK_NAMES if isinstance(names.get(name), torch.Tensor)), None)
    if mask_name is None:
        causal = names.get("is_causal") is True or names.get("custom_mask_type") == 1
        if not causal and names.get("custom_mask_type") != 2:
            return None
        # the layers of a decoder share their grid: its pairs are worked out once (under a sweep's sizes each
        # working-out is several operations through torch's symbolic layer)
        key_ = (CAUSAL if causal else "lower right", grid_key(grid))
        if key_ not in memo:
            memo[key_] = _causal_pairs(grid, causal)
        return memo[key_]
    node = nodes.get(mask_name)
    if not isinstance(node, torch.fx.Node):
        return KeptPairs(None, DATA)
    key_ = (node, grid_key(grid))
    if key_ not in memo:
        memo[key_] = _mask_pairs(node, grid, symbolic)
    return memo[key_]


def grid_key(grid: tuple[Any, ...]) -> tuple[Any, ...]:
    """A grid as a memo key: its sizes, a symbolic one by its expression (a SymInt cannot key a dict, and
    printing one, as str() does, costs more than the lookup saves)."""
    return tuple(size.node.expr if isinstance(size, torch.SymInt) else size for size in grid)


def _causal_pairs(grid: tuple[Any, ...], top_left: bool) -> KeptPairs:
    """The pairs of `is_causal` (top left), or of the efficient kernel's causal_lower_right, over `grid`."""
    if top_left:
        return KeptPairs(math.prod(grid[:-2]) * causal_pairs(grid[-2], grid[-1]), CAUSAL)
    # causal_lower_right: torch.ones(Lq, Lk).tril(diagonal=Lk - Lq), the last query sees every key
    lq, lk = grid[-2], grid[-1]
    pattern = CAUSAL if _same(lq, lk) else f"{CAUSAL} (lower right)"
    return KeptPairs(math.prod(grid[:-2]) * band_pairs(lq, lk, None, lk - lq), pattern)


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
        return KeptPairs(None, f"{within}{_unevaluated(node)}")
    with one_thread():
        try:
            mask = _evaluate(node, {})
        except _TooLarge:
            return KeptPairs(None, f"{within}{MASK} (too large to evaluate: over {mask_values.MAX_MASK_ELEMENTS} entries)")
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
    key = (masks, grid_key(grid))
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
        data = next((node for _, node in masks if reads_data(node)), None)
        return KeptPairs(None, _unevaluated(data if data is not None else masks[0][1]))
    kept: torch.Tensor | None = None
    memo: dict[Any, Any] = {}
    with one_thread():
        try:
            for how, node in masks:  # broadcast among themselves only: the grid itself can be huge
                value = kept_entries(how, _evaluate(node, memo))
                kept = value if kept is None else kept & value
                if kept.numel() > mask_values.MAX_MASK_ELEMENTS:
                    raise _TooLarge(node)
        except _TooLarge:
            return KeptPairs(None, f"{MASK} (too large to evaluate: over {mask_values.MAX_MASK_ELEMENTS} entries)")
        except (_NotKnowable, RuntimeError):
            return KeptPairs(None, DATA)
        return KeptPairs(mask_kept_pairs(kept, tuple(int(size) for size in grid)), MASK)


def kept_entries(how: str, value: torch.Tensor) -> torch.Tensor:
    """A mask operand's value as the pairs it keeps (True kept), read as `how` (KEEP | DROP | ADDITIVE)."""
    return ~_kept(value) if how == DROP else _kept(value)


def _unevaluated(node: torch.fx.Node) -> str:
    """What a mask not read as a band is under a sweep's symbolic sizes, where it cannot be evaluated:
    data (effective unknown, as at concrete sizes), or built from sizes alone (known at concrete ones)."""
    return DATA if reads_data(node) else f"{MASK} (not a band of diagonals: counted at concrete sizes only)"


def _band_name(lo: Any, hi: Any) -> str:
    if lo is None and hi == 0:
        return CAUSAL
    if hi == 0 and isinstance(lo, int):
        return f"sliding window {1 - lo}"
    if lo is None and hi is None:
        return FULL
    return f"band {'-inf' if lo is None else lo}..{'inf' if hi is None else hi}"
