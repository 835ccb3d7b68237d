"""Cases a new user hits that no other test names: torch.inner on matrices, profiler markers
(record_function, DataParallel), nn.TransformerEncoder's padding-mask check.

Counts are derived by hand; under the torch preset they equal FlopCounterMode (tests/oracle.py),
under fvcore / ptflops what those tools give (fvcore's jit trace sees aten::inner, which it has no
handler for; ptflops' aten backend sees the mm it runs as).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fxflops
from tests.oracle import oracle_flops


class Inner(nn.Module):
    def forward(self, a, b):
        return torch.inner(a, b)


class InnerMethod(nn.Module):
    def forward(self, a, b):
        return a.inner(b)


def count(model, args, kwargs=None, conventions="deepspeed", method="auto"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fxflops.estimate(model, args, kwargs, conventions=conventions, method=method)
    assert not result.unknown, [u.op for u in result.unknown]
    return result


# (a shape, b shape, MACs = numel(out) x the reduced last dim, FLOPs under deepspeed)
INNER_CASES = [
    ((5,), (5,), 5, 10),                     # a dot product: 5 MACs
    ((5,), (4, 5), 4 * 5, 40),               # out (4,), each a 5-long reduction
    ((3, 5), (5,), 3 * 5, 30),               # out (3,)
    ((3, 5), (4, 5), 3 * 4 * 5, 120),        # out (3, 4)
    ((2, 3, 5), (4, 6, 5), 2 * 3 * 4 * 6 * 5, 1440),  # out (2, 3, 4, 6)
    ((), (4, 5), 0, 20),                     # a scalar times a matrix: 20 multiplies, no reduction
    ((3, 5), (), 0, 15),                     # 15 multiplies
]


@pytest.mark.parametrize("module", [Inner, InnerMethod])
@pytest.mark.parametrize(("a_shape", "b_shape", "macs", "flops"), INNER_CASES)
def test_inner_by_hand_in_every_preset(module, a_shape, b_shape, macs, flops):
    args = (torch.randn(a_shape), torch.randn(b_shape))
    deepspeed = count(module(), args)
    assert (deepspeed.total_macs, deepspeed.total_flops) == (macs, flops)
    matrix = len(a_shape) >= 1 and len(b_shape) >= 1 and len(a_shape) + len(b_shape) > 2
    # FlopCounterMode and ptflops see the mm a matrix inner runs as; a dot or a multiply they do not count
    torch_preset = count(module(), args, conventions="torch")
    assert torch_preset.total_flops == (2 * macs if matrix else 0)
    assert torch_preset.total_flops == oracle_flops(module(), args)
    ptflops = count(module(), args, conventions="ptflops-aten")
    assert ptflops.total_macs == (macs if matrix else 0)
    assert count(module(), args, conventions="fvcore").total_flops == 0


def test_record_function_and_data_parallel_are_plumbing():
    class Marked(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 4)

        def forward(self, x):
            with torch.profiler.record_function("block"):
                return self.linear(x)

    x = torch.randn(2, 8)
    # 2 x 8 x 4 = 64 MACs; FLOPs 2 x 64 + 8 bias adds
    for model in (Marked(), nn.DataParallel(nn.Linear(8, 4))):  # DataParallel.forward opens a record_function
        result = count(model, (x,))
        assert (result.total_macs, result.total_flops) == (64, 136)
        assert count(model, (x,), conventions="torch").total_flops == 128 == oracle_flops(model, (x,))


def test_transformer_encoder_padding_mask_check_is_not_unknown():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(2, 6, 16)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, 4:] = True
    result = count(encoder, (x,), {"src_key_padding_mask": mask}, conventions="torch")
    # per layer, 12 tokens: in_proj 12*16*48 + out_proj 12*16*16 + ffn 2*12*16*32 MACs, attention
    # 2 * (2*4*6*6*4) MACs; x2 FLOPs, x2 layers
    per_layer = 12 * 16 * 48 + 12 * 16 * 16 + 2 * 12 * 16 * 32 + 2 * (2 * 4 * 6 * 6 * 4)
    assert result.total_flops == 2 * 2 * per_layer == 107520
    assert result.total_flops == oracle_flops(encoder, (x,), {"src_key_padding_mask": mask})


def test_a_forward_returning_a_generator_is_refused_not_counted_as_zero():
    class Lazy(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            for _ in range(3):
                yield self.linear(x)

    with pytest.raises(fxflops.CaptureError, match="returned a generator.*list"):
        fxflops.estimate(Lazy(), (torch.randn(2, 4),))


def test_backward_under_inference_mode_is_counted_as_outside_it():
    model, x = nn.Linear(8, 4), torch.randn(2, 8)
    # weight gradient g^T x: 4 * 8 * 2 = 64 MACs (128 FLOPs); bias gradient sums g over the batch: 8
    for method in ("auto", "eager", "trace"):
        with torch.inference_mode():
            inside = fxflops.estimate(model, (torch.randn(2, 8),), backward=True, method=method)
        assert (inside.bwd_macs, inside.bwd_flops) == (64, 136), method
    assert fxflops.estimate(model, (x,), backward=True).bwd_flops == 136
    for method in ("eager", "export", "symbolic", "trace"):  # forward only: 64 MACs, 128 + 8 bias FLOPs
        with torch.inference_mode():
            assert fxflops.estimate(model, (torch.randn(2, 8),), method=method).total_flops == 136, method


def test_json_without_nodes_keeps_node_counts_and_statuses():
    from fxflops import report

    class WithUnknown(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return torch.linalg.matrix_exp(self.linear(x).reshape(2, 2, 2))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimate = fxflops.estimate(WithUnknown(), (torch.randn(2, 4),))
    back = report.from_json(estimate.to_json())  # the CLI's --format json: no per-node costs
    assert not back.nodes
    assert back.node_status_counts() == estimate.node_status_counts() == {"counted": 1, "zero": 1, "unknown": 1}
    assert back.statuses("op") == estimate.statuses("op")
    assert back.statuses("rule")["linear"] == "counted"
    assert back.print(as_string=True) == estimate.print(as_string=True)
    assert report.from_json(back.to_json()).to_json() == back.to_json()


@pytest.mark.parametrize(("name", "label"), [
    ("h100 sxm", "H100 SXM"), ("H100-SXM", "H100 SXM"), ("4090", "RTX 4090"), ("a10", "A10"),
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("nvidia a100-sxm4-80gb", "A100 80GB SXM"),
])
def test_device_names_in_any_case_and_spacing(name, label):
    assert count(nn.Linear(4, 4), (torch.randn(2, 4),)).predict(name).device == label


@pytest.mark.parametrize("name", ["L40", "H20"])  # other GPUs, not the L40S or the H200
def test_device_name_words_match_whole(name):
    estimate = count(nn.Linear(4, 4), (torch.randn(2, 4),))
    with pytest.raises(ValueError, match=f"device '{name}' is not in the peaks table"):
        estimate.predict(name)


@pytest.mark.parametrize("name", ["A100", "H100", "v100"])
def test_a_device_name_several_parts_share_is_refused_listing_them(name):
    estimate = count(nn.Linear(4, 4), (torch.randn(2, 4),))
    with pytest.raises(ValueError, match=f"device '{name}' could be any of .*: name one"):
        estimate.predict(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, predict() takes what is missing from the current device")
def test_predict_with_half_the_given_numbers_names_the_missing_one():
    estimate = count(nn.Linear(4, 4), (torch.randn(2, 4),))
    with pytest.raises(ValueError, match=r"give bandwidth= \(bytes/s\) too"):
        estimate.predict(peak_flops=1e12)
    with pytest.raises(ValueError, match=r"give peak_flops= \(FLOP/s\) too"):
        estimate.predict(bandwidth=1e12)


@pytest.mark.parametrize("shape", [4, "1,3", [], [(1, 4), 4]])
def test_a_malformed_input_shape_says_what_to_give(shape):
    with pytest.raises(ValueError, match="input_shape must be a tuple of"):
        fxflops.estimate(nn.Linear(4, 4), input_shape=shape)


def test_a_function_instead_of_a_module_says_to_wrap_it():
    with pytest.raises(TypeError, match="counts a torch.nn.Module; got function"):
        fxflops.estimate(lambda x: x @ x, (torch.randn(3, 3),))


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_nested_tensor_inputs_are_refused_with_what_to_do(layout):
    x = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)], layout=layout)
    with pytest.raises(ValueError, match="nested tensors.*to_padded_tensor"):
        fxflops.estimate(nn.Linear(8, 4), (x,))


@pytest.mark.parametrize("method", ["symbolic", "eager", "export"])
def test_a_parametrized_module_counts_its_parametrization_under_every_method(method):
    model = nn.Sequential(torch.nn.utils.parametrizations.weight_norm(nn.Linear(4, 4)))
    before = {key: value.clone() for key, value in model.state_dict().items()}
    result = count(model, (torch.randn(2, 4),), method=method)
    # Linear: 2 * 4 * 4 = 32 MACs, 64 + 8 bias FLOPs; weight norm: square, sum, scale per element of v (16)
    assert (result.total_macs, result.total_flops) == (32, 64 + 8 + 3 * 16)
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())


def test_symbolic_tracing_of_spectral_norm_fails_clearly_and_leaves_its_vectors_alone():
    model = nn.Sequential(torch.nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4))).train()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(fxflops.CaptureError, match="symbolic"):
        fxflops.estimate(model, (torch.randn(2, 4),), method="symbolic")
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())  # u, v unmoved
