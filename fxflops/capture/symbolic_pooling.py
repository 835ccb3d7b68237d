"""A convnet's small ops shaped directly on named (symbolic) sizes: max pooling, a mean over the map, the
in-place ReLU and residual add.

Once its convolutions and batch norms were direct (`symbolic_kernels`), what a ResNet's sweep capture still ran
through FakeTensorMode was these: each a meta kernel or Python reference in symbolic arithmetic plus the mode's
bookkeeping, 0.4-8 ms a call. What each gives is known without running it where every question torch would
ask is answered at every point the capture's ranges allow (statically, no guard):

- `relu_(x)` and `add_(x, y)` (in place) return `x` itself, unchanged in layout. Here only for a strided
  floating `x` whose strides are the contiguous ones of its shape as expressions (so at every point), and for
  `add_` a `y` of the same dtype, device and shape (each axis the same expression or constant), contiguous
  too, and no `alpha`. TensorIterator's broadcast and layout questions then ask whether a named size is 1
  (`size_one` answers those without a guard only where the size is not 1 at the capture's point): a named
  size that is 1 there, unless known never to be, takes the mode, whose question is then a guard.
- `max_pool2d_with_indices` of a contiguous 4-d input: torch's meta kernel's output size per side,
  `(in + 2 * pad - dilation * (k - 1) - 1 [+ stride - 1 with ceil_mode]) // stride + 1` (with ceil_mode less 1
  where the last window would start past the input and its left padding), the same expressions in the same
  order; the output and its int64 indices contiguous. Its questions: the layout (contiguous, not
  channels-last: asked of the input's sizes and strides), the sides non-empty, each output side at least 1,
  and with ceil_mode the last window's start. Each must be known at every point, else the mode asks it.
- `mean.dim(x, dims, keepdim=True)` over a contiguous input's trailing axes (what `adaptive_avg_pool2d` to
  1 x 1 dispatches): those axes become 1, the output contiguous in the input's dtype; as for the in-place ops,
  a named size that is 1 at the capture's point takes the mode (its reduction asks it).

Anything else goes through the mode, as before. tests/test_symbolic_pooling.py holds each against the mode:
sizes, strides, offset, dtype, storage, and the ShapeEnv's guards in order, runtime asserts, replacements and
ranges, at points where a size is 1 and at the smallest maps, with ceil_mode, padding, dilation, channels-last
and strided inputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from fxflops.capture.size_one import _known, _not_one, _same_size


def relu_in_place(args: tuple, kwargs: dict) -> Any:
    """`relu_(x)`: `x` itself, where no question of torch's is a guard (see the module's docstring)."""
    if kwargs or len(args) != 1 or not _plain(args[0]) or not contiguous_as_expressions(args[0]):
        return NotImplemented
    return args[0]


def add_in_place(args: tuple, kwargs: dict) -> Any:
    """`add_(x, y)` of two same-shaped contiguous tensors (a residual add): `x` itself, else NotImplemented."""
    if kwargs or len(args) != 2:
        return NotImplemented
    target, other = args
    if not _plain(target) or type(other) is not FakeTensor or other.fake_mode is not target.fake_mode \
            or other.dtype != target.dtype or other.device != target.device or other.layout is not torch.strided \
            or other.constant is not None or other.dim() != target.dim() \
            or not all(_same_size(a, b) for a, b in zip(target.shape, other.shape)):
        return NotImplemented
    if not contiguous_as_expressions(target) or other is not target and not contiguous_as_expressions(other):
        return NotImplemented
    return target


def max_pool2d_with_indices(args: tuple, kwargs: dict) -> Any:
    """`max_pool2d_with_indices` of a contiguous 4-d input: (output, indices) as torch's meta kernel shapes them
    where each of its questions is known at every point, else NotImplemented."""
    if kwargs or not 2 <= len(args) <= 6:
        return NotImplemented
    source, kernel = args[0], args[1]
    stride, padding, dilation, ceil_mode = (*args[2:], *([], [0], [1], False)[len(args) - 2:])
    if not _plain(source) or source.dim() != 4 or type(source.shape[1]) is not int or source.shape[1] < 2 \
            or not isinstance(ceil_mode, bool):
        return NotImplemented
    kernel, padding, dilation = _pair(kernel), _pair(padding), _pair(dilation)
    stride = kernel if isinstance(stride, list | tuple) and len(stride) == 0 else _pair(stride)
    if None in (kernel, stride, padding, dilation) or min(kernel) < 1 or min(stride) < 1 or min(dilation) < 1 \
            or min(padding) < 0 or any(pad > k // 2 for pad, k in zip(padding, kernel)):
        return NotImplemented
    height, width = source.shape[2:]
    # the layout questions (suggest_memory_format: contiguous, not channels-last, asked of sizes and strides)
    # and the checks of non-empty sides hold at every point where both sides are at least 1; a channel count
    # of at least 2 makes the channels-last test fail on the last axis's stride (1 < C * H * W)
    if not contiguous_as_expressions(source) or not all(_known(side >= 1) for side in (height, width)):
        return NotImplemented
    sides = []
    for size, k, step, pad, wide in zip((height, width), kernel, stride, padding, dilation):
        # torch's pooling_output_shape_pad_lr, in its order of operations (the same expressions)
        side = (size + pad + pad - wide * (k - 1) - 1 + (step - 1 if ceil_mode else 0)) // step + 1
        if ceil_mode:
            if _known((side - 1) * step >= size + pad):
                side = side - 1
            elif not _known((side - 1) * step < size + pad):
                return NotImplemented
        if not _known(side >= 1):
            return NotImplemented
        sides.append(side)
    shape = (source.shape[0], source.shape[1], *sides)
    with unset_fake_temporarily():
        metas = [torch.empty(shape, dtype=dtype, device="meta", memory_format=torch.contiguous_format)
                 for dtype in (source.dtype, torch.int64)]
    return tuple(FakeTensor(source.fake_mode, meta, source.device) for meta in metas)


def mean_over_trailing_axes(args: tuple, kwargs: dict) -> Any:
    """`mean.dim(x, dims, keepdim=True)` over a contiguous input's trailing axes, 4-d or more (an adaptive
    average pool to 1 x 1): the reduced axes 1, contiguous, in the input's dtype; else NotImplemented."""
    if kwargs or len(args) != 3 or not _plain(args[0]) or args[2] is not True:
        return NotImplemented
    source, dims = args[0], args[1]
    rank = source.dim()
    if rank < 4:  # a pooled map; a lower rank's last-axis mean is symbolic_elementwise's, the rest the mode's
        return NotImplemented
    if not isinstance(dims, list | tuple) or not dims or any(type(d) is not int or not -rank <= d < rank for d in dims):
        return NotImplemented
    reduced = {d % rank for d in dims}
    if len(reduced) != len(dims) or reduced != set(range(rank - len(reduced), rank)) or len(reduced) == rank \
            or not contiguous_as_expressions(source):
        return NotImplemented
    shape = [1 if axis in reduced else size for axis, size in enumerate(source.shape)]
    with unset_fake_temporarily():
        meta = torch.empty(shape, dtype=source.dtype, device="meta", memory_format=torch.contiguous_format)
    return FakeTensor(source.fake_mode, meta, source.device)


def _plain(source: Any) -> bool:
    """A strided float32/float64 CPU fake tensor with named sizes, none of them 1 at the capture's point unless
    known never to be (there torch's size-one questions are guards the mode must ask)."""
    if not (type(source) is FakeTensor and source._has_symbolic_sizes_strides and source.device.type == "cpu"
            and source.dtype in (torch.float32, torch.float64) and source.layout is torch.strided
            and source.constant is None and source.dim() >= 1):
        return False
    return all(_not_one(size) for size in source.shape)


def contiguous_as_expressions(source: Any) -> bool:
    """Whether `source`'s strides are, as expressions, the contiguous ones of its shape and its offset 0: then
    they are at every point (a sufficient test that asks nothing; a layout equal only in value takes the mode)."""
    offset = source.storage_offset()
    if (offset.node.expr if isinstance(offset, torch.SymInt) else offset) != 0:
        return False
    expected = 1
    for size, step in reversed(tuple(zip(source.shape, source.stride()))):
        if _expression(step) != expected:
            return False
        expected = expected * _expression(size)
    return True


def _expression(size: Any) -> Any:
    """A size or stride as a sympy expression (an int as itself: sympy's integers compare equal to it)."""
    return size.node.expr if isinstance(size, torch.SymInt) else size


def _pair(value: Any) -> tuple | None:
    """A pooling argument of one or two ints as (height, width), as torch's unpack reads it, else None."""
    if not isinstance(value, list | tuple) or len(value) not in (1, 2) or any(type(v) is not int for v in value):
        return None
    return (value[0], value[-1])
