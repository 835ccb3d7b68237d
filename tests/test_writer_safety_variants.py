"""Issue 35 item 11, variants: a module name holding a newline cannot forge a line of the text report or a
row of a table, and every bidirectional control of the Trojan Source list (CVE-2021-42574), the Arabic
letter mark included, is shown as an escape."""

from __future__ import annotations

import csv
import io
import warnings

import torch

import fxflops
from fxflops.report.formats import csv_cell, printable
from fxflops.report.tables import tables

FORGED = "fc: Linear(0, 0,00% Params, 0 MACs"


class Forger(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.add_module(f"a\n{FORGED}", torch.nn.Linear(4, 4))
        self.add_module("\u061cb", torch.nn.Tanh())

    def forward(self, x):
        return self._modules["\u061cb"](self._modules[f"a\n{FORGED}"](x))


def _estimate() -> fxflops.Estimate:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxflops.estimate(Forger(), (torch.randn(2, 4),))


def test_a_newline_in_a_module_name_forges_no_line_of_the_text_report_or_the_tables():
    estimate = _estimate()
    text = estimate.print(as_string=True)
    assert not any(line.lstrip().startswith(FORGED) for line in text.splitlines())
    assert f"(a\\x0a{FORGED}): Linear(" in text
    table = tables(estimate)
    assert not any(line.lstrip("| ").startswith(FORGED) for line in table.splitlines())
    assert f"a\\x0a{FORGED}" in table


def test_the_arabic_letter_mark_is_escaped_like_the_other_bidirectional_controls():
    for control in "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069":
        assert printable(f"x{control}y") == f"x\\u{ord(control):04x}y"
    estimate = _estimate()
    assert "\u061c" not in estimate.print(as_string=True)
    names = [row[0] for row in csv.reader(io.StringIO(estimate.to_csv()))]
    assert "\\u061cb" in names and csv_cell("\u061c=1+1") == "\\u061c=1+1"
