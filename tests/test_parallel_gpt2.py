"""Hugging Face GPT-2 (the Megatron-LM block) under the derived tensor-parallel plan.

GPT-2's projections are transformers' Conv1D (weight stored (in, out)) and its q, k, v come from one fused
projection, c_attn. Per-rank FLOPs are hand counts under the torch preset (FlopCounterMode's formulas; the
single-device count is FlopCounterMode's own on the real model); collective bytes are Megatron's closed form.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fxflops
from tests.test_parallel_plans import by_phase_op

V, D, L, HEADS, B, S = 256, 64, 2, 8, 2, 16
T = B * S  # tokens
FP32 = 4
LINEARS = 2 * T * D * (3 * D + D + 4 * D + 4 * D)  # c_attn (fused q, k, v), attn.c_proj, mlp.c_fc, mlp.c_proj
SDPA = 2 * (2 * B * HEADS * S * S * (D // HEADS))  # q @ k^T and p @ v
HEAD = 2 * T * D * V  # lm_head


def fwd(tp: int, head_split: bool = False) -> int:
    return L * (LINEARS + SDPA) // tp + HEAD // (tp if head_split else 1)


def bwd(tp: int, head_split: bool = False) -> int:
    # grad input + grad weight of every matmul; the masked attention's backward (math kernel): the gradients
    # of both of its products, 4 products of the forward's size
    return L * (2 * LINEARS + 2 * SDPA) // tp + 2 * HEAD // (tp if head_split else 1)


def gpt2(device: str = "meta"):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=V, n_embd=D, n_layer=L, n_head=HEADS, n_positions=S, bos_token_id=0,
                        eos_token_id=0, attn_implementation="sdpa")
    with torch.device(device):
        return GPT2LMHeadModel(config)


@pytest.fixture(scope="module")
def model():
    return gpt2()


def tokens():
    return torch.zeros(B, S, dtype=torch.long)


def test_the_single_device_count_is_flop_counter_modes():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    real = gpt2("cpu")
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            with FlopCounterMode(display=False) as forward:
                logits = real(tokens()).logits
            with FlopCounterMode(display=False) as backward:
                logits.sum().backward()
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    assert (forward.get_total_flops(), backward.get_total_flops()) == (fwd(1), bwd(1)) == (7_602_176, 15_204_352)


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt2_tp_flops_and_two_all_reduces_per_layer_each_way(model, tp):
    est = fxflops.estimate(model, (tokens(),), conventions="torch", backward=True, parallel={"tp": tp})
    assert not dist.is_initialized()
    assert (est.fwd_flops, est.bwd_flops) == (fwd(tp), bwd(tp))
    activations = T * D * FP32  # b*s*h
    assert by_phase_op(est) == {("forward", "all_reduce"): (2 * L, 2 * L * activations),
                                ("backward", "all_reduce"): (2 * L, 2 * L * activations)}
    assert {c.module for c in est.collectives if c.phase == "forward"} == \
        {f"transformer.h.{i}.{m}.c_proj" for i in range(L) for m in ("attn", "mlp")}
    # the rank's parameters: its shards of the block's Conv1Ds (row-parallel biases whole), all else whole
    sharded = L * ((12 * D * D + 3 * D + 4 * D) // tp + 2 * D)
    whole = V * D + S * D + L * 4 * D + 2 * D  # wte (tied to lm_head), wpe, ln_1/ln_2, ln_f
    assert est.total_params == sharded + whole
    # the capture's model was put back: attention widths and Conv1D weights as they were
    attention = model.transformer.h[0].attn
    assert (attention.split_size, attention.embed_dim, attention.num_heads) == (D, D, HEADS)
    assert type(attention.c_attn.weight) is torch.nn.Parameter and attention.c_attn.weight.shape == (D, 3 * D)


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt2_sequence_parallel_closed_form(model, tp):
    est = fxflops.estimate(model, (tokens(),), conventions="torch", backward=True,
                           parallel={"tp": tp, "sequence_parallel": True})
    assert (est.fwd_flops, est.bwd_flops) == (fwd(tp, head_split=True), bwd(tp, head_split=True))
    activations = T * D * FP32
    positions = S * D * FP32  # wpe's (1, s, h) output
    # in the layers: an all-gather before and a reduce-scatter after each attention and MLP, both ways;
    # outside: the vocabulary-parallel wte reduce-scatters its output (its gradient all-gathers back); wpe is
    # whole on every rank, as Megatron-LM keeps position embeddings, its output split along the sequence (no
    # communication forward, its gradient all-gathered backward); the head all-gathers its input and the
    # logits (its input's gradient reduce-scatters)
    assert by_phase_op(est) == {
        ("forward", "all_gather"): (2 * L + 2, (2 * L + 1) * activations + T * V * FP32),
        ("forward", "reduce_scatter"): (2 * L + 1, (2 * L + 1) * activations),
        ("backward", "all_gather"): (2 * L + 2, (2 * L + 1) * activations + positions),
        ("backward", "reduce_scatter"): (2 * L + 1, (2 * L + 1) * activations)}
    wpe = [(c.op, c.phase, c.bytes) for c in est.collectives if c.module == "transformer.wpe"]
    assert wpe == [("all_gather", "backward", positions)]
    # wte vocabulary-parallel, lm_head sharing wte's shard (tied, held once), wpe and the norms whole
    assert est.total_params == L * ((12 * D * D + 3 * D + 4 * D) // tp + 2 * D) + V * D // tp + S * D \
        + L * 4 * D + 2 * D


def test_heads_that_tp_does_not_divide_are_one_clear_line(model):
    with pytest.raises(ValueError, match="tp=3 does not divide the 8 heads of config.num_attention_heads") as caught:
        fxflops.estimate(model, (tokens(),), parallel={"tp": 3})
    assert "\n" not in str(caught.value)
    assert not dist.is_initialized()


@pytest.mark.parametrize("tp", [2, 4])
def test_a_real_run_on_the_fake_group_makes_the_predicted_collectives(model, tp):
    """The derived plan applied by parallelize_module to a real GPT-2, run forward and backward as rank 1 of
    the fake process group under CommDebugMode: the collectives the estimate predicted, and each rank's
    c_attn shard holds its heads' q, k and v."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module

    from fxflops.parallel.megatron import megatron_plan
    from fxflops.parallel.whatif import fake_world

    predicted = fxflops.estimate(model, (tokens(),), conventions="torch", backward=True, parallel={"tp": tp})
    torch.manual_seed(0)
    real = gpt2("cpu")
    fused = real.transformer.h[0].attn.c_attn.weight.detach().clone()  # (in, [q | k | v])
    rank, width = 1, D // tp
    with fake_world(tp, rank):
        # src_data_rank=None: each rank shards its own copy (the fake group's scatter sends no data)
        parallelize_module(real, init_device_mesh("cpu", (tp,)), megatron_plan(real), src_data_rank=None)
        local = real.transformer.h[0].attn.c_attn.weight.to_local()
        expected = torch.cat([fused[:, block * D + rank * width:block * D + (rank + 1) * width] for block in range(3)], 1)
        assert torch.equal(local, expected)
        with CommDebugMode() as comm:
            logits = real(tokens()).logits
            assert logits.shape == (B, S, V)
            logits.float().sum().backward()
    counts = {str(op).rsplit(".", 1)[-1]: n for op, n in comm.get_comm_counts().items()}
    assert counts == {"all_reduce": len(predicted.collectives)} == {"all_reduce": 4 * L}


def test_sequence_parallel_on_a_real_gpt2_makes_the_predicted_collectives(model):
    """The derived sequence-parallel plan (wpe whole, its output split) run for real as rank 1 of the fake
    group under CommDebugMode: as many reduce-scatters and all-gathers as the estimate predicted."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module

    from fxflops.parallel.megatron import megatron_plan
    from fxflops.parallel.whatif import fake_world

    predicted = fxflops.estimate(model, (tokens(),), conventions="torch", backward=True,
                                 parallel={"tp": 2, "sequence_parallel": True})
    real = gpt2("cpu")
    with fake_world(2, 1):
        parallelize_module(real, init_device_mesh("cpu", (2,)), megatron_plan(real, True), src_data_rank=None)
        with CommDebugMode() as comm:
            real(tokens()).logits.float().sum().backward()
    counts = {str(op).rsplit(".", 1)[-1]: n for op, n in comm.get_comm_counts().items()}
    expected: dict[str, int] = {}
    for c in predicted.collectives:
        expected[c.op] = expected.get(c.op, 0) + 1
    assert counts == {"reduce_scatter_tensor": expected["reduce_scatter"], "all_gather_into_tensor": expected["all_gather"]}
    assert expected == {"reduce_scatter": 2 * (2 * L + 1), "all_gather": 2 * (2 * L + 2)}
