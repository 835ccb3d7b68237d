"""Expert parallelism in what-if plans: per-rank FLOPs are hand counts under the torch preset (matmuls and
SDPA, FlopCounterMode's formulas), the all-to-all bytes closed forms (tokens x top-k x h each way)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fxflops
from tests.moe_models import MoEModel

V, D, H, E, K, L, B, S = 32, 16, 32, 4, 2, 2, 2, 8
T, FP32 = B * S, 4
ROUTER = 2 * T * D * E
SHARED = 3 * 2 * T * D * H  # the shared expert: every token
HEAD = 2 * T * D * V
ROUTED = T * K * D * FP32  # bytes of the routed rows: tokens x top-k x h


def experts(rows: int) -> int:
    return 3 * 2 * rows * D * H  # w1, w3, w2 per routed row


def fwd(rows: int) -> int:
    """One rank's forward when its experts receive `rows` rows in each layer."""
    return L * (ROUTER + SHARED + experts(rows)) + HEAD


def tokens():
    return torch.zeros(B, S, dtype=torch.long)


def moe(layout: str) -> MoEModel:
    with torch.device("meta"):
        return MoEModel(V, D, H, E, K, L, layout)


def plan_estimate(model, routing=None, **plan):
    est = fxflops.estimate(model, (tokens(),), conventions="torch", backward=True, parallel=plan, routing=routing)
    assert not dist.is_initialized()
    return est


def all_to_alls(est, phase, dtype="float32"):
    """The rank's all-to-alls of one phase: of the rows (float32), or of torchtitan's counts (int64)."""
    return [c for c in est.collectives if c.op == "all_to_all" and c.phase == phase and c.dtype == dtype]


@pytest.mark.filterwarnings("ignore:values the weights decide")
@pytest.mark.parametrize("layout", ["loop", "grouped_mm", "list"])
@pytest.mark.parametrize("ep", [2, 4])
def test_balanced_routing_each_rank_runs_its_experts_on_the_tokens_routed_to_them(layout, ep):
    est = plan_estimate(moe(layout), ep=ep, dp=ep)
    # balanced: T*K/E rows per expert from each rank; a rank's E/ep experts get ep times that = T*K rows
    assert (est.fwd_flops, est.bwd_flops) == (fwd(T * K), 2 * fwd(T * K))
    assert [(r.name, r.ranks) for r in est.ranks] == [("every rank", tuple(range(ep)))]
    assert est.job_flops == ep * est.total_flops
    for phase in ("forward", "backward"):
        found = all_to_alls(est, phase)
        # dispatch and combine per layer (the ModuleList's layer exchanges each expert's rows on their own)
        assert len(found) == 2 * L * (E if layout == "list" else 1)
        assert sum(c.bytes for c in found) == 2 * L * ROUTED
        # a rank keeps the rows for its own experts: 1/ep of them
        assert sum(c.wire_bytes for c in found) == 2 * L * ROUTED * (ep - 1) // ep
        assert {c.group_size for c in found} == {ep} and {c.module for c in found} == \
            {f"layers.{i}.moe.experts" + (f".{e}" if layout == "list" else "") for i in range(L)
             for e in range(E)}
    # torchtitan's experts first exchange the tokens per expert (E int64), forward only
    counts = all_to_alls(est, "forward", "int64")
    expected = [] if layout == "list" else [(E * 8, E * 8 * (ep - 1) // ep)] * L
    assert [(c.bytes, c.wire_bytes) for c in counts] == expected
    assert all_to_alls(est, "backward", "int64") == []
    # the rank's parameters: its E/ep experts whole (dp = ep: FSDP leaves them be), the rest sharded ep ways
    other = 2 * V * D + L * (D + D * E + 3 * D * H)
    assert est.total_params == other // ep + L * (E // ep) * 3 * D * H


@pytest.mark.filterwarnings("ignore:values the weights decide")
def test_worst_routing_makes_two_rank_roles():
    est = plan_estimate(moe("loop"), routing="worst", ep=2, dp=2)
    # every token to experts 0 and 1, both on expert-parallel rank 0: it gets both ranks' T*K rows
    (busy, idle) = est.ranks
    assert (busy.ranks, idle.ranks) == ((0,), (1,))
    assert (busy.estimate.fwd_flops, idle.estimate.fwd_flops) == (fwd(2 * T * K), fwd(0))
    assert (busy.estimate.bwd_flops, idle.estimate.bwd_flops) == (2 * fwd(2 * T * K), 2 * fwd(0))
    assert est.job_flops == fwd(2 * T * K) * 3 + fwd(0) * 3
    assert "its experts receive 64, 64 rows" in busy.name and "receive 0, 0 rows" in idle.name
    # rank 0 sends its T*K rows to itself (nothing on the wire) and returns 2*T*K rows, half to rank 1
    found = all_to_alls(busy.estimate, "forward")
    assert [(c.bytes, c.wire_bytes) for c in found] == [(ROUTED, 0), (2 * ROUTED, ROUTED)] * L
    found = all_to_alls(idle.estimate, "forward")
    assert [(c.bytes, c.wire_bytes) for c in found] == [(ROUTED, ROUTED), (0, 0)] * L


@pytest.mark.filterwarnings("ignore:values the weights decide")
def test_given_counts_set_each_ranks_tokens():
    est = plan_estimate(moe("loop"), routing=[12, 4, 8, 8], ep=2, dp=2)
    # each rank routes 12, 4, 8, 8 rows: rank 0's experts get 2*(12+4), rank 1's 2*(8+8): same rows, other splits
    assert [r.ranks for r in est.ranks] == [(0,), (1,)]
    assert [r.estimate.fwd_flops for r in est.ranks] == [fwd(T * K)] * 2
    assert "24, 8" not in est.ranks[0].name and "32, 32 rows" in est.ranks[0].name


@pytest.mark.filterwarnings("ignore:values the weights decide")
def test_dp_above_ep_shards_the_experts_over_the_ranks_holding_the_same_ones():
    est = plan_estimate(moe("loop"), ep=2, dp=4)
    assert est.fwd_flops == fwd(T * K) and [r.ranks for r in est.ranks] == [(0, 1, 2, 3)]
    gathers = {(c.module, c.group_size, c.bytes) for c in est.collectives if c.op == "all_gather" and c.phase == "forward"}
    expert_bytes = (E // 2) * 3 * D * H * FP32
    # each layer's local experts: over dp / ep = 2 ranks; the blocks and the root: over all 4
    assert {g for g in gathers if g[0].endswith("experts")} == {(f"layers.{i}.moe.experts", 2, expert_bytes)
                                                               for i in range(L)}
    assert {g[1] for g in gathers if not g[0].endswith("experts")} == {4}
    # the experts' gradients reduce-scattered over those 2 ranks, the rest over all 4: FSDP's gradient
    # reductions, once per optimizer step; the all-to-alls run each micro-batch
    scatters = {(c.module, c.group_size, c.per_step) for c in est.collectives if c.op == "reduce_scatter"}
    assert scatters == {*((f"layers.{i}.moe.experts", 2, True) for i in range(L)),
                        *((f"layers.{i}", 4, True) for i in range(L)), ("", 4, True)}
    assert not any(c.per_step for c in est.collectives if c.op == "all_to_all")


@pytest.mark.filterwarnings("ignore:values the weights decide")
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
def test_hugging_face_mixtral_experts(implementation):
    from transformers import MixtralConfig, MixtralForCausalLM

    heads, kv = 4, 2
    config = MixtralConfig(vocab_size=V, hidden_size=D, intermediate_size=H, num_hidden_layers=L,
                           num_attention_heads=heads, num_key_value_heads=kv, num_local_experts=E,
                           num_experts_per_tok=K, attn_implementation="sdpa")
    with torch.device("meta"):
        model = MixtralForCausalLM(config)
    model.config._experts_implementation = implementation  # transformers' experts kernels: the same count
    est = plan_estimate(model, ep=2, dp=2)
    head_dim = D // heads
    attention = 2 * T * D * (2 * D + 2 * kv * head_dim)  # q, o: D x D; k, v: D x kv heads
    sdpa = 2 * (2 * B * heads * S * S * head_dim)
    layer = attention + ROUTER + experts(T * K)
    assert est.fwd_flops == L * (layer + sdpa) + HEAD
    assert est.bwd_flops == 2 * (L * layer + HEAD) + L * 5 * sdpa // 2
    for phase in ("forward", "backward"):
        found = all_to_alls(est, phase)
        assert len(found) == 2 * L and sum(c.bytes for c in found) == 2 * L * ROUTED
    assert {c.module for c in all_to_alls(est, "forward")} == {f"model.layers.{i}.mlp.experts" for i in range(L)}


@pytest.mark.filterwarnings("ignore:values the weights decide")
@pytest.mark.parametrize("routing", ["balanced", "worst"])
def test_hugging_face_qwen2_moe_with_its_shared_expert(routing):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    heads, kv = 4, 2
    config = Qwen2MoeConfig(vocab_size=V, hidden_size=D, intermediate_size=H, moe_intermediate_size=H,
                            shared_expert_intermediate_size=H, num_hidden_layers=L, num_attention_heads=heads,
                            num_key_value_heads=kv, num_experts=E, num_experts_per_tok=K, attn_implementation="sdpa")
    with torch.device("meta"):
        model = Qwen2MoeForCausalLM(config)
    est = plan_estimate(model, routing=routing, ep=2, dp=2)
    head_dim = D // heads
    # q, k, v (their biases are not matmul FLOPs), o; the router, the shared expert and its gate
    dense = 2 * T * D * (2 * D + 2 * kv * head_dim) + ROUTER + SHARED + 2 * T * D
    sdpa = 2 * (2 * B * heads * S * S * head_dim)
    rows = {"balanced": [T * K, T * K], "worst": [2 * T * K, 0]}[routing]  # per expert-parallel rank
    assert [r.ranks for r in est.ranks] == ([(0, 1)] if routing == "balanced" else [(0,), (1,)])
    for role, received in zip(est.ranks, rows):
        assert role.estimate.fwd_flops == L * (dense + experts(received) + sdpa) + HEAD
        assert role.estimate.bwd_flops == 2 * (L * (dense + experts(received)) + HEAD) + L * 5 * sdpa // 2


def test_the_model_is_left_as_it_was():
    for layout in ("grouped_mm", "list"):
        model = moe(layout)
        before = {name: (type(p), p.shape) for name, p in model.named_parameters()}
        classes = {name: type(m) for name, m in model.named_modules()}
        with pytest.warns(fxflops.CautionWarning):
            plan_estimate(model, ep=2, dp=2)
        assert {name: (type(p), p.shape) for name, p in model.named_parameters()} == before
        assert {name: type(m) for name, m in model.named_modules()} == classes
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


class OddExperts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.experts(x)


@pytest.mark.parametrize(("model", "plan", "message"), [
    (lambda: moe("loop"), {"ep": 3, "dp": 3}, "ep=3 does not divide the 4 experts of 'layers.0.moe.experts'"),
    (lambda: moe("loop"), {"ep": 2}, "ep=2 splits the experts over data-parallel ranks .*; dp=1 is not a multiple of 2"),
    (lambda: torch.nn.Linear(4, 4), {"ep": 2, "dp": 2}, "ep=2 found no experts in Linear to split; recognized is"),
    (OddExperts, {"ep": 2, "dp": 2}, "ep cannot split the experts of 'experts' \\(Linear\\): its layout is not one"),
])
def test_bad_expert_plans_are_one_clear_line(model, plan, message):
    with pytest.raises((ValueError, NotImplementedError), match=message) as caught:
        fxflops.estimate(model(), (tokens(),), parallel=plan)
    assert "\n" not in str(caught.value)
    assert not dist.is_initialized()


def test_the_expert_split_runs_for_real_with_the_all_to_alls_comm_debug_mode_counts():
    """The hooks that split the experts run on real tensors too (the real routing decides the rows), and
    CommDebugMode's all-to-alls per module equal the estimate's of the same split model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fxflops.parallel.experts import RoutedCounts, apply_experts
    from tests.test_parallel import comm_debug_counts

    torch.manual_seed(0)
    model = MoEModel(V, D, H, E, K, L, "loop")
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.1)
    # equal scores send every token to the same two experts (topk breaks the tie); the test runs as the rank
    # holding both, the one whose buffers are non-empty both ways (the fake group runs no other)
    for layer in model.layers:
        torch.nn.init.zeros_(layer.moe.gate.weight)
    picked = torch.topk(torch.zeros(1, E), K).indices.flatten() // (E // 2)
    assert picked.min() == picked.max()
    dist.init_process_group("fake", store=FakeStore(), rank=int(picked[0]), world_size=2)
    try:
        apply_experts(model, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)), RoutedCounts())
        with CommDebugMode() as comm:
            model(tokens()).sum().backward()
        expected = {key: count for key, count in comm_debug_counts(comm).items() if key[0].endswith("experts")}
        model.zero_grad(set_to_none=True)
        with pytest.warns(fxflops.CautionWarning):
            est = fxflops.estimate(model, (tokens(),), conventions="torch", backward=True)
        found: dict = {}
        for c in est.collectives:
            found[(c.module, c.phase)] = found.get((c.module, c.phase), 0) + 1
        # per layer: the counts, the rows and the results forward; the results' and rows' gradients backward
        assert found == expected == {**{(f"layers.{i}.moe.experts", "forward"): 3 for i in range(L)},
                                     **{(f"layers.{i}.moe.experts", "backward"): 2 for i in range(L)}}
        assert est.fwd_flops == fwd(T * K)
    finally:
        dist.destroy_process_group()


def test_received_rows_are_regrouped_per_expert_and_back():
    from fxflops.parallel.experts import _regroup

    sizes = [2, 0, 1]  # rows of each local expert from each of 3 source ranks
    rows = torch.tensor([(source, expert) for source in range(3) for expert, size in enumerate(sizes)
                         for _ in range(size)])
    grouped = _regroup(rows, 3, sizes, by_inner=True)
    assert grouped.tolist() == [[s, e] for e, size in enumerate(sizes) for s in range(3) for _ in range(size)]
    assert torch.equal(_regroup(grouped, 3, sizes, by_inner=False), rows)


class OutputMoE(MoEModel):
    """MoEModel with its head named `output`, which the derived plan recognizes (column parallel, reading
    the sequence-sharded stream under sequence parallelism)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.output = self.head
        del self.head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(h)


@pytest.mark.filterwarnings("ignore:values the weights decide")
@pytest.mark.parametrize(("layout", "ep"),
                         [("loop", 1), ("grouped_mm", 1), ("list", 1), ("loop", 2), ("grouped_mm", 2)])
def test_sequence_parallel_moe_layers_gather_their_tokens_and_split_their_output(layout, ep):
    """tp=2 with sequence parallelism: an MoE layer's sequence-sharded input is all-gathered (the router
    sees all T tokens), the layer runs as under tp alone (routed experts whole on each rank, listed experts
    and the shared expert column/row parallel with their all-reduces) and its output is split back along
    the sequence (no communication forward; its gradient all-gathered). Only the head differs from tp
    alone: column parallel here (HEAD / 2). Under ep=2 (balanced) a rank's experts get T*K rows as before."""
    with torch.device("meta"):
        model = OutputMoE(V, D, H, E, K, L, layout)
    plan = {"tp": 2, "sequence_parallel": True, **({"ep": ep, "dp": ep} if ep > 1 else {})}
    est = plan_estimate(model, **plan)
    routed = experts(T * K) // (2 if layout == "list" else 1)  # listed experts are MLP blocks: tensor parallel
    forward = L * (ROUTER + SHARED // 2 + routed) + HEAD // 2
    assert (est.fwd_flops, est.bwd_flops) == (forward, 2 * forward)
    tokens_bytes = B * S * D * FP32  # b·s·h float32: the whole layer input
    for layer in range(L):
        at = [(c.op, c.phase, c.bytes) for c in est.collectives if c.module == f"layers.{layer}.moe"]
        assert sorted(at) == [("all_gather", "backward", tokens_bytes), ("all_gather", "forward", tokens_bytes)]
        shared = [(c.op, c.phase, c.bytes) for c in est.collectives
                  if c.module.startswith(f"layers.{layer}.moe.shared")]
        assert sorted(shared) == [("all_reduce", "backward", tokens_bytes), ("all_reduce", "forward", tokens_bytes)]
    if ep > 1:  # every tp rank dispatches all T*K rows it routed, each way (the gathered tokens)
        for phase in ("forward", "backward"):
            assert [c.bytes for c in all_to_alls(est, phase)] == [ROUTED] * 2 * L
    assert not any(c.op == "reduce_scatter" and ".moe" in c.module for c in est.collectives)
    if ep == 1:  # the report says what each tp rank runs whole: the router, and routed experts not split
        whole = {"gate": 3 * ROUTER, **({} if layout == "list" else {"experts": 3 * experts(T * K)})}
        assert {(r["module"], r["flops"], r["extra_flops"], r["whole"]) for r in est.parallel["replicated"]} == \
            {(f"layers.{i}.moe.{name}", flops, flops, True) for i in range(L) for name, flops in whole.items()}


@pytest.mark.filterwarnings("ignore:values the weights decide")
@pytest.mark.parametrize(("sequence_parallel", "ep"), [(False, 2), (True, 2), (False, 4)])
def test_listed_experts_under_tp_and_ep_dispatch_their_rows_before_splitting_them_tensor_parallel(
        sequence_parallel, ep):
    """A ModuleList of experts under tp=2 and ep together (with and without sequence parallelism), in
    torchtitan's order: each expert call's rows go to the expert's rank first (all-to-all over the ep
    ranks, plain tensors), the expert then runs column/row parallel over the tp ranks on the rows it
    received (an all-reduce of them forward and one backward), and the results come back. Balanced: each
    rank routes T*K/E rows to each expert, so an expert receives ep*T*K/E rows and a rank's E/ep experts
    T*K rows, split over tp: experts(T*K)/2. Before, the expert's tensor-parallel input hook ran first
    and the dispatch met a DTensor (the capture failed)."""
    with torch.device("meta"):
        model = OutputMoE(V, D, H, E, K, L, "list")
    est = plan_estimate(model, tp=2, ep=ep, dp=ep, sequence_parallel=sequence_parallel)
    head = HEAD // 2 if sequence_parallel else HEAD  # column parallel only under sequence parallelism
    forward = L * (ROUTER + SHARED // 2 + experts(T * K) // 2) + head
    assert (est.fwd_flops, est.bwd_flops) == (forward, 2 * forward)
    assert [(r.name, r.ranks) for r in est.ranks] == [("every rank", tuple(range(2 * ep)))]
    received = ep * T * K // E * D * FP32  # bytes of the rows one expert receives
    for phase, linear in (("forward", "w2"), ("backward", "w1")):
        found = all_to_alls(est, phase)
        assert len(found) == 2 * L * E  # each expert call's rows there and back
        assert sum(c.bytes for c in found) == 2 * L * ROUTED  # tokens x top-k x h each way
        assert sum(c.wire_bytes for c in found) == 2 * L * ROUTED * (ep - 1) // ep  # 1/ep stays on the rank
        assert {c.group_size for c in found} == {ep}
        # the rank's E/ep experts (0 .. E/ep-1 on rank 0) reduce the rows they received over the tp ranks
        reduced = [(c.module, c.bytes, c.group_size) for c in est.collectives
                   if c.op == "all_reduce" and c.phase == phase and ".experts." in c.module]
        assert sorted(reduced) == [(f"layers.{i}.moe.experts.{e}.{linear}", received, 2)
                                   for i in range(L) for e in range(E // ep)]
