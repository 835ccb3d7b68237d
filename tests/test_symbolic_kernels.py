"""capture.symbolic_kernels' convolution against torch's own fake convolution on the same symbolic input:
the same output (shape, strides, dtype) and no guard torch would not ask, over dimensions, strides,
paddings, dilations, groups, 1 x 1 and depthwise kernels, transposed ones; and sweeps of convnets equal to
estimate() node by node on both sides of every size the kernels' checks care about."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import fxflops
from fxflops.sweeps import sweep

CONVOLUTION = torch.ops.aten.convolution.default


def _symbolic_run(kernel, batch: int, channels: int, sides: tuple[int, ...], weight_shape: tuple[int, ...],
                  bias: int, channels_last_weight: bool = False, one_side: bool = False):
    """(output layout, guards) of `kernel(input, weight, bias)` (a bias of `bias` values, or none) on an input
    [batch, channels, *sides] whose batch and sides are symbolic (a sweep's ShapeEnv; `one_side`: every side is
    one symbol, as a square image's), with oneDNN and NNPACK off as a sweep's capture has them."""
    outputs, guards = _symbolic_runs(lambda x, w, b: [kernel(x, w, b)], batch, channels, sides, weight_shape, bias,
                                     channels_last_weight, one_side)
    return (None, None) if outputs[0] is None else (outputs[0], guards)


def _symbolic_runs(kernels, batch: int, channels: int, sides: tuple[int, ...], weight_shape: tuple[int, ...],
                   bias: int, channels_last_weight: bool = False, one_side: bool = False):
    """(each output's layout or None, guards) of `kernels(input, weight, bias)`, a list of outputs (as
    _symbolic_run's), all under one ShapeEnv."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxflops.capture.size_one import size_one_shape_env

    env = size_one_shape_env()
    sizes = []
    for index, hint in enumerate((batch, *sides)):
        source = ConstantSource(f"size{index}")
        symbol = env.create_symbol(hint, source=source, do_not_specialize_zero_one=True)
        sizes.append(env.create_symintnode(symbol, hint=hint, source=source))
        if one_side and index == 1:
            sizes += [sizes[1]] * (len(sides) - 1)
            break
    mode = FakeTensorMode(shape_env=env, static_shapes=True)
    weight = torch.empty(weight_shape)
    if channels_last_weight:
        weight = weight.to(memory_format=torch.channels_last)
    weight = mode.from_tensor(weight)
    bias_tensor = mode.from_tensor(torch.empty(bias)) if bias else None
    mkldnn, nnpack = torch._C._get_mkldnn_enabled(), torch._C._get_nnpack_enabled()
    torch._C._set_mkldnn_enabled(False)
    torch._C._set_nnpack_enabled(False)
    try:
        with mode:
            outputs = kernels(torch.empty(sizes[0], channels, *sizes[1:]), weight, bias_tensor)
    finally:
        torch._C._set_mkldnn_enabled(mkldnn)
        torch._C._set_nnpack_enabled(nnpack)
    layouts = [None if out is NotImplemented else (tuple(map(str, out.shape)), tuple(map(str, out.stride())), out.dtype)
               for out in outputs]
    return layouts, {str(g.expr) for g in env.guards}


CASES = [
    # (sides, channels, out or in-per-group channels, kernel, stride, padding, dilation, groups, transposed, output_padding)
    ((9, 11), 3, 8, (3, 3), (2, 2), (1, 1), (1, 1), 1, False, (0, 0)),
    ((9, 11), 4, 6, (1, 1), (1, 1), (0, 0), (1, 1), 2, False, (0, 0)),
    ((9, 11), 6, 6, (3, 3), (1, 2), (2, 1), (2, 1), 6, False, (0, 0)),  # depthwise, dilated
    ((7, 7), 3, 4, (7, 7), (2, 2), (3, 3), (1, 1), 1, False, (0, 0)),  # a stem: 7 x 7, stride 2
    ((5, 8), 2, 3, (2, 3), (3, 1), (1, 2), (1, 2), 1, False, (0, 0)),
    ((17,), 4, 5, (3,), (2,), (1,), (1,), 1, False, (0,)),  # 1d
    ((17,), 4, 4, (1,), (1,), (0,), (1,), 4, False, (0,)),  # 1d depthwise 1 x 1
    ((5, 6, 7), 2, 3, (3, 3, 3), (1, 2, 1), (1, 1, 2), (1, 1, 2), 1, False, (0, 0, 0)),  # 3d
    ((9, 11), 4, 3, (3, 3), (2, 2), (1, 1), (1, 1), 1, True, (1, 0)),  # transposed
    ((9,), 4, 2, (4,), (3,), (1,), (1,), 2, True, (2,)),  # transposed 1d, grouped
    ((4, 5, 6), 2, 2, (2, 2, 2), (2, 2, 2), (0, 0, 0), (1, 1, 1), 1, True, (0, 0, 0)),  # transposed 3d
]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_the_symbolic_convolution_gives_what_the_fake_convolution_gives(case, bias):
    from fxflops.capture.symbolic_kernels import symbolic_kernel

    sides, channels, other, kernel, stride, padding, dilation, groups, transposed, output_padding = case
    weight_shape = (channels, other, *kernel) if transposed else (other, channels // groups, *kernel)
    bias = (groups * other if transposed else other) if bias else 0
    arguments = (list(stride), list(padding), list(dilation), transposed, list(output_padding), groups)
    for batch in (2, 3):
        ours, our_guards = _symbolic_run(lambda x, w, b: symbolic_kernel(CONVOLUTION, (x, w, b, *arguments), {}),
                                         batch, channels, sides, weight_shape, bias)
        theirs, their_guards = _symbolic_run(lambda x, w, b: CONVOLUTION(x, w, b, *arguments), batch, channels, sides,
                                             weight_shape, bias)
        assert ours is not None, "the kernel takes this convolution"
        assert ours == theirs and our_guards <= their_guards


@pytest.mark.parametrize("case", CASES)
def test_sides_of_one_size_give_what_the_fake_convolution_gives(case):
    """A map whose sides are one size (a square image): the kernel makes a side equal to one before it (size and
    numbers) once and reuses it; the output and guards are still the mode's, where the numbers differ too."""
    from fxflops.capture.symbolic_kernels import symbolic_kernel

    sides, channels, other, kernel, stride, padding, dilation, groups, transposed, output_padding = case
    weight_shape = (channels, other, *kernel) if transposed else (other, channels // groups, *kernel)
    arguments = (list(stride), list(padding), list(dilation), transposed, list(output_padding), groups)
    sides = (max(sides),) * len(sides)
    ours, our_guards = _symbolic_run(lambda x, w, b: symbolic_kernel(CONVOLUTION, (x, w, b, *arguments), {}),
                                     2, channels, sides, weight_shape, 0, one_side=True)
    theirs, their_guards = _symbolic_run(lambda x, w, b: CONVOLUTION(x, w, b, *arguments), 2, channels, sides,
                                         weight_shape, 0, one_side=True)
    assert ours is not None, "the kernel takes this convolution"
    assert ours == theirs and our_guards <= their_guards


def test_a_side_made_by_an_earlier_convolution_of_the_capture_is_what_the_mode_gives():
    """Convolutions of one capture on maps of one size: a later one takes an earlier one's output side for the same
    size and numbers (size_one's ShapeEnv keeps it) and gives what the mode gives, guards included; a padding of its
    own is made anew."""
    from fxflops.capture.symbolic_kernels import symbolic_kernel

    strided = ([2, 2], [1, 1], [1, 1], False, [0, 0], 1)
    wider = ([2, 2], [2, 2], [1, 1], False, [0, 0], 1)

    def three(convolve):
        # the second on a new input of the same sizes: its side is the first's, from the ShapeEnv's record
        return lambda x, w, b: [convolve(x, w, b, strided), convolve(torch.empty_like(x), w, b, strided),
                                convolve(x, w, b, wider)]

    ours, our_guards = _symbolic_runs(three(lambda x, w, b, arguments: symbolic_kernel(
        CONVOLUTION, (x, w, b, *arguments), {})), 2, 4, (9, 9), (8, 4, 3, 3), 0, one_side=True)
    theirs, their_guards = _symbolic_runs(three(lambda x, w, b, arguments: CONVOLUTION(x, w, b, *arguments)),
                                          2, 4, (9, 9), (8, 4, 3, 3), 0, one_side=True)
    assert None not in ours and ours == theirs and our_guards <= their_guards


def test_a_channels_last_weight_or_a_too_small_input_goes_through_the_mode():
    from fxflops.capture.symbolic_kernels import symbolic_kernel

    arguments = ([1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    run = lambda x, w, b: symbolic_kernel(CONVOLUTION, (x, w, b, *arguments), {})  # noqa: E731
    assert _symbolic_run(run, 2, 4, (5, 5), (8, 4, 3, 3), 0, channels_last_weight=True) == (None, None)
    # a 5 x 5 kernel over sides that may be 2: whether it fits is a guard torch asks (the mode asks it)
    assert _symbolic_run(run, 2, 4, (6, 6), (8, 4, 5, 5), 0) == (None, None)
    # one input channel: its contiguous layout may be channels-last too (a 1 x 1 map)
    assert _symbolic_run(run, 2, 1, (6, 6), (8, 1, 3, 3), 0) == (None, None)


class Convs(nn.Module):
    """Convolutions of each kind in a row: strided, dilated, grouped, depthwise 1 x 1, transposed."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 5, stride=2, padding=2)
        self.dilated = nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=2, bias=False)
        self.pointwise = nn.Conv2d(8, 8, 1, groups=8)
        self.up = nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1)
        self.line = nn.Conv1d(4, 6, 3, stride=3, padding=1)

    def forward(self, x):
        x = self.up(self.pointwise(self.dilated(self.stem(x))))
        return self.line(x.flatten(2))


def test_a_convnet_sweep_counts_every_point_as_estimate_does():
    model = Convs().eval()
    swept = sweep(model, torch.zeros(2, 3, 12, 12), dims={"batch": 0, "size": (2, 3)})
    for batch, size in itertools.product((1, 2, 5), (1, 2, 3, 7, 12, 31)):
        at, fresh = swept.at(batch=batch, size=size), fxflops.estimate(model, torch.zeros(batch, 3, size, size))
        assert (at.total_macs, at.total_flops, at.total_bytes) == (fresh.total_macs, fresh.total_flops, fresh.total_bytes)
        assert at.nodes == fresh.nodes
    assert len(swept.pieces) == 1
    side = lambda n: (n + 4 - 4 - 1) // 2 + 1  # noqa: E731 - the stem's output side, by hand
    up = 2 * side(9)  # (side - 1) * 2 - 2 + 2 + 1 + 1
    line = (up * up + 2 - 3) // 3 + 1
    by_hand = 2 * (8 * side(9) ** 2 * 3 * 25 + 8 * side(9) ** 2 * 4 * 9 + 8 * side(9) ** 2
                   + 8 * side(9) ** 2 * 4 * 9 + 6 * line * 4 * 3)
    assert swept.at(batch=2, size=9).total_macs == by_hand


CAT = torch.ops.aten.cat.default
# (tensors from symbolic batch b and seq s, dim): a cache's empty start before keys (transposed heads), more
# than one joined, two empties, a 5-d permuted one; and ones the kernel leaves to the mode
CAT_CASES = {
    "cache start": lambda b, s: ([torch.tensor([]), torch.empty(b, s, 2, 8).transpose(1, 2)], -2),
    "3-d": lambda b, s: ([torch.tensor([]), torch.empty(b, s, 8)], 1),
    "two joined": lambda b, s: ([torch.tensor([]), torch.empty(b, 2, s, 8).transpose(1, 2),
                                 torch.empty(b, 3, s, 8).transpose(1, 2)], 2),
    "two empties": lambda b, s: ([torch.tensor([]), torch.empty(b, s, 8), torch.tensor([])], 0),
    "5-d": lambda b, s: ([torch.tensor([]), torch.empty(b, 3, s, 2, 2).permute(0, 2, 1, 3, 4)], 2),
}
CAT_REFUSED = {
    "first not 1-d": lambda b, s: ([torch.empty(b, s, 8), torch.tensor([])], 1),
    "two dtypes": lambda b, s: ([torch.tensor([], dtype=torch.float16), torch.empty(b, s, 8)], 1),
    "1-d of a named size": lambda b, s: ([torch.empty(s), torch.empty(b)], 0),
    "other axis of another size": lambda b, s: ([torch.tensor([]), torch.empty(b, s, 8), torch.empty(s, s, 8)], 2),
}


def _cat_run(kernel, build):
    """(output layout and constant, guards) of `kernel(tensors, dim)` on tensors of symbolic sizes b=2, s=7."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxflops.capture.size_one import size_one_shape_env

    env = size_one_shape_env()
    sizes = []
    for name, hint in (("b", 2), ("s", 7)):
        source = ConstantSource(name)
        sizes.append(env.create_symintnode(env.create_symbol(hint, source=source, do_not_specialize_zero_one=True),
                                           hint=hint, source=source))
    with FakeTensorMode(shape_env=env, static_shapes=True):
        out = kernel(*build(*sizes))
    if out is NotImplemented:
        return None
    return (tuple(map(str, out.shape)), tuple(map(str, out.stride())), out.dtype, out.constant), \
        {str(g.expr) for g in env.guards}


@pytest.mark.parametrize("case", CAT_CASES)
def test_the_symbolic_cat_after_an_empty_start_gives_what_the_mode_gives(case):
    from fxflops.capture.symbolic_kernels import symbolic_kernel

    direct = _cat_run(lambda tensors, dim: symbolic_kernel(CAT, (tensors, dim), {}), CAT_CASES[case])
    assert direct is not None
    assert direct == _cat_run(lambda tensors, dim: CAT(tensors, dim), CAT_CASES[case])


@pytest.mark.parametrize("case", CAT_REFUSED)
def test_a_cat_the_kernel_cannot_shape_without_a_question_goes_through_the_mode(case):
    from fxflops.capture.symbolic_kernels import symbolic_kernel

    assert _cat_run(lambda tensors, dim: symbolic_kernel(CAT, (tensors, dim), {}), CAT_REFUSED[case]) is None


VIEW, UNSAFE_VIEW, TRANSPOSE = torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.transpose.int
UNSQUEEZE, SLICE, ADDMM = torch.ops.aten.unsqueeze.default, torch.ops.aten.slice.Tensor, torch.ops.aten.addmm.default


def _state(env) -> tuple:
    """What a ShapeEnv learned: its guards in order, runtime asserts, replacements and ranges."""
    return ([str(g.expr) for g in env.guards],
            sorted(str(a.expr) for asserts in env.deferred_runtime_asserts.values() for a in asserts),
            sorted((str(k), str(v)) for k, v in env.replacements.items()),
            sorted((str(k), str(v)) for k, v in env.var_to_range.items()))


def _named_sizes(hints):
    """A sweep's ShapeEnv and its symbolic sizes b and s (hints given)."""
    from torch._dynamo.source import ConstantSource

    from fxflops.capture.size_one import size_one_shape_env

    env = size_one_shape_env()
    sizes = []
    for name, hint in zip(("b", "s"), hints):
        source = ConstantSource(name)
        sizes.append(env.create_symintnode(env.create_symbol(hint, source=source, do_not_specialize_zero_one=True),
                                           hint=hint, source=source))
    return env, sizes


def symbolic_call(op, build, hints, direct):
    """(inputs, output, ShapeEnv) of `op(*build(b, s))` on symbolic sizes b and s (hints given) under a sweep's
    ShapeEnv, through symbolic_kernel (NotImplemented where it leaves the op to the mode) or through the mode;
    an error the mode raises is returned as its type's name (inputs and ShapeEnv None)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxflops.capture.symbolic_kernels import symbolic_kernel

    env, sizes = _named_sizes(hints)
    with FakeTensorMode(shape_env=env, static_shapes=True):
        args = build(*sizes)
        try:
            return args, symbolic_kernel(op, args, {}) if direct else op(*args), env
        except Exception as error:  # noqa: BLE001 - the mode's own refusal, compared by kind
            return None, type(error).__name__, None


def _layout_run(op, build, hints=(2, 7), direct=True):
    """(output layout, ShapeEnv state) of `op(*build(b, s))` (`symbolic_call`): None where the kernel leaves the
    op to the mode; an error the mode raises is returned as its type."""
    args, out, env = symbolic_call(op, build, hints, direct)
    if isinstance(out, str):
        return out, None
    if out is NotImplemented:
        return None, None
    source = args[0]
    layout = (tuple(map(str, out.shape)), tuple(map(str, out.stride())), str(out.storage_offset()), out.dtype,
              out.device, out.requires_grad, out.untyped_storage()._cdata == source.untyped_storage()._cdata)
    return layout, _state(env)


# (op, inputs from symbolic batch b and seq s): views a decoder makes (heads split and merged, a linear's
# rows folded and unfolded), ones on strided inputs (a slice, an offset), size-1 axes, -1 inferred
VIEW_CASES = {
    "heads split": (VIEW, lambda b, s: (torch.empty(b, s, 48), [b, s, -1, 8])),
    "heads merged": (VIEW, lambda b, s: (torch.empty(b, s, 6, 8), [b, s, 48])),
    "rows folded": (VIEW, lambda b, s: (torch.empty(b, s, 48), [-1, 48])),
    "rows unfolded": (UNSAFE_VIEW, lambda b, s: (torch.empty(b * s, 48), [b, s, 48])),
    "batch 1 folded": (VIEW, lambda b, s: (torch.empty(1, s, 48), [-1, 48])),
    "all to 1-d": (VIEW, lambda b, s: (torch.empty(b, s, 4), [-1])),
    "1-d to 2-d": (VIEW, lambda b, s: (torch.empty(s * 4), [s, 4])),
    "a slice's last axis split": (VIEW, lambda b, s: (torch.empty(b, s, 48)[:, :, :16], [b, s, 2, 8])),
    "an offset": (VIEW, lambda b, s: (torch.empty(b, s + 1, 48)[:, 1:], [b, s, 6, 8])),
    "an offset, merged": (VIEW, lambda b, s: (torch.empty(3, b, s, 8)[1], [b * s, 8])),
    "size-1 axis kept": (VIEW, lambda b, s: (torch.empty(b, 1, s, 8), [b, 1, s, 2, 4])),
    "size-1 axis dropped": (VIEW, lambda b, s: (torch.empty(b, 1, s, 8), [b, s, 8])),
    "size-1 axis added": (VIEW, lambda b, s: (torch.empty(b, s, 8), [b, 1, s, 8])),
    "tail unsqueeze": (VIEW, lambda b, s: (torch.empty(b, s), [b, s, 1])),
    "tail squeeze": (VIEW, lambda b, s: (torch.empty(b, s, 1), [b, s])),
    "flatten of a 1 x 1 map": (VIEW, lambda b, s: (torch.empty(b, 8, 1, 1), [b, 8])),
    "tail squeezes after a merge": (VIEW, lambda b, s: (torch.empty(b, s, 4, 1, 1), [b, s * 4])),
    "tail squeeze after a split": (VIEW, lambda b, s: (torch.empty(b, 6, 1), [b, 2, 3])),
    "tail squeeze of a strided map": (VIEW, lambda b, s: (torch.empty(b, 8, 3, 3)[:, :, 1:2, 2:], [b, 8])),
    "a batch's own axis": (VIEW, lambda b, s: (torch.empty(b, s, 8), [b, s * 8])),
    "a strided size-1 axis": (VIEW, lambda b, s: (torch.empty(b, 4, s, 8)[:, :1], [b, s, 8])),
    "transposed, split": (VIEW, lambda b, s: (torch.empty(b, 6, s, 8).transpose(1, 2), [b, s, 6, 2, 4])),
    "transpose": (TRANSPOSE, lambda b, s: (torch.empty(b, s, 6, 8), 1, 2)),
    "transpose, negative axes": (TRANSPOSE, lambda b, s: (torch.empty(b, s, 6, 8)[:, 1:], -1, -3)),
    "transpose of one axis": (TRANSPOSE, lambda b, s: (torch.empty(b, s), 1, -1)),
    "unsqueeze inside": (UNSQUEEZE, lambda b, s: (torch.empty(b, s, 8)[:, 1:], 1)),
    "unsqueeze at the end": (UNSQUEEZE, lambda b, s: (torch.empty(b, s, 8).transpose(0, 1), -1)),
    "unsqueeze first": (UNSQUEEZE, lambda b, s: (torch.empty(s, 8), 0)),
    "slice of a static axis": (SLICE, lambda b, s: (torch.empty(b, s, 8), 2, 0, 4)),
    "slice, negative start": (SLICE, lambda b, s: (torch.empty(b, s, 8), -1, -4, 9223372036854775807)),
    "slice, a step": (SLICE, lambda b, s: (torch.empty(b, s, 8)[:, 1:], 2, 1, 7, 2)),
    "slice of a named axis": (SLICE, lambda b, s: (torch.empty(b, s + 3, 8), 1, 0, s)),
    "slice up to a constant": (SLICE, lambda b, s: (torch.empty(b, s, 8), 1, 0, 5)),
    "slice from a named start": (SLICE, lambda b, s: (torch.empty(b, 2 * s, 8), 1, s)),
    "slice past the end": (SLICE, lambda b, s: (torch.empty(b, s, 8), 0, 1, 100)),
    "slice, nothing given": (SLICE, lambda b, s: (torch.empty(b, s, 8), 1)),
    "addmm of rows": (ADDMM, lambda b, s: (torch.empty(6), torch.empty(s, 4), torch.empty(4, 6))),
    "addmm of folded rows": (ADDMM, lambda b, s: (torch.empty(6), torch.empty(b * s, 4), torch.empty(4, 6))),
    "addmm of transposed rows": (ADDMM, lambda b, s: (torch.empty(6, dtype=torch.float64),
                                                      torch.empty(4, s, dtype=torch.float64).t(),
                                                      torch.empty(6, 4, dtype=torch.float64).t())),
}
# where an input's size is 1 at the capture's point the mode asks it as a guard: addmm leaves it to the mode
NOT_AT_ONE = {"addmm of rows": (3, 1), "addmm of transposed rows": (3, 1)}
# views the kernel leaves to the mode: a merge after a split, a tail squeeze, a copy (not a view), no elements
VIEW_REFUSED = {
    "merge after a split": (VIEW, lambda b, s: (torch.empty(b, s, 6, 8), [b, s, 3, 16])),
    "transposed, merged": (VIEW, lambda b, s: (torch.empty(b, 6, s, 8).transpose(1, 2), [b, s, 48])),
    "no elements": (VIEW, lambda b, s: (torch.empty(b, s, 0), [b, 0, s])),
    "addmm of a named width": (ADDMM, lambda b, s: (torch.empty(6), torch.empty(4, s), torch.empty(7, 6))),
    "addmm with a 2-d bias": (ADDMM, lambda b, s: (torch.empty(s, 6), torch.empty(s, 4), torch.empty(4, 6))),
    "addmm in half precision": (ADDMM, lambda b, s: (torch.empty(6, dtype=torch.float16),
                                                     torch.empty(s, 4, dtype=torch.float16),
                                                     torch.empty(4, 6, dtype=torch.float16))),
}


@pytest.mark.parametrize("hints", [(2, 7), (1, 7), (3, 1)])
@pytest.mark.parametrize("case", VIEW_CASES)
def test_the_symbolic_view_gives_what_the_mode_gives(case, hints):
    op, build = VIEW_CASES[case]
    direct = _layout_run(op, build, hints)
    if NOT_AT_ONE.get(case) == hints:  # the mode guards on it there: a shortcut would lose that guard
        assert direct == (None, None) and _layout_run(op, build, hints, direct=False)[1][0]
        return
    assert direct[0] is not None, "the kernel takes this view"
    assert direct == _layout_run(op, build, hints, direct=False)


# views that are views only where a size is 1 (merging axes across a transpose, or past a size-1 axis of any stride)
VIEW_AT_SOME_SIZES = {
    "merged across a transpose": lambda b, s: (torch.empty(b, s, 6, 8).transpose(1, 2), [b, 6 * s * 8]),
    "merged past a strided size-1 axis": lambda b, s: (torch.empty(b, 4, s, 8)[:, :1], [b, s * 8]),
    "batch merged into rows across a transpose": lambda b, s: (torch.empty(s, b, 8).transpose(0, 1), [b * s, 8]),
}


@pytest.mark.parametrize("hints", [(2, 7), (2, 1), (1, 7), (1, 1)])
@pytest.mark.parametrize("case", VIEW_AT_SOME_SIZES)
def test_a_view_only_at_some_sizes_is_the_modes_view_or_its_refusal(case, hints):
    direct, through_the_mode = (_layout_run(VIEW, VIEW_AT_SOME_SIZES[case], hints, direct=d) for d in (True, False))
    if isinstance(through_the_mode[0], str):  # not a view at these sizes: the mode raises its own error
        assert direct == (None, None)
    else:
        assert direct == through_the_mode


@pytest.mark.parametrize("case", VIEW_REFUSED)
def test_a_view_the_kernel_cannot_shape_goes_through_the_mode(case):
    op, build = VIEW_REFUSED[case]
    assert _layout_run(op, build) == (None, None)


def test_a_tail_squeeze_of_a_named_size_goes_through_the_mode():
    # a view only where s is 1 (the mode asks it as a guard there): the kernel squeezes constant 1s alone
    assert _layout_run(VIEW, lambda b, s: (torch.empty(b, 2, s), [b, 2]), hints=(3, 1)) == (None, None)


def _viewed_twice(op, build, hints, memo: bool, monkeypatch):
    """(each of two calls' output layout, ShapeEnv state, layouts computed) of `op(*build(b, s))` twice in one
    capture's ShapeEnv, on two inputs of the same layout: with the capture's memo of views, or without it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxflops.capture import symbolic_kernels

    computed = []
    layout = symbolic_kernels._view_layout
    with monkeypatch.context() as patched:
        patched.setattr(symbolic_kernels, "_view_layout", lambda *args: computed.append(args[1]) or layout(*args))
        if not memo:
            patched.setattr(symbolic_kernels, "_view_layouts", lambda source: None)
        env, sizes = _named_sizes(hints)
        layouts, keys = [], []
        with FakeTensorMode(shape_env=env, static_shapes=True):
            for _ in range(2):
                args = build(*sizes)
                keys.append(tuple(map(str, (*args[0].shape, *args[0].stride(), *args[1]))))
                out = symbolic_kernels.symbolic_kernel(op, args, {})
                layouts.append(None if out is NotImplemented else
                               (tuple(map(str, out.shape)), tuple(map(str, out.stride())), str(out.storage_offset()),
                                out.untyped_storage()._cdata == args[0].untyped_storage()._cdata))
    return layouts, _state(env), len(computed), keys[0] == keys[1]


VIEWS_ASKED_AGAIN = [*(case for case in VIEW_CASES if VIEW_CASES[case][0] in (VIEW, UNSAFE_VIEW)), *VIEW_AT_SOME_SIZES]


@pytest.mark.parametrize("hints", [(2, 7), (1, 7), (3, 1), (1, 1)])
@pytest.mark.parametrize("case", VIEWS_ASKED_AGAIN)
def test_a_view_asked_again_is_the_captures_first_and_leaves_the_shape_env_as_asking_again_does(case, hints,
                                                                                                monkeypatch):
    """The sweep's ShapeEnv keeps each view's layout (symbolic_kernels._view): the same view of another input of the
    same layout is that layout, on its own storage, computed once, and the ShapeEnv (guards in order, runtime asserts,
    replacements, ranges) is what computing it again leaves, where the first asked a guard too (at sizes of 1: a
    size the first view's guard made 1 gives the second input other expressions, and its own view)."""
    op, build = VIEW_CASES[case] if case in VIEW_CASES else (VIEW, VIEW_AT_SOME_SIZES[case])
    kept, kept_state, computed, same = _viewed_twice(op, build, hints, True, monkeypatch)
    again, again_state, computed_again, _ = _viewed_twice(op, build, hints, False, monkeypatch)
    assert (kept, kept_state) == (again, again_state)
    assert computed == computed_again - (1 if same and kept[0] is not None else 0)
    assert same or hints != (2, 7)


class Attention(nn.Module):
    """A decoder's attention as transformers writes it: heads split by view and transpose, half-rotated by
    slices, a gate sliced from the input and unsqueezed over the heads, the heads merged again (a view after
    transpose and contiguous, a reshape), two layers (replayed)."""

    def __init__(self, width: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head = heads, width // heads
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3 * self.heads, self.head).transpose(1, 2).split(self.heads, dim=1)
        half = self.head // 2
        q = torch.cat((-q[..., half:], q[..., :half]), dim=-1) * x[..., :1].unsqueeze(1)
        scores = q @ k.transpose(-1, -2)
        y = (scores.softmax(-1) @ v).transpose(1, 2).contiguous()
        return self.out(y.view(b, s, -1)) + self.out(y.reshape(b * s, -1)).view(b, s, -1)


SPLIT, SPLIT_WITH_SIZES = torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default
# (op, inputs from symbolic batch b and seq s): splits along a static axis, first, middle or last, of contiguous,
# sliced and transposed inputs, into equal pieces, a smaller last one, or given sizes (one of them empty)
SPLIT_CASES = {
    "last axis": (SPLIT, lambda b, s: (torch.empty(b, s, 12), 4, 2)),
    "a smaller last piece": (SPLIT, lambda b, s: (torch.empty(b, s, 10), 4, -1)),
    "middle axis": (SPLIT, lambda b, s: (torch.empty(b, 6, s), 2, 1)),
    "first axis, by default": (SPLIT, lambda b, s: (torch.empty(6, b, s), 4)),
    "a slice": (SPLIT, lambda b, s: (torch.empty(b, s + 1, 12)[:, 1:], 4, 2)),
    "one piece": (SPLIT, lambda b, s: (torch.empty(b, s, 4), 8, 2)),
    "sizes": (SPLIT_WITH_SIZES, lambda b, s: (torch.empty(b, s, 12), [3, 0, 9], 2)),
    "sizes of a transposed input": (SPLIT_WITH_SIZES, lambda b, s: (torch.empty(b, 12, s).transpose(1, 2), [5, 7], -1)),
}
# splits left to the mode: along a named axis, sizes that do not add up (the mode's error)
SPLIT_REFUSED = {
    "a named axis": (SPLIT, lambda b, s: (torch.empty(b, s, 12), 2, 1)),
    "sizes short of the axis": (SPLIT_WITH_SIZES, lambda b, s: (torch.empty(b, s, 12), [3, 4], 2)),
}


def _split_run(op, build, hints, direct):
    """(each piece's layout, ShapeEnv state) of a split (`symbolic_call`); NotImplemented or the mode's error as is."""
    args, out, env = symbolic_call(op, build, hints, direct)
    if isinstance(out, str) or out is NotImplemented:
        return out
    storage = args[0].untyped_storage()._cdata
    return [(tuple(map(str, piece.shape)), tuple(map(str, piece.stride())), str(piece.storage_offset()), piece.dtype,
             piece.device, piece.untyped_storage()._cdata == storage) for piece in out], _state(env)


@pytest.mark.parametrize("hints", [(2, 7), (1, 7), (3, 1), (1, 1)])
@pytest.mark.parametrize("case", SPLIT_CASES)
def test_the_symbolic_split_gives_what_the_mode_gives(case, hints):
    op, build = SPLIT_CASES[case]
    direct = _split_run(op, build, hints, True)
    assert direct is not NotImplemented, "the kernel takes this split"
    assert direct == _split_run(op, build, hints, False)


@pytest.mark.parametrize("case", SPLIT_REFUSED)
def test_a_split_the_kernel_cannot_shape_goes_through_the_mode(case):
    op, build = SPLIT_REFUSED[case]
    assert _split_run(op, build, (2, 7), True) is NotImplemented


class SplitAttention(Attention):
    """GPT-2's attention as transformers writes it: query, key and value split from one projection, heads split by
    view; the value split again by sizes and chunked (split by torch's chunk)."""

    def forward(self, x):
        b, s, width = x.shape
        q, k, v = (t.view(b, s, self.heads, self.head).transpose(1, 2) for t in self.qkv(x).split(width, dim=2))
        first, rest = v.split([1, self.heads - 1], dim=1)
        v = torch.cat([*rest.chunk(3, dim=1), first], dim=1)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, s, width))


def test_a_split_attention_sweep_is_the_captures_without_the_kernels_and_every_point_is_estimate(monkeypatch):
    model = nn.Sequential(SplitAttention(), SplitAttention()).eval()
    swept = sweep_as_without_the_kernels(model, monkeypatch)
    # by hand, one layer: qkv 3*16*16 and out 16*16 per row, q k^T and attention @ v 2*s*s*16 a batch
    assert swept.at(batch=2, seq=9).total_macs == 2 * (2 * 9 * 4 * 256 + 2 * 2 * 9 * 9 * 16)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Attention() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def sweep_as_without_the_kernels(model, monkeypatch, width: int = 16):
    """A batch x seq sweep of `model` on [b, s, width], held to the capture without the kernels (the same
    pieces) and to estimate() node by node at points where each size is 1 too."""
    from fxflops.capture import symbolic_kernels  # (a capture with named sizes takes its kernel from there)

    dims = {"batch": 0, "seq": 1}
    swept = sweep(model, torch.zeros(2, 5, width), dims=dims)
    with monkeypatch.context() as patched:
        patched.setattr(symbolic_kernels, "symbolic_kernel", lambda func, args, kwargs: NotImplemented)
        through_the_mode = sweep(model, torch.zeros(2, 5, width), dims=dims)
    assert [piece.conditions for piece in swept.pieces] == [piece.conditions for piece in through_the_mode.pieces]
    for batch, seq in itertools.product((1, 2, 3), (1, 2, 5, 9)):
        at, fresh = swept.at(batch=batch, seq=seq), fxflops.estimate(model, torch.zeros(batch, seq, width))
        assert (at.total_macs, at.total_flops, at.total_bytes) == (fresh.total_macs, fresh.total_flops, fresh.total_bytes)
        assert at.nodes == fresh.nodes
    return swept


def test_a_decoder_sweep_is_the_captures_without_the_kernels_and_every_point_is_estimate(monkeypatch):
    model = Decoder().eval()
    swept = sweep_as_without_the_kernels(model, monkeypatch)
    # by hand, one layer: qkv 3*16*16 and two out projections 2*16*16 per row, q k^T and attention @ v 2*s*16
    rows = lambda b, s: b * s  # noqa: E731
    assert swept.at(batch=2, seq=9).total_macs == 2 * (rows(2, 9) * (3 * 256 + 2 * 256) + 2 * 2 * 9 * 9 * 16)


def test_a_decoder_sweep_with_its_views_kept_is_the_capture_computing_each_again(monkeypatch):
    """A decoder's layer views the same rows the same way for several projections: the sweep computes each such view
    once (symbolic_kernels._view), and its capture is the one computing each again, node by node and guard by guard,
    every point estimate()'s."""
    from fxflops.capture import symbolic_kernels

    model, x, dims = Decoder().eval(), torch.zeros(2, 5, 16), {"batch": 0, "seq": 1}
    layout = symbolic_kernels._view_layout
    computed = {True: 0, False: 0}
    captures = {}
    for memo in (True, False):
        def counted(*args, memo=memo):
            computed[memo] += 1
            return layout(*args)

        with monkeypatch.context() as patched:
            patched.setattr(symbolic_kernels, "_view_layout", counted)
            if not memo:
                patched.setattr(symbolic_kernels, "_view_layouts", lambda source: None)
            captures[memo] = sweep(model, x, dims=dims)
    assert 0 < computed[True] < computed[False]
    assert _capture_state(captures[True]) == _capture_state(captures[False])
    assert [p.conditions for p in captures[True].pieces] == [p.conditions for p in captures[False].pieces]
    for batch, seq in itertools.product((1, 2, 3), (1, 2, 7)):
        at, fresh = captures[True].at(batch=batch, seq=seq), fxflops.estimate(model, torch.zeros(batch, seq, 16))
        assert at.nodes == fresh.nodes


def test_a_size_bound_known_without_its_symbool_is_what_known_says():
    """`_known_above` reads the relation torch would make (`Gt(size, bound)`) where sympy decides it true from the
    sizes' assumptions, past the SymBool around it; every answer is `_known`'s, and nothing is asked of the sizes."""
    from torch._dynamo.source import ConstantSource

    from fxflops.capture.size_one import size_one_shape_env
    from fxflops.capture.symbolic_kernels import _known, _known_above

    env = size_one_shape_env()
    b, s = (env.create_symintnode(env.create_symbol(hint, source=ConstantSource(name), do_not_specialize_zero_one=True),
                                  hint=hint, source=ConstantSource(name)) for name, hint in (("b", 2), ("s", 9)))
    side = (s + 2 * 3 - 1 * (7 - 1) - 1) // 2 + 1  # a strided convolution's output side
    cases = [  # (size, bound, inclusive, the answer by hand: for every b, s >= 1)
        (b * 64 * s * s, 0, False, True), (side, 0, False, True), (s + 2 * 3, 7, True, True),
        (b * 64 * s * s, 64, False, False),  # b = s = 1 has 64 values: not above 64 channels
        (s - 3, 0, False, False), (s, 1, True, True), (s + 1, 1, False, True), (b - 1, 0, True, True),
        (9, 3, False, True), (3, 3, False, False), (3, 3, True, True)]
    for size, bound, inclusive, expected in cases:
        asked = _known(size >= bound if inclusive else size > bound)
        assert _known_above(size, bound, inclusive) == asked == expected, (size, bound, inclusive)
    assert (env.guards, env.replacements, env.deferred_runtime_asserts) == ([], {}, {})


MM = torch.ops.aten.mm.default
# a linear layer without a bias on named rows (a decoder's projections folded to 2-d), as the mode shapes it
MM_CASES = {
    "rows": lambda b, s: (torch.empty(s, 4), torch.empty(4, 6)),
    "folded rows": lambda b, s: (torch.empty(b * s, 4), torch.empty(4, 6)),
    "transposed rows": lambda b, s: (torch.empty(4, s).t(), torch.empty(4, 6)),
    "transposed weight": lambda b, s: (torch.empty(b * s, 4), torch.empty(6, 4).t()),
    "rows of a slice": lambda b, s: (torch.empty(b * s, 8)[:, 2:6], torch.empty(4, 6, dtype=torch.float32)),
    "double precision": lambda b, s: (torch.empty(s, 4, dtype=torch.float64), torch.empty(4, 6, dtype=torch.float64)),
    "a named width out": lambda b, s: (torch.empty(6, 4), torch.empty(4, s)),
}
MM_REFUSED = {
    "a named contraction": lambda b, s: (torch.empty(6, s), torch.empty(s, 4)),
    "in half precision": lambda b, s: (torch.empty(s, 4, dtype=torch.float16), torch.empty(4, 6, dtype=torch.float16)),
    "two dtypes": lambda b, s: (torch.empty(s, 4), torch.empty(4, 6, dtype=torch.float64)),
    "no named size": lambda b, s: (torch.empty(3, 4), torch.empty(4, 6)),
}


@pytest.mark.parametrize("hints", [(2, 7), (1, 7), (3, 1)])
@pytest.mark.parametrize("case", MM_CASES)
def test_the_symbolic_mm_gives_what_the_mode_gives(case, hints):
    """The output's sizes, strides, offset, dtype and storage (its bytes the same expression), and the ShapeEnv's
    guards, runtime asserts, replacements and ranges after it: the mode's, at sizes of 1 too."""
    build = MM_CASES[case]
    direct = _layout_run(MM, build, hints)
    assert direct[0] is not None, "the kernel takes this mm"
    assert direct == _layout_run(MM, build, hints, direct=False)
    nbytes = [str(symbolic_call(MM, build, hints, d)[1].untyped_storage().nbytes()) for d in (True, False)]
    assert nbytes[0] == nbytes[1]


@pytest.mark.parametrize("case", MM_REFUSED)
def test_an_mm_the_kernel_cannot_shape_without_a_question_goes_through_the_mode(case):
    assert _layout_run(MM, MM_REFUSED[case]) == (None, None)


def _capture_state(swept):
    """A sweep's first piece as torch's symbolic shapes leave it: each node (op, arguments, module, the outputs'
    sizes, strides and dtypes as expressions) and the ShapeEnv's guards in order, replacements, runtime asserts and
    ranges."""
    captured = swept.pieces[0].captured

    def value(v):
        if isinstance(v, torch.fx.Node):
            return v.name
        if isinstance(v, torch.Tensor):
            return tuple(map(str, v.shape)), tuple(map(str, v.stride())), str(v.storage_offset()), v.dtype, v.device
        if isinstance(v, list | tuple):
            return type(v).__name__, tuple(value(item) for item in v)
        if isinstance(v, dict):
            return tuple((key, value(item)) for key, item in v.items())
        return repr(v)

    nodes = [(n.op, str(n.target), value(n.args), value(n.kwargs), value(n.meta.get("val")),
              n.meta.get("fxflops_module")) for n in captured.graph_module.graph.nodes]
    env = captured.sizes.env
    return nodes, [str(g.expr) for g in env.guards], {str(k): str(v) for k, v in env.replacements.items()}, \
        {str(k): [str(a.expr) for a in v] for k, v in env.deferred_runtime_asserts.items()}, \
        {str(k): str(v) for k, v in env.var_to_range.items()}


class Transposed(nn.Module):
    def forward(self, x):
        return x.transpose(2, 3)  # strides no longer the contiguous ones: the batch norm kernel leaves it to torch


def _normed(norm: nn.Module, conv: nn.Module | None = None) -> nn.Module:
    return nn.Sequential(*(m for m in (conv, norm, nn.ReLU()) if m is not None))


BATCH_NORMS = [  # (model, input, dims, taken directly in eval)
    (_normed(nn.BatchNorm1d(4)), (3, 4), {"batch": 0}, True),
    (_normed(nn.BatchNorm1d(4, affine=False)), (3, 4, 7), {"batch": 0, "seq": 2}, True),
    (_normed(nn.BatchNorm2d(4), nn.Conv2d(3, 4, 3, stride=2, padding=1)), (2, 3, 9, 9), {"batch": 0, "size": (2, 3)},
     True),
    (_normed(nn.BatchNorm2d(3)), (2, 3, 5, 6), {"batch": 0, "h": 2, "w": 3}, True),
    (_normed(nn.BatchNorm3d(2, momentum=0.3)), (2, 2, 3, 4, 5), {"batch": 0, "d": 2, "h": 3, "w": 4}, True),
    (_normed(nn.BatchNorm2d(3, track_running_stats=False)), (2, 3, 5, 6), {"batch": 0, "h": 2}, False),
    (_normed(nn.BatchNorm2d(3), Transposed()), (2, 3, 5, 6), {"batch": 0, "h": 2, "w": 3}, False),
]


@pytest.mark.filterwarnings("ignore:the model is in training mode")
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("case", range(len(BATCH_NORMS)))
def test_a_batch_norm_taken_at_the_function_leaves_the_capture_torchs_path_leaves(case, training, monkeypatch):
    """capture.symbolic_kernels.symbolic_function: F.batch_norm in eval on named sizes is shaped and recorded without
    torch's composite (its `numel == 0` check, reserve and dispatch) where the batch-norm kernel shapes it: the same
    nodes (ops, arguments, outputs' sizes and strides) and the same ShapeEnv (guards in order, replacements, asserts,
    ranges) as through torch; training, batch statistics in eval and a transposed input are left to torch."""
    from fxflops.capture import symbolic_kernels  # (the recorder imports symbolic_function from there on use)

    model, shape, dims, direct = BATCH_NORMS[case]
    model.train(training)
    x = torch.empty(shape)
    taken = []
    function = symbolic_kernels.symbolic_function

    def spy(func, args, kwargs):
        known = function(func, args, kwargs)
        taken.append(known is not NotImplemented)
        return known

    with monkeypatch.context() as patched:
        patched.setattr(symbolic_kernels, "symbolic_function", spy)
        swept = sweep(model, x, dims=dims)
    with monkeypatch.context() as patched:
        patched.setattr(symbolic_kernels, "symbolic_function", lambda func, args, kwargs: NotImplemented)
        through_torch = sweep(model, x, dims=dims)
    assert any(taken) == (direct and not training)
    assert _capture_state(swept) == _capture_state(through_torch)
    assert [piece.conditions for piece in swept.pieces] == [piece.conditions for piece in through_torch.pieces]
