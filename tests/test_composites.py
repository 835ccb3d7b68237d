"""Composite ops (CompositeImplicitAutograd: linalg.multi_dot, cov, nn.Bilinear's bilinear, ...) are
recorded whole only where a rule names them; any other is recorded as the ops it runs, which rules
count, instead of one unknown op. And nn.Bilinear, whose kernel aten._trilinear FlopCounterMode has
no formula for, is counted as torch runs it.

Counts by hand; under the torch preset the decomposed ones equal FlopCounterMode (tests/oracle.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fxflops
from tests.oracle import oracle_flops


class Call(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, *args):
        return self.function(*args)


def count(model, args, conventions="deepspeed", method="eager", **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fxflops.estimate(model, args, conventions=conventions, method=method, **options)
    assert not result.unknown, [u.op for u in result.unknown]
    return result


# (function, input shapes, MACs of the matrix products torch runs)
DECOMPOSED = [
    # multi_dot picks the cheaper order: (AB)C = 4*5*6 + 4*6*7 = 288, not A(BC) = 350
    (lambda a, b, c: torch.linalg.multi_dot([a, b, c]), [(4, 5), (5, 6), (6, 7)], 288),
    # a^5 by squaring: a^2, a^4, a * a^4: three 4x4 mms of 64 MACs
    (lambda a: torch.linalg.matrix_power(a, 5), [(4, 4)], 3 * 64),
    # the centred 4 x 10 observations times their transpose: 4 * 4 * 10
    (torch.cov, [(4, 10)], 160),
    (torch.corrcoef, [(4, 10)], 160),
    # a composite with no product: counted as its elementwise ops, nothing unknown
    (lambda a, b: nn.functional.cosine_similarity(a, b), [(4, 10), (4, 10)], 0),
    (lambda a: torch.quantile(a, 0.3), [(4, 10)], 0),
    (torch.diag, [(4, 4)], 0),  # runs diagonal_copy
]


# cov and corrcoef read a value (aten.equal), so "auto" takes them to the real-forward trace
@pytest.mark.parametrize("method", ["auto", "trace"])
@pytest.mark.parametrize(("function", "shapes", "macs"), DECOMPOSED)
def test_composite_without_a_rule_is_counted_through_what_it_runs(function, shapes, macs, method):
    args = tuple(torch.randn(shape) for shape in shapes)
    result = count(Call(function), args, conventions="torch", method=method)
    assert result.total_flops == 2 * macs == oracle_flops(Call(function), args)
    assert count(Call(function), args, method=method).total_macs == macs


def test_a_user_rule_for_a_composite_keeps_it_whole():
    args = tuple(torch.randn(shape) for shape in [(4, 5), (5, 6), (6, 7)])
    model = Call(lambda a, b, c: torch.linalg.multi_dot([a, b, c]))
    result = count(model, args, rules={"aten.linalg_multi_dot": lambda call: (7, 14)})
    assert (result.total_macs, result.total_flops) == (7, 14)
    assert [node.op for node in result.nodes if node.macs] == ["aten.linalg_multi_dot.default"]


def test_a_user_rule_naming_the_python_function_keeps_it_whole_and_says_it_missed():
    # the eager graph holds aten.cosine_similarity: a rule spelled as the Python function does not
    # match it, and the op is reported unknown (not silently counted through its decomposition)
    args = (torch.randn(4, 10), torch.randn(4, 10))
    model = Call(lambda a, b: nn.functional.cosine_similarity(a, b))
    with pytest.warns(fxflops.UnknownOpsWarning, match="aten.cosine_similarity"):
        result = fxflops.estimate(model, args, rules={"torch.nn.functional.cosine_similarity": lambda call: (1, 2)})
    assert [u.op for u in result.unknown] == ["aten.cosine_similarity.default"]


def test_trilinear_by_hand_where_a_summed_dim_is_on_one_side_only():
    from fxflops.rules.formula_helpers import trilinear_counts

    i1, i2, i3 = torch.empty(3, 4), torch.empty(3, 5), torch.empty(3, 5)
    # dims (a=3, u, k=4, j=5); unrolled over a: per slice, i1's k (only i1 has it) is summed first
    # (3 adds), times i2 plain (5 products), times i3 summed over j (5 MACs), one add into the output
    assert trilinear_counts(i1, i2, i3, [1, 3], [1, 2], [1, 2], [2, 3], 0) == (3 * 5, 3 * (3 + 5 + 1))
    # every input expanded at the unrolled dim: torch's loop runs zero times
    assert trilinear_counts(i1, i2, i3, [1, 3], [1, 2], [1, 2], [2, 3], 1) == (0, 0)


# nn.Bilinear(5, 6, 7) on a batch of 3: torch runs x1 times A summed over in1 (3*7 outputs x 5*6 MACs),
# then times x2 summed over in2 (3*7 x 6 MACs); FLOPs 2 x MACs, an add of each output into the zeroed
# output (21) and the bias (21)
BILINEAR_MACS = 3 * 7 * 5 * 6 + 3 * 7 * 6
BILINEAR_FLOPS = 2 * BILINEAR_MACS + 21 + 21


@pytest.mark.parametrize("method", ["eager", "export", "symbolic", "trace"])
def test_bilinear_by_hand_under_every_method(method):
    torch.manual_seed(0)
    result = count(nn.Bilinear(5, 6, 7), (torch.randn(3, 5), torch.randn(3, 6)), method=method)
    assert (result.total_macs, result.total_flops) == (756, 1554) == (BILINEAR_MACS, BILINEAR_FLOPS)


def test_bilinear_under_the_torch_preset_counts_the_products_flopcountermode_misses():
    args = (torch.randn(3, 5), torch.randn(3, 6))
    assert oracle_flops(nn.Bilinear(5, 6, 7), args) == 0  # no formula for aten._trilinear
    assert count(nn.Bilinear(5, 6, 7), args, conventions="torch").total_flops == 2 * BILINEAR_MACS
    assert count(nn.Bilinear(5, 6, 7), args, conventions="fvcore").total_flops == 0
    assert count(nn.Bilinear(5, 6, 7), args, conventions="ptflops-aten").total_macs == 0


class Bilinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.left, self.right, self.bilinear = nn.Linear(5, 5), nn.Linear(6, 6), nn.Bilinear(5, 6, 7)

    def forward(self, a, b):
        return self.bilinear(self.left(a), self.right(b))


def test_bilinear_backward_runs_trilinear_per_gradient_by_hand():
    args = (torch.randn(3, 5), torch.randn(3, 6))
    only_weight = count(nn.Bilinear(5, 6, 7), args, backward=True)
    # dL/dA[o,i,j] = sum_n g[n,o] x1[n,i] x2[n,j], per o: x1 * g plain products (3*5), then times x2
    # summed over n (3*5*6 MACs); 7 slices each added into the (5, 6) gradient; the bias gradient
    # sums g over the batch (21)
    assert (only_weight.bwd_macs, only_weight.bwd_flops) == (7 * 90, 2 * 7 * 90 + 7 * 15 + 7 * 30 + 21)
    through = count(Bilinear(), args, backward=True)
    # dL/dx1[n,i] = sum_o sum_j g[n,o] A[o,i,j] x2[n,j]: per o, g * A plain (3*5*6), times x2 summed over
    # j (3*5*6 MACs), each slice added into (3, 5): 630 MACs, 1260 + 630 + 105 FLOPs;
    # dL/dx2[n,j] = sum_o sum_i g[n,o] x1[n,i] A[o,i,j]: per o, x1 * A summed over i (3*5*6 MACs), times
    # g plain (3*6), each slice added into (3, 6): 630 MACs, 1260 + 126 + 126 FLOPs
    bilinear_macs = 3 * 630
    bilinear_flops = (2 * 630 + 105 + 210) + (2 * 630 + 630 + 105) + (2 * 630 + 126 + 126) + 21
    # each Linear: weight gradient g^T x and input gradient g W (3*5*5 or 3*6*6 MACs each), bias sums
    linear_macs = 2 * 75 + 2 * 108
    linear_flops = 2 * linear_macs + 15 + 18
    # the left and right inputs need no gradient: the Linears' input gradients are not computed
    linear_macs -= 75 + 108
    linear_flops -= 2 * (75 + 108)
    assert (through.bwd_macs, through.bwd_flops) == (bilinear_macs + linear_macs, bilinear_flops + linear_flops)
