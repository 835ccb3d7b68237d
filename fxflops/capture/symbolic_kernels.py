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

A CPU convolution goes through torch's fake convolution, which asks which CPU kernel would run and in
which memory format, then the meta kernel's checks and shape formula, each step symbolic arithmetic:
~45% of a ResNet-50 sweep's capture once the batch norms were direct. `_convolution_on_cpu` shapes it
with the meta kernel's formula (the same expressions) where the layout is contiguous at every point and
the meta kernel's checks hold at every point without a guard; anything else goes through the mode.

A concatenation whose first tensor is 1-d (a decoder's cache update: `torch.cat([torch.tensor([]), keys])`,
two a layer, each run again at every copied layer) goes through torch's Python reference of `cat`; `_cat`
shapes it as that reference does where no step of it is a question (tests/test_symbolic_kernels.py holds it
against the mode, guards included).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from fxflops.capture.symbolic_layers import addmm_on_cpu, layer_norm_on_cpu

aten = torch.ops.aten


def symbolic_kernel(func: Any, args: tuple, kwargs: dict) -> Any:
    """The outputs of `func` on symbolic sizes where they are known at every point, else NotImplemented."""
    if func is aten.native_layer_norm.default:  # (fxflops.capture.symbolic_layers)
        return layer_norm_on_cpu(args, kwargs, _contiguous)
    if func is aten.addmm.default:
        return addmm_on_cpu(args, kwargs)
    if func is aten.native_batch_norm.default:
        return _batch_norm_on_cpu(args, kwargs)
    if func is aten.convolution.default:
        return _convolution_on_cpu(args, kwargs)
    if func is aten.cat.default:
        return _cat(args, kwargs)
    return NotImplemented


def _cat(args: tuple, kwargs: dict) -> Any:
    """A concatenation whose first tensor is 1-d (a cache's empty start, `torch.tensor([])`, before the first
    step's keys), shaped as torch's reference shapes it: the 1-d empty tensors (static) left out, the rest
    joined along `dim` (each other axis provably equal, no guard asked), in one dtype and on one device, the
    output contiguous. Torch's `cat` takes the layout of the first input whose suggested format is
    contiguous, and a 1-d tensor's always is; its Python reference otherwise asks each step in symbolic
    arithmetic (a decoder's two cache updates a layer). Anything else goes through the mode."""
    if len(args) not in (1, 2) or set(kwargs) - {"dim"} or not isinstance(args[0], list | tuple):
        return NotImplemented
    tensors, dim = args[0], kwargs.get("dim", args[1] if len(args) == 2 else 0)
    if not tensors or type(dim) is not int or any(type(t) is not FakeTensor or t.layout is not torch.strided
                                                   for t in tensors):
        return NotImplemented
    first = tensors[0]
    if first.dim() != 1 or any(t.dtype != first.dtype or t.device != first.device or t.fake_mode is not first.fake_mode
                               for t in tensors):
        return NotImplemented
    joined = [t for t in tensors if not (t.dim() == 1 and type(t.shape[0]) is int and t.shape[0] == 0)]
    if not joined or not any(t._has_symbolic_sizes_strides for t in joined):
        return NotImplemented
    rank = joined[0].dim()
    if rank == 0 or any(t.dim() != rank for t in joined) or not -rank <= dim < rank \
            or rank == 1 and any(type(t.shape[0]) is not int for t in joined):  # (the mode asks if it is empty)
        return NotImplemented
    dim %= rank
    shape = list(joined[0].shape)
    for tensor in joined[1:]:
        for axis, (size, other) in enumerate(zip(shape, tensor.shape)):
            if axis == dim:
                shape[axis] = size + other
            elif not (size is other or _known(size == other)):
                return NotImplemented
    with unset_fake_temporarily():
        meta = torch.empty(shape, dtype=first.dtype, device="meta", memory_format=torch.contiguous_format)
    return FakeTensor(first.fake_mode, meta, first.device)


def _batch_norm_on_cpu(args: tuple, kwargs: dict) -> Any:
    if kwargs or len(args) != 8:
        return NotImplemented
    source, weight, bias, running_mean, running_var, training = args[:6]
    if not _plain_symbolic(source) or not isinstance(training, bool):
        return NotImplemented
    channels = source.shape[1]
    for tensor in (weight, bias, running_mean, running_var):
        if tensor is not None and (type(tensor) is not FakeTensor or tensor._has_symbolic_sizes_strides
                                   or tuple(tensor.shape) != (channels,) or tensor.device != source.device):
            return NotImplemented
    if not training and (running_mean is None or running_var is None):
        return NotImplemented
    numel = source.numel()
    # training divides by the values per channel less one: a batch of one value a channel takes the mode
    if not _known(numel > channels if training else numel > 0) or not _contiguous(source):
        return NotImplemented
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


def _convolution_on_cpu(args: tuple, kwargs: dict) -> Any:
    """A CPU convolution (1-3d, grouped, dilated, strided, transposed) of a contiguous input, shaped as torch's
    meta kernel shapes it: [N, C_out, *each side's formula], contiguous. Torch's fake convolution asks which
    CPU kernel would run and its memory format, and the meta kernel checks the kernel fits the padded input
    and the output is not empty: here the kernel choice is fixed (oneDNN and NNPACK off, as a sweep's capture
    sets them), the layout is contiguous at every point (an input of 2 or more channels, contiguous, is never
    channels-last-like; a weight that is takes the mode), and the checks must hold at every point without a
    guard (else the mode asks them, as before). tests/test_symbolic_kernels.py holds it against the mode."""
    if kwargs or len(args) != 9:
        return NotImplemented
    source, weight, bias, stride, padding, dilation, transposed, output_padding, groups = args
    if not _plain_symbolic(source) or torch._C._get_mkldnn_enabled() or torch._C._get_nnpack_enabled():
        return NotImplemented
    sides = source.dim() - 2
    numbers = (stride, padding, dilation, output_padding)
    if sides not in (1, 2, 3) or type(groups) is not int or groups < 1 or not isinstance(transposed, bool) \
            or not all(isinstance(v, list | tuple) and len(v) == sides and all(type(n) is int for n in v) for v in numbers):
        return NotImplemented
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0 or min(output_padding) < 0 \
            or not transposed and max(output_padding) > 0 \
            or transposed and any(extra >= max(step, wide) for extra, step, wide in zip(output_padding, stride, dilation)):
        return NotImplemented
    for tensor in (weight, bias):
        if tensor is not None and (type(tensor) is not FakeTensor or tensor._has_symbolic_sizes_strides
                                   or tensor.dtype != source.dtype or tensor.device != source.device
                                   or tensor.layout is not torch.strided):
            return NotImplemented
    channels = source.shape[1]
    if weight.dim() != source.dim() or channels < 2 or weight.numel() == 0 or not weight.is_contiguous() \
            or _channels_last_like(weight):
        return NotImplemented
    if transposed:
        fits = weight.shape[0] == channels and channels % groups == 0
        out_channels = groups * weight.shape[1]
    else:
        fits = weight.shape[1] * groups == channels and weight.shape[0] % groups == 0
        out_channels = weight.shape[0]
    if not fits or bias is not None and tuple(bias.shape) != (out_channels,) or not _known(source.numel() > 0) \
            or not _contiguous(source):
        return NotImplemented
    kernel = weight.shape[2:]
    if transposed:  # torch's _formula_transposed
        out = [(size - 1) * step - 2 * pad + wide * (k - 1) + extra + 1 for size, pad, wide, k, step, extra
               in zip(source.shape[2:], padding, dilation, kernel, stride, output_padding)]
    else:
        if not all(_known(size + 2 * pad >= wide * (k - 1) + 1)
                   for size, pad, wide, k in zip(source.shape[2:], padding, dilation, kernel)):
            return NotImplemented
        # torch's _formula, in its order of operations (the same expressions)
        out = [(size + 2 * pad - wide * (k - 1) - 1) // step + 1
               for size, pad, wide, k, step in zip(source.shape[2:], padding, dilation, kernel, stride)]
    if not all(_known(side > 0) for side in out):
        return NotImplemented
    with unset_fake_temporarily():
        meta = torch.empty((source.shape[0], out_channels, *out), dtype=source.dtype, device="meta",
                           memory_format=torch.contiguous_format)
    return FakeTensor(source.fake_mode, meta, source.device)


def _plain_symbolic(source: Any) -> bool:
    """A floating, strided CPU fake tensor with symbolic sizes, its channel axis (1) static."""
    return type(source) is FakeTensor and source._has_symbolic_sizes_strides and source.device.type == "cpu" \
        and source.dim() >= 2 and source.is_floating_point() and source.layout is torch.strided \
        and source.constant is None and type(source.shape[1]) is int


def _contiguous(source: Any) -> bool:
    """Whether `source`'s strides are the contiguous ones of its shape at every point (no guard asked)."""
    if not _known(source.storage_offset() == 0):
        return False
    expected = 1
    for size, step in reversed(tuple(zip(source.shape, source.stride()))):
        if not _known(step == expected):
            return False
        expected = expected * size
    return True


def _channels_last_like(weight: Any) -> bool:
    """Whether torch's CPU convolution would take the (static) weight's layout as channels-last (it then
    gives the output that layout); a 1d convolution's weight is asked with an axis of 1 before its last."""
    from torch._prims_common import suggest_memory_format

    shape, stride = tuple(weight.shape), tuple(weight.stride())
    if len(shape) == 3:
        shape, stride = (*shape[:2], 1, shape[2]), (*stride[:2], stride[2] * shape[2], stride[2])
    with unset_fake_temporarily():
        meta = torch.empty_strided(shape, stride, device="meta")
    return suggest_memory_format(meta) != torch.contiguous_format


def _known(condition: Any) -> bool:
    """Whether a size condition holds at every point the capture's ranges allow, asking no guard."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(condition)
