"""The largest micro-batch that fits on a device, from a few captures, not by trying each size.

Every tensor a step holds grows with the batch as a polynomial of low degree (most linearly; the
parameters, their gradients and the optimizer's state not at all), so the tensor bytes alive at each op
of the step are, point by point, affine in the micro-batch b: a(i) + k(i)·b. Three captures (b = 2, 3, 4: torch
takes other paths at 1) give a and k and check them; the peak is the highest line, max over i of a(i) + k(i)·b, and the
allowance is added as it grows: the CUDA context and collective buffers constant, fragmentation its
share of the peak, the block rounding (under a block per storage alive at the peak, whatever the
batch) at the most the captures saw. Where the step's ops differ between the three sizes, or a point
is not affine, the device bytes themselves are fitted with the quadratic through the three captures. Either way the answer
is then checked by capturing the step at it and at it + 1, and moved (by bisection over captures) until
the one fits and the next does not: the answer is always one the estimate itself confirms.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from fxflops.capture.tensor_walk import tensors_in
from fxflops.memory.records import MemoryEstimate

SAMPLES = (2, 3, 4)  # not 1: torch takes other paths for a size of 1 (squeezes, broadcasts)
LIMIT = 1 << 24  # no micro-batch above this is looked for
VALUES = 1 << 22  # integer inputs up to this many elements keep values (repeated rows); larger ones are meta


@dataclass(frozen=True)
class MicroBatchFit:
    """The largest micro-batch whose step fits, and what was captured to find it."""

    largest: int  # 0: not even one sample's step fits
    capacity: int  # the device's bytes
    device_bytes: dict[int, int] = field(default_factory=dict)  # each micro-batch captured -> peak + allowance
    how: str = ""  # the fit, in words

    def line(self, device: str | None) -> str:
        """The answer in one line."""
        where = f" on {device}" if device else ""
        if not self.largest:
            return f"largest micro-batch that fits{where}: none (one sample needs {self.device_bytes.get(1, 0):,} B)"
        return (f"largest micro-batch that fits{where}: {self.largest:,} "
                f"({self.device_bytes[self.largest]:,} B; {self.largest + 1:,} needs {self.device_bytes[self.largest + 1]:,} B)")


def largest_micro_batch(measure: Callable[[int], MemoryEstimate], capacity: int, limit: int = LIMIT) -> MicroBatchFit:
    """The largest micro-batch b whose step's device bytes (peak + allowance) are at most `capacity`;
    `measure(b)` estimates the step at micro-batch b (a capture)."""
    seen: dict[int, int] = {}

    def device_bytes(batch: int) -> int:
        if batch not in seen:
            seen[batch] = measure(batch).device_bytes
        return seen[batch]

    samples = [measure(batch) for batch in SAMPLES]
    for batch, memory in zip(SAMPLES, samples):
        seen[batch] = memory.device_bytes
    predict, how = _predictor(samples)
    first = SAMPLES[0]
    if seen[first] > capacity:  # below the samples: one sample, or none
        largest = 1 if device_bytes(1) <= capacity else 0
        if largest:
            device_bytes(2)
        return MicroBatchFit(largest, capacity, dict(seen), how)
    guess = _last_true(lambda batch: predict(batch) <= capacity, first, limit)
    # the captures decide: from the guess, in growing steps towards the answer, then bisection
    fits = device_bytes(guess) <= capacity
    low, high = (guess, None) if fits else (first, guess)  # low fits; high (captured) does not
    step = 1
    while fits and low < limit:
        trial = min(low + step, limit)
        if device_bytes(trial) > capacity:
            high = trial
            break
        low, step = trial, step * 2
    while not fits and high - step > first:
        trial = high - step
        if device_bytes(trial) <= capacity:
            low = trial
            break
        high, step = trial, step * 2
    if high is None:
        return MicroBatchFit(limit, capacity, dict(seen), how + f"; every micro-batch up to {limit:,} fits")
    low = _last_true(lambda batch: device_bytes(batch) <= capacity, low, high - 1)
    device_bytes(low + 1)
    return MicroBatchFit(low, capacity, dict(seen), how)


def inputs_at_batch(args: Any, kwargs: Any, batch: int) -> tuple[Any, Any]:
    """The example inputs at micro-batch `batch`: axis 0 of every input tensor whose axis 0 is the first
    input's (the batch, as sweeps' dims={"batch": 0} reads it) resized, the others as they are. Floating
    inputs become meta tensors (their values are not read); integer and bool ones (token ids, masks) keep
    values, their rows repeated, up to VALUES elements (meta beyond: a model that reads them then says so)."""
    inputs = tensors_in((args, kwargs))
    if not inputs or inputs[0].dim() == 0:
        raise ValueError("the largest micro-batch resizes axis 0 of the inputs: the first input has none")
    example = int(inputs[0].shape[0])

    def resized(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0 or tensor.shape[0] != example:
            return tensor
        shape = (batch, *tensor.shape[1:])
        numel = batch * (tensor.numel() // max(example, 1))
        if tensor.is_floating_point() or tensor.is_complex() or tensor.device.type == "meta" or numel > VALUES:
            return torch.empty(shape, dtype=tensor.dtype, device="meta")
        rows = torch.arange(batch, device=tensor.device) % example
        return tensor.index_select(0, rows)

    return tree_map_only(torch.Tensor, resized, (args, kwargs))


def _last_true(holds: Callable[[int], bool], low: int, high: int) -> int:
    """The largest b in [low, high] where holds(b), holds(low) being true and holds monotone."""
    while low < high:
        middle = (low + high + 1) // 2
        if holds(middle):
            low = middle
        else:
            high = middle - 1
    return low


def _predictor(samples: list[MemoryEstimate]) -> tuple[Callable[[int], float], str]:
    """Device bytes as a function of the micro-batch, from the captures at SAMPLES, and how, in words."""
    # the allowance: the context and collective buffers constant, fragmentation a share of the peak, the
    # block rounding bounded (under a block per storage alive at the peak, however large): its most seen
    lines = _point_lines(samples)
    if lines is not None:
        allowance = samples[0].allowance
        fixed = max(memory.allowance_bytes.rounding for memory in samples) + samples[0].allowance_bytes.context \
            + samples[0].allowance_bytes.collectives

        def predict(batch: int) -> float:
            peak = max(a + k * batch for a, k in lines)
            return peak + int(allowance.fragmentation * peak) + fixed

        steepest = max(lines, key=lambda line: (line[1], line[0]))
        return predict, (f"each op's live bytes affine in the micro-batch b (captured at b = 2, 3, 4); the peak grows "
                         f"by up to {steepest[1]:,} B per sample")
    # a quadratic through the three captures (exact for every size polynomial of degree 2 or less)
    y1, y2, y3 = (Fraction(memory.device_bytes) for memory in samples)
    c2 = (y3 - 2 * y2 + y1) / 2  # in t = b − SAMPLES[0]: y1 + c1·t + c2·t²
    c1 = y2 - y1 - c2

    def quadratic(batch: int) -> float:
        t = batch - SAMPLES[0]
        return float(y1 + c1 * t + max(c2, 0) * t * t)

    return quadratic, ("the step's ops differ with the micro-batch, or a point is not affine: the device bytes "
                       "fitted by the quadratic through b = 2, 3, 4")


def _point_lines(samples: list[MemoryEstimate]) -> list[tuple[int, int]] | None:
    """(a, k) of each point's total a + k·b, when the three timelines run the same ops and every point is
    affine; None otherwise."""
    one, two, three = (memory.timeline for memory in samples)
    if not len(one) == len(two) == len(three):
        return None
    lines = []
    for p1, p2, p3 in zip(one, two, three):
        if not p1.op == p2.op == p3.op or p1.phase != p2.phase:
            return None
        slope = p2.total - p1.total
        if p3.total - p2.total != slope or slope < 0:
            return None
        lines.append((p1.total - SAMPLES[0] * slope, slope))
    return lines


__all__ = ["MicroBatchFit", "largest_micro_batch"]
