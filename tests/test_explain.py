"""Estimate.explain / Sweep.explain / --explain: the rule, formula as written, bound values and result
behind each op, each number equal to a hand computation; unknown ops come with a stub that counts them."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fxflops
from fxflops.explain import Explanation

ROOT = Path(__file__).resolve().parents[1]


def quiet_estimate(model, *args, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxflops.estimate(model, *args, **options)


def only_counted(explanation: Explanation, op: str):
    found = [entry for entry in explanation.ops if entry.op == op]
    assert len(found) == 1, [entry.op for entry in explanation.ops]
    return found[0]


class Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x, image, y):
        return self.linear(x), self.conv(image), self.norm(y)


@pytest.fixture(scope="module")
def block_estimate():
    return quiet_estimate(Block(), (torch.randn(2, 8), torch.randn(1, 3, 16, 16), torch.randn(2, 16)))


def test_linear_formula_values_and_result(block_estimate):
    entry = only_counted(block_estimate.explain("linear"), "aten.linear.default")
    assert entry.rule == "linear" and entry.family == "matmul"
    assert entry.formulas == {"macs": "numel(out) * weight.shape[-1]",
                              "flops": "2 * macs + (numel(out) if bias is not None else 0)"}
    assert entry.values == {"out": "float32[2, 4]", "weight": "float32[4, 8]", "bias": "float32[4]"}
    # by hand: 2 rows x 4 outputs x 8 inputs; FLOPs twice that plus one bias add per output element
    assert (entry.macs, entry.flops) == (2 * 4 * 8, 2 * 64 + 8)
    assert entry.rule_counts == (64, 136) and entry.preset is None
    assert entry.bytes == 4 * (2 * 8 + 4 * 8 + 4 + 2 * 4)  # reads x, weight, bias; writes out (float32)


def test_conv_formula_values_and_result(block_estimate):
    entry = only_counted(block_estimate.explain("conv"), "aten.conv2d.default")
    assert entry.formulas["macs"] == "numel(out) * weight.shape[1] * prod(weight.shape[2:])"
    assert entry.values["weight"] == "float32[8, 3, 3, 3]" and entry.values["out"] == "float32[1, 8, 16, 16]"
    out = 8 * 16 * 16
    assert (entry.macs, entry.flops) == (out * 3 * 9, 2 * out * 3 * 9 + out)


def test_layer_norm_formula_values_and_result(block_estimate):
    explanation = block_estimate.explain("norm")
    entry = only_counted(explanation, "aten.native_layer_norm.default")
    assert entry.formulas == {"macs": "0", "flops": "numel(input) * (5 if weight is not None else 4)"}
    assert entry.values == {"input": "float32[2, 16]", "weight": "float32[16]"}
    assert (entry.macs, entry.flops) == (0, 2 * 16 * 5)
    assert (explanation.macs, explanation.flops) == (0, 160)


def test_sdpa_formula_values_and_result():
    q = torch.randn(1, 2, 8, 16)
    k = torch.randn(1, 2, 6, 16)
    v = torch.randn(1, 2, 6, 32)
    explanation = quiet_estimate(Attention(), (q, k, v)).explain("")
    entry = only_counted(explanation, "aten.scaled_dot_product_attention.default")
    assert entry.rule == "sdpa" and entry.family == "attention"
    assert entry.values == {"key": "float32[1, 2, 6, 16]", "query": "float32[1, 2, 8, 16]",
                            "value": "float32[1, 2, 6, 32]"}
    # by hand: B*H*Lq*Lk*(E + Ev) for the two products QK^T and PV
    assert entry.macs == 1 * 2 * 8 * 6 * (16 + 32) and entry.flops == 2 * entry.macs


def test_text_reads_formula_values_and_result(block_estimate):
    text = str(block_estimate.explain("linear"))
    assert "module linear (Linear), counted under the deepspeed conventions" in text
    assert "macs  = numel(out) * weight.shape[-1]" in text
    assert "with out = float32[2, 4], weight = float32[4, 8], bias = float32[4]" in text
    assert "= 64 MACs, 136 FLOPs" in text and "rules/matmul.toml" in text


def test_preset_treatment_is_stated():
    estimate = quiet_estimate(torch.nn.LayerNorm(16), (torch.randn(2, 16),), conventions="torch")
    entry = only_counted(estimate.explain(""), "aten.native_layer_norm.default")
    assert entry.rule_counts == (0, 160)  # what the rule gives; the torch preset does not count norms
    assert (entry.macs, entry.flops) == (0, 0)
    assert "does not count the norm family" in entry.preset


def test_fvcore_treatment_of_linear_is_stated():
    estimate = quiet_estimate(torch.nn.Linear(8, 4), (torch.randn(2, 8),), conventions="fvcore")
    entry = only_counted(estimate.explain(""), "aten.linear.default")
    assert entry.rule_counts == (64, 136) and (entry.macs, entry.flops) == (64, 64)
    assert "flops = macs" in entry.preset


def test_zero_ops_grouped_by_their_list():
    class Viewer(torch.nn.Module):
        def forward(self, x):
            return x.view(4, 2).transpose(0, 1).relu()

    explanation = quiet_estimate(Viewer(), (torch.randn(8),)).explain("")
    groups = {group.name: group.ops for group in explanation.zero}
    assert groups["view"] == {"aten.view.default": 1, "aten.transpose.int": 1}
    assert [entry.op for entry in explanation.ops] == ["aten.relu.default"]


def test_identical_calls_group_with_their_modules():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    explanation = quiet_estimate(model, (torch.randn(3, 4),)).explain("")
    square = [entry for entry in explanation.ops if entry.values.get("weight") == "float32[4, 4]"]
    assert len(square) == 1 and square[0].calls == 2 and square[0].modules == ("0", "1")
    assert square[0].total_macs == 2 * 3 * 4 * 4
    assert explanation.macs == 2 * 48 + 3 * 2 * 4


def test_explain_one_node_by_name(block_estimate):
    name = next(cost.name for cost in block_estimate.nodes if cost.op == "aten.conv2d.default")
    explanation = block_estimate.explain(name)
    assert explanation.kind == "node" and explanation.target == name
    assert [entry.op for entry in explanation.ops] == ["aten.conv2d.default"]


def test_unknown_name_suggests_close_ones(block_estimate):
    with pytest.raises(KeyError, match="did you mean 'linear'"):
        block_estimate.explain("linaer")


def test_user_ruled_op_shows_the_users_formula(tmp_path):
    rule = tmp_path / "median.toml"
    rule.write_text('[[rule]]\nname = "median"\nops = ["aten.median.dim"]\nmacs = "0"\n'
                    'flops = "numel(self) * 3"\n')

    class Median(torch.nn.Module):
        def forward(self, x):
            return torch.median(x, 0)[0]

    estimate = quiet_estimate(Median(), (torch.randn(5, 6),), rules=[str(rule)])
    entry = only_counted(estimate.explain(""), "aten.median.dim")
    assert entry.where == str(rule) and entry.formulas == {"macs": "0", "flops": "numel(self) * 3"}
    assert entry.values == {"self": "float32[5, 6]"} and entry.flops == 90


class Kth(torch.nn.Module):
    def forward(self, x):
        return torch.kthvalue(x, 2)[0] * 2


def test_unknown_op_stub_counts_it_when_passed_back(tmp_path):
    estimate = quiet_estimate(Kth(), (torch.randn(3, 7),))
    explanation = estimate.explain("")
    [unknown] = explanation.unknown
    assert unknown.op == "aten.kthvalue.default" and 'ops = ["aten.kthvalue.default"]' in unknown.stub
    assert "self = float32[3, 7]" in unknown.stub
    path = tmp_path / "stub.toml"
    path.write_text(unknown.stub)
    again = quiet_estimate(Kth(), (torch.randn(3, 7),), rules=[str(path)])
    assert not again.unknown
    # the stub's guess, one FLOP per output element (3), plus the multiply by 2 (3)
    assert again.total_flops == estimate.total_flops + 3 == 6


def test_sweep_explain_gives_formulas_in_the_named_sizes():
    sweep = fxflops.sweep(Attention(), (torch.randn(2, 4, 16, 8),) * 3, dims={"batch": 0, "seq": 2})
    explanation = sweep.explain("")
    entry = only_counted(explanation, "aten.scaled_dot_product_attention.default")
    assert explanation.sizes == ("batch", "seq")
    assert entry.values["query"] == "float32[batch, 4, seq, 8]"
    assert str(entry.macs) == "64*batch*seq**2"  # batch x 4 heads x seq x seq x (8 + 8), by hand


def test_json_ready(block_estimate):
    data = json.loads(json.dumps(block_estimate.explain("").to_dict()))
    assert data["macs"] == 64 + 8 * 16 * 16 * 27 and {op["op"] for op in data["ops"]} >= {"aten.linear.default"}


def test_estimate_without_capture_refuses():
    estimate = quiet_estimate(torch.nn.Linear(2, 2), (torch.randn(1, 2),))
    estimate.source = None
    with pytest.raises(ValueError, match="no capture to explain"):
        estimate.explain("")


def test_cli_explain_prints_a_stub_that_counts_the_op(tmp_path):
    factory = tmp_path / "kth_model.py"
    factory.write_text("import torch\n\nclass Kth(torch.nn.Module):\n    def forward(self, x):\n"
                       "        return torch.kthvalue(x, 2)[0] * 2\n\n"
                       "def build():\n    return Kth(), (torch.randn(3, 7),)\n")
    run = subprocess.run([sys.executable, "-m", "fxflops.cli", f"{factory}:build", "--explain", "", "-q"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    stub = run.stdout.split("[[rule]]", 1)[1].split("\n\n", 1)[0]
    lines = [line.strip() for line in ("[[rule]]" + stub).splitlines() if line.strip() and not line.strip().startswith("#")]
    rule = tmp_path / "kth.toml"
    rule.write_text("\n".join(lines) + "\n")
    counted = subprocess.run([sys.executable, "-m", "fxflops.cli", f"{factory}:build", "--rules", str(rule),
                              "--format", "json", "-q"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert counted.returncode == 0, counted.stderr
    data = json.loads(counted.stdout)
    assert data["totals"]["flops"] == 6 and not data["unknown"]


def test_a_module_counted_whole_and_called_twice_is_explained_call_by_call(tmp_path):
    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 8)

        def forward(self, x, y):
            return self.lin(x).sum() + self.lin(y).sum()

    estimate = quiet_estimate(Twice(), (torch.randn(2, 4), torch.randn(10, 4)), leaf_modules=[torch.nn.Linear],
                              method="symbolic")
    explanation = estimate.explain("lin")
    # by hand: 2 x 4 x 8 = 64 MACs, then 10 x 4 x 8 = 320 MACs: one group per call, summing to the module's
    assert sorted(entry.macs for entry in explanation.ops) == [64, 320]
    assert explanation.macs == sum(entry.total_macs for entry in explanation.ops) == 384
    assert len({cost.name for cost in estimate.nodes}) == len(estimate.nodes)
