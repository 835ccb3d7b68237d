"""A CPU layer norm shaped directly on named (symbolic) sizes, where the mode's route is torch's Python reference.

Under named sizes FakeTensorMode shapes `native_layer_norm` with `torch._refs.native_layer_norm` (its C++
meta kernel takes no SymInts): the checks, a `var_mean`, an `rsqrt`, a subtraction, two multiplications and
an addition, each through the mode in symbolic arithmetic, 10-20 ms a call, a fifth of a GPT-2 sweep's
capture. What it gives is known without running it where no step of it is a question: the input made
contiguous (it is, provably at every point), normalized over its static last axis, which equals
`normalized_shape`, the weight and bias (static, of that shape and the input's dtype, or none) broadcast
over it, all in float32 or float64, the input 2-d or 3-d. So: the output in the input's shape, dtype and
contiguous layout (an elementwise result of a contiguous full-shape first operand), the statistics
contiguous in the input's shape with the last axis 1, in its dtype. Anything else goes through the mode:
another device, rank, dtype or layout, several normalized axes, a symbolic normalized size, a mismatched
weight (a 4-d input, bfloat16 or a mixed dtype make the mode ask about the sizes: guards the kernel would
not ask).

(A linear layer's `addmm` on named rows is `symbolic_kernels._addmm`.)

tests/test_symbolic_layers.py holds it, and `_addmm` through `symbolic_kernel`, against the mode (layouts, dtypes, guards).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily


def layer_norm_on_cpu(args: tuple, kwargs: dict, contiguous: Any) -> Any:
    """native_layer_norm's (output, mean, rstd) where they are known at every point, else NotImplemented;
    `contiguous(tensor)`: whether its strides are provably the contiguous ones of its shape."""
    if kwargs or len(args) != 5:
        return NotImplemented
    source, normalized, weight, bias, eps = args
    if type(source) is not FakeTensor or not source._has_symbolic_sizes_strides or source.device.type != "cpu" \
            or source.layout is not torch.strided or not source.is_floating_point() or source.constant is not None:
        return NotImplemented
    # where the reference asks nothing (the mode's guards, tests/test_symbolic_layers.py): a 2-d or 3-d input (a
    # 4-d one's layout is asked whether it is channels-last: whether a named size is 1), one normalized axis,
    # one dtype throughout and a computation dtype (bfloat16/half are normalized in float32 and converted
    # back: the conversion asks about the sizes)
    if not isinstance(normalized, list | tuple) or len(normalized) != 1 or type(normalized[0]) is not int \
            or not isinstance(eps, float | int) or source.dtype not in (torch.float32, torch.float64) \
            or source.dim() not in (2, 3):
        return NotImplemented
    *leading, last = source.shape
    if type(last) is not int or last != normalized[0]:
        return NotImplemented
    for tensor in (weight, bias):
        if tensor is not None and (type(tensor) is not FakeTensor or tensor._has_symbolic_sizes_strides
                                   or tuple(tensor.shape) != tuple(normalized) or tensor.device != source.device
                                   or tensor.fake_mode is not source.fake_mode or tensor.dtype != source.dtype
                                   or tensor.layout is not torch.strided):
            return NotImplemented
    if not contiguous(source):
        return NotImplemented
    statistics = (*leading, 1)
    with unset_fake_temporarily():
        made = [torch.empty(shape, dtype=source.dtype, device="meta", memory_format=torch.contiguous_format)
                for shape in (source.shape, statistics, statistics)]
    return tuple(FakeTensor(source.fake_mode, meta, source.device) for meta in made)
