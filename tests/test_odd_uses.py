"""Unusual uses that once reached users as raw errors (or wrong files): each gives a working result or
one clear line. Issue 22, items 12 to 16."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fxflops

# ------------------------------------------------------------------ a sparse buffer under profile()


class SparseAdjacency(nn.Module):
    """A graph layer: a sparse adjacency buffer times the input, then a Linear(4, 4)."""

    def __init__(self, write: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("adj", torch.eye(4).to_sparse())
        self.write = write

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.write:
            self.adj.mul_(2)  # a forward that writes into its sparse buffer: put back afterwards
        return self.lin(torch.sparse.mm(self.adj, x))


LINEAR_4x4_ON_4_ROWS = 4 * 4 * 4  # MACs by hand; the sparse mm is reported unknown, not counted


@pytest.mark.parametrize("write", [False, True])
def test_profile_works_on_a_model_with_a_sparse_buffer(write):
    model = SparseAdjacency(write)
    before = model.adj.to_dense().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxflops.UnknownOpsWarning)
        profiled = fxflops.profile(model, (torch.randn(4, 4),), warm_up=1, steps=2)
    assert profiled.total_macs == LINEAR_4x4_ON_4_ROWS
    assert profiled.measurements.fwd_latency > 0
    assert model.adj.is_sparse and torch.equal(model.adj.to_dense(), before)


def test_get_model_profile_works_on_a_model_with_a_sparse_buffer():
    from fxflops.compat import get_model_profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxflops.UnknownOpsWarning)
        flops, macs, params = get_model_profile(SparseAdjacency(), args=[torch.randn(4, 4)], print_profile=False,
                                                as_string=False)
    assert (macs, params) == (LINEAR_4x4_ON_4_ROWS, 4 * 4 + 4)
    assert flops == 2 * LINEAR_4x4_ON_4_ROWS + 4 * 4  # the bias adds one FLOP per output
