"""predict_step under context parallelism (ring attention) and expert parallelism (MoE all-to-alls): each
captured collective classified by what issued it, the ring's and the dispatch's collectives timed from
bytes worked out by hand, parameters counted before FSDP, and the step's FSDP groups (dp x cp; dp / ep for
the experts) checked on synthetic per-layer costs."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import fxflops
from fxflops.predict.comm_time import collective_seconds, ranks_per_node
from fxflops.predict.hardware import cluster
from fxflops.predict.layers import CP, DP, EP, LayerCosts, Part, collective_kind
from fxflops.predict.op_time import node_seconds, stream_seconds
from fxflops.predict.step import StepPlan, capture_costs, simulate_plan
from fxflops.results import FORWARD
from tests.moe_models import MoEModel
from tests.parallel_models import Llama

A100 = cluster("DGX A100 80GB")
TOKENS = torch.zeros(2, 16, dtype=torch.long)  # micro-batch 2, 16 positions


def quiet(call, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return call(*args, **kwargs)


def test_cp_ring_collectives_are_timed_from_their_bytes_and_fsdp_is_left_to_the_step() -> None:
    # Llama of width 64 (8 heads of 8), MLP 128, 2 layers, fp32, cp=2: a rank holds 16 / 2 = 8 positions. Per
    # attention call ring attention all-gathers the rank's k and v (2 x 8 heads x 8 positions x 8 = 1,024
    # elements each per sample, 2 samples) over 2 ranks: 2 x 2 x 2 x 8 x 64 x 4 B = 16,384 bytes gathered; its
    # gradient is a reduce-scatter of as many bytes. The capture also runs FSDP over dp x cp = 2 ranks: those
    # collectives are the data parallel wrapper's, left to the step simulation.
    model = Llama(n_layers=2)
    est = quiet(fxflops.estimate, model, (TOKENS,), backward=True, parallel={"cp": 2})
    attention = {n.module for n in est.nodes if n.phase == FORWARD and "attention" in n.op}
    kinds = [(collective_kind(c, (), attention), c.module, c.op) for c in est.collectives]
    assert [k for k in kinds if k[0] == CP] == [
        (CP, "layers.0.attention", "all_gather"), (CP, "layers.1.attention", "all_gather"),
        (CP, "layers.1.attention", "reduce_scatter"), (CP, "layers.0.attention", "reduce_scatter")]
    assert {k[0] for k in kinds} == {CP, DP}  # the rest is FSDP's gathers and reduce-scatters

    costs = quiet(capture_costs, model, (TOKENS,), A100, cp=2)
    gathered = 2 * 2 * 2 * 8 * 64 * 4
    per_node = ranks_per_node(2, 1, A100)
    gather = collective_seconds("all_gather", gathered, 2, A100, per_node)
    scatter = collective_seconds("reduce_scatter", gathered, 2, A100, per_node)
    assert costs.block.cp_comm_forward == pytest.approx(gather, rel=1e-12)
    assert costs.block.cp_comm_backward == pytest.approx(scatter, rel=1e-12)
    # torch's ring issues the gather and computes step 0 (the rank's queries against its own keys) meanwhile:
    # exposed is what the gather takes beyond that first attention kernel; the reduce-scatter is exposed whole
    nodes = list(est.nodes)
    start = next(i for i, n in enumerate(nodes) if n.name == est.collectives[2].node)
    step0 = next(n for n in nodes[start + 1:] if n.module == "layers.0.attention" and "attention" in n.op)
    assert costs.block.comm_forward == pytest.approx(max(0.0, gather - node_seconds(step0, A100.device,
                                                                                    torch.bfloat16)), abs=1e-15)
    assert costs.block.comm_backward == pytest.approx(scatter, rel=1e-12)
    # parameters before FSDP's sharding: 4 x 64^2 + 3 x 64 x 128 + 2 x 64 per block, embedding 256 x 64,
    # final norm 64 + head 64 x 256
    assert costs.block.params == 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert (costs.pre.params, costs.post.params, costs.block.expert_params) == (256 * 64, 64 + 64 * 256, 0)
    assert any(note.startswith("ring attention (cp)") for note in costs.notes)


def test_ep_all_to_alls_are_exposed_and_timed_from_their_bytes() -> None:
    # MoE of width 64, 4 experts (MLP 128) top-2 with a shared expert, 2 layers, fp32, ep=2 (captured with dp=2,
    # the ranks ep borrows). Balanced routing: per layer forward an all-to-all of the 4 per-expert token counts
    # (int64: 32 bytes), the routed tokens out (2 x 16 tokens x top-2 = 64 rows of 64 fp32 = 16,384 bytes) and
    # their results back (as many); backward the two token all-to-alls again.
    model = MoEModel(256, 64, 128, 4, 2, 2)
    costs = quiet(capture_costs, model, (TOKENS,), A100, ep=2)
    per_node = ranks_per_node(2, 1, A100)
    tokens = collective_seconds("all_to_all", 64 * 64 * 4, 2, A100, per_node)
    counts = collective_seconds("all_to_all", 4 * 8, 2, A100, per_node)
    assert costs.block.ep_comm_forward == pytest.approx(counts + 2 * tokens, rel=1e-12)
    assert costs.block.ep_comm_backward == pytest.approx(2 * tokens, rel=1e-12)
    # exposed whole (torchtitan's default), and nothing else communicates in the block (FSDP's is the step's)
    assert costs.block.comm_forward == pytest.approx(costs.block.ep_comm_forward, rel=1e-12)
    assert costs.block.comm_backward == pytest.approx(costs.block.ep_comm_backward, rel=1e-12)
    # parameters before FSDP: norm 64, gate 64 x 4, shared expert 3 x 64 x 128, and this rank's 2 of the 4
    # experts (3 x 64 x 128 each)
    experts = 2 * 3 * 64 * 128
    assert costs.block.expert_params == experts
    assert costs.block.params == 64 + 64 * 4 + 3 * 64 * 128 + experts
    assert (costs.pre.params, costs.post.params) == (256 * 64, 256 * 64)
    est = quiet(fxflops.estimate, model, (TOKENS,), backward=True, parallel={"ep": 2, "dp": 2})
    experts_paths = ("layers.0.moe.experts", "layers.1.moe.experts")
    kinds = {collective_kind(c, experts_paths, set()) for c in est.collectives}
    assert kinds == {EP, DP}  # on one default group: told apart by module and op, not the group
    assert any("MoE routing assumed 'balanced'" in note for note in costs.notes)


def synthetic(params: int, expert_params: int, comm: float = 0.0) -> LayerCosts:
    block = Part(forward=1.0, backward=2.0, comm_forward=comm, comm_backward=comm / 2, forward_flops=100,
                 backward_flops=200, params=params, expert_params=expert_params, ep_comm_forward=comm,
                 ep_comm_backward=comm / 2)
    # costs of a cp / ep capture, which runs FSDP itself (its copies are among its ops)
    return LayerCosts(1, False, 1, 1000, 1, block, Part(), Part(), 0, 2, "bfloat16", "A100", 1, fsdp_in_capture=True)


def test_ep_step_gathers_experts_over_dp_over_ep_and_the_rest_over_dp() -> None:
    # one layer, one micro-batch, dp=4 with ep=2 under FSDP: the dense 2^26 parameters gathered (before forward
    # and backward) and reduce-scattered over 4 ranks, the 2^27 expert parameters (this rank's experts) over
    # dp / ep = 2 ranks (stride 2). The all-to-alls (0.5 s forward, 0.25 s backward) are on the critical path.
    dense, experts = 1 << 26, 1 << 27
    plan = StepPlan(dp=4, ep=2, fsdp=True, global_batch=4)
    prediction = simulate_plan(synthetic(dense + experts, experts, comm=0.5), plan, A100)
    four, two = ranks_per_node(4, 1, A100), ranks_per_node(2, 2, A100)
    gather = collective_seconds("all_gather", dense * 2, 4, A100, four) \
        + collective_seconds("all_gather", experts * 2, 2, A100, two)
    scatter = collective_seconds("reduce_scatter", dense * 2, 4, A100, four) \
        + collective_seconds("reduce_scatter", experts * 2, 2, A100, two)
    optimizer = stream_seconds((dense / 4 + experts / 2) * (2 * 12 + 2 + 2), A100.device)
    assert prediction.breakdown["compute"] == pytest.approx(3.0)
    assert prediction.breakdown["exposed_comm"] == pytest.approx(0.75 + 2 * gather + scatter, rel=1e-12)
    assert prediction.breakdown["optimizer"] == pytest.approx(optimizer, rel=1e-12)
    assert prediction.step_time == pytest.approx(3.75 + 2 * gather + scatter + optimizer, rel=1e-12)
    assert plan.gpus == 4 and prediction.ranks[0].ranks == 4


def test_cp_step_shards_over_dp_times_cp_and_counts_its_gpus() -> None:
    # dp=2, cp=2: 4 GPUs; FSDP over the 4 ranks (dp x cp, stride 1 with tp=1); each rank's FLOPs are its
    # share: the job's are 4 x the rank's
    params = 1 << 26
    plan = StepPlan(dp=2, cp=2, fsdp=True, global_batch=2)
    prediction = simulate_plan(synthetic(params, 0), plan, A100)
    gather = collective_seconds("all_gather", params * 2, 4, A100, ranks_per_node(4, 1, A100))
    scatter = collective_seconds("reduce_scatter", params * 2, 4, A100, ranks_per_node(4, 1, A100))
    optimizer = stream_seconds(params / 4 * (2 * 12 + 2 + 2), A100.device)
    assert prediction.step_time == pytest.approx(3.0 + 2 * gather + scatter + optimizer, rel=1e-12)
    assert plan.gpus == 4 and prediction.ranks[0].ranks == 4
    assert prediction.tflops_per_gpu == pytest.approx(300 * 4 / 4 / prediction.step_time / 1e12, rel=1e-12)


def test_predict_step_with_cp_and_ep_end_to_end() -> None:
    with_cp = quiet(fxflops.predict_step, Llama(n_layers=2), (TOKENS,), {"cp": 2, "dp": 2})
    assert with_cp.plan.cp == 2 and with_cp.plan.gpus == 4
    assert with_cp.tokens_per_sec == pytest.approx(2 * 2 * 16 / with_cp.step_time, rel=1e-12)
    with_ep = quiet(fxflops.predict_step, MoEModel(256, 64, 128, 4, 2, 2), (TOKENS,), {"ep": 2, "dp": 4})
    assert with_ep.plan.ep == 2 and with_ep.plan.gpus == 4 and with_ep.breakdown["exposed_comm"] > 0
    assert any("MoE routing assumed" in note for note in with_ep.notes) and " ep=2 " in str(with_ep)


def test_ep_without_the_ranks_it_borrows_is_refused() -> None:
    with pytest.raises(ValueError, match="ep=2 borrows its ranks from dp=1: pick an ep that divides dp"):
        fxflops.predict_step(MoEModel(256, 64, 128, 4, 2, 2), (TOKENS,), {"ep": 2})
    # torchtitan's layout: ep = dp_in_ep x cp, so cp divides ep
    with pytest.raises(ValueError, match="ep=2 borrows its ranks from dp=2 x cp=4: pick an ep that divides dp x cp "
                                         "and is a multiple of cp"):
        StepPlan(dp=2, cp=4, ep=2, fsdp=True, global_batch=2).check(2)
    assert dataclasses.replace(StepPlan(), cp=2).gpus == 2


def test_plan_search_enumerates_cp_with_fsdp() -> None:
    # 4 GPUs, tp=1 (the search's tps given), micro-batch 2, global batch 8. cp=2 plans: dp = 4 / 2 = 2, FSDP over
    # the 4 ranks of dp x cp. Their parameters per rank (bf16, before the allowance): the model's 2 x 41,088 +
    # 16,384 + 16,448 = 115,008 elements sharded 4 ways, plus FSDP's two gathered layers and the root unit whole.
    search = quiet(fxflops.plan, lambda n: Llama(n_layers=n), gpus=4, cluster="DGX A100 80GB", global_batch=8,
                   seq_len=16, layers=2, tp=[1], pp=[1], micro_batch=[2], recompute=["none"], cp=(1, 2), ep=(2,),
                   fsdp=(True,))
    rows = [r for r in search.rows + search.dropped if r.plan.cp == 2]
    assert len(rows) == 1 and rows[0].plan.dp == 2 and rows[0].plan.fsdp and rows[0].parallel["cp"] == 2
    block, outside = 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64, 256 * 64 + 64 + 64 * 256
    assert rows[0].memory["parameters"] == (2 * block + outside) * 2 // 4 + (2 * block + outside) * 2
    costs = quiet(capture_costs, Llama(n_layers=2), (TOKENS,), A100, cp=2, layers=2)
    same = simulate_plan(costs, rows[0].plan, A100)
    assert rows[0].step_time == pytest.approx(same.step_time, rel=1e-12)
    # ep on a model without experts: left out, said
    assert not any(r.plan.ep > 1 for r in search.rows + search.dropped)
    assert any(note.startswith("ep=2 at tp=1, micro-batch 2 left out") for note in search.notes)


def test_plan_search_enumerates_ep_for_a_moe_model() -> None:
    # MoE on 4 GPUs with ep=2: dp = 4, the experts (2 of 4 per rank: 2 x 3 x 64 x 128 per layer) FSDP-sharded
    # over dp / ep = 2 ranks, the rest (norm, gate, shared expert; embedding and head) over 4
    search = quiet(fxflops.plan, lambda n: MoEModel(256, 64, 128, 4, 2, n), gpus=4, cluster="DGX A100 80GB",
                   global_batch=8, seq_len=16, layers=2, tp=[1], pp=[1], micro_batch=[2], recompute=["none"],
                   ep=(2,), fsdp=(True,))
    rows = [r for r in search.rows + search.dropped if r.plan.ep == 2 and r.plan.dp_shard is None]
    assert len(rows) == 1 and rows[0].plan.dp == 4 and rows[0].parallel["ep"] == 2
    experts, dense, outside = 2 * 3 * 64 * 128, 64 + 64 * 4 + 3 * 64 * 128, 2 * 256 * 64
    sharded = 2 * experts * 2 // 2 + (2 * dense + outside) * 2 // 4
    assert rows[0].memory["parameters"] == sharded + (2 * (dense + experts) + outside) * 2
    # and as HSDP (dp_shard=2: 2 replicas of 2 shards, ep=2 borrowing both): the experts sharded over
    # dp_shard / ep = 1 rank (whole), the rest over the 2 shards
    hsdp = [r for r in search.rows + search.dropped if r.plan.ep == 2 and r.plan.dp_shard is not None]
    assert [r.plan.dp_shard for r in hsdp] == [2] and hsdp[0].parallel["dp_shard"] == 2
    sharded = 2 * experts * 2 // 1 + (2 * dense + outside) * 2 // 2
    assert hsdp[0].memory["parameters"] == sharded + (2 * (dense + experts) + outside) * 2


def test_a_tp_only_capture_has_no_ring_attention_collectives() -> None:
    # tp=2 with sequence parallelism: the capture's one group is the default one, and the all-gather before
    # attention is issued in the attention module, as ring attention's is. Without cp it is tensor parallel:
    # exposed whole. Per block forward: two all-gathers of the (2, 16, 64) fp32 stream (8,192 bytes gathered)
    # and two reduce-scatters of as many bytes.
    costs = quiet(capture_costs, Llama(n_layers=2), (TOKENS,), A100, tp=2, sequence_parallel=True)
    per_node = ranks_per_node(2, 1, A100)
    stream = 2 * 16 * 64 * 4
    assert costs.block.cp_comm_forward == costs.block.ep_comm_forward == 0.0
    assert costs.block.comm_forward == pytest.approx(2 * collective_seconds("all_gather", stream, 2, A100, per_node)
                                                     + 2 * collective_seconds("reduce_scatter", stream, 2, A100,
                                                                              per_node), rel=1e-12)
