"""The default capture counts the code path eager execution runs, not the one export traces.

Hybrid linear-attention models (qwen3_next, olmo_hybrid) solve a triangular system in eager mode and,
under `is_torchdynamo_exporting()`, a forward substitution plus two matmuls instead: export counts a
path that never runs. The oracle is FlopCounterMode over a real forward (the eager path), given the
triangular solve's count, which it has no formula for.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from torch import nn

import fxflops
from tests.models import ValueDependent
from tests.oracle import TRSM_COUNTS, oracle_flops

tf = pytest.importorskip("transformers")


class BranchesOnExporting(nn.Module):
    """Eager: one 8x8 linear; under export or compile: the same plus a second, 8x16 one."""

    def __init__(self, flag) -> None:
        super().__init__()
        self.flag = flag
        self.eager = nn.Linear(8, 8, bias=False)
        self.other = nn.Linear(8, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.eager(x)
        if self.flag():
            return self.other(y)
        return y


@pytest.mark.parametrize("flag", [torch.compiler.is_exporting, torch.compiler.is_compiling],
                         ids=["is_exporting", "is_compiling"])
def test_model_branching_on_export_or_compile_is_counted_on_its_eager_branch(flag):
    model, x = BranchesOnExporting(flag), torch.randn(4, 8)
    result = fxflops.estimate(model, (x,))
    assert result.method == "eager"
    assert result.total_macs == 4 * 8 * 8  # the eager branch: x @ W^T, 4 rows of 8x8
    assert result.modules["other"].calls == 0
    exported = fxflops.estimate(model, (x,), method="export")
    assert exported.total_macs == 4 * 8 * 8 + 4 * 8 * 16  # export runs the other branch too


def _hybrid(kind: str) -> nn.Module:
    torch.manual_seed(0)
    common = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=1000)
    if kind == "qwen3_next":  # every 4th layer full attention, the rest gated delta-net; MoE MLPs
        config = tf.Qwen3NextConfig(**common, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                                    linear_key_head_dim=16, linear_value_head_dim=16, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    else:
        config = tf.OlmoHybridConfig(**common, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return tf.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("kind", ["qwen3_next", "olmo_hybrid"])
def test_hybrid_linear_attention_counts_the_eager_path_exactly(kind):
    model = _hybrid(kind)
    inputs = {"input_ids": torch.randint(0, 1000, (2, 16))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fxflops.estimate(model, kwargs=inputs, conventions="torch")
        exported = fxflops.estimate(model, kwargs=inputs, conventions="torch", method="export")
    assert result.method == "eager" and result.unknown == []
    assert result.by_rule["triangular_solve"].count > 0  # the eager branch ran
    # the oracle runs the experts as plain matmuls (grouped_mm hides them from it) on the same weights
    eager_experts = copy.deepcopy(model)
    if hasattr(eager_experts, "set_experts_implementation"):
        eager_experts.set_experts_implementation("eager")
    assert result.total_flops == oracle_flops(eager_experts, kwargs=inputs, custom_mapping=TRSM_COUNTS)
    assert "triangular_solve" not in exported.by_rule
    assert exported.total_flops > result.total_flops  # export counts the forward substitution instead


def test_reports_say_which_path_was_counted_and_whether_the_model_ran():
    static = fxflops.estimate(nn.Linear(4, 4), (torch.randn(2, 4),))
    text = static.print(as_string=True)
    assert "Estimate Summary (static, nothing run)" in text
    assert "counted path:" in text and "fake tensors" in text
    assert "fake tensors" in static.to_dict()["counted"]

    ran = fxflops.estimate(ValueDependent(), (torch.ones(2, 4),))
    assert ran.method == "trace"
    text = ran.print(as_string=True)
    assert "the model ran once, on its real inputs" in text and "static, nothing run" not in text
    assert "depend on input values" in ran.to_dict()["counted"]


def test_reports_show_the_dtype_and_train_or_eval_mode_that_were_counted():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).to(torch.bfloat16)
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    trained = fxflops.estimate(model.train(), (x,))
    evaluated = fxflops.estimate(model.eval(), (x,))
    assert (trained.dtype, trained.training, evaluated.training) == ("bfloat16", True, False)
    text = trained.print(as_string=True)
    assert "dtype:" in text and "bfloat16" in text and "mode:" in text and "train" in text
    assert "eval" in evaluated.print(as_string=True)
    record = evaluated.to_dict()
    assert (record["dtype"], record["training"]) == ("bfloat16", False)
    # batch norm over 2 x 4 elements: batch statistics and affine in training (5 per element), affine
    # with running statistics in eval (2 per element)
    assert trained.total_flops - evaluated.total_flops == (5 - 2) * 2 * 4


def _with_defaults(forward):
    """A functools.wraps decorator whose wrapper takes (*args, **kwargs), as transformers' do."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        kwargs.setdefault("scale", 2.0)
        return forward(self, *args, **kwargs)

    return wrapper


class Decorated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)
        self.extra = nn.Linear(8, 4)

    @_with_defaults
    def forward(self, x, mask=None, scale=None, **kwargs):
        out = self.proj(x) * scale
        return out if mask is None else out + self.extra(mask)


@pytest.mark.parametrize("method", ["eager", "export", "symbolic"])
def test_a_decorated_forward_gets_its_arguments_in_place(method):
    # torch.fx reads the inner signature but used to call the (*args, **kwargs) wrapper positionally,
    # so `mask` (None) landed in the wrapper's kwargs. By hand: one Linear(8, 4) on 2 rows, 64 MACs;
    # FLOPs 2 x 64 + 8 (bias) + 8 (the scale's multiply)
    result = fxflops.estimate(Decorated(), (torch.randn(2, 8),), method=method)
    assert (result.total_macs, result.total_flops) == (64, 2 * 64 + 8 + 8)
