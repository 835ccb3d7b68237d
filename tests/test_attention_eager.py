"""Attention written as plain ops ("eager": matmul, scale, mask, softmax, dropout, matmul) read two ways.
Every effective count is by hand: a head keeping P of its Lq.Lk pairs makes each of the two products,
and each backward product that differentiates them, cost P.d instead of Lq.Lk.d."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxflops
from tests.oracle import oracle_flops

B, H, L, E = 2, 4, 8, 16


def causal(n):
    i = torch.arange(n)
    return i[:, None] >= i[None, :]


def window(n, w):
    i = torch.arange(n)
    return (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < w)


class Eager(nn.Module):
    """scores = q k^T / sqrt(E), masked as `how` says, softmax, dropout, @ v; GQA by repeat_kv."""

    def __init__(self, how, w=3, dropout=0.0):
        super().__init__()
        self.how, self.w, self.dropout = how, w, nn.Dropout(dropout)

    def forward(self, q, k, v, mask=None):
        n, groups = q.shape[-2], q.shape[1] // k.shape[1]
        if groups > 1:  # transformers' repeat_kv
            k, v = (x[:, :, None].expand(x.shape[0], x.shape[1], groups, *x.shape[2:]).reshape(*q.shape[:3], -1)
                    for x in (k, v))
        scores = torch.matmul(q, k.transpose(2, 3)) / E ** 0.5
        if self.how == "causal fill":
            scores = scores.masked_fill(~causal(n), float("-inf"))
        elif self.how == "window where":
            scores = scores + torch.where(window(n, self.w), 0.0, torch.finfo(scores.dtype).min)
        elif self.how == "window where tensor":  # transformers 5.17's eager mask: its 0 made by torch.tensor
            scores = scores + torch.where(window(n, self.w), torch.tensor(0.0), torch.finfo(scores.dtype).min)
        elif self.how == "window select":
            scores = torch.where(window(n, self.w), scores, float("-inf"))
        elif self.how == "window additive":
            scores = scores + torch.zeros(n, n).masked_fill(~window(n, self.w), float("-inf"))
        elif self.how == "causal fill, window select":  # two masks: their bands intersect
            i = torch.arange(n)
            scores = scores.masked_fill(~causal(n), float("-inf"))
            scores = torch.where(i[:, None] - i[None, :] < self.w, scores, float("-inf"))
        elif self.how == "documents fill":  # three packed documents (3, 3, 2), from positions: evaluated
            i = torch.arange(n)
            doc = (i >= 3).long() + (i >= 6).long()
            scores = scores.masked_fill(doc[:, None] != doc[None, :], float("-inf"))
        elif self.how == "given":
            scores = scores + mask
        elif self.how == "causal fill, given":
            scores = scores.masked_fill(~causal(n), float("-inf")) + mask
        probs = self.dropout(torch.softmax(scores, dim=-1))
        return torch.matmul(probs, v)


def qkv(heads=H, kv_heads=H, grad=True):
    torch.manual_seed(0)
    return tuple(torch.randn(B, n, L, E, requires_grad=grad) for n in (heads, kv_heads, kv_heads))


def products(estimate):
    """(forward, backward) attention products as (dense, effective) MACs, and their patterns."""
    nodes = [node for node in estimate.nodes if node.attention is not None]
    fwd = [(n.dense_macs, n.effective_macs) for n in nodes if not n.is_backward]
    bwd = [(n.dense_macs, n.effective_macs) for n in nodes if n.is_backward]
    return fwd, bwd, {n.attention for n in nodes}


@pytest.mark.parametrize("how, per_head, pattern", [
    ("causal fill", 36, "causal"),
    ("window where", 1 + 2 + 3 * 6, "sliding window 3"),
    ("window where tensor", 1 + 2 + 3 * 6, "sliding window 3"),
    ("window select", 1 + 2 + 3 * 6, "sliding window 3"),
    ("window additive", 1 + 2 + 3 * 6, "mask"),  # a float mask evaluated, not read as a band
    ("causal fill, window select", 1 + 2 + 3 * 6, "sliding window 3"),
    ("documents fill", 3 * 3 + 3 * 3 + 2 * 2, "mask"),
])
def test_eager_masks_from_positions_by_hand(how, per_head, pattern):
    estimate = fxflops.estimate(Eager(how), qkv(), backward=True)
    fwd, bwd, patterns = products(estimate)
    dense, effective = B * H * L * L * E, B * H * per_head * E
    assert fwd == [(dense, effective)] * 2  # q k^T and probs v
    assert bwd == [(dense, effective)] * 4  # d(probs), dv, dq, dk
    assert patterns == {pattern}
    assert estimate.total_macs == sum(d for d, _ in fwd + bwd) + estimate.total_macs - 6 * dense  # dense default
    chosen = fxflops.estimate(Eager(how), qkv(), backward=True, attention="effective")
    assert chosen.total_macs == estimate.total_macs - 6 * (dense - effective)
    totals = chosen.attention_totals()
    assert (totals.dense_macs, totals.effective_macs, totals.nodes, totals.unknown) == (6 * dense, 6 * effective, 6, 0)


def test_eager_grouped_query_attention_and_dropout_by_hand():
    model = Eager("causal fill", dropout=0.1).train()
    estimate = fxflops.estimate(model, qkv(heads=4, kv_heads=2), backward=True)
    fwd, bwd, _ = products(estimate)
    assert fwd == [(B * 4 * L * L * E, B * 4 * 36 * E)] * 2
    assert bwd == [(B * 4 * L * L * E, B * 4 * 36 * E)] * 4


@pytest.mark.parametrize("how", ["given", "causal fill, given"])
def test_eager_padding_mask_given_is_unknown_and_dense_stands(how):
    mask = torch.zeros(B, 1, L, L)
    estimate = fxflops.estimate(Eager(how), (*qkv(grad=False), mask), attention="effective")
    totals = estimate.attention_totals()
    assert (totals.unknown, totals.patterns) == (2, ("mask from data",))
    assert totals.effective_macs == totals.dense_macs == 2 * B * H * L * L * E
    assert estimate.total_macs == totals.dense_macs


@pytest.mark.parametrize("how", ["given", "causal fill, given"])
def test_a_sweep_names_an_eager_mask_from_data_as_the_static_count_does(how):
    from fxflops.sweeps import sweep

    args = (*qkv(grad=False), torch.zeros(B, 1, L, L))
    swept = sweep(Eager(how), args, dims={"batch": 0}, attention="effective").at(batch=3)
    assert swept.attention_totals().patterns == ("mask from data",)


def test_a_sweep_refuses_a_built_mask_estimate_counts_from_its_values():
    # positions only: estimate() counts the pairs it keeps at each point; a sweep cannot (issue 37 review)
    from fxflops.sweeps import sweep
    from fxflops.sweeps.core import SweepCaptureError

    with pytest.raises(SweepCaptureError, match=r"aten\.matmul\.default in the root module has a mask .*"
                       r"counted at concrete sizes only.*attention='dense'"):
        sweep(Eager("documents fill"), qkv(grad=False), dims={"batch": 0}, attention="effective")


def test_eager_without_mask_is_full_and_dense_matches_flop_counter_mode():
    estimate = fxflops.estimate(Eager("none"), qkv(grad=False), attention="effective")
    assert estimate.attention_totals().patterns == ("full",)
    assert estimate.total_macs == 2 * B * H * L * L * E
    for how in ("none", "causal fill", "window where", "window additive"):
        args = qkv(grad=False)
        assert fxflops.estimate(Eager(how), args, conventions="torch").total_flops == oracle_flops(Eager(how), args)


def test_a_softmax_not_between_two_products_is_not_attention():
    class Router(nn.Module):
        def forward(self, x, w):
            return torch.softmax(torch.matmul(x, w), dim=-1).sum()

    estimate = fxflops.estimate(Router(), (torch.randn(4, 8), torch.randn(8, 3)))
    assert estimate.attention_totals() is None


# ------------------------------------------------------------------- transformers' eager attention

WINDOW, HEADS, HEAD_DIM = 4, 4, 8
PROJECTION_MACS = 32 * 32 + 2 * 32 * 16 + 32 * 32  # per token: q, k, v (2 key/value heads), o


def test_gemma2_eager_sliding_and_full_layers_by_hand():
    import transformers as tf

    from fxflops.capture.dynamic import user_symbol
    from fxflops.sweeps import sweep

    config = tf.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=HEADS, num_key_value_heads=2, head_dim=HEAD_DIM,
                             max_position_embeddings=128, sliding_window=WINDOW, attn_implementation="eager")
    assert config.layer_types == ["sliding_attention", "full_attention"]
    torch.manual_seed(0)
    model = tf.Gemma2ForCausalLM(config).eval()
    swept = sweep(model, (torch.zeros(1, 8, dtype=torch.long),), dims={"seq": 1}, attention="effective")
    for seq in (3, 4, 12):  # shorter than the window, equal, longer
        estimate = swept.at(seq=seq)
        direct = fxflops.estimate(model, (torch.zeros(1, seq, dtype=torch.long),), attention="effective")
        for layer, layer_type in enumerate(config.layer_types):
            w = WINDOW if layer_type == "sliding_attention" else seq
            pairs = HEADS * sum(min(i + 1, w) for i in range(seq))
            path = f"model.layers.{layer}.self_attn"
            for counted in (estimate, direct):
                nodes = [node for node in counted.nodes if node.attention is not None and node.module == path]
                assert [(n.dense_macs, n.effective_macs) for n in nodes] == [
                    (HEADS * seq * seq * HEAD_DIM, pairs * HEAD_DIM)] * 2
                named = "sliding window 4" if layer_type == "sliding_attention" else "causal"
                assert {n.attention for n in nodes} == {named}
            formula = swept.formula("macs", module=path, seq=seq)
            assert formula.subs(user_symbol("seq"), seq) == PROJECTION_MACS * seq + pairs * 2 * HEAD_DIM


@pytest.mark.parametrize("seq", [5, 9])
def test_llama_eager_equals_its_sdpa_effective_count(seq):
    import transformers as tf

    counts = {}
    for implementation in ("eager", "sdpa"):
        config = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=HEADS, num_key_value_heads=2, head_dim=HEAD_DIM,
                                attn_implementation=implementation)
        torch.manual_seed(0)
        model = tf.LlamaForCausalLM(config)
        estimate = fxflops.estimate(model, (torch.zeros(1, seq, dtype=torch.long),), backward=True,
                                    attention="effective")
        totals = estimate.attention_totals()
        counts[implementation] = (estimate.fwd_macs, estimate.bwd_macs, totals.effective_macs, totals.patterns)
    pairs = HEADS * seq * (seq + 1) // 2
    assert counts["eager"][3] == counts["sdpa"][3] == ("causal",)
    # forward: two products of P.d each; backward: eager runs four products, the fused kernel five (it
    # recomputes q k^T), both over the kept pairs only
    assert counts["eager"][2] == 2 * pairs * 2 * HEAD_DIM + 2 * pairs * 4 * HEAD_DIM
    assert counts["sdpa"][2] == 2 * pairs * 2 * HEAD_DIM + 2 * pairs * 5 * HEAD_DIM
    assert counts["eager"][0] == counts["sdpa"][0]  # the whole forward, attention effective


def test_explain_and_compare_read_eager_attention_both_ways():
    from fxflops.compare import compare

    estimate = fxflops.estimate(Eager("causal fill"), qkv(grad=False), attention="effective")
    (entry, *_) = [op for op in estimate.explain("").ops if op.attention]
    assert entry.formulas["effective_macs"] == "macs * kept_pairs / numel(scores)"
    assert f"dense {B * H * L * L * E:,} MACs" in entry.attention
    assert f"effective {B * H * 36 * E:,} MACs" in entry.attention
    run = compare(estimate)
    column = f"{estimate.conventions} (dense attention)"
    assert run.totals[column][0] - run.totals[estimate.conventions][0] == 2 * B * H * (L * L - 36) * E


def test_multihead_attention_with_weights_runs_baddbmm_and_is_read():
    class SelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(32, 4, batch_first=True)

        def forward(self, x):  # need_weights (the default): mask + q k^T as one baddbmm, softmax, bmm
            return self.mha(x, x, x, attn_mask=nn.Transformer.generate_square_subsequent_mask(x.shape[1]))[0]

    # with gradients on, MHA never takes its fused fast path
    estimate = fxflops.estimate(SelfAttention().eval(), (torch.randn(2, L, 32),), backward=True)
    fwd, bwd, patterns = products(estimate)
    dense, effective = 2 * 4 * L * L * 8, 2 * 4 * 36 * 8  # B=2, 4 heads of 8, causal
    assert fwd == [(dense, effective)] * 2 and bwd == [(dense, effective)] * 4
    assert patterns == {"mask"}  # MHA's float mask (-inf above the diagonal), evaluated
    baddbmm = next(n for n in estimate.nodes if n.op == "aten.baddbmm.default")
    assert baddbmm.effective_flops == 2 * effective + 2 * 4 * 36  # the mask's add, per kept pair
