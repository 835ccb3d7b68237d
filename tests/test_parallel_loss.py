"""Loss parallelism: the output head's logits left sharded along the vocabulary over the tp ranks and the
cross-entropy run as torch's loss_parallel() computes it. Per-rank FLOPs are hand counts under the torch
preset (matmuls and SDPA); the loss's all-reduces are torch's: each position's max logit, its sum of
exponentials and its target's logit, one float32 per position each (torch/distributed/tensor/parallel/loss.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fxflops
from tests.parallel_models import Llama
from tests.test_parallel_plans import ATTN_LINEAR, B, D, FFN, FP32, HEAD, HEADS, L, S, SDPA, T, V, by_phase_op, bwd, fwd
from tests.test_parallel_plans import F as FF

TARGET = torch.zeros(B, S, dtype=torch.long)
PER_POSITION = T * FP32  # (tokens, 1) float32: the max, the sum of exponentials, the target logit


def cross_entropy(logits):
    return F.cross_entropy(logits.flatten(0, 1), TARGET.flatten())


@pytest.fixture(scope="module")
def llama():
    with torch.device("meta"):
        return Llama(V, D, L, HEADS, FF)


def plan_estimate(model, **plan):
    est = fxflops.estimate(model, (torch.zeros(B, S, dtype=torch.long),), conventions="torch", backward=True,
                           loss=cross_entropy, parallel=plan)
    assert not dist.is_initialized() and torch._C._len_torch_function_stack() == 0
    return est


def loss_all_reduces(est):
    return [(c.op, c.phase, c.bytes, c.group_size) for c in est.collectives if c.module == ""]


@pytest.mark.parametrize("tp", [2, 4])
def test_the_head_and_the_loss_split_over_the_vocabulary(llama, tp):
    est = plan_estimate(llama, tp=tp, loss_parallel=True)
    assert (est.fwd_flops, est.bwd_flops) == (fwd(tp, head_split=True), bwd(tp, head_split=True))
    # the loss: max, sum of exponentials, target logit, each all-reduced per position, forward only (its
    # backward is local: softmax minus the one-hot of the rank's own vocabulary slice)
    assert loss_all_reduces(est) == [("all_reduce", "forward", PER_POSITION, tp)] * 3
    activations = T * D * FP32
    # Megatron's 2 all-reduces per layer each way, and the column-parallel head's input gradient
    assert by_phase_op(est) == {("forward", "all_reduce"): (2 * L + 3, 2 * L * activations + 3 * PER_POSITION),
                                ("backward", "all_reduce"): (2 * L + 1, (2 * L + 1) * activations)}
    assert est.total_params == V * D + D * V // tp + D + L * ((4 * D * D + 3 * D * FF) // tp + 2 * D)
    # no rank holds a whole vocabulary's logits: the loss's elementwise work is on (tokens, V / tp)
    shapes = {shape for n in est.nodes if n.module == "" for shape in n.output_shapes}
    assert (T, V // tp) in shapes and (T, V) not in shapes


def test_with_sequence_parallelism_the_logits_are_never_gathered(llama):
    tp = 2
    est = plan_estimate(llama, tp=tp, sequence_parallel=True, loss_parallel=True)
    assert est.fwd_flops == fwd(tp, head_split=True)
    activations = T * D * FP32
    # the head gathers its input's sequence (one more all-gather than the layers'), never the logits (T x V)
    assert by_phase_op(est) == {
        ("forward", "all_gather"): (2 * L + 1, (2 * L + 1) * activations),
        ("forward", "reduce_scatter"): (2 * L + 1, (2 * L + 1) * activations),
        ("forward", "all_reduce"): (3, 3 * PER_POSITION),
        ("backward", "all_gather"): (2 * L + 1, (2 * L + 1) * activations),
        ("backward", "reduce_scatter"): (2 * L + 1, (2 * L + 1) * activations)}


def test_a_tied_head_without_sequence_parallelism_shares_the_vocabulary_parallel_embeddings_shard():
    from tests.test_parallel_gpt2 import LINEARS, gpt2, tokens
    from tests.test_parallel_gpt2 import SDPA as GPT2_SDPA

    tp = 2
    # the model's own loss (labels given: transformers' ForCausalLMLoss over the logits) under loss_parallel()
    est = fxflops.estimate(gpt2(), (tokens(),), {"labels": tokens()}, conventions="torch", backward=True,
                           parallel={"tp": tp, "loss_parallel": True})
    assert est.fwd_flops == L * (LINEARS + GPT2_SDPA) // tp + HEAD // tp
    # wte vocabulary-parallel, its output all-reduced (Megatron's VocabParallelEmbedding); lm_head its shard
    wte = [(c.op, c.phase, c.bytes) for c in est.collectives if c.module == "transformer.wte"]
    assert wte == [("all_reduce", "forward", T * D * FP32)]
    loss = [(c.op, c.phase, c.bytes) for c in est.collectives if c.module == ""]
    assert loss == [("all_reduce", "forward", PER_POSITION)] * 3
    assert est.total_params == L * ((12 * D * D + 3 * D + 4 * D) // tp + 2 * D) + V * D // tp + S * D \
        + L * 4 * D + 2 * D


def test_the_users_own_model_under_loss_parallel_counts_the_same(llama):
    """The same plan applied by hand with torch's styles, estimate() called inside loss_parallel() on the
    fake group: the same per-rank FLOPs and the loss's three all-reduces."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

    from fxflops.parallel.whatif import fake_world

    with torch.device("meta"):
        model = Llama(V, D, L, HEADS, FF)
    styles = {"output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(L):
        styles.update({f"layers.{i}.attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")})
        styles.update({f"layers.{i}.feed_forward.{w}": ColwiseParallel() for w in ("w1", "w3")})
        styles.update({f"layers.{i}.attention.wo": RowwiseParallel(), f"layers.{i}.feed_forward.w2": RowwiseParallel()})
    with fake_world(2, 1):
        parallelize_module(model, init_device_mesh("cpu", (2,)), styles)
        with loss_parallel():
            est = fxflops.estimate(model, (torch.zeros(B, S, dtype=torch.long),), conventions="torch", backward=True,
                                   loss=cross_entropy)
    assert est.fwd_flops == fwd(2, head_split=True) == L * (ATTN_LINEAR + FFN + SDPA) // 2 + HEAD // 2
    assert loss_all_reduces(est) == [("all_reduce", "forward", PER_POSITION, 2)] * 3


def test_the_derived_plan_runs_for_real_with_the_all_reduces_comm_debug_mode_counts():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from fxflops.parallel.megatron import megatron_plan
    from fxflops.parallel.whatif import fake_world

    with torch.device("meta"):
        meta = Llama(V, D, L, HEADS, FF)
    predicted = plan_estimate(meta, tp=2, loss_parallel=True)
    real = Llama(V, D, L, HEADS, FF)
    with fake_world(2, 0):
        parallelize_module(real, init_device_mesh("cpu", (2,)), megatron_plan(real, loss_parallel=True),
                           src_data_rank=None)
        with CommDebugMode() as comm, loss_parallel():
            cross_entropy(real(torch.zeros(B, S, dtype=torch.long))).backward()
    counts = {str(op).rsplit(".", 1)[-1]: n for op, n in comm.get_comm_counts().items()}
    assert counts == {"all_reduce": len(predicted.collectives)} == {"all_reduce": 4 * L + 4}


def test_loss_parallel_without_tp_is_one_clear_line(llama):
    with pytest.raises(ValueError, match="loss_parallel splits the logits' vocabulary over the tp ranks; give tp > 1"):
        plan_estimate(llama, loss_parallel=True, dp=2)
    assert not dist.is_initialized()


def test_loss_parallel_on_a_model_without_an_output_head_is_one_clear_line():
    from tests.parallel_models import FeedForward

    with torch.device("meta"):
        model = FeedForward(64, 128)
    with pytest.raises(ValueError, match="loss_parallel splits the output head's logits, and FeedForward has no Linear "
                                         "named lm_head or output") as caught:
        fxflops.estimate(model, (torch.randn(2, 8, 64, device="meta"),), parallel={"tp": 2, "loss_parallel": True})
    assert "\n" not in str(caught.value) and not dist.is_initialized()
