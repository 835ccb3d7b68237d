"""The HTML page says what its numbers are: which passes a card holds, which passes were counted apart
from the model's training flag, whether anything was measured; and the roofline's labels stay
readable (checked on the page as Chromium lays it out).
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fxflops
from fxflops.cli.main import main
from fxflops.report.html import to_html
from fxflops.report.roofline import roofline_svg
from tests.test_html import needs_browser, run_chromium


class CausalAttention(nn.Module):
    """Causal SDPA over a projection, so the page has attention read dense and effective."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x).view(1, 2, 16, 4)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)


def _subtitle(page: str) -> str:
    return html.unescape(re.search(r'<p class="sub">(.*?)</p>', page).group(1))


def _cards(page: str) -> dict[str, str]:
    found = re.findall(r'<div class="value">(.*?)</div><div class="label">(.*?)</div>', page)
    return {html.unescape(label): html.unescape(value) for value, label in found}


def test_header_names_the_passes_counted_apart_from_the_training_flag():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1)).eval()
    backward = fxflops.estimate(model, (torch.randn(2, 8),), backward=True)
    sub = _subtitle(to_html(backward))
    assert "counts the forward + backward" in sub and "model in eval mode" in sub
    assert "mode eval" not in sub  # it read as if the backward had not been counted
    forward = _subtitle(to_html(fxflops.estimate(model, (torch.randn(2, 8),))))
    assert "counts the forward ·" in forward and "backward" not in forward


def test_attention_card_says_it_holds_both_passes_beside_the_forward_cards():
    x = torch.randn(1, 16, 8)
    backward = fxflops.estimate(CausalAttention(), (x,), backward=True)
    cards = _cards(to_html(backward))
    assert "fwd FLOPs" in cards
    (label,) = [label for label in cards if label.startswith("attention FLOPs")]
    assert label == "attention FLOPs (fwd + bwd), dense / effective (causal)"
    totals = backward.attention_totals()
    # the card's numbers are both passes': the forward alone is 1 * 2 * 16 * 16 * (4 + 4) * 2 = 8,192 dense
    assert totals.dense_flops > 8192
    cautions = re.search(r'<section class="cautions">(.*?)</section>', to_html(backward), re.S).group(1)
    assert "attention FLOPs (fwd + bwd): " in html.unescape(cautions)
    forward = _cards(to_html(fxflops.estimate(CausalAttention(), (x,))))
    assert "attention FLOPs, dense / effective (causal)" in forward
    assert forward["attention FLOPs, dense / effective (causal)"].startswith("8.19 K / ")


def test_roofline_legend_speaks_of_measurements_only_when_something_was_measured():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    estimate = fxflops.estimate(model, (torch.randn(4, 16),))
    svg = roofline_svg(estimate, estimate.predict(peak_flops=1e12, bandwidth=1e11))
    assert "measured" not in svg.replace("nothing measured", "")
    assert "hollow: predicted FLOP/s (nothing measured)" in svg and "FLOP/s (predicted)</text>" in svg
    profile = fxflops.profile(model, (torch.randn(4, 16),), steps=2, warm_up=1)
    svg = roofline_svg(profile, profile.predict(peak_flops=1e12, bandwidth=1e11))
    assert "hollow: predicted FLOP/s, filled: measured" in svg and "FLOP/s (measured, else predicted)" in svg


# Every text of the roofline as the browser lays it out, and every leader line with the label it leads to.
BOXES = """
<script>
(function () {
  var svg = document.querySelector("#roofline svg");
  var texts = Array.prototype.map.call(svg.querySelectorAll("text"), function (t) {
    var b = t.getBBox(); return [t.textContent, b.x, b.y, b.x + b.width, b.y + b.height]; });
  var leaders = Array.prototype.map.call(svg.querySelectorAll('line[stroke-width="0.8"]'), function (l) {
    return [l.nextElementSibling.textContent].concat(
      ["x1", "y1", "x2", "y2"].map(function (k) { return Number(l.getAttribute(k)); })); });
  document.body.setAttribute("data-boxes", JSON.stringify({texts: texts, leaders: leaders}));
}());
</script>
"""


def _clashes(texts: list, leaders: list) -> list[str]:
    """Texts drawn over each other, and leader lines through a text other than their own label."""
    found = []
    # the y axis' title is rotated: getBBox gives its unrotated box, so it is left out here
    flat = [t for t in texts if not t[0].startswith("FLOP/s (")]
    for index, (name, x0, y0, x1, y1) in enumerate(flat):
        for other, a0, b0, a1, b1 in flat[index + 1:]:
            if min(x1, a1) - max(x0, a0) > 1 and min(y1, b1) - max(y0, b0) > 1:
                found.append(f"{name!r} over {other!r}")
    for own, x1, y1, x2, y2 in leaders:
        for name, a0, b0, a1, b1 in flat:
            if name != own and any(a0 + 1 < x1 + (x2 - x1) * i / 200 < a1 - 1 and b0 + 1 < y1 + (y2 - y1) * i / 200 < b1 - 1
                                   for i in range(201)):
                found.append(f"the leader of {own!r} through {name!r}")
    return found


@needs_browser
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_gpt2_roofline_labels_clear_each_other_in_chromium(tmp_path: Path, backward: bool):
    """GPT-2 on an H100: its 12 layers' c_attn and c_proj sit close to lm_head and the roof's label (the
    leader of `c_proj x12` ran through `c_attn x12` with --backward; `c_fc, c_proj x24` sat on the roof's
    label without)."""
    page = tmp_path / "gpt2.html"
    args = ["hf:gpt2", "--device", "H100 SXM", "--format", "html", "--output", str(page), "--quiet"]
    assert main(args + (["--backward"] if backward else [])) == 0
    driven = tmp_path / "driven.html"
    driven.write_text(page.read_text(encoding="utf-8").replace("</body>", BOXES + "</body>"), encoding="utf-8")
    done = run_chromium("--dump-dom", url=driven.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(html.unescape(re.search(r'data-boxes="(.*?)"', done.stdout).group(1)))
    labels = [text[0] for text in record["texts"] if text[0].endswith(" x12") or text[0] == "lm_head"]
    assert "transformer.h.*.attn.c_attn x12" in labels and "transformer.h.*.attn.c_proj x12" in labels
    assert _clashes(record["texts"], record["leaders"]) == []
