"""Slices covering their whole axis in an index on named sizes: skipped as torch skips them at every size.

torch's C++ indexing (`Tensor.__getitem__` / `__setitem__` with a tuple index; `__setitem__` with one slice)
slices each axis in `at::indexing::impl::applySlice` (aten/src/ATen/TensorIndexing.h), which returns its input
unsliced where (torch 2.14.1's header, lines 225-229)

    TORCH_STATICALLY_KNOWN_TRUE(start.sym_eq(0)) && TORCH_STATICALLY_KNOWN_TRUE(length.sym_le(stop)) && step == 1

and a getitem left with its input returns `at::alias` of it (`get_item`: "ensure we return a shallow copy for
things like x[...]"). A missing stop is INT64_MAX (`Slice`'s `INDEX_MAX`, line 63; Python's slice unpacking gives
PY_SSIZE_T_MAX, the same, and clamps a larger int to it). At a concrete size `length <= INT64_MAX` holds: `x[:, 0:, :]` or `x[None, :]` records no slice. On a
named size the question is `s <= 9223372036854775807`, which `statically_known_true` cannot answer (the size's
range reaches int_oo): torch records `aten.slice.Tensor`, and under backward its `slice_backward`, which carries
bytes, where `estimate()` at every size of the sweep records none.

A tensor's size is at most INT64_MAX at every point, so such a slice (start 0, step 1, stop INT64_MAX) covers its
axis wherever the sweep is evaluated. `whole_axis_index` gives it the axis's own size as its stop: torch's
question is then `s <= s`, which sympy makes the constant true (no guard asked, none added), and torch takes its
concrete-size path itself, recording what `estimate()` records. Any other slice, and every other index item, is
passed as given (a stop below INT64_MAX decides at some size: torch's own question, a guard or a slice, as before).
A one-slice getitem is never skipped by torch (`get_item` disables the shortcut there) and is passed as given.
"""

from __future__ import annotations

from typing import Any

import torch

# torch's Slice stop for a missing one (at::indexing::INDEX_MAX), and Python's PY_SSIZE_T_MAX that a larger
# int stop is clamped to
INDEX_MAX = 2**63 - 1

# the torch functions whose index `whole_axis_index` reads (the recorder asks it about these only)
INDEXING = frozenset((torch.Tensor.__getitem__, torch.Tensor.__setitem__))


def whole_axis_index(func: Any, args: tuple) -> tuple:
    """`args` of a `Tensor.__getitem__` / `__setitem__` call, each slice in its index that covers a named-size axis
    at every size (start 0, step 1, stop INT64_MAX) given that axis's size as its stop; `args` itself if none."""
    if len(args) < 2 or not isinstance(args[0], torch.Tensor):
        return args
    tensor, index = args[0], args[1]
    if isinstance(index, slice) and func is torch.Tensor.__setitem__:  # (one-slice getitem: never skipped)
        stop = _whole_axis_stop(index, tensor.shape[0] if tensor.dim() else None)
        return args if stop is None else (tensor, slice(index.start, stop, index.step), *args[2:])
    if not isinstance(index, tuple):
        return args
    axes = [_axes(item) for item in index]
    if None in axes or sum(item is Ellipsis for item in index) > 1 or sum(axes) > tensor.dim():
        return args  # an item read otherwise (a list, an object's __index__) or an index torch refuses: as given
    shape, axis, given, changed = tensor.shape, 0, list(index), False
    for at, item in enumerate(index):
        if item is Ellipsis:
            axis += tensor.dim() - sum(axes)
            continue
        if isinstance(item, slice):
            stop = _whole_axis_stop(item, shape[axis])
            if stop is not None:
                given[at], changed = slice(item.start, stop, item.step), True
        axis += axes[at]
    # (identity and `changed`, never `==` of index items: a named size compared is a guard, a tensor an op)
    return (tensor, tuple(given), *args[2:]) if changed else args


def _axes(item: Any) -> int | None:
    """How many of the tensor's axes an index item consumes, as torch counts them (`count_specified_dimensions`,
    `handleDimInMultiDimIndexing`): None, Ellipsis and a bool none (the Ellipsis's are counted apart), a bool or
    byte tensor its dims, a slice, an int, another tensor or a list of ints (a long tensor) or a flat list of bools
    one; None for any other item (its reading is left to torch, the index passed as given)."""
    if item is None or item is Ellipsis or type(item) is bool:
        return 0
    if isinstance(item, torch.Tensor):
        return item.dim() if item.dtype in (torch.bool, torch.uint8) else 1
    if isinstance(item, list):
        return 1 if _ints(item) or item and all(type(v) is bool for v in item) else None
    return 1 if isinstance(item, slice | torch.SymInt) or type(item) is int else None


def _ints(items: list) -> bool:
    """Whether a (nested) list holds ints only, none of them a bool (torch makes it a long index tensor)."""
    return all(type(v) is int or isinstance(v, list) and _ints(v) for v in items)


def _whole_axis_stop(item: slice, size: Any) -> Any:
    """The axis's named size where `item` starts at 0, steps by 1 and stops at INT64_MAX (covering the axis at every
    size, torch's shortcut at each), else None."""
    if not isinstance(size, torch.SymInt):
        return None  # a static size: torch's question is answered as at a concrete size
    start, stop, step = item.start, item.stop, item.step
    if not (start is None or type(start) is int and start == 0) or not (step is None or type(step) is int and step == 1):
        return None
    return size if stop is None or type(stop) is int and stop >= INDEX_MAX else None
