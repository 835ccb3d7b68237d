"""Under conventions="torch", totals equal FlopCounterMode's to the unit, on whole models."""

from __future__ import annotations

import pytest
import torch

import fxflops
from tests.models import LeNet5, tiny_transformers_model
from tests.oracle import oracle_flops

torchvision = pytest.importorskip("torchvision")


def test_lenet5_equals_flop_counter_mode():
    model, x = LeNet5().eval(), torch.randn(8, 1, 32, 32)
    assert fxflops.estimate(model, (x,), conventions="torch").total_flops == oracle_flops(model, (x,))


def test_lenet5_by_hand():
    # batch 1024 as in the DeepSpeed tutorial: conv MACs = out numel x C_in x k^2, linear = batch x in x out
    batch = 1024
    conv = batch * (6 * 28 * 28 * 1 * 25 + 16 * 10 * 10 * 6 * 25 + 120 * 1 * 1 * 16 * 25)
    linear = batch * (120 * 84 + 84 * 10)
    result = fxflops.estimate(LeNet5(), input_shape=(batch, 1, 32, 32))
    assert result.total_macs == conv + linear
    assert result.modules["feature_extractor.0"].macs == batch * 6 * 28 * 28 * 25
    assert result.modules["classifier"].macs == linear
    assert result.total_params == 61706


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "efficientnet_b0", "vit_b_16", "convnext_tiny", "swin_t"])
def test_torchvision_equals_flop_counter_mode(name):
    torch.manual_seed(0)
    model, x = getattr(torchvision.models, name)().eval(), torch.randn(1, 3, 224, 224)
    expected = oracle_flops(model, (x,))
    result = fxflops.estimate(model, (x,), conventions="torch")
    assert result.unknown == []
    assert result.total_flops == expected


@pytest.mark.parametrize("kind", ["bert", "gpt2", "llama"])
def test_transformers_equal_flop_counter_mode(kind):
    torch.manual_seed(0)
    model, inputs = tiny_transformers_model(kind)
    result = fxflops.estimate(model, kwargs=inputs, conventions="torch")
    assert result.unknown == []
    assert result.total_flops == oracle_flops(model, kwargs=inputs)


def test_vit_in_eval_is_counted_where_flop_counter_mode_goes_blind():
    # eager eval under no_grad takes nn.MultiheadAttention's fast path, which FlopCounterMode does not
    # see on CPU: it reports ~22.5 GFLOPs instead of 35.1 for vit_b_16
    torch.manual_seed(0)
    model, x = torchvision.models.vit_b_16().eval(), torch.randn(1, 3, 224, 224)
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as blind:
        model(x)
    for method in ("export", "trace"):
        assert fxflops.estimate(model, (x,), method=method, conventions="torch").total_flops == oracle_flops(model, (x,))
    assert blind.get_total_flops() < oracle_flops(model, (x,))


class FusedMHA(torch.nn.Module):
    """Calls the fused kernel nn.MultiheadAttention's fast path uses, so the graph holds it."""

    def __init__(self, mha: torch.nn.MultiheadAttention) -> None:
        super().__init__()
        self.mha = mha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mha = self.mha
        return torch._native_multi_head_attention(
            x, x, x, mha.embed_dim, mha.num_heads, mha.in_proj_weight, mha.in_proj_bias,
            mha.out_proj.weight, mha.out_proj.bias, need_weights=False)[0]


def test_fused_multi_head_attention_kernel_is_counted_at_its_true_cost():
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    result = fxflops.estimate(FusedMHA(mha), (x,), method="export", conventions="torch")
    assert "aten._native_multi_head_attention.default" in result.by_op
    unfused = lambda x: mha(x, x, x, need_weights=False)  # noqa: E731 - the same attention, unfused
    assert result.total_flops == oracle_flops(unfused, (x,))
    # by hand: q/k/v/out projections 4 x (10 tokens x 16 x 16) + attention 2 x 4 heads x 5 x 5 x (4 + 4)
    assert result.total_macs == 4 * 10 * 16 * 16 + 2 * 4 * 5 * 5 * (4 + 4)
