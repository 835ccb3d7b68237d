"""conventions="ptflops" counts nn.MultiheadAttention as ptflops' hook does (issue 35, item 17).

ptflops itself is the oracle: its default (pytorch) backend run for real on small models. ptflops divides
its module hooks' counts (not its patched functions') by len(first input), so every model here takes
one input of length 1 in its first dimension. ViT-B/16 itself is counted on the meta device and held
to the number ptflops gives for it (17,606,030,584 MACs; before, this preset gave 16,876,073,704).
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from torch import nn

import fxflops

ptflops = pytest.importorskip("ptflops")
torchvision = pytest.importorskip("torchvision")


def ptflops_macs(model: nn.Module, x: torch.Tensor) -> int:
    assert len(x) == 1, "ptflops divides its hooks' counts by len(first input)"
    with contextlib.redirect_stdout(io.StringIO()):
        macs, _ = ptflops.get_model_complexity_info(model, tuple(x.shape[1:]), input_constructor=lambda _: x,
                                                    as_strings=False, print_per_layer_stat=False, verbose=False)
    return macs


class Attention(nn.Module):
    """nn.MultiheadAttention fed a (1, L, 16) input, as self- or cross-attention, in either layout."""

    def __init__(self, need_weights: bool, batch_first: bool, cross: bool = False, mask: bool = False,
                 bias: bool = True) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 4, batch_first=batch_first, bias=bias)
        self.need_weights, self.batch_first, self.cross, self.mask = need_weights, batch_first, cross, mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x
        kv = x[:, :3] if self.cross else x
        if not self.batch_first:
            q, kv = q.transpose(0, 1), kv.transpose(0, 1)
        lengths = (x.shape[1], kv.shape[1 if self.batch_first else 0])
        mask = torch.zeros(lengths) if self.mask else None
        return self.mha(q, kv, kv, need_weights=self.need_weights, attn_mask=mask)[0]


def test_vit_b16_is_ptflops_own_count():
    with torch.device("meta"):
        model = torchvision.models.vit_b_16().eval()
    estimate = fxflops.estimate(model, (torch.zeros(1, 3, 224, 224, device="meta"),), conventions="ptflops")
    assert estimate.total_macs == 17_606_030_584  # ptflops' default backend on the real model
    # What the hook adds per layer over the preset's old count (L = 197 tokens, E = 768, 12 heads of 64),
    # by hand: Q K^T + softmax + A V 12 * 197 * 197 * (64 + 1 + 64), the query scaling 197 * 768, and the
    # projections' biases per element instead of per row (3 * 197 * 768 - 2304 and 197 * 768 - 768).
    per_layer = 12 * 197 * 197 * 129 + 197 * 768 + (3 * 197 * 768 - 2304) + (197 * 768 - 768)
    assert per_layer == 60_829_740
    assert 16_876_073_704 + 12 * per_layer == estimate.total_macs


def test_a_small_vision_transformer_matches_ptflops_run_for_real():
    torch.manual_seed(0)
    model = torchvision.models.vision_transformer.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10).eval()
    x = torch.randn(1, 3, 32, 32)
    assert fxflops.estimate(model, (x,), conventions="ptflops").total_macs == ptflops_macs(model, x)


@pytest.mark.parametrize("need_weights", [False, True], ids=["sdpa", "weights"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq-first", "batch-first"])
@pytest.mark.parametrize("variant", ["self", "cross", "mask"])
def test_multihead_attention_matches_ptflops(need_weights: bool, batch_first: bool, variant: str):
    """Both of its paths: scaled_dot_product_attention (need_weights=False), and bmm + softmax + bmm where
    it returns the weights (ptflops' patched torch.bmm and F.softmax count those again beside its hook)."""
    torch.manual_seed(0)
    model = Attention(need_weights, batch_first, cross=variant == "cross", mask=variant == "mask").eval()
    x = torch.randn(1, 5, 16)
    assert fxflops.estimate(model, (x,), conventions="ptflops").total_macs == ptflops_macs(model, x)


def test_multihead_attention_counted_whole_matches_ptflops():
    model = Attention(need_weights=False, batch_first=True).eval()
    x = torch.randn(1, 5, 16)
    whole = fxflops.estimate(model, (x,), conventions="ptflops", leaf_modules=[nn.MultiheadAttention])
    assert [node.op for node in whole.nodes if node.macs] == ["torch.nn.modules.activation.MultiheadAttention"]
    assert whole.total_macs == ptflops_macs(model, x)


def test_without_biases_ptflops_still_counts_the_output_projections_bias():
    """The one difference left, by design: ptflops' hook adds Lq x E for the output projection's bias
    ("bias is always enabled") even when the module has none; there is no op to read it from."""
    model = Attention(need_weights=False, batch_first=True, bias=False).eval()
    x = torch.randn(1, 5, 16)
    assert ptflops_macs(model, x) - fxflops.estimate(model, (x,), conventions="ptflops").total_macs == 5 * 16
