"""Per-module forward latency from hooks: one record of every module's calls per call of the root.

On CPU the hooks read `time.perf_counter_ns` (monotonic, nanosecond resolution). On CUDA each hook
records a `torch.cuda.Event` and the device is synchronized once, when the root module returns:
never between modules, because draining the queue per module (as DeepSpeed does) serializes
launch and execution and inflates every number (`fxflops.timing.clocks`).

A hook only appends `(code, stamp)` to a list (code = module index, `~index` on return); pairing,
nesting and sums happen after the step, outside the timed region. `fxflops.timing.join` joins the
latencies onto an Estimate as a Profile.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxflops.capture.running import capturing
from fxflops.timing.clocks import CpuClock, CudaClock


@dataclass(frozen=True)
class Interval:
    """One forward call of one module, in seconds since its step began."""

    module: str
    start: float
    end: float
    depth: int  # nesting depth in the call stack of this step (root call = 0)


@dataclass
class StepRecord:
    """One completed call of the root module: what every module inside it took."""

    latency: float  # the root call, hooks included
    modules: dict[str, tuple[float, int]]  # name -> (seconds summed over its calls, calls)
    timeline: list[Interval]
    tag: Any = None  # what the timer's on_call returned for this call (e.g. an input signature)
    # the host's seconds from the root's entry to its return, before the clock is read: on a GPU the time
    # to launch the call (its kernels run on), hooks included
    host_seconds: float | None = None


class ModuleTimer:
    """Times every forward call of `model`'s modules; one StepRecord per call of the root.

    Use it as a context manager, or attach()/detach(); records survive detach. The outermost root
    call opens and closes a step; its return hook is registered with `always_call=True`, so a
    forward that raises still closes the step (and leaves no record). Modules whose type is in
    `skip_types` get no hooks (the root is always timed).

    `on_call(args, kwargs)` runs before each outermost root call starts its clock; what it returns
    becomes the record's `tag`. Forwards it runs itself (a tracing estimate) are not recorded.
    `on_return(output)` runs after each recorded call.
    """

    def __init__(
        self,
        model: nn.Module,
        clock: CpuClock | CudaClock,
        *,
        skip_types: tuple[type, ...] = (),
        on_call: Callable[[tuple, dict], Any] | None = None,
        on_return: Callable[[Any], None] | None = None,
    ) -> None:
        self.model = model
        self.clock = clock
        self.records: list[StepRecord] = []
        self.on_call = on_call
        self.on_return = on_return
        modules = [(n, m) for n, m in model.named_modules() if not n or not isinstance(m, skip_types)]
        self.names = [n for n, _ in modules]
        self._modules = [m for _, m in modules]
        self._events: list[tuple[int, Any]] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._depth = 0
        self._tag: Any = None
        self._in_on_call = False
        self._host_began = 0.0

    # The hot path: one list append and one clock read per hook, nothing else. Forwards a capture runs
    # (this timer's on_call estimating, or another profiler's) are fxflops' own, not steps: not recorded.
    def _pre_hook(self, index: int) -> Callable:
        events, stamp = self._events, self.clock.stamp

        def hook(module: nn.Module, args: tuple) -> None:
            if not capturing():
                events.append((index, stamp()))

        return hook

    def _post_hook(self, index: int) -> Callable:
        events, stamp, code = self._events, self.clock.stamp, ~index

        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not capturing():
                events.append((code, stamp()))

        return hook

    def _root_enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._in_on_call or capturing():
            return
        if self._depth == 0:
            if self.on_call is not None:
                self._in_on_call = True
                try:
                    self._tag = self.on_call(args, kwargs)
                finally:
                    self._in_on_call = False
            self._events.clear()  # also drops whatever forwards on_call ran
            self.clock.reset()
            self._host_began = time.perf_counter()
        self._depth += 1
        self._events.append((0, self.clock.stamp()))

    def _root_exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._in_on_call or not self._depth or capturing():  # not self._depth: a pre-hook raised before ours ran
            return
        self._depth -= 1
        if self._depth:
            return
        host_seconds = time.perf_counter() - self._host_began
        record = replay(self.names, self._events, self.clock.seconds([s for _, s in self._events]))
        self._events.clear()
        if record is not None:  # None: the forward raised before the root returned
            record.tag = self._tag
            record.host_seconds = host_seconds
            self.records.append(record)
            if self.on_return is not None:
                self.on_return(output)

    def attach(self) -> ModuleTimer:
        """Register the hooks (pre-hooks first in line, so user hooks count inside the module)."""
        if self._handles:
            return self
        root, *rest = self._modules
        add = self._handles.append
        try:
            add(root.register_forward_pre_hook(self._root_enter, prepend=True, with_kwargs=True))
            add(root.register_forward_hook(self._post_hook(0)))
            add(root.register_forward_hook(self._root_exit, always_call=True))
            for index, module in enumerate(rest, start=1):
                add(module.register_forward_pre_hook(self._pre_hook(index), prepend=True))
                add(module.register_forward_hook(self._post_hook(index)))
        except BaseException:  # e.g. a ScriptModule refuses hooks: leave none behind
            self.detach()
            raise
        return self

    def detach(self) -> None:
        """Remove every hook this timer registered; safe to call twice."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        self._events.clear()
        self._depth = 0

    def __enter__(self) -> ModuleTimer:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()


def replay(names: list[str], events: list[tuple[int, Any]], seconds: list[float]) -> StepRecord | None:
    """Pair enter/exit events into intervals; None when the outermost root call never returned."""
    stack: list[tuple[int, float]] = []
    sums: dict[str, list] = {}
    timeline: list[Interval] = []
    root_latency = None
    for (code, _), t in zip(events, seconds):
        if code >= 0:
            stack.append((code, t))
            continue
        index = ~code
        # A module whose forward raised inside a caller's try/except never returned: drop it.
        while stack and stack[-1][0] != index:
            stack.pop()
        if not stack:
            continue
        _, start = stack.pop()
        name = names[index]
        timeline.append(Interval(name, start, t, len(stack)))
        acc = sums.setdefault(name, [0.0, 0])
        acc[0] += t - start
        acc[1] += 1
        if index == 0 and not stack:
            root_latency = t - start
    if root_latency is None:
        return None
    timeline.sort(key=lambda iv: (iv.start, iv.depth))
    return StepRecord(root_latency, {n: (s, c) for n, (s, c) in sums.items()}, timeline)


def mean_per_step(records: list[StepRecord]) -> dict[str, tuple[float, int]]:
    """Per module: mean seconds per step (all its calls summed) and calls per step (rounded mean)."""
    totals: dict[str, list] = {}
    for record in records:
        for name, (seconds, calls) in record.modules.items():
            acc = totals.setdefault(name, [0.0, 0])
            acc[0] += seconds
            acc[1] += calls
    n = len(records)
    return {name: (seconds / n, round(calls / n)) for name, (seconds, calls) in totals.items()}


def median_record(records: list[StepRecord]) -> StepRecord:
    """The record whose root latency is the median one (its timeline is a typical step)."""
    return sorted(records, key=lambda r: r.latency)[(len(records) - 1) // 2]


def timeline_rows(record: StepRecord, types: dict[str, str]) -> list[dict[str, Any]]:
    """A step's intervals as plain dicts (JSON-ready), for Measurements.extra['timeline']."""
    return [
        {"module": iv.module, "type": types.get(iv.module, ""), "start": iv.start,
         "duration": iv.end - iv.start, "depth": iv.depth}
        for iv in record.timeline
    ]
