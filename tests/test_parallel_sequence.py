"""Sequence parallelism on a Hugging Face Llama (rotary positions and the causal mask are made from the
embeddings' length): per-rank FLOPs are hand counts under the torch preset, the collectives Megatron's
closed forms (all-gather before and reduce-scatter after each attention and MLP, the same wire bytes as
the two all-reduces without sequence parallelism)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fxflops

V, D, L, HEADS, KV, F, B, S = 256, 64, 2, 8, 4, 128, 2, 16
T, FP32, HEAD_DIM = B * S, 4, D // HEADS
ATTN_LINEAR = 2 * T * D * (2 * D + 2 * KV * HEAD_DIM)  # q, o: D x D; k, v: D x (kv heads * head dim)
FFN = 3 * 2 * T * D * F
SDPA = 2 * (2 * B * HEADS * S * S * HEAD_DIM)  # k/v repeated to the query heads
HEAD = 2 * T * D * V


@pytest.fixture(scope="module")
def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
                         num_attention_heads=HEADS, num_key_value_heads=KV, attn_implementation="sdpa")
    with torch.device("meta"):
        return LlamaForCausalLM(config)


@pytest.mark.parametrize("tp", [2, 4])
def test_hf_llama_sequence_parallel_flops_and_bytes(hf_llama, tp):
    est = fxflops.estimate(hf_llama, (torch.zeros(B, S, dtype=torch.long),), conventions="torch", backward=True,
                           parallel={"tp": tp, "sequence_parallel": True})
    # every matmul and the attention split tp ways, the head too (vocabulary-parallel columns); the
    # backward: grad input and grad weight of each matmul, SDPA's 5 products of half the forward's
    assert est.fwd_flops == (L * (ATTN_LINEAR + FFN + SDPA) + HEAD) // tp
    assert est.bwd_flops == (L * (2 * (ATTN_LINEAR + FFN) + 5 * SDPA // 2) + 2 * HEAD) // tp
    activations = T * D * FP32  # b*s*h, the whole sequence's buffer
    totals = {key: (value["count"], value["bytes"]) for key, value in est.collective_totals(("phase", "op")).items()}
    # forward: per layer 2 all-gathers (before attention and MLP) and 2 reduce-scatters (after); the
    # embedding's reduce-scatter; the head's all-gather of its input and of the logits
    assert totals[("forward", "all_gather")] == (2 * L + 2, (2 * L + 1) * activations + T * V * FP32)
    assert totals[("forward", "reduce_scatter")] == (2 * L + 1, (2 * L + 1) * activations)
    # backward: each forward all-gather's gradient is a reduce-scatter and the other way round
    assert totals[("backward", "reduce_scatter")] == (2 * L + 1, (2 * L + 1) * activations)
    # (the logits' gather has a local split for gradient)
    assert totals[("backward", "all_gather")] == (2 * L + 1, (2 * L + 1) * activations)
    assert len(totals) == 4
    layer_ops = sorted(c.op for c in est.collectives if c.module.startswith("model.layers.") and c.phase == "backward")
    assert layer_ops == ["all_gather"] * 2 * L + ["reduce_scatter"] * 2 * L
    assert all(c.group_size == tp and c.wire_bytes == (tp - 1) * c.bytes // tp for c in est.collectives)


def test_the_derived_sequence_parallel_plan_runs_for_real_with_the_collectives_comm_debug_mode_counts():
    """The plan applied to a real Hugging Face Llama on torch's fake process group runs (the residual
    stream a DTensor), and CommDebugMode's collectives per module equal the estimate's of the same model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import LlamaConfig, LlamaForCausalLM

    from fxflops.parallel.megatron import megatron_plan
    from tests.test_parallel import _inclusive_counts, comm_debug_counts

    config = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
                         num_attention_heads=HEADS, num_key_value_heads=KV, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, V, (B, S))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        parallelize_module(model, mesh, megatron_plan(model, sequence_parallel=True))
        with CommDebugMode() as comm:
            logits = model(ids).logits
            assert logits.shape == (B, S, V)  # the whole sequence's logits, replicated
            logits.sum().backward()
        expected = comm_debug_counts(comm)
        model.zero_grad(set_to_none=True)
        est = fxflops.estimate(model, (ids,), conventions="torch", backward=True)
        # (a ModuleList is never called: CommDebugMode has no entry for it)
        ours = {key: count for key, count in _inclusive_counts(est).items() if key[0] != "model.layers"}
        # the one difference: the block input's gradient reduce-scatter, which fxflops gives the attention /
        # MLP whose input hook made it and CommDebugMode's backward tracker the first linear reading it
        firsts = {(f"model.layers.{i}.{name}", "backward") for i in range(L)
                  for name in ("self_attn.q_proj", "mlp.gate_proj")}
        assert {key: count for key, count in expected.items() if key not in firsts} == ours
        assert all(expected[key] == 1 for key in firsts)
        assert est.fwd_flops == (L * (ATTN_LINEAR + FFN + SDPA) + HEAD) // 2
    finally:
        dist.destroy_process_group()
