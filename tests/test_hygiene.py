"""Issue 35 items 14, 18 and 19: warnings point at the user's line; errors keep their type, place and the
closest spelling; the source line of a built-in example is its own; a caution is shown once on a terminal;
strict counting (--fail-on-unknown / strict=True) refuses ops no rule counts."""

from __future__ import annotations

import io
import sys
import warnings

import pytest
import torch

import fxflops
from fxflops.cli.main import main


class InPlaceOnLong(torch.nn.Module):
    def forward(self, x):
        return x.long().mul_(0.5)  # a caution: a real kernel refuses it


class Kth(torch.nn.Module):
    def forward(self, x):
        return torch.kthvalue(x, 1)[0]  # aten.kthvalue: no rule counts it


class Holder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Kth()

    def forward(self, x):
        return self.inner(x)


class Positions(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(4, 2)

    def forward(self, x):
        return self.table(torch.arange(x.shape[1]))


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- item 14: the warnings point at the user's line ---------------------------------------------------


def test_caution_and_unknown_warnings_point_at_the_callers_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        fxflops.estimate(InPlaceOnLong(), input_shape=(2, 3))
        fxflops.estimate(Holder(), input_shape=(2, 3))
    found = {w.category: (w.filename, w.lineno) for w in caught
             if w.category in (fxflops.CautionWarning, fxflops.UnknownOpsWarning)}
    assert found == {fxflops.CautionWarning: (__file__, line), fxflops.UnknownOpsWarning: (__file__, line + 1)}


def test_a_sweeps_warnings_point_at_the_callers_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        swept = fxflops.sweep(Positions(), torch.zeros(1, 2), dims={"seq": 1})
        line = sys._getframe().f_lineno + 1
        swept.at(seq=8)  # past the table's 4 rows
    (caution,) = [w for w in caught if w.category is fxflops.CautionWarning]
    assert (caution.filename, caution.lineno) == (__file__, line)


# --- item 18: errors that keep their type, place and the closest spelling -------------------------------


def test_a_factorys_exception_keeps_its_type_and_line(tmp_path, capsys):
    factory = tmp_path / "broken_model.py"
    factory.write_text("import torch\n\ndef build():\n    layers = {}\n    return layers['encoder']\n")
    code, _, err = _run(capsys, f"{factory}:build", "--input-shape", "2,8")
    assert code == 1
    assert err == (f"fxflops: error: the factory {factory}:build raised KeyError: 'encoder' "
                   f"(at {factory}:5: return layers['encoder'])\n")


@pytest.mark.parametrize(("argv", "guess"), [
    (["--conventoins", "torch"], "did you mean '--conventions'?"),
    (["--formt=json"], "did you mean '--format'?"),
    (["--conventions", "torhc"], "did you mean 'torch'?"),
    (["--attention", "efective"], "did you mean 'effective'?"),
])
def test_a_misspelt_cli_option_or_value_gets_the_closest(capsys, argv, guess):
    with pytest.raises(SystemExit) as exited:
        main(["lenet5", *argv])
    assert exited.value.code == 2 and guess in capsys.readouterr().err


@pytest.mark.parametrize(("options", "error", "guess"), [
    ({"convention": "torch"}, TypeError, "did you mean 'conventions'?"),
    ({"conventions": "deepspeeed"}, ValueError, "did you mean 'deepspeed'?"),
    ({"attention": "efective"}, ValueError, "did you mean 'effective'?"),
    ({"method": "eagre"}, ValueError, "did you mean 'eager'?"),
])
def test_a_misspelt_python_keyword_or_value_gets_the_closest(options, error, guess):
    with pytest.raises(error, match=guess.replace("?", r"\?")):
        fxflops.estimate(torch.nn.Linear(2, 2), input_shape=(1, 2), **options)


def test_explain_on_a_built_in_example_names_its_forward_not_the_console_script(capsys):
    from fxflops.cli import examples

    code, out, _ = _run(capsys, "lenet5", "--explain", "feature_extractor")
    assert code == 0
    sources = {line.strip() for line in out.splitlines() if line.strip().startswith("at File")}
    assert sources == {f'at File "{examples.__file__}", line {_line_of(examples.__file__, "x = self.feature_extractor(x)")}: '
                       "x = self.feature_extractor(x)"}


def _line_of(path: str, code: str) -> int:
    with open(path, encoding="utf-8") as handle:
        (number,) = [n for n, line in enumerate(handle, 1) if line.strip() == code]
    return number


def test_a_model_of_torch_modules_only_gets_no_made_up_source_line():
    est = fxflops.estimate(torch.nn.Sequential(torch.nn.Linear(2, 2)), input_shape=(1, 2))
    assert est.explain("0").ops[0].source is None  # not the line that called estimate()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_sweeps_caution_is_shown_once_on_a_terminal(tmp_path, monkeypatch):
    factory = tmp_path / "positions_model.py"
    factory.write_text("import torch\n\nclass Positions(torch.nn.Module):\n    def __init__(self):\n"
                       "        super().__init__()\n        self.table = torch.nn.Embedding(4, 2)\n"
                       "    def forward(self, x):\n        return self.table(torch.arange(x.shape[1]))\n\n"
                       "def build():\n    return Positions()\n")
    shown = {}
    for terminal in (True, False):
        out, err = (_Terminal(), _Terminal()) if terminal else (io.StringIO(), io.StringIO())
        monkeypatch.setattr(sys, "stdout", out)
        monkeypatch.setattr(sys, "stderr", err)
        assert main([f"{factory}:build", "--input-shape", "1,2", "--sweep", "seq[1]=2,8", "--quiet"]) == 0
        shown[terminal] = out.getvalue() + err.getvalue()
    assert shown[True].count("looks up rows") == 1  # the report's caution line only
    assert shown[False].count("looks up rows") == 2  # report and stderr are apart (a file, a pipe): both


# --- item 19: strict counting --------------------------------------------------------------------------


def test_strict_refuses_unknown_ops_naming_them_and_their_modules():
    with pytest.raises(fxflops.UnknownOpsError) as raised:
        fxflops.estimate(Holder(), input_shape=(2, 3), strict=True)
    assert [(u.op, u.count, u.modules) for u in raised.value.unknown] == [("aten.kthvalue.default", 1, ("inner",))]
    assert str(raised.value).startswith("1 op calls matched no rule and are not in the totals: "
                                        "aten.kthvalue.default x1 (in inner)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert fxflops.estimate(torch.nn.Linear(2, 3), input_shape=(1, 2), strict=True).total_macs == 6


def test_fail_on_unknown_on_the_command_line(tmp_path, capsys):
    factory = tmp_path / "kth_model.py"
    factory.write_text("import torch\n\nclass Kth(torch.nn.Module):\n    def forward(self, x):\n"
                       "        return torch.kthvalue(x, 1)[0]\n\ndef build():\n    return Kth()\n")
    code, out, err = _run(capsys, f"{factory}:build", "--input-shape", "2,3", "--fail-on-unknown")
    assert code == 1 and out == ""
    assert err.startswith("fxflops: error: 1 op calls matched no rule") and "aten.kthvalue.default x1 (in (root))" in err
    code, _, err = _run(capsys, f"{factory}:build", "--input-shape", "2,3", "--sweep", "b[0]=1,2", "--fail-on-unknown")
    assert code == 1 and "aten.kthvalue.default" in err
    assert _run(capsys, f"{factory}:build", "--input-shape", "2,3")[0] == 0  # without it: a report, as before
