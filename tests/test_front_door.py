"""The command line's front door (issue 21): suggestions for near-miss names, AMD and TPU parts with their
datasheet peaks, --peak-flops/--bandwidth, the [hf] extra, Ctrl-C while importing, factories that
call .cuda() without a GPU, and the CPU-only install in the README."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest
import torch

import fxflops
from fxflops.device import peaks
from fxflops.cli.examples import lenet5
from tests.test_cli import run_main

ROOT = Path(__file__).resolve().parent.parent
T = 1e12


# ------------------------------------------------------------------------------ did you mean


@pytest.mark.parametrize("name, suggested", [
    ("gpt2", "did you mean hf:gpt2 or gpt2-small?"),
    ("resnet50", "did you mean torchvision:resnet50?"),
    ("llama", "did you mean hf:llama?"),
    ("lenet", "did you mean lenet5?"),
])
def test_a_bare_name_suggests_the_form_it_has(capsys, name, suggested):
    code, out, err = run_main(capsys, name)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and suggested in err


def test_a_misspelt_hf_config_field_gets_a_suggestion(capsys):
    code, _, err = run_main(capsys, "hf:gpt2", "--set", "n_layers=1")
    assert code == 2 and "GPT2Config has no such field; did you mean 'n_layer'" in err


# --------------------------------------------------------------------------- devices and peaks


def test_amd_instinct_peaks_follow_from_their_clocks():
    # dense matrix rate = compute units x peak engine clock x FLOPs per CU per clock (CDNA 2: 1024 fp16,
    # 256 fp32; CDNA 3: 2048 fp16, 4096 fp8; CDNA 4: 4096 fp16, 8192 fp8), rounded as the datasheets print
    def rate(cus, ghz, per_clock):
        return round(cus * ghz * 1e9 * per_clock / 1e11) * 1e11

    mi250x, mi300x, mi325x, mi355x = (peaks.named(n) for n in ("MI250X", "MI300X", "MI325X", "MI355X"))
    assert mi250x.flops["bf16"] == pytest.approx(rate(220, 1.7, 1024)) and mi250x.flops["fp32"] == pytest.approx(rate(220, 1.7, 256))
    assert mi250x.bandwidth == pytest.approx(8192 / 8 * 3.2e9)  # HBM2e: 8192-bit bus at 3.2 Gb/s
    for row in (mi300x, mi325x):
        assert row.flops["bf16"] == pytest.approx(rate(304, 2.1, 2048))
        assert row.flops["fp8"] == pytest.approx(rate(304, 2.1, 4096), rel=1e-4)
    assert (mi300x.bandwidth, mi325x.bandwidth) == (5.3e12, 6.0e12)
    assert mi355x.flops["bf16"] == pytest.approx(rate(256, 2.4, 4096))
    assert mi355x.flops["fp8"] == pytest.approx(rate(256, 2.4, 8192))
    assert "tf32" not in mi355x.flops and mi355x.bandwidth == 8e12


def test_tpus_give_their_bf16_peak_and_bandwidth():
    expected = {"TPU v4": (275 * T, 1200e9), "TPU v5e": (197 * T, 819e9), "TPU v5p": (459 * T, 2765e9),
                "TPU v6e Trillium": (918 * T, 1640e9)}
    for name, (bf16, bandwidth) in expected.items():
        row = peaks.named(name)
        assert (row.flops, row.bandwidth) == ({"bf16": bf16}, bandwidth)
    assert peaks.named("v5e").label == "TPU v5e" and peaks.named("trillium").label == "TPU v6e Trillium"
    with pytest.raises(ValueError, match="could be any of TPU v4, TPU v5e"):
        peaks.named("TPU")


def test_device_mi300x_is_that_part(capsys):
    # issue 21: --device MI300X suggested "RTX 3090"
    code, out, err = run_main(capsys, "lenet5", "--device", "MI300X", "--format", "json")
    assert code == 0, err
    prediction = json.loads(out)["prediction"]
    assert (prediction["device"], prediction["peak_flops"], prediction["bandwidth"]) == ("MI300X", 163.4 * T, 5.3e12)


def test_peak_flops_and_bandwidth_flags_match_predict(capsys):
    code, out, err = run_main(capsys, "fxflops.cli.examples:lenet5", "--input-shape", "2,1,32,32",
                              "--peak-flops", "1.5T", "--bandwidth", "2e11", "--format", "json")
    assert code == 0, err
    prediction = json.loads(out)["prediction"]
    assert (prediction["device"], prediction["peak_flops"], prediction["bandwidth"]) == ("given", 1.5e12, 2e11)
    with torch.device("meta"):
        lenet = lenet5()
    expected = fxflops.estimate(lenet, (torch.zeros(2, 1, 32, 32, device="meta"),)).predict(peak_flops=1.5e12,
                                                                                           bandwidth=2e11)
    assert prediction["latency"] == pytest.approx(expected.latency, rel=1e-12)
    # with --device, a flag overrides that part's number only
    code, out, _ = run_main(capsys, "lenet5", "--device", "MI300X", "--bandwidth", "1T", "--format", "json")
    prediction = json.loads(out)["prediction"]
    assert (prediction["peak_flops"], prediction["bandwidth"]) == (163.4 * T, 1e12)
    code, _, err = run_main(capsys, "lenet5", "--peak-flops", "1T")
    assert code == 2 and "give --bandwidth too" in err
    code, _, err = run_main(capsys, "lenet5", "--device", "B300")
    assert code == 2 and "give --peak-flops and --bandwidth" in err


# ------------------------------------------------------------------------------- the [hf] extra


def test_hf_extra_brings_transformers_and_the_error_names_it(capsys, monkeypatch):
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(requirement.startswith("transformers") for requirement in extras["hf"])
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed: its import fails
    code, _, err = run_main(capsys, "hf:gpt2")
    assert code == 2 and 'pip install "fxflops[hf]"' in err
    readme = (ROOT / "README.md").read_text()
    assert 'pip install "fxflops[hf]"' in readme or '".[hf]"' in readme


# ------------------------------------------------------------------ Ctrl-C while importing, .cuda()


def test_the_console_entry_point_imports_nothing_heavy():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["fxflops"] == "fxflops.cli.console:main"
    code = "import sys, fxflops.cli.console; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.stdout.strip() == "False", result.stderr


def test_ctrl_c_while_importing_exits_130_quietly(capsys, monkeypatch):
    from fxflops.cli import console

    class Interrupted(types.ModuleType):
        def __getattr__(self, name):
            raise KeyboardInterrupt  # what Ctrl-C raises inside `from fxflops.cli.main import main`

    monkeypatch.setitem(sys.modules, "fxflops.cli.main", Interrupted("fxflops.cli.main"))
    assert console.main() == 130
    assert capsys.readouterr() == ("", "")


# The console script's own code, sent a real SIGINT (by the OS, through Python's signal handler) while
# torch's C extension loads: a finder asked for torch._C signals the process, then lets the import go on.
_INTERRUPTED_IMPORT = """
import os, signal, sys

# as in a terminal: a test run started in the background (nohup ... &) inherits SIGINT ignored
signal.signal(signal.SIGINT, signal.default_int_handler)

class InterruptTorchC:
    def find_spec(self, name, path=None, target=None):
        if name == "torch._C":
            print("SIGINT while importing torch._C", flush=True)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, InterruptTorchC())
from fxflops.cli.console import main
sys.exit(main())
"""


def test_ctrl_c_during_the_real_import_prints_no_traceback():
    child = subprocess.run([sys.executable, "-c", _INTERRUPTED_IMPORT, "lenet5"], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert child.stdout == "SIGINT while importing torch._C\n", (child.stdout, child.stderr)
    assert child.returncode == 130 and "Traceback" not in child.stderr, child.stderr


FACTORY_ON_CUDA = """
import torch
from torch import nn


def build():
    model = nn.Linear(8, 4).cuda()
    return model, torch.zeros(2, 8, device="cuda")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_a_factory_calling_cuda_without_a_gpu_says_what_to_change(capsys, tmp_path):
    (tmp_path / "gpu.py").write_text(FACTORY_ON_CUDA)
    code, _, err = run_main(capsys, f"{tmp_path}/gpu.py:build")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"{tmp_path}/gpu.py:build puts the model on CUDA ({tmp_path}/gpu.py:7: model = nn.Linear(8, 4).cuda())" in err
    assert "torch.device('meta')" in err and "no GPU" in err


# ------------------------------------------------------------------------------------- README


def test_readme_shows_the_cpu_only_torch_install_beside_the_unchanged_quick_start():
    readme = (ROOT / "README.md").read_text()
    quick_start = readme[readme.index("## Quick start"):]
    quick_start = quick_start[:quick_start.index("\n## ", 1)]
    assert 'pip install "torch==2.14.1" "torchvision==0.29.1" . && fxflops gpt2-small --seq-len 128' in quick_start
    assert 'pip install "torch==2.14.1" "torchvision==0.29.1" ".[test]" && python -m pytest -q' in quick_start
    assert "--index-url https://download.pytorch.org/whl/cpu" in quick_start
