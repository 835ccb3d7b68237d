"""Sweeps: one capture with named sizes symbolic. Every point is checked against a fresh estimate()
there (the independent count of the same forward), at held-out and odd sizes; formulas against
hand-derived ones."""

from __future__ import annotations

import csv
import io
import json
import warnings

import pytest
import sympy
import torch
from torch import nn

import fxflops
from fxflops.capture.dynamic import plan_from_dims
from fxflops.sweeps import compile_expression, grid_points, sweep

transformers = pytest.importorskip("transformers")

B, S = sympy.symbols("batch seq", integer=True, positive=True)


def tokens(batch: int, seq: int) -> torch.Tensor:
    return torch.zeros(batch, seq, dtype=torch.long, device="meta")


def gpt2() -> nn.Module:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=2048)
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(config).eval()


def llama() -> nn.Module:
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=176,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                      max_position_embeddings=4096)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config).eval()


def assert_same(at: fxflops.Estimate, fresh: fxflops.Estimate) -> None:
    assert (at.total_macs, at.total_flops, at.total_params) == (fresh.total_macs, fresh.total_flops,
                                                                fresh.total_params)
    assert {n: (m.macs, m.flops, m.params, m.calls) for n, m in at.modules.items()} == \
        {n: (m.macs, m.flops, m.params, m.calls) for n, m in fresh.modules.items()}
    assert {k: (t.macs, t.flops) for k, t in at.by_rule.items()} == {k: (t.macs, t.flops) for k, t in fresh.by_rule.items()}
    counted = lambda e: {k: (t.count, t.macs, t.flops) for k, t in e.by_op.items() if t.macs or t.flops}  # noqa: E731
    assert counted(at) == counted(fresh)
    assert at.input_shapes == fresh.input_shapes


@pytest.mark.parametrize("point", [(3, 17), (1, 1), (1, 64), (7, 1023), (16, 5)])
def test_gpt2_points_equal_fresh_estimates(point):
    model = gpt2()
    swept = sweep(model, tokens(2, 9), dims={"batch": 0, "seq": 1})
    batch, seq = point
    assert_same(swept.at(batch=batch, seq=seq), fxflops.estimate(model, tokens(batch, seq)))


def test_one_capture_serves_every_point_where_the_path_is_the_same():
    swept = sweep(gpt2(), tokens(2, 9), dims={"batch": 0, "seq": 1})
    for batch, seq in [(2, 9), (5, 100), (3, 2047), (9, 3)]:
        swept.at(batch=batch, seq=seq)
    assert len(swept.pieces) == 1
    assert swept.holds_for == "batch >= 1, seq >= 2"


def test_a_sweep_from_batch_one_is_captured_at_two_and_holds_there():
    # GPT-2's attention reshapes ask whether batch is 1 (C++ reshape's view-or-copy); the choice is the
    # same at 1 (fxflops.capture.size_one), so the capture at 2 serves batch 1
    model = gpt2()
    swept = sweep(model, tokens(1, 9), dims={"batch": 0, "seq": 1})
    assert swept.example == {"batch": 1, "seq": 9}
    assert swept.pieces[0].plan.hints["batch"] == 2  # captured at 2, so the formula is in batch
    assert B in swept.formula().free_symbols
    assert_same(swept.at(batch=1, seq=9), fxflops.estimate(model, tokens(1, 9)))
    assert len(swept.pieces) == 1


def test_llama_formula_is_the_hand_formula():
    model = llama()
    swept = sweep(model, tokens(2, 33), dims={"batch": 0, "seq": 1})
    hidden, inter, heads, kv_heads, vocab, layers = 64, 176, 4, 2, 1000, 2
    head_dim = hidden // heads
    matmul_params = layers * (2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter) \
        + hidden * vocab
    # q k^T and attention x v: heads x seq x seq x head_dim each, per layer
    attention = layers * 2 * heads * S * S * head_dim
    assert sympy.expand(swept.formula("macs") - B * (matmul_params * S + attention)) == 0
    flops = swept.formula("flops")
    # every MAC is 2 FLOPs (SDPA's rule included); the rest (norms, rotary, silu, residuals) is
    # elementwise, linear in the tokens, and the rotary tables once per position
    rest = sympy.Poly(sympy.expand(flops - 2 * swept.formula("macs")), B, S)
    assert rest.degree(S) == 1 and rest.degree(B) == 1 and rest.coeff_monomial(S) > 0
    assert swept.formula("params") == sum(p.numel() for p in model.parameters())


def test_gqa_llama_at_batch_one_is_the_capture_at_two():
    # the rotary tables' broadcast over the batch (the product's first operand orders the axis), the
    # attention output's reshape to its own shape (a view either way): nothing decided from batch being 1
    model = llama()
    swept = sweep(model, tokens(2, 33), dims={"batch": 0, "seq": 1})
    assert swept.holds_for == "batch >= 1, seq >= 2"
    for batch, seq in [(1, 33), (1, 2), (1, 500), (3, 17)]:
        assert_same(swept.at(batch=batch, seq=seq), fxflops.estimate(model, tokens(batch, seq)))
    assert len(swept.pieces) == 1


def test_llama_with_a_mask_held_out_points():
    model = llama()

    def inputs(batch, seq):
        return (tokens(batch, seq),), {"attention_mask": torch.ones(batch, seq, dtype=torch.long, device="meta")}

    args, kwargs = inputs(2, 33)
    swept = sweep(model, args, kwargs, dims={"batch": 0, "seq": 1})
    for batch, seq in [(3, 17), (1, 64), (5, 999)]:
        args, kwargs = inputs(batch, seq)
        assert_same(swept.at(batch=batch, seq=seq), fxflops.estimate(model, args, kwargs))


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
def test_torchvision_batch_and_image_size(name):
    torchvision = pytest.importorskip("torchvision")
    with torch.device("meta"):
        model = getattr(torchvision.models, name)().eval()

    def image(batch, size):
        return torch.empty(batch, 3, size, size, device="meta")

    swept = sweep(model, image(2, 224), dims={"batch": 0, "size": (2, 3)})
    for batch, size in [(3, 225), (1, 97), (5, 301), (2, 33), (20, 224)]:
        assert_same(swept.at(batch=batch, size=size), fxflops.estimate(model, image(batch, size)))
    # strided convolutions and pooling make the formula floor divisions of the size
    assert any(isinstance(f, sympy.floor) for f in sympy.preorder_traversal(swept.formula()))


def test_formula_of_one_module_and_of_params():
    swept = sweep(gpt2(), tokens(2, 9), dims={"batch": 0, "seq": 1})
    mlp = swept.formula("macs", module="transformer.h.0.mlp")
    assert sympy.expand(mlp - B * S * 2 * 32 * 128) == 0  # c_fc and c_proj: 32 x 128 each per token
    assert swept.formula("macs", "lm_head") == 32 * 100 * B * S
    with pytest.raises(KeyError, match="no module 'nope'"):
        swept.formula(module="nope")
    with pytest.raises(ValueError, match="quantity must be one of"):
        swept.formula("latency")


class Branchy(nn.Module):
    """A forward whose path depends on a size: long inputs go through an extra layer."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)

    def forward(self, x):
        x = self.proj(x)
        if x.shape[1] > 16:
            x = self.extra(x)
        return x


def test_a_branch_on_a_size_limits_the_formula_and_points_past_it_are_captured_again():
    model = Branchy()
    swept = sweep(model, torch.zeros(2, 10, 8), dims={"seq": 1})
    assert swept.formula() == 2 * 64 * S
    assert "seq <= 16" in swept.conditions
    assert swept.holds_for == "2 <= seq <= 16"
    for seq in (16, 17, 40):
        assert_same(swept.at(seq=seq), fxflops.estimate(model, torch.zeros(2, seq, 8)))
    assert len(swept.pieces) == 2
    assert swept.formula(seq=40) == 2 * 2 * 64 * S
    assert swept.pieces[1].summary() == "seq >= 17"


class FixesItsSize(nn.Module):
    """Turns a size into a Python int (a specialization): each size is a capture of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        steps = int(x.shape[1])
        return self.proj(x) * steps


def test_a_size_the_forward_fixes_is_never_extrapolated():
    model = FixesItsSize()
    swept = sweep(model, torch.zeros(2, 10, 8), dims={"seq": 1})
    assert swept.holds_for == "seq = 10"
    assert_same(swept.at(seq=11), fxflops.estimate(model, torch.zeros(2, 11, 8)))
    assert len(swept.pieces) == 2


def test_backward_sweep_points_equal_fresh_estimates():
    model = gpt2().train()
    swept = sweep(model, tokens(2, 9), dims={"batch": 0, "seq": 1}, backward=True)
    for batch, seq in [(3, 17), (2, 40)]:
        fresh = fxflops.estimate(model, tokens(batch, seq), backward=True)
        at = swept.at(batch=batch, seq=seq)
        assert_same(at, fresh)
        assert (at.bwd_macs, at.bwd_flops) == (fresh.bwd_macs, fresh.bwd_flops)
    assert swept.formula("bwd_macs") + swept.formula("fwd_macs") == swept.formula("macs")


def test_table_over_a_grid():
    swept = sweep(gpt2(), tokens(2, 9), dims={"batch": 0, "seq": 1})
    rows = swept.table({"batch": [1, 2], "seq": [8, 16]})
    assert [(r["batch"], r["seq"]) for r in rows] == [(1, 8), (1, 16), (2, 8), (2, 16)]
    assert rows[3]["macs"] == fxflops.estimate(gpt2(), tokens(2, 16)).total_macs
    rows = swept.table([{"seq": 5}], columns=lambda e: {"top": e.root.macs})
    assert rows == [{"batch": 2, "seq": 5, "top": swept.at(seq=5).total_macs}]


def test_dims_match_axes_of_equal_size_only():
    ids, positions = tokens(4, 9), tokens(1, 9)
    plan = plan_from_dims((ids,), {"position_ids": positions}, {"batch": 0, "seq": 1})
    assert plan.hints == {"batch": 4, "seq": 9}
    assert plan.axes == {0: {0: "batch", 1: "seq"}, 1: {1: "seq"}}  # [1, seq] positions keep batch 1


@pytest.mark.parametrize("dims, message", [
    ({}, "dims is empty"),
    ({"seq": 5}, "no input tensor has that axis"),
    ({"two words": 1}, "must be a Python identifier"),
    ({"size": (0, 1)}, "which differ in size"),
    ({"seq": "1"}, "must be an axis"),
])
def test_bad_dims_say_what_is_wrong(dims, message):
    with pytest.raises(ValueError, match=message):
        sweep(gpt2(), tokens(2, 9), dims=dims)


def test_bad_points_say_what_is_wrong():
    swept = sweep(gpt2(), tokens(2, 9), dims={"seq": 1})
    with pytest.raises(ValueError, match="unknown size 'batch'; this sweep's sizes: seq"):
        swept.at(batch=3)
    with pytest.raises(ValueError, match="must be a non-negative int"):
        swept.at(seq=2.5)


def test_only_the_eager_method_captures_symbolic_sizes():
    with pytest.raises(ValueError, match="symbolic sizes are .*'eager'"):
        sweep(gpt2(), tokens(2, 9), dims={"seq": 1}, method="export")


class ValueShaped(nn.Module):
    def forward(self, x):
        return torch.nonzero(x).float().sum()


def test_sizes_that_depend_on_values_are_refused_clearly():
    with pytest.raises(ValueError, match="depends on tensor values|depend on sizes the capture could not name"):
        sweep(ValueShaped(), torch.zeros(3, 5), dims={"n": 1})


def test_unknown_ops_warn_once_at_capture():
    class Unknown(nn.Module):
        def forward(self, x):
            return torch.special.bessel_j0(x)

    with pytest.warns(fxflops.UnknownOpsWarning):
        swept = sweep(Unknown(), torch.zeros(2, 5), dims={"n": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        swept.at(n=7)


def test_compiled_expressions_are_exact_integer_arithmetic():
    from torch.utils._sympy.functions import CeilDiv, FloorDiv

    n = sympy.Symbol("n", integer=True, positive=True)
    expr = 3 * FloorDiv(n + 1, 2) ** 2 + CeilDiv(n, 3) * (10**20) + n
    compiled = compile_expression(expr)
    for value in (1, 2, 7, 10**6 + 1):
        assert compiled({"n": value}) == int(expr.xreplace({n: value})) == \
            3 * ((value + 1) // 2) ** 2 + -(-value // 3) * 10**20 + value


def test_grid_points_vary_the_last_name_fastest():
    assert grid_points({"a": [1, 2], "b": [3]}) == [{"a": 1, "b": 3}, {"a": 2, "b": 3}]
    assert grid_points([{"a": 1}]) == [{"a": 1}]


# ------------------------------------------------------------------------------ command line


def test_cli_sweep_json_points_equal_estimates():
    from tests.models import LeNet5
    from tests.test_cli import LENET5_MACS_PER_SAMPLE, fxflops as run_cli

    result = run_cli("lenet5", "--sweep", "batch=1,3..9:3,32", "--format", "json", "--top", "1")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["schema"] == "fxflops.sweep" and data["sizes"] == ["batch"]
    assert [p["sizes"]["batch"] for p in data["points"]] == [1, 3, 6, 9, 32]
    assert [p["macs"] for p in data["points"]] == [b * LENET5_MACS_PER_SAMPLE for b in (1, 3, 6, 9, 32)]
    assert {p["params"] for p in data["points"]} == {sum(p.numel() for p in LeNet5().parameters())}
    assert data["points"][0]["top_modules"][0]["name"] == "feature_extractor"
    first = data["formulas"][0]
    assert sympy.sympify(first["macs"]) == LENET5_MACS_PER_SAMPLE * sympy.Symbol("batch")
    # neither the CPU conv kernel's choice (batch < 16) nor batch 1 splits it
    assert first["holds_for"] == ["batch >= 1"] and data["captures"] == 1


def test_cli_sweep_grid_text_and_csv():
    from tests.test_cli import fxflops as run_cli

    result = run_cli("gpt2-small", "--set", "n_layer=1", "--sweep", "seq=16..64*2", "--sweep", "batch=1,2")
    assert result.returncode == 0, result.stderr
    # one capture: batch 1 is a point of the capture at batch 2 (fxflops.capture.size_one), equal to
    # estimate() there node by node (tests/test_sweep_size_one.py::test_gpt2_small_at_batch_one_is_the_capture_at_two)
    assert "fxflops sweep: GPT2 over seq, batch (6 points, 1 capture)" in result.stdout
    assert "formulas, where seq >= 2, batch >= 1:" in result.stdout
    result = run_cli("gpt2-small", "--set", "n_layer=1", "--sweep", "seq[1]=16,32", "--format", "csv")
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert [r["seq"] for r in rows] == ["16", "32"]
    estimate_32 = fxflops.estimate(*_gpt2_small_one_layer(32))
    assert int(rows[1]["macs"]) == estimate_32.total_macs


def _gpt2_small_one_layer(seq):
    from fxflops.cli.model_spec import load
    from fxflops.cli.options import InputOptions

    loaded = load("gpt2-small", InputOptions(seq_len=seq, overrides={"n_layer": 1}))
    return loaded.model, loaded.args, loaded.kwargs


@pytest.mark.parametrize("text, message", [
    ("seq", "expected NAME=VALUES"),
    ("n=1,2", "which input axis is n?"),
    ("seq=10..2", "needs start <= stop"),
    ("seq=1..9*1", "a factor of at least 2"),
    ("seq=abc", "bad --sweep value 'abc'"),
    ("seq=1..100000000", "more than 10000 values"),
])
def test_cli_sweep_parse_errors(text, message):
    from fxflops.cli.options import ModelSpecError, parse_sweep

    with pytest.raises(ModelSpecError, match=message):
        parse_sweep(text)


def test_cli_sweep_values_and_axes():
    from fxflops.cli.options import parse_sweep

    assert parse_sweep("seq=128,256") == ("seq", (1,), [128, 256])
    assert parse_sweep("size[2, 3]=160..224:32") == ("size", (2, 3), [160, 192, 224])
    assert parse_sweep("n[1]=1..16*2,100") == ("n", (1,), [1, 2, 4, 8, 16, 100])


def test_cli_sweep_usage_errors_are_one_line():
    from tests.test_cli import assert_one_line_error, fxflops as run_cli

    assert_one_line_error(run_cli("lenet5", "--sweep", "batch=1", "--sweep", "batch=2"), 2, "given twice")
    # LeNet's [1, 1, 32, 32] input has an axis 1: its channels, which a convolution fixes
    assert_one_line_error(run_cli("lenet5", "--sweep", "seq=8,16"), 1,
                          "to have 1 channels, but got seq channels instead in module 'feature_extractor.0', "
                          "with seq=8 (seq on axis 1 of input 0 [1, 1, 32, 32])")
    assert_one_line_error(run_cli("lenet5", "--sweep", "width[4]=8"), 1, "dims['width'] = (4,): no input tensor")


# --------------------------------------------------------------- calls that differ only in sizes


def test_size_families_estimate_a_stream_of_calls_from_one_sweep():
    from fxflops.sweeps import SizeFamilies

    model = Branchy()
    families = SizeFamilies(model)
    calls = [(2, 5), (2, 6), (2, 9), (2, 12), (3, 12), (2, 30)]
    for batch, seq in calls:
        x = torch.zeros(batch, seq, 8)
        assert_same(families.estimate((x,), {}), fxflops.estimate(model, x))
    # (2, 5) plain; (2, 6) the sweep over seq; (2, 9), (2, 12) its points; (3, 12) changes batch too:
    # plain; (2, 30) takes the other branch (seq > 16): the sweep captures a second piece
    assert families.captures == 4


def test_size_families_points_equal_estimates_through_shape_arithmetic():
    from fxflops.sweeps import SizeFamilies

    class Fixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(5, 5)

        def forward(self, x):  # the swept size is split by a reshape whose other factor is fixed
            return self.proj(x.reshape(x.shape[0], 5, -1).transpose(1, 2))

    model = Fixed()
    families = SizeFamilies(model)
    for n in (10, 15, 20):
        x = torch.zeros(2, n)
        assert families.estimate((x,), {}).total_macs == fxflops.estimate(model, x).total_macs


def test_compiled_conditions_decide_as_sympy_does():
    from torch.utils._sympy.functions import FloorDiv

    n = sympy.Symbol("n", integer=True, positive=True)
    conditions = [sympy.Ne(FloorDiv(n - 1, 2) + 1, 1), sympy.Gt(64 * n * n, 20480), sympy.Eq(n, 7) | sympy.Le(n, 3)]
    for condition in conditions:
        check = compile_expression(condition)
        for value in range(1, 40):
            assert check({"n": value}) == bool(condition.xreplace({n: value}))


class Square(nn.Module):
    """Adds an image to its transpose: only square images run, and torch records height == width."""

    def forward(self, x):
        return (x + x.transpose(2, 3)).sum()


def test_sizes_a_forward_equates_stay_equal_in_the_conditions():
    swept = sweep(Square(), torch.zeros(1, 3, 8, 8), dims={"height": 2, "width": 3})
    assert any("height" in c and "width" in c for c in swept.conditions)
    with pytest.raises(fxflops.SweepCaptureError, match="height=8, width=16"):
        swept.at(height=8, width=16)  # not extrapolated from the square capture: captured, and it fails
    assert swept.at(height=5, width=5).total_flops == fxflops.estimate(Square(), torch.zeros(1, 3, 5, 5)).total_flops


def test_a_real_tensor_the_forward_meets_keeps_its_shape():
    table = torch.ones(4, 8)  # a constant outside any module: real, not a parameter

    class UsesConstant(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x) @ table.T

    model = UsesConstant()
    swept = sweep(model, torch.zeros(2, 10, 8), dims={"seq": 1})
    assert swept.formula() == 2 * (64 + 32) * S
    assert_same(swept.at(seq=7), fxflops.estimate(model, torch.zeros(2, 7, 8)))


def test_reserved_size_names_and_builtin_min_max_in_rules():
    with pytest.raises(ValueError, match="may not be called 'module'"):
        sweep(gpt2(), tokens(2, 9), dims={"module": 1})
    from fxflops.rules.formula import HELPERS

    assert HELPERS["max"]([3, 1.5]) == 3 and type(HELPERS["max"](3, 1.5)) is int  # Python's, not torch's
    assert HELPERS["min"](2, 1.5) == 1.5


def test_text_report_states_a_merged_formula_region_once():
    from fxflops.report.sweep import render_text
    from fxflops.results import SweepFormula, SweepResult

    # three pieces with one formula, each summarised alike (as resnet18 over size gives)
    region = "size >= 2 (and 14 more conditions, each checked per point)"
    result = SweepResult(model_type="M", names=("size",), example={"size": 64},
                         formulas=[SweepFormula({"macs": "size**2"}, [region] * 3, [[], [], []])],
                         points=[], captures=3)
    assert f"formulas, where {region}:\n" in render_text(result)


# ------------------------------------------------------------------------------ streamed grids


def _expected_point(swept, sizes: dict, depth: int, top: int) -> dict:
    """A point as the JSON report should write it, from the full Estimate at() gives there."""
    from fxflops.report.sweep import top_modules

    at = swept.at(**sizes)
    return {"sizes": {**swept.example, **sizes}, "macs": at.total_macs, "flops": at.total_flops,
            "params": at.total_params, "bwd_macs": at.bwd_macs, "bwd_flops": at.bwd_flops,
            "cautions": list(at.cautions), "top_modules": [{"name": m.name, "type": m.type, "macs": m.macs, "flops": m.flops,
                             "share": m.macs / at.total_macs} for m in top_modules(at, depth, top)]}


def test_streamed_json_and_csv_equal_at_every_sampled_point():
    from fxflops.report.sweep import to_csv, to_json, write_csv, write_json

    # a forward that branches at seq 16, over seq 1 and 3, 9 (the first capture's piece), 17, 33 (past the branch)
    grid = {"seq": [1, 3, 9, 17, 33]}
    swept = sweep(Branchy(), torch.zeros(2, 10, 8), dims={"seq": 1})
    stream = io.StringIO()
    write_json(swept, grid, stream, depth=2, top=2)
    data = json.loads(stream.getvalue())
    assert data["points"] == [_expected_point(swept, {"seq": s}, 2, 2) for s in grid["seq"]]
    assert data["captures"] == len(swept.pieces) == 3  # the pieces the points added are in the tail
    assert stream.getvalue() == to_json(swept.result(grid, depth=2, top=2))
    stream = io.StringIO()
    write_csv(swept, grid, stream)
    rows = list(csv.reader(io.StringIO(stream.getvalue())))
    assert rows[0] == ["seq", "macs", "flops", "params"]  # no backward: no bwd columns
    for row, seq in zip(rows[1:], grid["seq"], strict=True):
        at = swept.at(seq=seq)
        assert row == [str(seq), str(at.total_macs), str(at.total_flops), str(at.total_params)]
    assert stream.getvalue() == to_csv(swept.result(grid))


def test_streamed_backward_grid_has_bwd_columns_equal_at():
    from fxflops.report.sweep import write_csv, write_json

    model = llama()
    swept = sweep(model, tokens(2, 9), dims={"batch": 0, "seq": 1}, backward=True)
    grid = [{"batch": 3, "seq": 17}, {"batch": 1, "seq": 40}, {"batch": 5, "seq": 2}]
    stream = io.StringIO()
    write_csv(swept, grid, stream)
    rows = list(csv.DictReader(io.StringIO(stream.getvalue())))
    assert list(rows[0]) == ["batch", "seq", "macs", "flops", "params", "bwd_macs", "bwd_flops"]
    for row, sizes in zip(rows, grid, strict=True):
        at = swept.at(**sizes)
        assert at.bwd_flops > 0
        assert {k: int(v) for k, v in row.items()} == {**sizes, "macs": at.total_macs, "flops": at.total_flops,
                                                       "params": at.total_params, "bwd_macs": at.bwd_macs,
                                                       "bwd_flops": at.bwd_flops}
    stream = io.StringIO()
    write_json(swept, grid, stream)
    points = json.loads(stream.getvalue())["points"]
    assert points == [_expected_point(swept, sizes, 1, 3) for sizes in grid]
    result = swept.result(grid, top=0)
    assert [(p.fwd_macs, p.fwd_flops) for p in result.points] == \
        [(swept.at(**s).fwd_macs, swept.at(**s).fwd_flops) for s in grid]
    assert swept.table(grid) == [{**s, "macs": swept.at(**s).total_macs, "flops": swept.at(**s).total_flops,
                                  "params": swept.at(**s).total_params} for s in grid]


def test_a_grid_result_holds_totals_not_estimates():
    swept = sweep(gpt2(), tokens(2, 9), dims={"batch": 0, "seq": 1})
    result = swept.result({"batch": [2, 3], "seq": [5, 9]})
    assert all(type(point).__name__ == "SweepPoint" for point in result.points)
    assert not any(isinstance(value, fxflops.Estimate) for point in result.points for value in vars(point).values())


# ------------------------------------------------- a sweep past the position table (issue 21, item 4)


def test_sweep_points_past_the_position_table_carry_the_caution_with_its_region():
    from fxflops.cli.examples import GPT2

    model = GPT2(vocab_size=100, n_positions=64, d_model=16, n_layer=1, n_head=2).eval()
    swept = sweep(model, (tokens(1, 16),), dims={"seq": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert swept.at(seq=64).cautions == []  # rows 0..63 of 64: a forward real weights can run
    with pytest.warns(fxflops.CautionWarning, match=r"module 'wpe' \(Embedding\) looks up rows 0\.\.seq - 1 of a "
                                                    r"table of 64 rows \(positions from arange\), where seq > 64"):
        past = swept.at(seq=65)
    # the same caution the fixed-size estimate gives at that point, with the region stated
    with pytest.warns(fxflops.CautionWarning):
        direct = fxflops.estimate(model, (tokens(1, 65),))
    assert direct.cautions[0].split(":")[1] == past.cautions[0].split(":")[1]
    assert "rows 0..64 of a table of 64 rows" in direct.cautions[0]


def test_hf_sweep_past_n_positions_is_cautioned():
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = sweep(model, (tokens(1, 16),), dims={"seq": 1}).result({"seq": [32, 64, 128]})
    assert [bool(point.cautions) for point in result.points] == [False, False, True]
    assert "where seq > 64" in result.cautions[0] and len(result.cautions) == 1


def test_cli_sweep_past_the_position_table_warns_and_reports(capsys):
    from tests.test_cli import run_main

    code, out, err = run_main(capsys, "gpt2-small", "--set", "n_layer=1", "--set", "n_positions=64",
                              "--sweep", "seq=32..128*2")
    assert code == 0
    assert "fxflops: warning: module 'wpe' (Embedding) looks up rows 0..seq - 1 of a table of 64 rows" in err
    assert "caution: module 'wpe' (Embedding)" in out and "where seq > 64" in out
    code, out, err = run_main(capsys, "gpt2-small", "--set", "n_layer=1", "--set", "n_positions=64",
                              "--sweep", "seq=32..128*2", "--format", "json")
    points = json.loads(out)["points"]
    assert [bool(p["cautions"]) for p in points] == [False, False, True]


class Pooled(nn.Module):
    """A convolution and a global average pool: the pool's backward reads its gradient expanded (stride 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.pool(self.conv(x)).flatten(1))


def test_an_expanded_read_under_named_sizes_counts_its_distinct_bytes_as_estimate():
    # the pool's backward divides a [N, C, 1, 1] gradient expanded to [N, C, H, W]: it reads N*C values,
    # not N*C*H*W (traffic.py), under named sizes as at a fixed size
    model = Pooled()
    swept = sweep(model, torch.zeros(2, 3, 8, 8), dims={"batch": 0, "size": (2, 3)}, backward=True)
    for batch, size in [(2, 8), (3, 5), (1, 13)]:
        at, fresh = swept.at(batch=batch, size=size), fxflops.estimate(model, torch.zeros(batch, 3, size, size),
                                                                        backward=True)
        assert at.total_bytes == fresh.total_bytes and at.nodes == fresh.nodes
        (divide,) = [node for node in at.nodes if node.op == "aten.div.Scalar"]
        assert divide.bytes == 4 * (batch * 4 + batch * 4 * size * size)  # by hand: read N*C, write N*C*H*W


def test_conv_kernel_choice_and_batch_one_do_not_split_a_convnet_sweep():
    # which CPU kernel a convolution would use (oneDNN below channels x area thresholds, NNPACK from
    # batch 16) was a guard each, splitting a sweep over batch and image size into many pieces; it only
    # picks a memory layout. Batch 1 was a piece of its own (torch made a size of 1 a constant); the
    # questions that still asked whether it is 1 (a broadcast of a size against itself or against 1, the
    # stride check of an axis whose stride is the expected one) give the same program either way
    torchvision = pytest.importorskip("torchvision")
    with torch.device("meta"):
        model = torchvision.models.resnet18().eval()

    def image(batch, size):
        return torch.empty(batch, 3, size, size, device="meta")

    swept = sweep(model, image(2, 224), dims={"batch": 0, "size": (2, 3)})
    # every size: the last stage's map is 1 x 1 from size 32 down, where a contiguous map is channels-last
    # too; torch's batch-norm decomposition asked that of its first step, whose output is contiguous either
    # way (capture.symbolic_kernels), and it split the sweep at 33
    assert swept.holds_for == "batch >= 1, size >= 1"
    for batch, size in [(2, 33), (64, 517), (16, 64), (15, 100), (1, 33), (1, 517), (3, 200), (1, 224), (1, 32),
                        (2, 32), (3, 17), (1, 2), (2, 1)]:
        at, fresh = swept.at(batch=batch, size=size), fxflops.estimate(model, image(batch, size))
        assert_same(at, fresh)
        assert at.total_bytes == fresh.total_bytes and at.nodes == fresh.nodes
    assert len(swept.pieces) == 1
    assert torch._C._get_mkldnn_enabled() and torch._C._get_nnpack_enabled()  # restored


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x):
        return torch.cat([self.conv(x) + x, x], dim=1)


def test_a_nodes_bytes_under_named_sizes_are_its_terms_summed_as_estimate_sums_them():
    # traffic sums a node's terms (each input read, each output written) as one sympy Add under named
    # sizes: every node's bytes at every point equal estimate()'s, size 1 included
    model = _Residual()
    swept = sweep(model, torch.zeros(2, 3, 8, 8), dims={"batch": 0, "size": (2, 3)})
    for batch, size in [(2, 8), (1, 1), (3, 5), (1, 13), (4, 1)]:
        at, fresh = swept.at(batch=batch, size=size), fxflops.estimate(model, torch.zeros(batch, 3, size, size))
        assert at.total_bytes == fresh.total_bytes and at.nodes == fresh.nodes
        values = batch * 3 * size * size
        (add,) = [node for node in at.nodes if node.op == "aten.add.Tensor"]
        assert add.bytes == 4 * 3 * values  # by hand: two float32 inputs read, one output written
        (cat,) = [node for node in at.nodes if node.op == "aten.cat.default"]
        assert cat.bytes == 4 * 4 * values  # by hand: two inputs read, an output of twice their size written


def test_the_byte_total_is_the_chained_sum():
    from fxflops.traffic import _total

    batch, size = sympy.symbols("batch size", integer=True, positive=True)
    terms = [0, 12 * batch * size**2, 12 * batch * size**2, 24 * batch * size**2, 8 * batch]
    assert _total(terms) == sum(terms) == 48 * batch * size**2 + 8 * batch
    assert _total([0, 4, 8]) == 12 and type(_total([0, 4, 8])) is int
