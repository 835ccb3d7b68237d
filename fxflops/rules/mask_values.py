"""A mask's kept pairs counted from its values: concrete masks, flex_attention BlockMasks, and masks
built without data evaluated on real index tensors.

`mask_kept_pairs` counts the pairs a concrete boolean or additive mask keeps over the attention grid,
`block_mask_kept_pairs` those a BlockMask's kept blocks make flex_attention compute. A mask the graph
builds with no model input or parameter behind it (a packed batch's block diagonal from positions) is
computed on CPU at the captured sizes, each value at most MAX_MASK_ELEMENTS entries; one that needs
data raises _NotKnowable.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

from fxflops.capture.input_values import SHAPE_ONLY, UNINITIALIZED, call_recorded, value_refusal

aten = torch.ops.aten

MAX_MASK_ELEMENTS = 1 << 24  # a mask evaluated on real index tensors: at most this many entries per value (16 Mi)


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
    """The (query, key) pairs flex_attention computes under a BlockMask: those inside the blocks it keeps
    (partial and full, as its own kv_num_blocks/kv_indices and full_kv_* list them; the kernels
    compute each kept block whole), each block clipped to the sequence — a last block that runs past
    the end holds only the positions there are, so effective never exceeds dense; broadcast to
    `shape` (B, H, Lq, Lk) where the mask's batch or heads are 1. The counts are the mask function's at
    the mask's sizes, not data. Where the lengths are multiples of the block sizes this is kept
    blocks x block size²."""
    lengths = tuple(shape[-2:]) if shape is not None else tuple(block_mask.seq_lengths)
    per_head = listed_block_pairs(block_mask.kv_num_blocks, block_mask.kv_indices, lengths, block_mask.BLOCK_SIZE)
    if block_mask.full_kv_num_blocks is not None:
        per_head = per_head + listed_block_pairs(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, lengths,
                                                 block_mask.BLOCK_SIZE)
    return broadcast_pairs(per_head, shape)


def listed_block_pairs(counts: torch.Tensor, indices: torch.Tensor, lengths: tuple[int, int],
                       block_size: tuple[int, int]) -> torch.Tensor:
    """Pairs per (batch, head), (B, H) int64, in the blocks a BlockMask lists: for each query block i, the
    first counts[..., i] key-block indices of indices[..., i, :], each block clipped to `lengths`."""
    (q_len, kv_len), (q_block, kv_block) = lengths, block_size
    rows = (q_len - torch.arange(counts.shape[-1], dtype=torch.int64) * q_block).clamp(0, q_block)
    cols = (kv_len - indices.to(torch.int64) * kv_block).clamp(0, kv_block)
    listed = torch.arange(indices.shape[-1]) < counts.to(torch.int64).unsqueeze(-1)
    return ((cols * listed).sum(dim=-1) * rows).sum(dim=-1)


def broadcast_pairs(per_head: torch.Tensor, shape: tuple[int, ...] | None) -> int:
    """The sum of (B, H) per-head pairs, repeated over the batch or heads of `shape` where B or H is 1."""
    batch, heads = tuple(per_head.shape[:2])
    repeat = 1
    if shape is not None:
        for own, wanted in ((batch, shape[0]), (heads, shape[1])):
            if own not in (1, wanted):
                raise ValueError(f"a BlockMask of batch x heads {batch} x {heads} does not broadcast to {shape}")
            repeat *= wanted if own == 1 else 1
    return int(per_head.sum()) * repeat


def _kept(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        return mask > torch.finfo(mask.dtype).min
    return mask != 0


# --- masks evaluated on real index tensors --------------------------------------------------------


class _NotKnowable(Exception):
    pass


class _TooLarge(_NotKnowable):
    pass


# (capture.input_values owns which ops' values are computed from what: SHAPE_ONLY ops read only their inputs'
# shapes and dtypes, UNINITIALIZED ones nothing; the capture's shadows, the meter's data masks and these masks alike)


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
    if node.target is operator.getitem or value_refusal(node.target, in_place=False) is not None:
        raise _NotKnowable(node)  # (random, or uninitialized memory: values no one can know)
    if node.target in SHAPE_ONLY:
        args = tuple(_placeholder_like(arg) if isinstance(arg, torch.fx.Node) else _evaluate(arg, memo) for arg in node.args)
    else:
        args = _evaluate(node.args, memo)
    kwargs = {name: _evaluate(value, memo) for name, value in node.kwargs.items()}
    try:
        return call_recorded(node, args, kwargs)
    except Exception as error:  # noqa: BLE001 - whatever stops it, the mask is not known
        raise _NotKnowable(node) from error


# ops that read only their tensor inputs' sizes (under a sweep, a size is a symbol, not data)
_SIZES = {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int}


def reads_data(node: torch.fx.Node) -> bool:
    """Whether the node's value depends on the values of a placeholder or attribute (a model input,
    parameter or buffer), not only on sizes: where a mask cannot be evaluated (a sweep's symbolic
    sizes), this says whether it is a mask from data."""
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op in ("placeholder", "get_attr"):
            return True
        if current.op == "call_function" and (current.target in SHAPE_ONLY or current.target in _SIZES or getattr(
                current.target, "overloadpacket", None) in UNINITIALIZED):
            continue  # reads its inputs' shapes and dtypes only
        stack.extend(current.all_input_nodes)
    return False


def _placeholder_like(node: torch.fx.Node) -> torch.Tensor:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise _NotKnowable(node)
    return torch.zeros(tuple(int(s) for s in val.shape), dtype=val.dtype)
