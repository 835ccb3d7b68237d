"""Timed eager pass: per-module forward latency from hooks, joined onto an Estimate as a Profile.

On CPU the hooks read `time.perf_counter_ns` (monotonic, nanosecond resolution). On CUDA each hook
records a `torch.cuda.Event` and the device is synchronized once, when the root module returns:
never between modules, because draining the queue per module (as DeepSpeed does) serializes
launch and execution and inflates every number.

A hook only appends `(code, stamp)` to a list (code = module index, `~index` on return); pairing,
nesting and sums happen after the step, outside the timed region.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxflops.capture.backward import SequenceRuns, graph_nodes, parameter_owners
from fxflops.capture.running import capturing
from fxflops.results import Estimate, Measurements, ModuleStats, Profile

# ---------------------------------------------------------------------------------------- clocks


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


# ------------------------------------------------------------------------------- module timing


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
        self._depth += 1
        self._events.append((0, self.clock.stamp()))

    def _root_exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._in_on_call or not self._depth or capturing():  # not self._depth: a pre-hook raised before ours ran
            return
        self._depth -= 1
        if self._depth:
            return
        record = replay(self.names, self._events, self.clock.seconds([s for _, s in self._events]))
        self._events.clear()
        if record is not None:  # None: the forward raised before the root returned
            record.tag = self._tag
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


# ------------------------------------------------------------------------------ backward timing


class BackwardTimer:
    """Times the backward per module: every autograd node the backward runs is timed (from its
    pre-hook to its hook) and charged to the innermost module whose forward created it.

    Ownership comes from autograd's sequence numbers, as in the estimate: while attached, each
    module entry and exit of a forward cuts them (`SequenceRuns`), the numbers handed out in between
    going to the module on top of the stack. A gradient accumulated into a parameter belongs to the
    parameter's nearest timed module. Autograd nodes do not nest, so a module's time is exactly the
    sum of its nodes'; a parent's includes its children's.
    """

    def __init__(self, model: nn.Module, clock: CpuClock | CudaClock, skip_types: tuple[type, ...] = ()) -> None:
        self.clock = clock
        self.records: list[dict[str, float]] = []  # per backward: module -> seconds (inclusive)
        self._modules = [(n, m) for n, m in model.named_modules() if not n or not isinstance(m, skip_types)]
        timed = {name for name, _ in self._modules}
        self._param_owner = {key: _nearest(path, timed) for key, (path, _) in parameter_owners(model).items()}
        self._runs = SequenceRuns()
        self._thread = threading.get_ident()
        self._stack: list[str] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _enter(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            if not capturing():  # a capture's forward is not the one being differentiated
                self._runs.cut(self._stack[-1] if self._stack else None)
                self._stack.append(name)
        return hook

    def _exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._stack and not capturing():
            self._runs.cut(self._stack.pop())

    def attach(self) -> BackwardTimer:
        """Follow the forwards that run from now on (call before the forward to be differentiated)."""
        if not self._handles:
            self._runs, self._stack, self._thread = SequenceRuns(), [], threading.get_ident()
            self._runs.cut(None)
            for name, module in self._modules:
                self._handles.append(module.register_forward_pre_hook(self._enter(name), prepend=True))
                self._handles.append(module.register_forward_hook(self._exit, always_call=True))
        return self

    def detach(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def owner(self, node: Any) -> str | None:
        variable = getattr(node, "variable", None)  # AccumulateGrad: the parameter's module
        if variable is not None:
            return self._param_owner.get(id(variable))
        return self._runs.owner_of(self._thread, node._sequence_nr())

    def backward(self, roots: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Run the backward from `roots`, timing each autograd node; appends one record."""
        nodes = graph_nodes(roots)
        owners = [self.owner(node) for node in nodes]
        stamps: list[list[Any]] = [[] for _ in nodes]
        handles = []
        for node, owner, taken in zip(nodes, owners, stamps):
            if owner is None:
                continue
            handles.append(node.register_prehook(lambda grad_outputs, taken=taken: taken.append(self.clock.stamp())))
            handles.append(node.register_hook(lambda grad_inputs, grad_outputs, taken=taken:
                                              taken.append(self.clock.stamp())))
        self.clock.reset()
        try:
            torch.autograd.backward(roots, grads)
        finally:
            for handle in handles:
                handle.remove()
        seconds = iter(self.clock.seconds([stamp for taken in stamps for stamp in taken]))
        per_module: dict[str, float] = {}
        for owner, taken in zip(owners, stamps):
            times = [next(seconds) for _ in taken]
            if owner is None or len(times) != 2:
                continue
            for name in _self_and_ancestors(owner):
                per_module[name] = per_module.get(name, 0.0) + times[1] - times[0]
        self.records.append(per_module)


def _nearest(path: str, names: set[str]) -> str:
    """`path` or its nearest ancestor in `names` (the root always is)."""
    return next(name for name in _self_and_ancestors(path) if name in names or not name)


def _self_and_ancestors(name: str) -> list[str]:
    names = [name]
    while name:
        name = name.rsplit(".", 1)[0] if "." in name else ""
        names.append(name)
    return names


def mean_backward(records: list[dict[str, float]]) -> dict[str, float]:
    """Per module: mean backward seconds per step (modules absent from a step count 0 there)."""
    totals: dict[str, float] = {}
    for record in records:
        for name, seconds in record.items():
            totals[name] = totals.get(name, 0.0) + seconds
    return {name: seconds / len(records) for name, seconds in totals.items()}


# ------------------------------------------------------------------------ backward / step phases


def _output_tensors(output: Any) -> list[torch.Tensor]:
    """Tensors of a forward's output that gradients flow through (HF ModelOutput is a dict)."""
    leaves = pytree.tree_leaves(dict(output) if isinstance(output, dict) else output)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


class PhaseTimer:
    """Backward and optimizer-step latency in a training loop, without touching torch's functions.

    Backward: from the first gradient reaching a forward output to the end of that backward pass
    (an autograd-engine callback queued from the gradient hook), so the loss's own few backward
    ops are outside it. Step: the optimizer step pre/post hooks, registered (globally, for every
    optimizer) only while attached. On CUDA each phase end synchronizes once.
    """

    def __init__(self, clock: CpuClock | CudaClock) -> None:
        self.clock = clock
        self.bwd: list[float] = []
        self.step: list[float] = []
        self._grad_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._step_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._step_start: Any = None

    def watch(self, output: Any) -> None:
        """Time the backward pass that will run through this forward output."""
        tensors = _output_tensors(output)
        if not tensors:
            return
        started: list[Any] = []

        def on_grad(grad: torch.Tensor) -> None:
            if started:
                return
            self.clock.reset()
            started.append(self.clock.stamp())
            torch.autograd.Variable._execution_engine.queue_callback(on_end)

        def on_end() -> None:
            end = self.clock.stamp()
            self.bwd.append(self.clock.seconds([started[0], end])[1])
            self._drop_grad_hooks()

        self._drop_grad_hooks()  # a later forward replaces an earlier one that never ran backward
        self._grad_handles = [t.register_hook(on_grad) for t in tensors]

    def _drop_grad_hooks(self) -> None:
        handles, self._grad_handles = self._grad_handles, []
        for handle in handles:
            handle.remove()

    def _on_step_start(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.clock.reset()
        self._step_start = self.clock.stamp()

    def _on_step_end(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._step_start is not None:
            self.step.append(self.clock.seconds([self._step_start, self.clock.stamp()])[1])
            self._step_start = None

    def attach(self) -> PhaseTimer:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        if not self._step_handles:
            self._step_handles = [
                register_optimizer_step_pre_hook(self._on_step_start),
                register_optimizer_step_post_hook(self._on_step_end),
            ]
        return self

    def detach(self) -> None:
        handles, self._step_handles = self._step_handles, []
        for handle in handles:
            handle.remove()
        self._drop_grad_hooks()


# ------------------------------------------------------------------------------------------ join


def _with_latency(stats: ModuleStats, measured: tuple[float, int] | None) -> ModuleStats:
    copy = dataclasses.replace(stats, children=list(stats.children))
    if measured is not None:
        copy.latency, copy.latency_calls = measured
    return copy


def _fill_containers(modules: dict[str, ModuleStats], name: str) -> float | None:
    """Post-order: a module that never ran itself (ModuleList) gets its children's summed latency."""
    stats = modules[name]
    child_latencies = [_fill_containers(modules, child) for child in stats.children if child in modules]
    if stats.latency is None:
        ran = [lat for lat in child_latencies if lat is not None]
        if ran:
            stats.latency, stats.latency_calls = sum(ran), 0
    return stats.latency


def graph_modules(estimate: Estimate) -> set[str]:
    """Modules the captured graph saw run: owners of graph nodes, their ancestors, and counted calls."""
    seen = {name for name, stats in estimate.modules.items() if stats.calls}
    for node in estimate.nodes:
        path = node.module
        while path not in seen:
            seen.add(path)
            if not path:
                break
            path = path.rsplit(".", 1)[0] if "." in path else ""
    return seen


def join(estimate: Estimate, latencies: dict[str, tuple[float, int]], measurements: Measurements,
         bwd_latencies: dict[str, float] | None = None) -> Profile:
    """A Profile: the estimate's fields (copied, never mutated) with per-module latency filled in.

    Modules are matched by qualified name. Containers that never run themselves get their
    children's sum. Modules that ran but are not in the estimate, and graph modules that got no
    latency, are listed in `measurements.unmatched_measured` / `unmatched_graph`.
    """
    modules = {name: _with_latency(stats, latencies.get(name)) for name, stats in estimate.modules.items()}
    if "" in modules:
        _fill_containers(modules, "")
    if bwd_latencies is not None:
        for name, stats in modules.items():
            stats.bwd_latency = bwd_latencies.get(name, 0.0)
    measurements.unmatched_measured = tuple(sorted(n for n in latencies if n not in modules))
    seen_in_graph = graph_modules(estimate)
    measurements.unmatched_graph = tuple(n for n, s in modules.items() if n in seen_in_graph and s.latency is None)
    tree = estimate.tree.copy()
    for name in tree.nodes:
        if name in modules:
            tree.nodes[name]["stats"] = modules[name]
    fields = {f.name: getattr(estimate, f.name) for f in dataclasses.fields(Estimate)}
    fields.update(
        modules=modules,
        tree=tree,
        nodes=list(estimate.nodes),
        by_op=dict(estimate.by_op),
        by_rule=dict(estimate.by_rule),
        unknown=list(estimate.unknown),
        attempts=list(estimate.attempts),
        measurements=measurements,
    )
    return Profile(**fields)
