"""Tied weights: a parameter several modules hold counts once, at its first owner (in definition order,
as model.named_parameters() names it), and every report names it at the others (issue 35, item 13).

The oracle for totals is torch itself: sum(p.numel() for p in model.parameters()) holds each tied
parameter once. Per-module numbers are worked out by hand.
"""

from __future__ import annotations

import csv
import io
import json
import re

import torch
from torch import nn

import fxflops
from fxflops.report import from_json, module_table
from fxflops.report.html import to_html

V, D = 10, 4  # vocabulary and width


class TiedLM(nn.Module):
    """An embedding, a block, and a head whose weight is the embedding's (as GPT-2's lm_head)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.block = nn.Linear(D, D)
        self.head = nn.Linear(D, V)  # its bias stays its own
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.emb(ids)))


class Wrapped(nn.Module):
    """The tied head one level down, so its wrapper leaves the weight out too."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = TiedLM()
        self.out = nn.Sequential()
        self.out.add_module("head", self.lm.head)  # the same module again: an alias, not a tie
        self.extra = nn.Module()
        self.extra.proj = nn.Linear(D, V, bias=False)
        self.extra.proj.weight = self.lm.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.lm.block(self.lm.emb(ids))
        return self.lm.head(hidden) + self.extra.proj(hidden)


# By hand: emb V*D = 40; block D*D + D = 20; head: its bias V = 10 (the weight is emb's). Total 70.
EMB, BLOCK, HEAD = V * D, D * D + D, V
TOTAL = EMB + BLOCK + HEAD


def ids() -> torch.Tensor:
    return torch.zeros(2, 3, dtype=torch.long)


def test_a_tied_weight_counts_once_at_its_first_owner_and_the_rows_add_up():
    model = TiedLM()
    estimate = fxflops.estimate(model, (ids(),))
    assert estimate.total_params == sum(p.numel() for p in model.parameters()) == TOTAL
    params = {name: stats.params for name, stats in estimate.modules.items()}
    assert params == {"": TOTAL, "emb": EMB, "block": BLOCK, "head": HEAD}
    assert sum(params[name] for name in ("emb", "block", "head")) == TOTAL  # rows add up to 100%
    assert estimate.modules["head"].shared == {"weight": "emb.weight"}
    assert all(not estimate.modules[name].shared for name in ("", "emb", "block"))


def test_the_wrapper_of_a_tied_module_names_it_too_and_a_module_alias_is_not_a_tie():
    model = Wrapped()
    estimate = fxflops.estimate(model, (ids(),))
    assert estimate.total_params == sum(p.numel() for p in model.parameters()) == TOTAL
    modules = estimate.modules
    assert modules["lm"].params == TOTAL and not modules["lm"].shared  # emb and head both under it
    assert modules["lm.head"].shared == {"weight": "lm.emb.weight"}
    assert modules["extra"].params == 0 and modules["extra"].shared == {"proj.weight": "lm.emb.weight"}
    assert modules["extra.proj"].shared == {"weight": "lm.emb.weight"}
    assert "out.head" not in modules  # the head registered twice is one module, by its first name
    assert modules["out"].params == 0 and not modules["out"].shared


def test_every_report_marks_the_tied_weight():
    estimate = fxflops.estimate(TiedLM(), (ids(),))
    text = estimate.print(as_string=True)
    (head_line,) = [line for line in text.splitlines() if line.strip().startswith("(head):")]
    # 10 / 70 = 14.29% of the params, and where the weight it leaves out counts
    assert f"Linear({HEAD}, 14.29% Params" in head_line and "tied: weight = emb.weight" in head_line
    assert "counts once, at its first owner" in text
    table = module_table(estimate)
    assert "tied params (counted at)" in table
    (head_row,) = [row for row in table.splitlines() if row.startswith("| head ")]
    assert "weight = emb.weight" in head_row and "14.29%" in head_row
    record = json.loads(estimate.to_json())
    shared = {module["name"]: module["shared"] for module in record["modules"]}
    assert shared == {"": {}, "emb": {}, "block": {}, "head": {"weight": "emb.weight"}}
    assert from_json(estimate.to_json()).modules["head"].shared == {"weight": "emb.weight"}
    rows = {row["name"]: row for row in csv.DictReader(io.StringIO(estimate.to_csv()))}
    assert rows["head"]["shared"] == "weight=emb.weight" and rows["head"]["params"] == str(HEAD)
    assert rows["emb"]["shared"] == ""
    page = to_html(estimate)
    assert "tied params (counted at)" in page and ">weight = emb.weight</td>" in page
    data = json.loads(re.search(r'id="fxflops-data">(.*?)</script>', page, re.S).group(1))
    head = next(group for group in data["groups"] if group["name"] == "head")
    assert ["tied params", "weight = emb.weight (counted there)"] in head["info"]


def test_untied_models_show_no_tied_column():
    estimate = fxflops.estimate(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), (torch.randn(2, 4),))
    assert "tied" not in estimate.print(as_string=True) and "tied" not in module_table(estimate)
    assert "tied params" not in to_html(estimate)


def test_gpt2_lm_head_counts_no_params_of_its_own():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=8)
    model = GPT2LMHeadModel(config).eval()
    estimate = fxflops.estimate(model, (torch.zeros(1, 4, dtype=torch.long),))
    assert estimate.total_params == sum(p.numel() for p in model.parameters())
    modules = estimate.modules
    assert modules["transformer.wte"].params == 50 * 16
    assert modules["lm_head"].params == 0  # GPT-2's head has no bias: it was 31.02% beside wte's 31.02%
    assert modules["lm_head"].shared == {"weight": "transformer.wte.weight"}
    assert modules["transformer"].params + modules["lm_head"].params == estimate.total_params
