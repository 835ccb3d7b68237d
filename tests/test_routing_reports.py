"""What a count assumed is in every report (issue 39): the routing assumption (balanced, worst, given counts) and a
size counted at its bound appear in the text report, the JSON and the HTML, and changing the routing changes
the count and the words with it. Exact numbers by hand (tests/test_input_values.py's RoutedExperts)."""

from __future__ import annotations

import html
import json

import pytest
import torch
from torch import nn

from tests.test_input_values import ROUTER, RoutedExperts, expert_flops, quietly


def _reports(result) -> dict[str, str]:
    return {"text": result.print(as_string=True), "json": json.dumps(result.to_dict(), ensure_ascii=False),
            "html": html.unescape(result.to_html())}  # (its text as a browser shows it)


@pytest.mark.parametrize("routing, rows, words", [
    (None, 4 * 8, "balanced routing (tokens·top_k/experts tokens per expert)"),
    ("worst", 2 * 8, "worst-case routing (every token to the same top-k experts)"),
    ([6, 4, 1, 1], 4 * 8, "the given per-expert token counts [6, 4, 1, 1]"),
    ([0, 0, 6, 6], 2 * 8, "the given per-expert token counts [0, 0, 6, 6]"),
], ids=["balanced", "worst", "counts-spread", "counts-two"])
def test_each_routing_assumption_sets_the_count_and_every_report_says_which(routing, rows, words):
    with torch.device("meta"):
        model = RoutedExperts(grouped=True)  # grouped mm pads each expert's rows to 8: routing moves the count
    result = quietly(model, input_shape=(1, 6, 16), conventions="torch", routing=routing)
    assert result.total_flops == ROUTER + expert_flops(rows)
    for name, report in _reports(result).items():
        assert words in report, name
        assert "routing='balanced', 'worst' or per-expert token counts changes it" in report, name
    spread = "worst-case routing (every token to the same top-k experts) counts"
    assert any(caution.startswith(spread) for caution in result.cautions) == (routing is None)  # the default's


def test_the_default_routing_reports_the_worst_case_spread_in_every_report():
    with torch.device("meta"):
        model = RoutedExperts(grouped=True)
    result = quietly(model, input_shape=(1, 6, 16), conventions="torch")
    balanced, worst = ROUTER + expert_flops(4 * 8), ROUTER + expert_flops(2 * 8)
    spread = f"counts {worst:,} FLOPs, {(worst - balanced) / balanced:+.1%} against balanced routing's {balanced:,}"
    for name, report in _reports(result).items():
        assert spread in report, name


class WeightMask(nn.Module):
    """nonzero over a weight-derived tensor: the size it makes is data nothing given determines."""

    def __init__(self) -> None:
        super().__init__()
        self.score, self.head = nn.Linear(8, 1), nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = torch.nonzero(self.score(x).squeeze(-1) > 0).squeeze(-1)
        return self.head(x[kept])


def test_a_size_counted_at_its_bound_is_stated_in_every_report():
    with torch.device("meta"):
        model = WeightMask()
    result = quietly(model, input_shape=(10, 8), conventions="torch", method="eager")
    assert result.total_flops == 2 * 10 * 8 * 1 + 2 * 10 * 8 * 8  # the bound: all 10 rows kept
    for name, report in _reports(result).items():
        assert "counted at its bound 10 (at most every element nonzero)" in report, name
