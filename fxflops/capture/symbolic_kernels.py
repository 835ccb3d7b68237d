"""Ops shaped directly on named (symbolic) sizes, where the mode's own route is a Python decomposition.

A sweep's capture runs every op through FakeTensorMode with SymInt sizes. For a CPU batch norm the mode
runs torch's Python decomposition of `native_batch_norm` (a dozen ops, each of them symbolic arithmetic
in sympy): ~45% of a ResNet-50 sweep's capture. What it gives is known without running it, as the short
route past the mode knows it for static sizes (`meta_kernels._batch_norm_outputs_on_cpu`): the output
keeps the input's shape, strides and dtype; the saved statistics are [C] in training and [0] in eval, in
the input's dtype. Here that holds only where it holds at every point of the sweep: an input whose
strides are provably (no guard asked) the contiguous ones of its symbolic shape, a static channel count,
and in training more values than channels. Anything else goes through the mode, as before. In eval, where
this kernel shapes it, `F.batch_norm` is taken at the torch-function level (`symbolic_function`, called by
capture.recorder.CompositeOps): torch's C++ composite around `native_batch_norm` (its `numel == 0` check, its
reserve tensor and the two dispatches) is not run, its
`empty` and `native_batch_norm` recorded as their dispatch records them.

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

Views on named sizes cost the mode more than their answer: a `view` (and `_unsafe_view`, matmul's) runs torch's
Python reshape algorithm, each step (split an axis, merge axes) an op of its own through the mode with its
cache entry and an as_strided, 5-10 ms a view and 14 in GPT-2's reference layer; a `transpose`, `unsqueeze` or
`slice` is one C++ or Python kernel plus the mode's cache entry, ~5 ms. Each is shaped here by the same
algorithm, asking the same questions of the same expressions in the same order, through torch's own functions
wherever `size_one` tells questions apart by the function asking them (so a question it answers without a guard
there is answered so here, and a guard the mode would add is this kernel's, one for one); the output is one
as_strided of the input's storage, as the mode's last step gives it. A `view` whose algorithm would ask a
question of an intermediate view (axes merged after a split), a tail squeeze of a named size, or a case it
special-cases, goes to the mode, which asks what was asked again (answered now without a new guard); a tail
squeeze of constant 1s (a flatten of a 1 x 1 map) asks nothing and is shaped here. The same view of the same layout
(as expressions) again in the capture takes the layout found first (kept in the sweep's ShapeEnv: a decoder's layer
folds the same rows for each projection): what its questions taught the ShapeEnv answers them again without a new
guard. A `split` along an axis of static size is its pieces as views of the input's storage (no question of a named
size), where the mode runs a `narrow` per piece. An `addmm` of a 2-d linear layer on a
named row count is its decomposition's one contiguous output where that decomposition's questions are all
static or answered by `size_one` without a guard; an `mm` (one without a bias) is its meta kernel's one contiguous
output where the contraction it checks is static. Elementwise ops of provably contiguous operands (an RMSNorm,
a residual add) are `symbolic_elementwise`'s. tests/test_symbolic_kernels.py holds every one against the
mode: sizes, strides, offset, storage, and the ShapeEnv's guards (in order), runtime asserts, replacements and
ranges, at points where a size is 1 too.
"""

from __future__ import annotations

import functools
import operator
from types import MappingProxyType
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from fxflops.capture import symbolic_elementwise as elementwise
from fxflops.capture.size_one import _not_one
from fxflops.capture.symbolic_layers import layer_norm_on_cpu
from fxflops.capture.symbolic_pooling import (add_in_place, contiguous_as_expressions, max_pool2d_with_indices,
                                              mean_over_trailing_axes, relu_in_place)

aten = torch.ops.aten


def symbolic_kernel(func: Any, args: tuple, kwargs: dict) -> Any:
    """The outputs of `func` on symbolic sizes where they are known at every point, else NotImplemented."""
    kernel = _KERNELS.get(func)
    return NotImplemented if kernel is None else kernel(args, kwargs)


def _addmm(args: tuple, kwargs: dict) -> Any:
    """`addmm(bias, rows, weight)` (a linear layer on rows whose count is a named size: GPT-2's Conv1D, a
    classifier's head) shaped as the mode's decomposition of it shapes it: `rows @ weight` (meta_mm: a new
    contiguous [rows, out]), times 1, plus the bias times 1 (each a fast elementwise op: contiguous
    operands give a contiguous output). Four ops through the mode, each with its cache entry; here one new
    tensor. Their questions: the reduction axes equal (both static here), whether the rows are 1 in each
    contiguity check and broadcast against the bias, which `size_one` answers without a guard where the rows
    are not 1 at the capture's sizes (the stride is the expected one; the bias's axis is the constant 1).
    So only: one floating dtype (no casts), static weight and bias [out], the rows' count known not to be 1
    or not 1 at the capture's sizes (else the mode, whose question is then a guard)."""
    if kwargs or len(args) != 3:
        return NotImplemented
    bias, rows, weight = args
    if not all(type(t) is FakeTensor and t.layout is torch.strided and t.constant is None for t in args) \
            or rows.dtype not in (torch.float32, torch.float64) or rows.device.type != "cpu" \
            or any(t.dtype != rows.dtype or t.device != rows.device or t.fake_mode is not rows.fake_mode
                   for t in (bias, weight)):
        return NotImplemented
    if rows.dim() != 2 or weight.dim() != 2 or bias.dim() != 1 or not rows._has_symbolic_sizes_strides \
            or weight._has_symbolic_sizes_strides or bias._has_symbolic_sizes_strides or not bias.is_contiguous():
        return NotImplemented
    count, width = rows.shape
    if type(width) is not int or width != weight.shape[0] or tuple(bias.shape) != (weight.shape[1],) \
            or not isinstance(count, torch.SymInt) or not _not_one(count):
        return NotImplemented
    with unset_fake_temporarily():
        meta = torch.empty((count, weight.shape[1]), dtype=rows.dtype, device="meta",
                           memory_format=torch.contiguous_format)
    return FakeTensor(rows.fake_mode, meta, rows.device)


def _mm(args: tuple, kwargs: dict) -> Any:
    """`mm(rows, weight)` (a linear layer without a bias on rows whose count is a named size: a decoder's
    projections and head, each `matmul` folded to 2-d) shaped as the mode's meta kernel shapes it (`meta_mm`: the
    contraction sizes checked equal, then a new contiguous [rows, out] in the first operand's dtype), one new
    tensor where the mode's dispatch and cache entry cost ~1 ms. Only where that check asks nothing (a static
    contraction), one floating dtype (no casts), two 2-d CPU fake tensors of one mode; else the mode."""
    if kwargs or len(args) != 2:
        return NotImplemented
    rows, weight = args
    if not all(type(t) is FakeTensor and t.layout is torch.strided and t.constant is None for t in args) \
            or rows.dtype not in (torch.float32, torch.float64) or weight.dtype != rows.dtype \
            or rows.device.type != "cpu" or weight.device != rows.device or weight.fake_mode is not rows.fake_mode \
            or rows.dim() != 2 or weight.dim() != 2 \
            or not (rows._has_symbolic_sizes_strides or weight._has_symbolic_sizes_strides):
        return NotImplemented
    width, depth = rows.shape[1], weight.shape[0]
    if type(width) is not int or type(depth) is not int or width != depth:
        return NotImplemented
    with unset_fake_temporarily():
        meta = torch.empty((rows.shape[0], weight.shape[1]), dtype=rows.dtype, device="meta")
    return FakeTensor(rows.fake_mode, meta, rows.device)


class _Refused(Exception):
    """A step of a view the kernel leaves to the mode (raised before anything is asked that the mode would
    answer otherwise)."""


def _view(args: tuple, kwargs: dict) -> Any:
    """A view (`view`, `_unsafe_view`) on named sizes, shaped by torch's own algorithm
    (`_refs._reshape_view_helper`, which the mode runs for it) re-run on the sizes and strides alone.

    Through the mode each of the algorithm's steps (split an axis, merge axes, squeeze) is an op of its own,
    dispatched through the fake mode with its cache key and entry, an as_strided, each in symbolic
    arithmetic: ~5-10 ms a view. Here the same questions are asked in the same order, of the same
    expressions, through the same functions where `size_one` recognises the asking function
    (`infer_size`, `is_contiguous_or_false`, `_collapse_view_helper` on the input itself), and as plain
    questions where the mode asks them as plain questions (its guards are then this kernel's, one for
    one); the output is one view of the input's storage with the sizes, strides and offset the
    algorithm's last step gives. A merge of axes after a split (the mode would ask it of an intermediate
    view) or any case the algorithm special-cases (no elements, 0-d) goes to the mode, which asks the
    questions asked so far again, answered now without a new guard."""
    from torch._prims_common import infer_size, is_contiguous_or_false
    from torch._subclasses.fake_impls import _view_has_unbacked_input

    if kwargs or len(args) != 2 or not _view_source(args[0]) or not isinstance(args[1], list | tuple):
        return NotImplemented
    source, shape = args
    if torch.fx.experimental._config.backed_size_oblivious or _view_has_unbacked_input(source, shape):
        return NotImplemented
    if len(shape) == 1 and isinstance(shape[0], list | tuple):
        shape = shape[0]
    if not shape or source.dim() == 0 or not all(type(size) is int or isinstance(size, torch.SymInt) for size in shape):
        return NotImplemented
    # the same view of the same layout (as expressions) earlier in the capture: its sizes and strides. The
    # algorithm is a function of those expressions (and of the capture's hints, the same for the same ones), and
    # what its questions taught the ShapeEnv the first time (a guard, a runtime assert) answers them again
    # without a new one: asking again would find the same layout and leave the ShapeEnv as it is. (A decoder's
    # layer folds and unfolds the same rows for each projection: half its views; tests/test_symbolic_kernels.py
    # holds a capture with the memo against one without it, node by node and guard by guard.)
    made = _view_layouts(source)
    key = (_expressions(source.shape), _expressions(source.stride()), _expressions(shape)) if made is not None else None
    layout = made.get(key) if made is not None else None
    if layout is None:
        layout = _view_layout(source, shape, infer_size, is_contiguous_or_false)
        if layout is None:
            return NotImplemented
        if made is not None:
            made[key] = layout
    sizes, strides = layout
    return elementwise.aliasing(source, list(sizes), list(strides), source.storage_offset())


def _view_layouts(source: Any) -> dict[tuple, tuple[tuple, tuple]] | None:
    """The capture's views made so far, {(sizes, strides, asked shape) as expressions: (sizes, strides)}: a sweep's
    ShapeEnv keeps them (size_one); None under any other."""
    return getattr(source.fake_mode.shape_env, "view_layouts", None)


def _expressions(values: Any) -> tuple:
    """Sizes or strides as sympy expressions (ints as themselves)."""
    return tuple(value.node.expr if isinstance(value, torch.SymInt) else value for value in values)


def _view_layout(source: Any, shape: Any, infer_size: Any, is_contiguous_or_false: Any) -> tuple[tuple, tuple] | None:
    """The (sizes, strides) torch's algorithm gives a view of `source` as `shape`, asking what the mode asks, in its
    order (see `_view`); None where the kernel leaves the view to the mode."""
    shape = infer_size(tuple(shape), source.numel())
    if source.numel() == 0:  # (asked as the mode asks it)
        return None
    if is_contiguous_or_false(source):
        if len(shape) == 1 and source.dim() > 1:
            return (source.numel(),), (1,)
        if len(shape) == 2 and source.dim() == 1:
            return tuple(shape), (shape[1], 1)
    shape_numel = functools.reduce(operator.mul, shape, 1)
    torch._check(source.numel() == shape_numel,
                 lambda: f"Could not reshape a tensor with shape {source.shape} as a tensor with shape {shape}!")
    try:
        sizes, strides = _reshape_view_steps(source, shape)
    except _Refused:
        return None
    return tuple(sizes), tuple(strides)


def _reshape_view_steps(source: Any, shape: tuple) -> tuple[list, list]:
    """torch's `_reshape_view_helper_core_alg` (allow_copy=False) on (sizes, strides): the view's layout."""
    from torch._prims import _collapse_view_helper
    from torch._prims_common import validate_dim_length

    sizes, strides = list(source.shape), list(source.stride())
    split = False  # whether the layout is still the input's (a merge asks its questions of the input itself)

    def split_dim(dim: int, outer: Any) -> None:  # prims.split_dim's meta
        validate_dim_length(outer)
        inner = sizes[dim] // outer
        if (sizes[dim] % outer) != 0:
            raise _Refused
        stride = strides[dim]
        sizes[dim:dim + 1] = [outer, inner]
        strides[dim:dim + 1] = [stride * inner, stride]

    idx = 0
    for length in shape:
        if idx >= len(sizes):  # a tail unsqueeze
            if length != 1:
                raise _Refused
            split_dim(len(sizes) - 1, sizes[-1])
            split = True
            idx += 1
            continue
        if length == sizes[idx]:
            idx += 1
            continue
        accum, end = sizes[idx], idx
        while accum % length != 0:
            end += 1
            if end >= len(sizes):
                raise _Refused
            accum *= sizes[end]
        if end != idx:
            if split:  # the mode asks the merge's questions of an intermediate view
                raise _Refused
            new_shape, new_strides = _collapse_view_helper(source, idx, end, must_be_valid=None)
            if new_shape is None:  # not a view: the mode raises (view) or copies (reshape)
                raise _Refused
            sizes, strides = list(new_shape), list(new_strides)
        if accum != length:
            split_dim(idx, length)
        split = split or end != idx or accum != length
        idx += 1
    while idx < len(sizes):  # a tail squeeze (a flatten of a 1 x 1 map): of constant 1s, whose check and
        if type(sizes[idx]) is not int or sizes[idx] != 1:  # squeeze ask nothing; a named size takes the mode
            raise _Refused
        del sizes[idx], strides[idx]
    return sizes, strides


def _transpose(args: tuple, kwargs: dict) -> Any:
    """`transpose(a, d0, d1)` on named sizes: the C++ kernel the mode runs swaps the two axes' sizes and
    strides (an alias where they are one axis); no question is asked, but the mode's cache entry and its
    as_strided are symbolic arithmetic (~5 ms)."""
    if kwargs or len(args) != 3 or not _view_source(args[0]) or type(args[1]) is not int or type(args[2]) is not int:
        return NotImplemented
    source, first, second = args
    rank = source.dim()
    if rank == 0 or not (-rank <= first < rank and -rank <= second < rank):
        return NotImplemented
    first, second = first % rank, second % rank
    sizes, strides = list(source.shape), list(source.stride())
    sizes[first], sizes[second] = sizes[second], sizes[first]
    strides[first], strides[second] = strides[second], strides[first]
    return elementwise.aliasing(source, sizes, strides, source.storage_offset())


def _unsqueeze(args: tuple, kwargs: dict) -> Any:
    """`unsqueeze(a, d)` on named sizes: the C++ kernel the mode runs inserts a size 1 whose stride is the next
    axis's size times its stride (1 at the end); no question, only the mode's cache entry and as_strided."""
    if kwargs or len(args) != 2 or not _view_source(args[0]) or type(args[1]) is not int:
        return NotImplemented
    source, dim = args
    rank = source.dim() + 1
    if not -rank <= dim < rank:
        return NotImplemented
    dim %= rank
    sizes, strides = list(source.shape), list(source.stride())
    stride = 1 if dim >= source.dim() else sizes[dim] * strides[dim]
    sizes.insert(dim, 1)
    strides.insert(dim, stride)
    return elementwise.aliasing(source, sizes, strides, source.storage_offset())


def _slice(args: tuple, kwargs: dict) -> Any:
    """`slice(a, dim, start, end, step)` on named sizes by the mode's own Python kernel for it
    (`fake_impls.slice_forward`: the same questions from the same function), handed the input behind a
    stand-in whose as_strided is one view of its storage: through the mode that as_strided is an op of its
    own with its cache entry, besides the slice's (~5 ms a slice). Unbacked sizes (where that kernel would
    make a new symbol) go to the mode."""
    from torch._subclasses.fake_impls import slice_forward
    from fxflops.capture.torch_versions import has_guarding_hint

    if len(args) < 1 or not _view_source(args[0]) or set(kwargs) - {"dim", "start", "end", "step"}:
        return NotImplemented
    names = ("dim", "start", "end", "step")
    values = dict(zip(names, args[1:]), **kwargs)
    source = args[0]
    if len(args) > 5 or any(type(v) is not int and not isinstance(v, torch.SymInt)
                            for name, v in values.items() if v is not None or name in ("dim", "step")):
        return NotImplemented
    if type(values.get("dim", 0)) is not int or type(values.get("step", 1)) is not int \
            or not all(has_guarding_hint(v) for v in (*source.shape, *source.stride(), source.storage_offset(),
                                                      *(v for v in values.values() if v is not None))):
        return NotImplemented
    return slice_forward(source.fake_mode, aten.slice.Tensor, _Sliced(source), **values)


class _Sliced:
    """A fake tensor as `fake_impls.slice_forward` reads it, its as_strided a direct view of its storage."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.is_quantized = False

    def dim(self) -> int:
        return self.source.dim()

    def size(self) -> Any:
        return self.source.size()

    def stride(self) -> Any:
        return self.source.stride()

    def storage_offset(self) -> Any:
        return self.source.storage_offset()

    def as_strided(self, sizes: list, strides: list, offset: Any) -> Any:
        return elementwise.aliasing(self.source, list(sizes), list(strides), offset)


def _split(args: tuple, kwargs: dict) -> Any:
    """`split(a, size, dim)` (`split_with_sizes(a, sizes, dim)`) along an axis of static size, into pieces of static
    sizes, on named sizes: the mode runs torch's composite, a `narrow` (a `slice`) per piece, each through the
    mode with its cache entry and as_strided (~1 ms a call: GPT-2's query, key and value split from one
    projection). What it gives is each piece as a view of the input's storage, the axis's size the piece's, the
    strides the input's, the offset the input's plus the piece's start times the axis's stride; its checks are of
    the static sizes alone (no question of a named size). tests/test_symbolic_kernels.py holds it against the
    mode: sizes, strides, offsets, storage and the ShapeEnv."""
    if len(args) < 2 or len(args) > 3 or set(kwargs) - {"dim"} or not _view_source(args[0]):
        return NotImplemented
    source, pieces = args[0], args[1]
    dim = kwargs.get("dim", args[2] if len(args) == 3 else 0)
    rank = source.dim()
    if type(dim) is not int or rank == 0 or not -rank <= dim < rank:
        return NotImplemented
    dim %= rank
    length = source.shape[dim]
    if type(length) is not int or length == 0:
        return NotImplemented
    if type(pieces) is int:  # split: pieces of that size, the last one what is left
        if pieces <= 0:
            return NotImplemented
        pieces = [min(pieces, length - start) for start in range(0, length, pieces)]
    elif not isinstance(pieces, list | tuple) or not pieces \
            or any(type(piece) is not int or piece < 0 for piece in pieces) or sum(pieces) != length:
        return NotImplemented
    sizes, strides, offset = list(source.shape), list(source.stride()), source.storage_offset()
    out, start = [], 0
    for piece in pieces:
        sizes[dim] = piece
        at = offset + start * strides[dim] if start else offset
        out.append(elementwise.aliasing(source, list(sizes), strides, at))
        start += piece
    return out


def _view_source(source: Any) -> bool:
    """A strided fake tensor with named sizes, not a constant (the mode would carry a constant's value)."""
    return type(source) is FakeTensor and source._has_symbolic_sizes_strides and source.layout is torch.strided \
        and source.constant is None and not source.is_sparse and not source.is_quantized


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
    if not _known_above(numel, channels if training else 0) or not _contiguous(source):
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


# the torch functions symbolic_function answers: the recorder asks it about these only (every other call of a
# capture passes this membership test alone)
SYMBOLIC_FUNCTIONS = frozenset((torch.nn.functional.batch_norm, torch.batch_norm))


def symbolic_function(func: Any, args: tuple, kwargs: dict) -> Any:
    """A torch function's result on named sizes where it is known at every point without running it, with the aten
    calls it would dispatch (`(op, args, kwargs, outputs)` each, in its order: the recorder records them as its
    dispatch would); else NotImplemented."""
    if func is torch.nn.functional.batch_norm:
        return _functional_batch_norm(args, kwargs)
    return _batch_norm_function(args, kwargs) if func is torch.batch_norm else NotImplemented


def _functional_batch_norm(args: tuple, kwargs: dict) -> Any:
    """`F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)` in eval (as its
    torch-function override hands it: three positional, the rest by name): its Python asks nothing more then (in
    training it checks the values per channel, a question left to it) and calls `torch.batch_norm`
    (`_batch_norm_function`)."""
    if len(args) != 3 or not kwargs.keys() <= _FUNCTIONAL_BATCH_NORM.keys():
        return NotImplemented
    source, running_mean, running_var = args
    weight, bias, training, momentum, eps = ({**_FUNCTIONAL_BATCH_NORM, **kwargs}[name] for name in _FUNCTIONAL_BATCH_NORM)
    if training is not False:
        return NotImplemented
    return _batch_norm_function((source, weight, bias, running_mean, running_var, training, momentum, eps, True), {})


# F.batch_norm's arguments after the first three, with their defaults
_FUNCTIONAL_BATCH_NORM = MappingProxyType({"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5})


def _batch_norm_function(args: tuple, kwargs: dict) -> Any:
    """`torch.batch_norm` where `_batch_norm_on_cpu` shapes the `native_batch_norm` it runs.

    Its C++ composite (`_batch_norm_impl_index`, on a CPU input) asks `input.sym_numel() == 0`, matches each
    statistic's numel against the channels, makes its reserve (`empty([0])` in bytes) and its `native_batch_norm`
    (the first 8 arguments, momentum and eps as floats) through the dispatcher, and returns the first output: where
    the kernel shapes that call, its checks proved the numel above 0 from the sizes' assumptions (torch's question
    is then the constant False: no guard) and the statistics [C]. Only without autograd (no grad_fn to make) and
    autocast (which casts the operands first): torch's composite has no other effect on fake tensors (the running
    statistics' version counters stay). tests/test_symbolic_kernels.py holds it against torch's own: the nodes,
    outputs and the ShapeEnv's guards."""
    if kwargs or len(args) != 9 or torch._C._is_any_autocast_enabled() or not isinstance(args[8], bool):
        return NotImplemented
    source, weight, bias, running_mean, running_var, training, momentum, eps = args[:8]
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in args[:5]):
        return NotImplemented
    if type(momentum) not in (float, int) or type(eps) not in (float, int):
        return NotImplemented
    native = (source, weight, bias, running_mean, running_var, training, float(momentum), float(eps))
    out = _batch_norm_on_cpu(native, {})
    if out is NotImplemented:
        return NotImplemented
    with unset_fake_temporarily():
        reserve = FakeTensor(source.fake_mode, torch.empty(0, dtype=torch.uint8, device="meta"), source.device)
    reserve_kwargs = {"dtype": torch.uint8, "layout": torch.strided, "device": source.device}
    return out[0], ((aten.empty.memory_format, ([0],), reserve_kwargs, reserve),
                    (aten.native_batch_norm.default, native, {}, out))


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
    if not fits or bias is not None and tuple(bias.shape) != (out_channels,) or not _known_above(source.numel(), 0) \
            or not _contiguous(source):
        return NotImplemented
    # a side whose size (as an expression) and numbers are those of a side before it, in this call (a square map
    # under a square kernel) or in an earlier one of the capture (the blocks of a stage), gets that side's output
    # size: the same expressions from the same operations, made and checked once (its checks hold at every point
    # the capture allows then, and a capture only narrows those points); the others in torch's order: every fit,
    # then every formula, then every side > 0
    sides = list(zip(source.shape[2:], padding, dilation, weight.shape[2:], stride, output_padding))
    keys = [(transposed, type(size), size.node.expr if isinstance(size, torch.SymInt) else size, *numbers)
            for size, *numbers in sides]
    made_before = getattr(source.fake_mode.shape_env, "convolution_sides", None)  # (a sweep's: size_one)
    made = {key: made_before[key] for key in keys if made_before is not None and key in made_before}
    distinct: dict[tuple, tuple] = {}
    for key, side in zip(keys, sides):
        if key not in made:
            distinct.setdefault(key, side)
    if transposed:  # torch's _formula_transposed
        new = {key: (size - 1) * step - 2 * pad + wide * (k - 1) + extra + 1
               for key, (size, pad, wide, k, step, extra) in distinct.items()}
    else:
        padded = {key: size + 2 * pad for key, (size, pad, *_) in distinct.items()}
        if not all(_known_above(padded[key], wide * (k - 1) + 1, inclusive=True)
                   for key, (_, _, wide, k, _, _) in distinct.items()):
            return NotImplemented
        # torch's _formula, in its order of operations (the same expressions)
        new = {key: (padded[key] - wide * (k - 1) - 1) // step + 1
               for key, (_, _, wide, k, step, _) in distinct.items()}
    if not all(_known_above(side, 0) for side in new.values()):
        return NotImplemented
    if made_before is not None:
        made_before.update(new)
    made.update(new)
    out = [made[key] for key in keys]
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
    if contiguous_as_expressions(source):  # the same expressions: nothing to ask (a tenth of the questions' cost)
        return True
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


def _known_above(size: Any, bound: int, inclusive: bool = False) -> bool:
    """`_known(size > bound)` (`size >= bound` with `inclusive`) of an int or SymInt size and an int bound.

    torch's symbolic layer makes that question the sympy relation of the two expressions (`Gt(size, bound)`),
    which sympy decides from the sizes' assumptions where it can (a product of positive sizes is above 0); where
    it decides it true the SymBool is that constant, and `_known` reads it as such. The relation is made here as
    torch makes it and read where it is that constant, without the SymBool around it (the Python of torch's
    symbolic layer: ~25 us a question, ~160 of them a ResNet-50 sweep capture); anything else is asked as before."""
    if isinstance(size, torch.SymInt):
        import sympy

        expr = size.node.expr
        # the same question of the same expression asked before in the capture: sympy's answer is a function of
        # the expression alone (its facts), so a True it gave is kept (a sweep's ShapeEnv: size_one)
        decided = getattr(size.node.shape_env, "sympy_above", None)
        if decided is not None and (expr, bound, inclusive) in decided:
            return True
        relation = (sympy.Ge if inclusive else sympy.Gt)(expr, sympy.Integer(bound))
        if relation is sympy.true:
            if decided is not None:
                decided.add((expr, bound, inclusive))
            return True
    return _known(size >= bound if inclusive else size > bound)


def _mean(args: tuple, kwargs: dict) -> Any:
    """A mean over trailing axes of a map of 4 or more axes (an adaptive 1 x 1 pool: symbolic_pooling), else
    over the last axis of a tensor not 4-d or 5-d (an RMSNorm: symbolic_elementwise); each takes only cases
    whose every question is known without a guard (each held against the mode), else NotImplemented."""
    made = mean_over_trailing_axes(args, kwargs)
    return elementwise.mean(args, kwargs) if made is NotImplemented else made


# each op's kernel (a read-only table: symbolic_kernel is asked of every op of a symbolic capture)
_KERNELS = MappingProxyType({
    aten.native_batch_norm.default: _batch_norm_on_cpu, aten.convolution.default: _convolution_on_cpu,
    aten.cat.default: _cat, aten.view.default: _view, aten._unsafe_view.default: _view,
    aten.transpose.int: _transpose, aten.unsqueeze.default: _unsqueeze, aten.slice.Tensor: _slice,
    aten.split.Tensor: _split, aten.split_with_sizes.default: _split,
    aten.addmm.default: _addmm, aten.mm.default: _mm, aten.native_layer_norm.default: lambda args, kwargs: layer_norm_on_cpu(args, kwargs, _contiguous),
    aten.max_pool2d_with_indices.default: max_pool2d_with_indices,
    aten.relu_.default: relu_in_place,
    aten.add_.Tensor: add_in_place,
    aten.add.Tensor: elementwise.binary,
    aten.sub.Tensor: elementwise.binary,
    aten.mul.Tensor: elementwise.multiplying,
    aten.div.Tensor: elementwise.dividing,
    aten.neg.default: elementwise.negating,
    aten.rsqrt.default: elementwise.unary,
    aten.pow.Tensor_Scalar: elementwise.unary,
    aten.mean.dim: _mean,
})
