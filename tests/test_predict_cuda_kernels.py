"""The CUDA kernels torch launches for batch norm and the layout conversions cuDNN runs around an NCHW convolution
(fxflops.predict.cuda_kernels), by hand from the launch configurations of aten/src/ATen/native/cuda/Normalization.cuh."""

from __future__ import annotations

import pytest
import torch

import fxflops
from fxflops.predict.cuda_kernels import batch_norm_launches, conversion_bytes
from fxflops.predict.hardware import device_model, with_constant
from fxflops.predict.op_time import op_time


def nodes(model: torch.nn.Module, x: torch.Tensor, names: tuple[str, ...]) -> list:
    est = fxflops.estimate(model, (x,), backward=True)
    return [n for n in est.nodes if any(name in n.op for name in names)]


def batch_norm(channels_last: bool) -> tuple:
    with torch.device("meta"):
        model = torch.nn.BatchNorm2d(16).to(torch.bfloat16)
    x = torch.empty(8, 16, 14, 14, device="meta", dtype=torch.bfloat16, requires_grad=True)
    if channels_last:
        x = x.detach().to(memory_format=torch.channels_last).requires_grad_()
    forward, backward = nodes(model, x, ("native_batch_norm",))
    return forward, backward


def test_nchw_batch_norm_kernels_by_hand() -> None:
    # (8, 16, 14, 14) bf16, training, NCHW contiguous. Forward: batch_norm_collect_statistics_kernel, one block of
    # getNumThreads(196) = 256 x 2 threads per channel: 16 blocks, each thread ceil(8 / 2) x ceil(196 / 256) = 4
    # dependent loads; the channels' update kernel (1 block of 128, one load); batch_norm_transform_input_kernel:
    # tf = max(getNumThreads(49), min(getNumThreads(196), 64)) = 64, tb = 1, grid (16, min(262144 / 16, 8) = 8) = 128
    # blocks of 64 threads, each ceil(8 / 8) x ceil(196 / 64) = 4 loads. All in one wave (132 SMs x 4 blocks of 512, x
    # 32 of 64). Each load waits the H100's memory_latency (400 cycles at 1.98 GHz); each kernel's bytes at 2.97 TB/s
    # take less (50,176 B in, 100,352 B through the transform); a 2 us launch each
    forward, backward = batch_norm(channels_last=False)
    assert not forward.channels_last and not backward.channels_last
    assert [(k.name, k.blocks, k.threads, k.rounds) for k in batch_norm_launches(forward, 2)] == [
        ("batch_norm_collect_statistics_kernel", 16, 512, 4), ("batch_norm_update_stats_and_invert", 1, 128, 1),
        ("batch_norm_transform_input_kernel", 128, 64, 4)]
    h100 = device_model("H100 SXM")
    latency = 400 / 1.98e9
    assert h100.memory_latency == pytest.approx(latency, rel=1e-3)
    assert op_time(forward, h100, "bf16").seconds == pytest.approx((4 + 1 + 4) * h100.memory_latency + 3 * 2e-6)
    # backward: batch_norm_backward_kernel, one block of 512 per channel, two passes of 4 rounds (the sums over the
    # input and the output's gradient, then the input's gradient), 5 x 50,176 bytes, one launch
    (kernel,) = batch_norm_launches(backward, 2)
    assert (kernel.name, kernel.blocks, kernel.threads, kernel.rounds, kernel.bytes) == (
        "batch_norm_backward_kernel", 16, 512, 8, 5 * 50176)
    assert op_time(backward, h100, "bf16").seconds == pytest.approx(8 * h100.memory_latency + 2e-6)
    # a device without the latency (memory_latency 0) times them at the normalization class's bandwidth, as before
    plain = with_constant(h100, "memory_latency", 0, "given")
    assert op_time(forward, plain, "bf16").seconds < 3.5e-6


def test_channels_last_batch_norm_kernels_by_hand() -> None:
    # the same shape channels-last: flexible_launch_configs(reduction 8 x 196 = 1568, stride 16): block 16 x 32;
    # statistics (cooperative): grid_y = ceil(1568 / (32 x 16)) = 4 < 8, so 1: one block, ceil(1568 / (32 x 4)) = 13
    # rounds of 4 loads; the transform: grid (1, 4), ceil(1568 / (32 x 4 x 4)) = 4 rounds. Backward: the reduce kernel
    # (13 rounds) and the elementwise kernel (4)
    forward, backward = batch_norm(channels_last=True)
    assert forward.channels_last and backward.channels_last
    assert [(k.name, k.blocks, k.threads, k.rounds) for k in batch_norm_launches(forward, 2)] == [
        ("batch_norm_collect_statistics_channels_last_kernel", 1, 512, 13),
        ("batch_norm_update_stats_and_invert", 1, 128, 1),
        ("batch_norm_transform_input_channels_last_kernel", 4, 512, 4)]
    assert [(k.name, k.blocks, k.rounds) for k in batch_norm_launches(backward, 2)] == [
        ("batch_norm_backward_reduce_channels_last_kernel", 1, 13),
        ("batch_norm_backward_elemt_channels_last_kernel", 4, 4)]
    h100 = device_model("H100 SXM")
    assert op_time(backward, h100, "bf16").seconds == pytest.approx(17 * h100.memory_latency + 2 * 2e-6)


def conv(channels_last: bool, input_grad: bool, bias: bool = False) -> tuple:
    with torch.device("meta"):
        model = torch.nn.Conv2d(64, 64, 3, padding=1, bias=bias).to(torch.bfloat16)
    x = torch.empty(4, 64, 28, 28, device="meta", dtype=torch.bfloat16, requires_grad=input_grad)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.detach().to(memory_format=torch.channels_last).requires_grad_(input_grad)
    return tuple(nodes(model, x, ("conv",)))


def test_layout_conversions_of_one_convolution() -> None:
    # bf16 NCHW: cuDNN's NHWC kernels behind one NCHW -> NHWC copy per call: forward (the input), input gradient (the
    # output's gradient) and weight gradient (the input): 3 copies of 4 x 64 x 28 x 28 bf16 (401,408 bytes each, read
    # and written); a first layer, whose input needs no gradient, 2; channels-last tensors none
    element, size = 2, 4 * 64 * 28 * 28 * 2
    forward, backward = conv(channels_last=False, input_grad=True)
    assert conversion_bytes(forward, element, 1) == (2 * size, 1)
    assert conversion_bytes(backward, element, 1) == (4 * size, 2)
    forward, backward = conv(channels_last=False, input_grad=False)
    assert conversion_bytes(forward, element, 1)[1] + conversion_bytes(backward, element, 1)[1] == 2
    # a first layer with a bias: its backward computes the weight's and the bias's gradients, no input gradient, and
    # converts the input alone, as the weight's gradient does (the same reading as its dW GEMM: op_time.gemm_shape)
    _, backward = conv(channels_last=False, input_grad=False, bias=True)
    assert conversion_bytes(backward, element, 1) == (2 * size, 1)
    forward, backward = conv(channels_last=True, input_grad=True)
    assert forward.channels_last and backward.channels_last
    assert conversion_bytes(forward, element, 1) == conversion_bytes(backward, element, 1) == (0, 0)
    # priced as copies at the copy class's bandwidth with a launch each, in the convolution's overhead; fp32 runs
    # none, nor does a device whose conv_layout_conversions is 0
    h100 = device_model("H100 SXM")
    none = with_constant(h100, "conv_layout_conversions", 0, "given")
    forward, _ = conv(channels_last=False, input_grad=True)
    copy = 2 * size / h100.class_bandwidth("copy", 2 * size) + h100.launch_overhead
    assert op_time(forward, h100, "bf16").overhead == pytest.approx(op_time(forward, none, "bf16").overhead + copy)
    assert op_time(forward, h100, "fp32") == op_time(forward, none, "fp32")


def test_layer_norm_on_a_transposed_input_copies_it_and_its_backward_is_two_kernels() -> None:
    # torch's CUDA layer norm (aten/src/ATen/native/cuda/layer_norm_kernel.cu) takes input.expect_contiguous() forward
    # and backward and dY.contiguous() in its backward: a transposed (16, 32, 64) bf16 input is copied, 2 x 32,768
    # elements x 2 bytes read and written, once in each pass; the backward's weight and bias gradients are a second
    # kernel (GammaBetaBackward) that reads dY and X again (2 x 65,536 B), the fp32 mean and rstd of its 512 rows
    # (2 x 4 x 512 B) and writes the two 64-element gradients (2 x 128 B). Each at its class's bandwidth with a launch
    from fxflops.predict.cuda_kernels import layer_norm_launches
    from fxflops.predict.op_time import layer_norm_extra_seconds

    class Transposed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = torch.nn.LayerNorm(64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.ln(x.transpose(0, 1)) * 2.0

    with torch.device("meta"):
        model = Transposed().to(torch.bfloat16)
    x = torch.empty(32, 16, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    forward, backward = nodes(model, x, ("native_layer_norm",))
    assert forward.strided_inputs == (0,) and backward.strided_inputs == (1,)  # the output's gradient is contiguous
    copy = 2 * 32768 * 2
    assert layer_norm_launches(forward, 2) == (copy, 1, 0, 0)
    reduction = 2 * 32768 * 2 + 2 * 4 * 512 + 2 * 64 * 2
    assert layer_norm_launches(backward, 2) == (copy, 1, reduction, 1)
    h100 = device_model("H100 SXM")
    extra = copy / h100.class_bandwidth("copy", copy) + 2e-6
    assert layer_norm_extra_seconds(forward, h100, "bf16") == pytest.approx(extra, rel=1e-12)
    extra += reduction / h100.class_bandwidth("normalization_backward", 64) + 2e-6
    assert layer_norm_extra_seconds(backward, h100, "bf16") == pytest.approx(extra, rel=1e-12)
    plain = op_time(backward, h100, "bf16")
    assert plain.overhead == pytest.approx(2e-6 + extra, rel=1e-12)
    # a contiguous input: nothing to copy; the backward's second kernel stays
    with torch.device("meta"):
        ln = torch.nn.LayerNorm(64).to(torch.bfloat16)
    forward, backward = nodes(ln, torch.empty(16, 32, 64, device="meta", dtype=torch.bfloat16, requires_grad=True),
                              ("native_layer_norm",))
    assert forward.strided_inputs == backward.strided_inputs == ()
    assert layer_norm_launches(forward, 2) == (0, 0, 0, 0) and layer_norm_launches(backward, 2) == (0, 0, reduction, 1)
