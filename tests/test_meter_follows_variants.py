"""Issue 35, variants the first tests did not name: what changes a training step's count and must change the
meter's (forward hooks, pruning, a parameter resized in place, a module's class), and the options every
public entry point spells back. Oracles: FlopCounterMode on the real step (conventions="torch"), hand counts,
or estimate(backward=True) where the meter must equal it."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.utils.prune as prune
from torch import nn

import fxflops
from fxflops import FlopsMeter
from fxflops.timing.model_state import model_state
from tests.oracle import oracle_training_flops
from tests.test_meter_follows import quiet_estimate


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def test_a_forward_hook_added_and_removed_changes_the_count_as_flop_counter_mode_counts_it():
    model = mlp()
    x = torch.randn(5, 8)
    meter = FlopsMeter(model, x, conventions="torch", peak_flops=1e12)
    plain = meter.step(x, time=1.0).flops
    assert plain == sum(oracle_training_flops(model, (x,)))
    project = torch.randn(4, 32)
    handle = model[2].register_forward_hook(lambda module, args, out: out @ project)  # the hook's product counts
    hooked = meter.step(x, time=1.0)
    # by hand: the hook's (5, 4) @ (4, 32) forward, and its input gradient backward (project needs none)
    assert (hooked.fwd_flops, hooked.bwd_flops) == oracle_training_flops(model, (x,), loss=lambda out: out.sum())
    assert hooked.flops == plain + 2 * 5 * 4 * 32 * 2
    handle.remove()
    assert meter.step(x, time=1.0).flops == plain


def test_pruning_a_layer_changes_the_count_as_estimate_counts_it():
    model = mlp()
    x = torch.randn(5, 8)
    meter = FlopsMeter(model, x, peak_flops=1e12)
    plain = meter.step(x, time=1.0).flops
    prune.l1_unstructured(model[0], "weight", amount=0.5)  # weight = weight_orig * weight_mask, every forward
    pruned = meter.step(x, time=1.0).flops
    assert pruned == quiet_estimate(model, (x,), backward=True).total_flops
    # by hand: the mask's multiply, 16 * 8 elements forward, and its gradient's multiply backward
    assert pruned == plain + 2 * 16 * 8


def test_a_parameter_resized_in_place_changes_the_count_as_flop_counter_mode_counts_it():
    model = mlp()
    x = torch.randn(5, 8)
    meter = FlopsMeter(model, x, conventions="torch", peak_flops=1e12)
    meter.step(x, time=1.0)
    model[2].weight = nn.Parameter(torch.randn(40, 16))  # the head resized: same module, new parameters
    model[2].bias = nn.Parameter(torch.randn(40))
    resized = meter.step(x, time=1.0)
    assert (resized.fwd_flops, resized.bwd_flops) == oracle_training_flops(model, (x,))
    assert resized.fwd_flops == 2 * 5 * 8 * 16 + 2 * 5 * 16 * 40


def test_a_module_whose_class_changed_is_counted_as_its_new_class():
    model = mlp()
    x = torch.randn(5, 8)
    meter = FlopsMeter(model, x, peak_flops=1e12)
    meter.step(x, time=1.0)
    model[1].__class__ = nn.Identity  # the same object (its id, its attributes), another forward
    assert meter.step(x, time=1.0).flops == quiet_estimate(model, (x,), backward=True).total_flops


def test_model_state_changes_with_hooks_parameter_shapes_and_classes():
    changes = [lambda m: m[0].register_forward_hook(lambda *a: None),
               lambda m: m[0].register_forward_pre_hook(lambda *a: None),
               lambda m: setattr(m[2], "bias", nn.Parameter(torch.zeros(5))),
               lambda m: setattr(m[1], "__class__", nn.Identity)]
    for change in changes:
        model = mlp()
        state = model_state(model)
        change(model)
        assert model_state(model) != state, change


# ------------------------------------------------------------------- 18. every entry point spells back


def test_the_meter_refuses_a_misspelt_convention_or_reading_at_construction_with_the_closest_spelling():
    model = mlp()
    # a misspelt option is the caller's mistake, refused at once (before, the meter warned at its first count
    # and trained on with no FLOPs logged)
    with pytest.raises(ValueError, match="did you mean 'torch'"):
        FlopsMeter(model, conventions="torh")
    with pytest.raises(ValueError, match="did you mean 'effective'"):
        FlopsMeter(model, attention="efective")


def test_compare_spells_back_a_misspelt_preset_once():
    estimate = quiet_estimate(mlp(), (torch.randn(2, 8),))
    with pytest.raises(ValueError, match="did you mean 'deepspeed'") as raised:
        estimate.compare(["deepsped"])
    assert str(raised.value).count("did you mean") == 1
    with pytest.raises(ValueError) as raised:  # estimate's own check says it once too
        fxflops.estimate(mlp(), (torch.randn(2, 8),), conventions="deepsped")
    assert str(raised.value).count("did you mean") == 1


@pytest.mark.parametrize("call, wrong, right", [
    (lambda: FlopsMeter(mlp(), conventons="torch"), "conventons", "conventions"),
    (lambda: quiet_estimate(mlp(), (torch.randn(2, 8),)).print(modul_depth=1), "modul_depth", "module_depth"),
    (lambda: fxflops.annotate(torch.fx.symbolic_trace(mlp()), conventons="torch"), "conventons", "conventions"),
    (lambda: __import__("fxflops.compat").compat.get_model_profile(mlp(), input_shape=(2, 8), print_profil=False),
     "print_profil", "print_profile"),
])
def test_a_misspelt_keyword_names_the_closest_one(call, wrong, right):
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{wrong}'; did you mean '{right}'"):
        call()


# --------------------------------------------------------------------------------- 7. step times, variants


@pytest.mark.parametrize("seconds", ["1.0", b"1", True, 10 ** 400, [1.0]])
def test_a_step_time_that_is_not_a_number_of_seconds_is_refused_with_a_clear_message(seconds):
    meter = FlopsMeter(mlp(), None, peak_flops=1e12)
    with pytest.raises(ValueError, match="step time"):  # a string, a flag or an overflow: no step to log
        meter.step(torch.randn(2, 8), time=seconds)
    assert len(meter.steps) == 0


def test_numbers_that_are_seconds_are_taken():
    import numpy as np

    meter = FlopsMeter(mlp(), None, peak_flops=1e12)
    for seconds in (np.float32(0.5), torch.tensor(0.5), 1, 0.25):
        assert meter.step(torch.randn(2, 8), time=seconds).time == float(seconds)


# ------------------------------------------------------------------------- 19. strict, every entry point


class Kth(nn.Module):
    def forward(self, x):
        return x.kthvalue(1, dim=-1)[0] * 2  # aten.kthvalue: no shipped rule counts it


def test_strict_refuses_an_incomplete_count_in_sweep_and_profile_and_a_user_rule_completes_it(tmp_path):
    x = torch.randn(3, 4)
    for call in (lambda **k: fxflops.sweep(Kth(), (x,), dims={"batch": 0}, **k),
                 lambda **k: fxflops.profile(Kth(), (x,), warm_up=0, steps=1, **k)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # refused before any warning about the same ops
            with pytest.raises(fxflops.UnknownOpsError, match="aten.kthvalue"):
                call(strict=True)
    rule = tmp_path / "kth.toml"
    rule.write_text('[[rule]]\nname = "kth"\nops = ["aten.kthvalue"]\nmacs = "0"\nflops = "numel(self)"\n')
    # by hand: kthvalue reads the 3 x 4 input (12), the multiply writes 3 elements
    assert fxflops.sweep(Kth(), (x,), dims={"batch": 0}, rules=[rule], strict=True).at(batch=5).total_flops == 5 * 4 + 5
    assert fxflops.profile(Kth(), (x,), warm_up=0, steps=1, rules=[rule], strict=True).total_flops == 12 + 3


class Adapted(nn.Module):
    """A LoRA-style layer as peft writes it: its switch is a private flag (peft's `_disable_adapters`,
    `disable_adapter_layers()`), its step counter a private int that changes every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(8, 8)
        self.lora_a = nn.Linear(8, 2, bias=False)
        self.lora_b = nn.Linear(2, 8, bias=False)
        self._disable_adapters = False
        self._calls = 0

    def forward(self, x):
        self._calls += 1
        out = self.base(x)
        return out if self._disable_adapters else out + self.lora_b(self.lora_a(x))


def test_a_private_flag_that_switches_an_adapter_changes_the_count_and_a_private_counter_does_not():
    model = Adapted()
    x = torch.randn(5, 8)
    meter = FlopsMeter(model, x, conventions="torch", peak_flops=1e12)
    with_adapter = meter.step(x, time=1.0)
    assert (with_adapter.fwd_flops, with_adapter.bwd_flops) == oracle_training_flops(model, (x,))
    model._disable_adapters = True
    without = meter.step(x, time=1.0)
    assert (without.fwd_flops, without.bwd_flops) == oracle_training_flops(model, (x,))
    assert without.fwd_flops == 2 * 5 * 8 * 8  # by hand: the base layer alone
    meter.step(x, time=1.0)
    assert meter.captures == 2  # the counter moved every forward: no capture of its own


# ------------------------------------------------------------------- 14. the meter's warnings, variants


def test_the_meters_warnings_point_at_the_users_line():
    class Kaput(nn.Module):
        def forward(self, x):
            raise RuntimeError("no forward today")

    meter = FlopsMeter(Kaput(), None, peak_flops=1e12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meter.step(torch.randn(2, 8), time=1.0)  # the line the warning names
    assert caught and {record.filename for record in caught} == {__file__}


def test_the_cli_spells_back_a_misspelt_dtype(capsys):
    from fxflops.cli.main import main

    assert main(["resnet18", "--dtype", "bflaot16"]) != 0
    assert "did you mean 'bfloat16'?" in capsys.readouterr().err
