"""A sweep never returns a count estimate() would refuse (issue 37, review): a rule's count that is no
non-negative integer at a point raises estimate()'s RuleEvaluationError there from at(), points() and
grid(); a mask whose kept pairs depend on its values is refused under effective attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxflops
from fxflops.rules import RuleEvaluationError
from fxflops.sweeps import sweep
from fxflops.sweeps.core import SweepCaptureError


def _rule(tmp_path, macs: str):
    path = tmp_path / "mine.toml"
    path.write_text(f"[[rule]]\nname = 'mine'\nops = ['aten.linear']\nmacs = '{macs}'\nflops = 'macs'\n")
    return path


def _linear_sweep(rules):
    return sweep(nn.Linear(6, 5), (torch.randn(3, 4, 6),), dims={"b": 0, "t": 1}, rules=rules)


def test_float_count_raises_where_estimate_does(tmp_path):
    rules = [_rule(tmp_path, "numel(out) * 1.5")]  # 1.5 * 5 * b * t: not an integer where b * t is odd
    swept = _linear_sweep(rules)
    with pytest.raises(RuleEvaluationError):
        fxflops.estimate(nn.Linear(6, 5), (torch.randn(1, 1, 6),), rules=rules)
    with pytest.raises(RuleEvaluationError, match=r"rule 'mine': 'macs' failed on aten\.linear\.default in module "
                       r"'\(root\)': its formula gave 7\.5 \(a float\).*at b=1, t=1"):
        swept.at(b=1, t=1)
    assert swept.at(b=2, t=1).total_macs == 15  # 1.5 * 5 * 2, an integer: counted
    with pytest.raises(RuleEvaluationError, match="at b=1, t=3"):
        list(swept.points({"b": [2, 1], "t": [3]}))
    with pytest.raises(RuleEvaluationError, match="7.5 .*at b=1, t=1"):
        swept.grid(b=[2, 1], t=[1])
    assert swept.grid(b=[2, 4], t=[1])["macs"].tolist() == [[15], [30]]


def test_explicit_int_is_a_count(tmp_path):
    rules = [_rule(tmp_path, "int(numel(out) * 1.5)")]  # the user rounds: int(7.5) = 7, as estimate() counts
    assert _linear_sweep(rules).at(b=1, t=1).total_macs == 7


def test_negative_count_raises_where_estimate_does(tmp_path):
    rules = [_rule(tmp_path, "input.shape[0] - 4")]  # b - 4: negative below b = 4
    swept = _linear_sweep(rules)
    with pytest.raises(RuleEvaluationError, match=r"-2, a negative count.*at b=2, t=4"):
        swept.at(b=2)
    assert swept.at(b=5).total_macs == 1
    assert swept.grid(b=[5, 6])["macs"].tolist() == [1, 2]
    with pytest.raises(RuleEvaluationError, match=r"-1, a negative count.*at b=3, t=4"):
        swept.grid(b=[5, 3])
    with pytest.raises(RuleEvaluationError, match="at b=2, t=4"):
        swept.table({"b": [2]})


def test_ordinary_sweep_has_no_checks():
    swept = _linear_sweep(None)
    assert swept.at(b=1, t=1).total_macs == 30  # 1 * 1 * 6 * 5
    assert swept.pieces[0].checks() == []


class _DataMask(nn.Module):
    def forward(self, x):
        q = x.view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()  # built from data
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def test_value_mask_refused_under_effective_attention():
    with pytest.raises(SweepCaptureError, match=r"aten\.scaled_dot_product_attention\.default in the root module "
                       r"has a mask whose kept .* attention='dense'.*estimate\(\) at each point"):
        sweep(_DataMask(), (torch.randn(2, 5, 8),), dims={"b": 0, "t": 1}, attention="effective")
    # dense: every pair, QK^T and AV each b * heads * t * t * head_dim = 2 * 2 * 5 * 5 * 4
    dense = sweep(_DataMask(), (torch.randn(2, 5, 8),), dims={"b": 0, "t": 1})
    assert dense.at(b=2, t=5).total_macs == 800


def test_causal_flag_still_swept_under_effective_attention():
    class Causal(nn.Module):
        def forward(self, x):
            q = x.view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    swept = sweep(Causal(), (torch.randn(2, 5, 8),), dims={"b": 0, "t": 1}, attention="effective")
    # kept pairs t * (t + 1) / 2 = 15 per (batch, head): 2 * 2 * 15 * 4 for each of QK^T and AV
    assert swept.at(b=2, t=5).total_macs == 480
