"""`fxflops MODEL --compare --run-tools`: the command line builds its models on the meta device, so the
tools that run a real forward (fvcore, ptflops) get the model built again on the CPU with random weights
when it is small enough, or one line saying why not (issue 35, item 16).
"""

from __future__ import annotations

import json
import textwrap

import pytest

from fxflops import tool_runs
from fxflops.cli import main as cli

# LeNet5 by hand (1x32x32): conv MACs 6*28*28*25 + 16*10*10*6*25 + 120*16*25 = 405,600; linear MACs
# 120*84 + 84*10 = 10,920. Conv bias adds (one per output) 4,704 + 1,600 + 120 = 6,424, linear 84 + 10.
# Pooling inputs 6*28*28 + 16*10*10 = 6,304; softmax over 10.
CONV, LINEAR, CONV_BIAS, LINEAR_BIAS, POOLED, SOFTMAX = 405_600, 10_920, 6_424, 94, 6_304, 10
LENET5_PARAMS = 156 + 2_416 + 48_120 + 10_164 + 850  # 61,706


def tools_of(capsys, *args: str) -> dict[str, dict]:
    assert cli.main([*args, "--compare", "--run-tools", "--format", "json"]) == 0
    return {run["tool"]: run for run in json.loads(capsys.readouterr().out)["tools"]}


@pytest.mark.skipif(not {"fvcore", "ptflops"} <= set(tool_runs.real_tools_installed()), reason="needs fvcore and ptflops")
def test_a_small_model_is_built_real_for_the_tools_that_run_a_forward(capsys):
    runs = tools_of(capsys, "lenet5")
    assert runs["FlopCounterMode"]["total"] == 2 * (CONV + LINEAR)
    assert runs["fvcore"]["status"] == "ran" and runs["fvcore"]["total"] == CONV + LINEAR  # one per MAC
    # ptflops' pytorch backend: bias adds as MACs, 2 per pooled input element, the softmax's 10
    pytorch = runs["ptflops (pytorch backend)"]
    assert pytorch["status"] == "ran"
    assert pytorch["total"] == CONV + LINEAR + CONV_BIAS + LINEAR_BIAS + 2 * POOLED + SOFTMAX == 435_656
    aten = runs["ptflops (aten backend)"]
    assert aten["status"] == "ran" and aten["total"] == CONV + LINEAR + CONV_BIAS + LINEAR_BIAS
    assert all(run["matches"] for run in runs.values() if run["status"] == "ran")


@pytest.mark.skipif(not tool_runs.real_tools_installed(), reason="no tool that runs a real forward is installed")
def test_a_model_over_the_limit_says_why_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(tool_runs, "REAL_PARAMS_LIMIT", 1000)
    runs = tools_of(capsys, "lenet5")
    why = ("skipped: it runs a real forward, and --run-tools builds models of at most 1 k params with real "
           "weights (lenet5 has 61.71 k): run the tool from Python on a model you built")
    assert LENET5_PARAMS == 61_706
    real = [run for tool, run in runs.items() if tool.split()[0].lower() in tool_runs.real_tools_installed()]
    assert real and all(run["status"] == why for run in real)
    assert runs["FlopCounterMode"]["status"] == "ran"  # it counts on the meta device


@pytest.mark.skipif("fvcore" not in tool_runs.real_tools_installed(), reason="needs fvcore")
def test_a_factory_that_builds_on_meta_itself_is_named(capsys, tmp_path):
    source = tmp_path / "meta_factory.py"
    source.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def build():
            with torch.device("meta"):
                return nn.Linear(8, 4), (torch.zeros(2, 8, device="meta"),)
    """))
    runs = tools_of(capsys, f"{source}:build")
    assert runs["fvcore"]["status"] == (
        f"skipped: it runs a real forward, and {source}:build builds its model or inputs on the meta device "
        "itself; have it build them on the CPU")


def test_the_help_states_the_limit(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert tool_runs.REAL_PARAMS_LIMIT == 200_000_000
    assert "at most 200 M params" in " ".join(capsys.readouterr().out.split())
