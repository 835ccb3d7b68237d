"""Sweeps at sizes of 1: a capture at 2 serves a size of 1 where torch's `size == 1` questions decide
nothing (fxflops.capture.size_one), and still splits where the forward decides something from it.
Every point is checked against a fresh estimate() there."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fxflops
from fxflops.sweeps import sweep


def assert_same(at: fxflops.Estimate, fresh: fxflops.Estimate) -> None:
    assert (at.total_macs, at.total_flops, at.total_params, at.total_bytes) == \
        (fresh.total_macs, fresh.total_flops, fresh.total_params, fresh.total_bytes)
    assert {n: (m.macs, m.flops, m.calls) for n, m in at.modules.items()} == \
        {n: (m.macs, m.flops, m.calls) for n, m in fresh.modules.items()}
    assert {k: (t.count, t.macs, t.flops) for k, t in at.by_op.items()} == \
        {k: (t.count, t.macs, t.flops) for k, t in fresh.by_op.items()}
    # every node field by field (counts, shapes, bytes, attention readings and kept pairs, source lines)
    assert [dataclasses.asdict(n) for n in at.nodes] == [dataclasses.asdict(n) for n in fresh.nodes]


class Residual(nn.Module):
    """A conv block as a ResNet's: batch norm ([C, 1, 1] operands), an in-place residual add, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.norm = nn.BatchNorm2d(3)
        self.head = nn.Linear(3, 5)

    def forward(self, x):
        y = self.norm(self.conv(x))
        y += x
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(y.relu(), 1), 1))


def test_batch_one_is_a_point_of_the_capture_at_two():
    model = Residual().eval()
    swept = sweep(model, torch.empty(1, 3, 8, 8), dims={"batch": 0})
    assert swept.pieces[0].plan.hints == {"batch": 2}
    assert swept.holds_for == "batch >= 1"
    for batch in (1, 2, 7):
        assert_same(swept.at(batch=batch), fxflops.estimate(model, torch.empty(batch, 3, 8, 8)))
    assert len(swept.pieces) == 1


def test_a_point_with_a_size_of_one_outside_every_piece_is_captured_at_two_first():
    # the image's last map 1 x 1 below size 2 (a stride check that decides an elementwise output's
    # layout); the new piece, captured at batch 2, serves batch 1 too
    model = Residual().eval()
    swept = sweep(model, torch.empty(2, 3, 8, 8), dims={"batch": 0, "size": (2, 3)})
    assert swept.holds_for == "batch >= 1, size >= 2"
    for batch in (1, 2):
        assert_same(swept.at(batch=batch, size=1), fxflops.estimate(model, torch.empty(batch, 3, 1, 1)))
    assert len(swept.pieces) == 2
    assert swept.pieces[1].plan.hints == {"batch": 2, "size": 1}


class BranchOnOne(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.extra = nn.Linear(4, 4)

    def forward(self, x):
        x = self.proj(x)
        return self.extra(x) if x.shape[0] == 1 else x


def test_a_branch_on_batch_one_still_splits():
    model = BranchOnOne()
    swept = sweep(model, torch.empty(3, 4), dims={"batch": 0})
    assert swept.holds_for == "batch >= 2"
    for batch in (1, 2, 5):
        assert_same(swept.at(batch=batch), fxflops.estimate(model, torch.empty(batch, 4)))
    assert len(swept.pieces) == 2


class Squeezed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):  # a squeeze removes the batch axis only at batch 1: a question that decides
        y = x.squeeze(0)
        return self.proj(self.proj(y)) if y.dim() == 1 else self.proj(y)


def test_a_squeeze_of_the_batch_axis_still_splits():
    model = Squeezed()
    swept = sweep(model, torch.empty(3, 4), dims={"batch": 0})
    for batch in (1, 2, 5):
        assert_same(swept.at(batch=batch), fxflops.estimate(model, torch.empty(batch, 4)))
    assert len(swept.pieces) == 2


class Outer(nn.Module):
    def forward(self, x):  # rows' sums plus columns' sums: a broadcast of two named sizes
        return x.sum(1) + x.sum(0)


def test_a_broadcast_of_two_sizes_still_splits_where_one_is_one():
    model = Outer()
    swept = sweep(model, torch.empty(3, 3), dims={"rows": 0, "cols": 1})
    assert "cols == rows" in swept.conditions or "rows == cols" in swept.conditions
    for rows, cols in [(4, 4), (1, 5), (5, 1)]:
        at, fresh = swept.at(rows=rows, cols=cols), fxflops.estimate(model, torch.empty(rows, cols))
        assert_same(at, fresh)
        assert at.by_op["aten.add.Tensor"].flops == max(rows, cols)  # by hand: one add per element of the result


class Transposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):  # [batch, seq, 4] read as [seq, batch, 4]: contiguous only where batch is 1
        y = x.transpose(0, 1)
        return self.proj(self.proj(y)) if y.is_contiguous() else self.proj(y)


def test_a_stride_that_matters_at_batch_one_still_splits():
    # the contiguity check's `batch == 1` is answered "no" unguarded, and the stride check after it
    # fails: the tensor's contiguity is then a formula, and the branch on it a condition
    model = Transposed()
    swept = sweep(model, torch.empty(2, 5, 4), dims={"batch": 0, "seq": 1})
    for batch, seq in [(2, 5), (1, 5), (3, 7), (1, 2)]:
        assert_same(swept.at(batch=batch, seq=seq), fxflops.estimate(model, torch.empty(batch, seq, 4)))
    assert len(swept.pieces) == 2


@pytest.mark.parametrize("batch", [1, 2])
def test_size_zero_is_its_own_piece(batch):
    model = nn.Linear(4, 4)
    swept = sweep(model, torch.empty(batch, 4), dims={"batch": 0})
    assert swept.holds_for == "batch >= 1"
    assert_same(swept.at(batch=0), fxflops.estimate(model, torch.empty(0, 4)))
    assert swept.pieces[-1].summary() == "batch = 0"


class RowSums(nn.Module):
    def forward(self, x):  # a [batch] tensor through an elementwise op: is_contiguous asks `batch < 2`
        return x.sum(1) * x.sum(1)


def test_a_vector_of_batch_values_is_contiguous_either_way():
    # numel < 2 is "contiguous" at once; otherwise the strides, known to be the contiguous ones, pass
    model = RowSums()
    swept = sweep(model, torch.empty(2, 5), dims={"batch": 0})
    assert swept.holds_for == "batch >= 1"
    for batch in (1, 2, 7):
        at = swept.at(batch=batch)
        assert_same(at, fxflops.estimate(model, torch.empty(batch, 5)))
        assert at.by_op["aten.mul.Tensor"].flops == batch  # by hand: one multiply per row
    assert len(swept.pieces) == 1


class StridedRows(nn.Module):
    def forward(self, x):  # a [batch] column of [batch, 5]: stride 5, contiguous only where batch is 1
        column = x.select(1, 0)
        return column * column


def test_a_strided_vector_of_batch_values_is_right_at_batch_one():
    # the strides are not the contiguous ones: `batch < 2` decides the layout, and stays a condition
    model = StridedRows()
    swept = sweep(model, torch.empty(2, 5), dims={"batch": 0})
    for batch in (1, 2, 7):
        assert_same(swept.at(batch=batch), fxflops.estimate(model, torch.empty(batch, 5)))


class Flattened(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):  # [batch, 3, 4] viewed as [batch * 3, 4]: the collapse asks `batch != 1`
        return self.proj(x.view(x.shape[0] * 3, 4))


def test_flattening_the_batch_into_rows_holds_at_batch_one():
    # the collapsed axes' stride is the least of those not 1 in size; the batch axis's (12) is no less
    # than the next one's (4), so the stride is 4 either way
    model = Flattened()
    swept = sweep(model, torch.empty(2, 3, 4), dims={"batch": 0})
    assert swept.holds_for == "batch >= 1"
    for batch in (1, 2, 9):
        at = swept.at(batch=batch)
        assert_same(at, fxflops.estimate(model, torch.empty(batch, 3, 4)))
        assert at.total_macs == batch * 3 * 4 * 4  # by hand: rows x in x out
    assert len(swept.pieces) == 1


def test_gpt2_small_at_batch_one_is_the_capture_at_two():
    # the example decoder's attention (views of the qkv split, SDPA, the heads merged back): every
    # question on batch being 1 is one of those that decide nothing
    from fxflops.cli.examples import gpt2_small

    model = gpt2_small(vocab_size=100, n_positions=64, d_model=32, n_layer=1, n_head=2)
    swept = sweep(model, torch.zeros(2, 16, dtype=torch.long), dims={"batch": 0, "seq": 1})
    assert swept.holds_for == "batch >= 1, seq >= 2"
    for batch, seq in [(1, 16), (1, 2), (1, 63), (2, 16), (3, 7)]:
        at = swept.at(batch=batch, seq=seq)
        assert_same(at, fxflops.estimate(model, torch.zeros(batch, seq, dtype=torch.long)))
        # by hand: rows x (in x out) of qkv, the attention's projection, the MLP's two and the head
        widths = 32 * 96 + 32 * 32 + 32 * 128 + 128 * 32 + 32 * 100
        assert at.by_op["aten.linear.default"].macs == batch * seq * widths
    assert len(swept.pieces) == 1


class ScaledRows(nn.Module):
    """A scale of shape [1, 1, 4] (strides 1, 4, 1) times a transposed [batch, 3, 4] tensor (strides 12, 1, 3): the
    product's slow path broadcasts the scale's batch axis (a stride of 0, or at batch 1 the scale's own, 1),
    and the product's layout is all that reads that stride."""

    def __init__(self, scale_first: bool, reads_expand: bool = False) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1, 4, 1))
        self.proj = nn.Linear(3, 3)
        self.scale_first = scale_first
        self.reads_expand = reads_expand

    def forward(self, z):  # z: [batch, 4, 3]
        x = z.transpose(1, 2)
        scale = self.scale.permute(2, 0, 1)
        y = scale * x if self.scale_first else x * scale
        y = y.transpose(1, 2)  # [batch, 4, 3]: contiguous where y's strides are x's
        if self.reads_expand and scale.expand(x.shape).stride(0) != 0:  # the broadcast read by the model
            y = self.proj(y)
        return self.proj(self.proj(y)) if y.stride(0) == 3 else self.proj(y)


def swept_over_batch(model: nn.Module, rest: tuple, macs: Callable[[int], int], pieces: int) -> Any:
    """`model` swept over axis 0 of a [batch, *rest] input from batch 2; batch 1, 2 and 5 equal to fresh
    estimates and to `macs(batch)` by hand, in `pieces` pieces."""
    swept = sweep(model, torch.empty(2, *rest), dims={"batch": 0})
    for batch in (1, 2, 5):
        at = swept.at(batch=batch)
        assert_same(at, fxflops.estimate(model, torch.empty(batch, *rest)))
        assert at.total_macs == macs(batch)
    assert len(swept.pieces) == pieces
    return swept


def test_a_broadcast_the_first_operand_orders_holds_at_batch_one():
    # x * scale: x, first, orders the batch axis against the others (strides 12 against 1 and 3), the
    # scale's stride there is not read; should_expand's `batch != 1` expands either way (1 against 3).
    # By hand: one projection (y's strides are x's: 12, 1, 3), rows x in x out
    swept = swept_over_batch(ScaledRows(scale_first=False), (4, 3), lambda batch: batch * 4 * 3 * 3, pieces=1)
    assert swept.holds_for == "batch >= 1"


def test_a_broadcast_operand_first_still_splits_at_batch_one():
    # scale * x: the scale comes first, and at batch 1 its own batch stride (1) orders the product's layout
    # (y's strides 3, 1, 3) where a stride of 0 leaves it to x (12, 1, 3): y.stride(0) decides a branch,
    # two projections at batch 1
    swept_over_batch(ScaledRows(scale_first=True), (4, 3), lambda batch: (2 if batch == 1 else 1) * batch * 4 * 3 * 3,
                     pieces=2)


def test_the_broadcast_left_out_of_the_cache_is_asked_again():
    # the product's broadcast (stride 0, answered without a guard) is kept out of the fake mode's cache: the
    # model's own expand of the scale asks again, a guard (its stride at batch 1 is the scale's, 1): an
    # extra projection there
    swept_over_batch(ScaledRows(scale_first=False, reads_expand=True), (4, 3),
                     lambda batch: (2 if batch == 1 else 1) * batch * 4 * 3 * 3, pieces=2)


class Regrouped(nn.Module):
    """Reshapes of a transposed tensor: C++ reshape asks whether the batch axis ends a chunk."""

    def __init__(self, merge: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3)
        self.merge = merge

    def forward(self, z):  # z: [batch, 4, 3], or [batch, 2, 3] to merge
        if self.merge:  # [2, batch, 3] as [2 * batch, 3]: a view only where batch is 1, else a copy
            return self.proj(z.transpose(0, 1).reshape(-1, 3))
        x = z.transpose(1, 2)  # [batch, 3, 4], strides [12, 1, 3]
        return self.proj(x.reshape(x.shape[0], -1, 4).transpose(1, 2))  # its own shape: a view either way


def test_a_reshape_that_is_a_view_either_way_holds_at_batch_one():
    swept = swept_over_batch(Regrouped(merge=False), (4, 3), lambda batch: batch * 4 * 3 * 3, pieces=1)
    assert swept.holds_for == "batch >= 1"


def test_a_reshape_that_is_a_view_only_at_batch_one_still_splits():
    # [2, batch, 3] with strides [3, 6, 1]: at batch 1 the size-1 axis joins the chunk and the merge is a
    # view; elsewhere the batch axis ends a chunk and reshape copies (a clone the program records)
    swept = swept_over_batch(Regrouped(merge=True), (2, 3), lambda batch: batch * 2 * 3 * 3, pieces=2)
    for batch in (1, 2):
        assert ("aten.clone.default" in swept.at(batch=batch).by_op) == (batch != 1)


@pytest.mark.parametrize("sizes, strides, new", [
    ((2, 1, 3), (3, 7, 1), (6,)),  # a size-1 axis with any stride joins the chunk: a view
    ((2, 2, 3), (3, 7, 1), (12,)),  # the same axis at 2 ends a chunk: a copy
    ((2, 3, 4), (12, 1, 3), (2, 3, 4)),  # its own shape: a view
    ((2, 3, 4), (12, 1, 3), (6, 4)),  # a transposed pair merged: a copy
    ((1, 4, 5, 16), (320, 16, 64, 1), (1, 4, 5, 16)),  # the attention output's reshape at batch 1
    ((2, 4, 5, 16), (320, 16, 64, 1), (2, 20, 16)),
    ((3, 1, 4), (4, 4, 1), (3, 4, 1)),
    ((2, 6), (6, 1), (3, 4)),
])
def test_the_reshape_choice_is_torch_computestride(sizes, strides, new):
    # the oracle: torch's own reshape of a (meta) tensor with these strides, a view or a copy
    from fxflops.capture.size_one import _is_view

    tensor = torch.empty_strided(sizes, strides, device="meta")
    assert _is_view(list(sizes), list(strides), list(new), bool) == tensor.reshape(new)._is_view()
