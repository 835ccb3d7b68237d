"""Errors users can hit say what failed, where, and what to try."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fxflops


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        if y.sum() > 0:  # data-dependent branch
            return y * 2
        return y


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_data_dependent_control_flow_on_meta_lists_every_attempt_and_the_user_line():
    with torch.device("meta"):
        model = DataDependent()
    with pytest.raises(fxflops.CaptureError) as caught:
        fxflops.estimate(model, input_shape=(2, 4))
    message = str(caught.value)
    assert "DataDependent" in message
    assert [a.method for a in caught.value.attempts] == ["eager", "export", "symbolic", "trace"]
    assert "depend on tensor values" in caught.value.attempts[0].reason
    assert "data-dependent" in message
    assert "test_errors.py:21" in message  # the `if y.sum() > 0` line
    assert "needs real weights" in message
    assert "method='trace'" in message


def test_data_dependent_control_flow_with_real_weights_falls_back_to_trace():
    model, x = DataDependent(), torch.randn(2, 4)
    result = fxflops.estimate(model, (x,))
    assert result.method == "trace"
    assert [method for method, _ in result.attempts] == ["eager", "export", "symbolic"]
    assert result.total_macs == 2 * 4 * 4


def test_wrong_input_shape_names_module_and_op():
    with pytest.raises(fxflops.CaptureError) as caught:
        fxflops.estimate(TwoLayer(), input_shape=(2, 5))
    export_attempt = caught.value.attempts[0]
    assert export_attempt.module == "body.0"
    assert export_attempt.op is not None and "aten." in export_attempt.op
    assert "in module 'body.0'" in str(caught.value)
    assert "check the input shapes" in str(caught.value)


def test_unknown_op_is_reported_and_warned_never_silently_zero():
    class Unknown(nn.Module):
        def forward(self, x):
            return torch.linalg.matrix_exp(x).sum() + torch.linalg.matrix_exp(x).sum()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fxflops.estimate(Unknown(), input_shape=(3, 3))
    # matrix_exp has no rule: its cost depends on the matrix norm, not on shapes (rules/linalg.toml)
    assert [(u.op, u.count, u.modules) for u in result.unknown] == [("aten.linalg_matrix_exp.default", 2, ("",))]
    assert result.node_status_counts()["unknown"] == 2
    messages = [str(w.message) for w in caught if issubclass(w.category, fxflops.UnknownOpsWarning)]
    assert len(messages) == 1 and "aten.linalg_matrix_exp.default x2" in messages[0]


def test_bad_method_and_conventions():
    with pytest.raises(ValueError, match="method must be one of"):
        fxflops.estimate(TwoLayer(), input_shape=(2, 8), method="jit")
    with pytest.raises(ValueError, match="conventions must be one of"):
        fxflops.estimate(TwoLayer(), input_shape=(2, 8), conventions="mlperf")


def test_bad_input_shape():
    with pytest.raises(ValueError, match="input_shape"):
        fxflops.estimate(TwoLayer(), input_shape=(2, "8"))
    with pytest.raises(ValueError, match="either input_shape or args"):
        fxflops.estimate(TwoLayer(), (torch.randn(2, 8),), input_shape=(2, 8))


@pytest.mark.parametrize(
    "text, problem",
    [
        ("[[rule]]\nname = 'x'\nops = ['aten.mm']\nmacs = '1'\n", "missing 'flops' formula"),
        ("[[rule]]\nname = 'x'\nops = ['aten.mm']\nmacs = '__import__(\"os\")'\nflops = '1'\n", "call to '__import__' is not allowed"),
        ("[[rule]]\nname = 'x'\nops = ['aten.mm']\nmacs = 'a.__class__'\nflops = '1'\n", "attribute '.__class__' is not allowed"),
        ("[[rule]]\nname = 'x'\nops = ['aten.mm']\nmacs = '1 +'\nflops = '1'\n", "does not parse"),
        ("[[rule]]\nname = 'x'\nops = 'aten.mm'\nmacs = '1'\nflops = '1'\n", "'ops' must be a non-empty list"),
        ("[[rule]]\nname = 'x'\nops = ['mm']\nmacs = '1'\nflops = '1'\n", "not a qualified name"),
        ("[[rule]]\nname = 'x'\nops = ['aten.mm']\nmacs = '1'\nflops = '1'\ncost = 3\n", "unknown keys ['cost']"),
        ("[[rule]]\nname = 'x'\nops = ['aten.mm']\nmacs = '1'\nflops = '1'\npresets.mlperf = { flops = '0' }\n", "unknown preset 'mlperf'"),
        ("[[rule]\nname = 'x'\n", "not valid TOML"),
    ],
)
def test_bad_rule_file_names_file_rule_and_problem(tmp_path, text, problem):
    path = tmp_path / "mine.toml"
    path.write_text(text)
    with pytest.raises(fxflops.RuleFileError) as caught:
        fxflops.estimate(TwoLayer(), input_shape=(2, 8), rules=[path])
    assert str(path) in str(caught.value)
    assert problem in str(caught.value)
    if "TOML" not in problem:
        assert "rule 'x'" in str(caught.value) or "rule #1" in str(caught.value)


def test_missing_rule_file():
    with pytest.raises(fxflops.RuleFileError, match="does not exist"):
        fxflops.estimate(TwoLayer(), input_shape=(2, 8), rules=["/nonexistent/rules.toml"])


def test_formula_failing_on_a_real_call_names_rule_op_and_module(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[[rule]]\nname = 'broken_linear'\nops = ['aten.linear']\nmacs = 'weight.shape[7]'\nflops = '0'\n")
    with pytest.raises(fxflops.RuleEvaluationError) as caught:
        fxflops.estimate(TwoLayer(), input_shape=(2, 8), rules=[path])
    message = str(caught.value)
    assert "broken_linear" in message and str(path) in message
    assert "aten.linear.default" in message and "module 'body.0'" in message


class Positions(nn.Module):
    """Looks up positions from arange, shifted and strided, or a slice of a positions buffer."""

    def __init__(self, rows: int, sliced: bool = False) -> None:
        super().__init__()
        self.table = nn.Embedding(rows, 4)
        self.sliced = sliced
        self.register_buffer("ids", torch.arange(64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sliced:  # a slice keeps some values: not followed, so never a caution
            positions = self.ids[: x.shape[1]]
        else:
            positions = (torch.arange(2, 2 + 3 * x.shape[1], 3) + 1).unsqueeze(0).expand(x.shape[0], -1)
        return x + self.table(positions)


def test_positions_past_an_embedding_table_are_a_caution():
    x = torch.zeros(2, 4, 4, device="meta")  # positions 3, 6, 9, 12
    with pytest.warns(fxflops.CautionWarning, match=r"module 'table' \(Embedding\) looks up rows 3\.\.12 of a table of 12"):
        fxflops.estimate(Positions(12).to("meta"), (x,))
    # the symbolic method records torch-level calls: F.embedding's arguments the other way round
    with pytest.warns(fxflops.CautionWarning, match="rows 3..12 of a table of 12"):
        fxflops.estimate(Positions(12).to("meta"), (x,), method="symbolic")
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxflops.CautionWarning)
        assert fxflops.estimate(Positions(13).to("meta"), (x,)).cautions == []
        assert fxflops.estimate(Positions(3, sliced=True).to("meta"), (x,)).cautions == []


def test_failures_on_tensor_values_are_told_from_others():
    """Only a failure on a tensor's value can be fixed by a run on real inputs (the CLI's fallback to trace
    on made-up inputs asks this); torch's own exceptions count, also wrapped as another's cause."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    from fxflops.capture.diagnosis import DataDependentSizes, reads_values

    op = torch.ops.aten.nonzero.default
    wrapped = RuntimeError("export failed")
    wrapped.__cause__ = DynamicOutputShapeException(op)
    assert reads_values(DataDependentOutputException(op)) and reads_values(wrapped)
    assert reads_values(DataDependentSizes("sizes from values"))
    assert not reads_values(RuntimeError("Expected tensor for argument #1 'indices' to have ... Long, Int"))
