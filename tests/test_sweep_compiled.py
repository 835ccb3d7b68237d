"""Compiled sweeps (issue 37): at() from formulas compiled once, and grid() over arrays. Every number is
checked against a fresh estimate() at the point (the independent count of the same forward) or
against sympy evaluating the same expression."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import sympy
import torch
from torch import nn

import fxflops
from fxflops.sweeps import sweep
from fxflops.sweeps.compiled import Program
from fxflops.tree import module_stats
from tests.test_sweep import gpt2, llama, tokens

N = sympy.Symbol("n", integer=True, positive=True)
M = sympy.Symbol("m", integer=True, positive=True)


def test_program_is_exact_on_ints_and_on_arrays():
    from torch.utils._sympy.functions import CeilDiv, FloorDiv, PythonMod

    exprs = [3 * FloorDiv(N + 1, 2) ** 2 + CeilDiv(N, 3) * M, sympy.Max(N, M, 7) - sympy.Min(N, 5), PythonMod(N * M, 7),
             sympy.Rational(1, 2) * N * (N + 1)]  # the last has no Python form here: sympy evaluates it
    program = Program(("n", "m"), [(5, {expr: 2}) for expr in exprs])
    ns, ms = np.meshgrid(np.arange(1, 40), np.arange(1, 9), indexing="ij")
    arrays = program.on_arrays(ns, ms)
    for n in range(1, 40):
        for m in range(1, 9):
            expected = tuple(5 + 2 * int(expr.xreplace({N: n, M: m})) for expr in exprs)
            assert program(n, m) == expected
            assert tuple(int(array[n - 1, m - 1]) for array in arrays) == expected


def test_program_keeps_python_ints_where_int64_would_overflow():
    program = Program(("n",), [(0, {N ** 3 * 1000: 1})])
    found = program.on_arrays(np.array([10, 10**6]))[0]
    assert found.dtype == object and list(found) == [10**6, 10**21] == [program(10)[0], program(10**6)[0]]


def test_conditions_compile_and_decide_as_sympy_on_arrays():
    from torch.utils._sympy.functions import FloorDiv

    conditions = [sympy.Ne(FloorDiv(N - 1, 2) + 1, 1), sympy.Eq(N, 7) | sympy.Le(N, 30)]
    program = Program(("n",), conditions=conditions)
    values = np.arange(1, 40)
    expected = [all(bool(c.xreplace({N: n})) for c in conditions) for n in values]
    assert [program(int(n)) for n in values] == expected == list(program.on_arrays(values))


@pytest.mark.parametrize("backward", [False, True])
def test_a_point_equals_a_fresh_estimate_in_every_table(backward):
    model = llama()  # GQA: 4 heads, 2 key-value heads
    swept = sweep(model, tokens(2, 9), dims={"batch": 0, "seq": 1}, backward=backward)
    for batch, seq in ((3, 17), (1, 64), (5, 1)):
        at = swept.at(batch=batch, seq=seq)
        fresh = fxflops.estimate(model, tokens(batch, seq), backward=backward)
        assert (at.total_macs, at.total_flops, at.total_params, at.bwd_macs, at.bwd_flops) == \
            (fresh.total_macs, fresh.total_flops, fresh.total_params, fresh.bwd_macs, fresh.bwd_flops)
        # the compiled table is what tree.module_stats makes of the point's nodes, every field of every module
        piece = swept.piece(batch=batch, seq=seq)
        infos = {name: dataclasses.replace(info, params=at.modules[name].params) for name, info in piece.infos.items()}
        assert at.modules == module_stats(infos, piece.captured.aliases, at.nodes, piece.captured.module_calls,
                                          "LlamaForCausalLM")
        if not backward:
            assert at.modules == fresh.modules
        else:  # the symbolic capture's backward records two slice_backward ops at the root the static one does not:
            # their bytes differ (as before compiling), every MAC and FLOP agrees
            no_bytes = lambda e: {n: dataclasses.replace(m, bytes=0, self_bytes=0) for n, m in e.modules.items()}  # noqa: E731
            assert no_bytes(at) == no_bytes(fresh)
        # zero-cost nodes aside: a symbolic capture may record one more view than a static one
        counted = lambda e: {k: t for k, t in e.by_rule.items() if t.macs or t.flops}  # noqa: E731
        assert counted(at) == counted(fresh) and at.unknown == fresh.unknown
        assert at.input_shapes == fresh.input_shapes and at.cautions == fresh.cautions
        assert list(at.tree.edges) == list(fresh.tree.edges)


def test_grid_equals_fresh_estimates_and_at():
    model = llama()
    swept = sweep(model, tokens(2, 9), dims={"batch": 0, "seq": 1})
    grid = swept.grid(batch=[1, 2, 5], seq=range(1, 200, 9))
    assert set(grid) == {"batch", "seq", "macs", "flops", "params"}
    assert grid["macs"].shape == (3, 23) and grid["macs"].dtype == np.int64
    for i, batch in enumerate((1, 2, 5)):
        for j, seq in enumerate(range(1, 200, 9)):
            at = swept.at(batch=batch, seq=seq)
            assert (grid["batch"][i, j], grid["seq"][i, j]) == (batch, seq)
            assert (grid["macs"][i, j], grid["flops"][i, j], grid["params"][i, j]) == \
                (at.total_macs, at.total_flops, at.total_params)
    for batch, seq in ((1, 1), (5, 190)):
        fresh = fxflops.estimate(model, tokens(batch, seq))
        i, j = (1, 2, 5).index(batch), (seq - 1) // 9
        assert (grid["macs"][i, j], grid["flops"][i, j]) == (fresh.total_macs, fresh.total_flops)


class SmallConv(nn.Module):
    """Strided, padded convolutions and pooling: floor divisions of the image size in every formula."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 7, stride=2, padding=3)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.conv = nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))

    def forward(self, x):
        return self.head(torch.relu(self.conv(self.pool(torch.relu(self.stem(x))))))


def test_grid_over_batch_and_image_size_equals_fresh_estimates():
    model = SmallConv().eval()
    swept = sweep(model, torch.zeros(2, 3, 40, 40), dims={"batch": 0, "size": (2, 3)})
    sizes = [13, 33, 34, 35, 100, 517]
    grid = swept.grid(batch=[1, 6], size=sizes)
    for i, batch in enumerate((1, 6)):
        for j, size in enumerate(sizes):
            fresh = fxflops.estimate(model, torch.zeros(batch, 3, size, size))
            assert (grid["macs"][i, j], grid["flops"][i, j], grid["params"][i, j]) == \
                (fresh.total_macs, fresh.total_flops, fresh.total_params)


def test_grid_backward_columns_and_bad_values():
    model = gpt2()
    swept = sweep(model, tokens(2, 9), dims={"batch": 0, "seq": 1}, backward=True)
    grid = swept.grid(seq=[5, 40])
    assert grid["macs"].shape == (2,)
    for j, seq in enumerate((5, 40)):
        at = swept.at(seq=seq)
        assert (grid["bwd_macs"][j], grid["bwd_flops"][j], grid["macs"][j]) == (at.bwd_macs, at.bwd_flops, at.total_macs)
    with pytest.raises(ValueError, match="unknown size 'width'"):
        swept.grid(width=[1])
    with pytest.raises(ValueError, match="size seq must be a non-negative int"):
        swept.grid(seq=[3, -1])
