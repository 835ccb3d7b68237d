"""The formula language: safe by construction, works on ints and on symbolic sizes."""

from __future__ import annotations

import re

import pytest
import torch

from fxflops.rules.formula import Formula, FormulaError
from fxflops.rules.formula_helpers import einsum_macs


def test_arithmetic_conditions_subscripts_and_helpers():
    weight = torch.empty(4, 5, 3, 3, device="meta")
    out = torch.empty(2, 4, 6, 6, device="meta")
    names = {"weight": weight, "out": out, "bias": None}
    assert Formula("numel(out) * weight.shape[1] * prod(weight.shape[2:])").evaluate(names) == 288 * 5 * 9
    assert Formula("2 * 3 + (numel(out) if bias is not None else 0)").evaluate(names) == 6
    assert Formula("max(weight.ndim, 2) - min(1, 0) + len(out.shape) // 2").evaluate(names) == 6
    assert Formula("weight.shape[-1] ** 2 % 5").evaluate(names) == 4
    assert Formula("True and out.ndim == 4 or False").evaluate(names) is True


def test_multi_line_formulas():
    assert Formula("1 +\n  2\n  * 3").evaluate({}) == 7


@pytest.mark.parametrize(
    "source, problem",
    [
        ("__import__('os').system('true')", "not allowed"),
        ("x.__class__.__bases__", "attribute"),
        ("x.numel()", "not allowed"),
        ("[i for i in x]", "ListComp"),
        ("lambda: 0", "Lambda"),
        ("open('/etc/passwd')", "call to 'open'"),
        ("numel(x, dim=1)", "keyword"),
        ("(y := 3)", "NamedExpr"),
        ("f'{x}'", "JoinedStr"),
        ("x if", "does not parse"),
        (3, "must be a string"),
    ],
)
def test_unsafe_or_broken_formulas_are_refused_at_load(source, problem):
    with pytest.raises(FormulaError, match=problem):
        Formula(source)


def test_huge_powers_are_refused():
    with pytest.raises(FormulaError, match="too large"):
        Formula("10 ** 10 ** 10").evaluate({})


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(FormulaError, match="name 'weigth' is not defined.*weight"):
        Formula("weigth.shape[0]").evaluate({"weight": torch.empty(2)})


def test_numel_refuses_a_tuple_of_tensors():
    with pytest.raises(FormulaError, match=r"numel\(out\[0\]\)"):
        Formula("numel(out)").evaluate({"out": (torch.empty(2), torch.empty(3))})


def test_symbolic_sizes_give_an_expression():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    batch = env.create_unbacked_symint()
    seq = env.create_unbacked_symint()
    macs = Formula("batch * seq * 768 * 3072").evaluate({"batch": batch, "seq": seq})
    assert isinstance(macs, torch.SymInt)
    assert str(macs.node.expr).replace(" ", "") in {f"2359296*{batch.node.expr}*{seq.node.expr}",
                                                   f"2359296*{seq.node.expr}*{batch.node.expr}"}


@pytest.mark.parametrize(
    "equation, shapes, expected",
    [
        ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)], 2 * 3 * 4 * 5),
        ("ij,ij->i", [(3, 4), (3, 4)], 3 * 4),
        ("ij,jk,kl->il", [(3, 4), (4, 5), (5, 6)], 3 * 4 * 5 + 3 * 5 * 6),
        ("i,j->ij", [(3,), (4,)], 3 * 4),
        ("bhqd,bhkd->bhqk", [(2, 3, 4, 8), (2, 3, 6, 8)], 2 * 3 * 4 * 6 * 8),
        ("...ij,...jk", [(7, 2, 3), (7, 3, 4)], 7 * 2 * 3 * 4),
        ("ii->i", [(3, 3)], 0),
        ("ijk,jl->il", [(2, 3, 4), (3, 5)], 2 * 3 * 5),  # k is summed away first: additions, not MACs
    ],
)
def test_einsum_macs(equation, shapes, expected):
    assert einsum_macs(equation, [torch.empty(s, device="meta") for s in shapes]) == expected


@pytest.mark.parametrize(
    "source, problem",
    [
        ("(9 ** 64) ** 64", "would have about 12992 bits (at most 256)"),
        ("2 ** 200 * 2 ** 60", "exponent 200 is too large"),
        ("(2 ** 64) ** 3 * (2 ** 64) ** 2", "would have about 322 bits"),
        ("'ab' * 10 ** 9", "a str of length 2 repeated 1000000000 times"),
        ("(1, 2) * 6000", "a tuple of length 2 repeated 6000 times"),
        ("sum([[0] * 10000] * 10000, [])", "concatenating would make length 20000"),
        ("'%0999999999d' % 1", "string formatting with % is not allowed"),
        ("int(1e300)", "an integer of 997 bits"),
        ("1e308 + 1e308", "float overflow"),
        ("(-1) ** 0.5", "complex result"),
        ("x * 2", "arithmetic on a tensor is not allowed"),
        ("-x", "arithmetic on a tensor is not allowed"),
    ],
)
def test_bounds_refuse_before_computing(source, problem):
    with pytest.raises(FormulaError, match=re.escape(problem)):
        Formula(source).evaluate({"x": torch.empty(3, device="meta")})


def test_bounds_leave_room_for_real_counts():
    # 2**80 MACs is far beyond any model; products of sizes up to 256 bits are fine
    assert Formula("prod((2 ** 40, 2 ** 40, 2 ** 40))").evaluate({}) == 2**120
    assert Formula("sum([1] * 10000)").evaluate({}) == 10000
    assert Formula("12 ** 64").evaluate({}) == 12**64


def test_a_lazy_formula_is_parsed_on_first_use_and_checked_the_same():
    # the shipped table is loaded lazily (parsing all of its formulas cost ~0.25 s of every first estimate)
    lazy = Formula("numel(out) * 2", lazy=True)
    assert lazy._parsed is None
    assert lazy.evaluate({"out": torch.empty(3, 4, device="meta")}) == 24
    assert lazy.names == frozenset({"out"})
    with pytest.raises(FormulaError, match="does not parse"):
        Formula("1 +", lazy=True).evaluate({})
    with pytest.raises(FormulaError, match="is not allowed"):
        Formula("[x for x in y]", lazy=True).evaluate({})


def test_numel_of_a_tensor_is_the_product_of_its_sizes_symbolic_too():
    # numel() of a plain, parameter or fake tensor is the tensor's own count: the product of its sizes from 1
    # in axis order, the same int and (under named sizes) the same expression as prod(shape)
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from fxflops.rules.formula_helpers import numel, prod

    for tensor in (torch.empty(2, 3, 5), torch.nn.Parameter(torch.empty(7, 1)), torch.empty(0, 4), torch.empty(()),
                   torch.empty(1, 1, device="meta")):
        assert numel(tensor) == prod(tensor.shape) == tensor.shape.numel() and type(numel(tensor)) is int
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    for hints in [(2, 224), (1, 1), (1, 33)]:
        sizes = []
        for index, hint in enumerate(hints):
            source = ConstantSource(f"size{index}_{hints}")
            symbol = env.create_symbol(hint, source=source, dynamic_dim=DimDynamic.DYNAMIC,
                                       do_not_specialize_zero_one=True)
            sizes.append(env.create_symintnode(symbol, hint=hint, source=source))
        batch, side = sizes
        with mode:
            for shape in [(batch, 64, (side - 1) // 2 + 1, side), (batch, side, 4096), (side,), (3, batch)]:
                fake = torch.empty(shape)
                by_sizes = prod(fake.shape)
                assert isinstance(numel(fake), torch.SymInt)
                assert numel(fake).node.expr == by_sizes.node.expr and numel(fake).node.hint == by_sizes.node.hint
    assert numel(None) == 0 and numel((2, 3)) == 6  # not tensors: as before
