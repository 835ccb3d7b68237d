"""The optimizer step timed as the kernels its implementation launches (fxflops.predict.optimizer_time), by hand
from torch/optim/adam.py and sgd.py (torch 2.14.1) and ATen's MultiTensorApply.cuh."""

from __future__ import annotations

import math

import pytest
import torch

from fxflops.predict.hardware import cluster
from fxflops.predict.layers import LayerCosts, Part
from fxflops.predict.optimizer_time import MASTER_FUSED, element_bytes, optimizer_kernels
from fxflops.predict.step import StepPlan, simulate_plan

A100 = cluster("DGX A100 80GB")
# distinct element sizes so a pass counting the wrong operand shows: parameter 2 B, gradient 4 B, state 8 B
P, G, S = 2, 4, 8


def per_element(optimizer, implementation=None) -> int:
    return optimizer_kernels(optimizer, implementation).bytes_per_element(P, G, S)


def adam(**options) -> torch.optim.Optimizer:
    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=1e-3, **options)


def test_adamw_passes_per_implementation() -> None:
    # foreach (torch's CUDA default), _multi_tensor_adam: mul_(params) 2P, lerp_(m, g) 2S+G, mul_(v) 2S,
    # addcmul_(v, g, g) 2S+G (the gradient read once), sqrt(v) 2S, div_ 2S, add_(eps) 2S, addcdiv_(p, m, d) 2P+2S
    # = 4P + 14S + 2G; the single-tensor loop runs the same operations
    assert per_element("adamw") == 4 * P + 14 * S + 2 * G == 128
    assert per_element("adamw", "for_loop") == 128
    assert len(optimizer_kernels("adamw").passes) == 8
    # bf16 everywhere: 40 B a parameter element, 20 passes' worth of a 2-byte element
    assert optimizer_kernels("adamw").bytes_per_element(2, 2, 2) == 40
    # fused (_fused_adamw_): parameter read and written, gradient read, m and v read and written
    assert per_element("adamw", "fused") == 2 * P + G + 4 * S == 40
    # fxflops' default: one fused kernel, the state (12 B: fp32 master, m, v) read and written, gradient read, the
    # bf16 parameter written; the formula the step used before implementations existed
    assert MASTER_FUSED.bytes_per_element(2, 2, 12) == 2 * 12 + 2 + 2


def test_adam_and_its_options() -> None:
    # Adam without weight decay: no mul_(params): 2P + 14S + 2G
    assert per_element("adam") == 2 * P + 14 * S + 2 * G == 124
    # coupled weight decay: grads = _foreach_add(grads, params) reads G and P, writes G
    assert per_element(adam(weight_decay=0.1)) == 124 + 2 * G + P
    # amsgrad: _foreach_maximum_(max_v, v) reads both, writes max_v; fused reads and writes max_v too
    assert per_element(adam(amsgrad=True)) == 124 + 3 * S
    assert per_element(adam(amsgrad=True), "fused") == 2 * P + G + 6 * S
    # maximize: grads = _foreach_neg(grads)
    assert per_element(adam(maximize=True)) == 124 + 2 * G
    # capturable: foreach divides the denominator by the step-size tensors (one more pass) and runs 9 kernels over
    # the per-tensor step scalars; the loop folds the step size into its division and add_, 10 scalar kernels
    capturable = optimizer_kernels(adam(capturable=True))
    assert capturable.bytes_per_element(P, G, S) == 124 + 2 * S and capturable.scalar_kernels == 9
    loop = optimizer_kernels(adam(capturable=True), "for_loop")
    assert loop.bytes_per_element(P, G, S) == 124 and loop.scalar_kernels == 10


def test_sgd_passes() -> None:
    sgd = torch.optim.SGD
    param = [torch.nn.Parameter(torch.zeros(2))]
    # plain SGD: add_(params, grads): 2P + G
    assert per_element("sgd") == 2 * P + G
    # weight decay: grads = add(grads, params) 2G + P first
    assert per_element(sgd(param, lr=0.1, weight_decay=0.1)) == 2 * P + G + 2 * G + P
    # momentum: mul_(buf) 2S, add_(buf, g) 2S + G, add_(params, buf) 2P + S
    assert per_element(sgd(param, lr=0.1, momentum=0.9)) == 5 * S + G + 2 * P
    # nesterov: add_(grads, buf) 2G + S, then add_(params, grads) 2P + G
    assert per_element(sgd(param, lr=0.1, momentum=0.9, nesterov=True)) == 4 * S + G + 2 * G + S + 2 * P + G
    # fused: parameter and buffer read and written, gradient read
    assert per_element(sgd(param, lr=0.1, momentum=0.9), "fused") == 2 * P + G + 2 * S
    assert optimizer_kernels(sgd(param, lr=0.1, momentum=0.9)).state_tensors == 1


def test_implementation_from_the_instance() -> None:
    assert optimizer_kernels("adamw").implementation == "foreach"  # torch's default on CUDA
    assert optimizer_kernels(adam(foreach=False)).implementation == "for_loop"
    assert optimizer_kernels(adam(fused=True)).implementation == "fused"
    assert optimizer_kernels(adam(fused=True), "foreach").implementation == "foreach"  # the argument wins
    # torch's _default_to_fused_or_foreach: a differentiable step runs the single-tensor loop
    assert optimizer_kernels(adam(differentiable=True)).implementation == "for_loop"


def test_launches() -> None:
    adamw = optimizer_kernels("adamw")
    # the measured Llama: 852,559,872 elements in 147 tensors: 13,010 chunks of 65,536, 41 launches of 320 chunks
    # per kernel (the tensor limit, 36 a launch at depth 3, needs only 5), 8 kernels: 328, as the profiler counted
    assert math.ceil(852_559_872 / 65536) == 13_010 and adamw.launches(852_559_872, 147) == 8 * 41
    # 100 small tensors (16 chunks): the tensor limits decide: mul_ x2 and add_ (110 a launch) 1 each, div_ with its
    # scalar list (96) 2, lerp_ and sqrt (depth 2: 64) 2 each, addcmul_ and addcdiv_ (depth 3: 48) 3 each
    assert adamw.launches(1_000_000, 100) == 1 + 1 + 1 + 2 + 2 + 2 + 3 + 3
    # the loop: one kernel per operation per tensor
    assert optimizer_kernels("adamw", "for_loop").launches(1_000_000, 100) == 800
    assert MASTER_FUSED.launches(1_000_000, 100) == 1


def costs(layers: int = 4, params: int = 50_000_000, tensors: int = 40) -> LayerCosts:
    block = Part(forward=1.0, backward=2.0, forward_flops=100, backward_flops=200, params=params,
                 tensors=tensors // layers)
    return LayerCosts(1, False, 1, 1000, layers, block, Part(), Part(), 0, 2, "bfloat16", "A100", layers)


def test_optimizer_time_foreach_against_fused() -> None:
    # 4 layers of 5e7 bf16 parameters in 40 tensors on one A100. Fused default (12 B of state): 2e8 x 28 B and one
    # launch. torch's AdamW foreach on the bf16 model (4 B of state: m and v in bf16): 2e8 x 40 B, and 3,052 chunks
    # make 10 launches of each of the 8 kernels (40 tensors need at most 2)
    device = A100.device
    fused = simulate_plan(costs(), StepPlan(global_batch=1), A100)
    assert fused.breakdown["optimizer"] == pytest.approx(2e8 * 28 / device.sustained + device.launch_overhead)
    plan = StepPlan(global_batch=1, optimizer_kernels=optimizer_kernels("adamw"))
    foreach = simulate_plan(costs(), plan, A100, optimizer_state_bytes=4)
    assert foreach.breakdown["optimizer"] == pytest.approx(2e8 * 40 / device.sustained + 80 * device.launch_overhead)
    assert any("adamw foreach" in note and "40 B per parameter element" in note for note in foreach.notes)
    assert any("one fused kernel: 28 B per parameter element" in note for note in fused.notes)
    # the loop: the same bytes, 8 kernels for each of the 40 tensors
    loop = simulate_plan(costs(), StepPlan(global_batch=1, optimizer_kernels=optimizer_kernels("adamw", "for_loop")),
                         A100, optimizer_state_bytes=4)
    assert loop.breakdown["optimizer"] == pytest.approx(2e8 * 40 / device.sustained + 320 * device.launch_overhead)
    # FSDP2's fp32 shards of a bf16 model (torchtitan's rows): 12 B of state = fp32 copies + m + v, so the optimizer
    # steps 4-byte parameters and state; fp32 gradients: 4 x 4 + 14 x 4 + 2 x 4 = 80 B
    shards = simulate_plan(costs(), StepPlan(global_batch=1, grad_bytes=4, optimizer_kernels=optimizer_kernels("adamw")),
                           A100, optimizer_state_bytes=12)
    assert shards.breakdown["optimizer"] == pytest.approx(2e8 * 80 / device.sustained + 80 * device.launch_overhead)


def test_validation_rows_keep_the_fused_default_but_torchtitan() -> None:
    from fxflops.predict.validation import RUNS, _optimizer_options

    torch_rows = [run.name for run in RUNS if run.torch_optimizer]
    # torchtitan's train.py at 0413364: torch.optim.AdamW(..., foreach=True); Megatron-LM, DeepSpeed, Composer and
    # Meta's runs keep fxflops' fused default
    assert torch_rows == ["Llama 3 70B, FSDP, full AC", "Llama 2 70B, FSDP, full AC", "Llama 2 13B, FSDP, no AC"]
    assert all(run.source.startswith("torchtitan") for run in RUNS if run.torch_optimizer)
    assert all(_optimizer_options(run) == {} for run in RUNS if not run.torch_optimizer)
    assert _optimizer_options(RUNS[-1]) == {"optimizer": "adamw", "optimizer_impl": "foreach",
                                            "optimizer_state_bytes": 12}
    assert StepPlan().optimizer_kernels is None  # the plan's default: one fused kernel


def test_errors_name_what_to_give() -> None:
    import fxflops

    with pytest.raises(ValueError, match="optimizer_impl='multi': pick one of fused, foreach, for_loop"):
        optimizer_kernels("adamw", "multi")
    with pytest.raises(ValueError, match="optimizer must be one of"):
        optimizer_kernels("lion")
    with pytest.raises(ValueError, match="optimizer_state_bytes=6 does not describe torch.optim's adamw foreach.*"
                                         "give 4 .* or 12"):
        element_bytes(optimizer_kernels("adamw"), 6, 2)
    model, ids = torch.nn.Linear(4, 4), (torch.zeros(1, 4),)
    with pytest.raises(ValueError, match="optimizer_impl='foreach' times torch.optim's own kernels: name the optimizer"):
        fxflops.predict_step(model, ids, optimizer_impl="foreach")
    with pytest.raises(ValueError, match="optimizer_state_bytes=6"):
        fxflops.predict_step(model, ids, optimizer="adamw", optimizer_state_bytes=6)
    with pytest.raises(ValueError, match="predict_step: optimizer_impl='multi': pick one of fused, foreach, for_loop"):
        fxflops.predict_step(model, ids, optimizer="adamw", optimizer_impl="multi")


def test_measured_multi_tensor_launches_and_times() -> None:
    # torch.profiler on an H200 (run 7) and an H100 (run 1), torch 2.11 + CUDA 13, AdamW defaults on bf16 models:
    # the multi_tensor_apply launches the profiler counted are the ones predicted for the models whose parameter
    # tensors are known here (Llama 147, ViT-B/16 152 -- torchvision's -- and the Megatron-shaped GPTs 69), and
    # the foreach prediction on each GPU's measured device file is within 20% of the kernels' time (fused: 70%+ short)
    import json
    from pathlib import Path

    from fxflops.predict.hardware import device_model

    results = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "gpu"
    data = Path(__file__).resolve().parent.parent / "fxflops" / "predict" / "data" / "devices"
    tensors = {"Llama GQA": 147, "ViT-B/16": 152, "Megatron GPT": 69}
    adamw = optimizer_kernels("adamw")
    for run, device in (("h200_run7.json", "h200_sxm_measured.toml"), ("h100_run1.json", "h100_sxm_measured.toml")):
        model = device_model(str(data / device))
        for key, entry in json.loads((results / run).read_text(encoding="utf-8"))["steps"].items():
            kernels = [(s, n) for name, s, n in entry["kernels"]["top"] if "multi_tensor_apply" in name]
            measured, launches = sum(s for s, _ in kernels), sum(n for _, n in kernels)
            count = next((n for prefix, n in tensors.items() if key.startswith(prefix)), 0)
            if count:
                assert adamw.launches(entry["params"], count) == launches, key
            foreach = adamw.seconds(entry["params"], count, 2, 2, 2, model)
            fused = MASTER_FUSED.seconds(entry["params"], count, 2, 2, 4, model)
            assert abs(foreach / measured - 1) <= 0.20 and fused / measured < 0.3, (run, key, foreach, measured)


def test_param_groups_each_their_own_kernels() -> None:
    # Hugging Face's Trainer's groups: weight decay on the weights, none on biases and norms. torch steps each group
    # with its own options in its own _multi_tensor_adamw call: Linear(4, 4)'s weight (16 elements) with the decay's
    # mul_ (40 B in bf16), its bias (4) without (36 B): 0.8 x 40 + 0.2 x 36 = 39.2 B; launches 8 + 7 (a launch per
    # pass per group, one tensor each)
    lin = torch.nn.Linear(4, 4)
    decay = torch.optim.AdamW([{"params": [lin.weight]}, {"params": [lin.bias], "weight_decay": 0.0}], lr=1e-3)
    kernels = optimizer_kernels(decay)
    assert kernels.bytes_per_element(2, 2, 2) == pytest.approx(0.8 * 40 + 0.2 * 36)
    assert kernels.launches(20, 2) == 8 + 7 and kernels.state_tensors == 2
    assert kernels.label == ("2 param groups: adamw foreach (weight_decay=0.01) on 80.0% of the elements, "
                             "adamw foreach on 20.0% of the elements")
    # one group's own options, not the defaults: weight_decay 0 everywhere is 7 passes of 36 B
    none = optimizer_kernels(torch.optim.AdamW([{"params": lin.parameters(), "weight_decay": 0.0}], lr=1e-3))
    assert none.bytes_per_element(2, 2, 2) == 36 and none.label == "adamw foreach"
    # a group's own implementation: the bias's group run by the loop (7 kernels for its one tensor, as many as foreach)
    # and a group of frozen parameters stepped by nothing (torch skips parameters without a gradient)
    frozen = torch.nn.Parameter(torch.zeros(8), requires_grad=False)
    mixed = optimizer_kernels(torch.optim.AdamW([{"params": [lin.weight]}, {"params": [frozen]},
                                                 {"params": [lin.bias], "weight_decay": 0.0, "foreach": False}],
                                                lr=1e-3))
    assert mixed.implementation == "mixed" and len(mixed.groups) == 2
    assert [group.implementation for _, _, group in mixed.groups] == ["foreach", "for_loop"]
    assert mixed.launches(20, 2) == 8 + 7
    # the step over 2e8 elements in 40 tensors: the weights' group 1.6e8 (2,442 chunks: 8 launches of each of its 8
    # kernels), the biases' 4e7 (611 chunks: 2 of each of 7); the notes name the groups
    plan = StepPlan(global_batch=1, optimizer_kernels=kernels)
    step = simulate_plan(costs(), plan, A100, optimizer_state_bytes=4)
    device = A100.device
    assert step.breakdown["optimizer"] == pytest.approx(2e8 * 39.2 / device.sustained
                                                        + (8 * 8 + 2 * 7) * device.launch_overhead)
    assert any("2 param groups" in note and "39.2 B per parameter element" in note for note in step.notes)


def test_torch_optim_reads_gradients_of_its_parameters_dtype() -> None:
    # torch.optim's gradients are its parameters' dtype (AccumulateGrad's; FSDP2 casts the reduced gradient to its
    # fp32 shard's), whatever the reduction ran in: a bf16 model with an fp32 reduction steps 2-byte gradients (40 B),
    # fp32 shards with a bf16 reduction 4-byte ones (4 x 4 + 14 x 4 + 2 x 4 = 80 B)
    device = A100.device
    adamw = optimizer_kernels("adamw")
    bf16 = simulate_plan(costs(), StepPlan(global_batch=1, grad_bytes=4, optimizer_kernels=adamw), A100,
                         optimizer_state_bytes=4)
    assert bf16.breakdown["optimizer"] == pytest.approx(2e8 * 40 / device.sustained + 80 * device.launch_overhead)
    shards = simulate_plan(costs(), StepPlan(global_batch=1, optimizer_kernels=adamw), A100, optimizer_state_bytes=12)
    assert shards.breakdown["optimizer"] == pytest.approx(2e8 * 80 / device.sustained + 80 * device.launch_overhead)
    # the fused default keeps reading the gradient as reduced (Megatron's fp32 main_grad): 24 + 4 + 2
    fused = simulate_plan(costs(), StepPlan(global_batch=1, grad_bytes=4), A100)
    assert fused.breakdown["optimizer"] == pytest.approx(2e8 * 30 / device.sustained + device.launch_overhead)


def gpt(layers: int, tie: bool = False):
    from fxflops.predict.validation import GPT

    with torch.device("meta"):
        return GPT(layers, 256, 8, vocab=1024, seq=256, tie=tie).to(torch.bfloat16)


# GPT(hidden 256, vocab 1024, seq 256): a block holds 16 tensors (2 layer norms' 4, query / key / value / out_proj's
# 8, the MLP's 4) of 4 x 256 + 4 x (256^2 + 256) + 2 x 256 x 1024 + 1024 + 256 = 789,760 elements; before the blocks
# the two embeddings (1024 + 256) x 256 = 327,680 in 2 tensors, after them the final norm and the head:
# 512 + 1024 x 256 = 262,656 in 3
BLOCK, PRE, POST = 789_760, 327_680, 262_656


def test_parts_count_their_trainable_tensors() -> None:
    from fxflops.predict.step import capture_costs

    ids = torch.zeros(1, 256, dtype=torch.long)
    costs_of = capture_costs(gpt(2), ids, A100)
    assert (costs_of.block.tensors, costs_of.pre.tensors, costs_of.post.tensors) == (16, 2, 3)
    assert costs_of.at_depth(8).param_tensors == 8 * 16 + 5
    # a tied head is the embedding's tensor, stepped once; a frozen one is not stepped
    tied = gpt(2, tie=True)
    tied.position_embeddings.weight.requires_grad_(False)
    costs_of = capture_costs(tied, ids, A100)
    assert (costs_of.pre.tensors, costs_of.post.tensors) == (1, 2)


def test_search_and_pipeline_stages_launch_per_their_tensors() -> None:
    # the loop launches its 8 AdamW kernels per parameter tensor: 8 layers on one GPU hold 8 x 16 + 5 tensors, the
    # same in the plan search (captured 2 layers deep) as in predict_step; a pipeline's first stage 4 x 16 + 2, its
    # last 4 x 16 + 3 (the tensors where they are, not in proportion to the elements)
    import warnings

    import fxflops

    device = A100.device
    ids = torch.zeros(1, 256, dtype=torch.long)
    whole = 8 * BLOCK + PRE + POST
    expected = whole * 40 / device.sustained + 8 * 133 * device.launch_overhead
    step = fxflops.predict_step(gpt(8), ids, cluster=A100, optimizer="adamw", optimizer_impl="for_loop")
    assert step.breakdown["optimizer"] == pytest.approx(expected)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = fxflops.plan(gpt, gpus=1, cluster=A100, global_batch=1, seq_len=256, layers=8, tp=(1,),
                             micro_batch=(1,), recompute=("none",), optimizer="adamw", optimizer_impl="for_loop")
    assert found.rows[0].prediction.breakdown["optimizer"] == pytest.approx(expected)
    staged = fxflops.predict_step(gpt(8), ids, {"pp": 2}, cluster=A100, global_batch=2, optimizer="adamw",
                                  optimizer_impl="for_loop")
    first, last = staged.ranks
    assert first.optimizer == pytest.approx((4 * BLOCK + PRE) * 40 / device.sustained
                                            + 8 * 66 * device.launch_overhead)
    assert last.optimizer == pytest.approx((4 * BLOCK + POST) * 40 / device.sustained
                                           + 8 * 67 * device.launch_overhead)


def test_expert_parallel_ranks_step_their_own_experts_tensors() -> None:
    # MoEModel(vocab 256, dim 64, hidden 128, 4 experts, top 2, 8 layers; more layers than experts, so the layers are
    # the repeated blocks): a block holds its RMSNorm's weight, the
    # router's, a shared expert's w1 / w2 / w3 and the experts'. Under ep=2 a ModuleList of 4 experts (3 tensors
    # each) is split 2 per rank: 1 + 1 + 3 + 2 x 3 = 11 tensors a rank; torchtitan's grouped weights are sliced,
    # 3 on every rank: 1 + 1 + 3 + 3 = 8. The embedding and the head 1 each
    import warnings

    from fxflops.predict.step import capture_costs
    from tests.moe_models import MoEModel

    tokens = torch.zeros(2, 16, dtype=torch.long)
    for layout, block in (("list", 11), ("loop", 8)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            captured = capture_costs(MoEModel(256, 64, 128, 4, 2, 8, layout=layout), tokens, A100, ep=2)
        assert (captured.block.tensors, captured.pre.tensors, captured.post.tensors) == (block, 1, 1), layout
