"""Context parallelism in what-if plans: the sequence split over cp ranks (torch's head-tail load
balancing), attention as torch's ring attention. Per-rank FLOPs are hand counts under the torch preset
(FlopCounterMode's formulas: matmuls and SDPA, dense); the k/v all-gather bytes closed forms."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fxflops
from tests.parallel_models import Llama

V, D, L, HEADS, FF, B, S = 256, 64, 2, 8, 128, 2, 16
HEAD_DIM, FP32 = D // HEADS, 4


def sdpa(lq: int, lk: int, heads: int = HEADS) -> int:
    return 2 * B * heads * lq * lk * 2 * HEAD_DIM  # q @ k^T and p @ v


def ring(cp: int, causal: bool = True) -> int:
    """One rank's ring attention: step 0 its chunk against its own, causal; then per other rank half its
    queries against all the keys or all its queries against half the keys (head-tail balancing)."""
    local = S // cp
    if not causal:
        return cp * sdpa(local, local)
    return sdpa(local, local) + (cp - 1) * sdpa(local, local // 2)


def linears(tokens: int, kv_heads: int = HEADS) -> int:
    attention = 2 * tokens * D * (2 * D + 2 * kv_heads * HEAD_DIM)
    return attention + 3 * 2 * tokens * D * FF


def tokens():
    return torch.zeros(B, S, dtype=torch.long)


def plan_estimate(model, **plan):
    est = fxflops.estimate(model, (tokens(),), conventions="torch", backward=True, parallel=plan)
    assert not dist.is_initialized() and torch._C._len_torch_function_stack() == 0
    return est


def in_attention(est, phase):
    return [c for c in est.collectives if c.module.endswith("attention") and c.phase == phase]


@pytest.fixture(scope="module")
def llama():
    with torch.device("meta"):
        return Llama(V, D, L, HEADS, FF)


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_per_rank_flops_and_kv_all_gather(llama, cp):
    est = plan_estimate(llama, cp=cp)
    local = B * S // cp  # the rank's tokens
    head = 2 * local * D * V
    assert est.fwd_flops == L * (linears(local) + ring(cp)) + head
    # backward: grad input and weight of every matmul; each ring step's SDPA backward (5 products of half
    # the forward's size, FlopCounterMode's)
    assert est.bwd_flops == 2 * (L * linears(local) + head) + L * 5 * ring(cp) // 2
    assert [r.ranks for r in est.ranks] == [tuple(range(cp))]  # head-tail balancing: every rank alike
    kv = 2 * B * HEADS * S * HEAD_DIM * FP32  # every rank's k and v: the whole sequence's
    gathers = in_attention(est, "forward")
    assert [(c.op, c.bytes, c.wire_bytes, c.group_size) for c in gathers] == \
        [("all_gather", kv, kv * (cp - 1) // cp, cp)] * L
    assert [(c.op, c.bytes) for c in in_attention(est, "backward")] == [("reduce_scatter", kv)] * L
    # FSDP over the cp ranks (they hold other positions of the same batch): parameters gathered, gradients
    # reduce-scattered
    params = V * D * 2 + D + L * (4 * D * D + 3 * D * FF + 2 * D)
    fsdp = [c for c in est.collectives if not c.module.endswith("attention")]
    assert sum(c.bytes for c in fsdp if c.op == "reduce_scatter") == params * FP32


def test_cp_with_tp_and_dp(llama):
    est = plan_estimate(llama, cp=2, tp=2, dp=2)
    local = B * S // 2
    assert est.fwd_flops == L * (linears(local) + ring(2)) // 2 + 2 * local * D * V
    groups = {(c.op, c.group_desc, c.group_size) for c in est.collectives if c.phase == "forward"}
    assert groups == {("all_gather", "mesh_cp", 2), ("all_reduce", "mesh_tp", 2), ("all_gather", "mesh_dp_cp", 4)}
    assert len(est.ranks) == 1 and est.ranks[0].ranks == tuple(range(8))



@pytest.mark.parametrize("plan", [{"cp": 2}, {"cp": 2, "dp": 2}])
def test_only_fsdps_gradient_reductions_are_once_per_step(llama, plan):
    # ring attention's backward reduce-scatters dk/dv over the cp group (the whole world under cp=2 alone, the
    # group FSDP reduces gradients over): once per micro-batch; FSDP's reduce-scatters, at its units (each
    # block and the root), once per optimizer step (Collective.per_step)
    est = plan_estimate(llama, **plan)
    scatters = [(c.module, c.per_step) for c in est.collectives if c.op == "reduce_scatter"]
    assert sorted(scatters) == sorted([(f"layers.{i}.attention", False) for i in range(L)]
                                      + [(f"layers.{i}", True) for i in range(L)] + [("", True)])

class Bidirectional(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * D, bias=False)

    def forward(self, x):
        q, k, v = (t.view(B, -1, HEADS, HEAD_DIM).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return F.scaled_dot_product_attention(q, k, v)


def test_non_causal_attention_runs_every_query_against_every_key():
    with torch.device("meta"):
        model = Bidirectional()
    est = fxflops.estimate(model, (torch.randn(B, S, D, device="meta"),), conventions="torch", parallel={"cp": 4})
    assert est.fwd_flops == 2 * (B * S // 4) * D * 3 * D + ring(4, causal=False)


def test_hugging_face_llama_with_grouped_kv_heads():
    from transformers import LlamaConfig, LlamaForCausalLM

    kv_heads = 4
    config = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=FF, num_hidden_layers=L,
                         num_attention_heads=HEADS, num_key_value_heads=kv_heads, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    est = plan_estimate(model, cp=2)
    local = B * S // 2
    assert est.fwd_flops == L * (linears(local, kv_heads) + ring(2)) + 2 * local * D * V
    # the key/value heads are gathered as the model gives them (enable_gqa: 4 heads, not 8)
    gathers = [c for c in est.collectives if c.module.endswith("self_attn")]
    assert [(c.op, c.bytes) for c in gathers if c.phase == "forward"] == \
        [("all_gather", 2 * B * kv_heads * S * HEAD_DIM * FP32)] * L


def test_the_model_is_left_as_it_was(llama):
    plan_estimate(llama, cp=2)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in llama.modules())


@pytest.mark.parametrize(("plan", "message"), [
    ({"cp": 3}, "cp=3 does not divide the sequence of 16 positions into 2\\*cp = 6 chunks"),
    ({"cp": 16}, "cp=16 does not divide the sequence of 16 positions into 2\\*cp = 32 chunks"),
])
def test_bad_context_plans_are_one_clear_line(llama, plan, message):
    with pytest.raises((ValueError, NotImplementedError), match=message) as caught:
        fxflops.estimate(llama, (tokens(),), parallel=plan)
    assert "\n" not in str(caught.value)
    assert not dist.is_initialized()


def test_an_explicit_attention_mask_is_refused_naming_it():
    class Masked(Bidirectional):
        def forward(self, x):
            q, k, v = (t.view(B, -1, HEADS, HEAD_DIM).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool))

    with torch.device("meta"):
        model = Masked()
    with pytest.raises(fxflops.CaptureError, match="attention with an explicit mask"):
        fxflops.estimate(model, (torch.randn(B, S, D, device="meta"),), parallel={"cp": 2})
    assert not dist.is_initialized() and torch._C._len_torch_function_stack() == 0


def torch_ring_calls(cp: int, rank: int) -> list[tuple[torch.Size, torch.Size, torch.Size, bool]]:
    """The SDPA calls torch's own _templated_ring_attention makes as `rank` of a fake cp-rank process group on
    this file's causal attention (load balancing as torch's _cp_options says): (q, k, v shapes, is_causal)."""
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
    try:
        q, k, v = (torch.randn(B, HEADS, S // cp, HEAD_DIM) for _ in range(3))
        calls = []

        def op(q, k, v, is_causal, **kwargs):
            calls.append((q.shape, k.shape, v.shape, is_causal))
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, **kwargs)

        _templated_ring_attention(dist.group.WORLD, 2, op, q, k, v, is_causal=True)
        return calls
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cp", [2, 4])
def test_the_hand_count_is_what_torchs_own_ring_attention_runs_on_every_rank(cp):
    """torch's _templated_ring_attention (load balancing on, its default) on the fake process group as
    each rank: the SDPA calls it makes, costed with FlopCounterMode's own formula, sum to ring(cp)."""
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options
    from torch.utils.flop_counter import sdpa_flop_count

    assert _cp_options.enable_load_balance
    for rank in range(cp):
        assert sum(sdpa_flop_count(q, k, v) for q, k, v, _ in torch_ring_calls(cp, rank)) == ring(cp)


def kept_balanced(cp: int) -> int:
    """Query-key pairs one rank's ring steps keep under torch's head-tail layout (chunks r and 2cp-1-r, the local
    sequence of L = S/cp): step 0 causal over its own L positions, then cp - 1 steps of L x L/2 pairs all kept."""
    local = S // cp
    return local * (local + 1) // 2 + (cp - 1) * local * local // 2


def kept_unbalanced(cp: int, rank: int) -> int:
    """The same without load balancing (rank r holds the r-th contiguous chunk): step 0 causal, then all L x L
    pairs against each of the r ranks before it, nothing against the ranks after it (torch skips those steps)."""
    local = S // cp
    return local * (local + 1) // 2 + rank * local * local


def effective(pairs: int, heads: int = HEADS) -> int:
    return 2 * B * heads * pairs * 2 * HEAD_DIM  # q @ k^T and p @ v over the kept pairs


def forward_attention(est, field: str) -> int:
    return sum(getattr(n, field) for n in est.nodes if n.phase == "forward" and "attention" in n.op)


@pytest.mark.parametrize("cp", [2, 4])
def test_each_rank_runs_one_cp_th_of_the_causal_work_as_torchs_balanced_layout_makes_it(llama, cp):
    """The time model reads a causal kernel's effective FLOPs (the pairs its mask keeps: fxflops.predict.op_time),
    so the per-rank time is balanced when these are: under torch's head-tail layout every rank keeps 1/cp of the
    sequence's S(S+1)/2 causal pairs; the unbalanced layout's last rank would keep L(L+1)/2 + (cp-1)L^2 (cp=2:
    100 pairs against 68; cp=4: 58 against 34)."""
    from fxflops.predict.hardware import cluster
    from fxflops.predict.step import capture_costs

    whole = fxflops.estimate(llama, (tokens(),), backward=True)
    est = fxflops.estimate(llama, (tokens(),), backward=True, parallel={"cp": cp})
    assert forward_attention(whole, "effective_flops") == L * effective(S * (S + 1) // 2)
    assert forward_attention(est, "effective_flops") == L * effective(kept_balanced(cp))
    assert cp * kept_balanced(cp) == S * (S + 1) // 2 < cp * kept_unbalanced(cp, cp - 1)
    # the predicted step's per-layer costs: the rank's dense attention FLOPs are the balanced ring's, not the
    # unbalanced last rank's cp full L x L blocks
    costs = capture_costs(llama, tokens(), cluster("DGX A100 80GB"), cp=cp)
    assert costs.block.attention_flops == ring(cp) < cp * sdpa(S // cp, S // cp)


@pytest.mark.parametrize("cp", [2, 4])
def test_torchs_ring_keeps_these_pairs_per_rank_balanced_or_not(cp):
    """torch's own _templated_ring_attention on each rank of a fake process group, with its load balancing on
    (its default, which fxflops follows) and off: the pairs its SDPA calls keep (a causal call L(L+1)/2, others
    every pair) are the hand counts above, every rank alike only when balanced."""
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

    default = _cp_options.enable_load_balance
    try:
        for balanced in (True, False):
            _cp_options.enable_load_balance = balanced
            for rank in range(cp):
                kept = [q[-2] * (q[-2] + 1) // 2 if causal else q[-2] * k[-2]
                        for q, k, _, causal in torch_ring_calls(cp, rank)]
                assert sum(kept) == (kept_balanced(cp) if balanced else kept_unbalanced(cp, rank))
    finally:
        _cp_options.enable_load_balance = default
