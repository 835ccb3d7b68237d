"""Micro-batches in flight on a pipeline stage, by schedule: hand counts (p stages, m micro-batches,
v chunks per rank; A = one micro-batch's saved activations on the rank)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxflops
from fxflops.memory.pipeline import in_flight, stage_activation_bytes, with_micro_batches_in_flight

A = 1_000_000


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gpipe_holds_every_micro_batch(stage):
    assert stage_activation_bytes(A, "gpipe", p=4, stage=stage, m=8) == 8 * A


@pytest.mark.parametrize(("stage", "held"), [(0, 4), (1, 3), (2, 2), (3, 1)])
def test_1f1b_holds_p_minus_stage(stage, held):
    assert stage_activation_bytes(A, "1f1b", p=4, stage=stage, m=8) == held * A


def test_1f1b_with_fewer_micro_batches_than_stages():
    assert in_flight("1f1b", p=4, stage=0, m=2) == 2


def test_interleaved_first_stage_is_the_papers_figure():
    # Narayanan et al. 2021: the first stage holds p·(1 + (p − 1)/(p·v)) micro-batches' activations
    p, v = 4, 2
    assert in_flight("interleaved", p=p, stage=0, m=8, v=v) == 2 * (p - 1) + (v - 1) * p + 1 == 11
    assert stage_activation_bytes(A, "interleaved", p=p, stage=0, m=8, v=v) == A * p * (p * v + p - 1) // (p * v)
    assert stage_activation_bytes(A, "interleaved", p=p, stage=3, m=8, v=v) == 5 * A // 2  # (v − 1)·p + 1 = 5 chunks
    assert in_flight("interleaved", p=4, stage=0, m=8, v=1) == in_flight("1f1b", p=4, stage=0, m=8)


def test_interleaved_rounds_up_and_caps_at_every_chunk():
    assert stage_activation_bytes(3, "interleaved", p=2, stage=0, m=1, v=2) == 3  # min(2 + 2 + 1, 1·2) = 2 chunks: 3·2/2
    assert stage_activation_bytes(5, "interleaved", p=4, stage=3, m=8, v=2) == 13  # 5·5/2 = 12.5 -> 13


@pytest.mark.parametrize(("args", "words"), [
    (dict(schedule="zb", p=4, stage=0, m=8), "schedule is one of"),
    (dict(schedule="1f1b", p=4, stage=4, m=8), "stage is 0 to"),
    (dict(schedule="1f1b", p=4, stage=0, m=8, v=2), "interleaved"),
    (dict(schedule="gpipe", p=0, stage=0, m=8), "at least 1"),
])
def test_bad_schedules_are_one_line(args, words):
    with pytest.raises(ValueError, match=words):
        in_flight(**args)


def test_a_stage_estimate_with_micro_batches_in_flight():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    memory = fxflops.estimate(model, (torch.randn(8, 64),), backward=True, memory=True, optimizer="sgd").memory
    saved = memory.saved_under("")
    staged = with_micro_batches_in_flight(memory, "1f1b", p=4, stage=0, m=8)
    forward_backward = [point.total for point in memory.timeline if point.phase in ("forward", "backward")]
    assert staged.peak_bytes == max(max(forward_backward) + 3 * saved, memory.peak_bytes)
    assert staged.timeline[-1].total == memory.timeline[-1].total  # the optimizer step: nothing in flight
    assert "4 in flight" in staged.notes[-1]
    assert with_micro_batches_in_flight(memory, "1f1b", p=4, stage=3, m=8) is memory
