"""Issue 35 item 11: names from the model never drive a terminal (escape sequences) or a spreadsheet
(formulas) through our text and CSV writers; numbers in machine-readable output stay numbers."""

from __future__ import annotations

import csv
import io
import re
import warnings

import torch

import fxflops
from fxflops.report.formats import csv_cell, printable
from fxflops.report.machine import to_csv
from fxflops.report.tables import tables

ESC = "\x1b"
RAW_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202e]")  # (tab and newline are layout)


class Evil(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.add_module("\x1b]0;pwned\x07title", torch.nn.Linear(4, 4))
        self.add_module("=HYPERLINK(\"http://x\")", torch.nn.Linear(4, 4))
        self.add_module("@SUM(1+1)", torch.nn.ReLU())

    def extra_repr(self) -> str:
        return "-2+3 \x1b[2J\u202eevil"

    def forward(self, x):
        return self._modules["@SUM(1+1)"](self._modules["=HYPERLINK(\"http://x\")"](self._modules["\x1b]0;pwned\x07title"](x)))


Evil.__name__ = Evil.__qualname__ = "Evil\x1b[31m"


def _estimate():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxflops.estimate(Evil(), input_shape=(2, 4))


def test_printable_escapes_controls_and_keeps_layout():
    assert printable("a\x1b[31mb\nc\u202ed\x9b") == "a\\x1b[31mb\nc\\u202ed\\x9b"
    assert printable("tab\there", keep="\n\t") == "tab\there"
    assert printable("new\nline", keep="") == "new\\x0aline"


def test_csv_cells_starting_like_formulas_are_neutralised_and_numbers_stay_numbers():
    for formula in ("=1+1", "+1", "-1+2", "@SUM(A1)", "\tx", "\rx"):
        assert csv_cell(formula).startswith("'"), formula
    assert csv_cell("layer.0") == "layer.0"
    assert csv_cell(-5) == -5 and csv_cell(2.5) == 2.5 and csv_cell(0) == 0  # numbers, negative ones too


def test_text_reports_carry_no_raw_control_characters():
    result = _estimate()
    for report in (result.print(as_string=True), tables(result), str(result.explain(""))):
        assert not RAW_CONTROLS.search(report), report
        assert "\\x1b" in report


def test_csv_neutralises_formulas_and_escapes_but_keeps_raw_integers():
    result = _estimate()
    document = to_csv(result)
    assert not RAW_CONTROLS.search(document)
    rows = {row["name"]: row for row in csv.DictReader(io.StringIO(document))}
    assert set(rows) == {"", "\\x1b]0;pwned\\x07title", "'=HYPERLINK(\"http://x\")", "'@SUM(1+1)"}
    assert rows[""]["type"] == "Evil\\x1b[31m"
    assert rows[""]["extra_repr"] == "'-2+3 \\x1b[2J\\u202eevil"
    linear = rows["'=HYPERLINK(\"http://x\")"]
    assert linear["macs"] == str(2 * 4 * 4) and linear["params"] == str(4 * 4 + 4)  # digits, no quote


def test_the_cli_writes_no_escape_sequence(tmp_path, capsys):
    from fxflops.cli.main import main

    factory = tmp_path / "evil_model.py"
    factory.write_text(
        "import torch\n"
        "class Bad(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return x.long().mul_(0.5)\n"  # a caution that names this module
        "class Evil(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.add_module('\\x1b[31mred', Bad())\n"
        "    def forward(self, x):\n"
        "        return self._modules['\\x1b[31mred'](x)\n"
        "def build():\n"
        "    return Evil()\n")
    shown = {}
    for fmt in ("text", "table", "csv", "json"):
        assert main([f"{factory}:build", "--input-shape", "2,4", "--format", fmt]) == 0
        shown[fmt] = capsys.readouterr()
        assert ESC not in shown[fmt].out and ESC not in shown[fmt].err, fmt
    assert "\\x1b[31mred" in shown["text"].out and "module '\\x1b[31mred' (Bad)" in shown["text"].err
    assert "\\u001b[31mred" in shown["json"].out  # JSON's own escape
