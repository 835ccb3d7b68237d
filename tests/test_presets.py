"""Counting presets as data (rules/presets.toml): one definition each, families on every rule, user
rules and callables through the same presets, and the fvcore / ptflops presets equal to those tools."""

from __future__ import annotations

import contextlib
import inspect
import io
import tomllib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxflops
from fxflops.cli import parser as cli_parser
from fxflops.rules.presets import OTHER, PresetFileError, load_presets
from fxflops.rules import CONVENTIONS, FAMILIES, PRESET_TABLE, Rule, _shipped_entries, default_rules_dir
from tests.oracle import oracle_flops

PRESETS_TOML = default_rules_dir() / "presets.toml"


# --- the table ------------------------------------------------------------------------------


def test_preset_table_loads_and_is_the_one_list_of_conventions():
    data = tomllib.loads(PRESETS_TOML.read_text())
    assert CONVENTIONS == tuple(data["preset"]) == ("deepspeed", "torch", "fvcore", "ptflops", "ptflops-aten")
    assert fxflops.CONVENTIONS == CONVENTIONS
    assert FAMILIES == tuple(data["families"]) and OTHER in FAMILIES
    assert all(PRESET_TABLE.presets[name].doc for name in CONVENTIONS)


def test_cli_choices_are_the_table():
    action = next(a for a in cli_parser.build_parser()._actions if "--conventions" in a.option_strings)
    assert tuple(action.choices) == CONVENTIONS
    assert all(name in action.help for name in CONVENTIONS)


def test_every_shipped_rule_belongs_to_a_known_family():
    rules = [entry for entry in _shipped_entries() if isinstance(entry, Rule)]
    assert rules
    unassigned = [f"{rule.name} ({rule.source})" for rule in rules if rule.family not in FAMILIES or rule.family == OTHER]
    assert unassigned == []
    counted = {family for preset in PRESET_TABLE.presets.values() for family in preset.count} - {"*"}
    assert counted <= set(FAMILIES)


def _same(a: str, b: str) -> bool:
    return " ".join(a.split()) == " ".join(b.split())


def test_no_rule_repeats_what_a_preset_already_gives():
    # a rule's own presets.NAME formulas must change something: an uncounted family's zeros, the rule's
    # own formulas, or the preset's FLOPs-from-MACs formula written out again are all redundant
    redundant = []
    for rule in (entry for entry in _shipped_entries() if isinstance(entry, Rule)):
        for name, (macs, flops) in rule.presets.items():
            treatment = PRESET_TABLE.presets[name].treatment(rule.family)
            if treatment is None:
                same = _same(macs.source, "0") and _same(flops.source, "0")
            else:
                same_macs = _same(macs.source, rule.macs.source) and treatment.macs.source == "macs"
                same_flops = ((_same(flops.source, rule.flops.source) and treatment.flops.source == "flops")
                              or _same(flops.source, treatment.flops.source))
                same = same_macs and same_flops
            if same:
                redundant.append(f"{rule.name} ({rule.source}): presets.{name}")
    assert redundant == []


def test_unknown_preset_names_are_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="conventions must be one of deepspeed, torch, fvcore, ptflops, ptflops-aten; got 'flopth'"):
        fxflops.estimate(nn.Linear(4, 4), input_shape=(2, 4), conventions="flopth")
    with pytest.raises(ValueError, match="deepspeed, torch, fvcore, ptflops, ptflops-aten"):
        fxflops.annotate(torch.export.export(nn.Linear(4, 4), (torch.randn(2, 4),)), conventions="flopth")


def test_unknown_family_in_a_user_rule_is_refused_with_the_known_ones(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text("[[rule]]\nname = 'x'\nfamily = 'matmull'\nops = ['aten.mm']\nmacs = '1'\nflops = '1'\n")
    with pytest.raises(fxflops.RuleFileError, match="unknown family 'matmull' .*matmul, matvec"):
        fxflops.estimate(nn.Linear(4, 4), input_shape=(2, 4), rules=[path])
    path.write_text("family = 'nope'\n[[rule]]\nname = 'x'\nops = ['aten.mm']\nmacs = '1'\nflops = '1'\n")
    with pytest.raises(fxflops.RuleFileError, match="top-level 'family': unknown family 'nope'"):
        fxflops.estimate(nn.Linear(4, 4), input_shape=(2, 4), rules=[path])

    def cost(call):
        return 0, 0

    cost.family = "nope"
    with pytest.raises(fxflops.RuleFileError, match="unknown family 'nope'"):
        fxflops.estimate(nn.Linear(4, 4), input_shape=(2, 4), rules={"aten.linear": cost})


@pytest.mark.parametrize("text, problem", [
    ("[families]\nother = 'x'\n[preset.a]\ndoc = 'a'\ncount = { matmul = {} }\n", "unknown family 'matmul'"),
    ("[families]\nother = 'x'\n[preset.a]\ndoc = 'a'\ncount = { other = { flops = 'numel(out)' } }\n",
     "only macs, flops and extra"),
    ("[families]\nother = 'x'\n[preset.a]\ncount = { other = {} }\n", "missing 'doc'"),
    ("[families]\nm = 'x'\n[preset.a]\ndoc = 'a'\ncount = { m = {} }\n", "must list 'other'"),
    ("[families]\nother = 'x'\n[preset.a]\ndoc = 'a'\ncount = { other = {} }\nwhole_modules = 'torch.nn.GRU'\n",
     "'whole_modules' must be a list of dotted class names"),
])
def test_a_bad_preset_table_names_the_problem(tmp_path, text, problem):
    path = tmp_path / "presets.toml"
    path.write_text(text)
    with pytest.raises(PresetFileError, match=problem):
        load_presets(path)


# --- presets by hand ------------------------------------------------------------------------


class Mixed(nn.Module):
    """One op of most families: what each preset counts is worked out by hand below."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)  # (2,3,8,8) -> (2,4,8,8): 512 out, 512 * 27 MACs, 512 bias adds
        self.bn = nn.BatchNorm2d(4)  # eval, affine: 2 per element
        self.pool = nn.MaxPool2d(2)  # 512 in -> (2,4,4,4)
        self.up = nn.Upsample(scale_factor=2, mode="bilinear")  # -> (2,4,8,8): 4 per output element
        self.gap = nn.AdaptiveAvgPool2d(1)  # 512 in -> (2,4,1,1)
        self.ln = nn.LayerNorm(4)  # (2,4): 5 per element
        self.fc = nn.Linear(4, 6)  # (2,4) -> (2,6): 48 MACs, 12 bias adds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gap(self.up(self.pool(torch.relu(self.bn(self.conv(x))))))
        y = self.fc(self.ln(y.flatten(1))).view(2, 1, 2, 3)
        return F.scaled_dot_product_attention(y, y, y)  # B.H.Lq.Lk.(E+Ev) = 2*1*2*2*6 = 48 MACs


CONV, FC, SDPA = 512 * 3 * 9, 2 * 4 * 6, 2 * 1 * 2 * 2 * (3 + 3)
BN, UP, GAP, LN = 2 * 512, 4 * 512, 512, 5 * 8
BLIND = {"relu": 512, "maxpool": 512}


def _mixed() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return Mixed().eval(), (torch.randn(2, 3, 8, 8),)


def test_presets_count_what_the_table_says_by_hand():
    model, args = _mixed()
    torch_preset = fxflops.estimate(model, args, conventions="torch")
    assert (torch_preset.total_macs, torch_preset.total_flops) == (CONV + FC + SDPA, 2 * (CONV + FC + SDPA))
    fvcore = fxflops.estimate(model, args, conventions="fvcore")
    # one FLOP per MAC of conv and linear (no bias), the norms, bilinear upsampling and adaptive pooling
    assert fvcore.total_flops == CONV + FC + BN + UP + GAP + LN
    assert fvcore.total_macs == CONV + FC
    ptflops = fxflops.estimate(model, args, conventions="ptflops-aten")
    # MACs of conv and linear plus one per bias add; nothing else
    assert ptflops.total_macs == CONV + 512 + FC + 12
    assert ptflops.total_flops == 2 * ptflops.total_macs
    # ptflops' default (pytorch) backend: the modules' hooks (batch norm 2 per element, layer norm 1) and
    # the patched functions the pooling and upsampling modules call (each counted twice); torch.relu
    # here is counted once, as F.relu would be (ptflops does not patch torch.relu: an aten op is the same)
    pytorch = fxflops.estimate(model, args, conventions="ptflops")
    assert pytorch.total_macs == CONV + 512 + BN + 512 + 2 * 512 + 2 * 512 + 2 * 512 + 8 + FC + 12
    assert pytorch.total_flops == 2 * pytorch.total_macs
    deepspeed = fxflops.estimate(model, args)
    assert deepspeed.total_flops == 2 * (CONV + FC + SDPA) + 512 + 12 + BN + UP + GAP + LN + sum(BLIND.values())
    assert torch_preset.total_flops == oracle_flops(model, args)


# --- user rules and callables go through the same presets -----------------------------------


class LinearHardswish(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.hardswish(self.fc(x))


HARDSWISH_TOML = "[[rule]]\nname = 'hardswish'\nops = ['aten.hardswish']\nmacs = '0'\nflops = '7 * numel(out)'\n"


def test_user_toml_rule_without_a_family_matches_flop_counter_mode_under_torch(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(HARDSWISH_TOML)
    model, x = LinearHardswish().eval(), torch.randn(4, 8)
    assert oracle_flops(model, (x,)) == 2 * 4 * 8 * 4 == 256  # FlopCounterMode: the linear only
    assert fxflops.estimate(model, (x,), conventions="torch", rules=[path]).total_flops == 256
    ours = fxflops.estimate(model, (x,), rules=[path])
    assert ours.by_rule["hardswish"].flops == 7 * 16  # and deepspeed counts the user's formula


def test_callable_without_a_family_matches_flop_counter_mode_under_torch():
    def hardswish(call):
        return 0, 7 * call.out.numel()

    model, x = LinearHardswish().eval(), torch.randn(4, 8)
    assert fxflops.estimate(model, (x,), conventions="torch", rules={"aten.hardswish": hardswish}).total_flops == 256
    assert fxflops.estimate(model, (x,), rules={"aten.hardswish": hardswish}).by_rule["user:hardswish"].flops == 7 * 16


def test_callables_receive_the_convention_and_its_family_treatment():
    seen = []

    def linear(call):  # replaces our linear rule: its family (matmul) is taken from ours
        seen.append(call.conventions)
        macs = call.out.numel() * call.names["weight"].shape[-1]
        return macs, 2 * macs + call.out.numel()

    model, x = nn.Linear(8, 4), torch.randn(4, 8)
    totals = {name: fxflops.estimate(model, (x,), conventions=name, rules={"aten.linear": linear})
              for name in CONVENTIONS}
    assert seen == list(CONVENTIONS)
    macs = 4 * 4 * 8
    assert {name: (t.total_macs, t.total_flops) for name, t in totals.items()} == {
        "deepspeed": (macs, 2 * macs + 16), "torch": (macs, 2 * macs), "fvcore": (macs, macs),
        "ptflops": (macs + 16, 2 * (macs + 16)), "ptflops-aten": (macs + 16, 2 * (macs + 16))}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


def test_a_callable_names_its_family_for_a_module_counted_whole():
    def block(call):  # a whole module: no rule of ours to take a family from
        macs = call.out.numel() * 8
        return macs, 3 * macs

    x = torch.randn(4, 8)
    assert fxflops.estimate(Block(), (x,), conventions="torch", rules={Block: block}).total_flops == 0  # "other"
    block.family = "matmul"
    counted = fxflops.estimate(Block(), (x,), conventions="torch", rules={Block: block})
    assert (counted.total_macs, counted.total_flops) == (4 * 8 * 8, 2 * 4 * 8 * 8)


def test_a_user_rule_file_may_give_its_rules_a_family(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text("family = 'matmul'\n[[rule]]\nname = 'cdist'\nops = ['aten._cdist_forward']\n"
                    "macs = 'args[0].shape[0] * args[1].shape[0] * args[0].shape[1]'\nflops = '3 * macs'\n")

    class Dist(nn.Module):
        def forward(self, a, b):
            return torch.cdist(a, b)

    a, b = torch.randn(5, 3), torch.randn(6, 3)
    assert fxflops.estimate(Dist(), (a, b), conventions="fvcore", rules=[path]).total_flops == 5 * 6 * 3
    assert fxflops.estimate(Dist(), (a, b), rules=[path]).total_flops == 3 * 5 * 6 * 3


# --- fvcore and ptflops themselves ----------------------------------------------------------


def _torchvision(name: str, **kwargs):
    torchvision = pytest.importorskip("torchvision")

    def make():
        torch.manual_seed(0)
        return getattr(torchvision.models, name)(**kwargs).eval(), torch.randn(1, 3, 64, 64)

    return make


def _transformers(kind: str):
    def make():
        tf = pytest.importorskip("transformers")
        torch.manual_seed(0)
        if kind == "bert":
            config = tf.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                   intermediate_size=128, vocab_size=1000)
            model = tf.BertModel(config)
        else:  # no cache: fvcore's jit trace takes tuples, lists and tensors as outputs, not a DynamicCache
            config = tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, bos_token_id=0,
                                   eos_token_id=0, use_cache=False)
            model = tf.GPT2LMHeadModel(config)
        return model.eval(), torch.randint(0, 1000, (2, 16))

    return make


MODELS = {
    "resnet18": _torchvision("resnet18"),
    "mobilenet_v2": _torchvision("mobilenet_v2"),  # depthwise convolutions
    "mobilenet_v3_small": _torchvision("mobilenet_v3_small"),  # hardswish, squeeze-excitation pooling
    "efficientnet_b0": _torchvision("efficientnet_b0"),
    "vit_b_16": _torchvision("vit_b_16", image_size=64),  # nn.MultiheadAttention, SDPA
    "bert": _transformers("bert"),
    "gpt2": _transformers("gpt2"),
    "mixed": lambda: (_mixed()[0], _mixed()[1][0]),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_fvcore_preset_equals_flop_count_analysis(name):
    flop_count = pytest.importorskip("fvcore.nn").FlopCountAnalysis
    model, x = MODELS[name]()
    ours = fxflops.estimate(model, (x,), conventions="fvcore").total_flops
    try:
        analysis = flop_count(model, (x,))
        analysis.unsupported_ops_warnings(False)
        analysis.uncalled_modules_warnings(False)
        expected = analysis.total()
    except Exception as error:  # the tool's own failure, not ours
        pytest.skip(f"fvcore cannot count {name}: {type(error).__name__}: {error}")
    assert ours == expected


@pytest.mark.parametrize("preset, backend", [("ptflops", "pytorch"), ("ptflops-aten", "aten")])
@pytest.mark.parametrize("name", list(MODELS))
def test_ptflops_presets_equal_get_model_complexity_info(name, preset, backend):
    # `ptflops` is what get_model_complexity_info gives by default (backend="pytorch", batch 1)
    ptflops = pytest.importorskip("ptflops")
    model, x = MODELS[name]()
    if name != "mixed":  # ptflops' pytorch backend divides its module hooks' counts (not its functions') by the batch
        x = x[:1]
    ours = fxflops.estimate(model, (x,), conventions=preset).total_macs  # first: ptflops leaves hooks on the model
    inputs = {"input_ids": x} if x.dtype == torch.long else x
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        macs, _ = ptflops.get_model_complexity_info(model, tuple(x.shape), input_constructor=lambda _: inputs,
                                                    backend=backend, as_strings=False, print_per_layer_stat=False)
    if macs is None:  # ptflops prints its exception and returns None
        pytest.skip(f"ptflops cannot count {name}: {' '.join(printed.getvalue().split())[-300:]}")
    if name in PYTORCH_BACKEND_DIFFERS and backend == "pytorch":
        assert ours != macs, PYTORCH_BACKEND_DIFFERS[name]
        return
    assert ours == macs


def _module_zoo():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.LeakyReLU(), nn.MaxPool2d(2), nn.GroupNorm(2, 8), nn.SiLU(),
        nn.Upsample(scale_factor=2), nn.ConvTranspose2d(8, 4, 3), nn.ReLU6(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(4, 16), nn.LayerNorm(16), nn.GELU(), nn.ELU(), nn.Linear(16, 5), nn.Softmax(-1))
    return model.eval(), torch.randn(1, 3, 16, 16)


@pytest.mark.parametrize("make", [_module_zoo], ids=["module_zoo"])
def test_ptflops_pytorch_backend_counts_hooks_and_patched_functions(make):
    # modules whose forward calls a function ptflops patches (Upsample -> F.interpolate, MaxPool2d,
    # AdaptiveAvgPool2d, GELU, ELU) count twice; LeakyReLU, ReLU6 (F.hardtanh) and SiLU once
    ptflops = pytest.importorskip("ptflops")
    model, x = make()
    ours = fxflops.estimate(model, (x,), conventions="ptflops").total_macs
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        macs, _ = ptflops.get_model_complexity_info(model, tuple(x.shape[1:]), input_constructor=lambda _: x,
                                                    as_strings=False, print_per_layer_stat=False)
    assert ours == macs


# where the pytorch backend's hooks see what an aten op cannot tell apart (said in the README)
PYTORCH_BACKEND_DIFFERS = {
    "mixed": "batch 2: ptflops divides its module hooks' counts by the batch, not its functions'",
}


def test_ptflops_default_is_the_pytorch_backend_on_resnet50():
    # the number a ptflops user sees by default: get_model_complexity_info(resnet50, (3, 224, 224))
    ptflops = pytest.importorskip("ptflops")
    torchvision = pytest.importorskip("torchvision")
    with torch.device("meta"):
        model = torchvision.models.resnet50().eval()
    ours = fxflops.estimate(model, input_shape=(1, 3, 224, 224), conventions="ptflops")
    aten = fxflops.estimate(model, input_shape=(1, 3, 224, 224), conventions="ptflops-aten")
    # measured with ptflops 0.7.5 on a real ResNet-50: pytorch backend (the default), then backend="aten"
    assert (ours.total_macs, aten.total_macs) == (4_132_436_968, 4_089_185_256)
    # and the installed ptflops' own default is that backend
    default = inspect.signature(ptflops.get_model_complexity_info).parameters["backend"].default
    assert str(getattr(default, "value", default)) == "pytorch"


@pytest.mark.parametrize("method", ["eager", "symbolic"])
def test_fvcore_grid_sample_and_interpolate_under_every_method(method):
    fvcore = pytest.importorskip("fvcore.nn", reason="fvcore is not installed (pip install fvcore)")

    class Sampler(nn.Module):
        def forward(self, x, grid):
            up = nn.functional.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
            return nn.functional.grid_sample(up, grid, align_corners=False)

    x, grid = torch.randn(1, 3, 4, 4), torch.rand(1, 5, 5, 2) * 2 - 1
    analysis = fvcore.FlopCountAnalysis(Sampler(), (x, grid))
    analysis.unsupported_ops_warnings(False)
    # fvcore: bilinear upsampling 4 per output element (3 x 8 x 8), grid_sampler 4 per output element (3 x 5 x 5)
    assert analysis.total() == 4 * 3 * 8 * 8 + 4 * 3 * 5 * 5
    ours = fxflops.estimate(Sampler(), (x, grid), method=method, conventions="fvcore")
    assert ours.total_flops == analysis.total()
