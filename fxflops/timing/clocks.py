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


class QueueAhead:
    """Keeps a GPU's queue ahead of the host while a hooked pass is timed.

    Per-module CUDA events measure the span between two points of the stream. Where the host launches a
    module's kernels slower than the GPU runs them (small kernels, eager Python, the timing hooks' own
    work), the GPU waits between kernels and the span is the host's time, not the module's: measured on an
    H200, GPT-2 small's blocks (batch 8, seq 1024) spanned 0.74-1.07 ms around 0.30 ms of kernels. So
    before each timed pass the stream is given a sleep (`torch.cuda._sleep`, a kernel that spins) longer
    than the host needs to launch the pass (`expect`): the host enqueues the whole pass while the GPU
    sleeps, then the GPU runs it back to back and each span is the module's device time (the same blocks:
    0.35 ms). The sleep lies before the pass's first stamp, in no module's span. It is capped at
    `MAX_SECONDS`; a pass that launches more work than the stream's queue holds blocks the host mid-pass,
    and there gaps can come back."""

    MAX_SECONDS = 0.5
    MARGIN = 0.001  # seconds added to twice the host's expected launch time
    HOOKED_OVER_PLAIN = 3.0  # the hooks' host cost: at most this many times the plain pass's launch

    def __init__(self, device: torch.device, first_guess: float = 0.01) -> None:
        self.device = device
        self.seconds = first_guess  # the sleep before the next pass
        self.cycles_per_second = self._spin_rate()

    def _spin_rate(self) -> float:
        """Spin cycles per second, read once (the SM clock as the sleep kernel sees it)."""
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 1_000_000
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream(self.device)
            torch.cuda._sleep(cycles)  # once untimed: the kernel's first launch loads its module
            began.record(stream)
            torch.cuda._sleep(cycles)
            ended.record(stream)
        ended.synchronize()
        return cycles / max(began.elapsed_time(ended) * 1e-3, 1e-9)

    def expect(self, plain_host: float, hooked_host: float | None = None) -> None:
        """Size the next sleep from the host's seconds to launch the last plain pass and, where one ran, the
        last hooked pass (see `sleep_for`)."""
        self.seconds = self.sleep_for(plain_host, hooked_host)

    @classmethod
    def sleep_for(cls, plain_host: float, hooked_host: float | None = None) -> float:
        """Twice the host's expected time to launch a hooked pass, plus `MARGIN`, at most `MAX_SECONDS`. The
        expectation: the last hooked pass's host time, at most `HOOKED_OVER_PLAIN` times the plain pass's
        (that bound alone before any hooked pass ran). The bound matters where the host waited on the device
        in the hooked pass (a sync inside the forward, a launch queue full): that wait held the sleep itself,
        and read as launch time it doubled the next sleep, step after step, up to `MAX_SECONDS`."""
        bound = cls.HOOKED_OVER_PLAIN * plain_host
        expected = bound if hooked_host is None else min(hooked_host, bound)
        return min(2 * expected + cls.MARGIN, cls.MAX_SECONDS)

    def fill(self) -> None:
        """Put the sleep on the stream, ahead of the pass about to be launched."""
        with torch.cuda.device(self.device):
            torch.cuda._sleep(int(self.seconds * self.cycles_per_second))


def queue_ahead(device: torch.device) -> QueueAhead | None:
    """A QueueAhead for a CUDA device, None elsewhere (a host clock has no queue to fill)."""
    return QueueAhead(device) if device.type == "cuda" else None


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
