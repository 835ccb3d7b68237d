"""Values the weights decide, beyond topk's picks (issue 39): routed counts built any way from a router's picks
(a mask scattered into zeros_like, a sort, sampled picks, one_hot sums, repeat_interleave by the counts) use the
routing assumption; a size or a value read from weight-derived values that no routing decides is counted at its
bound (capture.value_bounds: argmax's index, a count of booleans, a clamp), named in every report; a read no op
bounds, and the forward's own check of a size taken at its bound, fail in one line. Exact numbers by hand."""

from __future__ import annotations

import html
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxflops
from tests.test_input_values import quietly

TOKENS, DIM, EXPERTS = 6, 8, 4
ROUTER = 2 * TOKENS * DIM * EXPERTS  # the router: 6 tokens x 8 -> 4


class Routed(nn.Module):
    """Top-2 of 4 experts; expert e (8 -> 8(e+1)) runs on as many rows as its routed count."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM * (e + 1), bias=False) for e in range(EXPERTS))

    def counts(self, scores: torch.Tensor) -> list[int]:
        if self.how == "scatter":  # a routing mask scattered into zeros_like(scores), summed per expert
            _, picks = scores.topk(2, dim=-1)
            return torch.zeros_like(scores).scatter(1, picks, 1.0).sum(0).long().tolist()
        if self.how == "sort":  # the first two of a sort's ranking, counted with bincount
            picks = scores.argsort(dim=-1, descending=True)[:, :2]
            return torch.bincount(picks.flatten(), minlength=EXPERTS).tolist()
        if self.how == "multinomial":  # picks sampled from the softmax, counted as one_hot sums
            picks = scores.softmax(-1).multinomial(2)
            return F.one_hot(picks, EXPERTS).sum((0, 1)).tolist()
        # repeat_interleave by the routed counts: each routed row's expert, counted back per expert
        _, picks = scores.topk(2, dim=-1)
        owner = torch.repeat_interleave(torch.arange(EXPERTS), torch.bincount(picks.flatten(), minlength=EXPERTS))
        return [int((owner == e).sum()) for e in range(EXPERTS)]

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [expert(x[:rows]) for expert, rows in zip(self.experts, self.counts(self.router(x)))]


def routed_flops(counts: list[int]) -> int:
    return ROUTER + sum(2 * rows * DIM * DIM * (e + 1) for e, rows in enumerate(counts))


# balanced: 12 picks round robin, 3 per expert; a sort's balanced ranking starts row r at expert r mod 4, so its
# first two columns give experts 0..3: rows {0, 3, 4}, {0, 1, 4, 5}, {1, 2, 5}, {2, 3} = 3, 4, 3, 2
BALANCED = {"scatter": [3, 3, 3, 3], "sort": [3, 4, 3, 2], "multinomial": [3, 3, 3, 3], "repeat": [3, 3, 3, 3]}


@pytest.mark.parametrize("how", ["scatter", "sort", "multinomial", "repeat"])
def test_routed_counts_built_from_a_routers_picks_use_each_routing_assumption(how):
    with torch.device("meta"):
        model = Routed(how)
    balanced = quietly(model, input_shape=(TOKENS, DIM), conventions="torch", method="eager")
    assert balanced.total_flops == routed_flops(BALANCED[how])
    assert any("balanced routing" in caution and "a router's picks" in caution for caution in balanced.cautions)
    worst = quietly(model, input_shape=(TOKENS, DIM), conventions="torch", method="eager", routing="worst")
    assert worst.total_flops == routed_flops([6, 6, 0, 0])  # every token to experts 0 and 1
    assert any("worst-case routing" in caution for caution in worst.cautions)
    given = quietly(model, input_shape=(TOKENS, DIM), conventions="torch", method="eager", routing=[6, 4, 1, 1])
    assert given.total_flops == routed_flops([6, 4, 1, 1])
    assert any("[6, 4, 1, 1]" in caution for caution in given.cautions)


class Bounded(nn.Module):
    """A value or a size from weight-derived values no routing decides, which an op bounds."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.score = nn.Linear(DIM, 1, bias=False)  # one score per token
        self.pick = nn.Linear(DIM, 3, bias=False)  # one of 3 per token
        self.proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "argmax-item":  # the best token's position: below 6
            return self.proj(x[: self.score(x).squeeze(-1).argmax().item() + 1])
        if self.how == "count-item":  # how many scores are positive: at most 6
            return self.proj(x[: int((self.score(x) > 0).sum())])
        if self.how == "bincount":  # bins of clamped values: 0..2, so 3 bins
            return self.proj(x[: torch.bincount(self.score(x).squeeze(-1).long().clamp(0, 2)).numel()])
        # (argmax along a dim is a top-1 router's pick, which the routing assumption decides: these count booleans)
        if self.how == "repeat":  # each token repeated by how many of its 3 scores are positive: 18 rows at most
            return self.proj(torch.repeat_interleave(x, (self.pick(x) > 0).sum(-1), dim=0))
        if self.how == "unique":  # distinct counts of 3 booleans: 0..3, at most 4
            return self.proj(x[: torch.unique((self.pick(x) > 0).sum(-1)).numel()])
        if self.how == "unique-counts":  # how often a count of 3 booleans repeats: up to every token, 6
            _, counts = torch.unique((self.pick(x) > 0).sum(-1), return_counts=True)
            return self.proj(x[: int(counts.max())])
        if self.how == "unique-inverse":  # which of the kept values (0..3: at most 4) a token has: below 4
            _, inverse = torch.unique((self.pick(x) > 0).sum(-1), return_inverse=True)
            return self.proj(x[: int(inverse.max()) + 1])
        if self.how == "one_hot":  # classes up to the largest clamped value + 1: 4
            return self.proj(x[: F.one_hot(self.score(x).squeeze(-1).long().clamp(0, 3)).shape[1]])
        return self.proj(x[self.score(x).squeeze(-1) > 0])  # a boolean mask: at most every token


SCORE, PICK = 2 * TOKENS * DIM * 1, 2 * TOKENS * DIM * 3


@pytest.mark.parametrize("how, flops, words", [
    ("argmax-item", SCORE + 2 * 6 * DIM * DIM,
     "counted at its bound 5 (its largest value; values in 0..5, from an index aten.argmax.default in module "
     "'(root)' (Bounded) picks among 6)"),
    ("count-item", SCORE + 2 * 6 * DIM * DIM, "counted at its bound 6 (its largest value; values in 0..6, from booleans)"),
    ("bincount", SCORE + 2 * 3 * DIM * DIM,
     "counted at its bound 3 (bins up to its largest value + 1; values in 0..2, from the range aten.clamp.default"),
    ("repeat", PICK + 2 * 18 * DIM * DIM,
     "counted at its bound 18 (each of 6 repeats at its largest; values in 0..3, from booleans)"),
    ("unique", PICK + 2 * 4 * DIM * DIM, "counted at its bound 4 (at most one of each value; values in 0..3, from booleans)"),
    ("unique-counts", PICK + 2 * 6 * DIM * DIM, "counted at its bound 6 (its largest value; values in 0..6, from a count"),
    ("unique-inverse", PICK + 2 * 4 * DIM * DIM, "counted at its bound 3 (its largest value; values in 0..3, from an index"),
    ("mask", SCORE + 2 * 6 * DIM * DIM, "counted at its bound 6 (at most every element of the mask selected)"),
    ("one_hot", SCORE + 2 * 4 * DIM * DIM,  # (one_hot without num_classes reads the largest value with .item())
     "counted at its bound 3 (its largest value; values in 0..3, from the range aten.clamp.default"),
])
def test_a_value_the_weights_decide_is_counted_at_the_bound_an_op_gives_it_in_every_report(how, flops, words):
    with torch.device("meta"):
        model = Bounded(how)
    result = quietly(model, input_shape=(TOKENS, DIM), conventions="torch", method="eager")
    assert result.total_flops == flops
    reports = (result.print(as_string=True), json.dumps(result.to_dict(), ensure_ascii=False),
               html.unescape(result.to_html()))
    assert all(words in report for report in reports), [c for c in result.cautions]
    assert not any("routing" in caution for caution in result.cautions)  # no routing was assumed


def eager_failure(model_class: type[nn.Module]) -> str:
    """Why the eager capture of a meta-device `model_class` on (TOKENS, DIM) failed."""
    with torch.device("meta"):
        model = model_class()
    with pytest.raises(fxflops.CaptureError) as caught:
        quietly(model, input_shape=(TOKENS, DIM), method="eager")
    return caught.value.attempts[0].reason


def test_a_value_read_no_op_bounds_fails_naming_op_module_line_and_what_to_pass():
    class Sum(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.score = nn.Linear(DIM, 1)

        def forward(self, x):
            return x[: int(self.score(x).sum().item())]  # the line the error names

    reason = eager_failure(Sum)
    assert "aten._local_scalar_dense" in reason and "module '(root)' (Sum)" in reason
    assert "int(self.score(x).sum().item())" in reason and "method='trace'" in reason


def test_the_forwards_own_check_of_a_size_taken_at_its_bound_fails_saying_so():
    class Split(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router = nn.Linear(DIM, EXPERTS)

        def forward(self, x):
            counts = (self.router(x) > 0).sum(0).tolist()  # each at most 6: together 24, not 6
            return torch.split(x, counts)

    reason = eager_failure(Split)
    assert "aten.split_with_sizes" in reason and "split_sizes=[6, 6, 6, 6]" in reason
    assert "after aten._local_scalar_dense.default" in reason and "was counted at its bound" in reason


@pytest.mark.parametrize("op, args, low, high", [
    (torch.ops.aten.add.Tensor, ("a", "b"), 5, 11),  # [0, 2] + [5, 9]
    (torch.ops.aten.sub.Tensor, ("a", "b"), -9, -3),
    (torch.ops.aten.mul.Tensor, ("a", "b"), 0, 18),
    (torch.ops.aten.add.Tensor, ("a", 10), 10, 12),
    (torch.ops.aten.maximum.default, ("a", "b"), 0, 9),  # one of the two: their union
    (torch.ops.aten.max.other, ("a", "b"), 0, 9),
    (torch.ops.aten.clamp.default, ("b", 6, None), 6, 9),
    (torch.ops.aten.clamp.default, ("b", None, 3), 3, 3),  # every value above 3: all 3
    (torch.ops.aten.remainder.Scalar, ("b", 4), 0, 3),
    (torch.ops.aten.remainder.Scalar, ("a", 2.5), 0, 2.5),  # an int tensor % 2.5 is floating: 2 % 2.5 = 2 > 1.5
    (torch.ops.aten.remainder.Scalar_Tensor, (7, "b"), 0, 8),  # a number % [5, 9]: below 9
    (torch.ops.aten.rsub.Scalar, ("a", 10), 8, 10),  # 10 - [0, 2]
    (torch.ops.aten.cumsum.default, ("b", 0), 5, 27),  # 1 to 3 values of [5, 9]
    (torch.ops.aten.sum.dim_IntList, ("a", [0]), 0, 6),  # 3 values of [0, 2]
    (torch.ops.aten.neg.default, ("b",), -9, -5),
])
def test_bounds_follow_arithmetic_by_hand(op, args, low, high):
    from fxflops.capture.value_bounds import Bound, output_bounds

    a, b = torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)
    named = {"a": a, "b": b}
    bounds = {id(a): Bound(0, 2, "a"), id(b): Bound(5, 9, "b")}

    def bound_of(value):
        return bounds.get(id(value)) if isinstance(value, torch.Tensor) else Bound(value, value, "")

    floating = any(isinstance(v, float) for v in args)  # the output's dtype, as torch promotes it
    out = torch.zeros(() if op is torch.ops.aten.sum.dim_IntList else 3, dtype=torch.float if floating else torch.long)
    (_, found), = output_bounds(op, tuple(named.get(v, v) if isinstance(v, str) else v for v in args), {}, out,
                                bound_of, "op")
    assert (found.low, found.high) == (low, high)


def test_rsub_scales_its_first_argument_by_alpha():
    from fxflops.capture.value_bounds import Bound, output_bounds

    a = torch.zeros(3, dtype=torch.long)
    bounds = {id(a): Bound(0, 2, "a")}

    def bound_of(value):
        return bounds.get(id(value)) if isinstance(value, torch.Tensor) else Bound(value, value, "")

    (_, found), = output_bounds(torch.ops.aten.rsub.Scalar, (a, 10), {"alpha": 3}, torch.zeros(3, dtype=torch.long),
                                bound_of, "op")
    assert (found.low, found.high) == (4, 10)  # 10 - 3 * [0, 2]
