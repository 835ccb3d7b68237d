"""Parallelisms combined in what-if plans: pp with ep and cp, ep and cp with DDP and HSDP, ep with cp.

Per-rank FLOPs are hand counts under the torch preset (matmuls and SDPA, FlopCounterMode's formulas);
collective bytes closed forms over the groups torchtitan's ParallelDims (and Megatron-LM's process
groups) put them on: dense gradients reduced over dp x cp, expert gradients over the data-parallel ranks
holding the same experts (dp x cp / ep), expert parallelism borrowed from dp x cp."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fxflops
from tests.moe_models import MoEModel
from tests.parallel_models import Llama

pytestmark = pytest.mark.filterwarnings("ignore:values the weights decide")  # the MoE's routing caution

FP32 = 4
# the Llama: vocabulary, width, layers, heads, MLP hidden, batch, sequence
V, D, L, HEADS, FF, B, S = 256, 64, 2, 8, 128, 2, 16
HEAD_DIM = D // HEADS
LAYER_PARAMS = 4 * D * D + 3 * D * FF + 2 * D
REST = V * D + D + D * V  # embedding, final norm, head
# the MoE: vocabulary, width, expert hidden, experts, top-k, layers, batch, sequence
MV, MD, MH, E, K, ML, MB, MS = 32, 16, 32, 4, 2, 2, 2, 8
DENSE = 2 * MV * MD + ML * (MD + MD * E + 3 * MD * MH)  # embedding, head; per layer norm, router, shared expert
EXPERT = 3 * MD * MH  # one expert's w1, w2, w3


def llama_linears(tokens: int) -> int:
    return 2 * tokens * D * 4 * D + 3 * 2 * tokens * D * FF


def ring(cp: int) -> int:
    """One rank's causal ring attention (head-tail balancing): its own chunk, then half against half."""
    local = S // cp

    def sdpa(lq: int, lk: int) -> int:
        return 2 * B * HEADS * lq * lk * 2 * HEAD_DIM

    return sdpa(local, local) + (cp - 1) * sdpa(local, local // 2)


def moe_layer(tokens: int, rows: int, tp: int = 1) -> int:
    """One MoE layer's forward on a rank: router on its tokens, the shared expert (split tp ways), its
    experts on the `rows` they receive."""
    return 2 * tokens * MD * E + 3 * 2 * tokens * MD * MH // tp + 3 * 2 * rows * MD * MH


@pytest.fixture(scope="module")
def llama():
    with torch.device("meta"):
        return Llama(V, D, L, HEADS, FF)


@pytest.fixture(scope="module")
def moe():
    with torch.device("meta"):
        return MoEModel(MV, MD, MH, E, K, ML)


def plan_estimate(model, routing=None, **plan):
    sequence = MS if isinstance(model, MoEModel) else S
    est = fxflops.estimate(model, (torch.zeros(MB if sequence == MS else B, sequence, dtype=torch.long),),
                           conventions="torch", backward=True, parallel=plan, routing=routing)
    assert not dist.is_initialized() and torch._C._len_torch_function_stack() == 0
    return est


def totals(est, op, per_step=None):
    """{(group size, mesh dimension): (count, bytes)} of one kind of collective."""
    found: dict[tuple[int, str], tuple[int, int]] = {}
    for c in est.collectives:
        if c.op == op and (per_step is None or c.per_step == per_step):
            count, size = found.get((c.group_size, c.group_desc), (0, 0))
            found[(c.group_size, c.group_desc)] = (count + 1, size + c.bytes)
    return found


def test_cp_with_ddp_all_reduces_the_gradients_over_dp_times_cp(llama):
    # Megatron's DDP reduces gradients over its data-parallel-with-context-parallel group: here all 8 ranks
    est = plan_estimate(llama, cp=2, dp=4, fsdp=False)
    local = B * S // 2
    assert est.fwd_flops == L * (llama_linears(local) + ring(2)) + 2 * local * D * V
    assert [r.ranks for r in est.ranks] == [tuple(range(8))]
    # (one of DDP's buckets: all 460,032 bytes are under its first bucket's 1 MiB)
    assert totals(est, "all_reduce") == {(8, "default_pg"): (1, (L * LAYER_PARAMS + REST) * FP32)}
    assert all(c.per_step and c.wire_bytes == 2 * 7 * c.bytes // 8 for c in est.collectives if c.op == "all_reduce")
    assert est.total_params == L * LAYER_PARAMS + REST  # nothing sharded
    # ring attention's own collectives stay on the cp group, once per micro-batch
    kv = 2 * B * HEADS * S * HEAD_DIM * FP32
    assert totals(est, "all_gather") == {(2, "mesh_cp"): (L, L * kv)}
    assert totals(est, "reduce_scatter") == {(2, "mesh_cp"): (L, L * kv)}


def test_cp_with_hsdp_shards_over_dp_shard_times_cp_and_all_reduces_over_the_replicas(llama):
    # torchtitan: fully_shard on the 2-D mesh (dp_replicate, dp_shard_cp)
    est = plan_estimate(llama, cp=2, dp=4, dp_shard=2)
    params = (L * LAYER_PARAMS + REST) * FP32
    assert est.total_params == (L * LAYER_PARAMS + REST) // 4
    assert totals(est, "reduce_scatter", per_step=True) == {(4, "mesh_dp_shard_cp"): (L + 1, params)}
    assert totals(est, "all_reduce") == {(2, "mesh_dp_replicate"): (L + 1, params // 4)}
    assert all(c.per_step for c in est.collectives if c.op == "all_reduce")
    gathers = totals(est, "all_gather")
    assert gathers[(4, "mesh_dp_shard_cp")] == (2 * (L + 1), 2 * params)  # forward, and backward (resharded)


def test_ep_with_ddp_reduces_expert_gradients_over_the_ranks_holding_the_same_experts(moe):
    est = plan_estimate(moe, ep=2, dp=4, fsdp=False)
    tokens = MB * MS
    assert est.fwd_flops == ML * moe_layer(tokens, tokens * K) + 2 * tokens * MD * MV
    assert est.total_params == DENSE + ML * (E // 2) * EXPERT  # parameters whole, the rank's experts only
    # Megatron: dense gradients over dp (4), expert gradients over the expert-data-parallel group (dp / ep = 2)
    # (a DDP bucket each: under its first bucket's 1 MiB)
    assert totals(est, "all_reduce") == {(4, "default_pg"): (1, DENSE * FP32),
                                         (2, "mesh_dp_mod_ep"): (1, ML * (E // 2) * EXPERT * FP32)}
    assert all(c.per_step for c in est.collectives if c.op == "all_reduce")


def test_ep_with_ddp_where_every_rank_holds_its_own_experts(moe):
    est = plan_estimate(moe, ep=2, dp=2, fsdp=False)
    assert totals(est, "all_reduce") == {(2, "default_pg"): (1, DENSE * FP32)}  # no expert reduction


def test_ep_with_hsdp_replicates_the_experts_over_the_replicas(moe):
    # dp 4 = 2 replicas x dp_shard 2, ep borrowed from dp_shard: each replica's 2 ranks hold other experts, the
    # expert gradients all-reduced over the 2 replicas (torchtitan's dp_mod_ep mesh: dp_replicate x 1)
    est = plan_estimate(moe, ep=2, dp=4, dp_shard=2)
    experts = ML * (E // 2) * EXPERT
    assert est.total_params == DENSE // 2 + experts
    assert totals(est, "reduce_scatter") == {(2, "mesh_ep"): (ML + 1, DENSE * FP32)}
    assert totals(est, "all_reduce") == {(2, "mesh_dp_replicate"): (2 * ML + 1, (experts + DENSE // 2) * FP32)}


@pytest.mark.parametrize(("ep", "dp", "group"), [(2, 1, "default_pg"), (4, 2, "default_pg"), (2, 2, "mesh_cp")])
def test_ep_with_cp_routes_each_ranks_positions_over_ep_borrowed_from_dp_times_cp(moe, ep, dp, group):
    est = plan_estimate(moe, ep=ep, cp=2, dp=dp)
    tokens = MB * MS // 2  # the rank's positions
    # balanced: the rank's E/ep experts receive tokens*K/E rows from each of the ep ranks
    assert est.fwd_flops == ML * moe_layer(tokens, ep * (E // ep) * tokens * K // E) + 2 * tokens * MD * MV
    assert est.bwd_flops == 2 * est.fwd_flops
    rows = tokens * K * MD * FP32
    dispatched = {(c.group_size, c.group_desc) for c in est.collectives if c.op == "all_to_all"}
    assert dispatched == {(ep, group)}
    assert sum(c.bytes for c in est.collectives if c.op == "all_to_all" and c.dtype == "float32"
               and c.phase == "forward") == 2 * ML * rows
    # dense gradients over dp x cp; expert ones over dp x cp / ep (none left when ep = dp x cp)
    scatters = totals(est, "reduce_scatter")
    assert scatters.pop((dp * 2, "default_pg")) == (ML + 1, DENSE * FP32)
    experts = ML * (E // ep) * EXPERT
    assert scatters == ({} if ep == dp * 2 else {(2, "mesh_dp_mod_ep"): (ML, experts * FP32)})
    assert est.total_params == DENSE // (dp * 2) + experts // (dp * 2 // ep)


def test_ep_not_a_multiple_of_cp_is_one_clear_line(moe):
    with pytest.raises(ValueError, match="ep=2 with cp=4: .* pick an ep that is a multiple of cp=4") as caught:
        plan_estimate(moe, ep=2, cp=4)
    assert "\n" not in str(caught.value) and not dist.is_initialized()


def test_pp_with_cp_cuts_the_ring_attention_model_into_stages(llama):
    est = plan_estimate(llama, pp=2, cp=2)
    local = B * S // 2
    first, last = est.ranks
    assert (first.ranks, last.ranks) == ((0, 1), (2, 3))
    layer = llama_linears(local) + ring(2)
    assert (first.estimate.fwd_flops, last.estimate.fwd_flops) == (layer, layer + 2 * local * D * V)
    assert last.estimate.bwd_flops == 2 * (llama_linears(local) + 2 * local * D * V) + 5 * ring(2) // 2
    # the activations of the rank's positions cross the cut: b * s/cp * h each way
    activation = local * D * FP32
    p2p = [(c.op, c.phase, c.bytes, c.group_desc) for c in first.estimate.collectives if c.op in ("send", "recv")]
    assert sorted(p2p) == [("recv", "backward", activation, "mesh_pp"), ("send", "forward", activation, "mesh_pp")]
    # each stage's parameters sharded over its cp ranks, its own attention's k/v gathered over them
    kv = 2 * B * HEADS * S * HEAD_DIM * FP32
    assert totals(first.estimate, "reduce_scatter", per_step=True) == \
        {(2, "mesh_cp"): (2, (V * D + LAYER_PARAMS) * FP32)}
    assert totals(first.estimate, "reduce_scatter", per_step=False) == {(2, "mesh_cp"): (1, kv)}


@pytest.mark.parametrize("tp", [1, 2])
def test_pp_with_ep_tp_and_dp(moe, tp):
    est = plan_estimate(moe, tp=tp, pp=2, ep=2, dp=2)
    tokens = MB * MS
    first, last = est.ranks
    inner = 2 * tp  # ranks per pipeline stage: dp x tp
    assert (first.ranks, last.ranks) == (tuple(range(inner)), tuple(range(inner, 2 * inner)))
    layer = moe_layer(tokens, tokens * K, tp)
    assert (first.estimate.fwd_flops, last.estimate.fwd_flops) == (layer, layer + 2 * tokens * MD * MV)
    for role in est.ranks:  # the stage's one MoE layer: dispatch and combine of tokens x top-k x h, each way
        found = [c for c in role.estimate.collectives if c.op == "all_to_all" and c.dtype == "float32"]
        assert sorted((c.phase, c.bytes, c.group_size) for c in found) == \
            [("backward", tokens * K * MD * FP32, 2)] * 2 + [("forward", tokens * K * MD * FP32, 2)] * 2
        sends = [c.bytes for c in role.estimate.collectives if c.op == "send"]
        assert sends == [tokens * MD * FP32]
    # the first stage's parameters: the embedding and its layer's dense ones sharded over ep = dp (the shared
    # expert split tp ways), its own experts whole
    shared = 3 * MD * MH
    assert first.estimate.total_params == (MV * MD + MD + MD * E + shared // tp) // 2 + (E // 2) * EXPERT
    assert est.job_flops == inner * (first.estimate.total_flops + last.estimate.total_flops)


def test_pp_with_ep_under_worst_routing_makes_a_role_per_stage_and_routing(moe):
    est = plan_estimate(moe, routing="worst", pp=2, ep=2, dp=2)
    tokens = MB * MS
    busy, idle = moe_layer(tokens, 2 * tokens * K), moe_layer(tokens, 0)
    head = 2 * tokens * MD * MV
    assert [(r.ranks, r.estimate.fwd_flops) for r in est.ranks] == \
        [((0,), busy), ((2,), busy + head), ((1,), idle), ((3,), idle + head)]
    assert "pipeline stage 0 (first), expert-parallel index 0" in est.ranks[0].name
