"""The DeepSpeed-compatible API: get_model_profile's tuple, FlopsProfiler's training workflow.

MAC and FLOP numbers are worked out by hand for the small CNN below (DeepSpeed's conventions).
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

import fxflops
from fxflops.compat import FlopsProfiler, get_model_profile
from fxflops.report.formats import macs_to_string, number_to_string, params_to_string

# Conv2d(3, 8, 3) on (2, 3, 8, 8): output 2*8*6*6 = 576 elements, each 3*3*3 = 27 MACs -> 15552;
# Linear(288, 10) on (2, 288): 2*288*10 = 5760 MACs.
CNN_MACS = 15552 + 5760
# conv 2*15552 + 576 bias; BatchNorm (eval, affine) 2*576; ReLU 576; linear 2*5760 + 20 bias
CNN_FLOPS_EVAL = (2 * 15552 + 576) + 2 * 576 + 576 + (2 * 5760 + 20)
# BatchNorm in training: 5*576 (DeepSpeed's estimate; the num_batches_tracked bump is not compute)
CNN_FLOPS_TRAIN = CNN_FLOPS_EVAL - 2 * 576 + 5 * 576
CNN_PARAMS = (8 * 27 + 8) + 2 * 8 + (288 * 10 + 10)


def cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(288, 10))


def hooks_of(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def optimizer_hooks() -> int:
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    return len(_global_optimizer_pre_hooks) + len(_global_optimizer_post_hooks)


# ------------------------------------------------------------------------ get_model_profile


def test_get_model_profile_returns_deepspeeds_tuple() -> None:
    model = cnn().eval()
    flops, macs, params = get_model_profile(model, input_shape=(2, 3, 8, 8), print_profile=False, as_string=False)
    assert (flops, macs, params) == (CNN_FLOPS_EVAL, CNN_MACS, CNN_PARAMS)
    static = fxflops.estimate(model, (torch.ones(2, 3, 8, 8),))
    assert macs == static.total_macs and flops == static.total_flops


def test_get_model_profile_strings_and_args_kwargs() -> None:
    model = cnn().eval()
    x = torch.randn(2, 3, 8, 8)
    as_strings = get_model_profile(model, args=[x], print_profile=False)
    assert as_strings == (number_to_string(CNN_FLOPS_EVAL), macs_to_string(CNN_MACS), params_to_string(CNN_PARAMS))
    by_kwargs = get_model_profile(model, kwargs={"input": x}, print_profile=False, as_string=False,
                                  func_name="forward")
    assert by_kwargs[1] == CNN_MACS
    with pytest.raises(ValueError, match="mode"):
        get_model_profile(model, args=[x], mode="backward")


def test_get_model_profile_profiles_in_eval_and_restores_training() -> None:
    model = cnn().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flops, _, _ = get_model_profile(model, input_shape=(2, 3, 8, 8), print_profile=False, as_string=False)
    assert flops == CNN_FLOPS_EVAL  # DeepSpeed profiles in eval mode
    assert all(m.training for m in model.modules())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert hooks_of(model) == 0


def test_get_model_profile_prints_the_report(tmp_path, capsys) -> None:
    model = cnn().eval()
    get_model_profile(model, input_shape=(2, 3, 8, 8), top_modules=2)
    out = capsys.readouterr().out
    for field in ("fwd MACs per device:", macs_to_string(CNN_MACS), "fwd latency:", "% latency", "Conv2d("):
        assert field in out
    path = tmp_path / "profile.txt"
    get_model_profile(model, input_shape=(2, 3, 8, 8), output_file=str(path), detailed=False)
    assert "fwd latency:" in path.read_text() and "Conv2d(" not in path.read_text()
    assert capsys.readouterr().out == ""


def test_ignore_modules_moves_their_cost_to_the_parent() -> None:
    model = cnn().eval()
    kept = fxflops.estimate(model, (torch.ones(2, 3, 8, 8),))
    flops, macs, _ = get_model_profile(model, input_shape=(2, 3, 8, 8), print_profile=False, as_string=False,
                                       ignore_modules=[nn.ReLU, nn.Conv2d])
    assert (flops, macs) == (CNN_FLOPS_EVAL, CNN_MACS)  # totals stay
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=[nn.ReLU, nn.Conv2d])
    model(torch.ones(2, 3, 8, 8))
    prof.stop_profile()
    modules = prof.profile.modules
    assert modules["0"].macs == 0 and modules["0"].flops == 0 and modules["2"].flops == 0
    assert modules["0"].latency is None and modules["2"].latency is None  # not timed
    assert modules["1"].latency is not None
    assert modules[""].self_macs == kept.modules["0"].macs
    assert modules[""].self_flops == kept.modules["0"].flops + kept.modules["2"].flops
    assert modules[""].macs == CNN_MACS
    prof.end_profile()
    assert hooks_of(model) == 0


# ------------------------------------------------------------------------- FlopsProfiler


def train(model: nn.Module, steps: int, prof: FlopsProfiler, start: int, stop_after_forward: bool = False,
          printed: list[str] | None = None, capsys=None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([1, 2])
    for step in range(steps):
        if step == start:
            prof.start_profile()
        if step == start + 1 and not stop_after_forward:  # DeepSpeed's training example
            prof.stop_profile()
            prof.print_model_profile(profile_step=start)
            prof.end_profile()
        loss = nn.functional.cross_entropy(model(x), y)
        if step == start and stop_after_forward:  # DeepSpeed's newer example: stop right after forward
            prof.stop_profile()
            prof.print_model_profile(profile_step=start)
            prof.end_profile()
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_training_workflow_prints_deepspeeds_summary(capsys) -> None:
    model = cnn().train()
    prof = FlopsProfiler(model)
    train(model, 4, prof, start=1)
    out = capsys.readouterr().out
    for field in (
        "params per device:", "fwd MACs per device:", "fwd flops per device:", "fwd latency:",
        "fwd FLOPS per device = fwd flops per device / fwd latency:", "bwd latency:",
        "bwd FLOPS per device = bwd flops per device / bwd latency:",  # counted, not 2 x fwd
        "fwd+bwd FLOPS per device = (fwd+bwd flops per device) / (fwd+bwd latency):",
        "step latency:", "iter latency:", "samples/second:", "batch size per device:",
    ):
        assert field in out, field
    assert macs_to_string(CNN_MACS) in out and number_to_string(CNN_FLOPS_TRAIN) in out
    assert hooks_of(model) == 0 and optimizer_hooks() == 0
    assert all(not hasattr(m, "__flops__") for m in model.modules())


def test_recomputed_forward_raises_the_backward_flops_factor(capsys) -> None:
    # a recomputation the profiler cannot see (DeepSpeed's own checkpointing) is added as asked:
    # backward = counted backward + 1 x forward FLOPs
    model = cnn().train()
    train(model, 4, FlopsProfiler(model, recompute_fwd_factor=1.0), start=1)
    out = capsys.readouterr().out
    assert "bwd FLOPS per device = (bwd flops per device + 1 * fwd flops per device) / bwd latency:" in out
    assert "fwd+bwd FLOPS per device = (fwd+bwd flops per device + 1 * fwd flops per device) / (fwd+bwd latency):" in out


def test_training_workflow_stopped_after_forward_has_no_backward(capsys) -> None:
    model = cnn().train()
    train(model, 3, FlopsProfiler(model), start=1, stop_after_forward=True)
    out = capsys.readouterr().out
    assert "fwd latency:" in out and "bwd latency:" not in out and "iter latency:" not in out
    assert hooks_of(model) == 0 and optimizer_hooks() == 0


def test_profiler_getters_and_measurements() -> None:
    model = cnn().train()
    prof = FlopsProfiler(model)
    with pytest.raises(RuntimeError, match="start_profile"):
        prof.get_total_flops()
    prof.start_profile()
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([1, 2])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert prof.get_total_macs() == CNN_MACS
    assert prof.get_total_flops() == CNN_FLOPS_TRAIN
    assert prof.get_total_params() == CNN_PARAMS
    assert prof.get_total_macs(as_string=True) == macs_to_string(CNN_MACS)
    assert prof.get_total_duration() == prof.profile.root.latency > 0
    m = prof.profile.measurements
    assert m.bwd_latency > 0 and m.step_latency > 0
    assert m.iter_latency == m.fwd_latency + m.bwd_latency + m.step_latency
    assert m.batch_size == 2
    assert m.hooked_fwd_latency is None  # nothing ran without hooks in the user's loop
    prof.end_profile()
    assert hooks_of(model) == 0 and optimizer_hooks() == 0
    with pytest.raises(RuntimeError):
        prof.get_total_macs()


def test_profiler_leaves_no_hooks_after_an_exception_in_forward() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(5, 5))
    prof = FlopsProfiler(model)
    prof.start_profile()
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 4))
    prof.end_profile()
    assert hooks_of(model) == 0 and optimizer_hooks() == 0


def test_parallel_sizes_given(capsys) -> None:
    model = cnn().eval()
    get_model_profile(model, input_shape=(2, 3, 8, 8), detailed=False, mp_size=2, dp_size=4)
    out = capsys.readouterr().out
    assert "world size:" in out and "data parallel size:" in out and "model parallel size:" in out
    assert f"{params_to_string(CNN_PARAMS * 2)}" in out.split("params of model = params per device * mp_size:")[1]
    assert number_to_string(CNN_FLOPS_EVAL * 2) in out.split("fwd flops of model = fwd flops per device * mp_size:")[1]


def test_parallel_sizes_from_torch_distributed() -> None:
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("this torch build has no torch.distributed")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank: no port to race for
    try:
        model = cnn().eval()
        prof = FlopsProfiler(model, mp_size=1)
        prof.start_profile()
        model(torch.randn(2, 3, 8, 8))
        m = prof.profile.measurements
        assert (m.world_size, m.dp_size, m.mp_size) == (1, 1, 1)
        prof.end_profile()
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------- DeepSpeed's older API (0.3)


def test_older_get_model_profile_returns_macs_params_steps(capsys) -> None:
    model = cnn().eval()
    # the older call of DeepSpeed's docs: input_res is the input's whole shape
    macs, params, steps = get_model_profile(model=model, input_res=(2, 3, 8, 8), input_constructor=None,
                                            print_profile=False, print_aggregated_profile=False,
                                            module_depth=-1, top_modules=3, warm_up=1, num_steps=2,
                                            as_strings=True, ignore_modules=None)
    assert (macs, params, steps) == (macs_to_string(CNN_MACS), params_to_string(CNN_PARAMS), 2)
    assert capsys.readouterr().out == ""
    raw = get_model_profile(model, input_res=(2, 3, 8, 8), print_profile=False,
                            print_aggregated_profile=False, warm_up=0, num_steps=1, as_strings=False)
    assert raw == (CNN_MACS, CNN_PARAMS, 1)


def test_older_get_model_profile_prints_the_aggregated_profile_alone(capsys) -> None:
    get_model_profile(cnn(), input_res=(2, 3, 8, 8), print_profile=False, print_aggregated_profile=True,
                      warm_up=0, num_steps=1)
    out = capsys.readouterr().out
    assert "Top 3 modules" in out and "Detailed Profile" not in out


def test_older_input_constructor_builds_keyword_inputs() -> None:
    class Keyed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = cnn()

        def forward(self, pixels: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            return self.body(pixels) * scale

    seen = []

    def construct(input_res):
        seen.append(input_res)
        return {"pixels": torch.randn(*input_res), "scale": 2.0}

    macs, _, _ = get_model_profile(Keyed(), input_res=(2, 3, 8, 8), input_constructor=construct,
                                   print_profile=False, print_aggregated_profile=False, warm_up=0,
                                   num_steps=1, as_strings=False)
    assert macs == CNN_MACS and seen and all(res == (2, 3, 8, 8) for res in seen)
    with pytest.raises(ValueError, match="older call"):
        get_model_profile(cnn(), input_shape=(2, 3, 8, 8), input_res=(2, 3, 8, 8))


def test_older_profiler_getters_take_in_str(capsys) -> None:
    model = cnn().train()
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randn(2, 3, 8, 8))
    # DeepSpeed 0.3's get_total_flops returned MACs (it counted them under that name)
    assert prof.get_total_flops(in_str=True) == macs_to_string(CNN_MACS)
    assert prof.get_total_flops(in_str=False) == CNN_MACS
    assert prof.get_total_flops() == CNN_FLOPS_TRAIN  # today's call: FLOPs
    assert prof.get_total_params(in_str=True) == params_to_string(CNN_PARAMS)
    assert isinstance(prof.get_total_duration(in_str=True), str)
    assert prof.get_total_steps() == 1
    prof.print_model_aggregated_profile(module_depth=-1, top_modules=3)
    out = capsys.readouterr().out
    assert "Top 3 modules" in out and "Detailed Profile" not in out
    prof.end_profile()
    assert hooks_of(model) == 0


def test_seed_alexnet_example_runs_with_one_import_changed(capsys) -> None:
    # DeepSpeed's current AlexNet example, its two deepspeed imports replaced by one fxflops import
    # (batch 2 and one warm-up instead of 256 and 10, to stay fast)
    import torchvision.models as models

    from fxflops.compat import get_accelerator, get_model_profile

    with get_accelerator().device(0):
        model = models.alexnet()
        batch_size = 2
        flops, macs, params = get_model_profile(model=model, input_shape=(batch_size, 3, 224, 224), args=None,
                                                kwargs=None, print_profile=True, detailed=True, module_depth=-1,
                                                top_modules=1, warm_up=1, as_string=True, output_file=None,
                                                ignore_modules=None)
    assert "AlexNet" in capsys.readouterr().out
    static = fxflops.estimate(model, input_shape=(batch_size, 3, 224, 224))
    assert macs == macs_to_string(static.total_macs) and params == params_to_string(static.total_params)


def test_get_accelerator_names_the_device() -> None:
    from fxflops.compat import get_accelerator

    accelerator = get_accelerator()
    if torch.cuda.is_available():
        assert accelerator.device_name(0) == "cuda:0" and accelerator.device_name() == "cuda"
    else:
        assert accelerator.device_name(0) == "cpu" and accelerator.current_device_name() == "cpu"
        with accelerator.device(0):
            pass
    assert accelerator.is_available() and accelerator.device_count() >= 1


def test_older_0_3_12_call_returns_macs_and_params(capsys) -> None:
    # 0.3.12 to 0.5.9: input_res (here positional, as DeepSpeed's BERT example passes it) and as_string
    model = cnn()
    seen = []

    def construct(input_res):
        seen.append(input_res)
        return {"input": torch.randn(*input_res)}

    macs, params = get_model_profile(model, (2, 3, 8, 8), input_constructor=construct, print_profile=False,
                                     as_string=False, warm_up=0)
    assert (macs, params) == (CNN_MACS, CNN_PARAMS) and seen[0] == (2, 3, 8, 8)
    assert capsys.readouterr().out == ""  # print_profile=False prints nothing
    strings = get_model_profile(model=model, input_res=(2, 3, 8, 8), print_profile=False, detailed=False, warm_up=0)
    assert strings == (macs_to_string(CNN_MACS), params_to_string(CNN_PARAMS))


def test_older_get_total_params_counts_the_trainable_ones() -> None:
    model = cnn()
    model[0].weight.requires_grad_(False)
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randn(2, 3, 8, 8))
    assert prof.get_total_params() == CNN_PARAMS
    assert prof.get_total_params(in_str=False) == CNN_PARAMS - 8 * 27  # 0.3.11 counted requires_grad ones
    prof.end_profile()
