"""Memory per rank under what-if parallel plans: each rank role's `memory` holds the rank's own shards.

Hand counts on the torchtitan-style Llama of parallel_models (vocab 256, dim 64, 2 layers, 8 heads,
hidden 128): per layer 2·64 (norms) + 4·64·64 (attention) + 3·64·128 (feed forward) = 41,088
parameters; the root's own (embedding 256·64, final norm 64, output 64·256) 32,832; in all 115,008 in
21 tensors. Adam's `step` is a 4-byte tensor per parameter tensor.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fxflops
from fxflops.memory import MemoryOptions
from fxflops.memory.formulas import model_state_bytes
from fxflops.memory.records import GATHERED
from tests.parallel_models import Llama

LAYER = 2 * 64 + 4 * 64 * 64 + 3 * 64 * 128
ROOT = 256 * 64 + 64 + 64 * 256
PARAMS = 2 * LAYER + ROOT
TENSORS = 2 * 9 + 3
STEP = 4 * TENSORS


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return Llama()


def planned(model, plan, optimizer="adamw", memory=True):
    tokens = torch.randint(0, 256, (2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxflops.estimate(model, (tokens,), backward=True, optimizer=optimizer, memory=memory, parallel=plan)


def test_hand_counts_hold():
    assert PARAMS == sum(p.numel() for p in Llama().parameters()) == 115_008
    assert TENSORS == len(list(Llama().parameters()))


def test_a_tensor_parallel_rank_holds_its_shards_and_steps_them(llama):
    # Megatron plan, tp=2: q/k/v/o and w1/w2/w3 halved; embedding, norms and output replicated
    local = 2 * (2 * 64 + (4 * 64 * 64 + 3 * 64 * 128) // 2) + ROOT
    estimate = planned(llama, {"tp": 2})
    memory = estimate.ranks[0].estimate.memory
    assert memory.model_states == {"parameters": 4 * local, "buffers": 0, "gradients": 4 * local,
                                   "optimizer": 2 * 4 * local + STEP}
    assert estimate.optimizer.params == local
    # AdamW: decoupled decay 1 + first moment 3 + second moment 4 + denominator 3 + update 3 = 14 per element
    assert estimate.optimizer.flops == 14 * local


def test_tensor_parallel_activations_are_the_ranks_local_tensors(llama):
    single = planned(llama, None).memory
    ranked = planned(llama, {"tp": 2}).memory
    # w1 (column parallel) makes b·s·hidden/tp values of 4 bytes, which silu saves for the backward
    assert single.saved_by_module["layers.0.feed_forward.w1"] == 2 * 16 * 128 * 4
    assert ranked.saved_by_module["layers.0.feed_forward.w1"] == 2 * 16 * 128 // 2 * 4
    # the norm's output (replicated) is whole on every rank
    assert ranked.saved_by_module["layers.0.attention_norm"] == single.saved_by_module["layers.0.attention_norm"]


@pytest.mark.parametrize("dp", [2, 4])
def test_fsdp_is_zero3_adam_mixed_precision_16_bytes_per_parameter(llama, dp):
    # bf16 parameters, fp32 master weights and moments: 2 + 2 + 12 bytes per parameter, all divided by dp
    model = Llama().to(torch.bfloat16)
    estimate = planned(model, {"dp": dp}, memory=MemoryOptions(master_weights=True))
    zero3 = model_state_bytes(PARAMS, dp=dp, zero_stage=3)
    assert estimate.memory.model_states == {"parameters": zero3["parameters"], "buffers": 0,
                                            "gradients": zero3["gradients"], "optimizer": zero3["optimizer"] + STEP}
    assert zero3 == {"parameters": 2 * PARAMS // dp, "gradients": 2 * PARAMS // dp, "optimizer": 12 * PARAMS // dp}
    assert estimate.optimizer.params == PARAMS // dp


def test_hsdp_shards_within_its_group_only(llama):
    estimate = planned(llama, {"dp": 4, "dp_shard": 2})
    assert estimate.memory.model_states["parameters"] == 4 * PARAMS // 2
    assert estimate.memory.model_states["gradients"] == 4 * PARAMS // 2


def _gathered(memory, module: str, phase: str) -> set[int]:
    return {point.by_kind[GATHERED] for point in memory.timeline if point.module == module and point.phase == phase}


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_holds_the_gathered_parameters_of_the_running_layer(llama, reshard):
    memory = planned(llama, {"dp": 2, "reshard_after_forward": reshard}).memory
    layer, root = 4 * LAYER, 4 * ROOT  # unsharded fp32 bytes
    # forward: the root's own parameters (embedding, norm, output) and the running layer's; without
    # resharding after the forward, layer 0's stay gathered while layer 1 runs
    assert _gathered(memory, "layers.0.attention.wq", "forward") == {root + layer}
    assert _gathered(memory, "layers.1.attention.wq", "forward") == {root + layer + (0 if reshard else layer)}
    # backward of layer 1: FSDP2 prefetches layer 0 (its all-gather buffer, `layer` bytes, waits for
    # layer 0's pre-backward to be copied out); resharded layers were gathered again
    assert _gathered(memory, "layers.1.attention.wq", "backward") == {root + 2 * layer}
    assert _gathered(memory, "layers.0.attention.wq", "backward") == {root + layer}


def test_fsdp_frees_what_it_gathered_when_it_reshards(llama):
    memory = planned(llama, {"dp": 2}).memory
    after = [point for point in memory.timeline if point.phase == "optimizer step"]
    assert after[0].by_kind[GATHERED] == 0  # every gathered parameter freed after the backward
    assert after[0].by_kind["gradients"] == 4 * PARAMS // 2


def test_sequence_parallel_norms_save_the_ranks_share_of_the_sequence(llama):
    single = planned(llama, None).memory
    ranked = planned(llama, {"tp": 2, "sequence_parallel": True}).memory
    # RMSNorm saves x·rsqrt (b·s·h) and rsqrt (b·s) for its backward, its output for the linear after it;
    # under sequence parallelism its output is all-gathered first (the gathered copy is what wq saves)
    b, s, h = 2, 16, 64
    assert single.saved_by_module["layers.0.attention_norm"] == (2 * b * s * h + b * s) * 4
    assert ranked.saved_by_module["layers.0.attention_norm"] == (b * s // 2 * h + b * s // 2) * 4


def test_fsdp_over_tensor_parallel_shards_the_local_shards(llama):
    local = 2 * (2 * 64 + (4 * 64 * 64 + 3 * 64 * 128) // 2) + ROOT
    memory = planned(llama, {"tp": 2, "dp": 2}).memory
    assert memory.model_states["parameters"] == memory.model_states["gradients"] == 4 * local // 2
