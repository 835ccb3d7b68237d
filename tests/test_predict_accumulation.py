"""Gradient accumulation over a step's micro-batches, per engine (fxflops.predict.step._accumulation,
_fsdp_accumulation), worked out by hand on synthetic per-layer costs; and the capture's AccumulateGrad copies,
which a real step does not run, left out of the per-layer time (fxflops.predict.layers.accumulate_grad_copy)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fxflops
from fxflops.predict.hardware import cluster
from fxflops.predict.layers import LayerCosts, Part, accumulate_grad_copy
from fxflops.predict.op_time import node_times
from fxflops.predict.step import StepPlan, capture_costs, simulate_plan
from fxflops.predict.validation import GPT, lm_loss

A100 = cluster("DGX A100 80GB")
DEVICE = A100.device
PARAMS = 50_000_000  # a layer's parameter elements on this rank


def costs(params: int = PARAMS, gemm: int = 0, layers: int = 4) -> LayerCosts:
    """`layers` layers of 1 s forward / 2 s backward, each holding `params` elements, `gemm` of them Linear weights."""
    block = Part(forward=1.0, backward=2.0, forward_flops=100, backward_flops=200, params=params,
                 gemm_weight_params=gemm)
    return LayerCosts(1, False, 1, 1000, layers, block, Part(), Part(), 0, 2, "bfloat16", "A100", layers)


def compute(plan: StepPlan, layer_costs: LayerCosts, dtype: str = "bf16") -> float:
    return simulate_plan(layer_costs, plan, A100, dtype).breakdown["compute"]


def test_autograd_adds_into_grad_from_the_second_micro_batch_by_hand() -> None:
    # plain torch / torch DDP (no_sync before the last micro-batch): AccumulateGrad keeps micro-batch 0's gradient
    # as .grad and adds each later one in place (variable_grad += new_grad: read 2 + 2, write 2 bytes), one kernel
    # a chunk; m = 3: two backwards of the 4 layers' 200M elements
    plan = StepPlan(micro_batch=1, global_batch=3)
    add = 4 * PARAMS * 6 / DEVICE.sustained + DEVICE.launch_overhead
    assert compute(plan, costs()) == pytest.approx(3 * 4 * 3.0 + 2 * add, rel=1e-12)
    # one micro-batch: nothing accumulates
    assert compute(dataclasses.replace(plan, global_batch=1), costs()) == 4 * 3.0


def test_megatron_main_grad_hooks_add_every_micro_batch_by_hand() -> None:
    # Megatron-LM's DDP with a contiguous buffer (distributed.py at de7dc40): main_grad.add_(grad) every
    # micro-batch; under bf16 the buffer is fp32 (arguments.py forces accumulate_allreduce_grads_in_fp32):
    # 2 bytes read, 4 read and 4 written an element
    plan = StepPlan(micro_batch=1, global_batch=3, grad_accumulation="main_grad")
    add = 4 * PARAMS * (2 + 4 + 4) / DEVICE.sustained + DEVICE.launch_overhead
    assert compute(plan, costs()) == pytest.approx(3 * (4 * 3.0 + add), rel=1e-12)
    # fp16 without grad_bytes 4: the buffer in the parameters' dtype, 2 + 2 + 2 bytes
    add = 4 * PARAMS * 6 / DEVICE.sustained + DEVICE.launch_overhead
    assert compute(plan, costs(), "fp16") == pytest.approx(3 * (4 * 3.0 + add), rel=1e-12)
    # with grad_bytes 4 (--accumulate-allreduce-grads-in-fp32) an fp32 buffer in fp16 too
    add = 4 * PARAMS * 10 / DEVICE.sustained + DEVICE.launch_overhead
    assert compute(dataclasses.replace(plan, grad_bytes=4), costs(), "fp16") == pytest.approx(3 * (4 * 3.0 + add),
                                                                                             rel=1e-12)


def test_gradient_accumulation_fusion_leaves_the_gemm_weights_to_their_gemm_by_hand() -> None:
    # gradient_accumulation_fusion: each Linear weight's wgrad GEMM accumulates into the fp32 main_grad itself (in
    # its epilogue, timed with the GEMM); the 10M other elements (norms, biases) through the hook, 10 bytes each,
    # every micro-batch
    plan = StepPlan(micro_batch=1, global_batch=2, grad_accumulation="fused")
    layer_costs = costs(gemm=PARAMS - 10_000_000)
    add = 4 * 10_000_000 * 10 / DEVICE.sustained + DEVICE.launch_overhead
    assert compute(plan, layer_costs) == pytest.approx(2 * (4 * 3.0 + add), rel=1e-12)
    # fp16 with a buffer in fp16: Megatron turns the fusion off (arguments.py at 83b1e42), every element hooked
    add = 4 * PARAMS * 6 / DEVICE.sustained + DEVICE.launch_overhead
    assert compute(plan, layer_costs, "fp16") == pytest.approx(2 * (4 * 3.0 + add), rel=1e-12)
    with pytest.raises(ValueError, match="grad_accumulation='apex': pick one of autograd, main_grad, fused"):
        StepPlan(grad_accumulation="apex").check(layers=4)


def test_deepspeed_fp16_is_autograd_whatever_grad_accumulation_says() -> None:
    # DeepSpeed's engine accumulates as its code does (fp16: torch's AccumulateGrad from micro-batch 1)
    plan = StepPlan(micro_batch=1, global_batch=3, pipeline_engine="deepspeed", grad_accumulation="fused")
    add = 4 * PARAMS * 6 / DEVICE.sustained + DEVICE.launch_overhead
    assert compute(plan, costs(gemm=PARAMS), "fp16") == pytest.approx(3 * 4 * 3.0 + 2 * add, rel=1e-12)


def test_fsdp_adds_the_sharded_gradients_after_each_reduce_scatter_by_hand() -> None:
    # FSDP2's foreach_reduce: from the second micro-batch, each layer's reduce-scattered shard (1/dp of its
    # elements) added into the sharded .grad (3 x 2 bytes an element, one kernel) on the reduce stream after the
    # reduce-scatter: hidden behind the next layer's backward but the last layer's, which the backward's end
    # waits for. So a step of m micro-batches takes one such add more per micro-batch after the first.
    plan = StepPlan(dp=2, fsdp=True, micro_batch=1, global_batch=2)  # m = 1
    one = simulate_plan(costs(), plan, A100)
    two = simulate_plan(costs(), dataclasses.replace(plan, global_batch=4), A100)
    add = PARAMS / 2 * 6 / DEVICE.sustained + DEVICE.launch_overhead
    assert two.step_time - 2 * one.step_time + one.breakdown["optimizer"] == pytest.approx(add, rel=1e-9)
    # the wait is on the reduce stream: not compute
    assert two.breakdown["compute"] == pytest.approx(2 * one.breakdown["compute"], rel=1e-12)


def test_the_captures_accumulate_grad_copies_are_not_timed() -> None:
    # the capture copies each leaf's gradient into a new .grad (new_empty_strided + copy_); torch's AccumulateGrad
    # keeps the gradient itself instead: the block's backward is its ops' times less those copies, one a parameter
    with torch.device("meta"):
        model = GPT(2, 256, 8, vocab=1024, seq=128).to(torch.bfloat16)
    ids = torch.zeros(1, 128, dtype=torch.long)
    estimate = fxflops.estimate(model, (ids,), backward=True, loss=lm_loss)
    nodes = list(estimate.nodes)
    copies = [i for i in range(len(nodes)) if accumulate_grad_copy(nodes, i)]
    assert len(copies) == sum(1 for _ in model.parameters())
    layer_costs = capture_costs(model, (ids,), A100, dtype=torch.bfloat16, loss=lm_loss)
    times = node_times(nodes, DEVICE, torch.bfloat16)
    first = [i for i, n in enumerate(nodes) if n.phase != "forward" and n.module.startswith("layers.0.")]
    timed = sum(times[i].seconds for i in first if i not in copies)
    assert sum(times[i].seconds for i in first if i in copies) > 0  # what the capture had charged
    blocks = [sum(times[i].seconds for i, n in enumerate(nodes) if n.phase != "forward" and i not in copies
                  and n.module.startswith(f"layers.{k}.")) for k in (0, 1)]
    assert layer_costs.block.backward == pytest.approx(sum(blocks) / 2, rel=1e-12) and blocks[0] == pytest.approx(timed)
    # the Linear weights of a block, by hand: query, key, value and out_proj h x h, the MLP's two 4h x h
    h = 256
    assert layer_costs.block.gemm_weight_params == 4 * h * h + 2 * 4 * h * h
