"""The distributed reduction: every rank's window of steps summed over the job's process group.

FLOPs, samples, tokens, 6N, peaks and dense FLOPs are summed and the slowest rank's time taken, in two
all_reduces on the group's device (the current CUDA device under NCCL, else the CPU); a figure any rank
lacks is None in the result. Called by `FlopsMeter.reduce` at logging steps only: a collective.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fxflops.timing.steps import WindowStats


def all_reduced(local: WindowStats, group: Any) -> WindowStats:
    """Sums (FLOPs, samples, tokens, 6N, peaks, dense FLOPs) and the slowest time over the group, in two all_reduces."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    known = [local.flops, local.tokens, local.six_n_flops, local.peak_flops, local.dense_flops]
    sums = torch.tensor([float(local.samples), *(v if v is not None else 0 for v in known),
                         *(1.0 if v is None else 0.0 for v in known)], dtype=torch.float64, device=device)
    slowest = torch.tensor([local.time if local.time is not None else math.inf], dtype=torch.float64, device=device)
    dist.all_reduce(sums, group=group)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    values = sums.tolist()
    missing = values[1 + len(known):]
    flops, tokens, six_n, peak, dense = (None if missing[i] else values[1 + i] if i == 3 else int(values[1 + i])
                                         for i in range(len(known)))
    seconds = slowest.item()
    return WindowStats(steps=local.steps, flops=flops, samples=int(values[0]), tokens=tokens,
                       time=None if math.isinf(seconds) else seconds, six_n_flops=six_n, peak_flops=peak,
                       world_size=dist.get_world_size(group), dense_flops=dense)
