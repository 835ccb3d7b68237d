"""What-if plans with pipeline stages, DDP, micro-batches and the replicated-work report (issue 38).

Hand counts under the torch preset (FlopCounterMode's formulas: matmuls and SDPA) for the small Llama of
tests/parallel_models.py with 4 layers; collective bytes are closed forms (b·s·h per micro-batch per stage
boundary each way; DDP: the gradient bytes of each block and of the rest, all-reduced).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fxflops
from fxflops.parallel.pipeline import layer_stages
from tests.parallel_models import Llama

V, D, L, HEADS, F, B, S = 256, 64, 4, 8, 128, 2, 16
T = B * S
FP32 = 4
ATTN_LINEAR = 4 * 2 * T * D * D
FFN = 3 * 2 * T * D * F
SDPA = 2 * (2 * B * HEADS * S * S * (D // HEADS))
HEAD = 2 * T * D * V
LAYER_FWD = ATTN_LINEAR + FFN + SDPA
LAYER_BWD = 2 * (ATTN_LINEAR + FFN) + 5 * SDPA // 2  # SDPA backward: 5 products of the forward's size
LAYER_PARAMS = 4 * D * D + 3 * D * F + 2 * D
WHOLE = L * (LAYER_FWD + LAYER_BWD) + 3 * HEAD  # the unsharded model, forward + backward, one micro-batch
ACTIVATION = T * D * FP32  # b·s·h of the residual stream


@pytest.fixture(scope="module")
def llama():
    with torch.device("meta"):
        return Llama(V, D, L, HEADS, F)


def tokens(batch: int = B):
    return torch.zeros(batch, S, dtype=torch.long)


def plan_estimate(model, conventions="torch", backward=True, **plan):
    est = fxflops.estimate(model, (tokens(),), conventions=conventions, backward=backward, parallel=plan)
    assert not dist.is_initialized()
    return est


def roles(est) -> dict[str, tuple]:
    return {role.name: (role.ranks, role.estimate.fwd_flops, role.estimate.bwd_flops) for role in est.ranks}


def p2p(estimate) -> list[tuple[str, str, int, int]]:
    return [(c.op, c.phase, c.bytes, c.wire_bytes) for c in estimate.collectives if c.op in ("send", "recv")]


def test_stages_are_balanced_by_layer_count():
    assert layer_stages(4, 2) == [0, 0, 1, 1]
    assert layer_stages(5, 2) == [0, 0, 0, 1, 1]  # the first stages take the extra layers
    assert layer_stages(7, 4) == [0, 0, 1, 1, 2, 2, 3]


def test_pp2_first_and_last_stage(llama):
    est = plan_estimate(llama, pp=2)
    assert roles(est) == {
        "pipeline stage 0 (first)": ((0,), 2 * LAYER_FWD, 2 * LAYER_BWD),
        "pipeline stage 1 (last)": ((1,), 2 * LAYER_FWD + HEAD, 2 * LAYER_BWD + 2 * HEAD)}
    first, last = (role.estimate for role in est.ranks)
    assert first.total_params == V * D + 2 * LAYER_PARAMS  # the embedding and two blocks
    assert last.total_params == 2 * LAYER_PARAMS + D + D * V  # two blocks, the final norm and the head
    # one boundary: the activation forward, its gradient backward
    assert p2p(first) == [("send", "forward", ACTIVATION, ACTIVATION), ("recv", "backward", ACTIVATION, 0)]
    assert p2p(last) == [("recv", "forward", ACTIVATION, 0), ("send", "backward", ACTIVATION, ACTIVATION)]
    assert est.job_flops == WHOLE
    assert est.total_flops == first.total_flops  # the estimate itself is the first role's rank


def test_pp4_has_one_middle_role_for_the_two_middle_stages(llama):
    est = plan_estimate(llama, pp=4)
    assert roles(est) == {
        "pipeline stage 0 (first)": ((0,), LAYER_FWD, LAYER_BWD),
        "pipeline stages 1-2 (middle)": ((1, 2), LAYER_FWD, LAYER_BWD),
        "pipeline stage 3 (last)": ((3,), LAYER_FWD + HEAD, LAYER_BWD + 2 * HEAD)}
    middle = est.ranks[1].estimate
    assert sorted(p2p(middle)) == sorted([("recv", "forward", ACTIVATION, 0), ("send", "forward", ACTIVATION, ACTIVATION),
                                          ("recv", "backward", ACTIVATION, 0), ("send", "backward", ACTIVATION, ACTIVATION)])
    assert middle.total_params == LAYER_PARAMS and {c.group_size for c in middle.collectives} == {4}
    # the job: 3 boundaries, b·s·h each way each
    assert sum(len(r.ranks) * r.estimate.collective_wire_bytes for r in est.ranks) == 3 * 2 * ACTIVATION
    assert est.job_flops == WHOLE


@pytest.mark.parametrize(("pp", "dp", "tp", "microbatches"), [(2, 2, 1, 4), (4, 2, 2, 8), (2, 1, 2, 2)])
def test_job_flops_are_the_unsharded_model_times_copies_and_micro_batches(llama, pp, dp, tp, microbatches):
    est = plan_estimate(llama, pp=pp, dp=dp, tp=tp, microbatches=microbatches)
    assert est.parallel["microbatches"] == microbatches and est.parallel["batch"] == B * microbatches * dp
    replicated = (tp - 1) * 3 * HEAD  # without sequence parallelism the head runs whole on each tp rank
    assert est.job_flops == microbatches * dp * (WHOLE + replicated)
    # every rank's pipeline position: pp outermost in the mesh, then dp, then tp
    per_stage = dp * tp
    assert est.ranks[0].ranks == tuple(range(per_stage)) and est.ranks[-1].ranks[-1] == pp * dp * tp - 1
    layers = L // pp
    assert est.ranks[0].estimate.fwd_flops == layers * LAYER_FWD // tp


def test_pp_with_tp_sends_the_local_activation_and_all_reduces_within_the_stage(llama):
    est = plan_estimate(llama, pp=2, tp=2)
    first = est.ranks[0].estimate
    totals = {key: (v["count"], v["bytes"]) for key, v in first.collective_totals(("phase", "op")).items()}
    assert totals == {("forward", "all_reduce"): (4, 4 * ACTIVATION), ("forward", "send"): (1, ACTIVATION),
                      ("backward", "recv"): (1, ACTIVATION), ("backward", "all_reduce"): (4, 4 * ACTIVATION)}
    assert est.ranks[0].ranks == (0, 1) and est.ranks[1].ranks == (2, 3)


def test_pp_with_fsdp_gathers_each_stages_own_parameters(llama):
    est = plan_estimate(llama, pp=2, dp=2)
    first, last = (role.estimate for role in est.ranks)

    def gathered(e, phase):
        return sum(c.bytes for c in e.collectives if c.op == "all_gather" and c.phase == phase)

    # forward and (resharded) backward: the stage's parameters; gradients reduce-scattered once
    for e, params in ((first, V * D + 2 * LAYER_PARAMS), (last, 2 * LAYER_PARAMS + D + D * V)):
        assert gathered(e, "forward") == gathered(e, "backward") == params * FP32
        assert sum(c.bytes for c in e.collectives if c.op == "reduce_scatter") == params * FP32
    assert est.ranks[0].ranks == (0, 1) and est.ranks[1].ranks == (2, 3)


def test_virtual_stages_interleave(llama):
    est = plan_estimate(llama, pp=2, virtual_stages=2)
    assert roles(est) == {
        "pipeline rank 0 (first; stages 0, 2)": ((0,), 2 * LAYER_FWD, 2 * LAYER_BWD),
        "pipeline rank 1 (last; stages 1, 3)": ((1,), 2 * LAYER_FWD + HEAD, 2 * LAYER_BWD + 2 * HEAD)}
    # rank 0 holds stages 0 and 2: it sends after 0 and 2, receives before 2 (each way, three boundaries in all)
    first, last = (role.estimate for role in est.ranks)
    assert sorted(p2p(first)) == sorted([("send", "forward", ACTIVATION, ACTIVATION)] * 2
                                        + [("recv", "forward", ACTIVATION, 0)]
                                        + [("recv", "backward", ACTIVATION, 0)] * 2
                                        + [("send", "backward", ACTIVATION, ACTIVATION)])
    assert len(p2p(last)) == 6 and est.job_flops == WHOLE


def test_ddp_all_reduces_the_gradients_in_ddps_buckets(llama):
    est = plan_estimate(llama, dp=4, fsdp=False)
    assert (est.fwd_flops, est.bwd_flops) == (L * LAYER_FWD + HEAD, L * LAYER_BWD + 2 * HEAD)
    rest = V * D + D + D * V  # embedding, final norm, head: the root's unit
    # 788,736 bytes of gradients: under DDP's first bucket's 1 MiB, one bucket, complete at the embedding's
    # gradient; tests/test_parallel_buckets.py has more buckets
    assert [(c.op, c.phase, c.module, c.bytes) for c in est.collectives] == \
        [("all_reduce", "backward", "tok_embeddings", (L * LAYER_PARAMS + rest) * FP32)]
    assert sum(c.bytes for c in est.collectives) == (L * LAYER_PARAMS + rest) * FP32 < 1 << 20
    assert all(c.wire_bytes == 2 * 3 * c.bytes // 4 and c.per_step for c in est.collectives)
    assert est.total_params == L * LAYER_PARAMS + rest  # nothing sharded


def test_gradient_accumulation_scales_the_job_and_reduces_gradients_once(llama):
    est = plan_estimate(llama, dp=2, fsdp=False, microbatch=B, batch=8 * B)  # 4 micro-batches per dp rank
    assert est.parallel["microbatches"] == 4 and est.micro_batches == 4
    assert est.job_flops == 4 * 2 * WHOLE
    # the gradient all-reduce runs once per step (no_sync until the last micro-batch)
    assert est.job_collective_wire_bytes == 2 * est.collective_wire_bytes
    piped = plan_estimate(llama, pp=2, microbatches=3)
    per_micro_batch = sum(len(r.ranks) * r.estimate.collective_wire_bytes for r in piped.ranks)
    assert piped.job_collective_wire_bytes == 3 * per_micro_batch == 3 * 2 * ACTIVATION
    assert "3 of 2 samples per data-parallel rank (global batch 6)" in piped.print(as_string=True, detailed=False)


def test_replicated_work_explains_the_sum_over_tp_ranks(llama):
    est = plan_estimate(llama, tp=2)
    assert [(r["module"], r["flops"], r["ranks"], r["extra_flops"], r["whole"]) for r in est.parallel["replicated"]] == \
        [("output", 3 * HEAD, 2, 3 * HEAD, True)]
    assert est.job_flops == WHOLE + sum(r["extra_flops"] for r in est.parallel["replicated"])


def test_replicated_norms_and_residual_adds_by_hand_under_deepspeed(llama):
    tp = 4
    est = plan_estimate(llama, conventions="deepspeed", backward=False, tp=tp)
    rms = 4 * T * D + 2 * T  # x², mean, mul by rsqrt, mul by weight: T·D each; + eps and rsqrt: T each
    expected = {f"layers.{i}.{norm}": rms for i in range(L) for norm in ("attention_norm", "ffn_norm")}
    expected |= {f"layers.{i}": 2 * T * D for i in range(L)}  # the two residual adds
    expected |= {"norm": rms, "output": 2 * T * D * V}
    found = {r["module"]: r["flops"] for r in est.parallel["replicated"]}
    assert found == expected
    assert all(r["whole"] and r["extra_flops"] == (tp - 1) * r["flops"] for r in est.parallel["replicated"])
    text = est.print(as_string=True, detailed=False)
    assert f"replicated work:{' ' * 46}{(tp - 1) * sum(expected.values()):,} flops" in text


def test_sequence_parallel_leaves_no_replicated_matmul(llama):
    est = plan_estimate(llama, tp=2, sequence_parallel=True)
    assert est.parallel["replicated"] == []


def test_the_model_is_left_as_it_was_after_pp_and_ddp(llama):
    before = {name: (type(p), p.shape) for name, p in llama.named_parameters()}
    classes = {name: type(m) for name, m in llama.named_modules()}
    plan_estimate(llama, pp=2, dp=2, fsdp=False)
    plan_estimate(llama, pp=2, dp=2)
    assert {name: (type(p), p.shape) for name, p in llama.named_parameters()} == before
    assert {name: type(m) for name, m in llama.named_modules()} == classes
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in llama.modules())


@pytest.mark.parametrize(("plan", "message"), [
    ({"pp": 5}, "pp=5 stages for 4 layers; pp can be at most 4"),
    ({"pp": 2, "virtual_stages": 3}, "pp*virtual_stages = 2*3 = 6 stages for 4 layers"),
    ({"virtual_stages": 2}, "virtual_stages=2 are stages per pipeline rank; give pp > 1"),
    ({"dp": 2, "batch": 6}, "batch=6 is not a multiple of microbatch * dp = 2*2 = 4"),
    ({"dp": 2, "microbatches": 3, "batch": 8}, "batch=8 does not split into microbatches * dp = 3*2 = 6 equal"),
    ({"dp": 2, "microbatch": 2, "microbatches": 3, "batch": 8}, "batch=8 is 2 micro-batches of 2 per dp rank"),
    ({"microbatch": 4}, "microbatch=4, but the inputs (one micro-batch) have 2 samples"),
    ({"pp": 2, "dp": 2, "world_size": 8}, "world size 8 is not pp*dp*cp*tp = 2*2*1*1 = 4"),
    ({"dp": 2, "fsdp": False, "dp_shard": 1}, "dp_shard shards parameters"),
])
def test_bad_pipeline_and_batch_plans_are_one_clear_line(llama, plan, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace("(", r"\(").replace(")", r"\)")) as caught:
        fxflops.estimate(llama, (tokens(),), parallel=plan)
    assert "\n" not in str(caught.value)
    assert not dist.is_initialized()


def test_a_pipeline_needs_repeated_blocks():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.b(self.a(x))

    with pytest.raises(ValueError, match="pp=2 cuts the repeated blocks into stages, and Two has none"):
        fxflops.estimate(Two(), (torch.randn(2, 8),), parallel={"pp": 2})
    assert not dist.is_initialized()


def test_a_pipeline_stage_explains_its_own_modules(llama):
    est = plan_estimate(llama, pp=2)
    last = est.ranks[1].estimate
    assert "aten.mm.default" in str(last.explain("output"))
    assert set(last.modules) >= {"", "layers", "layers.2", "layers.3", "norm", "output"}
    assert "layers.0" not in last.modules and "tok_embeddings" not in last.modules


def test_a_plain_stack_of_linears_with_a_constant_backward_seed():
    # the input needs no gradient: the first linear's backward is its weight gradient only; the gradients
    # of the others read no input (the backward's seed is a constant) and still go by what they differentiate
    n, width, tokens_ = 8, 64, 32
    with torch.device("meta"):
        stack = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(n)))
    est = fxflops.estimate(stack, (torch.randn(tokens_, width, device="meta"),), conventions="torch", backward=True,
                           parallel={"pp": 4})
    one = 2 * tokens_ * width * width
    assert roles(est) == {"pipeline stage 0 (first)": ((0,), 2 * one, 3 * one),
                          "pipeline stages 1-2 (middle)": ((1, 2), 2 * one, 4 * one),
                          "pipeline stage 3 (last)": ((3,), 2 * one, 4 * one)}
    assert est.job_flops == (n + 2 * n - 1) * one


def test_hf_llama_stages_send_the_hidden_state_and_each_builds_its_rotary_tables():
    from transformers import LlamaConfig, LlamaForCausalLM

    kv_heads, head_dim = 4, D // HEADS
    config = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
                         num_attention_heads=HEADS, num_key_value_heads=kv_heads, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    est = plan_estimate(model, pp=2, tp=2)
    kv = kv_heads * head_dim
    attention_linear = 2 * T * D * (2 * D + 2 * kv)
    layer = (attention_linear + FFN + SDPA) // 2  # tp=2 splits the block's matmuls
    first, last = (role.estimate for role in est.ranks)
    assert (first.fwd_flops, last.fwd_flops) == (2 * layer, 2 * layer + HEAD)
    # the residual stream (b·s·h) only: the rotary cos and sin come from positions and a buffer, and the next
    # stage computes them itself, as torchtitan's split does (tests/test_parallel_schedule.py: torch's schedule)
    assert sorted(p2p(first)) == sorted([("send", "forward", ACTIVATION, ACTIVATION), ("recv", "backward", ACTIVATION, 0)])
    assert "model.rotary_emb" in first.modules and "model.rotary_emb" in last.modules
    assert [(r["module"], r["extra_flops"]) for r in est.parallel["replicated"]] == [("lm_head", 3 * HEAD)]


class SharedProduct(torch.nn.Module):
    """w = a @ b from two trainable parameters of the root, read after every block (a value from parameters
    alone that two stages read)."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.empty(width, width))
        self.b = torch.nn.Parameter(torch.empty(width, width))
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.a @ self.b
        for layer in self.layers:
            x = layer(x) @ w
        return x


def test_a_value_from_trainable_parameters_is_computed_once_and_sent_with_its_gradient_back():
    # unlike the rotary tables (buffers and positions: each stage builds its own), w depends on parameters the
    # first stage holds: the last stage neither holds them nor their gradients, so w is sent like an
    # activation and its gradient comes back, and a @ b (and its backward) runs on the first stage only
    width, rows = 8, 16
    with torch.device("meta"):
        model = SharedProduct(width, 2)
    est = fxflops.estimate(model, (torch.randn(4, rows // 4, width, device="meta"),), conventions="torch",
                           backward=True, parallel={"pp": 2})
    one, product = 2 * rows * width * width, 2 * width ** 3  # a linear or `@ w`; a @ b
    # backward: the input needs no gradient (the first linear: its weight gradient only); `@ w`: both gradients
    assert roles(est) == {"pipeline stage 0 (first)": ((0,), 2 * one + product, 3 * one + 2 * product),
                          "pipeline stage 1 (last)": ((1,), 2 * one, 4 * one)}
    act, w = rows * width * FP32, width * width * FP32
    first = est.ranks[0].estimate
    assert sorted(p2p(first)) == sorted([("send", "forward", act, act), ("send", "forward", w, w),
                                         ("recv", "backward", act, 0), ("recv", "backward", w, 0)])


@pytest.mark.parametrize(("index", "sends"), [(0, "first"), (1, "middle"), (3, "last")])
def test_a_pipeline_stage_of_torch_pipelining_counts_its_module_and_its_send_recv(index, sends):
    from torch.distributed.pipelining import PipelineStage
    from torch.testing._internal.distributed.fake_pg import FakeStore

    width, rows = 64, 32
    with torch.device("meta"):
        submodule = torch.nn.Sequential(torch.nn.Linear(width, width, bias=False), torch.nn.Linear(width, width, bias=False))
    x = torch.randn(rows, width, device="meta")
    dist.init_process_group("fake", store=FakeStore(), rank=index, world_size=4)
    try:
        stage = PipelineStage(submodule, index, 4, torch.device("cpu"))
        est = fxflops.estimate(stage, (x,), conventions="torch", backward=True)
    finally:
        dist.destroy_process_group()
    one, size = 2 * rows * width * width, rows * width * FP32
    # a received activation needs its gradient (sent back); the first stage's input needs none
    assert (est.fwd_flops, est.bwd_flops) == (2 * one, (3 if sends == "first" else 4) * one)
    expected = {"first": [("send", "forward", size), ("recv", "backward", size)],
                "middle": [("recv", "forward", size), ("send", "forward", size), ("recv", "backward", size),
                           ("send", "backward", size)],
                "last": [("recv", "forward", size), ("send", "backward", size)]}[sends]
    assert [(c.op, c.phase, c.bytes) for c in est.collectives] == expected
    assert all(c.group_size == 4 and c.wire_bytes == (c.bytes if c.op == "send" else 0) for c in est.collectives)
    assert not x.requires_grad  # the caller's tensor as it was


def test_the_micro_batch_size_comes_from_keyword_inputs_too():
    class Tokens(Llama):
        def forward(self, input_ids):
            return super().forward(input_ids)

    with torch.device("meta"):
        model = Tokens(V, D, L, HEADS, F)
    est = fxflops.estimate(model, kwargs={"input_ids": tokens()}, conventions="torch", parallel={"pp": 2, "batch": 8})
    assert (est.parallel["microbatch"], est.parallel["microbatches"], est.parallel["batch"]) == (B, 4, 8)
    assert est.job_flops == 4 * (L * LAYER_FWD + HEAD)
