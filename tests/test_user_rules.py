"""Users extend the table without editing ours: TOML files, Python callables, whole-module formulas."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxflops


class FusedBlock(nn.Module):
    """A custom block a user wants counted by one formula of their own."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.inner = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.inner(x)) * 2


class WithBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = FusedBlock()
        self.head = nn.Linear(8, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.block(x)))


def test_user_toml_rule_overrides_ours(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(
        "[[rule]]\nname = 'my_linear'\nops = ['aten.linear']\n"
        "macs = 'numel(out) * weight.shape[1]'\nflops = '3 * macs'\n"
    )
    result = fxflops.estimate(nn.Linear(4, 5), input_shape=(2, 4), rules=[path])
    assert result.total_macs == 2 * 5 * 4
    assert result.total_flops == 3 * 2 * 5 * 4
    assert list(result.by_rule) == ["my_linear"]


def test_user_rule_for_an_unknown_op_counts_it(tmp_path):
    class Exp(nn.Module):
        def forward(self, x):
            return torch.linalg.matrix_exp(x)

    path = tmp_path / "matrix_exp.toml"
    path.write_text(
        "[[rule]]\nname = 'matrix_exp'\nops = ['aten.linalg_matrix_exp']\n"
        "macs = '6 * numel(out) * self.shape[-1]'\nflops = '2 * macs'\n"
    )
    result = fxflops.estimate(Exp(), input_shape=(5, 5), rules=path)
    assert result.unknown == []
    assert result.total_macs == 6 * 25 * 5


def test_python_callable_rule():
    def linear_rule(call: fxflops.OpCall) -> tuple[int, int]:
        weight = call.names["weight"]
        macs = call.out.numel() * weight.shape[1]
        return macs, 2 * macs

    result = fxflops.estimate(nn.Linear(4, 5), input_shape=(3, 4), rules={"aten.linear": linear_rule})
    assert (result.total_macs, result.total_flops) == (3 * 5 * 4, 2 * 3 * 5 * 4)
    assert list(result.by_rule) == ["user:linear_rule"]


@pytest.mark.parametrize("method", ["export", "symbolic", "trace"])
def test_whole_module_rule_replaces_its_inside(method):
    # the block's own formula: 100 MACs per input row; its Linear/ReLU/mul must not be counted again
    rules = {FusedBlock: lambda call: (100 * call.names["input"].shape[0], 7)}
    result = fxflops.estimate(WithBlocks(), (torch.randn(3, 8),), rules=rules, method=method)
    block = result.modules["block"]
    assert block.calls == 2
    assert (block.macs, block.flops) == (2 * 100 * 3, 2 * 7)
    assert result.modules["block.inner"].macs == 0
    assert result.total_macs == 2 * 100 * 3 + 3 * 8 * 2
    assert result.unknown == []


@pytest.mark.parametrize("method", ["export", "symbolic"])
def test_leaf_modules_with_toml_rule_by_class_name(tmp_path, method):
    path = tmp_path / "block.toml"
    path.write_text(
        f"[[rule]]\nname = 'fused_block'\nops = ['{__name__}.FusedBlock']\n"
        "macs = 'numel(input) * 8'\nflops = '2 * macs'\n"
    )
    result = fxflops.estimate(WithBlocks(), (torch.randn(3, 8),), rules=[path], leaf_modules=[FusedBlock],
                              method=method)
    assert result.modules["block"].macs == 2 * 3 * 8 * 8
    assert result.by_rule["fused_block"].count == 2


def test_leaf_module_without_a_rule_is_unknown_not_zero():
    with pytest.warns(fxflops.UnknownOpsWarning):
        result = fxflops.estimate(WithBlocks(), (torch.randn(3, 8),), leaf_modules=[FusedBlock], method="export")
    assert [(u.op, u.count) for u in result.unknown] == [(f"{__name__}.FusedBlock", 2)]


def test_annotate_writes_costs_into_an_exported_graph():
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU())
    program = torch.export.export(model, (torch.randn(2, 4),))
    graph_module = fxflops.annotate(program)
    costs = {n.target: n.meta["fxflops"] for n in graph_module.graph.nodes if "fxflops" in n.meta}
    linear = costs[torch.ops.aten.linear.default]
    assert (linear["macs"], linear["flops"], linear["rule"]) == (2 * 6 * 4, 2 * 2 * 6 * 4 + 2 * 6, "linear")
    assert linear["module"] == "0"
    relu = costs[torch.ops.aten.relu.default]
    assert (relu["flops"], relu["status"], relu["module"]) == (2 * 6, "counted", "1")


def test_annotate_reads_shapes_from_a_shape_propagated_symbolic_trace():
    from torch.fx.passes.shape_prop import ShapeProp

    graph_module = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 5), nn.ReLU()))
    ShapeProp(graph_module).propagate(torch.randn(2, 4))
    fxflops.annotate(graph_module)
    costs = {n.target: n.meta["fxflops"] for n in graph_module.graph.nodes if "fxflops" in n.meta}
    assert costs["0"]["macs"] == 2 * 4 * 5  # 2 rows x 4 in x 5 out
    assert costs["0"]["flops"] == 2 * (2 * 4 * 5) + 2 * 5  # + a bias add per output element
    assert costs["1"]["flops"] == 2 * 5  # relu: one per output element


def test_annotate_refuses_a_graph_without_shapes():
    graph_module = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 5)))
    with pytest.raises(ValueError, match="ShapeProp"):
        fxflops.annotate(graph_module)


class IndexPutAccumulate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.index_put((torch.tensor([0, 1]),), torch.ones(2, 8), accumulate=True)


def test_user_rule_for_a_packet_overrides_our_rule_for_one_overload(tmp_path):
    # ours names aten.index_put.default (so it goes before the zero list's aten.index_put); a user's rule
    # for aten.index_put must still win: a user's rule always goes before ours
    path = tmp_path / "mine.toml"
    path.write_text('[[rule]]\nname = "mine"\nops = ["aten.index_put"]\nmacs = "0"\nflops = "1000"\n')
    ours = fxflops.estimate(IndexPutAccumulate(), (torch.randn(4, 8),))
    assert ours.total_flops == 2 * 8  # one add per accumulated value, by hand
    assert fxflops.estimate(IndexPutAccumulate(), (torch.randn(4, 8),), rules=[path]).total_flops == 1000


def test_a_preset_that_makes_a_count_negative_names_the_rule_and_preset():
    # ptflops counts macs + extra = macs + (flops - 2 macs): a rule with fewer FLOPs than MACs goes negative
    def fewer_flops(call):
        return 8, 2

    with pytest.raises(fxflops.RuleEvaluationError, match=r"fewer_flops: 'macs under preset ptflops \(family matmul\)'"):
        fxflops.estimate(nn.Linear(4, 4), input_shape=(2, 4), rules={"aten.linear": fewer_flops}, conventions="ptflops")


@pytest.mark.parametrize("rules, problem", [
    ({"linear": lambda call: (1, 1)}, "op 'linear' is not a qualified name"),
    ({5: lambda call: (1, 1)}, "a key must be an op name"),
])
def test_python_rule_keys_are_checked(rules, problem):
    with pytest.raises(fxflops.RuleFileError, match=problem):
        fxflops.estimate(nn.Linear(4, 4), input_shape=(2, 4), rules=rules)


def test_a_family_that_is_not_a_name_is_a_rule_file_error(tmp_path):
    path = tmp_path / "family.toml"
    path.write_text('[[rule]]\nname = "x"\nfamily = ["matmul"]\nops = ["aten.linear"]\nmacs = "1"\nflops = "1"\n')
    with pytest.raises(fxflops.RuleFileError, match=r"rule 'x': unknown family \['matmul'\]"):
        fxflops.estimate(nn.Linear(4, 4), input_shape=(2, 4), rules=[path])


def test_loaded_entries_are_rule_specs(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('[[rule]]\nname = "mine"\nops = ["aten.linear"]\nmacs = "7"\nflops = "9"\n')
    entries = fxflops.rules.load_rule_file(path)
    result = fxflops.estimate(nn.Linear(4, 4), input_shape=(2, 4), rules=entries)
    assert (result.total_macs, result.total_flops) == (7, 9)
