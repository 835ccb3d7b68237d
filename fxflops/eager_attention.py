"""Eager attention: attention written as plain ops, found in a captured graph and read both ways.

transformers' "eager" attention (and models without SDPA support, Gemma 2 in this version) computes
scores = q @ k^T * scale (+ mask, or masked_fill / where with a mask), softmax, (dropout), probs @ v;
nn.MultiheadAttention with need_weights runs mask + q @ k^T as one baddbmm.
This module recognises that pattern: a softmax over the last dim whose input is a scaled / masked /
soft-capped batched matmul with the same (Lq, Lk) last dims, and whose output (through casts and
dropout) is the first operand of another matmul. The masks it met on the way are read as SDPA's
attn_mask is (kept_pairs: bands of diagonals in closed form, other position masks evaluated, data
unknown), and both matmuls, with the backward products that differentiate them, get an effective
reading: dense x kept pairs / (the scores' numel), exact in integers since each pair costs the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from fxflops.capture.input_values import scalar_constant
from fxflops.rules.kept_pairs import ADDITIVE, DROP, FULL, KEEP, MASK, KeptPairs, masks_kept_pairs

aten = torch.ops.aten

_MATMULS = {aten.matmul.default, aten.bmm.default}
_GRAD_MATMULS = _MATMULS | {aten.mm.default, aten.baddbmm.default}  # what a matmul's backward runs its products as
# (a tuple: asked of every node, and an OpOverload's hash, which a set would ask, is Python code; a tuple compares
# by identity)
_SOFTMAX = (aten._softmax.default, aten.softmax.int, aten._safe_softmax.default)
# ops that keep every score where it is (casts, copies, the soft-capping tanh)
_SAME = {aten.detach.default, aten.clone.default, aten.alias.default, aten.contiguous.default, aten.tanh.default,
         aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten.to.other, aten._to_copy.default,
         aten.lift_fresh.default, aten.dropout.default}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_SCALE = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}
_NOT = {aten.bitwise_not.default, aten.logical_not.default}
_WHERE = {aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar}
_FILL = {aten.masked_fill.Scalar, aten.masked_fill_.Scalar}
_ZEROS = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default, aten.scalar_tensor.default}


@dataclass(frozen=True)
class EagerAttention:
    """One attention written as plain ops: its two matmuls, the scores' shape (the B.H.Lq.Lk grid), the
    masks applied to them (each (KEEP | DROP | ADDITIVE, node), as plainly as it reads) and the pairs
    they keep."""

    scores: str  # the q @ k^T node
    output: str  # the probs @ v node
    shape: tuple[Any, ...]  # the scores' shape: ints, or SymInts under a sweep
    kept: KeptPairs
    masks: tuple[tuple[str, torch.fx.Node], ...] = ()

    @property
    def grid(self) -> Any:
        """The scores' numel: every pair."""
        return math.prod(self.shape)


class _NotAttention(Exception):
    pass


def find_eager_attention(nodes: Iterable[torch.fx.Node], memo: dict[Any, KeptPairs],
                         symbolic: bool) -> dict[str, EagerAttention]:
    """Each forward matmul of an eager attention, by node name. `symbolic`: a sweep's sizes."""
    found: dict[str, EagerAttention] = {}
    for node in nodes:
        if node.op != "call_function" or node.target not in _SOFTMAX:
            continue
        try:
            attention = _read(node, memo, symbolic)
        except (_NotAttention, IndexError, KeyError, AttributeError, TypeError):
            continue  # a softmax this reading does not follow is counted as it always was: dense
        found[attention.scores] = found[attention.output] = attention
    return found


def attention_of(node: torch.fx.Node, found: dict[str, EagerAttention],
                 differentiates: str | None) -> EagerAttention | None:
    """The eager attention whose matmul `node` is, or whose matmul its backward product differentiates."""
    if node.name in found:
        return found[node.name]
    if differentiates in found and node.target in _GRAD_MATMULS:
        return found[differentiates]
    return None


def effective_count(dense: Any, pairs: Any, grid: Any, sizes: Any) -> Any:
    """dense x pairs / grid: an int (floored; exact for products, whose dense count is per-pair work x
    grid), or under a sweep's `sizes` a sympy expression in the user's names."""
    if sizes is None:
        return int(dense) * int(pairs) // int(grid)
    import sympy

    pairs, grid = sympy.sympify(sizes.expression(pairs)), sympy.sympify(sizes.expression(grid))
    per_pair = sympy.cancel(sympy.sympify(dense) / grid)
    if per_pair.is_polynomial() and sympy.fraction(sympy.together(per_pair))[1] == 1:
        return sympy.expand(per_pair * pairs) if not pairs.has(sympy.Min, sympy.Max) else per_pair * pairs
    return sympy.floor(sympy.sympify(dense) * pairs / grid)


def _read(softmax: torch.fx.Node, memo: dict[Any, KeptPairs], symbolic: bool) -> EagerAttention:
    scores_val = softmax.meta.get("val")
    if not isinstance(scores_val, torch.Tensor) or scores_val.ndim < 2:
        raise _NotAttention(softmax)
    dim = softmax.args[1] if len(softmax.args) > 1 else softmax.kwargs.get("dim")
    if dim not in (-1, scores_val.ndim - 1):
        raise _NotAttention(softmax)
    masks: list[tuple[str, torch.fx.Node]] = []
    scores = _scores(softmax.args[0], scores_val.shape[-2:], masks)
    output = _output(softmax, scores_val.shape[-1])
    shape = tuple(scores.meta["val"].shape)
    if not masks:
        return EagerAttention(scores.name, output.name, shape, KeptPairs(None, FULL))
    normal = tuple(_normal(how, node) for how, node in masks)
    try:
        kept = masks_kept_pairs(normal, shape, memo, symbolic)
    except ValueError:  # a mask that does not broadcast to the scores: not read
        return EagerAttention(scores.name, output.name, shape,
                              KeptPairs(None, f"{MASK} (not read: does not broadcast to the scores)"))
    return EagerAttention(scores.name, output.name, shape, kept, normal)


def _scores(node: Any, last: Any, masks: list[tuple[str, torch.fx.Node]]) -> torch.fx.Node:
    """Back from the softmax's input to the q @ k^T matmul, collecting the masks met on the way."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        raise _NotAttention(node)
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.ndim < 2 or tuple(map(str, val.shape[-2:])) != tuple(map(str, last)):
        raise _NotAttention(node)
    target, args = node.target, node.args
    if target in _MATMULS:
        return node
    if target is aten.baddbmm.default and node.kwargs.get("beta", 1) == 1:  # mask + q @ k^T in one op (MHA)
        if isinstance(args[0], torch.fx.Node):
            masks.append((ADDITIVE, args[0]))
        return node
    if target in _SAME or target in _VIEWS:
        return _scores(args[0], last, masks)
    if target in _SCALE:
        operands = (args[0],) if target in (aten.div.Tensor, aten.div.Scalar) else args[:2]
        for index, operand in enumerate(operands):
            if _is_scalar(args[1 - index]):
                return _scores(operand, last, masks)
        raise _NotAttention(node)
    if target is aten.add.Tensor and node.kwargs.get("alpha", 1) == 1:
        for chain, mask in ((args[0], args[1]), (args[1], args[0])):
            met: list[tuple[str, torch.fx.Node]] = []  # kept only if this side is the scores
            try:
                found = _scores(chain, last, met)
            except _NotAttention:
                continue
            masks += met
            if isinstance(mask, torch.fx.Node):
                masks.append((ADDITIVE, mask))
            return found
        raise _NotAttention(node)
    if target in _FILL and _blocking(args[2], val.dtype):
        masks.append((DROP, args[1]))
        return _scores(args[0], last, masks)
    if target in _WHERE:
        for branch, other, how in ((args[1], args[2], KEEP), (args[2], args[1], DROP)):
            if isinstance(branch, torch.fx.Node) and _blocking(other, val.dtype):
                masks.append((how, args[0]))
                return _scores(branch, last, masks)
    raise _NotAttention(node)


def _output(softmax: torch.fx.Node, keys: Any) -> torch.fx.Node:
    """Forward from the softmax to the one matmul that takes the probabilities as its first operand
    (through casts, views and dropout, which scales each probability or zeroes it by a random mask)."""
    found, seen, todo = [], set(), [softmax]
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in seen or user.op != "call_function":
                continue
            seen.add(user)
            if user.target in _MATMULS and user.args[0] is node:
                found.append(user)
            elif user.target in _SAME or user.target in _SCALE or user.target is aten.native_dropout.default or (
                    user.target.__name__ == "getitem" and user.args[1] == 0) or (
                    user.target in _VIEWS and _last(user) == str(keys)):
                todo.append(user)
    if len(found) != 1:
        raise _NotAttention(softmax)
    return found[0]


def _last(node: torch.fx.Node) -> str | None:
    val = node.meta.get("val")
    return str(val.shape[-1]) if isinstance(val, torch.Tensor) and val.ndim else None


def _normal(how: str, node: torch.fx.Node) -> tuple[str, torch.fx.Node]:
    """A mask as plainly as it reads: ~m dropped is m kept; where(m, 0, -inf) added is m kept."""
    while how in (KEEP, DROP) and node.target in _NOT:
        how, node = (DROP if how == KEEP else KEEP), node.args[0]
    if how == ADDITIVE:
        inner = node
        while inner.target in _SAME and inner.target is not aten.tanh.default:
            inner = inner.args[0]
        if inner.target in _WHERE:
            dtype = inner.meta["val"].dtype  # a where's output: always a tensor
            if _blocking(inner.args[2], dtype) and _is_zero(inner.args[1]):
                return _normal(KEEP, inner.args[0])
            if _blocking(inner.args[1], dtype) and _is_zero(inner.args[2]):
                return _normal(DROP, inner.args[0])
    return how, node


def _is_scalar(value: Any) -> bool:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return True
    val = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.numel() == 1


def _blocking(value: Any, dtype: torch.dtype) -> bool:
    """A fill value that rules a pair out: -inf, or the dtype's lowest value (as masks_kept_pairs reads it)."""
    return isinstance(value, int | float) and dtype.is_floating_point and value <= torch.finfo(dtype).min


def _is_zero(value: Any) -> bool:
    if isinstance(value, torch.fx.Node):
        while value.target in _SAME:
            value = value.args[0]
        if value.op == "placeholder":  # torch.tensor(0.0) made in the forward (transformers 5.17's eager mask)
            constant = scalar_constant(value)
            return constant is not None and bool(constant == 0)
        return value.target in _ZEROS and (value.target is not aten.scalar_tensor.default or value.args[0] == 0)
    return isinstance(value, int | float) and value == 0
