"""A sweep's replayed blocks: copies of a reference under named sizes, each point equal to a fresh
estimate() with every call run (replay=False) node by node."""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch._subclasses import fake_impls

import fxflops
from fxflops.sweeps import sweep


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.conv(x)).relu()


def convnet() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *[Block() for _ in range(4)]).eval()


def image(batch: int, size: int) -> torch.Tensor:
    return torch.empty(batch, 3, size, size, device="meta")


def _node(n):
    return n.op, n.module, n.input_shapes, n.output_shapes, n.macs, n.flops, n.bytes


def test_a_replayed_blocks_fresh_outputs_are_made_past_the_fake_modes_cache():
    # a copy's outputs are new fake tensors shaped like the reference's: made by the meta kernel the mode's
    # constructor runs, not through the mode (whose cache key and entry for them cost more than the kernel)
    model = convnet()
    constructed, ran = [], []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is fake_impls.constructors.__code__:
            constructed.append(frame.f_locals.get("func"))
        elif event == "call" and frame.f_code is Block.forward.__code__:
            ran.append(frame)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        swept = sweep(model, image(2, 16), dims={"batch": 0, "size": (2, 3)})
    finally:
        sys.setprofile(previous)
    assert torch.ops.aten.empty_strided.default not in constructed
    assert len(ran) == 1  # the first block ran (the reference); the other three were copied
    # every point is what each call run gives, node by node
    for batch, size in [(2, 16), (1, 5), (3, 31), (5, 64)]:
        at, fresh = swept.at(batch=batch, size=size), fxflops.estimate(model, image(batch, size), replay=False)
        assert (at.total_macs, at.total_flops, at.total_bytes) == (fresh.total_macs, fresh.total_flops,
                                                                   fresh.total_bytes)
        assert [_node(n) for n in at.nodes] == [_node(n) for n in fresh.nodes]
        # by hand: 3x3 convolutions, 3 -> 8 then four 8 -> 8, at every pixel
        assert at.by_op["aten.conv2d.default"].macs == batch * size * size * 9 * 8 * (3 + 4 * 8)
