"""HSDP, DDP's default gradient buckets and tensor-parallel communication overlap in the step prediction and the
plan search; the software constants they read, with their sources, and a user's cluster file changing them.
Every time below is the α-β model worked by hand from the cluster's constants."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fxflops
from fxflops.cli.main import main
from fxflops.predict.comm_time import collective_record_seconds, ranks_per_node
from fxflops.predict.hardware import cluster, constants_text
from fxflops.predict.layers import LayerCosts, Part, tp_overlap_seconds
from fxflops.predict.op_time import node_seconds
from fxflops.predict.step import StepPlan, capture_costs, dim_ranks_per_node, simulate_plan
from fxflops.predict.validation import GPT, RUNS, llama
from tests.test_predict_combinations import MIB, NO_LATENCY, quiet, synthetic

A100 = cluster("DGX A100 80GB")  # 8 GPUs a node, NVLink 235 GB/s bus, 8 x 25 GB/s adapters, α 1 µs / 5 µs
B_INTRA, A_INTRA = 235e9, 1e-6
B_GPU, A_INTER = 25e9 * 8 / 8, 5e-6  # a GPU's share of its node's adapters


def test_hsdp_places_the_shard_group_by_its_stride_and_the_replicas_outside_it() -> None:
    # ranks tp fastest, then cp, dp_shard, dp_replicate (torchtitan's order). tp=2, dp=16, dp_shard=4: the shard
    # group is 4 ranks 2 apart (one node holds them all), the replicas 4 ranks 2 x 4 = 8 apart (one a node)
    placed = dim_ranks_per_node(StepPlan(tp=2, dp=16, dp_shard=4, fsdp=True), A100)
    assert (placed["fsdp"], placed["replicate"]) == (4, 1)
    # dp_shard=8 at tp=2: 8 ranks 2 apart, 4 a node over 2 nodes; FSDP over all of dp: 16 ranks, 4 a node
    assert dim_ranks_per_node(StepPlan(tp=2, dp=16, dp_shard=8, fsdp=True), A100)["fsdp"] == 4
    assert dim_ranks_per_node(StepPlan(tp=2, dp=16, fsdp=True), A100)["fsdp"] == 4
    plan = StepPlan(tp=2, dp=16, cp=2, dp_shard=2, fsdp=True)
    assert (plan.shard_group, plan.replicas, plan.grad_group) == (4, 8, 32)


def test_hsdp_gathers_in_the_shard_group_and_all_reduces_the_shards_over_the_replicas() -> None:
    # one layer of 2^24 bf16 elements (32 MiB; forward 1 s, backward 2 s), dp=16 as 2 replicas of 8 shards, one
    # micro-batch. The shard group (8 ranks, 1 apart) is one node: all-gather and reduce-scatter on NVLink,
    # (n-1)/n S/B + (n-1) α. The replicas (2 ranks, 8 apart) are on 2 nodes, one rank each: the all-reduce of the
    # layer's gradient shard (S/8) is S/8 / b + 2 α_inter (ring, tree and hierarchical agree for n = 2, g = 1).
    # With one layer nothing hides them: the gather before the forward, the gather before the backward, the
    # reduce-scatter and the all-reduce after it are all exposed.
    size = (1 << 24) * 2
    gather = 7 / 8 * size / B_INTRA + 7 * A_INTRA
    all_reduce = size / 8 / B_GPU + 2 * A_INTER
    plan = StepPlan(dp=16, dp_shard=8, fsdp=True, global_batch=16)
    prediction = simulate_plan(synthetic(1, 1 << 24), plan, A100)
    assert prediction.breakdown["exposed_comm"] == pytest.approx(3 * gather + all_reduce, rel=1e-12)
    assert any("HSDP" in note and "2 replicas" in note for note in prediction.notes)
    assert "HSDP: 2 replicas x 8 shards" in str(prediction)
    # FSDP over all 16 (2 nodes, 8 a node): no all-reduce, the gathers over 16 ranks instead
    fsdp = simulate_plan(synthetic(1, 1 << 24), dataclasses.replace(plan, dp_shard=None), A100)
    assert not any("HSDP" in note for note in fsdp.notes)
    assert fsdp.breakdown["exposed_comm"] != pytest.approx(prediction.breakdown["exposed_comm"])


def test_hsdp_memory_and_optimizer_are_per_shard_group() -> None:
    # 8 layers of 1,000 elements, no embedding or head, bf16, dp=16 as 4 replicas of 4 shards: parameters,
    # gradients and the optimizer's 12 bytes an element divided 4 ways, plus FSDP's two gathered layers
    costs = synthetic(8, 1000)
    plan = StepPlan(dp=16, dp_shard=4, fsdp=True, global_batch=16)
    prediction = simulate_plan(costs, plan, NO_LATENCY)
    memory = prediction.peak_memory.by_kind
    assert memory["parameters"] == 8 * 1000 * 2 // 4 + 2 * 1000 * 2
    # one micro-batch: at the first layer's backward the other 7 layers' gradient shards exist (FSDP2 makes a layer's
    # sharded .grad after its reduce-scatter), beside one layer's whole gradients
    assert memory["gradients"] == 7 * 1000 * 2 // 4 + 1000 * 2
    assert memory["optimizer"] == 8 * 1000 * 12 // 4
    # the optimizer step reads and writes a quarter of the state the memory counts: (2 x 12 + 2 + 2) bytes a local
    # element
    sustained = A100.device.sustained
    assert prediction.breakdown["optimizer"] == pytest.approx(8 * 1000 / 4 * 28 / sustained + A100.device.launch_overhead,
                                                              rel=1e-9)


def test_hsdp_plans_are_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^dp_shard=3 must divide dp=8"):
        StepPlan(dp=8, dp_shard=3, fsdp=True, global_batch=8).check(4)
    with pytest.raises(ValueError, match=r"^dp_shard shards parameters \(HSDP\); give it with fsdp=True"):
        StepPlan(dp=8, dp_shard=2, fsdp=False, global_batch=8).check(4)
    with pytest.raises(ValueError, match=r"^ep=4 borrows its ranks from dp_shard x cp = 2"):
        StepPlan(dp=8, ep=4, dp_shard=2, fsdp=True, global_batch=8).check(4)
    ids = torch.zeros(1, 32, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^dp_shard=3 must divide dp=4"):
        fxflops.predict_step(tiny_gpt(), (ids,), {"dp": 4, "dp_shard": 3})


def test_grad_buckets_other_than_the_default_are_refused_where_no_all_reduce_is_bucketed() -> None:
    """grad_buckets sizes DDP's all-reduce buckets: FSDP reduce-scatters per layer and the distributed optimizer
    reduce-scatters per layer, so "megatron", "deepspeed" or "layer" there would be ignored; predict_step's
    default fsdp (True when dp > 1) must not swallow them either."""
    for fsdp, dist_opt in ((True, False), (False, True)):
        for buckets in ("megatron", "deepspeed", "layer"):
            with pytest.raises(ValueError, match=r"^grad_buckets='" + buckets + r"' buckets the data-parallel "
                                                 r"all-reduce: give it with fsdp=False and without the distributed "
                                                 r"optimizer"):
                StepPlan(dp=2, global_batch=2, fsdp=fsdp, distributed_optimizer=dist_opt,
                         grad_buckets=buckets).check(layers=2)
    StepPlan(dp=2, global_batch=2, fsdp=True).check(layers=2)  # the default stays accepted with FSDP
    StepPlan(dp=2, global_batch=2, grad_buckets="megatron").check(layers=2)
    ids = torch.zeros(1, 32, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^grad_buckets='megatron' buckets the data-parallel all-reduce"):
        fxflops.predict_step(tiny_gpt(), (ids,), {"dp": 2}, grad_buckets="megatron")


def tiny_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(2, 64, 4, vocab=128, seq=32).to(torch.bfloat16)


def test_predict_step_takes_dp_shard_and_is_the_simulation_of_its_capture() -> None:
    ids = torch.zeros(1, 32, dtype=torch.long)
    prediction = quiet(fxflops.predict_step, tiny_gpt(), (ids,), {"dp": 16, "dp_shard": 8}, cluster="DGX A100 80GB")
    assert (prediction.plan.dp_shard, prediction.plan.replicas, prediction.plan.fsdp) == (8, 2, True)
    costs = quiet(capture_costs, tiny_gpt(), (ids,), A100)
    assert prediction.step_time == pytest.approx(simulate_plan(costs, prediction.plan, A100).step_time, rel=1e-12)


def test_ddp_takes_torch_default_buckets_when_no_cap_is_given() -> None:
    # one stage, dp=2 in a node, one micro-batch; 4 layers of 2 s backward, each two modules of 2^20 bf16 elements
    # (2 MiB each), made last layer first. torch's DDP defaults: the first bucket closes at 1 MiB (layer 4's
    # first module's 2 MiB, ready 2 s into the backward), the next at 25 MiB, which the 14 MiB left never reach:
    # one bucket ready at the backward's end, exposed. An all-reduce over 2 ranks of a node takes S/B.
    costs = synthetic(4, 2 << 20, gradients=((1 << 20, False), (1 << 20, False)))
    plan = StepPlan(dp=2, fsdp=False, global_batch=2, optimizer_bytes_per_param=0)
    prediction = simulate_plan(costs, plan, NO_LATENCY)
    backward = 4.0  # the forwards end at 4 s
    assert [start for _, _, start, _ in prediction.comm_events] == pytest.approx([backward + 2.0, backward + 8.0])
    assert prediction.breakdown["exposed_comm"] == pytest.approx(14 * MIB / B_INTRA, rel=1e-12)
    assert any("torch's buckets (1 MiB then 25 MiB)" in note for note in prediction.notes)


def test_megatron_and_deepspeed_buckets() -> None:
    # the same layers, dp=2. Megatron-LM without overlap: the whole buffer (16 MiB) in one all-reduce after the
    # backward. With overlap: buckets of max(40M, 1M x 2) elements = 80 MB of bf16, more than the buffer: one
    # bucket, ready at the end. DeepSpeed: 5e8 elements a bucket, one bucket too.
    costs = synthetic(4, 2 << 20, gradients=((1 << 20, False), (1 << 20, False)))
    plan = StepPlan(dp=2, fsdp=False, global_batch=2, optimizer_bytes_per_param=0, grad_buckets="megatron",
                    overlap_grad_reduce=False)
    for grad_buckets, overlap in (("megatron", False), ("megatron", True), ("deepspeed", True)):
        prediction = simulate_plan(costs, dataclasses.replace(plan, grad_buckets=grad_buckets,
                                                              overlap_grad_reduce=overlap), NO_LATENCY)
        assert len(prediction.comm_events) == 1
        assert prediction.breakdown["exposed_comm"] == pytest.approx(16 * MIB / B_INTRA, rel=1e-12)
    # Megatron's bucket in a cluster whose megatron_bucket_elements is 2^21 (4 MiB of bf16): buckets close at
    # 4 MiB, a layer each (2, 4, 6, 8 s into the backward): only the last one exposed
    small = dataclasses.replace(NO_LATENCY, megatron_bucket_elements=1 << 21)
    prediction = simulate_plan(costs, dataclasses.replace(plan, overlap_grad_reduce=True), small)
    assert [start for _, _, start, _ in prediction.comm_events] == pytest.approx([4.0 + 2.0 * k for k in (1, 2, 3, 4)])
    assert prediction.breakdown["exposed_comm"] == pytest.approx(4 * MIB / B_INTRA, rel=1e-12)
    with pytest.raises(ValueError, match=r"^grad_buckets='nccl': pick one of torch, megatron, deepspeed, layer"):
        StepPlan(grad_buckets="nccl").check(4)


def test_interleaved_stages_bucket_each_model_chunk_apart() -> None:
    # pp=2, v=2, dp=2 (4 GPUs in a node), 2 micro-batches: 4 chunks of one layer (two modules of 2^20 bf16
    # elements, 4 MiB), chunks 0 and 2 on rank 0, 1 and 3 on rank 1. Each model chunk is its own DDP (Megatron-LM's
    # get_model wraps every chunk, disable_bucketing for chunks after the first and on every stage but the first;
    # torchtitan wraps every model part): its gradients fill buckets of their own, reduced once that chunk's last
    # micro-batch backward ends. Megatron's buckets (80 MB on chunk 0 of rank 0, the whole chunk elsewhere): one
    # 4 MiB all-reduce per chunk, S/B each over 2 ranks of a node.
    costs = synthetic(4, 2 << 20, gradients=((1 << 20, False), (1 << 20, False)))
    plan = StepPlan(pp=2, virtual_stages=2, dp=2, fsdp=False, micro_batch=1, global_batch=4,
                    optimizer_bytes_per_param=0, grad_buckets="megatron")
    prediction = simulate_plan(costs, plan, NO_LATENCY)
    seconds = 4 * MIB / B_INTRA
    for rank in (0, 1):
        chunk_ends = sorted(e.end for e in prediction.timeline.rank_events(rank)
                            if e.stream == "compute" and e.kind == "backward" and e.microbatch == 1)
        assert len(chunk_ends) == 2
        events = [(start, end) for r, _, start, end in prediction.comm_events if r == rank]
        assert [start for start, _ in events] == pytest.approx(chunk_ends, rel=1e-12)
        assert [end - start for start, end in events] == pytest.approx([seconds, seconds], rel=1e-9)
    # torch's DDP per chunk: each chunk's Reducer closes its 1 MiB first bucket on the first 2 MiB module, the
    # second module in a 25 MiB bucket: two all-reduces per chunk, four per rank
    torch_ddp = simulate_plan(costs, dataclasses.replace(plan, grad_buckets="torch"), NO_LATENCY)
    assert [sum(1 for r, *_ in torch_ddp.comm_events if r == rank) for rank in (0, 1)] == [4, 4]


def test_validation_rows_bucket_as_their_software_does() -> None:
    # the 2021-2022 Megatron-LM rows all-reduce Megatron's way (but those run with --DDP-impl torch in the authors'
    # script for Table 1: torch's DDP), MT-NLG's DeepSpeed's; FSDP and distributed optimizer rows do not all-reduce
    # in buckets at all
    buckets = {run.name: run.grad_buckets for run in RUNS}
    assert buckets["39.1B on 512 GPUs"] == buckets["22B, SP + selective"] == "megatron"
    assert buckets["18.4B on 256 GPUs"] == "torch"
    assert buckets["MT-NLG 530B on 2240 GPUs"] == "deepspeed"
    assert buckets["Llama 2 13B, FSDP, no AC"] == "torch"


def test_a_user_cluster_file_changing_a_software_constant_changes_the_prediction_and_says_so(tmp_path, capsys) -> None:
    # DDP buckets of 4 MiB (ddp_bucket_cap) after the 1 MiB first one: layer 4's first module (2 MiB, 2 s in),
    # then 4 MiB buckets closing at 4 s and 6 s, then layer 2's second and layer 1's first module (4 MiB) and layer
    # 1's second (2 MiB), both ready at the backward's end, 8 s in: those two exposed, each S/B + 2 α over 2 ranks
    path = tmp_path / "my_cluster.toml"
    path.write_text('base = "DGX A100 80GB"\nname = "mine"\n'
                    '[ddp_bucket_cap]\nvalue = 4194304\nsource = "our own DDP setting"\n')
    mine = cluster(str(path))
    costs = synthetic(4, 2 << 20, gradients=((1 << 20, False), (1 << 20, False)))
    plan = StepPlan(dp=2, fsdp=False, global_batch=2, optimizer_bytes_per_param=0)
    prediction = simulate_plan(costs, plan, mine)
    assert len(prediction.comm_events) == 5
    expected = (4 * MIB / B_INTRA + 2 * A_INTRA) + (2 * MIB / B_INTRA + 2 * A_INTRA)
    assert prediction.breakdown["exposed_comm"] == pytest.approx(expected, rel=1e-12)
    assert prediction.breakdown["exposed_comm"] != pytest.approx(simulate_plan(costs, plan, A100).breakdown["exposed_comm"])
    assert f"cluster constants from your file {path}: ddp_bucket_cap" in prediction.notes
    assert any("torch's buckets (1 MiB then 4 MiB)" in note for note in prediction.notes)
    # explain prints it with its source, marked as the user's, and the presets' with theirs
    text = constants_text(str(path))
    assert f"ddp_bucket_cap = 4194304 B\n      from your file {path}: our own DDP setting" in text
    assert "tp_overlap_gemm_slowdown = 1 factor\n      assumption: no SM-sharing penalty" in text
    assert main(["explain", "--cluster", "DGX H100"]) == 0
    out = capsys.readouterr().out
    assert "megatron_bucket_elements = 40000000 elements\n      Megatron-LM's DistributedDataParallel" in out


def test_a_tp_overlap_slowdown_below_one_is_refused(tmp_path) -> None:
    # a GEMM sharing its SMs with a collective runs no faster than alone: a slowdown of 0.5 would make the
    # overlapped pair (max(comm, gemm x 0.5)) shorter than the GEMM by itself
    path = tmp_path / "fast.toml"
    path.write_text('base = "DGX A100 80GB"\nname = "fast"\n'
                    '[tp_overlap_gemm_slowdown]\nvalue = 0.5\nsource = "wishful"\n')
    with pytest.raises(ValueError, match=r"^tp_overlap_gemm_slowdown \(your file .*\) must be a factor >= 1"):
        cluster(str(path))
    path.write_text('base = "DGX A100 80GB"\nname = "slow"\n[tp_overlap_gemm_slowdown]\nvalue = 1.25\nsource = "ours"\n')
    assert cluster(str(path)).tp_overlap_gemm_slowdown == 1.25


def test_tp_overlap_seconds_by_hand() -> None:
    # a 3 s collective beside 2 s of GEMMs: 3 s instead of 5, 2 s saved; GEMMs twice as slow while they share the
    # SMs: max(3, 4) = 4 s, 1 s saved; a 1 s collective beside them at that slowdown costs 1 s more than none
    assert tp_overlap_seconds(3.0, 2.0) == 2.0
    assert tp_overlap_seconds(3.0, 2.0, 2.0) == 1.0
    assert tp_overlap_seconds(1.0, 2.0, 2.0) == -1.0


def test_tp_overlap_pairs_each_collective_with_the_gemms_it_feeds_or_follows() -> None:
    # Hugging Face's Llama at tp=2 with sequence parallelism, one layer's forward: the attention's all-gather
    # feeds q, k and v; o_proj's reduce-scatter follows o_proj; the MLP's all-gather feeds gate_proj (SiLU runs
    # before up_proj: the run ends there); down_proj's reduce-scatter follows down_proj
    pytest.importorskip("transformers")
    model = llama(2, 256, 4, 512, 2, 512, 64)
    ids = torch.zeros(1, 64, dtype=torch.long)
    est = quiet(fxflops.estimate, model, (ids,), backward=True, parallel={"tp": 2, "sequence_parallel": True})
    dtype = torch.bfloat16

    def gemm(module: str) -> float:
        return sum(node_seconds(n, A100.device, dtype) for n in est.nodes
                   if n.phase == "forward" and n.module == module and n.macs)

    def comm(module: str, op: str) -> float:
        return sum(collective_record_seconds(c, A100, ranks_per_node(2, 1, A100)) for c in est.collectives
                   if c.phase == "forward" and c.module == module and c.op == op)

    layer = "model.layers.0"
    pairs = [(comm(f"{layer}.self_attn", "all_gather"), sum(gemm(f"{layer}.self_attn.{p}_proj") for p in "qkv")),
             (comm(f"{layer}.self_attn.o_proj", "reduce_scatter"), gemm(f"{layer}.self_attn.o_proj")),
             (comm(f"{layer}.mlp", "all_gather"), gemm(f"{layer}.mlp.gate_proj")),
             (comm(f"{layer}.mlp.down_proj", "reduce_scatter"), gemm(f"{layer}.mlp.down_proj"))]
    assert all(c > 0 and g > 0 for c, g in pairs)
    costs = quiet(capture_costs, model, (ids,), A100, tp=2, sequence_parallel=True)
    # the block's costs are the mean of the two captured layers, which run the same ops
    assert costs.block.tp_overlap_forward == pytest.approx(sum(tp_overlap_seconds(c, g) for c, g in pairs), rel=1e-9)
    assert 0 < costs.block.tp_overlap_backward <= costs.block.comm_backward
    # in the step: each layer's exposed communication less what the overlap saves, per micro-batch
    plan = StepPlan(tp=2, sequence_parallel=True, global_batch=1)
    plain = simulate_plan(costs, plan, A100)
    overlapped = simulate_plan(costs, dataclasses.replace(plan, tp_comm_overlap=True), A100)
    saved = costs.layers * (costs.block.tp_overlap_forward + costs.block.tp_overlap_backward) \
        + costs.pre.tp_overlap_forward + costs.pre.tp_overlap_backward + costs.post.tp_overlap_forward \
        + costs.post.tp_overlap_backward
    assert plain.step_time - overlapped.step_time == pytest.approx(saved, rel=1e-9)
    assert any("overlapped with the GEMMs" in note for note in overlapped.notes)
    assert "TP comm overlapped" in str(overlapped)
    with pytest.raises(ValueError, match=r"^tp_comm_overlap overlaps sequence parallelism's"):
        dataclasses.replace(plan, sequence_parallel=False, tp_comm_overlap=True).check(2)


def test_a_backward_reduce_scatter_overlaps_the_weight_gradient_gemms_of_the_linears_it_fed() -> None:
    """Transformer Engine's bulk overlap (ub_bulk_wgrad, BULK_OVERLAP_RS; Megatron-Core's tp_comm_bulk_wgrad): the
    backward's reduce-scatter of a column-parallel linear's input gradient runs beside that linear's
    weight-gradient GEMM. A synthetic MLP of 4,096 tokens. Forward: the all-gather (module mlp) feeding fc1, GeLU,
    fc2, its reduce-scatter. Backward: the all-gather of fc2's output gradient, fc2's dgrad (K = 2,048 output
    features) and wgrad (K = 4,096 tokens), a bias-gradient sum, GeLU's backward, fc1's dgrad (K = 8,192) and wgrad
    (K = 4,096), an add, the reduce-scatter (module mlp). The forward all-gather claims fc1's forward GEMM (2 s) and
    so says it fed mlp.fc1; the backward all-gather claims fc2's two GEMMs (7 + 5 s: the sum ends the run); the
    reduce-scatter overlaps fc1's wgrad (3 s), never a dgrad (it makes what the reduce-scatter sends). Without the
    all-gather's claim still only fc1's wgrad: fc2's wgrad ran before the reduce-scatter's payload existed (before
    this fix: 3 + 5 s). Not knowing what the all-gather fed, the walk stops at the GEMMs another collective claimed.
    A forward reduce-scatter keeps the rule of the GEMMs right before it (fc2's forward, 4 s)."""
    from fxflops.predict.layers import _overlapped_gemms
    from fxflops.results.costs import COUNTED, NodeCost

    def node(name: str, op: str, module: str, m: int, n: int, k: int, phase: str = "backward") -> NodeCost:
        macs = m * n * k
        return NodeCost(name=name, op=op, status=COUNTED, rule="mm" if macs else "elementwise", module=module,
                        module_type="Block", input_shapes=((m, k), (k, n)), output_shapes=((m, n),), macs=macs,
                        flops=2 * macs if macs else m * n, phase=phase, bytes=2 * m * n)

    ag, rs, mm = ("_c10d_functional.all_gather_into_tensor.default", "_c10d_functional.reduce_scatter_tensor.default",
                  "aten.mm.default")
    nodes = [node("ag_f", ag, "mlp", 4096, 2048, 0, "forward"),
             node("fc1_f", mm, "mlp.fc1", 4096, 8192, 2048, "forward"),
             node("gelu_f", "aten.gelu.default", "mlp.act", 4096, 8192, 0, "forward"),
             node("fc2_f", mm, "mlp.fc2", 4096, 2048, 8192, "forward"),
             node("rs_f", rs, "mlp.fc2", 2048, 2048, 0, "forward"),
             node("ag", ag, "mlp.fc2", 4096, 2048, 0),
             node("fc2_dgrad", mm, "mlp.fc2", 4096, 8192, 2048),
             node("fc2_wgrad", mm, "mlp.fc2", 2048, 8192, 4096),
             node("bias", "aten.sum.dim_IntList", "mlp.fc2", 1, 2048, 0),
             node("gelu", "aten.gelu_backward.default", "mlp.act", 4096, 8192, 0),
             node("fc1_dgrad", mm, "mlp.fc1", 4096, 2048, 8192),
             node("fc1_wgrad", mm, "mlp.fc1", 8192, 2048, 4096),
             node("add", "aten.add.Tensor", "mlp", 4096, 2048, 0),
             node("rs", rs, "mlp", 2048, 2048, 0)]
    times = [0.0, 2.0, 0.1, 4.0, 0.0, 0.0, 7.0, 5.0, 0.1, 0.1, 11.0, 3.0, 0.1, 0.0]
    collectives = {"ag_f", "rs_f", "ag", "rs"}
    claimed: set[int] = set()
    fed: dict[str, set[str]] = {}
    assert _overlapped_gemms(nodes, times, 0, "all_gather", collectives, claimed, 4096, fed) == 2.0
    assert fed == {"mlp": {"mlp.fc1"}}
    assert _overlapped_gemms(nodes, times, 4, "reduce_scatter", collectives, claimed, 4096, fed) == 4.0
    assert _overlapped_gemms(nodes, times, 5, "all_gather", collectives, claimed, 4096, fed) == 7.0 + 5.0
    assert _overlapped_gemms(nodes, times, 13, "reduce_scatter", collectives, claimed, 4096, fed) == 3.0
    assert _overlapped_gemms(nodes, times, 13, "reduce_scatter", collectives, {0, 1, 3}, 4096, fed) == 3.0
    assert _overlapped_gemms(nodes, times, 13, "reduce_scatter", collectives, {6, 7}, 4096) == 3.0


def test_plan_search_tries_tp_comm_overlap_only_when_asked(tmp_path) -> None:
    def build(layers: int) -> GPT:
        with torch.device("meta"):
            return GPT(layers, 256, 8, vocab=1024, seq=256).to(torch.bfloat16)

    options = dict(gpus=4, global_batch=8, seq_len=256, layers=4, tp=(2,), pp=(1,), micro_batch=(1,),
                   recompute=("none",), virtual_stages=(1,), fsdp=(True,), dp_shard=())
    plain = quiet(fxflops.plan, build, cluster="DGX A100 80GB", **options)
    assert [r.plan.tp_comm_overlap for r in plain.rows + plain.dropped] == [False]
    both = quiet(fxflops.plan, build, cluster="DGX A100 80GB", tp_comm_overlap=(False, True), **options)
    rows = {r.plan.tp_comm_overlap: r for r in both.rows + both.dropped}
    assert set(rows) == {False, True} and rows[True].step_time < rows[False].step_time
    assert rows[True].record()["tp_comm_overlap"] is True
    # a cluster file whose GEMMs run 3 times slower beside a collective: the overlapped plan is slower than that
    # (the saving comm + gemm - max(comm, 3 gemm) is smaller), and the search says the constant is the user's
    path = tmp_path / "slow_overlap.toml"
    path.write_text('base = "DGX A100 80GB"\n[tp_overlap_gemm_slowdown]\nvalue = 3.0\nsource = "a guess"\n')
    slow = quiet(fxflops.plan, build, cluster=str(path), tp_comm_overlap=(True,), **options)
    assert slow.rows[0].step_time > rows[True].step_time
    assert f"cluster constants from your file {path}: tp_overlap_gemm_slowdown" in slow.notes


def test_cli_plan_tries_hsdp_and_tp_comm_overlap(tmp_path, capsys) -> None:
    # a 4-layer GPT on 8 GPUs of a DGX A100, micro-batch 2, batch 16: every FSDP plan with dp = 8 / (tp x pp) >= 4
    # is also tried as HSDP with each shard degree between 1 and dp that divides it; --dp-shard 2 keeps only 2;
    # --tp-comm-overlap adds each sequence-parallel plan (tp > 1) overlapped
    factory = tmp_path / "gpt.py"
    factory.write_text("import torch\nfrom fxflops.predict.validation import GPT\n\n\ndef build(batch, seq_len):\n"
                       "    with torch.device('meta'):\n"
                       "        model = GPT(4, 256, 8, vocab=1024, seq=128).to(torch.bfloat16)\n"
                       "    return model, torch.zeros(batch, seq_len, dtype=torch.long)\n")
    table = tmp_path / "p.csv"
    common = ["plan", f"{factory}:build", "--gpus", "8", "--cluster", "DGX A100 80GB", "--batch", "16", "--seq-len", "128",
              "--micro-batch", "2", "--csv", str(table)]
    assert main([*common, "--dp-shard", "2", "--tp-comm-overlap"]) == 0
    capsys.readouterr()
    import csv

    rows = list(csv.DictReader(table.read_text().splitlines()))
    hsdp = {(row["tp"], row["pp"], row["dp"], row["dp_shard"]) for row in rows if row["fsdp"] == "True"
            and row["dp_shard"] != row["dp"]}
    assert hsdp and all(shard == "2" and int(dp) > 2 for _, _, dp, shard in hsdp)
    overlapped = [row for row in rows if row["tp_comm_overlap"] == "True"]
    assert overlapped and all(row["tp"] != "1" and row["sequence_parallel"] == "True" for row in overlapped)
    assert main([*common, "--dp-shard"]) == 0
    rows = list(csv.DictReader(table.read_text().splitlines()))
    assert all(row["dp_shard"] in (row["dp"], "") for row in rows)
    assert not any(row["tp_comm_overlap"] == "True" for row in rows)


def test_hsdp_all_reduce_runs_on_its_own_stream_after_each_reduce_scatter() -> None:
    # two layers of 1 s backward, no gathers, reduce-scatters of 0.5 s and replica all-reduces of 0.8 s. Layer 1's
    # reduce-scatter runs 1-1.5 s, its all-reduce 1.5-2.3 s on its own stream; layer 2's reduce-scatter 2-2.5 s,
    # its all-reduce from 2.5 s (both its reduce-scatter and the stream are done) to 3.3 s. On one stream the
    # second reduce-scatter would wait for the first all-reduce: 2.3-2.8 s, then 2.8-3.6 s.
    from fxflops.predict.step import _prefetched

    assert _prefetched([1.0, 1.0], [0.0, 0.0], [0.5, 0.5], [0.8, 0.8]) == pytest.approx(3.3)
    assert _prefetched([1.0, 1.0], [0.0, 0.0], [0.5 + 0.8, 0.5 + 0.8]) == pytest.approx(3.6)


def test_hsdp_model_moves_the_bytes_torch_fsdp2_records() -> None:
    # torch's own HSDP (fully_shard on a (dp_replicate=2, dp_shard=2) mesh, captured by fxflops.estimate) per
    # layer: an all-gather of the layer's bf16 parameters over the 2 shard ranks (forward, and backward after
    # resharding), a reduce-scatter of its gradients over them, and an all-reduce of the gradient shard (half)
    # over the 2 replicas: the sizes and groups the step's HSDP model times
    ids = torch.zeros(1, 32, dtype=torch.long)
    est = quiet(fxflops.estimate, tiny_gpt(), (ids,), backward=True, parallel={"dp": 4, "dp_shard": 2})
    plan = StepPlan(dp=4, dp_shard=2, fsdp=True, global_batch=4)
    params = quiet(capture_costs, tiny_gpt(), (ids,), A100).block.params
    # (the last layer: FSDP2 prefetches the others' backward gathers from the module running before them)
    layer = sorted((c.op, c.phase, c.group_size, c.bytes) for c in est.collectives if c.module == "layers.1")
    assert layer == sorted([("all_gather", "forward", plan.shard_group, params * 2),
                            ("all_gather", "backward", plan.shard_group, params * 2),
                            ("reduce_scatter", "backward", plan.shard_group, params * 2),
                            ("all_reduce", "backward", plan.replicas, params * 2 // plan.shard_group)])
