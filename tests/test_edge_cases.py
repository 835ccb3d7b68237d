"""Cases a new user hits that no other test names: torch.inner on matrices, profiler markers
(record_function, DataParallel), nn.TransformerEncoder's padding-mask check.

Counts are derived by hand; under the torch preset they equal FlopCounterMode (tests/oracle.py),
under fvcore / ptflops what those tools give (fvcore's jit trace sees aten::inner, which it has no
handler for; ptflops' aten backend sees the mm it runs as).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fxflops
from tests.oracle import oracle_flops


class Inner(nn.Module):
    def forward(self, a, b):
        return torch.inner(a, b)


class InnerMethod(nn.Module):
    def forward(self, a, b):
        return a.inner(b)


def count(model, args, kwargs=None, conventions="deepspeed"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fxflops.estimate(model, args, kwargs, conventions=conventions)
    assert not result.unknown, [u.op for u in result.unknown]
    return result


# (a shape, b shape, MACs = numel(out) x the reduced last dim, FLOPs under deepspeed)
INNER_CASES = [
    ((5,), (5,), 5, 10),                     # a dot product: 5 MACs
    ((5,), (4, 5), 4 * 5, 40),               # out (4,), each a 5-long reduction
    ((3, 5), (5,), 3 * 5, 30),               # out (3,)
    ((3, 5), (4, 5), 3 * 4 * 5, 120),        # out (3, 4)
    ((2, 3, 5), (4, 6, 5), 2 * 3 * 4 * 6 * 5, 1440),  # out (2, 3, 4, 6)
    ((), (4, 5), 0, 20),                     # a scalar times a matrix: 20 multiplies, no reduction
    ((3, 5), (), 0, 15),                     # 15 multiplies
]


@pytest.mark.parametrize("module", [Inner, InnerMethod])
@pytest.mark.parametrize(("a_shape", "b_shape", "macs", "flops"), INNER_CASES)
def test_inner_by_hand_in_every_preset(module, a_shape, b_shape, macs, flops):
    args = (torch.randn(a_shape), torch.randn(b_shape))
    deepspeed = count(module(), args)
    assert (deepspeed.total_macs, deepspeed.total_flops) == (macs, flops)
    matrix = len(a_shape) >= 1 and len(b_shape) >= 1 and len(a_shape) + len(b_shape) > 2
    # FlopCounterMode and ptflops see the mm a matrix inner runs as; a dot or a multiply they do not count
    torch_preset = count(module(), args, conventions="torch")
    assert torch_preset.total_flops == (2 * macs if matrix else 0)
    assert torch_preset.total_flops == oracle_flops(module(), args)
    ptflops = count(module(), args, conventions="ptflops")
    assert ptflops.total_macs == (macs if matrix else 0)
    assert count(module(), args, conventions="fvcore").total_flops == 0


def test_record_function_and_data_parallel_are_plumbing():
    class Marked(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 4)

        def forward(self, x):
            with torch.profiler.record_function("block"):
                return self.linear(x)

    x = torch.randn(2, 8)
    # 2 x 8 x 4 = 64 MACs; FLOPs 2 x 64 + 8 bias adds
    for model in (Marked(), nn.DataParallel(nn.Linear(8, 4))):  # DataParallel.forward opens a record_function
        result = count(model, (x,))
        assert (result.total_macs, result.total_flops) == (64, 136)
        assert count(model, (x,), conventions="torch").total_flops == 128 == oracle_flops(model, (x,))


def test_transformer_encoder_padding_mask_check_is_not_unknown():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(2, 6, 16)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, 4:] = True
    result = count(encoder, (x,), {"src_key_padding_mask": mask}, conventions="torch")
    # per layer, 12 tokens: in_proj 12*16*48 + out_proj 12*16*16 + ffn 2*12*16*32 MACs, attention
    # 2 * (2*4*6*6*4) MACs; x2 FLOPs, x2 layers
    per_layer = 12 * 16 * 48 + 12 * 16 * 16 + 2 * 12 * 16 * 32 + 2 * (2 * 4 * 6 * 6 * 4)
    assert result.total_flops == 2 * 2 * per_layer == 107520
    assert result.total_flops == oracle_flops(encoder, (x,), {"src_key_padding_mask": mask})
