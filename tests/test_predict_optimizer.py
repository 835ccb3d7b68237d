"""The optimizer step's time and the distributed optimizer's parameter all-gather, by hand."""

from __future__ import annotations

import pytest

from fxflops.predict.comm_time import collective_seconds
from fxflops.predict.hardware import cluster
from fxflops.predict.layers import LayerCosts, Part
from fxflops.predict.step import StepPlan, simulate_plan
from fxflops.predict.step_memory import OPTIMIZER_STATE_BYTES

A100 = cluster("DGX A100 80GB")
PARAMS = 50_000_000  # a layer's parameter elements


def costs(layers: int = 4, forward: float = 1.0, params: int = PARAMS) -> LayerCosts:
    block = Part(forward=forward, backward=2.0, forward_flops=100, backward_flops=200, params=params)
    return LayerCosts(1, False, 1, 1000, layers, block, Part(), Part(), 0, 2, "bfloat16", "A100", layers)


def test_optimizer_step_reads_and_writes_the_state_the_memory_counts() -> None:
    # one rank, 4 layers of 5e7 bf16 parameters, Adam with fp32 master weights: the state the memory per stage
    # counts (12 B: master, m, v) read and written, the bf16 gradient read, the bf16 parameter written, in one
    # memory-bound pass; before, the time read and wrote 16 B of state a parameter while the memory counted 12
    assert OPTIMIZER_STATE_BYTES == 12
    plan = StepPlan(global_batch=1)
    prediction = simulate_plan(costs(), plan, A100)
    state = 4 * PARAMS * (2 * 12 + 2 + 2) / A100.device.sustained + A100.device.launch_overhead
    assert prediction.breakdown["optimizer"] == pytest.approx(state)
    assert prediction.optimizer_state_bytes == 12
    # torch's AdamW on a bf16 model (m, v in bf16: 4 B): time and memory follow the one setting
    adamw = simulate_plan(costs(), plan, A100, optimizer_state_bytes=4)
    assert adamw.breakdown["optimizer"] == pytest.approx(
        4 * PARAMS * (2 * 4 + 2 + 2) / A100.device.sustained + A100.device.launch_overhead)
    assert adamw.optimizer_state_bytes == 4
    # a plan's own optimizer_bytes_per_param still overrides the time (0: no state)
    none = simulate_plan(costs(), StepPlan(global_batch=1, optimizer_bytes_per_param=0), A100)
    assert none.breakdown["optimizer"] == pytest.approx(
        4 * PARAMS * (2 + 2) / A100.device.sustained + A100.device.launch_overhead)


def test_param_gather_after_the_step_or_one_layer_ahead_of_the_next_forward() -> None:
    # dp = 2 in a node, the distributed optimizer: each rank updates half the parameters (no state here) and the
    # updated halves are all-gathered; without overlap after the step (one gather of the 4 layers), with --overlap-param-gather one bucket (layer) ahead of the
    # next forward, a gather a unit (the embedding and head parts hold no parameters: a latency each): the
    # embedding's gather, then the first layer's exposed, the other three hidden behind 1 s
    # forwards (each takes well under a second), the head's behind the last layer
    plan = StepPlan(dp=2, global_batch=2, distributed_optimizer=True, optimizer_bytes_per_param=0)
    layer = collective_seconds("all_gather", PARAMS * 2, 2, A100, 2)
    empty = collective_seconds("all_gather", 0, 2, A100, 2)
    assert 0 < empty < layer < 1.0
    update = 4 * PARAMS / 2 * (2 + 2) / A100.device.sustained + A100.device.launch_overhead
    after = simulate_plan(costs(), plan, A100)
    assert after.breakdown["optimizer"] == pytest.approx(update + collective_seconds("all_gather", 4 * PARAMS * 2, 2,
                                                                                      A100, 2))
    overlapped = simulate_plan(costs(), StepPlan(**{**plan.as_dict(), "overlap_param_gather": True}), A100)
    assert overlapped.breakdown["optimizer"] == pytest.approx(update + empty + layer)
    # forwards that take no time hide nothing: every gather waited for in turn, the head's last
    bare = simulate_plan(costs(forward=0.0), StepPlan(**{**plan.as_dict(), "overlap_param_gather": True}), A100)
    assert bare.breakdown["optimizer"] == pytest.approx(update + 2 * empty + 4 * layer)


def test_overlap_param_gather_needs_the_distributed_optimizer() -> None:
    with pytest.raises(ValueError, match="overlap_param_gather .* distributed_optimizer=True and fsdp=False"):
        simulate_plan(costs(), StepPlan(dp=2, global_batch=2, overlap_param_gather=True), A100)
    with pytest.raises(ValueError, match="distributed_optimizer=True and fsdp=False"):
        simulate_plan(costs(), StepPlan(dp=2, global_batch=2, fsdp=True, distributed_optimizer=True,
                                        overlap_param_gather=True), A100)
