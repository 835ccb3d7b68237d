"""Symbolic sizes as polynomials while a sweep's formulas are evaluated (fxflops.rules.polynomial): the
same expressions as sympy's, the same guards as torch's SymInts, every value worked out by hand."""

from __future__ import annotations

import sympy
import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch._dynamo.source import ConstantSource
from torch.utils._sympy.functions import FloorDiv

import fxflops
from fxflops.rules.formula import Formula
from fxflops.rules.polynomial import Poly, SizeValue, lifted
from fxflops.sweeps import sweep

b, s = sympy.symbols("b s", integer=True, positive=True)


def test_a_polynomial_of_a_conv_output_size_is_the_sympy_expression():
    # a stride-2 conv's output side: floor((s - 1) / 2) + 1, kept whole (an atom), as sympy's Mul keeps it
    side = FloorDiv(s - 1, 2) + 1
    numel = 64 * b * side**2
    poly = Poly.of(numel)
    assert poly.terms == {frozenset({(b, 1), (side, 2)}): 64}
    assert poly.in_user_names(lambda atom: atom) == numel
    # bytes of an op reading it (float32) and writing an input-sized tensor: 4*64*b*side**2 + 4*3*b*s**2
    total = poly * Poly.of(4) + Poly.of(12 * b * s**2)
    assert total.in_user_names(lambda atom: atom) == 256 * b * side**2 + 12 * b * s**2


def test_polynomial_arithmetic_is_exact_and_cancels():
    x = Poly.of(s)
    square = (x + Poly.of(1)) * (x - Poly.of(1))  # s**2 - 1
    assert square.terms == {frozenset({(s, 2)}): 1, frozenset(): -1}
    assert (square - x * x).constant() == -1
    assert (x - x).constant() == 0 and (x - x).terms == {}
    assert Poly.of(3 * b * s).in_user_names(lambda atom: {b: 5, s: 7}[atom]) == 105  # an int where no symbol is left


def test_a_rational_coefficient_stays_one_atom():
    half = s / 2
    assert Poly.of(half).terms == {frozenset({(half, 1)}): 1}


def _symint(env: ShapeEnv, name: str, hint: int) -> torch.SymInt:
    source = ConstantSource(name)
    symbol = env.create_symbol(hint, source=source, dynamic_dim=DimDynamic.DYNAMIC)
    return env.create_symintnode(symbol, hint=hint, source=source)


def test_a_lifted_formula_gives_the_symints_value_and_guards():
    # the same formula over two fresh ShapeEnvs, once on SymInts and once lifted: equal values, and the
    # comparison records the same guard (the SymInt is made by the same operations in the same order)
    source = "(a * c + a) * 2 if a * c > 6 else a // 2"
    found = []
    for lift in (False, True):
        env = ShapeEnv()
        a, c = _symint(env, "a", 3), _symint(env, "c", 4)
        value = Formula(source).evaluate({"a": a, "c": c}, lift)
        if lift:
            assert type(value) is SizeValue
            assert value.poly == Poly.of(a.node.expr) * Poly.of(c.node.expr) * Poly.of(2) + Poly.of(a.node.expr) * \
                Poly.of(2)
            value = value.sym()
        found.append((str(value.node.expr), [str(guard.expr) for guard in env.guards], int(value)))
    assert found[0] == found[1]
    assert found[0][2] == (3 * 4 + 3) * 2  # by hand at the hints


def test_only_counts_lift():
    env = ShapeEnv()
    a = _symint(env, "a", 5)
    assert type(Formula("a * 2 + 1").evaluate({"a": a})) is torch.SymInt  # the default: SymInts as before
    assert type(lifted(a)) is SizeValue and lifted(3) == 3


class _Strided(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).relu()


def test_a_strided_conv_sweeps_formulas_and_bytes_are_the_hand_ones():
    model = _Strided()
    swept = sweep(model, torch.zeros(2, 3, 16, 16), dims={"batch": 0, "size": (2, 3)})
    batch, size = (sympy.Symbol(name, integer=True, positive=True) for name in ("batch", "size"))
    side = sympy.floor((size - 1) / 2) + 1  # (size + 2*1 - 3) // 2 + 1
    macs = 8 * 3 * 3 * 3 * batch * side**2  # out numel x C_in x k x k
    assert sympy.expand(swept.formula("macs") - macs) == 0
    # flops: 2 x MACs for the conv, one per output element for the relu
    assert sympy.expand(swept.formula("flops") - (2 * macs + 8 * batch * side**2)) == 0
    for point in [(1, 1), (2, 16), (3, 17), (5, 33)]:
        n, edge = point
        at, fresh = swept.at(batch=n, size=edge), fxflops.estimate(model, torch.zeros(n, 3, edge, edge))
        assert (at.total_macs, at.total_flops, at.total_bytes) == (fresh.total_macs, fresh.total_flops,
                                                                   fresh.total_bytes)
        out = 8 * n * ((edge - 1) // 2 + 1) ** 2
        (conv,) = [node for node in at.nodes if node.op == "aten.conv2d.default"]
        # by hand, float32: the input and the weight read, the output written
        assert conv.bytes == 4 * (n * 3 * edge * edge + 8 * 3 * 3 * 3 + out)


def test_a_pieces_counts_read_as_sympy_and_evaluate_exactly_past_int64():
    # a sweep keeps its counts as polynomials (compiled as they are); read through Piece.costs they are the
    # sympy expressions a user gets, and a grid past int64 is exact (Python ints)
    model = nn.Linear(3, 5)
    swept = sweep(model, torch.zeros(2, 4, 3), dims={"batch": 0, "seq": 1})
    batch, seq = (sympy.Symbol(name, integer=True, positive=True) for name in ("batch", "seq"))
    (linear,) = [cost for cost in swept.pieces[0].costs if cost.op == "aten.linear.default"]
    assert linear.macs == 15 * batch * seq  # out numel (batch * seq * 5) x in features 3, by hand
    # float32: the input (3 per row) and the output (5 per row) per row, the weight (15) and the bias (5)
    assert linear.bytes == 32 * batch * seq + 80
    assert swept.formula("flops") == 2 * 15 * batch * seq + 5 * batch * seq  # + the bias add per output
    huge = 2**40
    grid = swept.grid(batch=[1, huge], seq=[7, huge])
    assert grid["macs"].tolist() == [[15 * 7, 15 * huge], [15 * huge * 7, 15 * huge * huge]]
    assert swept.at(batch=huge, seq=huge).total_macs == 15 * huge * huge


def test_renaming_a_floor_division_gives_the_expression_xreplace_gives():
    # a stride-2 conv's output side in the ShapeEnv's symbols, renamed into the sweep's: torch's FloorDiv is
    # rebuilt without re-running its eval, and comes out the same expression, argument for argument
    from torch.utils._sympy.functions import ModularIndexing

    from fxflops.capture.dynamic import _renamed

    s0, s1 = sympy.symbols("s0 s1", integer=True, positive=True)
    names = {s0: b, s1: s}
    side = FloorDiv(s1 - 1, 2) + 1
    for expr in [side, 64 * s0 * side**2, FloorDiv(s0 * s1, 4) + 3 * s0, ModularIndexing(s1, 1, 4) * s0]:
        renamed = _renamed(expr, names, {})
        expected = expr.xreplace(names)
        assert renamed == expected and renamed.args == expected.args
    assert _renamed(64 * s0 * side**2, names, {}) == 64 * b * (FloorDiv(s - 1, 2) + 1) ** 2  # by hand
