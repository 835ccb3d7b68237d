"""A sweep's point holds estimate()'s nodes field by field for attention too: the dense and effective readings
and the kept (query, key) pairs of a causal, a banded or a sliding-window mask, with and without GQA, at
sizes of 1 and above, under both readings."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxflops
from fxflops.sweeps import sweep

WINDOW = 3
HEADS, HEAD_DIM = 4, 4


class Attention(nn.Module):
    """Self-attention over [batch, seq, 16]: 4 query heads of 4, `kv_heads` key/value heads (GQA when fewer),
    masked causally by SDPA (`is_causal`), or by a mask built from positions: the lower triangle, or a
    sliding window of WINDOW keys. (The masks use unsqueeze: `i[None, :]` records a full slice under named
    sizes that torch's indexing leaves out at fixed sizes, a zero-cost node estimate() does not have.)"""

    def __init__(self, mask: str, kv_heads: int) -> None:
        super().__init__()
        self.mask, self.kv_heads = mask, kv_heads
        self.query = nn.Linear(16, HEADS * HEAD_DIM)
        self.key_value = nn.Linear(16, 2 * kv_heads * HEAD_DIM)
        self.out = nn.Linear(HEADS * HEAD_DIM, 16)

    def forward(self, x):
        batch, seq, _ = x.shape
        q = self.query(x).view(batch, seq, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = (t.transpose(1, 2) for t in self.key_value(x).view(batch, seq, 2, self.kv_heads, HEAD_DIM).unbind(2))
        keys, queries = torch.arange(seq).unsqueeze(0), torch.arange(seq).unsqueeze(1)
        options = {"enable_gqa": self.kv_heads != HEADS}
        if self.mask == "causal":
            options["is_causal"] = True
        elif self.mask == "band":
            options["attn_mask"] = keys <= queries
        else:
            options["attn_mask"] = (keys <= queries) & (keys > queries - WINDOW)
        y = F.scaled_dot_product_attention(q, k, v, **options)
        return self.out(y.transpose(1, 2).reshape(batch, seq, HEADS * HEAD_DIM))


def kept_by_hand(mask: str, batch: int, seq: int) -> int:
    """Query i keeps keys 0..i (causal, band), or the last WINDOW of them; over every batch and query head."""
    per_head = sum(min(i + 1, WINDOW) if mask == "window" else i + 1 for i in range(seq))
    return batch * HEADS * per_head


@pytest.mark.parametrize("attention", ["dense", "effective"])
@pytest.mark.parametrize("mask, kv_heads", [("causal", 4), ("causal", 2), ("band", 2), ("window", 4), ("window", 2)])
def test_every_point_has_estimates_nodes_field_by_field(mask, kv_heads, attention):
    model = Attention(mask, kv_heads)
    swept = sweep(model, torch.zeros(2, 8, 16), dims={"batch": 0, "seq": 1}, attention=attention)
    for batch, seq in [(1, 1), (1, 2), (3, 1), (2, 8), (3, 5)]:
        at = swept.at(batch=batch, seq=seq)
        fresh = fxflops.estimate(model, torch.zeros(batch, seq, 16), attention=attention)
        # every field, source lines included (the same forward captured: the same lines)
        assert [dataclasses.asdict(node) for node in at.nodes] == [dataclasses.asdict(node) for node in fresh.nodes]
        (node,) = [node for node in at.nodes if node.attention is not None]
        kept = kept_by_hand(mask, batch, seq)
        assert node.kept_pairs == kept
        # by hand: each kept pair scores a query against a key and weighs a value, HEAD_DIM MACs each
        assert node.effective_macs == kept * 2 * HEAD_DIM
        assert node.dense_macs == batch * HEADS * seq * seq * 2 * HEAD_DIM
