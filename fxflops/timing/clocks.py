"""Clocks for the timed passes: perf_counter on the host, CUDA events on a GPU, one interface.

A clock hands out stamps (`stamp()`), starts a new step (`reset()`) and turns a step's stamps into
seconds after its first (`seconds()`). `CpuClock` reads `time.perf_counter_ns`; `CudaClock`
records events from a pool reused every step on the model's device and synchronizes once, when
the step's times are read. `time_calls` times whole calls with either.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


class CpuClock:
    """Host clock: a stamp is an integer nanosecond count."""

    timer = "perf_counter"

    def __init__(self) -> None:
        self.stamp: Callable[[], Any] = time.perf_counter_ns

    def reset(self) -> None:
        """Start a new step (nothing to recycle on the host)."""

    def seconds(self, stamps: list[Any]) -> list[float]:
        """Each stamp as seconds after the first one."""
        if not stamps:
            return []
        first = stamps[0]
        return [(s - first) * 1e-9 for s in stamps]


class CudaClock:
    """Device clock: a stamp is a CUDA event recorded on the current stream.

    Events come from a pool reused every step, so a hook does not allocate one. `seconds`
    synchronizes the device once and reads all elapsed times.
    """

    timer = "cuda-event"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool: list[torch.cuda.Event] = []
        self._next = 0

    def reset(self) -> None:
        self._next = 0

    def stamp(self) -> torch.cuda.Event:
        if self._next == len(self._pool):
            self._pool.append(torch.cuda.Event(enable_timing=True))
        event = self._pool[self._next]
        self._next += 1
        # the model's device, which need not be the current one (a model on cuda:1)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, stamps: list[Any]) -> list[float]:
        if not stamps:
            return []
        # One synchronize for the whole step; device-wide, because a forward may use side streams.
        torch.cuda.synchronize(self.device)
        first = stamps[0]
        return [first.elapsed_time(s) * 1e-3 for s in stamps]


def make_clock(device: torch.device) -> CpuClock | CudaClock:
    """The clock for a device: CUDA events on a GPU, perf_counter elsewhere."""
    return CudaClock(device) if device.type == "cuda" else CpuClock()


def time_calls(fn: Callable[[], Any], steps: int, clock: CpuClock | CudaClock) -> list[float]:
    """Seconds of each of `steps` calls of `fn`, timed around the call only."""
    latencies = []
    for _ in range(steps):
        clock.reset()
        start = clock.stamp()
        fn()
        end = clock.stamp()
        latencies.append(clock.seconds([start, end])[1])
    return latencies
