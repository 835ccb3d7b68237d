"""What a lent H100 SXM measured (benchmarks/results/gpu/h100_run*.json, written by benchmarks/gpu_check.py) held
against fxflops: the meter's count, the measured device file, the time model at the shapes of issue 41's
Megatron-Core H100 rows, and where the H100 preset's published constants are off for torch's own kernels."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "gpu"
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_tables_h100  # noqa: E402

from fxflops.predict import op_table  # noqa: E402
from fxflops.predict.hardware import device_model  # noqa: E402

# FlopCounterMode around one real training step of gpu_check's Llama, as on the H200 (tests/test_gpu_measurements.py)
GPU_STEP_FLOPS = 25_348_897_112_064


def run(i: int) -> dict:
    return json.loads((RESULTS / f"h100_run{i}.json").read_text(encoding="utf-8"))


def median_error(rows: list[op_table.Row], device) -> float:
    return statistics.median(abs(op_table.predicted(row, device) / row.seconds - 1) for row in rows)


def test_the_run_was_an_h100_sxm_and_its_cuda_tests_passed() -> None:
    first = run(1)
    assert first["env"]["name"] == "NVIDIA H100 80GB HBM3" and first["env"]["sm_count"] == 132
    assert first["tests"]["summary"] == "12 passed in 21.01s"
    assert round(first["ceilings"]["matmul"]["tflops"]) == 678 and round(first["ceilings"]["copy"]["tb_per_s"], 2) == 3.02


def test_the_meter_and_flopcountermode_agreed_on_the_h100_step() -> None:
    meter = run(1)["meter"]
    assert meter["oracle_flops"] == GPU_STEP_FLOPS
    assert all(step["flops"] == GPU_STEP_FLOPS for step in meter["logged"])


def test_the_shipped_measured_device_is_the_fit_of_the_shipped_measurements() -> None:
    _, fitted = gpu_tables_h100.fitted_device(write=False)
    shipped = device_model("H100 SXM measured")
    assert set(fitted) == {name for name, c in shipped.constants.items() if "measured on NVIDIA H100" in c.source}
    for name, (value, _) in fitted.items():
        shipped_value = shipped.constants[name].value
        if isinstance(value, list):
            assert [tuple(point) for point in value] == [tuple(point) for point in shipped_value], name
        else:
            assert shipped_value == pytest.approx(value), name


def test_the_megatron_core_rows_linears_are_predicted_by_the_preset() -> None:
    # issue 41's worst rows (Megatron-Core 1.7B and 7.1B, +38.6% and +32.9%): their rank's 60 GEMMs (forward,
    # input and weight gradient of qkv, proj, fc1, fc2 and the output layer) ran at 607-800 TFLOP/s, and the preset's
    # GEMM model (published constants only) is within 4% at the median of them (90th percentile 15%): the rows' error
    # is not in their GEMMs
    linears = op_table.rows(run(1), ["gemm_rows"])
    assert len(linears) == 60
    tflops = [row.source["tflops"] for row in linears]
    assert (round(min(tflops)), round(max(tflops))) == (607, 800)
    errors = sorted(abs(op_table.predicted(row, device_model("H100 SXM")) / row.seconds - 1) for row in linears)
    assert statistics.median(errors) <= 0.05 and errors[int(0.9 * len(errors))] <= 0.15


def test_held_out_ops_the_measured_file_fixes() -> None:
    # the H100 preset's flash attention curve is FlashAttention-3's (its paper's figures); torch's SDPA runs
    # FlashAttention-2, which the preset predicts 41% fast at the median; unfused attention has no published H100
    # curve (the preset times it at peak): 85% fast. The file fitted to the other half of the ops: within 6%
    _, held_out = gpu_tables_h100.split_rows()
    preset, measured = device_model("H100 SXM"), device_model("H100 SXM measured")
    for kernel, at_least in (("flash", 0.35), ("math", 0.8)):
        rows = [r for r in held_out if r.kind == "attention" and r.kernel == kernel]
        assert median_error(rows, preset) >= at_least and median_error(rows, measured) <= 0.06, kernel
    cudnn = [r for r in held_out if r.kind == "attention" and r.kernel == "cudnn"]
    assert median_error(cudnn, measured) <= 0.05 and median_error(cudnn, preset) <= 0.11  # FA3 paper's cuDNN bars


def test_profile_module_latency_is_near_the_kernel_time_on_the_h100() -> None:
    # module latency with the host queued ahead against torch.profiler's kernels for the same module: GPT-2's root
    # +6%, lm_head +1%, ResNet-50's root and stages +9..+20% (the H200's run 5: +6%, +0%, +10..+21%)
    profile = run(1)["profile"]
    assert profile["gpt2"]["extra"]["module_latency"].startswith("device time")
    for model in ("gpt2", "resnet50"):
        for name, stats in profile[model]["modules"].items():
            kernels = stats["kernel_seconds"]
            if kernels and kernels >= 1e-3:
                assert 0 <= stats["latency"] / kernels - 1 <= 0.21, (model, name)


def test_the_meters_mfu_on_the_h100_is_the_oracles() -> None:
    meter = run(1)["meter"]
    logged = statistics.median(step["mfu"] for step in meter["logged"])
    assert logged == pytest.approx(meter["mfu_from_oracle"], abs=0.006)  # 31.2% vs 31.5%
    for step in meter["logged"]:
        assert step["mfu"] == pytest.approx(step["flops"] / step["time"] / 989.4e12)


@pytest.mark.parametrize("index", [0, 1])  # Megatron-shaped GPTs, 4 x 2048 and 4 x 4096, sequence 4096, vocab 131072
def test_megatron_shaped_steps_on_one_h100(index) -> None:
    # torch.optim.AdamW (foreach) on bf16 weights, SDPA's cuDNN attention: measured 43.10 / 92.46 ms. Predicted with
    # the optimizer as the foreach kernels it ran: preset -11% / -6%, measured file -2% / +0% (as one fused pass, the
    # old default: -29% / -28% and -20% / -21%)
    import torch

    import fxflops

    label, model, inputs, loss, key = gpu_tables_h100.megatron_steps()[index]
    measured = run(1)["steps"][key]["median"]
    errors = {}
    for device in ("H100 SXM", "H100 SXM measured"):
        for optimizer in (None, "adamw"):
            step = fxflops.predict_step(model, inputs, parallel={}, cluster="DGX H100", device=device,
                                        dtype=torch.bfloat16, attention="cudnn", loss=loss, optimizer=optimizer,
                                        optimizer_state_bytes=None if optimizer else 4)
            errors[device, optimizer] = step.step_time / measured - 1
    assert abs(errors["H100 SXM measured", "adamw"]) <= 0.03 and abs(errors["H100 SXM", "adamw"]) <= 0.13, label
    assert errors["H100 SXM", None] <= -0.25 and errors["H100 SXM measured", None] <= -0.19, label


def test_resnet50s_first_convolution_weight_gradient_runs_split_k() -> None:
    # ResNet-50's conv1 (7x7, 3 -> 64 channels, stride 2) at batch 64: its weight's gradient is a GEMM of 64 x 147
    # outputs over K = 64 x 112 x 112 = 802,816. The run's ResNet-50 step shows cuDNN's wgrad kernels running split
    # along K (`execute_segment_k_on`). Without split-K its 2 tiles of 256 x 128 left 130 of 132 SMs idle: 17.5 ms
    # (preset) and 67.3 ms (measured file) of a 30.92 ms step. Split into 66 parts by hand on the preset: efficiency
    # 0.801 x (64 x 147 / 256^2) x 132/132 x 0.5 (147 bf16 columns: 2-byte rows) = 0.0575, 15.1 GFLOP at 989.4
    # TFLOP/s: 0.2655 ms, + 65 fp32 partials of 64 x 147 through memory (1.6 us) + the 2 us launch
    import torch

    import fxflops
    from fxflops.predict.op_time import gemm_shape, op_time

    kernels = [name for name, _, _ in run(1)["steps"]["ResNet-50, bf16, batch 64"]["kernels"]["top"]]
    assert any("wgrad" in name and "segment_k_on" in name for name in kernels)
    with torch.device("meta"):
        conv1 = torch.nn.Conv2d(3, 64, 7, 2, 3, bias=False).to(torch.bfloat16)
    images = torch.empty(64, 3, 224, 224, device="meta", dtype=torch.bfloat16)
    (wgrad,) = [n for n in fxflops.estimate(conv1, (images,), backward=True).nodes if "convolution_backward" in n.op]
    assert gemm_shape(wgrad) == (64, 147, 802816, 1)
    preset, measured = device_model("H100 SXM"), device_model("H100 SXM measured")
    assert preset.split_k(64, 147, 802816, 2) == measured.split_k(64, 147, 802816, 2) == 66
    flops = 2 * 64 * 147 * 802816
    efficiency = 0.801 * (64 * 147 / 256**2) * 0.5
    expected = flops / (989.4e12 * efficiency) + 2 * 4 * 65 * 64 * 147 / (3.35e12 * 0.887) + 2e-6
    # and cuDNN's NCHW -> NHWC copy of the images before its NHWC wgrad kernel (read and written, a launch)
    images_bytes = 2 * 64 * 3 * 224 * 224 * 2
    expected += images_bytes / preset.class_bandwidth("copy", images_bytes) + 2e-6
    assert op_time(wgrad, preset, "bf16").seconds == pytest.approx(expected, rel=1e-12)  # 0.269 + 0.015 ms
    assert op_time(wgrad, measured, "bf16").seconds < 1.1e-3  # its 2-byte rows at the measured 0.14 of aligned ones


# (label key, measured peak less what was resident, GiB to 2 places; predicted): the peak memory of each training
# step on the H100 (run 1), never fitted. The step's highest moment, the gradients as torch keeps them (made in the
# backward, freed by zero_grad(set_to_none=True)) and the logits held only as autograd holds them: within 3.2%
# (the earlier sum of every gradient and the saved activations: +1% to +25% over)
STEP_PEAKS = [(0, 18.58, 0.00), (1, 13.01, -0.031), (2, 2.80, -0.011), (3, 4.18, -0.032), (4, 11.27, 0.006),
              (5, 18.78, 0.007)]


@pytest.mark.parametrize("index, measured_gib, error", STEP_PEAKS)
def test_training_steps_peak_memory_on_one_h100(index, measured_gib, error) -> None:
    import torch

    import fxflops
    from gpu_tables import unseen_steps

    label, model, inputs, loss, key = (unseen_steps() + gpu_tables_h100.megatron_steps())[index]
    measured = gpu_tables_h100.own_peak(run(1)["steps"], key)
    assert round(measured / 2**30, 2) == measured_gib
    step = fxflops.predict_step(model, inputs, parallel={}, cluster="DGX H100", device="H100 SXM",
                                dtype=torch.bfloat16, attention="cudnn", loss=loss, optimizer="adamw")
    memory = step.memory[0]
    assert memory.gradients_kept == "eager"
    assert memory.tensor_bytes / measured - 1 == pytest.approx(error, abs=0.003), label


def _resnet_step_nodes() -> tuple[list, dict]:
    import fxflops

    _, model, inputs, loss, key = gpu_tables_h100.unseen_steps()[2]
    return fxflops.estimate(model, inputs, backward=True, loss=loss).nodes, run(1)["steps"][key]["kernels"]


def test_resnet50s_layout_conversions_are_one_per_convolution_call() -> None:
    # cuDNN ran its NHWC kernels on the step's bf16 NCHW tensors: 158 nchwToNhwcKernel launches, one for each of the
    # 53 convolutions' forward, the 52 input gradients (conv1's input needs none) and the 53 weight gradients; the
    # model counts the same from the captured ops. The 68 nhwcToNchwKernel launches (1.02 ms) have no rule yet
    from fxflops.predict.cuda_kernels import conversion_bytes

    nodes, kernels = _resnet_step_nodes()
    launches = {name.split("<")[0].split("::")[-1]: count for name, _, count in kernels["top"] if "Nhwc" in name or "Nchw" in name}
    assert launches == {"nchwToNhwcKernel": 158, "nhwcToNchwKernel": 68}
    assert sum(conversion_bytes(node, 2, 1)[1] for node in nodes) == 158


def test_resnet50s_batch_norm_kernels_against_the_run() -> None:
    # torch's NCHW batch norm kernels of the step (53 launches each): measured 3.77 ms (statistics), 2.26 (transform),
    # 9.02 (backward). Timed from their launch configurations at the published 400-cycle load latency they come out
    # 1.96 / 1.06 / 4.17 ms on the H100 preset: the ratios between the three follow the measurement (1 : 0.60 : 2.39
    # measured, 1 : 0.54 : 2.12 modelled), the level is about half (what the kernels imply is a load latency of about
    # 410 ns under load, twice the unloaded figure: not fitted, docs/guide/gpu.md). Before: 2.62 ms for all of them
    from fxflops.predict.cuda_kernels import batch_norm_launches, launch_seconds

    nodes, kernels = _resnet_step_nodes()
    measured = {name.split("<")[0].split("::")[-1]: (seconds, count) for name, seconds, count in kernels["top"]
                if "batch_norm" in name}
    h100 = device_model("H100 SXM")
    predicted: dict[str, float] = {}
    for node in nodes:
        for launch in batch_norm_launches(node, 2) or []:
            predicted[launch.name] = predicted.get(launch.name, 0.0) + h100.launch_overhead + launch_seconds(
                launch, h100.sm_count, h100.threads_per_sm, h100.memory_latency, h100.sustained)
    ratios = {name: predicted[name] / seconds for name, (seconds, count) in measured.items()}
    assert {name: count for name, (_, count) in measured.items()} == {
        "batch_norm_backward_kernel": 53, "batch_norm_collect_statistics_kernel": 53,
        "batch_norm_transform_input_kernel": 53}
    assert all(0.45 <= ratio <= 0.55 for ratio in ratios.values()), ratios


@pytest.mark.parametrize("device, measured_file", [("H100 SXM", False), ("H100 SXM measured", True)])
def test_resnet50s_step_on_the_h100(device, measured_file) -> None:
    # measured 30.92 ms; split-K alone left it at 11.14 / 12.99 ms (-64% / -58%); with torch's batch-norm kernels and
    # cuDNN's layout conversions timed: 18.87 / 20.33 ms (-39% / -34%)
    import torch

    import fxflops

    _, model, inputs, loss, key = gpu_tables_h100.unseen_steps()[2]
    step = fxflops.predict_step(model, inputs, parallel={}, cluster="DGX H100", device=device, dtype=torch.bfloat16,
                                attention="cudnn", loss=loss, optimizer="adamw")
    error = step.step_time / run(1)["steps"][key]["median"] - 1
    assert (-0.36 <= error <= -0.32) if measured_file else (-0.41 <= error <= -0.37), error


def vit_kernel_class(name: str) -> str:
    """The class of one kernel of the ViT step by its name in torch.profiler (docs/guide/gpu.md's table)."""
    classes = (("nvjet", "gemm"), ("splitKreduce", "gemm"), ("cutlass", "patch conv"), ("Nhwc", "patch conv"),
               ("Nchw", "patch conv"), ("fprop", "attention fwd"), ("sdpa", "attention bwd"),
               ("cudnn::fusion", "attention bwd"), ("vectorized_layer_norm", "layer norm fwd"),
               ("GammaBeta", "layer norm bwd"), ("layer_norm_grad_input", "layer norm bwd"),
               ("GeluBackward", "gelu bwd"), ("Gelu", "gelu fwd"), ("CUDAFunctor_add", "add"),
               ("reduce_kernel", "sum"), ("direct_copy", "copy"), ("Memcpy", "copy"), ("Fill", "copy"),
               ("CatArray", "copy"), ("multi_tensor_apply", "optimizer"), ("softmax", "loss"), ("Memset", "memset"))
    return next(klass for part, klass in classes if part in name)


# (class, launches, ms) of the ViT-B/16 step's 40 longest kernels (torch.profiler), H100 run 1 and H200 run 7
VIT_KERNELS = {
    "h100_run1": {"gemm": (159, 9.17), "patch conv": (9, 0.88), "attention fwd": (12, 0.55),
                  "attention bwd": (36, 2.08), "layer norm fwd": (25, 0.70), "layer norm bwd": (50, 2.01),
                  "gelu fwd": (12, 0.69), "gelu bwd": (12, 0.92), "add": (86, 3.48), "sum": (52, 1.62),
                  "copy": (184, 5.33), "optimizer": (40, 1.47), "loss": (1, 0.00), "memset": (113, 0.13)},
    "h200_run7": {"gemm": (183, 9.20), "patch conv": (9, 0.87), "attention fwd": (12, 0.55),
                  "attention bwd": (36, 1.87), "layer norm fwd": (25, 0.70), "layer norm bwd": (50, 1.93),
                  "gelu fwd": (12, 0.65), "gelu bwd": (12, 0.84), "add": (86, 2.93), "sum": (52, 1.47),
                  "copy": (185, 5.02), "optimizer": (40, 1.19), "loss": (1, 0.00), "memset": (113, 0.12)},
}


@pytest.mark.parametrize("name", sorted(VIT_KERNELS))
def test_vit_steps_kernels_by_class(name) -> None:
    # what the table in docs/guide/gpu.md holds as measured: every one of the 40 longest kernels has a class, and
    # they are the step's busy time but for 0.01 ms
    kernels = json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))["steps"]["ViT-B/16, bf16, batch 64"][
        "kernels"]
    classes: dict[str, list] = {}
    for kernel, seconds, count in kernels["top"]:
        entry = classes.setdefault(vit_kernel_class(kernel), [0, 0.0])
        entry[0] += count
        entry[1] += seconds
    assert {klass: (count, round(seconds * 1e3, 2)) for klass, (count, seconds) in classes.items()} == VIT_KERNELS[name]
    assert kernels["busy_seconds"] - sum(seconds for _, seconds, _ in kernels["top"]) < 2e-5


def test_vit_steps_layer_norms_copy_their_strided_inputs() -> None:
    # nn.MultiheadAttention (batch_first) hands back a transposed view, so each block's residual sum x + input is laid
    # out like it (an elementwise output follows its first input's strides): 12 ln_2 inputs, the 11 ln_1 inputs after
    # the first block and the final ln's are strided, and torch's CUDA layer norm copies each to a contiguous tensor,
    # forward and backward (24 + 24), plus the 12 ln_1 output gradients (the attention's input transposed back). The
    # run's 25 GammaBetaBackward kernels are the 25 backward ops' weight gradients
    from fxflops.predict.cuda_kernels import layer_norm_launches

    import fxflops

    _, model, inputs, loss, key = gpu_tables_h100.unseen_steps()[3]
    nodes = fxflops.estimate(model, inputs, backward=True, loss=loss).nodes
    launches = [layer_norm_launches(n, 2) for n in nodes if "native_layer_norm" in n.op]
    assert len(launches) == 50
    assert sum(copies for _, copies, _, _ in launches) == 60 and sum(r for _, _, _, r in launches) == 25
    gamma_beta = [count for kernel, _, count in run(1)["steps"][key]["kernels"]["top"] if "GammaBeta" in kernel]
    assert gamma_beta == [25]


@pytest.mark.parametrize("device, low, high", [("H100 SXM", -0.20, -0.18), ("H100 SXM measured", -0.16, -0.14)])
def test_vit_step_on_the_h100(device, low, high) -> None:
    # measured 31.22 ms; predicted 24.03 / 25.20 ms (-23% / -19%) before the layer norm's copies and second backward
    # kernel, 25.31 / 26.53 ms (-19% / -15%) with them
    import torch

    import fxflops

    _, model, inputs, loss, key = gpu_tables_h100.unseen_steps()[3]
    step = fxflops.predict_step(model, inputs, parallel={}, cluster="DGX H100", device=device, dtype=torch.bfloat16,
                                attention="cudnn", loss=loss, optimizer="adamw", optimizer_state_bytes=4)
    error = step.step_time / run(1)["steps"][key]["median"] - 1
    assert low <= error <= high, error
