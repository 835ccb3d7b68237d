"""Kept pairs of a flex_attention call: the blocks its BlockMask keeps, known without data.

A captured `flex_attention` (or `flex_attention_backward`) call holds its BlockMask as a tuple
(`BlockMask.as_tuple()`: the sequence lengths, the block counts and indices, the block sizes, the
mask_mod). The kernels compute every block the mask keeps (partial and full), so the kept pairs are
the pairs inside the kept blocks, each clipped to the sequence (`block_mask_kept_pairs`; kept blocks
x block size² where the lengths are multiples of the block sizes), broadcast over the batch and query
heads the mask does not name:

- counts that are real tensors (a BlockMask made outside the capture and reaching it as it is) are
  read directly;
- counts that are fake (a BlockMask built inside the forward, or one given as an input, swapped for
  a fake twin) are recomputed: the mask_mod evaluated on real index tensors at the mask's sizes,
  outside every fake and dispatch mode, a few query blocks at a time, then each block kept if any of
  its pairs is; one evaluation per (mask_mod, sizes) and count. Fake counts with torch's noop_mask
  (`BlockMask.from_kv_blocks` without a mask_mod) were the only record of the blocks: data;
- a mask_mod that reads data (it closes over a fake tensor: a document-id or padding tensor from the
  batch) keeps pairs the capture cannot know: "mask from data", counted dense;
- no BlockMask (flex's own empty mask, one block as large as the grid): every pair, effective = dense.
  A block larger than the sequence counts as the sequence, like every block at the sequence's end.

Sizes that are a sweep's symbols cannot be evaluated: the pairs are then unknown ("counted at
concrete sizes only").
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from fxflops.rules import mask_values  # its MAX_MASK_ELEMENTS read at call time: one limit, wherever it is set
from fxflops.rules.kept_pairs import DATA, KeptPairs, call_kept_pairs
from fxflops.rules.mask_values import block_mask_kept_pairs, broadcast_pairs

BLOCK_MASK = "block mask"  # the pattern a flex BlockMask's kept pairs are reported under
MAX_FLEX_MASK_ELEMENTS = 1 << 30  # a mask_mod evaluated at most over this many (b, h, q, kv) entries (~5 s)


def attention_kept_pairs(op: str, names: Mapping[str, Any], nodes: Mapping[str, Any],
                         memo: dict[Any, KeptPairs], symbolic: bool) -> KeptPairs | None:
    """The kept pairs of one attention call (see `fxflops.rules.kept_pairs.call_kept_pairs`): a flex
    call's from its BlockMask, any other's from its mask or is_causal. None: every pair is kept."""
    block_mask = names.get("block_mask")
    if not isinstance(block_mask, tuple):
        return call_kept_pairs(op, names, nodes, memo, symbolic)
    query, key = names.get("query"), names.get("key")
    if not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor):
        return None
    return block_mask_pairs(block_mask, (*query.shape[:-1], key.shape[-2]), memo, symbolic)


def block_mask_pairs(block_mask: tuple, grid: tuple[Any, ...], memo: dict[Any, KeptPairs],
                     symbolic: bool) -> KeptPairs | None:
    """The pairs a BlockMask (as `BlockMask.as_tuple()` gives it) keeps over `grid` (B, Hq, Lq, Lk)."""
    mask = _read(block_mask)
    if mask is None:
        return KeptPairs(None, f"{BLOCK_MASK} (its layout is not one this torch version is known to use)")
    if _is_empty(mask, grid):
        return None
    pattern = BLOCK_MASK
    listed = (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices)
    if all(tensor is None or _is_real(tensor) for tensor in listed) and all(
            isinstance(size, int) for size in (*grid[-2:], *mask.BLOCK_SIZE)):
        return KeptPairs(block_mask_kept_pairs(mask, tuple(grid)), pattern)
    if is_noop(mask.mask_mod):  # the blocks are the counts' alone (BlockMask.from_kv_blocks), which have no data
        return KeptPairs(None, f"{DATA} (blocks given as counts, no mask_mod)")
    sizes = (*mask.kv_num_blocks.shape[:2], *mask.seq_lengths, *mask.BLOCK_SIZE)
    if symbolic or not all(isinstance(size, int) for size in (*sizes, *grid)):
        return KeptPairs(None, f"{pattern} (counted at concrete sizes only)")
    return evaluated_block_pairs(mask.mask_mod, sizes, tuple(grid), memo)


def evaluated_block_pairs(mask_mod: Callable[..., Any], sizes: tuple[int, ...], grid: tuple[int, ...],
                          memo: dict[Any, Any]) -> KeptPairs:
    """The pairs a mask_mod's BlockMask keeps over `grid` (B, Hq, Lq, Lk), the mask at concrete `sizes`
    (its B, H, Lq, Lk and block sizes): evaluated once per (mask_mod, sizes) in `memo`; `pairs` None,
    with the reason as the pattern, where it cannot be."""
    key = ("flex", mask_mod, sizes)
    try:
        found = memo.get(key)
    except TypeError:  # an unhashable mask_mod: evaluated each time
        key, found = None, None
    if found is None:
        found = _evaluated(mask_mod, sizes, BLOCK_MASK)
        if key is not None:
            memo[key] = found
    if found.pairs is None:
        return found
    return KeptPairs(broadcast_pairs(found.pairs, grid), BLOCK_MASK)


def _read(block_mask: tuple) -> SimpleNamespace | None:
    """The parts of BlockMask.as_tuple() read here: (Q_LEN, KV_LEN, kv_num_blocks, kv_indices,
    full_kv_num_blocks, ..., Q_BLOCK_SIZE, KV_BLOCK_SIZE, mask_mod); None for another layout."""
    if len(block_mask) < 7:
        return None
    q_len, kv_len, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices = block_mask[:6]
    *_, q_block, kv_block, mask_mod = block_mask
    if not (isinstance(kv_num_blocks, torch.Tensor) and kv_num_blocks.ndim == 3 and callable(mask_mod)
            and isinstance(kv_indices, torch.Tensor) and kv_indices.ndim == 4
            and (full_kv_num_blocks is None or isinstance(full_kv_num_blocks, torch.Tensor))
            and (full_kv_indices is None or isinstance(full_kv_indices, torch.Tensor))
            and all(isinstance(size, int | torch.SymInt) for size in (q_len, kv_len, q_block, kv_block))):
        return None
    return SimpleNamespace(seq_lengths=(q_len, kv_len), kv_num_blocks=kv_num_blocks, kv_indices=kv_indices,
                           full_kv_num_blocks=full_kv_num_blocks, full_kv_indices=full_kv_indices,
                           BLOCK_SIZE=(q_block, kv_block), mask_mod=mask_mod)


def _is_empty(mask: SimpleNamespace, grid: tuple[Any, ...]) -> bool:
    """flex_attention's default mask (no block_mask given): noop_mask, one block over the whole grid."""
    q_block, kv_block = mask.BLOCK_SIZE
    return is_noop(mask.mask_mod) and _at_least(q_block, grid[-2]) and _at_least(kv_block, grid[-1])


def is_noop(mask_mod: Any) -> bool:
    from torch.nn.attention.flex_attention import noop_mask

    return mask_mod is noop_mask


def _at_least(size: Any, other: Any) -> bool:
    return isinstance(size, int) and isinstance(other, int) and size >= other


def _is_real(tensor: torch.Tensor) -> bool:
    return not isinstance(tensor, FakeTensor) and not tensor.is_meta and type(tensor) is torch.Tensor


def _evaluated(mask_mod: Callable[..., Any], sizes: tuple[int, ...], pattern: str) -> KeptPairs:
    """KeptPairs whose `pairs` holds the pairs in the mask's kept blocks per (b, h) as a (B, H) count,
    or None with what stopped the evaluation."""
    batch, heads, q_len, kv_len, q_block, kv_block = sizes
    if batch * heads * q_len * kv_len > MAX_FLEX_MASK_ELEMENTS:
        return KeptPairs(None, f"{pattern} (too large to evaluate: over {MAX_FLEX_MASK_ELEMENTS} entries)")
    if mask_mod_reads_data(mask_mod):
        return KeptPairs(None, DATA)
    try:
        with unset_fake_temporarily(), torch.utils._python_dispatch._disable_current_modes():
            pairs = kept_block_pairs(mask_mod, batch, heads, q_len, kv_len, q_block, kv_block)
    except Exception as error:  # noqa: BLE001 - whatever stops it, the kept blocks are not known
        return KeptPairs(None, f"{BLOCK_MASK} (its mask_mod could not be evaluated: {type(error).__name__})")
    return KeptPairs(pairs, pattern)


def kept_block_pairs(mask_mod: Callable[..., Any], batch: int, heads: int, q_len: int, kv_len: int,
                     q_block: int, kv_block: int) -> torch.Tensor:
    """Pairs inside the q_block x kv_block blocks the mask keeps (any pair kept, as create_block_mask
    keeps a block), each block clipped to the sequence, per (b, h): a (B, H) int64 count.

    The mask_mod is evaluated as torch's create_mask evaluates it (vmapped over scalar indices), a few
    query blocks at a time, so at most MAX_MASK_ELEMENTS entries exist at once; the last blocks are
    padded with dropped pairs, as create_block_mask pads them."""
    from torch.nn.attention.flex_attention import create_mask

    q_block, kv_block = min(q_block, q_len), min(kv_block, kv_len)  # one block covers a shorter sequence
    rows = max(1, mask_values.MAX_MASK_ELEMENTS // max(1, batch * heads * kv_len * q_block)) * q_block
    pad_kv = -kv_len % kv_block
    cols = (kv_len - torch.arange(-(-kv_len // kv_block), dtype=torch.int64) * kv_block).clamp(max=kv_block)
    total = torch.zeros(batch, heads, dtype=torch.int64)
    for start in range(0, q_len, rows):
        length = min(rows, q_len - start)
        mask = create_mask(_rows_from(mask_mod, start), batch, heads, length, kv_len, device="cpu")
        if isinstance(mask, FakeTensor) or mask.is_meta:
            raise TypeError("the mask_mod read a tensor without data")
        mask = F.pad(mask, (0, pad_kv, 0, -length % q_block), value=False)
        blocks = mask.view(batch, heads, mask.shape[2] // q_block, q_block, mask.shape[3] // kv_block, kv_block)
        kept = blocks.any(dim=5).any(dim=3)  # (B, H, query blocks of this chunk, key blocks)
        block_rows = (q_len - start - torch.arange(kept.shape[2], dtype=torch.int64) * q_block).clamp(max=q_block)
        total += ((kept * cols).sum(dim=3) * block_rows).sum(dim=2)
    return total


def _rows_from(mask_mod: Callable[..., Any], start: int) -> Callable[..., Any]:
    """mask_mod over query rows start, start + 1, ...: what create_mask gives for a slice of the queries."""
    if start == 0:
        return mask_mod

    def rows(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return mask_mod(b, h, q + start, kv)

    return rows


def mask_mod_reads_data(function: Any) -> bool:
    """Whether a mask_mod (or what it closes over: captured tensors, other mask_mods as and_masks keeps
    them) holds a fake or meta tensor: a value the capture had no data for."""
    return any(isinstance(value, FakeTensor) or (isinstance(value, torch.Tensor) and value.is_meta)
               for value in _reachable(function))


def _reachable(function: Any) -> Iterator[Any]:
    seen: set[int] = set()
    stack = [function]
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        yield value
        if isinstance(value, functools.partial):
            stack.extend((value.func, *value.args, *value.keywords.values()))
        elif isinstance(value, list | tuple):
            stack.extend(value)
        elif callable(value) and not isinstance(value, torch.Tensor | type):
            cells = getattr(value, "__closure__", None) or ()
            stack.extend(cell.cell_contents for cell in cells if _filled(cell))
            stack.extend(getattr(value, "__defaults__", None) or ())
            inner = getattr(value, "__self__", None) or getattr(value, "mask_mod", None)
            if inner is not None and not isinstance(inner, torch.nn.Module | type):
                stack.append(inner)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True

