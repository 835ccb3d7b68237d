"""flex_attention captured and counted: one node per call (forward and backward), dense as
FlopCounterMode counts it (sdpa's count), effective over the blocks its BlockMask keeps. Every
effective count below is worked out by hand as kept blocks x 128² pairs per (batch, query head),
and the kept blocks checked against the mask's own kv_num_blocks + full_kv_num_blocks, computed by
torch's create_block_mask on real tensors."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch._higher_order_ops.flex_attention import flex_attention as flex_operator
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

import fxflops
from fxflops.explain import explain
from fxflops.report.machine import from_json
from fxflops.rules.flex import kept_block_pairs
from tests.oracle import oracle_flex_flops

B, H, E, D = 2, 4, 16, 64  # batch, query heads, head dim, model width
BLOCK = 128


def causal(b, h, q, kv):
    return q >= kv


DOCS = torch.tensor([0] * 100 + [1] * 200 + [2] * 212)  # three packed documents, not block-aligned (L = 512)


def document(b, h, q, kv):
    return DOCS[q] == DOCS[kv]


def own_blocks(mask_mod, length):
    """Kept blocks per (b, h) as the mask itself counts them: create_block_mask on real tensors."""
    mask = create_block_mask(mask_mod, None, None, length, length, device="cpu")
    assert mask.BLOCK_SIZE == (BLOCK, BLOCK)
    return int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())


class Attention(nn.Module):
    """Projections, then flex_attention with a BlockMask built inside the forward (or none)."""

    def __init__(self, mask_mod=causal, kv_heads=H, score_mod=None, operator=False):
        super().__init__()
        self.q = nn.Linear(D, H * E)
        self.kv = nn.Linear(D, 2 * kv_heads * E)
        self.kv_heads, self.mask_mod, self.score_mod, self.operator = kv_heads, mask_mod, score_mod, operator

    def forward(self, x):
        batch, length, _ = x.shape
        q = self.q(x).view(batch, length, H, E).transpose(1, 2)
        k, v = self.kv(x).view(batch, length, 2, self.kv_heads, E).permute(2, 0, 3, 1, 4)
        mask = (create_block_mask(self.mask_mod, None, None, length, length, device=x.device)
                if self.mask_mod is not None else None)
        if self.operator:
            # torch has no flex_attention backward on the CPU: the operator flex_attention's wrapper calls
            # (on CUDA) is called as it calls it, so that the backward runs here
            out, _, _ = flex_operator(q, k, v, self.score_mod or _identity, mask.as_tuple(), E ** -0.5,
                                      {"OUTPUT_LOGSUMEXP": True, "OUTPUT_MAX": False})
            return out
        return flex_attention(q, k, v, score_mod=self.score_mod, block_mask=mask, enable_gqa=self.kv_heads != H)


def _identity(score, b, h, q, kv):
    return score


class Net(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.attn = Attention(**options)

    def forward(self, x):
        return self.attn(x)


def x_of(length):
    torch.manual_seed(0)
    return torch.randn(B, length, D)


def attention_nodes(estimate):
    return [node for node in estimate.nodes if node.attention is not None]


# pairs per head in the kept blocks, each clipped to the sequence
CAUSAL_300 = 128 * 128 + 2 * 128 * 128 + 2 * 44 * 128 + 44 * 44  # rows of 128, 128, 44: blocks (0,0) (1,0-1) (2,0-2)


@pytest.mark.parametrize("length, mask_mod, blocks, pairs", [
    (256, causal, 1 + 2, 3 * BLOCK * BLOCK),
    (300, causal, 1 + 2 + 3, CAUSAL_300),  # the last block row holds 44 queries, its blocks 44 x 128 and 44 x 44
    # docs 0-99, 100-299, 300-511 share blocks (0,0-2) (1,0-2) (2,0-3) (3,2-3)
    (512, document, 3 + 3 + 4 + 2, 12 * BLOCK * BLOCK),
])
def test_block_mask_built_in_the_forward_by_hand(length, mask_mod, blocks, pairs):
    assert own_blocks(mask_mod, length) == blocks
    model = Net(mask_mod=mask_mod, score_mod=lambda score, b, h, q, kv: score * 2)
    estimate = fxflops.estimate(model, (x_of(length),), attention="effective", conventions="torch")
    [node] = attention_nodes(estimate)
    assert (node.op, node.rule, node.module, node.attention) == (
        "torch.ops.higher_order.flex_attention", "flex_attention", "attn", "block mask")
    assert node.dense_macs == B * H * length * length * 2 * E
    assert node.kept_pairs == B * H * pairs
    assert node.effective_macs == B * H * pairs * 2 * E <= node.dense_macs
    assert "return flex_attention(q, k, v" in node.source  # the user's line, not torch's wrapper
    dense = fxflops.estimate(model, (x_of(length),), conventions="torch")
    assert dense.total_flops == oracle_flex_flops(model, (x_of(length),))[0]  # dense: FlopCounterMode's count


@pytest.mark.parametrize("length, mask_mod, blocks", [(256, causal, 3), (512, document, 12)])
def test_forward_and_backward_by_hand_and_against_flop_counter_mode(length, mask_mod, blocks):
    model = Net(mask_mod=mask_mod, operator=True)
    counts = fxflops.estimate(model, (x_of(length),), backward=True, attention="effective", conventions="torch")
    forward, backward = attention_nodes(counts)
    assert (forward.phase, backward.phase, backward.op) == ("forward", "backward",
                                                             "torch.ops.higher_order.flex_attention_backward")
    assert backward.module == "attn" and backward.differentiates == forward.name
    pairs = B * H * blocks * BLOCK * BLOCK
    grid = B * H * length * length
    assert (forward.dense_macs, backward.dense_macs) == (grid * 2 * E, grid * 5 * E)  # E + Ev; 3E + 2Ev
    assert (forward.effective_macs, backward.effective_macs) == (pairs * 2 * E, pairs * 5 * E)
    dense = fxflops.estimate(model, (x_of(length),), backward=True, conventions="torch")
    assert (dense.fwd_flops, dense.bwd_flops) == oracle_flex_flops(model, (x_of(length),), backward=True)
    # the reports read the node as any attention op
    text = str(explain(counts, backward.name))
    assert "rule 'flex_attention_backward' (rules/backward.toml, family attention)" in text
    assert f"attention (block mask): dense {backward.dense_macs:,} MACs" in text
    assert from_json(counts.to_json()).attention_totals() == counts.attention_totals()


def test_grouped_query_attention_counts_per_query_head():
    model = Net(kv_heads=2)
    estimate = fxflops.estimate(model, (x_of(256),), attention="effective", conventions="torch")
    [node] = attention_nodes(estimate)
    assert (node.dense_macs, node.effective_macs) == (B * H * 256 * 256 * 2 * E, B * H * 3 * BLOCK * BLOCK * 2 * E)
    assert fxflops.estimate(model, (x_of(256),), conventions="torch").total_flops == oracle_flex_flops(
        model, (x_of(256),))[0]
    training = Net(kv_heads=2, operator=True)
    bwd = attention_nodes(fxflops.estimate(training, (x_of(256),), backward=True, attention="effective"))[1]
    assert bwd.effective_macs == B * H * 3 * BLOCK * BLOCK * 5 * E
    assert fxflops.estimate(training, (x_of(256),), backward=True, conventions="torch").bwd_flops == \
        oracle_flex_flops(training, (x_of(256),), backward=True)[1]


def test_no_block_mask_keeps_every_pair():
    estimate = fxflops.estimate(Net(mask_mod=None), (x_of(300),), attention="effective")
    [node] = attention_nodes(estimate)
    assert node.attention == "full" and node.effective_macs == node.dense_macs == B * H * 300 * 300 * 2 * E


class Given(nn.Module):
    def forward(self, q, block_mask):
        return flex_attention(q, q, q, block_mask=block_mask)


class Held(nn.Module):
    def __init__(self, block_mask):
        super().__init__()
        self.block_mask = block_mask

    def forward(self, q):
        return flex_attention(q, q, q, block_mask=self.block_mask)


def _diagonal_blocks():
    """Two kept blocks of four, given as counts (no mask_mod says which)."""
    return BlockMask.from_kv_blocks(torch.tensor([[[1, 1]]], dtype=torch.int32),
                                    torch.tensor([[[[0, 1], [1, 0]]]], dtype=torch.int32), BLOCK_SIZE=BLOCK,
                                    seq_lengths=(256, 256))


def test_block_masks_made_outside_the_forward():
    q = torch.randn(B, H, 256, E)
    # given as an input: its tensors become fake twins, so its mask_mod is evaluated
    given = create_block_mask(causal, None, None, 256, 256, device="cpu")
    [node] = attention_nodes(fxflops.estimate(Given(), (q, given), attention="effective"))
    assert node.kept_pairs == B * H * 3 * BLOCK * BLOCK
    # held by the model: its real counts are read as they are (2 blocks: the counts, not the mask_mod)
    [node] = attention_nodes(fxflops.estimate(Held(_diagonal_blocks()), (q,), attention="effective"))
    assert (node.kept_pairs, node.attention) == (B * H * 2 * BLOCK * BLOCK, "block mask")
    # the same through a real forward (method="trace", which keeps values as meta): its counts stay real
    [node] = attention_nodes(fxflops.estimate(Held(_diagonal_blocks()), (q,), attention="effective",
                                              method="trace"))
    assert (node.kept_pairs, node.attention) == (B * H * 2 * BLOCK * BLOCK, "block mask")
    # one block of 512 over 256 positions computes the 256 x 256 there are
    whole = create_block_mask(causal, None, None, 256, 256, device="cpu", BLOCK_SIZE=512)
    [node] = attention_nodes(fxflops.estimate(Held(whole), (q,), attention="effective"))
    assert node.kept_pairs == node.dense_macs // (2 * E) == B * H * 256 * 256
    # the same counts given as an input are fake: nothing says which blocks they kept
    [node] = attention_nodes(fxflops.estimate(Given(), (q, _diagonal_blocks()), attention="effective"))
    assert (node.effective_macs, node.attention) == (None, "mask from data (blocks given as counts, no mask_mod)")


class DocumentsFromTheBatch(nn.Module):
    """A document mask whose ids come with the batch: the kept blocks depend on data."""

    def forward(self, q, documents):
        def same_document(b, h, i, j):
            return documents[i] == documents[j]

        mask = create_block_mask(same_document, None, None, q.shape[-2], q.shape[-2], device=q.device)
        return flex_attention(q, q, q, block_mask=mask)


def test_a_mask_mod_reading_the_batch_is_data_and_counts_dense():
    estimate = fxflops.estimate(DocumentsFromTheBatch(), (torch.randn(B, H, 256, E), DOCS[:256]), attention="effective")
    totals = estimate.attention_totals()
    assert (totals.unknown, totals.patterns) == (1, ("mask from data",))
    assert estimate.total_macs == totals.effective_macs == totals.dense_macs == B * H * 256 * 256 * 2 * E


def test_kept_blocks_evaluated_a_few_query_blocks_at_a_time(monkeypatch):
    import fxflops.rules.mask_values

    for mask_mod, length, pairs in ((causal, 300, CAUSAL_300), (document, 512, 12 * BLOCK * BLOCK)):
        assert int(kept_block_pairs(mask_mod, 1, 1, length, length, BLOCK, BLOCK).sum()) == pairs
        # one block row at a time: the limit set where the other mask evaluations read it
        monkeypatch.setattr(fxflops.rules.mask_values, "MAX_MASK_ELEMENTS", BLOCK * length)
        assert int(kept_block_pairs(mask_mod, 1, 1, length, length, BLOCK, BLOCK).sum()) == pairs
        monkeypatch.undo()
    # per (batch, head): a mask_mod that reads them
    per_head = kept_block_pairs(lambda b, h, q, kv: (q >= kv) | (h == 1), 2, 3, 256, 256, BLOCK, BLOCK)
    assert per_head.view(-1).tolist() == [n * BLOCK * BLOCK for n in [3, 4, 3] * 2]
    # a block larger than the sequence is one block over it (flex's own empty mask is one block of 2^30)
    assert int(kept_block_pairs(causal, 1, 1, 300, 300, 1 << 30, 1 << 30).sum()) == 300 * 300


def test_a_given_block_mask_is_read_from_its_own_lists_clipped_like_the_evaluated_one():
    from fxflops.rules.kept_pairs import block_mask_kept_pairs

    mask = create_block_mask(causal, None, None, 300, 300, device="cpu")
    assert block_mask_kept_pairs(mask) == CAUSAL_300
    assert block_mask_kept_pairs(mask, (B, H, 300, 300)) == B * H * CAUSAL_300


def test_too_large_to_evaluate_is_unknown(monkeypatch):
    import fxflops.rules.flex

    monkeypatch.setattr(fxflops.rules.flex, "MAX_FLEX_MASK_ELEMENTS", 256 * 256 - 1)
    estimate = fxflops.estimate(Net(), (x_of(256),), attention="effective")
    assert estimate.attention_totals().patterns == (f"block mask (too large to evaluate: over {256 * 256 - 1} entries)",)


def test_annotate_counts_an_exported_flex_attention_as_one_op():
    model = Net().eval()
    with torch.no_grad():
        program = torch.export.export(model, (x_of(256),))
    annotated = fxflops.annotate(program, conventions="torch")
    flex = [node.meta["fxflops"] for node in annotated.graph.nodes if "flex_attention" in str(node.target)]
    assert [(cost["rule"], cost["flops"]) for cost in flex] == [("flex_attention", 2 * B * H * 256 * 256 * 2 * E)]


def test_sweep_over_seq_is_dense_exact_and_effective_per_point():
    from fxflops.capture.dynamic import user_symbol
    from fxflops.sweeps import sweep

    # the mask_mod cannot be evaluated at a symbolic size: under effective attention a sweep refuses it
    # (estimate() counts its blocks at each point), and counts it dense under dense attention
    from fxflops.sweeps.core import SweepCaptureError

    with pytest.raises(SweepCaptureError, match="block mask .*attention='dense'"):
        sweep(Net(), (x_of(256),), dims={"seq": 1}, attention="effective", conventions="torch")
    found = sweep(Net(), (x_of(256),), dims={"seq": 1}, conventions="torch")
    linears = B * D * (H * E + 2 * H * E)  # per position
    for seq in (128, 300):
        assert found.formula("macs").subs(user_symbol("seq"), seq) == B * H * seq * seq * 2 * E + linears * seq
    assert fxflops.estimate(Net(), (x_of(300),), attention="effective").attention_totals().unknown == 0


def test_flex_runs_eagerly_only_inside_the_capture_and_quietly():
    from fxflops.capture.flex import flex_runs_eagerly

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with flex_runs_eagerly():
            assert torch._dynamo.eval_frame._stance.stance == "force_eager"
            # torch warns this once per process, from the first uncompiled call: a capture's is silent
            warnings.warn("flex_attention called without torch.compile() - this will use an unfused implementation")
    assert torch._dynamo.eval_frame._stance.stance == "default"


def test_a_capture_leaves_torchs_uncompiled_warning_for_the_users_own_call():
    import torch.nn.attention.flex_attention as flex

    warning = "flex_attention_performance"
    before = warning in flex._WARNINGS_SHOWN
    flex._WARNINGS_SHOWN.discard(warning)  # as in a process where no flex_attention ran yet
    try:
        fxflops.estimate(Net(), (x_of(256),))
        assert warning not in flex._WARNINGS_SHOWN
        with pytest.warns(UserWarning, match="without torch.compile"), torch.no_grad():
            Net()(x_of(256))
    finally:
        if before:
            flex._WARNINGS_SHOWN.add(warning)
        else:
            flex._WARNINGS_SHOWN.discard(warning)


def test_transformers_llama_with_flex_attention_by_hand():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=D, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=H, num_key_value_heads=2, max_position_embeddings=1024)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="flex_attention").eval()
    ids = torch.randint(0, 128, (B, 256))
    estimate = fxflops.estimate(model, (ids,), attention="effective", conventions="torch")
    nodes = attention_nodes(estimate)
    assert [node.module for node in nodes] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert all(node.effective_macs == B * H * 3 * BLOCK * BLOCK * 2 * E for node in nodes)
    dense = fxflops.estimate(model, (ids,), conventions="torch")
    assert dense.total_flops == oracle_flex_flops(model, (ids,))[0]


def test_the_training_meter_counts_flex_blocks_at_each_batchs_sizes():
    """The meter captures once with the sequence symbolic; a BlockMask's kept blocks are evaluated at
    each batch's length (the reviewer's case: every step used to lose its FLOPs)."""
    from fxflops import FlopsMeter

    model = Net(mask_mod=causal, operator=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meter = FlopsMeter(model, (x_of(256),), attention="effective", conventions="torch", peak_flops=1e12,
                           dims={"batch": 0, "seq": 1})
    per_pair = 2 * (2 * E) + 2 * (5 * E)  # forward (E + Ev) and backward (3E + 2Ev) MACs, 2 FLOPs each
    for length, pairs in ((256, 3 * BLOCK * BLOCK), (384, 6 * BLOCK * BLOCK), (300, CAUSAL_300)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dense = FlopsMeter(model, (x_of(length),), conventions="torch", peak_flops=1e12).step(
                (x_of(length),), time=1.0)
        stats = meter.step((x_of(length),), time=1.0)
        assert stats.flops == dense.flops - B * H * (length * length - pairs) * per_pair
        assert stats.dense_flops == dense.flops
        if length == 384:
            assert meter.captures == 1  # 256 and 384 from one capture: the blocks evaluated at each length
