"""torchtitan's Llama 4 (tests/third_party: its own code, v0.2.2) with mixture-of-experts layers, built from its
config on the meta device and counted on fake tensors under balanced routing, equal to a hand count (issue 39).

Its router counts tokens per expert with histc over the picked experts (int64: the CPU kernel, and torch's
meta kernel for the CPU, lack it; capture.input_values runs it widened) and its experts read the counts with
.tolist() to split the tokens (the for-loop path) or to pad each expert's rows for grouped mm (torchtitan's
generate_permute_indices). The FLOP total does not depend on the routing for either path (each routed row
meets one expert, and grouped mm's padded row count is a shape), so worst-case routing counts the same."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import fxflops
from tests.third_party.torchtitan_llama4 import Transformer, TransformerModelArgs, llama4_args
from tests.third_party.torchtitan_moe import MoEArgs


def _moe_hidden(args: TransformerModelArgs) -> int:
    """The routed experts' hidden size, by Llama 4's rule: 2/3 of 4·dim, times ffn_dim_multiplier, split
    between top_k routed and the shared experts, rounded up to multiple_of."""
    hidden = int(args.ffn_dim_multiplier * int(2 * 4 * args.dim / 3)) if args.ffn_dim_multiplier else int(2 * 4 * args.dim / 3)
    hidden = int(hidden / (args.moe_args.top_k + args.moe_args.num_shared_experts))
    return hidden + -hidden % args.multiple_of


def hand_count(args: TransformerModelArgs, batch: int, seq: int) -> int:
    """FlopCounterMode's conventions (2 FLOPs a MAC; matmuls, SDPA and grouped mm only), every layer MoE."""
    dim, heads, kv_heads = args.dim, args.n_heads, args.n_kv_heads or args.n_heads
    head_dim, experts, top_k = dim // heads, args.moe_args.num_experts, args.moe_args.top_k
    tokens, hidden = batch * seq, _moe_hidden(args)
    if args.moe_args.use_grouped_mm:  # rows padded: tokens·top_k plus 8 per expert, rounded up to 8
        routed_rows = -(-(tokens * top_k + experts * 8) // 8) * 8
    else:
        routed_rows = tokens * top_k
    layer = (2 * tokens * dim * dim * 2                      # wq, wo
             + 2 * tokens * dim * kv_heads * head_dim * 2    # wk, wv
             + 4 * batch * heads * seq * seq * head_dim      # SDPA: QK^T and PV over every pair (causal: dense)
             + 2 * tokens * dim * experts                    # router gate
             + 3 * 2 * routed_rows * dim * hidden            # routed experts: w1, w3, w2
             + 3 * 2 * tokens * dim * hidden * args.moe_args.num_shared_experts)  # the shared expert
    return args.n_layers * layer + 2 * tokens * dim * args.vocab_size  # + the output projection


def _count(args: TransformerModelArgs, batch: int, seq: int, **options) -> fxflops.Estimate:
    with torch.device("meta"):
        model = Transformer(args)
    tokens = torch.zeros(batch, seq, dtype=torch.long)  # (its values decide nothing here)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fxflops.estimate(model, (tokens,), conventions="torch", method="eager", **options)
    assert all(parameter.is_meta for parameter in model.parameters())
    return result


def _small(grouped: bool) -> TransformerModelArgs:
    return TransformerModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=16,
                                max_seq_len=64, interleave_moe_layer_step=1,
                                moe_args=MoEArgs(num_experts=4, top_k=2, use_grouped_mm=grouped))


@pytest.mark.parametrize("grouped", [False, True], ids=["for-loop", "grouped-mm"])
def test_a_small_llama4_moe_counts_balanced_routing_by_hand_and_says_so(grouped):
    result = _count(_small(grouped), 2, 12)
    # 4 layers: repeated blocks whose router picks carry assumed values are each run, not replayed
    assert result.total_flops == hand_count(_small(grouped), 2, 12)
    assert any("balanced routing" in caution and "TokenChoiceTopKRouter" in caution for caution in result.cautions)
    assert any(caution.startswith("worst-case routing counts the same FLOPs as balanced routing")
               for caution in result.cautions)


@pytest.mark.parametrize("grouped", [False, True], ids=["for-loop", "grouped-mm"])
def test_llama4_17bx16e_at_full_size_on_the_meta_device_equals_the_hand_count(grouped):
    args = copy.deepcopy(llama4_args["17bx16e"])  # 48 layers, dim 5120, 16 experts top-1 + 1 shared
    args.moe_args.use_grouped_mm = grouped
    assert _moe_hidden(args) == 8192
    result = _count(args, 1, 8192, routing="balanced")  # (named: the worst case is not captured beside it)
    assert result.total_flops == hand_count(args, 1, 8192)
    assert result.total_flops == (331_920_441_344_000 if grouped else 330_374_253_117_440)  # the hand count's value
