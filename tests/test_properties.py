"""Properties every estimate must have, whatever the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxflops
from tests.models import LeNet5, SharedTwice, tiny_transformers_model

torchvision = pytest.importorskip("torchvision")


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_macs_scale_exactly_linearly_with_batch(batch):
    model = torchvision.models.resnet18()
    one = fxflops.estimate(model, input_shape=(1, 3, 64, 64))
    many = fxflops.estimate(model, input_shape=(batch, 3, 64, 64))
    assert many.total_macs == batch * one.total_macs
    assert many.total_params == one.total_params


def test_transformer_macs_scale_linearly_with_batch():
    model, _ = tiny_transformers_model("gpt2", device="meta")
    one = fxflops.estimate(model, kwargs={"input_ids": torch.zeros(1, 16, dtype=torch.long, device="meta")})
    four = fxflops.estimate(model, kwargs={"input_ids": torch.zeros(4, 16, dtype=torch.long, device="meta")})
    assert four.total_macs == 4 * one.total_macs


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_meta_model_equals_real_weights(kind):
    real, inputs = tiny_transformers_model(kind)
    meta, meta_inputs = tiny_transformers_model(kind, device="meta")
    a = fxflops.estimate(real, kwargs=inputs)
    b = fxflops.estimate(meta, kwargs=meta_inputs)
    assert (a.total_macs, a.total_flops, a.total_params) == (b.total_macs, b.total_flops, b.total_params)
    assert {n: m.macs for n, m in a.modules.items()} == {n: m.macs for n, m in b.modules.items()}


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v2", "vit_b_16"])
def test_export_symbolic_and_trace_agree(name):
    model, x = getattr(torchvision.models, name)().eval(), torch.randn(1, 3, 224, 224)
    results = [fxflops.estimate(model, (x,), method=m) for m in ("export", "symbolic", "trace")]
    assert [r.method for r in results] == ["export", "symbolic", "trace"]
    totals = {(r.total_macs, r.total_flops, r.total_params) for r in results}
    assert len(totals) == 1
    per_module = [{n: (s.macs, s.flops) for n, s in r.modules.items()} for r in results]
    assert per_module[0] == per_module[1] == per_module[2]


@pytest.mark.parametrize("method", ["export", "symbolic", "trace"])
def test_module_called_twice_is_counted_twice_and_its_params_once(method):
    model = SharedTwice()
    result = fxflops.estimate(model, (torch.randn(4, 8),), method=method)
    assert result.modules["proj"].calls == 2
    assert result.modules["proj"].macs == 2 * 4 * 8 * 8
    assert result.modules["proj"].flops == 2 * (2 * 4 * 8 * 8 + 4 * 8)
    assert result.total_macs == 2 * 4 * 8 * 8 + 4 * 8 * 3
    assert result.total_params == 8 * 8 + 8 + 8 * 3
    assert "again" not in result.modules  # an alias is the same module: listed once, by its first name


def _snapshot(model: nn.Module) -> dict:
    return {
        "state": {k: (v.device, v.dtype, v.clone() if not v.is_meta else v.shape) for k, v in model.state_dict().items()},
        "training": [m.training for m in model.modules()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "hooks": [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()],
        "attrs": [sorted(vars(m)) for m in model.modules()],
        "global_hooks": (len(torch.nn.modules.module._global_forward_hooks),
                         len(torch.nn.modules.module._global_forward_pre_hooks)),
    }


def _assert_same(before: dict, after: dict) -> None:
    assert before["training"] == after["training"]
    assert before["requires_grad"] == after["requires_grad"]
    assert before["hooks"] == after["hooks"]
    assert before["attrs"] == after["attrs"]
    assert before["global_hooks"] == after["global_hooks"]
    assert before["state"].keys() == after["state"].keys()
    for key, (device, dtype, value) in before["state"].items():
        device_after, dtype_after, value_after = after["state"][key]
        assert (device, dtype) == (device_after, dtype_after)
        assert torch.equal(value, value_after) if isinstance(value, torch.Tensor) else value == value_after


@pytest.mark.parametrize("method", ["export", "symbolic", "trace"])
def test_model_unchanged_afterwards(method):
    model = torchvision.models.resnet18().train()
    model.layer1[0].bn1.eval()
    model.fc.weight.requires_grad_(False)
    handle = model.conv1.register_forward_hook(lambda *a: None)
    before = _snapshot(model)
    fxflops.estimate(model, (torch.randn(2, 3, 32, 32),), method=method)
    _assert_same(before, _snapshot(model))
    handle.remove()


def test_model_unchanged_after_a_failing_call():
    model = LeNet5().train()
    before = _snapshot(model)
    with pytest.raises(fxflops.CaptureError):
        fxflops.estimate(model, (torch.randn(2, 1, 31, 17),))  # too small for the last conv
    _assert_same(before, _snapshot(model))


def test_estimate_never_allocates_real_weights():
    # a model whose weights would need 40 GB is estimated from the meta device
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(100_000, 100_000), nn.ReLU(), nn.Linear(100_000, 10))
    result = fxflops.estimate(model, input_shape=(2, 100_000))
    assert result.total_macs == 2 * 100_000 * 100_000 + 2 * 100_000 * 10
    assert result.total_params == 100_000 * 100_000 + 100_000 + 100_000 * 10 + 10


def test_training_mode_batch_norm_counts_batch_statistics():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4))
    x = torch.randn(2, 3, 8, 8)
    out_numel = 2 * 4 * 6 * 6
    assert fxflops.estimate(model.eval(), (x,)).modules["1"].flops == 2 * out_numel
    # training also bumps the int64 num_batches_tracked: integer work, not a FLOP
    assert fxflops.estimate(model.train(), (x,)).modules["1"].flops == 5 * out_numel
    assert model.training
