"""Pipeline stages hold several micro-batches' activations at once: how many, under each schedule.

A stage's capture is one micro-batch's forward and backward; the schedule decides how many other
micro-batches' saved activations the stage still holds while it runs one. With p stages, m micro-batches
and stage i (0 = first):

- GPipe (Huang et al. 2019): every forward before any backward, so all m micro-batches are in flight.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021): stage i runs p − i − 1 warm-up forwards, then one
  forward and one backward in turn: p − i micro-batches in flight (at most m).
- Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021 §2.2): each rank runs v model chunks of its
  stage; its warm-up is 2·(p − i − 1) + (v − 1)·p chunk forwards (Megatron's
  `get_forward_backward_func` schedule) and one more runs before the first backward:
  2·(p − i − 1) + (v − 1)·p + 1 chunk-micro-batches in flight (at most m·v), each holding 1/v of the
  rank's activations per micro-batch. On the first stage that is p·(1 + (p − 1)/(p·v)) micro-batches'
  worth, the paper's figure.

`per_microbatch` is the bytes one micro-batch's forward saves on the rank (all its chunks together:
`MemoryEstimate.saved_under("")` of the stage's capture). Interleaved bytes are rounded up.
"""

from __future__ import annotations

import dataclasses

from fxflops.memory.records import ACTIVATIONS, OPTIMIZER_STEP, START, MemoryEstimate

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def in_flight(schedule: str, p: int, stage: int, m: int, v: int = 1) -> int:
    """Micro-batches (interleaved: chunk-micro-batches) whose saved activations stage `stage` holds at its peak."""
    schedule = schedule.lower().replace("-", "").replace("_", "")
    if schedule == "interleaved1f1b":
        schedule = "interleaved"
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule is one of {', '.join(SCHEDULES)}; got {schedule!r}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline: p, m and v are at least 1; got p={p}, m={m}, v={v}")
    if not 0 <= stage < p:
        raise ValueError(f"pipeline: stage is 0 to p − 1 = {p - 1}; got {stage}")
    if v > 1 and schedule != "interleaved":
        raise ValueError(f"pipeline: v={v} virtual stages need the interleaved schedule, not {schedule!r}")
    if schedule == "gpipe":
        return m
    if schedule == "1f1b" or v == 1:  # interleaving one chunk is 1F1B
        return min(p - stage, m)
    return min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v)


def stage_activation_bytes(per_microbatch: int, schedule: str, p: int, stage: int, m: int, v: int = 1) -> int:
    """Saved-activation bytes stage `stage` holds at its peak: `per_microbatch` (one micro-batch's, all of
    the rank's chunks) times the micro-batches in flight (interleaved: chunk-micro-batches / v, rounded up)."""
    chunks = in_flight(schedule, p, stage, m, v)
    return -(-per_microbatch * chunks // v)


def with_micro_batches_in_flight(memory: MemoryEstimate, schedule: str, p: int, stage: int, m: int,
                                 v: int = 1) -> MemoryEstimate:
    """A stage's one-micro-batch estimate with the other micro-batches the schedule keeps in flight: their
    saved activations (what this capture's forward saved) held all through its step, peak included."""
    saved = memory.saved_under("")
    extra = stage_activation_bytes(saved, schedule, p, stage, m, v) - saved
    if extra <= 0:
        return memory
    # held while this micro-batch runs forward and backward; the optimizer steps after the last one, when
    # none is in flight (as at the step's start)
    timeline = [point if point.phase in (START, OPTIMIZER_STEP) else
                dataclasses.replace(point, total=point.total + extra,
                                    by_kind={**point.by_kind, ACTIVATIONS: point.by_kind[ACTIVATIONS] + extra})
                for point in memory.timeline]
    peak = max(timeline, key=lambda point: point.total)
    note = (f"pipeline stage {stage} of {p}, {schedule}, {m} micro-batches" + (f", v={v}" if v > 1 else "") +
            f": {in_flight(schedule, p, stage, m, v)} in flight, {extra:,} bytes of other micro-batches' "
            "saved activations held all step")
    allowance = dataclasses.replace(memory.allowance_bytes,
                                    fragmentation=int(memory.allowance.fragmentation * peak.total))
    # by module at the peak: the one micro-batch's, unless the peak moved (from the optimizer step)
    by_module = memory.by_module if peak.index == memory.peak_at.index else {}
    return dataclasses.replace(memory, peak_bytes=peak.total, by_kind=dict(peak.by_kind), peak_at=peak,
                               timeline=timeline, by_module=by_module, notes=[*memory.notes, note], allowance_bytes=allowance)


__all__ = ["SCHEDULES", "in_flight", "stage_activation_bytes", "with_micro_batches_in_flight"]
