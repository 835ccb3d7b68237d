"""Elementwise ops and a last-axis mean shaped directly on named (symbolic) sizes, where the mode's route asks
nothing that decides the output.

A decoder's normalisation (RMSNorm: `pow`, `mean`, `+ eps`, `rsqrt`, two `mul`s) and its residual `add`s run,
under named sizes, through the fake mode's binary fast path (`fake_impls.make_fast_binary_impl`: broadcast the
shapes, type promotion, contiguity checks) or torch's Python references and prims (type promotion, the output
layout by `compute_elementwise_output_strides`), each step symbolic arithmetic with its cache entry: 3-10 ms a
call, ~70 ms of a Llama sweep's capture. Where every operand is provably contiguous (its strides the contiguous
ones of its shape at every point, no guard asked) and no operand is 4-d or 5-d (whose channels-last check asks
whether a named size is 1: a guard), each of these routes gives a new contiguous tensor of the broadcast shape
in the promoted dtype, and each question it asks on the way is either decided by the sizes' expressions
(static sizes, one expression against itself) or one `size_one` answers without a guard (a size broadcast
against itself or against the constant 1). The kernels here accept exactly those cases, asking the same
questions only in that form; any other (a real broadcast of two named sizes, an operand not provably
contiguous, a 0-d tensor, a symbolic scalar, a 4-d or 5-d operand, another device) goes to the mode, as before.
So do a float16 or bfloat16 `neg`, `rsqrt`, `pow` or `mean` (the reference computes in float32 and its
conversions ask whether sizes are 1: guards), `pow` by 1 (the reference's clone) or where every named size is
1 at the capture's point (there the reference guards each to 1), and an int beyond int64 (the mode raises).

A binary op whose first operand is strided (a decoder's rotary block on transposed heads) is shaped by torch's
own functions under `size_one.refusing_guards` (`_strided_binary`): a question that would be a guard stops it
and the op goes to the mode, which asks it.

tests/test_symbolic_elementwise.py holds each against the mode: sizes, strides, offset, dtype, and the
ShapeEnv's guards (in order), runtime asserts, replacements and ranges, at points where a size is 1 too.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes
from torch._subclasses.fake_impls import make_fast_binary_impl
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from fxflops.capture.size_one import _contiguous_strides, _known, _not_one, _same_size

# the binary fast path's type promotion: DEFAULT, or INT_TO_FLOAT for `div` (torch's `get_fast_op_impls`)
_DEFAULT, INT_TO_FLOAT = ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT, ELEMENTWISE_TYPE_PROMOTION_KIND.INT_TO_FLOAT


def binary(args: tuple, kwargs: dict, promotion: ELEMENTWISE_TYPE_PROMOTION_KIND = _DEFAULT,
           named_broadcast: bool = False) -> Any:
    """`add`/`sub`/`mul`/`div` of contiguous operands (`_contiguous_binary`), else of a strided first operand
    (`_strided_binary`), else NotImplemented. `named_broadcast`: whether the op's reference is torch's generic
    binary one (`mul`, `div`), whose expansion of a size-1 axis against a named size `size_one` answers
    unguarded; `add` and `sub` have references of their own (`alpha`), where that question is a guard."""
    out = _contiguous_binary(args, kwargs, promotion)
    return _strided_binary(args, kwargs, promotion, named_broadcast) if out is NotImplemented else out


def multiplying(args: tuple, kwargs: dict) -> Any:
    """`mul`: `binary` through torch's generic binary reference."""
    return binary(args, kwargs, _DEFAULT, named_broadcast=True)


def dividing(args: tuple, kwargs: dict) -> Any:
    """`div` (true division, integers promoted to floating): `binary` through the generic binary reference."""
    return binary(args, kwargs, INT_TO_FLOAT, named_broadcast=True)


def _contiguous_binary(args: tuple, kwargs: dict, promotion: ELEMENTWISE_TYPE_PROMOTION_KIND) -> Any:
    """`add`/`sub`/`mul`/`div` (`.Tensor`, no `alpha`) of two operands, tensors or Python numbers, as the mode's
    fast path shapes them (`make_fast_binary_impl`), where it does so without a guard: the broadcast shape,
    per axis one expression against itself, a static size against a static size, or a size against the
    constant 1 (`infer_size` asks `size == 1` there: `size_one` answers it unguarded); an operand of that
    shape before any other whose shape is not known to differ (the path's "is the output's layout obvious"
    question, else a guard); every tensor provably contiguous and none 4-d or 5-d (else its layout questions
    are guards, or the Python reference runs). The output: contiguous, in the promoted dtype."""
    if kwargs or len(args) != 2 or not isinstance(args[0], torch.Tensor):
        return NotImplemented
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors or not all(_operand(t, tensors[0]) for t in tensors) \
            or not all(isinstance(a, torch.Tensor) or type(a) in (int, float, bool) and _in_int64(a) for a in args) \
            or not any(t._has_symbolic_sizes_strides for t in tensors):
        return NotImplemented
    shape: tuple = ()
    for index, operand in enumerate(args):
        own = tuple(operand.shape) if isinstance(operand, torch.Tensor) else ()
        shape = own if index == 0 else _broadcast(shape, own)
        if shape is None:
            return NotImplemented
    # the first tensor of the output's rank whose shape is the output's decides its layout is obvious; a shape
    # before it that is neither provably equal nor provably different would be a guard
    for tensor in tensors:
        if tensor.dim() != len(shape):
            continue
        same = _same_shape(tuple(tensor.shape), shape)
        if same is None:
            return NotImplemented
        if same:
            break
    else:
        return NotImplemented
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) == 1 and len(tensors) == 2 and promotion is _DEFAULT:
        dtype = tensors[0].dtype
    else:
        try:
            dtype = elementwise_dtypes(*args, type_promotion_kind=promotion)[1]
        except Exception:  # noqa: BLE001 - the mode raises it in its own words
            return NotImplemented
    return _contiguous_output(tensors[0], shape, dtype)


class _Slow(Exception):
    """The binary fast path gave up (its layout is not obvious): torch's reference would run."""


def _give_up(*args: Any, **kwargs: Any) -> Any:
    raise _Slow


# torch's own binary fast path, per promotion kind, with its slow route (the reference) replaced by giving up
_FAST = MappingProxyType({kind: make_fast_binary_impl(_give_up, kind) for kind in (_DEFAULT, INT_TO_FLOAT)})


def _strided_binary(args: tuple, kwargs: dict, promotion: ELEMENTWISE_TYPE_PROMOTION_KIND, named_broadcast: bool) -> Any:
    """A binary op whose first operand has the output's shape in any layout (a decoder's rotary block on
    transposed heads: `q * cos`, `q * cos + rotate_half(q) * sin`), the second a tensor of its dtype and rank
    that broadcasts against it by static sizes of 1 (one of fewer axes is expanded by new leading axes, where
    the mode asks whether the first's named sizes are 1: guards). Shaped by torch's own functions, each asked what the mode
    asks under `size_one.refusing_guards` (a question that would be a guard leaves the op to the mode): the
    fast path (`make_fast_binary_impl`, its reference replaced by giving up), then the reference's broadcast
    (`_broadcast_shapes`; the second operand's expansion, whose questions `size_one` answers unguarded where
    the first operand orders every axis, checked here) and the prim's output layout
    (`compute_elementwise_output_strides` of the first operand and the expansion)."""
    import torch._refs as refs
    from torch._prims_common import compute_elementwise_output_strides

    from fxflops.capture.size_one import WouldGuard, refusing_guards

    if kwargs or len(args) != 2:
        return NotImplemented
    first, second = args
    if not isinstance(first, torch.Tensor) or not isinstance(second, torch.Tensor) or not _strided(first, first) \
            or not _strided(second, first) or second.dtype != first.dtype or not first.is_floating_point() \
            or not first._has_symbolic_sizes_strides or first.dim() < 2 or second.dim() != first.dim() \
            or not hasattr(type(first.fake_mode.shape_env), "refusing"):
        return NotImplemented
    shape, strides, padded = tuple(first.shape), first.stride(), tuple(second.shape)
    # the expansion of the second operand: its own axes kept, the constant 1 against a static size or (its
    # stride asked by `size_one`, unguarded where the first operand's stride on that axis is known nonzero and
    # unlike every other) against a named size not 1 at the capture's point
    ordered = all(_known(stride != 0) for stride in strides) \
        and all(_known(one != other) for at, one in enumerate(strides) for other in strides[at + 1:])
    expanded = []
    for axis, (size, own) in enumerate(zip(shape, padded)):
        if _same_size(size, own):
            expanded.append(second.stride()[axis])
        elif type(own) is int and own == 1 and (type(size) is int or named_broadcast and ordered and _not_one(size)):
            expanded.append(0)
        else:
            return NotImplemented
    # the reference's should_expand: `1 != size` of the two shapes, unguarded where some pair is known unequal
    if not any(_known(x != y) for x, y in zip(padded, shape)) and not all(_same_size(x, y) for x, y in zip(padded, shape)):
        return NotImplemented
    env = first.fake_mode.shape_env
    with refusing_guards(env):
        try:
            try:
                # past the mode, as the mode runs it (its handler runs with itself off the stack): its output's
                # constructor through the mode would be an op of its own, with a cache entry made and checked
                with unset_fake_temporarily():
                    return _FAST[promotion](first.fake_mode, first, second)
            except _Slow:
                pass
            if refs._broadcast_shapes(shape, tuple(second.shape)) is None:
                return NotImplemented
            broadcast = aliasing(second, list(shape), expanded, second.storage_offset())
            layout = compute_elementwise_output_strides(first, broadcast)
        except WouldGuard:
            return NotImplemented
    with unset_fake_temporarily():
        meta = torch.empty_strided(shape, layout, dtype=first.dtype, device="meta")
    return FakeTensor(first.fake_mode, meta, first.device)


def _strided(tensor: Any, first: Any) -> bool:
    """A strided, non-constant fake tensor like `first` (device, mode), no named size of it 1 at the capture's
    point (where `size_one`'s "not 1" answers are guards)."""
    return type(tensor) is FakeTensor and tensor.layout is torch.strided and tensor.constant is None \
        and not tensor.is_sparse and not tensor.is_quantized and tensor.device.type in ("cpu", "cuda") \
        and tensor.device == first.device and tensor.fake_mode is first.fake_mode and tensor.dim() > 0 \
        and all(_not_one(size) for size in tensor.shape)


def aliasing(source: Any, sizes: list, strides: list, offset: Any) -> Any:
    """A fake view of `source`'s storage with these sizes, strides and offset (the meta kernel's as_strided, on
    the storage the fake tensor holds; symbolic_kernels' views are made by it too)."""
    from torch._subclasses.fake_tensor import in_kernel_invocation_manager

    mode = source.fake_mode
    with in_kernel_invocation_manager(mode):
        meta = torch.ops.aten.as_strided.default(source, sizes, strides, offset)
    return FakeTensor(mode, meta, source.device)


def unary(args: tuple, kwargs: dict) -> Any:
    """`neg`, `rsqrt`, `pow` by a number: `_contiguous_unary`, else NotImplemented."""
    return _contiguous_unary(args, kwargs)


def negating(args: tuple, kwargs: dict) -> Any:
    """`neg`: `_contiguous_unary`, else of a strided floating tensor (rotate-half's `-x2`, a slice of transposed
    heads) by its own meta kernel on the fake tensor's meta (what the mode runs for it) under
    `size_one.refusing_guards`: a question that would be a guard leaves it to the mode."""
    out = _contiguous_unary(args, kwargs)
    if out is not NotImplemented or kwargs or len(args) != 1:
        return out
    from torch._subclasses.fake_tensor import in_kernel_invocation_manager

    from fxflops.capture.size_one import WouldGuard, refusing_guards

    source = args[0]
    if not isinstance(source, torch.Tensor) or not _strided(source, source) or not source.is_floating_point() \
            or not source._has_symbolic_sizes_strides or not hasattr(type(source.fake_mode.shape_env), "refusing"):
        return NotImplemented
    mode = source.fake_mode
    with refusing_guards(mode.shape_env):
        try:
            with in_kernel_invocation_manager(mode):
                meta = torch.ops.aten.neg.default(source)
        except WouldGuard:
            return NotImplemented
    return FakeTensor(mode, meta, source.device)


def _contiguous_unary(args: tuple, kwargs: dict) -> Any:
    """`neg`, `rsqrt` (or `pow` by a Python number) of a floating tensor, provably contiguous, not 4-d or
    5-d: the elementwise output layout of one contiguous operand is its contiguous layout (torch's
    `compute_elementwise_output_logical_to_physical_perm` short-circuits there, its questions `size_one`'s),
    in the input's dtype (a floating tensor with a Python number stays in its dtype)."""
    if kwargs or len(args) not in (1, 2):
        return NotImplemented
    source = args[0]
    if not isinstance(source, torch.Tensor) or not _operand(source, source) or not source._has_symbolic_sizes_strides \
            or source.dim() == 0 or source.dtype not in _FULL_FLOATS:
        return NotImplemented
    if len(args) == 2 and (type(args[1]) not in (int, float) or not _in_int64(args[1]) or args[1] == 1
                           or not all(_not_one(size) for size in source.shape)):
        # `pow` by 1 is the reference's clone, and where every named size is 1 at the capture's point (fewer
        # than 2 elements) the reference's questions are guards: both take the mode's route, which asks them
        return NotImplemented
    return _contiguous_output(source, tuple(source.shape), source.dtype)


# float16 and bfloat16 run the mode's reference computing in float32 (its conversions ask layout questions
# that are guards): the unary ops and the mean here take only these
_FULL_FLOATS = (torch.float32, torch.float64)


def _in_int64(number: Any) -> bool:
    """Whether a Python number is no int outside int64 (the mode raises OverflowError converting one)."""
    return type(number) is not int or -2**63 <= number < 2**63


def mean(args: tuple, kwargs: dict) -> Any:
    """`mean.dim` of a floating, provably contiguous tensor (not 4-d or 5-d) over its static, nonempty last
    axis alone (RMSNorm's `x.pow(2).mean(-1, keepdim=True)`), no dtype given: contiguous, the last axis 1 or
    dropped, in the input's dtype, as the mode's reduction gives it."""
    if set(kwargs) - {"keepdim"} or len(args) not in (2, 3):
        return NotImplemented
    source, dims = args[0], args[1]
    keepdim = args[2] if len(args) == 3 else kwargs.get("keepdim", False)
    if not isinstance(source, torch.Tensor) or not _operand(source, source) or not source._has_symbolic_sizes_strides \
            or source.dim() < 2 or source.dtype not in _FULL_FLOATS or type(keepdim) is not bool \
            or not isinstance(dims, list | tuple) or len(dims) != 1 or type(dims[0]) is not int \
            or dims[0] % source.dim() != source.dim() - 1 or not -source.dim() <= dims[0] < source.dim():
        return NotImplemented
    *leading, last = source.shape
    # the reduction asks whether a named size is 1 even of one element (unlike the elementwise checks)
    if type(last) is not int or last < 1 or not all(_not_one(size) for size in leading):
        return NotImplemented
    return _contiguous_output(source, (*leading, 1) if keepdim else tuple(leading), source.dtype)


def _operand(tensor: Any, first: Any) -> bool:
    """A strided, non-constant fake tensor of 1-3 or 6+ axes, on the CPU or CUDA like `first`, its strides
    provably the contiguous ones of its shape, its contiguity check no guard (`_layout_unasked`)."""
    return type(tensor) is FakeTensor and tensor.layout is torch.strided and tensor.constant is None \
        and not tensor.is_sparse and not tensor.is_quantized and not tensor.is_complex() \
        and tensor.device.type in ("cpu", "cuda") and tensor.device == first.device \
        and tensor.fake_mode is first.fake_mode and tensor.dim() not in (0, 4, 5) \
        and _contiguous_strides(tensor.shape, tensor.stride()) and _layout_unasked(tensor)


def _layout_unasked(tensor: Any) -> bool:
    """Whether the mode's contiguity check of `tensor` asks no guard: it asks "fewer than 2 elements?" first
    (`size_one` answers it either way for provably contiguous strides, true where the capture's point has
    fewer) and only past that whether each named axis is 1 (`size_one`'s "not 1")."""
    numel = tensor.numel()
    hint = numel if type(numel) is int else numel.node.hint
    if hint is None or any(type(size) is not int and size.node.hint in (None, 0) for size in tensor.shape):
        return False
    return hint < 2 or all(_not_one(size) for size in tensor.shape)


def _broadcast(shape: tuple, other: tuple) -> tuple | None:
    """The broadcast of two shapes where `infer_size` asks nothing that is a guard (None otherwise): per axis
    (from the last) one size against itself, two static sizes that broadcast, or a size against the
    constant 1."""
    rank = max(len(shape), len(other))
    shape, other = (1,) * (rank - len(shape)) + shape, (1,) * (rank - len(other)) + other
    out = []
    for size, against in zip(shape, other):
        if type(size) is int and size == 1:
            out.append(against)
        elif type(against) is int and against == 1 and _not_one(size) or _same_size(size, against):
            out.append(size)
        else:
            return None
    return tuple(out)


def _same_shape(shape: tuple, other: tuple) -> bool | None:
    """Whether two shapes are one (True), provably differ at a static axis (False), or neither (None)."""
    if all(_same_size(a, b) for a, b in zip(shape, other)):
        return True
    if any(type(a) is int and type(b) is int and a != b for a, b in zip(shape, other)):
        return False
    return None


def _contiguous_output(like: Any, shape: tuple, dtype: torch.dtype) -> Any:
    """A new contiguous fake tensor of `shape` and `dtype` on `like`'s device and mode."""
    with unset_fake_temporarily():
        meta = torch.empty(shape, dtype=dtype, device="meta", memory_format=torch.contiguous_format)
    return FakeTensor(like.fake_mode, meta, like.device)
