"""Ops shaped directly on named (symbolic) sizes, where the mode's own route is a Python decomposition.

A sweep's capture runs every op through FakeTensorMode with SymInt sizes. For a CPU batch norm the mode
runs torch's Python decomposition of `native_batch_norm` (a dozen ops, each of them symbolic arithmetic
in sympy): ~45% of a ResNet-50 sweep's capture. What it gives is known without running it, as the short
route past the mode knows it for static sizes (`meta_kernels._batch_norm_outputs_on_cpu`): the output
keeps the input's shape, strides and dtype; the saved statistics are [C] in training and [0] in eval, in
the input's dtype. Here that holds only where it holds at every point of the sweep: an input whose
strides are provably (no guard asked) the contiguous ones of its symbolic shape, a static channel count,
and in training more values than channels. Anything else goes through the mode, as before.

The output's layout is what the decomposition's first elementwise step (input - mean) gives: both operands
contiguous at every point, torch's fast path makes the contiguous layout of the input's shape. That step
also asks whether they are channels-last too, which decides nothing once they are contiguous (a guard on
the map's area: a 1 x 1 map is both), so the kernel does not ask it; through the mode it was the costliest
question of a ResNet's capture and split its sweep where the last map is 1 x 1. The steps after it keep
that layout, and their questions decide strides only, never a shape (a rule reads shapes, never strides;
the sweep tests hold `at()` equal to `estimate()` node by node on both sides of such a map).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

aten = torch.ops.aten


def symbolic_kernel(func: Any, args: tuple, kwargs: dict) -> Any:
    """The outputs of `func` on symbolic sizes where they are known at every point, else NotImplemented."""
    if func is aten.native_batch_norm.default:
        return _batch_norm_on_cpu(args, kwargs)
    return NotImplemented


def _batch_norm_on_cpu(args: tuple, kwargs: dict) -> Any:
    if kwargs or len(args) != 8:
        return NotImplemented
    source, weight, bias, running_mean, running_var, training = args[:6]
    if type(source) is not FakeTensor or not source._has_symbolic_sizes_strides or source.device.type != "cpu" \
            or source.dim() < 2 or not source.is_floating_point() or source.layout is not torch.strided \
            or source.constant is not None or not isinstance(training, bool):
        return NotImplemented
    channels = source.shape[1]
    if type(channels) is not int:
        return NotImplemented
    for tensor in (weight, bias, running_mean, running_var):
        if tensor is not None and (type(tensor) is not FakeTensor or tensor._has_symbolic_sizes_strides
                                   or tuple(tensor.shape) != (channels,) or tensor.device != source.device):
            return NotImplemented
    if not training and (running_mean is None or running_var is None):
        return NotImplemented
    numel = source.numel()
    # training divides by the values per channel less one: a batch of one value a channel takes the mode
    if not _known(numel > channels if training else numel > 0) or not _known(source.storage_offset() == 0):
        return NotImplemented
    expected = 1
    for size, step in reversed(tuple(zip(source.shape, source.stride()))):
        if not _known(step == expected):
            return NotImplemented
        expected = expected * size
    # the output as the decomposition's first elementwise step (input - mean, the mean [C, 1, ...]) makes
    # it: both operands are contiguous at every point, so torch's fast path gives the contiguous layout of
    # the input's shape (its other layout question, whether they are channels-last too, decides nothing
    # then: each a guard on the map's area that split a convnet's sweep for nothing, and the costliest
    # questions of its capture); the steps after it keep that layout
    statistics = (channels,) if training else (0,)
    with unset_fake_temporarily():
        output = torch.empty(source.shape, dtype=source.dtype, device="meta", memory_format=torch.contiguous_format)
        saved = [torch.empty(statistics, dtype=source.dtype, device="meta") for _ in range(2)]
    return tuple(FakeTensor(source.fake_mode, meta, source.device) for meta in (output, *saved))


def _known(condition: Any) -> bool:
    """Whether a size condition holds at every point the capture's ranges allow, asking no guard."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(condition)
