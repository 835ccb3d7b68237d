"""What a what-if plan costs to apply: the plan's shards are made on meta tensors (C++ only), not through the
fake mode, so applying it does not grow with the world size; and FSDP's padding of a parameter the ranks do
not divide evenly is what torch pads (hand counts; the shapes of tests/test_parallel_plans.py but a vocabulary
of 250, which 8 ranks do not divide)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fxflops
from tests.parallel_models import Llama

V, D, L, HEADS, F, B, S = 250, 64, 2, 8, 128, 2, 16
T = B * S
FP32 = 4
FWD = L * (4 * 2 * T * D * D + 3 * 2 * T * D * F + 2 * (2 * B * HEADS * S * S * (D // HEADS))) + 2 * T * D * V


@pytest.fixture(scope="module")
def llama():
    with torch.device("meta"):
        return Llama(V, D, L, HEADS, F)


def plan_estimate(model, backward: bool = True, **plan):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxflops.estimate(model, (torch.zeros(B, S, dtype=torch.long),), conventions="torch",
                                backward=backward, parallel=plan)


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_pads_a_parameter_the_ranks_do_not_divide(llama, reshard):
    dp = 8
    est = plan_estimate(llama, dp=dp, reshard_after_forward=reshard)
    assert est.fwd_flops == FWD
    # fully_shard pads dim 0 to a multiple of dp: the 250-row embedding and head gather 256 rows each
    padded = -(-V // dp) * dp
    gathered = (2 * padded * D + D + L * (4 * D * D + 3 * D * F + 2 * D)) * FP32
    totals = {key: (value["count"], value["bytes"]) for key, value in est.collective_totals(("phase", "op")).items()}
    expected = {("forward", "all_gather"): (L + 1, gathered), ("backward", "reduce_scatter"): (L + 1, gathered)}
    if reshard:
        expected[("backward", "all_gather")] = (L + 1, gathered)
    assert totals == expected
    # rank 0 holds the first chunk of each parameter: 32 rows of the 250, an eighth of every other one
    assert est.total_params == 2 * (-(-V // dp)) * D + D // dp + L * (4 * D * D + 3 * D * F + 2 * D) // dp


def _fake_dispatches(model, **plan) -> int:
    counts = lambda: FakeTensorMode.cache_hits + FakeTensorMode.cache_misses + \
        sum(FakeTensorMode.cache_bypasses.values())  # noqa: E731
    before = counts()
    plan_estimate(model, backward=False, **plan)
    return counts() - before


def test_applying_a_plan_does_not_grow_with_the_data_parallel_ranks(llama):
    # FSDP takes a rank's piece of each parameter by chunking it dp ways: on fake tensors each of the dp
    # pieces went through the fake mode (thousands of dispatches at dp=256); on meta tensors none does.
    # Counted as the fake mode counts its dispatches (never timed); a few differ where padding differs
    small, large = _fake_dispatches(llama, tp=2, dp=8), _fake_dispatches(llama, tp=2, dp=256)
    assert large - small < 64, (small, large)


@pytest.mark.parametrize("plan", [dict(tp=2, dp=2), dict(dp=2, fsdp=False)])
def test_a_plan_applies_again_when_its_capture_runs_again(llama, plan):
    # a capture may run a second time (replay's re-capture without it): the plan is applied afresh, where
    # FSDP's state of the run before (taken off the model by the capture's isolation) stayed in torch's table
    # of composable states and fully_shard refused the module
    import functools

    from fxflops.api import _estimate
    from fxflops.parallel.whatif import estimate_plan

    tokens = torch.zeros(B, S, dtype=torch.long)
    once = functools.partial(_estimate, llama, (tokens,), {}, "eager", "torch", None, None, True, None, None, None,
                             "dense", False, False, replay=True, routing="balanced")

    def twice(prepare, whole_memory=True):
        once(prepare=prepare)
        return once(prepare=prepare)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = estimate_plan(llama, plan, twice, ((tokens,), {}))
    plain = plan_estimate(llama, **plan)
    assert (again.fwd_flops, again.bwd_flops, again.total_params) == (plain.fwd_flops, plain.bwd_flops,
                                                                        plain.total_params)
    assert [(c.op, c.bytes, c.module, c.phase, c.group_size, c.per_step) for c in again.collectives] == \
        [(c.op, c.bytes, c.module, c.phase, c.group_size, c.per_step) for c in plain.collectives]


class _ScaledLinear(torch.nn.Module):
    """A linear whose input is scaled by a buffer and a plain tensor attribute, both requiring grad."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.alpha = torch.ones(width, requires_grad=True)
        self.register_buffer("beta", torch.ones(width).requires_grad_(True), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x * self.alpha * self.beta)


@pytest.mark.parametrize("fsdp", [True, False])
def test_a_plan_keeps_the_grad_flag_of_buffers_and_tensor_attributes(fsdp):
    # the plan runs on meta twins of the model's tensors: a buffer or tensor attribute the backward
    # differentiates must keep requires_grad there, or the linear's input gradient is not counted
    width, tokens = 16, 8
    model = _ScaledLinear(width)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = fxflops.estimate(model, (torch.randn(2, 4, width),), conventions="torch", backward=True,
                               parallel={"dp": 2, "fsdp": fsdp})
    assert est.fwd_flops == 2 * tokens * width * width
    assert est.bwd_flops == 2 * (2 * tokens * width * width)  # input gradient + weight gradient
    assert model.alpha.requires_grad and model.beta.requires_grad and model.alpha.device.type == "cpu"
