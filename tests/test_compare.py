"""Estimate.compare / --compare: one capture under every preset, every difference attributed to a named
convention, and the real tools' own numbers equal to the presets that reproduce them."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torchvision

import fxflops
from fxflops.rules import CONVENTIONS, PRESET_TABLE

ROOT = Path(__file__).resolve().parents[1]


def quiet(function, *args, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return function(*args, **options)


class FirstOutput(torch.nn.Module):
    """A Hugging Face model returning its first output tensor, as fvcore (a JIT trace) needs."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids)[0]


def tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, bos_token_id=0,
                                     eos_token_id=0, use_cache=False)
    # batch 1: ptflops' pytorch backend divides its module hooks' counts (not its functions') by the batch
    return FirstOutput(transformers.GPT2LMHeadModel(config)).eval(), {"input_ids": torch.randint(0, 100, (1, 16))}


def tiny_bert():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                     intermediate_size=128, vocab_size=100)
    return FirstOutput(transformers.BertModel(config, add_pooling_layer=False)).eval(), {
        "input_ids": torch.randint(0, 100, (1, 16))}


def resnet50_bn_elements(size: int) -> int:
    """Elements entering ResNet-50's batch norms on a size x size image, from its architecture: the stem
    (64 channels at size/2), then stages of (blocks, width, side) where a block normalizes width, width
    and 4 x width channels, the first block's first norm before its stride, plus one downsample norm."""
    side = size // 2
    total = 64 * side * side
    side //= 2  # the max pool
    inputs = 64
    for stage, (blocks, width) in enumerate([(3, 64), (4, 128), (6, 256), (3, 512)]):
        out = side if stage == 0 else side // 2
        total += width * side * side + width * out * out + 4 * width * out * out  # first block, stride in conv2
        total += 4 * width * out * out  # its downsample's norm
        total += (blocks - 1) * (width + width + 4 * width) * out * out
        side, inputs = out, 4 * width
    return total


@pytest.fixture(scope="module")
def resnet50():
    model = torchvision.models.resnet50().eval()
    inputs = (torch.randn(1, 3, 64, 64),)
    estimate = quiet(fxflops.estimate, model, inputs)
    return model, inputs, estimate, estimate.compare()


def test_totals_equal_each_presets_own_estimate(resnet50):
    model, inputs, _, comparison = resnet50
    assert comparison.presets == CONVENTIONS  # every preset, the reference (deepspeed) first
    for name in comparison.presets:
        own = quiet(fxflops.estimate, model, inputs, conventions=name)
        assert comparison.totals[name] == (own.total_macs, own.total_flops), name
        for module in ("", "layer1", "layer4.2.conv3", "fc"):
            stats = own.modules[module]
            assert comparison.modules[module][name] == (stats.macs, stats.flops), (name, module)


def test_every_difference_is_attributed_to_a_named_convention(resnet50):
    comparison = resnet50[3]
    for name in comparison.presets:
        assert comparison.residue(name) == (0, 0), name
        for cause in comparison.causes[name]:
            assert "count this op differently" not in cause.convention
            assert cause.family in PRESET_TABLE.families
    torch_causes = {cause.family: cause for cause in comparison.causes["torch"]}
    assert "torch does not count norm" in torch_causes["norm"].convention
    # by hand: batch norm in eval is 2 FLOPs per element (affine), over all 53 BN inputs of ResNet-50 at 64x64
    assert torch_causes["norm"].calls == 53 and torch_causes["norm"].flops == -2 * resnet50_bn_elements(64)
    fvcore_conv = next(c for c in comparison.causes["fvcore"] if c.family == "conv")
    assert "FMA = 1 FLOP" in fvcore_conv.convention
    # fvcore counts one FLOP per MAC: the conv difference is exactly minus the MACs (+ the bias adds: none)
    conv_macs = sum(values["deepspeed"][0] for op, values in comparison.ops.items() if "conv" in op)
    assert fvcore_conv.flops == -conv_macs


def test_torch_preset_equals_flop_counter_mode_and_fvcore_ptflops_equal_theirs(resnet50):
    model, inputs, _, comparison = resnet50
    runs = {run.tool: run for run in comparison.run_tools(model, inputs)}
    assert runs["FlopCounterMode"].total == comparison.totals["torch"][1]
    assert runs["FlopCounterMode"].matches and not runs["FlopCounterMode"].blind_spots
    if "fvcore" in runs and runs["fvcore"].status == "ran":
        assert runs["fvcore"].total == comparison.totals["fvcore"][1]
    ptflops_runs = [run for run in runs.values() if run.tool.startswith("ptflops")]
    assert ptflops_runs, "a preset reproduces ptflops"
    for run in ptflops_runs:
        assert run.status == "ran", run.status
        assert run.total == comparison.totals[run.preset][0], run.tool
    text = str(comparison)
    assert "FlopCounterMode" in text and "equal" in text


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_bert], ids=["gpt2", "bert"])
def test_transformers_presets_equal_the_tools_with_math_attention(build):
    model, kwargs = build()
    comparison = quiet(fxflops.estimate, model, kwargs=kwargs).compare()
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            runs = {run.tool: run for run in comparison.run_tools(model, (), kwargs)}
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    assert runs["FlopCounterMode"].total == comparison.totals["torch"][1]
    assert runs["fvcore"].status == "ran" and runs["fvcore"].total == comparison.totals["fvcore"][1]
    # ptflops as its users run it, on torch's default attention kernel (under the math kernel its aten
    # backend sees the bmm inside attention, which its convention, mm/bmm/addmm/conv, then counts)
    for run in comparison.run_tools(model, (), kwargs):
        if run.tool.startswith("ptflops"):
            assert run.status == "ran" and run.total == run.predicted, (run.tool, run.total, run.predicted)
    for name in comparison.presets:
        assert comparison.residue(name) == (0, 0)


def test_flop_counter_modes_blind_spot_is_flagged_at_the_attention_modules():
    model, kwargs = tiny_gpt2()
    comparison = quiet(fxflops.estimate, model, kwargs=kwargs).compare(["deepspeed", "torch"])
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):  # the CPU's fused kernel
        [run] = [r for r in comparison.run_tools(model, (), kwargs) if r.tool == "FlopCounterMode"]
    # by hand: per layer QK^T and PV, 2 x B*H*L*L*E = 2 x 1*4*16*16*16 MACs, x2 FLOPs; the tool sees none
    sdpa_flops = 2 * 2 * (1 * 4 * 16 * 16 * 16)
    assert run.total == comparison.totals["torch"][1] - 2 * sdpa_flops
    assert [spot.module for spot in run.blind_spots] == ["model.transformer.h.0.attn", "model.transformer.h.1.attn"]
    assert all(spot.ops == ("aten.scaled_dot_product_attention.default",) for spot in run.blind_spots)
    assert all(spot.convention_flops - spot.tool_flops == sdpa_flops for spot in run.blind_spots)


def test_user_rules_are_compared_too(tmp_path):
    rule = tmp_path / "median.toml"
    rule.write_text('[[rule]]\nname = "median"\nops = ["aten.median.dim"]\nmacs = "0"\nflops = "numel(self)"\n')

    class Median(torch.nn.Module):
        def forward(self, x):
            return torch.median(x, 0)[0]

    comparison = quiet(fxflops.estimate, Median(), (torch.randn(4, 5),), rules=[str(rule)]).compare()
    assert comparison.totals["deepspeed"] == (0, 20)
    [cause] = comparison.causes["torch"]
    assert cause.family == "other" and "torch does not count other" in cause.convention and cause.flops == -20


def test_json_and_cli(tmp_path):
    data = json.loads(json.dumps(quiet(fxflops.estimate, torch.nn.Linear(4, 3), (torch.randn(2, 4),)).compare().to_dict()))
    assert data["totals"]["deepspeed"] == {"macs": 24, "flops": 54}
    assert data["totals"]["fvcore"] == {"macs": 24, "flops": 24}
    run = subprocess.run([sys.executable, "-m", "fxflops.cli", "lenet5", "--compare", "--format", "json", "-q"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    cli = json.loads(run.stdout)
    assert set(cli["totals"]) == set(CONVENTIONS) and all(
        not (cli["totals"][p]["flops"] - cli["totals"]["deepspeed"]["flops"]
             - sum(c["flops"] for c in cli["causes"][p])) for p in CONVENTIONS)


def test_deepspeeds_own_number_and_its_blind_spots():
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (it is not in the test extra: its sdist "
                                            "builds against torch); the other tools are checked above")
    model = torchvision.models.resnet18().eval()
    inputs = (torch.randn(1, 3, 64, 64),)
    comparison = quiet(fxflops.estimate, model, inputs).compare(["deepspeed"])
    [run] = quiet(comparison.run_tools, model, inputs)
    assert run.tool == "DeepSpeed" and run.status == "ran"
    # DeepSpeed patches torch functions, not Python's operators, and counts no bias in linear: it misses
    # each block's residual `out += identity` (one FLOP per element, by hand: 2 blocks x 64x16x16 in
    # layer1, 2 x 128x8x8, 2 x 256x4x4, 2 x 512x2x2) and fc's 1000 bias adds
    residual = 2 * (64 * 16 * 16 + 128 * 8 * 8 + 256 * 4 * 4 + 512 * 2 * 2)
    assert run.total == comparison.totals["deepspeed"][1] - residual - 1000
    spots = {spot.module: spot for spot in run.blind_spots}
    assert set(spots) == {f"layer{i}.{j}" for i in range(1, 5) for j in range(2)} | {"fc"}
    assert spots["layer1.0"].ops == ("aten.add_.Tensor",) and spots["fc"].ops == ("aten.linear.default",)


def test_attention_dense_and_effective_is_a_named_difference():
    class Causal(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    q = torch.randn(2, 4, 8, 16)
    estimate = quiet(fxflops.estimate, Causal(), (q, q, q))
    comparison = estimate.compare(["deepspeed", "torch"])
    column = "deepspeed (effective attention)"
    # by hand: causal over 8 positions keeps 1 + 2 + ... + 8 = 36 pairs per head; x B*H = 8, x (E + Ev) = 32
    assert comparison.totals[column] == (8 * 36 * 32, 2 * 8 * 36 * 32)
    [cause] = comparison.causes[column]
    assert "attention counted effective" in cause.convention and "causal" in cause.convention
    assert cause.macs == 8 * 36 * 32 - 8 * 8 * 8 * 32 and comparison.residue(column) == (0, 0)
    entry = estimate.explain("").ops[0]
    assert entry.formulas["effective_macs"] == "kept_pairs * (query.shape[-1] + value.shape[-1])"
    assert entry.attention == ("attention (causal): dense 16,384 MACs, 32,768 FLOPs; "
                               "effective 9,216 MACs, 18,432 FLOPs")


def test_tools_leave_the_model_as_found_and_count_the_forward_of_a_backward_estimate():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 5)).train()
    x = torch.randn(2, 3, 8, 8)
    before = {name: buffer.clone() for name, buffer in model.named_buffers()}
    estimate = quiet(fxflops.estimate, model, (x,), backward=True)
    comparison = estimate.compare()
    runs = {run.tool: run for run in comparison.run_tools(model, (x,))}
    # FlopCounterMode runs one forward: it equals the torch preset's forward share, with no blind spot
    assert runs["FlopCounterMode"].total == comparison.forward["torch"][1] == quiet(
        fxflops.estimate, model, (x,), conventions="torch").total_flops
    assert runs["FlopCounterMode"].matches and not runs["FlopCounterMode"].blind_spots
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules()), "ptflops' hooks removed"
    assert all(torch.equal(before[name], buffer) for name, buffer in model.named_buffers()), "running stats as found"


def test_effective_attention_comparisons_say_why_no_tool_ran():
    class Causal(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    q = torch.randn(1, 2, 4, 8)
    comparison = quiet(fxflops.estimate, Causal(), (q, q, q), attention="effective").compare(["deepspeed", "torch"])
    [run] = [r for r in comparison.run_tools(Causal(), (q, q, q)) if r.preset == "torch"]
    assert run.tool == "FlopCounterMode" and run.total is None and "attention='dense'" in run.status


def test_a_pickled_estimate_keeps_its_numbers_not_its_capture():
    import copy
    import pickle

    estimate = quiet(fxflops.estimate, torch.nn.Linear(4, 3), (torch.randn(2, 4),), method="symbolic")
    again = pickle.loads(pickle.dumps(estimate))
    assert again.total_flops == estimate.total_flops == 2 * 24 + 6 and again.source is None
    assert copy.deepcopy(estimate).source is None and estimate.source is not None
