"""The distributed reduction: every rank's window of steps summed over the job's process group.

FLOPs, samples, tokens, 6N and dense FLOPs are integers and summed as integers (each split into two
int64 limbs of 32 bits, so sums stay exact far beyond 2^53, where float64 would round, and beyond
int64's 2^63 too); peaks are summed as float64 and the slowest rank's time taken, in three
all_reduces on the group's device (the current CUDA device under NCCL, else the CPU). A figure any rank
lacks, or a time that is not finite seconds, is None in the result, on every rank alike (and a bad time
is warned about: no rank raises inside a collective). Called by `FlopsMeter.reduce` at logging steps
only: a collective.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from fxflops.timing.steps import JOB_SUMMED, WindowStats

_LIMB = 32  # bits of the low limb: a sum of 2^31 ranks' low limbs still fits an int64


def all_reduced(local: WindowStats, group: Any) -> WindowStats:
    """Sums (FLOPs, samples, tokens, 6N, dense FLOPs exactly; peaks) and the slowest time over the group."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    counts = [local.flops, local.samples, local.tokens, local.six_n_flops, local.dense_flops]
    limbs: list[int] = []
    for value in counts:
        # exact while the job's sum stays below 2^94 (the high limbs' sum within int64) over up to 2^31 ranks
        # (the low limbs' sum within int64): 2^94 FLOPs is ~10^28, past any training run's
        value = int(value) if value is not None else 0
        limbs += [value >> _LIMB, value & ((1 << _LIMB) - 1)]  # hi * 2^32 + lo, also for a negative value
    missing = [int(value is None) for value in counts]
    integers = torch.tensor([*limbs, *missing], dtype=torch.int64, device=device)
    peak = torch.tensor([local.peak_flops or 0.0, float(local.peak_flops is None)], dtype=torch.float64,
                        device=device)
    time = local.time
    bad_time = time is not None and not (math.isfinite(time) and time >= 0)
    # a missing time (inf: the max is inf) and a bad one (nan is dropped by some backends' max: sent as inf too)
    slowest = torch.tensor([math.inf if time is None or bad_time else float(time), float(bad_time)],
                           dtype=torch.float64, device=device)
    dist.all_reduce(integers, group=group)
    dist.all_reduce(peak, group=group)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    values = integers.tolist()
    summed = [None if values[2 * len(counts) + i] else (values[2 * i] << _LIMB) + values[2 * i + 1]
              for i in range(len(counts))]
    flops, samples, tokens, six_n, dense = summed
    seconds, any_bad = slowest.tolist()
    if any_bad:
        warnings.warn("fxflops: a rank's step time is not finite seconds >= 0 (NaN, infinite or negative): the job's "
                      "time and rates are left out of this reduction", UserWarning, stacklevel=3)
    total_peak, peak_missing = peak.tolist()
    return WindowStats(steps=local.steps, flops=flops, samples=samples, tokens=tokens,
                       time=None if math.isinf(seconds) else seconds, six_n_flops=six_n,
                       peak_flops=None if peak_missing else total_peak, world_size=dist.get_world_size(group),
                       dense_flops=dense, job_total=JOB_SUMMED)
