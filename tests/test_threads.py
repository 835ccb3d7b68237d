"""Real computation beside a capture runs on one intra-op thread (fxflops/threads.py): the small tensors
input values and attention masks compute are too small for torch's thread pool, which on a busy machine
spun 8 ms of CPU per op on its barrier. torch's thread count is put back as it was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxflops
from fxflops.threads import one_thread


@pytest.fixture
def two_threads(monkeypatch):
    """torch at 2 intra-op threads, and every set_num_threads call recorded."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    calls: list[int] = []
    original = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n) or original(n))
    yield calls
    original(before)


def test_one_thread_sets_one_and_puts_the_count_back_even_on_an_error(two_threads):
    with one_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(ValueError), one_thread():
        raise ValueError
    assert torch.get_num_threads() == 2
    assert two_threads == [1, 2, 1, 2]


class ReadsLengths(nn.Module):
    """Reads a length from its input's values (capture.input_values runs the sum for real)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.proj(x[: int(mask.sum())])


def test_values_the_forward_reads_are_computed_on_one_thread(two_threads):
    with torch.device("meta"):
        model = ReadsLengths()
    est = fxflops.estimate(model, (torch.empty(6, 4, device="meta"), torch.tensor([1, 1, 0, 1, 0, 0])))
    assert est.total_macs == 3 * 4 * 4  # three rows kept, by hand
    assert two_threads and two_threads == [1, 2] * (len(two_threads) // 2)  # each real run bracketed
    assert torch.get_num_threads() == 2


class WindowFromPositions(nn.Module):
    """Attention under a mask built from positions: its kept pairs are computed for real at count time."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(q.shape[-2], device=q.device)
        mask = (positions[:, None] - positions[None, :]).abs() <= 1
        mask = mask & (positions[:, None] % 3 != 0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_an_attention_masks_kept_pairs_are_counted_on_one_thread(two_threads):
    q = torch.empty(1, 2, 8, 4, device="meta")
    est = fxflops.estimate(WindowFromPositions(), (q, q, q), attention="effective")
    # rows 1, 2, 4, 5, 7 kept: a band of width 3 gives row 1: 3, 2: 3, 4: 3, 5: 3, 7: 2 keys
    per_head = 3 + 3 + 3 + 3 + 2
    assert est.attention_totals().effective_macs == 2 * per_head * (4 + 4)
    assert two_threads and two_threads == [1, 2] * (len(two_threads) // 2)
    assert torch.get_num_threads() == 2
