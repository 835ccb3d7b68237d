"""Captures of unusual models: hook-based parametrizations under symbolic tracing, torch.cond,
profilers' hooks during a capture, torch.compile'd models. Counts are worked out by hand."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fxflops


def _quiet_estimate(model: nn.Module, args: tuple, **options) -> fxflops.Estimate:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxflops.CautionWarning)
        warnings.simplefilter("error", fxflops.UnknownOpsWarning)
        return fxflops.estimate(model, args, **options)


# Linear(4, 4) on a (3, 4) input: 3 * 4 * 4 = 48 MACs, 96 + 12 (bias) FLOPs.
# weight_norm: square, sum and scale per element of v: 3 * 16 FLOPs.
# spectral_norm, eval: sigma = dot(u, mv(W, v)): 16 + 4 MACs, then W / sigma: 16 FLOPs.
# spectral_norm, training: one power iteration first: two mv (32 MACs) and two normalize of 4
# (norm 4 + clamp 1 + divide 4 = 9 FLOPs each).
HOOKED = [
    ("weight_norm", False, 48, 108 + 48),
    ("spectral_norm", False, 48 + 20, 108 + 40 + 16),
    ("spectral_norm", True, 48 + 20 + 32, 108 + 40 + 16 + 64 + 18),
]


@pytest.mark.parametrize("root", [False, True], ids=["inside", "root"])
@pytest.mark.parametrize(("kind", "training", "macs", "flops"), HOOKED)
@pytest.mark.parametrize("method", ["symbolic", "eager"])
def test_hook_based_parametrizations_are_counted_under_every_method(method, kind, training, macs, flops, root):
    layer = getattr(nn.utils, kind)(nn.Linear(4, 4))
    model = (layer if root else nn.Sequential(layer)).train(training)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    result = _quiet_estimate(model, (torch.randn(3, 4),), method=method)
    assert (result.total_macs, result.total_flops) == (macs, flops)
    assert result.cautions == []
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())  # u, v unmoved


def test_normalize_kept_whole_counts_as_its_aten_ops():
    class Normalize(nn.Module):
        def forward(self, x):
            return nn.functional.normalize(x, dim=-1)

    # (3, 5) input: norm 15, clamp of 3 norms, divide 15
    for method in ("symbolic", "eager"):
        assert _quiet_estimate(Normalize(), (torch.randn(3, 5),), method=method).total_flops == 15 + 3 + 15


def test_symbolic_tracing_cautions_about_the_hooks_it_does_not_run():
    model = nn.Sequential(nn.Linear(4, 4))
    model[0].register_forward_hook(lambda module, args, out: out * 2)
    with pytest.warns(fxflops.CautionWarning, match=r"symbolic tracing does not run module forward hooks.*\b0 \(<lambda>\)"):
        result = fxflops.estimate(model, (torch.randn(3, 4),), method="symbolic")
    assert result.total_flops == 108  # the hook's 12 multiplications ran in no capture
    assert len(model[0]._forward_hooks) == 1


# --- torch.compile'd models --------------------------------------------------------------------------

_COMPILED = r'''
import sys, warnings
import torch
from torch import nn
import fxflops

warnings.simplefilter("ignore")

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))

def torch_state():
    return dict(vars(nn.Module))

compiled = []  # what dynamo handed its backend: nothing, if the capture never ran dynamo

def recording_backend(graph_module, example_inputs):
    compiled.append(graph_module)
    return graph_module.forward

x = torch.randn(3, 4)
for where in ("root", "submodule"):
    before = torch_state()
    if where == "root":
        model = torch.compile(Net(), backend=recording_backend)
    else:
        model = Net()
        model.b = torch.compile(model.b, backend=recording_backend)
    result = fxflops.estimate(model, (x,))
    after = torch_state()
    assert after.keys() == before.keys(), (where, set(after) ^ set(before))
    assert all(after[key] is before[key] for key in before), (where, [k for k in before if after[k] is not before[k]])
    # a: 3 * 4 * 8 = 96 MACs, 192 + 24 (bias) FLOPs; relu 24; b: 3 * 8 * 2 = 48 MACs, 96 + 6
    assert (result.total_macs, result.total_flops) == (96 + 48, 192 + 24 + 24 + 96 + 6), (where, result)
    print(result.model_type, sorted(result.modules), result.modules["b"].type)
print("dynamo compiled", len(compiled))
print("sweep", fxflops.sweep(torch.compile(Net()), (x,), dims={"batch": 0}).model_type)
'''


def test_a_compiled_model_is_counted_as_its_original_and_torch_is_left_unpatched():
    # a fresh interpreter: dynamo patches nn.Module once per process, so an earlier compile would hide it
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", _COMPILED], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    # the compiled root counted as its original module, under its own names; a compiled submodule
    # as its original module under its own name (no `b._orig_mod` level), run without dynamo; a sweep
    # names the original class as estimate() does
    assert done.stdout.split("\n")[:4] == ["Net ['', 'a', 'b'] Linear", "Net ['', 'a', 'b'] Linear",
                                           "dynamo compiled 0", "sweep Net"]


# --- hooks during a capture ---------------------------------------------------------------------------

# Linear(8, 16) on (5, 8): 640 MACs, 1280 + 80 (bias) FLOPs; ReLU 80; Linear(16, 4): 320 MACs, 640 + 20
PROFILED_FLOPS = 1280 + 80 + 80 + 640 + 20


@pytest.mark.parametrize("grad", [False, True])
def test_two_flops_profilers_on_one_model_count_only_the_real_forwards(grad):
    from fxflops.compat import FlopsProfiler

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    first, second = FlopsProfiler(model), FlopsProfiler(model)
    first.start_profile()
    second.start_profile()
    try:
        with torch.set_grad_enabled(grad), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(3):
                model(torch.randn(5, 8))
        for profiler in (first, second):
            assert profiler.get_total_steps() == 3
            assert profiler.get_total_flops() == PROFILED_FLOPS
            assert profiler.get_total_macs() == 640 + 320
    finally:
        first.end_profile()
        second.end_profile()
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_a_users_hook_can_tell_a_capture_from_a_real_forward():
    model = nn.Sequential(nn.Linear(8, 4))
    seen = []
    model.register_forward_hook(lambda module, args, out: seen.append((fxflops.capturing(), type(out).__name__)))
    for method in ("eager", "trace"):
        fxflops.estimate(model, (torch.randn(2, 8),), method=method)
    model(torch.randn(2, 8))
    assert seen == [(True, "FakeTensor"), (True, "Tensor"), (False, "Tensor")]
    assert not fxflops.capturing()


# --- torch.cond ---------------------------------------------------------------------------------------


class Branches(nn.Module):
    """x (3, 4): the true branch multiplies by a 4x4 (48 MACs), the false one by an 8x4 (96 MACs);
    either then sums 12 values. The predicate: a sum of 12 and a comparison (13 FLOPs)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, 4))
        self.b = nn.Parameter(torch.randn(8, 4))

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda v: (v @ self.a.t()).sum(0), lambda v: (v @ self.b.t())[:, :4].sum(0), (x,))


@pytest.mark.parametrize("method", ["eager", "export", "auto"])
def test_torch_cond_counts_each_ops_larger_branch_and_says_the_total_is_an_upper_bound(method):
    # FlopCounterMode's rule: per op, the branch where it costs more (mm: the false one's 96 MACs; the
    # sums tie at 12 FLOPs: counted once)
    with pytest.warns(fxflops.CautionWarning, match=r"torch.cond in the model \(Branches\): both branches are "
                                                    r"captured and each op counts where its branch costs more.*upper bound"):
        result = fxflops.estimate(Branches(), (torch.ones(3, 4),), method=method)
    assert (result.total_macs, result.total_flops) == (96, 2 * 96 + 12 + 13)
    assert len(result.cautions) == 1


class TwoOpsTwoBranches(nn.Module):
    """x (3, 4): the true branch an mm by a 4x4 (48 MACs), the false one an addmm by an 8x4 with bias
    (96 MACs): each op's larger branch is a different branch, so the count is more than either."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, 4))
        self.b = nn.Linear(4, 8)

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda v: v @ self.a.t(), lambda v: self.b(v)[:, :4], (x,))


@pytest.mark.parametrize("model", [Branches(), TwoOpsTwoBranches()], ids=["one op", "two ops"])
def test_torch_cond_under_the_torch_preset_equals_flop_counter_mode(model):
    from tests.oracle import oracle_flops

    x = torch.ones(3, 4)
    with torch.no_grad():
        expected = oracle_flops(model, (x,))
    assert expected == {Branches: 2 * 96, TwoOpsTwoBranches: 2 * 48 + 2 * 96}[type(model)]
    assert _quiet_estimate(model, (x,), method="eager", conventions="torch").total_flops == expected


@pytest.mark.parametrize(("sign", "macs"), [(1, 48), (-1, 96)])
def test_torch_cond_under_trace_counts_the_branch_the_inputs_take(sign, macs):
    from tests.oracle import oracle_flops

    model, x = Branches(), sign * torch.ones(3, 4)
    result = _quiet_estimate(model, (x,), method="trace")
    assert (result.total_macs, result.total_flops, result.cautions) == (macs, 2 * macs + 12 + 13, [])
    if sign < 0:  # the larger branch: FlopCounterMode's upper bound
        assert _quiet_estimate(model, (x,), method="trace", conventions="torch").total_flops == oracle_flops(model, (x,))


def test_torch_cond_with_a_backward_is_refused_rather_than_missing_its_gradients():
    with pytest.raises(fxflops.CaptureError, match="the backward of torch.cond is not recorded op by op"):
        fxflops.estimate(Branches(), (torch.ones(3, 4),), method="eager", backward=True)
