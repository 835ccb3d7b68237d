"""Memory per pipeline stage under what-if plans: each pp rank role holds its own stage's parameters,
gradients, optimizer state and activations, with the micro-batches its schedule keeps in flight.

Hand counts on the torchtitan-style Llama of parallel_models (vocab 256, dim 64, 8 heads, hidden 128):
per layer 2·64 + 4·64·64 + 3·64·128 = 41,088 parameters in 9 tensors; the embedding 256·64 (1 tensor)
on the first stage, the final norm 64 and the output 64·256 (2 tensors) on the last. fp32: 4 bytes a
parameter and a gradient; AdamW: two moments like the parameter and a 4-byte `step` per tensor.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fxflops
from fxflops.memory.records import OPTIMIZER_STEP, START
from fxflops.report.text_summary import summary_lines
from tests.parallel_models import Llama

LAYER, LAYER_TENSORS = 2 * 64 + 4 * 64 * 64 + 3 * 64 * 128, 9
EMBEDDING, HEAD = 256 * 64, 64 + 64 * 256


def planned(model, plan, optimizer="adamw"):
    tokens = torch.randint(0, 256, (2, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fxflops.estimate(model, (tokens,), backward=True, optimizer=optimizer, memory=True, parallel=plan)


def states(params: int, tensors: int) -> dict[str, int]:
    return {"parameters": 4 * params, "buffers": 0, "gradients": 4 * params, "optimizer": 8 * params + 4 * tensors}


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return Llama()


@pytest.fixture(scope="module")
def llama4() -> torch.nn.Module:
    torch.manual_seed(0)
    return Llama(n_layers=4)


def test_each_stage_holds_its_own_parameters_gradients_and_adamw_state(llama):
    first, last = planned(llama, {"pp": 2}).ranks
    assert first.estimate.memory.model_states == states(EMBEDDING + LAYER, 1 + LAYER_TENSORS)
    assert last.estimate.memory.model_states == states(LAYER + HEAD, LAYER_TENSORS + 2)


def test_middle_stages_hold_their_layers_only(llama4):
    roles = planned(llama4, {"pp": 4}).ranks  # one micro-batch: every stage has one in flight
    assert [role.name for role in roles] == ["pipeline stage 0 (first)", "pipeline stages 1-2 (middle)",
                                             "pipeline stage 3 (last)"]
    assert roles[1].estimate.memory.model_states == states(LAYER, LAYER_TENSORS)


def test_fsdp_shards_each_stages_own_state(llama):
    first, last = planned(llama, {"pp": 2, "dp": 2}).ranks
    assert first.estimate.memory.model_states == {**states((EMBEDDING + LAYER) // 2, 1 + LAYER_TENSORS)}
    assert last.estimate.memory.model_states == {**states((LAYER + HEAD) // 2, LAYER_TENSORS + 2)}


def extra_held(staged, single) -> set[int]:
    """How many more bytes each point of the forward and backward holds; the start and the optimizer step
    (no micro-batch in flight) hold the same."""
    assert len(staged.timeline) == len(single.timeline)
    for a, b in zip(staged.timeline, single.timeline, strict=True):
        if a.phase in (START, OPTIMIZER_STEP):
            assert a.total == b.total
    return {a.total - b.total for a, b in zip(staged.timeline, single.timeline, strict=True)
            if a.phase not in (START, OPTIMIZER_STEP)}


def test_micro_batches_in_flight_by_schedule(llama):
    one = [role.estimate.memory for role in planned(llama, {"pp": 2}).ranks]
    saved = [memory.saved_under("") for memory in one]
    assert all(saved)
    gpipe = [role.estimate.memory for role in planned(llama, {"pp": 2, "microbatches": 4, "schedule": "GPipe"}).ranks]
    # GPipe: every stage holds all 4 micro-batches' saved activations
    assert [extra_held(g, o) for g, o in zip(gpipe, one, strict=True)] == [{3 * saved[0]}, {3 * saved[1]}]
    # 1F1B (the default): stage i holds p - i = 2 on the first stage, 1 on the last
    first, last = planned(llama, {"pp": 2, "microbatches": 4}).ranks
    assert extra_held(first.estimate.memory, one[0]) == {saved[0]}
    assert last.estimate.memory.peak_bytes == one[1].peak_bytes


def test_interleaved_stages_hold_chunk_micro_batches(llama4):
    one = [role.estimate.memory for role in planned(llama4, {"pp": 2, "virtual_stages": 2}).ranks]
    roles = planned(llama4, {"pp": 2, "virtual_stages": 2, "microbatches": 4}).ranks
    # rank 0: 2·(p − 1) + (v − 1)·p + 1 = 5 chunk-micro-batches of half its activations each; rank 1: 3
    for role, single, chunks in zip(roles, one, (5, 3), strict=True):
        saved = single.saved_under("")
        assert extra_held(role.estimate.memory, single) == {-(-saved * chunks // 2) - saved}


def test_the_stages_together_hold_the_whole_models_state(llama):
    whole = planned(llama, None).memory.model_states
    roles = planned(llama, {"pp": 2}).ranks
    for kind in ("parameters", "gradients", "optimizer"):
        assert sum(role.estimate.memory.model_states[kind] for role in roles) == whole[kind]


def test_the_summary_shows_each_roles_memory(llama):
    text = "\n".join(summary_lines(planned(llama, "pp=2,microbatches=4,schedule=gpipe")))
    assert "memory of rank role 'pipeline stage 0 (first)'" in text
    assert "memory of rank role 'pipeline stage 1 (last)'" in text
    assert text.count("memory peak (tensor bytes, per rank)") == 2


@pytest.mark.parametrize("plan, message", [
    ({"pp": 2, "schedule": "zigzag"}, "schedule is one of 1F1B, GPipe, interleaved; got 'zigzag'"),
    ({"schedule": "1F1B"}, "is a pipeline schedule; give pp > 1"),
    ({"pp": 2, "schedule": "interleaved"}, "give virtual_stages > 1"),
    ({"pp": 2, "virtual_stages": 2, "schedule": "GPipe"}, "need the interleaved schedule"),
])
def test_bad_schedules_are_one_clear_line(llama4, plan, message):
    with pytest.raises(ValueError, match=message) as error:
        planned(llama4, plan)
    assert "\n" not in str(error.value)
