"""Pipeline schedules simulated micro-batch by micro-batch (fxflops.predict.schedule), checked by hand."""

from __future__ import annotations

import pytest

from fxflops.predict.schedule import BACKWARD, FORWARD, ChunkCost, simulate

# forward 1 s, backward 2 s per chunk and micro-batch: exact in binary floating point
UNIFORM = ChunkCost(1.0, 2.0)


@pytest.mark.parametrize(("schedule", "p", "m", "v"), [
    ("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 16, 1), ("interleaved", 4, 8, 2), ("interleaved", 4, 8, 4),
    ("interleaved", 2, 4, 3), ("gpipe", 4, 8, 2), ("1f1b", 1, 4, 1)])
def test_uniform_stages_bubble_is_p_minus_1_over_m_v(schedule: str, p: int, m: int, v: int) -> None:
    timeline = simulate([UNIFORM] * (p * v), m, schedule, stages=p)
    ideal = m * v * 3.0  # each rank: m micro-batches x v chunks x (1 + 2) s
    assert timeline.ideal == ideal
    # hand count: the fill and drain of the pipe leave every rank (p-1) chunk passes (F + B) idle
    assert timeline.bubble_time == (p - 1) * 3.0
    assert timeline.bubble_fraction == (p - 1) / (m * v)
    assert timeline.step_time == ideal + (p - 1) * 3.0
    for rank in range(p):
        assert timeline.bubble(rank) == (p - 1) * 3.0


def test_activations_in_flight_per_schedule() -> None:
    # 1F1B: rank r holds p - r micro-batches; GPipe holds all m; interleaved rank 0 holds
    # (p-1)*2 + (v-1)*p + 1 chunk-micro-batches (Megatron's warm-up plus the one in steady state)
    assert [simulate([UNIFORM] * 4, 8, "1f1b").in_flight(r) for r in range(4)] == [4, 3, 2, 1]
    assert simulate([UNIFORM] * 4, 8, "gpipe").in_flight(0) == 8
    assert simulate([UNIFORM] * 8, 8, "interleaved", stages=4).in_flight(0) == 3 * 2 + 1 * 4 + 1


def test_heavier_last_stage_the_loss_sets_the_pace() -> None:
    # the last stage also runs the head and the loss: forward 2 s instead of 1. It is busiest (8 x 4 s = 32 s)
    # and never waits once its first micro-batch arrives; the step is its 32 s plus the time the first
    # micro-batch takes to reach it (3 x 1 s) and the last gradient to drain back (3 x 2 s): 41 s. The bubble
    # against the busiest rank is 9 s = (p-1)(t_f + t_b) of the light stages: 9/32 = 0.28 of the ideal step,
    # not (p-1)/m = 0.375 (the formula's ideal would be the light stages' 24 s).
    chunks = [UNIFORM] * 3 + [ChunkCost(2.0, 2.0)]
    for schedule in ("gpipe", "1f1b"):
        timeline = simulate(chunks, 8, schedule)
        assert timeline.step_time == 41.0
        assert timeline.ideal == 32.0
        assert timeline.bubble_time == 9.0
        assert [timeline.busy(r) for r in range(4)] == [24.0, 24.0, 24.0, 32.0]


def test_heavier_first_stage_the_embedding_by_hand() -> None:
    # p = 2, m = 2, 1F1B; stage 0 carries the embedding (forward 2 s), stage 1 is 1 s / 2 s.
    # rank 0: F0 0-2, F1 2-4, then waits for B0 from rank 1 (F0 2-3, B0 3-5), B0 5-7, waits for rank 1's
    # B1 (F1 5-6 once free, B1 6-8), B1 8-10. Rank 0 idles 1 s twice: bubble 2 s against its 8 s of work,
    # 0.25 of the ideal step, not (p-1)/m = 0.5: rank 0's heavier forward hides most of rank 1's work.
    timeline = simulate([ChunkCost(2.0, 2.0), UNIFORM], 2, "1f1b")
    rank0 = [(e.kind, e.microbatch, e.start, e.end) for e in timeline.rank_events(0)]
    rank1 = [(e.kind, e.microbatch, e.start, e.end) for e in timeline.rank_events(1)]
    assert rank0 == [(FORWARD, 0, 0.0, 2.0), (FORWARD, 1, 2.0, 4.0), (BACKWARD, 0, 5.0, 7.0), (BACKWARD, 1, 8.0, 10.0)]
    assert rank1 == [(FORWARD, 0, 2.0, 3.0), (BACKWARD, 0, 3.0, 5.0), (FORWARD, 1, 5.0, 6.0), (BACKWARD, 1, 6.0, 8.0)]
    assert timeline.step_time == 10.0 and timeline.ideal == 8.0 and timeline.bubble_fraction == 0.25


def test_critical_path_by_hand() -> None:
    # the first-stage-heavier case above: rank 1's passes, waiting on rank 0's first forward, set the step; rank
    # 0's last backward waits on rank 1's
    timeline = simulate([ChunkCost(2.0, 2.0), UNIFORM], 2, "1f1b")
    path = [(e.rank, e.kind, e.microbatch) for e in timeline.critical_path()]
    assert path == [(0, FORWARD, 0), (1, FORWARD, 0), (1, BACKWARD, 0), (1, FORWARD, 1), (1, BACKWARD, 1),
                    (0, BACKWARD, 1)]
    # uniform 1F1B: the first micro-batch down the pipe, the last rank's steady state, the last gradient back up
    path = simulate([UNIFORM] * 3, 4, "1f1b").critical_path()
    assert path[0].start == 0.0 and path[-1].end == simulate([UNIFORM] * 3, 4, "1f1b").step_time
    assert sum(e.end - e.start for e in path) == simulate([UNIFORM] * 3, 4, "1f1b").step_time  # no waits in it


def test_p2p_time_delays_the_next_stage() -> None:
    # GPipe, p = 2, m = 1, 0.5 s each way: F 0-1 | send 1-1.5 | F 1.5-2.5, B 2.5-4.5 | send | B 5-7
    timeline = simulate([ChunkCost(1.0, 2.0, 0.5)] * 2, 1, "gpipe")
    assert timeline.step_time == 7.0
    sends = [(e.kind, e.start, e.end) for e in timeline.events if e.stream == "p2p"]
    assert sends == [("send forward", 1.0, 1.5), ("send backward", 4.5, 5.0)]


def test_bad_schedules_are_one_line() -> None:
    with pytest.raises(ValueError, match="multiple of the pipeline stages"):
        simulate([UNIFORM] * 8, 6, "interleaved", stages=4)
    with pytest.raises(ValueError, match="pick one of"):
        simulate([UNIFORM] * 2, 2, "zero-bubble")
    with pytest.raises(ValueError, match="use 'interleaved'"):
        simulate([UNIFORM] * 4, 4, "1f1b", stages=2)


# --- DeepSpeed's pipeline engine, instruction by instruction -------------------------------------------


def test_deepspeed_train_schedule_instructions_by_hand() -> None:
    from fxflops.predict.schedule import (RECV_ACTIVATION, RECV_GRAD, SEND_ACTIVATION, SEND_GRAD,
                                          deepspeed_instructions)

    # p = 2, m = 2, DeepSpeed's TrainSchedule (schedule.py, v0.5.4) written out: 2 (m + p - 1) = 6 steps; stage 0
    # runs forwards on even steps, stage 1 on odd ones; a forward step receives, then sends the previous
    # step's gradient; a backward step sends the previous step's activations, then receives
    assert deepspeed_instructions(2, 2, 0) == [
        (FORWARD, 0),  # step 0
        (SEND_ACTIVATION, 0),  # step 1: backward of micro-batch -1, none
        (FORWARD, 1),  # step 2
        (SEND_ACTIVATION, 1), (RECV_GRAD, 0), (BACKWARD, 0),  # step 3
        # step 4: forward of micro-batch 2, none
        (RECV_GRAD, 1), (BACKWARD, 1)]  # step 5: the previous step sent nothing
    assert deepspeed_instructions(2, 2, 1) == [
        (RECV_ACTIVATION, 0), (FORWARD, 0),  # step 1 (step 0: backward of micro-batch -1, none)
        (BACKWARD, 0),  # step 2: the last stage sends no activations and receives no gradient
        (RECV_ACTIVATION, 1), (SEND_GRAD, 0), (FORWARD, 1),  # step 3
        (BACKWARD, 1),  # step 4
        (SEND_GRAD, 1)]  # step 5: forward of micro-batch 2, none; the previous step's gradient goes


@pytest.mark.parametrize(("p", "m"), [(1, 3), (2, 1), (2, 5), (4, 4), (4, 9), (8, 3), (8, 16)])
def test_deepspeed_runs_1f1b_order_and_without_transfers_its_step(p: int, m: int) -> None:
    from fxflops.predict.schedule import ONE_F_ONE_B, order, simulate_deepspeed

    # DeepSpeed's steps give every stage Megatron's non-interleaved 1F1B order of passes; with transfers that
    # take no time (and uniform stages) the step is 1F1B's (m + p - 1) (F + B)
    timeline = simulate_deepspeed([UNIFORM] * p, m)
    for rank in range(p):
        passes = [(e.kind, e.microbatch) for e in timeline.rank_events(rank) if e.stream == "compute"]
        assert passes == [(kind, mb) for kind, mb, _ in order(ONE_F_ONE_B, p, m, 1, rank)]
    assert timeline.step_time == (m + p - 1) * 3.0


def test_deepspeed_blocking_sends_by_hand() -> None:
    from fxflops.predict.schedule import simulate_deepspeed

    # p = 2, m = 2, F 1 s, B 2 s, 0.5 s a transfer. Stage 0: F0 0-1, send a0 1-1.5 (stage 1 waits at its
    # receive), F1 1.5-2.5, then its step 3 sends a1, which pairs only when stage 1 reaches its receive after
    # F0 1.5-2.5 and B0 2.5-4.5: a1 4.5-5; stage 1 then sends g0 5-5.5 (its receive came first in its step),
    # stage 0 runs B0 5.5-7.5 while stage 1 runs F1 5.5-6.5, B1 6.5-8.5; g1 8.5-9 holds both; B1 9-11
    timeline = simulate_deepspeed([ChunkCost(1.0, 2.0, 0.5)] * 2, 2)
    rank0 = [(e.kind, e.microbatch, e.start, e.end) for e in timeline.rank_events(0)]
    rank1 = [(e.kind, e.microbatch, e.start, e.end) for e in timeline.rank_events(1)]
    assert rank0 == [(FORWARD, 0, 0.0, 1.0), ("send forward", 0, 1.0, 1.5), (FORWARD, 1, 1.5, 2.5),
                     ("send forward", 1, 4.5, 5.0), (BACKWARD, 0, 5.5, 7.5), (BACKWARD, 1, 9.0, 11.0)]
    assert rank1 == [(FORWARD, 0, 1.5, 2.5), (BACKWARD, 0, 2.5, 4.5), ("send backward", 0, 5.0, 5.5),
                     (FORWARD, 1, 5.5, 6.5), (BACKWARD, 1, 6.5, 8.5), ("send backward", 1, 8.5, 9.0)]
    assert timeline.step_time == 11.0
    # the same costs with transfers beside the passes (the 1F1B simulation): a1 crosses while stage 0 waits
    assert simulate([ChunkCost(1.0, 2.0, 0.5)] * 2, 2, "1f1b").step_time == 10.0
    # the critical path ends with stage 0's last backward, which waited on stage 1's
    assert [(e.rank, e.kind, e.microbatch) for e in timeline.critical_path()][-2:] == [(1, BACKWARD, 1),
                                                                                      (0, BACKWARD, 1)]


def test_gradient_accumulation_from_the_second_micro_batch_by_hand() -> None:
    from fxflops.predict.schedule import simulate_deepspeed

    # p = 2, m = 2, F 1 s, B 2 s, no transfer time, 0.5 s of accumulation in every backward but micro-batch 0's.
    # 1F1B: stage 0 F0 0-1, F1 1-2; stage 1 F0 1-2, B0 2-4 (micro-batch 0: no accumulation), F1 4-5,
    # B1 5-7.5; stage 0 B0 4-6, B1 7.5-10. Without accumulation B1 ends at 7 and 9.
    chunks = [ChunkCost(1.0, 2.0, 0.0, 0.5)] * 2
    for timeline in (simulate(chunks, 2, "1f1b"), simulate_deepspeed(chunks, 2)):
        backwards = [(e.rank, e.microbatch, e.start, e.end) for e in timeline.events
                     if e.kind == "backward"]
        assert sorted(backwards) == [(0, 0, 4.0, 6.0), (0, 1, 7.5, 10.0), (1, 0, 2.0, 4.0), (1, 1, 5.0, 7.5)]
        assert timeline.step_time == 10.0
    assert simulate([ChunkCost(1.0, 2.0)] * 2, 2, "1f1b").step_time == 9.0
