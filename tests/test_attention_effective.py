"""Attention read two ways: dense (every (query, key) pair, FlopCounterMode's count, the default) and
effective (only the pairs the mask keeps). Every effective count below is worked out by hand: a head
keeps P pairs, so the forward is B.Hq.P.(E + Ev) MACs and the fused backward B.Hq.P.(3E + 2Ev)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxflops
from fxflops.rules.mask_bands import band_pairs, causal_pairs
from fxflops.rules.mask_values import mask_kept_pairs
from fxflops.report.machine import from_json
from fxflops.rules import RuleFileError, load_rule_file
from tests.oracle import oracle_flops

B, H, E = 2, 4, 16


def qkv(lq=8, lk=8, heads=H, kv_heads=H, requires_grad=True):
    torch.manual_seed(0)
    q = torch.randn(B, heads, lq, E, requires_grad=requires_grad)
    return q, torch.randn(B, kv_heads, lk, E), torch.randn(B, kv_heads, lk, E)


class Causal(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


class Windowed(nn.Module):
    """A sliding window of W keys built from positions, as Mistral's mask is."""

    def __init__(self, window):
        super().__init__()
        self.window = window

    def forward(self, q, k, v):
        i = torch.arange(q.shape[-2])
        mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < self.window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class PackedFromPositions(nn.Module):
    """Three documents packed in one row (lengths 3, 3, 2), their block-diagonal mask from positions."""

    def forward(self, q, k, v):
        i = torch.arange(q.shape[-2])
        doc = (i >= 3).long() + (i >= 6).long()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=doc[:, None] == doc[None, :])


class MaskGiven(nn.Module):
    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attention_counts(model, args, **options):
    """(dense fwd, dense bwd, effective fwd, effective bwd) MACs of the attention ops, and the estimate."""
    estimate = fxflops.estimate(model, args, backward=True, **options)
    nodes = [node for node in estimate.nodes if node.attention is not None]
    fwd = [node for node in nodes if not node.is_backward]
    bwd = [node for node in nodes if node.is_backward]
    return (sum(n.dense_macs for n in fwd), sum(n.dense_macs for n in bwd),
            sum(n.effective_macs for n in fwd), sum(n.effective_macs for n in bwd)), estimate


def test_causal_square_by_hand():
    counts, estimate = attention_counts(Causal(), qkv())
    pairs = B * H * 36  # 1 + 2 + ... + 8 per head
    assert counts == (B * H * 64 * 32, B * H * 64 * 80, pairs * 32, pairs * 80)
    assert estimate.total_macs == B * H * 64 * (32 + 80)  # dense by default: no number changes
    effective = fxflops.estimate(Causal(), qkv(), backward=True, attention="effective")
    assert (effective.fwd_macs, effective.bwd_macs) == (pairs * 32, pairs * 80)
    assert effective.attention_totals().patterns == ("causal",)


@pytest.mark.parametrize("lq, lk, per_head", [(5, 8, 1 + 2 + 3 + 4 + 5), (8, 5, 1 + 2 + 3 + 4 + 5 * 4)])
def test_causal_with_unequal_lengths_is_top_left_aligned(lq, lk, per_head):
    # torch's is_causal is torch.ones(Lq, Lk).tril(): query i sees keys 0..i
    assert torch.ones(lq, lk).tril().sum() == per_head == causal_pairs(lq, lk)
    counts, _ = attention_counts(Causal(), qkv(lq, lk))
    assert counts[2:] == (B * H * per_head * 32, B * H * per_head * 80)


def test_causal_grouped_query_attention_counts_per_query_head():
    counts, _ = attention_counts(Causal(), qkv(heads=4, kv_heads=2))
    assert counts == (B * 4 * 64 * 32, B * 4 * 64 * 80, B * 4 * 36 * 32, B * 4 * 36 * 80)


def test_dense_equals_flop_counter_mode():
    for model, args in ((Causal(), qkv(requires_grad=False)), (Windowed(3), qkv(requires_grad=False))):
        assert fxflops.estimate(model, args, conventions="torch").total_flops == oracle_flops(model, args)


@pytest.mark.parametrize("window, per_head", [(3, 1 + 2 + 3 * 6), (8, 36), (20, 36), (1, 8)])
def test_sliding_window_from_positions_by_hand(window, per_head):
    counts, estimate = attention_counts(Windowed(window), qkv())
    assert counts == (B * H * 64 * 32, B * H * 64 * 80, B * H * per_head * 32, B * H * per_head * 80)
    assert estimate.attention_totals().patterns == (f"sliding window {window}",)


def test_packed_documents_built_from_positions_by_hand():
    counts, estimate = attention_counts(PackedFromPositions(), qkv())
    per_head = 3 * 3 + 3 * 3 + 2 * 2
    assert counts[2:] == (B * H * per_head * 32, B * H * per_head * 80)
    assert estimate.attention_totals().patterns == ("mask",)


def test_a_mask_too_large_to_evaluate_is_unknown_and_says_so(monkeypatch):
    import fxflops.rules.mask_values

    monkeypatch.setattr(fxflops.rules.mask_values, "MAX_MASK_ELEMENTS", 63)  # the 8 x 8 mask has 64
    estimate = fxflops.estimate(PackedFromPositions(), qkv(), attention="effective")
    totals = estimate.attention_totals()
    assert (totals.unknown, totals.patterns) == (1, ("mask (too large to evaluate: over 63 entries)",))
    assert estimate.total_macs == totals.dense_macs
    assert "1 of 1 attention ops keep pairs not known without data, counted dense in both" in estimate.print(
        as_string=True, detailed=False)


def test_a_mask_given_as_input_is_unknown_then_counted_from_the_real_mask():
    doc = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    mask = doc[:, None] == doc[None, :]
    counts_estimate = fxflops.estimate(MaskGiven(), (*qkv(), mask), backward=True, attention="effective")
    totals = counts_estimate.attention_totals()
    assert (totals.unknown, totals.nodes, totals.patterns) == (2, 2, ("mask from data",))
    assert totals.effective_macs == totals.dense_macs == counts_estimate.total_macs  # dense stands in
    assert mask_kept_pairs(mask, (B, H, 8, 8)) == B * H * 22
    additive = torch.zeros(8, 8).masked_fill(~mask, float("-inf"))
    assert mask_kept_pairs(additive, (B, H, 8, 8)) == B * H * 22
    assert mask_kept_pairs(torch.zeros(8, 8).masked_fill(~mask, torch.finfo(torch.float32).min)) == 22
    with pytest.raises(ValueError, match="does not broadcast"):
        mask_kept_pairs(mask, (B, H, 8, 9))


def test_band_pairs_match_counting_the_band():
    for lq in range(1, 9):
        for lk in range(1, 9):
            i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
            for lo in (None, -5, -2, 0, 1):
                for hi in (None, -1, 0, 2, 6):
                    keep = torch.ones(lq, lk, dtype=torch.bool)
                    if lo is not None:
                        keep &= j - i >= lo
                    if hi is not None:
                        keep &= j - i <= hi
                    assert band_pairs(lq, lk, lo, hi) == int(keep.sum()), (lq, lk, lo, hi)


def test_sweep_formula_in_seq():
    from fxflops.capture.dynamic import user_symbol
    from fxflops.sweeps import sweep

    seq_ = user_symbol("seq")
    q, k, v = qkv(requires_grad=False)
    causal = sweep(Causal(), (q, k, v), dims={"seq": 2}, attention="effective")
    windowed = sweep(Windowed(3), (q, k, v), dims={"seq": 2}, attention="effective")
    for seq in (1, 2, 3, 5, 8, 20):
        assert causal.formula("macs").subs(seq_, seq) == B * H * seq * (seq + 1) // 2 * 32
        per_head = sum(min(i + 1, 3) for i in range(seq))
        assert windowed.formula("macs").subs(seq_, seq) == B * H * per_head * 32
        assert windowed.at(seq=seq).total_macs == B * H * per_head * 32
    dense = sweep(Windowed(3), (q, k, v), dims={"seq": 2})
    assert dense.formula("macs").subs(seq_, 20) == B * H * 400 * 32


def test_reports_show_both_readings():
    estimate = fxflops.estimate(Causal(), qkv(), attention="effective")
    text = estimate.print(as_string=True, detailed=False)
    assert "attention flops:                " in text
    assert "32.77 K dense, 18.43 K effective (causal); totals count effective" in text
    back = from_json(estimate.to_json())
    assert back.attention == "effective" and back.attention_totals() == estimate.attention_totals()
    record = json.loads(estimate.to_json())
    assert record["attention"]["totals"]["effective_flops"] == 2 * B * H * 36 * 32
    assert "18.43 K" in estimate.to_html() and "dense / effective" in estimate.to_html()
    plain = fxflops.estimate(nn.Linear(4, 4), (torch.randn(2, 4),))
    assert "attention" not in plain.print(as_string=True, detailed=False)
    assert json.loads(plain.to_json())["attention"] == {"reading": "dense", "totals": None}


def test_attention_argument_is_checked():
    with pytest.raises(ValueError, match="attention='sparse': say 'dense'"):
        fxflops.estimate(Causal(), qkv(), attention="sparse")


def test_effective_formulas_come_in_pairs(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('[[rule]]\nname = "mine"\nops = ["aten.mm"]\nmacs = "1"\nflops = "1"\neffective_macs = "kept_pairs"\n')
    with pytest.raises(RuleFileError, match="'effective_macs' without 'effective_flops'"):
        load_rule_file(path)
    path.write_text('[[rule]]\nname = "mine"\nops = ["aten.mm"]\nmacs = "1"\nflops = "1"\n'
                    'effective_macs = "kept_pair"\neffective_flops = "macs"\n')
    with pytest.raises(RuleFileError, match="'effective_macs': name 'kept_pair' .*did you mean 'kept_pairs'"):
        load_rule_file(path)


# ---------------------------------------------------------------- transformers' sliding-window models

WINDOW, HEADS, HEAD_DIM = 4, 4, 8
PROJECTION_MACS = 32 * 32 + 2 * 32 * 16 + 32 * 32  # per token: q, k, v (2 key/value heads), o


def _sliding_model(kind):
    import transformers as tf

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=HEADS,
                  num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=128, sliding_window=WINDOW)
    cls, config = {
        "mistral": (tf.MistralForCausalLM, lambda: tf.MistralConfig(num_hidden_layers=1, **common)),
        "gemma3": (tf.Gemma3ForCausalLM, lambda: tf.Gemma3TextConfig(
            num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], **common)),
        "qwen2": (tf.Qwen2ForCausalLM, lambda: tf.Qwen2Config(
            num_hidden_layers=2, use_sliding_window=True, layer_types=["full_attention", "sliding_attention"],
            **common)),
    }[kind]
    config = config()
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return cls(config).eval(), config.layer_types if kind != "mistral" else ["sliding_attention"]


@pytest.mark.parametrize("kind", ["mistral", "gemma3", "qwen2"])
def test_transformers_sliding_window_layers_by_hand(kind):
    from fxflops.capture.dynamic import user_symbol
    from fxflops.sweeps import sweep

    model, layer_types = _sliding_model(kind)
    swept = sweep(model, (torch.zeros(1, 8, dtype=torch.long),), dims={"seq": 1}, attention="effective")
    for seq in (3, 4, 12):  # shorter than the window, equal, longer
        estimate = swept.at(seq=seq)
        for layer, layer_type in enumerate(layer_types):
            window = WINDOW if layer_type == "sliding_attention" else seq
            pairs = HEADS * sum(min(i + 1, window) for i in range(seq))
            path = f"model.layers.{layer}.self_attn"
            (node,) = [node for node in estimate.nodes if node.attention is not None and node.module == path]
            assert (node.dense_macs, node.effective_macs) == (HEADS * seq * seq * 2 * HEAD_DIM, pairs * 2 * HEAD_DIM)
            formula = swept.formula("macs", module=path, seq=seq)
            assert formula.subs(user_symbol("seq"), seq) == PROJECTION_MACS * seq + pairs * 2 * HEAD_DIM
    dense = fxflops.estimate(model, (torch.zeros(1, 12, dtype=torch.long),))  # the default reading
    assert dense.total_macs == estimate.total_macs + sum(
        n.dense_macs - n.effective_macs for n in estimate.nodes if n.attention is not None)


# ------------------------------------------------------------------------- flex_attention BlockMask


def test_flex_block_masks_keep_their_blocks_by_hand():
    from torch.nn.attention.flex_attention import create_block_mask

    from fxflops.rules.kept_pairs import block_mask_kept_pairs

    length, block = 512, 128  # 4 x 4 blocks

    def causal(b, h, q, kv):
        return q >= kv

    doc = torch.tensor([0] * 128 + [1] * 256 + [2] * 128)  # three documents, block-aligned

    def document(b, h, q, kv):
        return doc[q] == doc[kv]

    causal_mask = create_block_mask(causal, None, None, length, length, device="cpu")
    document_mask = create_block_mask(document, None, None, length, length, device="cpu")
    # by hand: causal keeps 1 + 2 + 3 + 4 blocks (the diagonal partial, the rest full); the documents
    # keep 1 + 2 x 2 + 1 (all full)
    for mask, blocks, partial in ((causal_mask, 10, 4), (document_mask, 6, 0)):
        assert int(mask.kv_num_blocks.sum()) == partial  # the mask's own block counts
        assert int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()) == blocks
        assert mask.BLOCK_SIZE == (block, block)
        assert block_mask_kept_pairs(mask) == blocks * block * block
        assert block_mask_kept_pairs(mask, (B, H, length, length)) == B * H * blocks * block * block
    with pytest.raises(ValueError, match="does not broadcast"):
        block_mask_kept_pairs(create_block_mask(causal, 2, None, length, length, device="cpu"), (3, H, length, length))


def test_cli_attention_option(tmp_path, capsys):
    from fxflops.cli import main as cli

    (tmp_path / "causal.py").write_text(
        "import torch\n"
        "class Causal(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)\n"
        "def build():\n"
        "    return Causal()\n")
    spec = [f"{tmp_path}/causal.py:build", "--input-shape", "2,4,8,16", "--quiet", "--format", "json"]
    assert cli.main(spec + ["--attention", "effective"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["attention"]["reading"] == "effective"
    assert record["totals"]["macs"] == B * H * 36 * 32
    assert cli.main(spec) == 0
    assert json.loads(capsys.readouterr().out)["totals"]["macs"] == B * H * 64 * 32


class CausalAndGiven(nn.Module):
    def forward(self, q, k, v, mask):
        i = torch.arange(q.shape[-2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(i[:, None] >= i[None, :]) & mask)


class CausalDocumentsFromPositions(nn.Module):
    def forward(self, q, k, v):
        i = torch.arange(q.shape[-2])
        doc = (i >= 3).long() + (i >= 6).long()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(doc[:, None] == doc[None, :]) & (i[:, None] >= i[None, :]))


def test_a_band_and_data_is_named_and_unknown_a_band_and_positions_is_counted():
    given = fxflops.estimate(CausalAndGiven(), (*qkv(), torch.ones(8, 8, dtype=torch.bool)), attention="effective")
    assert given.attention_totals().patterns == ("causal & mask from data",)
    assert given.attention_totals().unknown == 1
    counts, estimate = attention_counts(CausalDocumentsFromPositions(), qkv())
    per_head = 6 + 6 + 3  # causal inside documents of 3, 3 and 2
    assert counts[2:] == (B * H * per_head * 32, B * H * per_head * 80)
    assert estimate.attention_totals().patterns == ("mask",)


def test_a_sweep_names_a_mask_from_data_as_the_static_count_does():
    from fxflops.sweeps import sweep

    mask = torch.ones(B, 1, 8, 8, dtype=torch.bool)
    for model, args, pattern in ((MaskGiven(), (*qkv(), mask), "mask from data"),
                                 (CausalAndGiven(), (*qkv(), mask), "causal & mask from data")):
        swept = sweep(model, args, dims={"batch": 0}, attention="effective").at(batch=3)
        assert swept.attention_totals().patterns == (pattern,), type(model).__name__
    # a mask built from positions: estimate() counts its pairs at each point, a sweep cannot (issue 37 review)
    from fxflops.sweeps.core import SweepCaptureError

    with pytest.raises(SweepCaptureError, match=r"aten\.scaled_dot_product_attention\.default in the root module "
                       r"has a mask .*counted at concrete sizes only.*estimate\(\) at each point"):
        sweep(PackedFromPositions(), qkv(), dims={"batch": 0}, attention="effective")
    static = fxflops.estimate(CausalAndGiven(), (*qkv(), mask), attention="effective")
    assert static.attention_totals().patterns == ("causal & mask from data",)


class DocumentsMovedToDevice(nn.Module):
    """PackedFromPositions with the document ids moved by `.to(device)`, which the capture records
    whole as aten.to.device (no dtype: its overload does not take the call's arguments)."""

    def forward(self, q, k, v):
        i = torch.arange(q.shape[-2])
        doc = ((i >= 3).long() + (i >= 6).long()).to(q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=doc[:, None] == doc[None, :])


def test_a_mask_moved_to_the_device_is_evaluated():
    counts, estimate = attention_counts(DocumentsMovedToDevice(), qkv())
    per_head = 3 * 3 + 3 * 3 + 2 * 2
    assert counts[2:] == (B * H * per_head * 32, B * H * per_head * 80)
    assert estimate.attention_totals().patterns == ("mask",)


class SnapshotThenTriuInPlace(nn.Module):
    """The mask's history mutates a tensor after copying it: evaluated in dependency order, the copy
    would see the mutation. Really every pair is kept (ones | triu(ones))."""

    def forward(self, q, k, v):
        full = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool)
        snap = full.clone()
        full.triu_(1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=full | snap)


class ShiftedInPlaceThroughAView(nn.Module):
    """An arange shifted in place after a view of it was taken: the view reads the shifted values."""

    def forward(self, q, k, v):
        i = torch.arange(q.shape[-2])
        rows = i[:, None]
        i.add_(3)  # rows now holds i + 3: query i sees keys 0..i + 3
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.arange(k.shape[-2])[None, :] <= rows)


@pytest.mark.parametrize("model", [SnapshotThenTriuInPlace(), ShiftedInPlaceThroughAView()])
def test_a_mask_built_with_in_place_ops_is_unknown_and_counted_dense(model):
    q, k, v = qkv(requires_grad=False)
    estimate = fxflops.estimate(model, (q, k, v), attention="effective")
    totals = estimate.attention_totals()
    assert totals.unknown == 1
    assert totals.effective_macs == totals.dense_macs == B * H * 64 * 32


class ExpandedSizeOneRow(nn.Module):
    """A single query position (0) expanded over every row, compared with the key positions j."""

    def __init__(self, keep_at_most_zero: bool) -> None:
        super().__init__()
        self.keep_at_most_zero = keep_at_most_zero

    def forward(self, q, k, v):
        lq, lk = q.shape[-2], k.shape[-2]
        zero = torch.arange(1)[:, None].expand(lq, lk)
        mask = zero >= torch.arange(lk) if self.keep_at_most_zero else zero <= torch.arange(lk)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("keep_at_most_zero, per_head", [(True, 8), (False, 64)])  # column 0 of 8 rows; all
def test_expanding_a_size_one_axis_drops_its_positions(keep_at_most_zero, per_head):
    counts, _ = attention_counts(ExpandedSizeOneRow(keep_at_most_zero), qkv())
    assert counts[2:] == (B * H * per_head * 32, B * H * per_head * 80)


@pytest.mark.parametrize("lq, lk", [(5, 8), (8, 8), (3, 3)])
def test_efficient_attention_lower_right_causal_is_a_band_to_lk_minus_lq(lq, lk):
    from torch.nn.attention.bias import causal_lower_right

    from fxflops.rules.kept_pairs import call_kept_pairs

    per_head = int(causal_lower_right(lq, lk)._materialize(torch.device("cpu")).sum())  # torch's own mask
    query, key = torch.empty(B, lq, H, E), torch.empty(B, lk, H, E)  # (batch, seq, heads, dim)
    kept = call_kept_pairs("aten._efficient_attention_forward.default",
                           {"query": query, "key": key, "custom_mask_type": 2}, {}, {}, symbolic=False)
    assert kept.pairs == B * H * per_head
    assert per_head == {(5, 8): 4 + 5 + 6 + 7 + 8, (8, 8): 36, (3, 3): 6}[(lq, lk)]


def test_a_reader_ignores_attention_totals_keys_a_later_version_adds():
    estimate = fxflops.estimate(Causal(), qkv(), attention="effective")
    record = json.loads(estimate.to_json())
    record["attention"]["totals"]["kept_pairs"] = 123  # a key this version does not know
    assert from_json(json.dumps(record)).attention_totals() == estimate.attention_totals()


class EagerTwoMasksOneInPlace(nn.Module):
    """Plain-op attention filled by two masks: a causal one from positions, and SnapshotThenTriuInPlace's."""

    def forward(self, q, k, v):
        n = q.shape[-2]
        i = torch.arange(n)
        full = torch.ones(n, n, dtype=torch.bool)
        snap = full.clone()
        full.triu_(1)
        scores = (q @ k.transpose(-2, -1)).masked_fill(i[:, None] < i[None, :], float("-inf"))
        scores = scores.masked_fill(~(full | snap), float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


def test_eager_attention_with_a_mask_built_in_place_is_unknown():
    estimate = fxflops.estimate(EagerTwoMasksOneInPlace(), qkv(requires_grad=False), attention="effective")
    totals = estimate.attention_totals()
    assert (totals.nodes, totals.unknown) == (2, 2)
    assert totals.effective_macs == totals.dense_macs == 2 * B * H * 64 * E
    assert totals.patterns == ("mask from data (built with in-place ops)",)


class PackedCheck(nn.Module):
    """transformers' sdpa mask (5.x): packed documents found from position ids that do not step by 1
    (diff with a prepend, != 1, cumsum), indexed per (batch, query) and (batch, key), and'ed with causal."""

    def __init__(self, first_document=None):
        super().__init__()
        self.first_document = first_document  # positions restart after this many tokens

    def forward(self, q, k, v):
        length, first = q.shape[-2], self.first_document
        pos = (torch.arange(length) if first is None else torch.cat([torch.arange(first), torch.arange(length - first)]))[None]
        doc = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
        b = torch.arange(1)[:, None, None, None]
        qi, ki = torch.arange(length)[None, None, :, None], torch.arange(length)[None, None, None, :]
        mask = (doc[b, qi] == doc[b, ki]) & (pos[b, ki] <= pos[b, qi])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(q.shape[0], 1, -1, -1))


def test_transformers_packed_sequence_check_on_plain_positions_is_read_as_causal():
    """Positions that step by 1 make one document: the mask is causal, read as a band (no evaluation),
    with its closed form in a sweep: sum over i of (i + 1) pairs per head."""
    from fxflops.capture.dynamic import user_symbol
    from fxflops.sweeps import sweep

    q, k, v = qkv(requires_grad=False)
    [node] = [n for n in fxflops.estimate(PackedCheck(), (q, k, v)).nodes if n.attention is not None]
    assert (node.attention, node.kept_pairs) == ("causal", B * H * 8 * 9 // 2)
    swept = sweep(PackedCheck(), (q, k, v), dims={"seq": 2}, attention="effective")
    for seq in (1, 5, 8, 13):
        assert swept.formula("macs").subs(user_symbol("seq"), seq) == B * H * seq * (seq + 1) // 2 * 2 * E


def test_the_packed_sequence_check_on_restarting_positions_is_evaluated():
    """Positions restarting at 0 (documents of 3 and 5, from a cat of aranges) are not affine: evaluated
    at the captured sizes, each token seeing its own document causally: 6 + 15 pairs per head."""
    q, k, v = qkv(requires_grad=False)
    model = PackedCheck(first_document=3)
    [node] = [n for n in fxflops.estimate(model, (q, k, v)).nodes if n.attention is not None]
    assert node.kept_pairs == B * H * (6 + 15)


class WrappedIndex(nn.Module):
    """Positions read through an index that is -1 at the first query (it wraps to the last position)."""

    def forward(self, q, k, v):
        i = torch.arange(q.shape[-2])
        shifted = i[i - 1]  # [L-1, 0, 1, ..., L-2]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=shifted[:, None] >= i[None, :])


def test_an_index_that_can_be_negative_is_not_read_as_a_band():
    """Row 0 reads position L-1 and keeps all 8 keys; row r >= 1 keeps r: 8 + 28 pairs per head (a band
    reading of i - 1 would give row 0 none)."""
    q, k, v = qkv(requires_grad=False)
    [node] = [n for n in fxflops.estimate(WrappedIndex(), (q, k, v)).nodes if n.attention is not None]
    assert node.kept_pairs == B * H * (8 + 28)
