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


def _at_sympy(expr, point):
    return int(sympy.sympify(expr).xreplace({sympy.Symbol(n, integer=True, positive=True): v for n, v in point.items()}))


@pytest.mark.parametrize("backward", [False, True])
def test_points_and_table_equal_the_formulas_evaluated_by_sympy(backward):
    """points(), table() and result() run compiled programs: at every point their totals and top modules
    are the piece's formulas (sympy, summed up the module tree) evaluated there, and at()'s module table."""
    model = llama()
    swept = sweep(model, tokens(2, 9), dims={"batch": 0, "seq": 1}, backward=backward)
    grid = {"batch": [1, 2, 3, 7], "seq": [1, 2, 5, 33, 100, 257]}
    rows = swept.table(grid)
    for depth in (1, 2, 3):
        points = list(swept.points(grid, depth=depth, top=4))
        assert len(points) == len(rows) == 24
        for found, row in zip(points, rows):
            point = found.sizes
            piece = swept.piece(**point)
            expected = {q: _at_sympy(piece.formulas(q)[""], point)
                        for q in ("macs", "flops", "params", "bwd_macs", "bwd_flops")}
            assert (found.macs, found.flops, found.params, found.bwd_macs, found.bwd_flops) == tuple(expected.values())
            assert row == {**point, "macs": expected["macs"], "flops": expected["flops"], "params": expected["params"]}
            macs, flops = piece.formulas("macs"), piece.formulas("flops")
            level = min(depth, max(name.count(".") + 1 for name in macs if name))
            ranked = sorted(((_at_sympy(macs[name], point), name) for name in macs
                             if name and name.count(".") + 1 == level), key=lambda item: (-item[0], item[1]))[:4]
            assert [(m.name, m.macs, m.flops) for m in found.top_modules] == \
                [(name, value, _at_sympy(flops[name], point)) for value, name in ranked]
            modules = swept.at(**point).modules
            assert all((modules[m.name].macs, modules[m.name].flops) == (m.macs, m.flops) for m in found.top_modules)
    result = swept.result(grid, depth=2, top=2)
    assert [(p.sizes, p.macs, p.top_modules) for p in result.points] == \
        [(p.sizes, p.macs, p.top_modules) for p in swept.points(grid, depth=2, top=2)]


class Reshaping(nn.Module):
    """A block that computes a size on the model's own line (SymInt arithmetic, which runs sympy)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        batch, seq, width = x.shape
        return self.linear(x.reshape(batch * seq, width)).reshape(batch, seq, width)


def test_a_sweep_capture_replays_repeated_blocks():
    """torch computes symbolic sizes in sympy, which hashes and reads locals(): not the block's own reads,
    so a sweep's repeated blocks are replayed as an estimate's are (before, every block ran)."""
    from fxflops.capture.replay import REPLAY_OF

    model = nn.Sequential(*(Reshaping() for _ in range(4)))
    swept = sweep(model, torch.zeros(2, 5, 8), dims={"batch": 0, "seq": 1})
    replayed = {node.meta["fxflops_module"][0] for node in swept.pieces[0].captured.graph_module.graph.nodes
                if REPLAY_OF in node.meta}
    assert {"1", "2", "3"} <= replayed  # a block with siblings is the reference at its first call
    for batch, seq in ((1, 1), (2, 5), (3, 40)):
        at = swept.at(batch=batch, seq=seq)
        assert at.total_macs == 4 * batch * seq * 8 * 8  # by hand: 4 linears of 8 x 8, no bias
        assert at.modules == fxflops.estimate(model, torch.zeros(batch, seq, 8)).modules


class NormedConv(nn.Module):
    """A convolution, a batch norm and a head: the norm's map is 1 x 1 for images up to 2 x 2."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(4)
        self.head = nn.Sequential(nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))

    def forward(self, x):
        return self.head(self.norm(self.conv(x)))


@pytest.mark.filterwarnings("ignore:the model is in training mode")  # counting the training batch norm is the point
@pytest.mark.parametrize("training", [False, True])
def test_a_batch_norm_on_named_sizes_is_shaped_directly_and_counts_as_estimate(training):
    """capture.symbolic_kernels: a CPU batch norm of a contiguous input is shaped without torch's Python
    decomposition; every point still counts as estimate() does, a 1 x 1 map and a batch of 1 included."""
    from fxflops.capture import symbolic_kernels

    model = NormedConv().train(training)
    assert symbolic_kernels.symbolic_kernel(torch.ops.aten.relu.default, (), {}) is NotImplemented
    swept = sweep(model, torch.zeros(2, 3, 40, 40), dims={"batch": 0, "size": (2, 3)})
    points = [(2, 40), (3, 7), (6, 64), (2, 2)] + ([] if training else [(1, 1), (1, 2), (5, 3), (4, 4)])
    for batch, size in points:
        at = swept.at(batch=batch, size=size)
        side = (size - 1) // 2 + 1
        assert at.total_macs == batch * 4 * side * side * 3 * 9 + batch * 4 * 2  # by hand: conv, linear
        fresh = fxflops.estimate(model, torch.zeros(batch, 3, size, size))
        assert at.modules == fresh.modules and at.by_rule == fresh.by_rule


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 5, 6), (3, 4, 7), (5, 4), (2, 4, 1, 1)])
def test_the_symbolic_batch_norm_gives_what_the_mode_gives(shape, training):
    """symbolic_kernels' batch norm against the mode's own decomposition on the same symbolic input: the
    same shapes, strides and dtypes, and the size questions the mode asks (as conditions) asked alike."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from fxflops.capture.symbolic_kernels import symbolic_kernel

    def run(kernel):
        env = ShapeEnv()
        mode = FakeTensorMode(shape_env=env)
        dynamic = [DimDynamic.STATIC if axis == 1 else DimDynamic.DYNAMIC for axis in range(len(shape))]
        source = mode.from_tensor(torch.empty(shape), symbolic_context=StatelessSymbolicContext(dynamic_sizes=dynamic))
        stats = [mode.from_tensor(torch.ones(4), static_shapes=True) for _ in range(4)]
        args = (source, *stats, training, 0.1, 1e-5)
        with mode:
            out = kernel(args)
        assert out is not NotImplemented
        return [(tuple(map(str, t.shape)), tuple(map(str, t.stride())), t.dtype) for t in out[:3]], \
            sorted(str(guard.expr) for guard in env.guards)

    assert run(lambda args: symbolic_kernel(torch.ops.aten.native_batch_norm.default, args, {})) == \
        run(lambda args: torch.ops.aten.native_batch_norm.default(*args))


@pytest.mark.parametrize("training", [False, True])
def test_the_symbolic_batch_norm_asks_no_layout_question_that_decides_nothing(training):
    """The decomposition's first step asks whether its contiguous operands are channels-last too, a guard
    on the map's area (`Ne(((s - 1)//2 + 1)**2, 1)`: a 1 x 1 map is both); its output is contiguous either
    way, so the kernel leaves the question out, and its output is the decomposition's on both sides of it."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    from fxflops.capture.size_one import size_one_shape_env
    from fxflops.capture.symbolic_kernels import symbolic_kernel

    def run(kernel, hint):
        env = size_one_shape_env()
        symbol = env.create_symbol(hint, source=ConstantSource("size"), dynamic_dim=DimDynamic.DYNAMIC,
                                   do_not_specialize_zero_one=True)
        size = env.create_symintnode(symbol, hint=hint, source=ConstantSource("size"))
        mode = FakeTensorMode(shape_env=env, static_shapes=True)
        stats = [mode.from_tensor(torch.ones(4)) for _ in range(4)]
        with mode:
            side = (size - 1) // 2 + 1  # a stride-2 convolution's map
            source = torch.empty(2, 4, side, side)
            out = kernel((source, *stats, training, 0.1, 1e-5))
        assert out is not NotImplemented
        layout = [(tuple(map(str, t.shape)), tuple(map(str, t.stride())), t.dtype) for t in out[:3]]
        return layout, {str(guard.expr) for guard in env.guards}, symbol

    kernel = run(lambda args: symbolic_kernel(torch.ops.aten.native_batch_norm.default, args, {}), 9)
    decomposed = run(lambda args: torch.ops.aten.native_batch_norm.default(*args), 9)
    assert kernel[0] == decomposed[0]
    (area,) = [guard for guard in decomposed[1] if guard.startswith("Ne(") and guard.endswith("**2, 1)")]
    assert f"{decomposed[2]} - 1)//2" in area and kernel[1] == decomposed[1] - {area}
    # at size 1 (a 1 x 1 map, where the question's answer flips) the decomposition gives the same layout
    with FakeTensorMode():
        static = torch.ops.aten.native_batch_norm.default(torch.empty(2, 4, 1, 1), *[torch.ones(4)] * 4, training,
                                                          0.1, 1e-5)
    assert [tuple(t.stride()) for t in static[:1]] == [(4, 1, 1, 1)]  # the contiguous strides of [2, 4, 1, 1]
