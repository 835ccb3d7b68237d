"""predict_step and the plan search on the plans that combine pp, cp, ep and DDP: the step runs, each new
group's collectives are timed over its own size and placement (checked against the α-β formulas worked out
here), DDP's gradient buckets overlap the backward with the last one exposed, and the search enumerates the
combinations."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import fxflops
from fxflops.predict.hardware import cluster
from fxflops.predict.layers import LayerCosts, Part
from fxflops.predict.step import StepPlan, capture_costs, dim_ranks_per_node, simulate_plan
from tests.moe_models import MoEModel
from tests.parallel_models import Llama

A100 = cluster("DGX A100 80GB")  # 8 GPUs a node
NO_LATENCY = dataclasses.replace(A100, intra_latency=0.0, inter_latency=0.0)
TOKENS = torch.zeros(2, 16, dtype=torch.long)  # micro-batch 2, 16 positions
MIB = 1 << 20


def quiet(call, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return call(*args, **kwargs)


def all_reduce_by_hand(size: float, n: int, g: int, c=NO_LATENCY) -> float:
    """An all-reduce of `size` bytes over n ranks, g a node, on links without latency: in one node a ring at
    the NVLink bus bandwidth, 2(n-1)/n S/B; across N = n/g nodes NCCL's ring (or tree) at the slower of NVLink
    and the group's g adapters' share, or the hierarchical one (reduce-scatter in the node, all-reduce of S/g
    among the nodes on one adapter share, all-gather in the node), whichever is faster."""
    b_intra, b_inter = c.intra_bandwidth, c.inter_bandwidth * c.nics_per_node / c.gpus_per_node
    if g >= n:
        return 2 * (n - 1) / n * size / b_intra
    nodes = n // g
    ring = 2 * (n - 1) / n * size / min(b_intra, g * b_inter)
    hierarchical = 2 * (g - 1) / g * size / b_intra + 2 * (nodes - 1) / nodes * (size / g) / b_inter
    return min(ring, hierarchical)


def synthetic(layers: int, params: int, experts: int = 0, tp: int = 1, gradients=()) -> LayerCosts:
    """Layers of 1 s forward, 2 s backward holding `params` bf16 elements (`experts` of them in experts)."""
    block = Part(forward=1.0, backward=2.0, forward_flops=100, backward_flops=200, params=params,
                 expert_params=experts)
    return LayerCosts(tp, False, 1, 1000, layers, block, Part(), Part(), 0, 2, "bfloat16", "A100", layers,
                      block_gradients=tuple(gradients))


def test_pp2_cp2_prediction_runs_and_is_the_simulation_of_its_capture() -> None:
    # Llama of width 64, 2 layers, pp=2 x cp=2 (FSDP over the 2 cp ranks by default): 4 GPUs, two stages of one
    # layer; the stages hand each other the rank's 16 / 2 = 8 positions in the predicted dtype: 2 x 8 x 64 x 2 B
    prediction = quiet(fxflops.predict_step, Llama(n_layers=2), (TOKENS,), {"pp": 2, "cp": 2})
    assert prediction.plan.gpus == 4 and prediction.plan.fsdp
    assert [r.role for r in prediction.ranks] == ["first stage", "last stage"]
    assert [r.ranks for r in prediction.ranks] == [2, 2] and [r.layers for r in prediction.ranks] == [1, 1]
    assert prediction.breakdown["bubble"] > 0
    costs = quiet(capture_costs, Llama(n_layers=2), (TOKENS,), A100, cp=2)
    assert costs.boundary_bytes == 2 * 8 * 64 * 2
    same = simulate_plan(costs, prediction.plan, A100)
    assert prediction.step_time == pytest.approx(same.step_time, rel=1e-12)
    # cp with DDP: the gradients all-reduced over dp x cp = 4 ranks
    ddp = quiet(fxflops.predict_step, Llama(n_layers=2), (TOKENS,), {"cp": 2, "dp": 2, "fsdp": False})
    assert not ddp.plan.fsdp and any(name == "dp all_reduce" for _, name, _, _ in ddp.comm_events)


def test_tp2_pp2_ep2_dp2_prediction_runs() -> None:
    # the MoE (4 experts, top 2) with tp=2, pp=2, ep=2 (borrowed from dp=2), FSDP over dp: 8 GPUs, each stage
    # one layer, each role played by tp x dp = 4 ranks; the expert all-to-alls are exposed
    model = MoEModel(256, 64, 128, 4, 2, 2)
    prediction = quiet(fxflops.predict_step, model, (TOKENS,), {"tp": 2, "pp": 2, "ep": 2, "dp": 2},
                       sequence_parallel=False)
    assert prediction.plan.gpus == 8 and prediction.plan.ep == 2
    assert [r.ranks for r in prediction.ranks] == [4, 4] and [r.layers for r in prediction.ranks] == [1, 1]
    assert prediction.breakdown["exposed_comm"] > 0 and prediction.breakdown["bubble"] > 0
    assert prediction.tokens_per_sec == pytest.approx(2 * 2 * 16 / prediction.step_time, rel=1e-12)
    assert " ep=2 " in str(prediction)
    # ep with cp (torchtitan's ep = dp_in_ep x cp) and DDP: predicted too
    both = quiet(fxflops.predict_step, model, (TOKENS,), {"ep": 4, "cp": 2, "dp": 2, "fsdp": False})
    assert both.plan.gpus == 4 and both.plan.expert_group == 1


def test_groups_are_placed_by_their_stride() -> None:
    # ranks numbered tp fastest, then cp, then dp (torchtitan's order), 8 GPUs a node. tp=2, cp=4: the cp group
    # is 4 ranks 2 apart, one node; tp=4, cp=4: 4 ranks 4 apart, 2 a node. ep (dp_in_ep x cp, contiguous after
    # tp) at tp=2 is 4 ranks 2 apart, one node; the ranks holding the same experts (dp x cp / ep = 4) are
    # tp x ep = 8 apart: one a node
    placed = dim_ranks_per_node(StepPlan(tp=2, cp=4, dp=4, ep=4), A100)
    assert (placed["cp"], placed["ep"], placed["fsdp"], placed["fsdp_experts"]) == (4, 4, 4, 1)
    assert dim_ranks_per_node(StepPlan(tp=4, cp=4), A100)["cp"] == 2


def test_ddp_with_cp_and_ep_reduces_each_group_over_its_size_and_links() -> None:
    # tp=2, dp=4, cp=2, ep=2, DDP, one layer holding 2^24 dense and 2^23 expert bf16 elements, buckets large
    # enough for all of a group. Dense gradients: all-reduced over dp x cp = 8 ranks, 2 apart: 4 a node, 2 nodes.
    # Expert gradients: over dp x cp / ep = 4 ranks, tp x ep = 4 apart: 2 a node, 2 nodes. Both buckets are
    # ready when the one layer's backward ends: one after the other on the communication stream, exposed.
    dense, experts = 1 << 24, 1 << 23
    plan = StepPlan(tp=2, dp=4, cp=2, ep=2, fsdp=False, global_batch=4, bucket_cap_mb=1024,
                    optimizer_bytes_per_param=0)
    prediction = simulate_plan(synthetic(1, dense + experts, experts, tp=2), plan, NO_LATENCY)
    by_hand = all_reduce_by_hand(dense * 2, 8, 4) + all_reduce_by_hand(experts * 2, 4, 2)
    assert prediction.breakdown["exposed_comm"] == pytest.approx(by_hand, rel=1e-12)
    assert [name for _, name, _, _ in prediction.comm_events] == ["dp all_reduce", "dp all_reduce (experts)"]
    # with the distributed optimizer: reduce-scatters over the same groups, the parameters gathered after the step
    zero1 = simulate_plan(synthetic(1, dense + experts, experts, tp=2),
                          dataclasses.replace(plan, bucket_cap_mb=None, distributed_optimizer=True), NO_LATENCY)
    b_inter = A100.inter_bandwidth * A100.nics_per_node / A100.gpus_per_node

    def scatter(size: float, n: int, g: int) -> float:  # ring at min(B, g b), or node + network phases
        nodes = n // g
        return min((n - 1) / n * size / min(A100.intra_bandwidth, g * b_inter),
                   (nodes - 1) / nodes * size / g / b_inter + (g - 1) / g * size / A100.intra_bandwidth)

    assert zero1.breakdown["exposed_comm"] == pytest.approx(scatter(dense * 2, 8, 4) + scatter(experts * 2, 4, 2),
                                                            rel=1e-12)


def test_ddp_buckets_overlap_the_backward_and_the_last_is_exposed() -> None:
    # one stage, dp=2 in a node, one micro-batch; 4 layers of 2 s backward, each two modules of 2^20 bf16
    # elements (2 MiB each, 4 MiB a layer), made last layer first. 8 MiB buckets: layers 4 and 3 (ready 4 s into
    # the backward), layers 2 and 1 (ready at its end). An 8 MiB all-reduce over 2 ranks takes S/B (well under
    # 4 s): the first is hidden, the last exposed.
    module = 1 << 20
    costs = synthetic(4, 2 * module, gradients=((module, False), (module, False)))
    plan = StepPlan(dp=2, fsdp=False, global_batch=2, bucket_cap_mb=8, optimizer_bytes_per_param=0)
    prediction = simulate_plan(costs, plan, NO_LATENCY)
    bucket = all_reduce_by_hand(8 * MIB, 2, 2)
    assert bucket == pytest.approx(8 * MIB / A100.intra_bandwidth, rel=1e-12) and bucket < 4.0
    assert prediction.breakdown["compute"] == 4 * 3.0
    assert prediction.breakdown["exposed_comm"] == pytest.approx(bucket, rel=1e-12)
    backward = 4.0  # the forwards end at 4 s
    starts = [start for _, _, start, _ in prediction.comm_events]
    assert starts == pytest.approx([backward + 4.0, backward + 8.0], rel=1e-12)
    # not overlapped: both after the backward
    after = simulate_plan(costs, dataclasses.replace(plan, overlap_grad_reduce=False), NO_LATENCY)
    assert after.breakdown["exposed_comm"] == pytest.approx(2 * bucket, rel=1e-12)
    # one all-reduce per layer (grad_buckets="layer", replicate() per block), each layer's 4 MiB as its backward
    # ends (2, 4, 6, 8 s in): the last exposed
    default = simulate_plan(costs, dataclasses.replace(plan, bucket_cap_mb=None, grad_buckets="layer"), NO_LATENCY)
    assert [start for _, _, start, _ in default.comm_events] == pytest.approx([backward + 2.0 * k for k in (1, 2, 3, 4)])
    assert default.breakdown["exposed_comm"] == pytest.approx(all_reduce_by_hand(4 * MIB, 2, 2), rel=1e-12)
    # 1 MiB buckets: one a module gradient, two a layer: the last layer's two, both ready at the end, exposed
    small = simulate_plan(costs, dataclasses.replace(plan, bucket_cap_mb=1), NO_LATENCY)
    assert len(small.comm_events) == 8
    assert small.breakdown["exposed_comm"] == pytest.approx(2 * all_reduce_by_hand(2 * MIB, 2, 2), rel=1e-12)


def test_plan_search_enumerates_pp_cp_ep_and_ddp_combinations() -> None:
    # the MoE on 8 GPUs, tp=1, micro-batch 2, global batch 16, 2 layers: pp in (1, 2), cp in (1, 2), ep in (1, 2),
    # FSDP or DDP. ep=2 divides dp x cp in every one of them (dp = 8 / (pp x cp) >= 2), and is a multiple of cp:
    # all 2 x 2 x 2 x 2 = 16 combinations run
    search = quiet(fxflops.plan, lambda n: MoEModel(256, 64, 128, 4, 2, n), gpus=8, cluster="DGX A100 80GB",
                   global_batch=16, seq_len=16, layers=2, tp=[1], pp=[1, 2], micro_batch=[2], recompute=["none"],
                   virtual_stages=(1,), schedules=("1f1b",), cp=(1, 2), ep=(2,))
    combos = sorted((r.plan.pp, r.plan.cp, r.plan.ep, r.plan.fsdp) for r in search.rows + search.dropped
                    if r.plan.dp_shard is None)
    assert combos == sorted((p, c, e, f) for p in (1, 2) for c in (1, 2) for e in (1, 2) for f in (False, True))
    # besides, FSDP plans as HSDP with each shard degree between 1 and dp that divides dp (dp_shard x cp a multiple
    # of ep): dp = 8 / (pp x cp) is 8 at pp = cp = 1 (dp_shard 2 or 4), 4 at pp x cp = 2 (dp_shard 2), 2 at
    # pp = cp = 2 (none)
    hsdp = sorted((r.plan.pp, r.plan.cp, r.plan.ep, r.plan.dp_shard) for r in search.rows + search.dropped
                  if r.plan.dp_shard is not None)
    assert hsdp == sorted([(1, 1, e, d) for e in (1, 2) for d in (2, 4)] + [(2, 1, e, 2) for e in (1, 2)]
                          + [(1, 2, e, 2) for e in (1, 2)])
    assert search.captures == 1 + 3 * 2  # the plain one, and (cp, ep) = (1, 2), (2, 1), (2, 2) with each FSDP choice
    row = next(r for r in search.rows + search.dropped if (r.plan.pp, r.plan.cp, r.plan.ep) == (2, 2, 2))
    assert row.plan.dp == 2 and row.parallel["cp"] == row.parallel["ep"] == 2
    assert not any(r.plan.distributed_optimizer != (not r.plan.fsdp) for r in search.rows + search.dropped)


def test_loss_parallel_all_reduces_are_timed_as_small_collectives() -> None:
    # tp=2 on Llama (vocabulary 256, fp32): loss parallelism leaves the head's logits vocabulary-sharded and the
    # cross-entropy all-reduces each position's max, sum of exponentials and target logit: 3 all-reduces of
    # 2 x 16 positions x 4 B = 128 bytes over the 2 tp ranks of a node, forward only. Each takes 2(n-1)/n S/B
    # + 2(n-1) α = 128 / B + 2 α. They are the whole forward communication after the blocks (the column-parallel
    # head's input is replicated: its all-reduce is the backward's).
    target = torch.zeros(2, 16, dtype=torch.long)

    def cross_entropy(logits: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    costs = quiet(capture_costs, Llama(n_layers=2), (TOKENS,), A100, tp=2, loss=cross_entropy, loss_parallel=True)
    small = 128 / A100.intra_bandwidth + 2 * A100.intra_latency
    assert costs.post.comm_forward == pytest.approx(3 * small, rel=1e-12)
    prediction = quiet(fxflops.predict_step, Llama(n_layers=2), (TOKENS,), {"tp": 2, "loss_parallel": True},
                       loss=cross_entropy, sequence_parallel=False)
    assert prediction.step_time == pytest.approx(simulate_plan(costs, prediction.plan, A100).step_time, rel=1e-12)
