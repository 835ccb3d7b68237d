"""capture.symbolic_pooling's kernels (max pooling, a mean over the map, the in-place ReLU and residual add)
against the fake mode on the same symbolic inputs: the same outputs (sizes, strides, offset, dtype, storage,
the very input for an in-place op) and the same ShapeEnv afterwards (guards in order, runtime asserts,
replacements, ranges), at points where a size is 1 and at the smallest maps; hostile cases take the mode;
and a ResNet-style sweep equal to estimate() node by node down to 1 x 1 maps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxflops
from fxflops.sweeps import sweep
from tests.test_symbolic_kernels import _state, symbolic_call

aten = torch.ops.aten
MAX_POOL, RELU_, ADD_, MEAN = (aten.max_pool2d_with_indices.default, aten.relu_.default, aten.add_.Tensor,
                               aten.mean.dim)


def _run(op, build, hints, direct):
    """(outputs' layouts, ShapeEnv state) of `op(*build(b, s))` on symbolic b and s (hints given), through
    symbolic_kernel or through the mode (`symbolic_call`); a mode's error as its type. Where the kernel leaves
    the op to the mode: (None, whether a size of the first input is 1 at this point)."""
    args, out, env = symbolic_call(op, build, hints, direct)
    if isinstance(out, str):
        return out, None
    if out is NotImplemented:
        return None, any(getattr(size, "node", None) is not None and size.node.hint == 1 for size in args[0].shape)
    layouts = tuple((tuple(map(str, o.shape)), tuple(map(str, o.stride())), str(o.storage_offset()), o.dtype,
                     o.device, o is args[0], o.untyped_storage()._cdata == args[0].untyped_storage()._cdata)
                    for o in (out if isinstance(out, tuple) else (out,)))
    return layouts, _state(env)


def _map(b, s, channels=8):
    """A stem's output: a 7 x 7 stride-2 convolution's side over an s x s image (as a ResNet has it)."""
    side = (s + 6 - 6 - 1) // 2 + 1
    return torch.empty(b, channels, side, side)


CASES = {
    "relu_": (RELU_, lambda b, s: (_map(b, s),)),
    "relu_ of a raw side": (RELU_, lambda b, s: (torch.empty(b, 3, s, s + 1),)),
    "relu_ of a 2-d tensor": (RELU_, lambda b, s: (torch.empty(b * s, 16, dtype=torch.float64),)),
    "residual add_": (ADD_, lambda b, s: (_map(b, s), _map(b, s))),
    "add_ to itself": (ADD_, (lambda b, s: (lambda x: (x, x))(_map(b, s)))),
    "add_ with a static 1 x 1 map": (ADD_, lambda b, s: (torch.empty(b, 8, 1, 1), torch.empty(b, 8, 1, 1))),
    "ResNet's max pool": (MAX_POOL, lambda b, s: (_map(b, s), [3, 3], [2, 2], [1, 1], [1, 1], False)),
    "max pool, no padding": (MAX_POOL, lambda b, s: (torch.empty(b, 4, 2 * s + 2, s + 3), [2, 2], [2, 2], [0, 0],
                                                     [1, 1], False)),
    "max pool, default stride": (MAX_POOL, lambda b, s: (_map(b, s), [2, 3], [], [1, 1], [1, 1], False)),
    "max pool, dilated, odd": (MAX_POOL, lambda b, s: (torch.empty(b, 4, s + 5, 2 * s + 3), [3, 2], [1, 3], [1, 0],
                                                       [2, 1], False)),
    "max pool, ceil_mode, kernel 1": (MAX_POOL, lambda b, s: (_map(b, s), [1, 1], [1, 1], [0, 0], [1, 1], True)),
    "max pool, one-element arguments": (MAX_POOL, lambda b, s: (_map(b, s), [3], [2], [1], [1], False)),
    "max pool in float64": (MAX_POOL, lambda b, s: (torch.empty(b, 3, s + 2, s + 2, dtype=torch.float64), [3, 3],
                                                    [1, 1], [0, 0], [1, 1], False)),
    "adaptive 1 x 1 as a mean": (MEAN, lambda b, s: (_map(b, s), [-1, -2], True)),
    "mean over the last axis": (MEAN, lambda b, s: (torch.empty(b, s, 6), [2], True)),
    "mean over a 5-d map": (MEAN, lambda b, s: (torch.empty(b, 4, s, s, 2), [4, 2, 3], True)),
}
# cases the kernel leaves to the mode wherever (a question it cannot answer without a guard, or a layout it
# does not take): ceil_mode's last window, channels-last or strided inputs, a size that may be 0, one channel,
# keepdim False, a broadcast, a different dtype
REFUSED = {
    "max pool, ceil_mode": (MAX_POOL, lambda b, s: (_map(b, s), [3, 3], [2, 2], [1, 1], [1, 1], True)),
    "max pool, channels-last": (MAX_POOL, lambda b, s: (_map(b, s).contiguous(memory_format=torch.channels_last),
                                                        [3, 3], [2, 2], [1, 1], [1, 1], False)),
    "max pool of a raw side (maybe 0)": (MAX_POOL, lambda b, s: (torch.empty(b, 4, s, s), [2, 2], [2, 2], [0, 0],
                                                                 [1, 1], False)),
    "max pool whose output may be empty": (MAX_POOL, lambda b, s: (_map(b, s), [2, 2], [2, 2], [0, 0], [1, 1],
                                                                   False)),
    "max pool, one channel": (MAX_POOL, lambda b, s: (_map(b, s, 1), [3, 3], [2, 2], [1, 1], [1, 1], False)),
    "max pool, 3-d input": (MAX_POOL, lambda b, s: (_map(b, s)[0], [3, 3], [2, 2], [1, 1], [1, 1], False)),
    "relu_ of a transposed map": (RELU_, lambda b, s: (_map(b, s).transpose(2, 3),)),
    "relu_ of a slice": (RELU_, lambda b, s: (_map(b, s)[:, 1:],)),
    "relu_ in half precision": (RELU_, lambda b, s: (torch.empty(b, 8, s, dtype=torch.float16),)),
    "add_ broadcast": (ADD_, lambda b, s: (_map(b, s), torch.empty(8, 1, 1))),
    "add_ of another dtype": (ADD_, lambda b, s: (_map(b, s), _map(b, s).double())),
    "add_ of a channels-last other": (ADD_, lambda b, s: (_map(b, s), _map(b, s).contiguous(
        memory_format=torch.channels_last))),
    "mean without keepdim": (MEAN, lambda b, s: (_map(b, s), [-1, -2], False)),
    "mean over the channels": (MEAN, lambda b, s: (_map(b, s), [1], True)),
    "mean over every axis": (MEAN, lambda b, s: (_map(b, s), [0, 1, 2, 3], True)),
}
# hints (b, s): ResNet's capture point, a batch of 1 (the mode's size-one questions are guards there: the
# kernels leave it to the mode), the smallest images (1 x 1 and 2 x 2 maps), odd sizes
HINTS = [(2, 33), (1, 33), (3, 1), (2, 2), (3, 3), (1, 1), (5, 4)]


@pytest.mark.parametrize("hints", HINTS)
@pytest.mark.parametrize("case", CASES)
def test_each_kernel_gives_what_the_mode_gives(case, hints):
    op, build = CASES[case]
    direct, through_the_mode = (_run(op, build, hints, direct=d) for d in (True, False))
    if direct[0] is None:  # left to the mode: only where a named size is 1 at this point
        assert direct[1]
        return
    assert direct == through_the_mode
    assert through_the_mode[1][0] == [], "no guard asked: the kernel stands for the mode's unguarded answer"


@pytest.mark.parametrize("case", CASES)
def test_each_kernel_takes_its_case_away_from_a_size_of_one(case):
    op, build = CASES[case]
    assert _run(op, build, (2, 33), direct=True)[0] is not None


@pytest.mark.parametrize("hints", [(2, 33), (2, 2), (3, 1)])
@pytest.mark.parametrize("case", REFUSED)
def test_a_case_the_kernels_cannot_answer_without_a_question_goes_through_the_mode(case, hints):
    op, build = REFUSED[case]
    assert _run(op, build, hints, direct=True)[0] is None


class Bottleneck(nn.Module):
    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 4, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(4)
        self.conv3 = nn.Conv2d(4, 8, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.down = nn.Conv2d(channels, 8, 1, stride=stride, bias=False) if stride > 1 or channels != 8 else None

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


class TinyResNet(nn.Module):
    """A ResNet's ops in a row: stem, max pool, bottlenecks (strided, with the residual add), 1 x 1 average."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(6),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1))
        self.blocks = nn.Sequential(Bottleneck(6, 1), Bottleneck(8, 1), Bottleneck(8, 2), Bottleneck(8, 1))
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


def test_a_resnet_sweep_counts_every_point_as_estimate_does_down_to_one_by_one_maps():
    model = TinyResNet().eval()
    swept = sweep(model, (torch.empty(2, 3, 33, 33),), dims={"batch": 0, "size": (2, 3)})
    # the kernels ask no guard: one piece for every size (each takes its op at the capture's point)
    assert len(swept.pieces) == 1 and swept.holds_for == "batch >= 1, size >= 1"
    for batch, size in [(2, 33), (1, 1), (1, 2), (3, 5), (1, 8), (4, 9), (2, 17), (1, 64)]:
        at = swept.at(batch=batch, size=size)
        expected = fxflops.estimate(model, (torch.empty(batch, 3, size, size),))
        assert (at.total_macs, at.total_flops, at.total_params) == \
            (expected.total_macs, expected.total_flops, expected.total_params), (batch, size)
        assert [(n.name, n.macs, n.flops) for n in at.nodes] == [(n.name, n.macs, n.flops) for n in expected.nodes]
