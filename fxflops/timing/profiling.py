"""profile(): the static estimate plus a timed eager pass on the model's device, joined as a Profile.

The timed loops, the Measurements assembly and the estimates of live calls (EstimateCache) are shared
by the generation profiler (fxflops.timing.generate) and the DeepSpeed-compatible API (fxflops.compat);
device choice is in fxflops.timing.placement, leaving the model as it was in fxflops.timing.preserving.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fxflops.device import peaks
from fxflops.api import deep_models, estimate
from fxflops.timing.backward import BackwardTimer, mean_backward
from fxflops.timing.clocks import make_clock, queue_ahead, time_calls
from fxflops.timing.join import join
from fxflops.timing.latency import ModuleTimer, StepRecord, mean_per_step, median_record, timeline_rows
from fxflops.timing.placement import (
    batch_size_of,
    compute_dtype,
    device_context,
    device_name,
    gc_paused,
    normalize_args,
    on_device,
    parallel_sizes,
    resolve_device,
    resolve_peak,
)
from fxflops.timing.model_state import model_state
from fxflops.timing.preserving import moved_to, preserved
from fxflops.capture import tensors_in
from fxflops.capture.inputs import signature
from fxflops.capture.backward import backward_roots, cleared_grads, ones_like_each, restore_grads
from fxflops.results import Estimate, Measurements, Profile
from fxflops.tree import forward_only


@deep_models
def profile(
    model: nn.Module,
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    warm_up: int = 1,
    steps: int = 10,
    device: str | torch.device | None = None,
    peak_flops: float | None = None,
    grad: bool = False,
    mp_size: int | None = None,
    dp_size: int | None = None,
    skip_types: tuple[type, ...] = (),
    method: str = "auto",
    conventions: str = "deepspeed",
    rules: Any = None,
    leaf_modules: Any = None,
    backward: bool = False,
    loss: Callable[[Any], torch.Tensor] | None = None,
    strict: bool = False,
) -> Profile:
    """Estimate one forward of `model` (as `estimate()` does) and time it on its device.

    After `warm_up` untimed forwards, each of `steps` rounds times one plain forward (no hooks)
    and one forward with per-module hooks; module latencies are per-step means. `device`
    defaults to the model's own; a model elsewhere is moved there and back. Forwards run under
    `torch.no_grad()` unless `grad=True`. `peak_flops` (FLOP/s) overrides the GPU peak table and
    is the only way to get a CPU utilization. `mp_size`/`dp_size` (or torch.distributed) fill the
    parallel sizes of the summary. Modules of `skip_types` are not timed. `method`, `conventions`,
    `rules`, `leaf_modules` and `strict` are estimate()'s (strict: an incomplete count is refused before
    anything is timed). The model is left as it was: training flags, buffers (BatchNorm statistics),
    devices, RNG state; no hooks remain, also on exceptions.

    `backward=True` counts the backward of `loss(output)` (estimate()'s default loss: the output's
    own `loss` when it has one, else the sum of its floating tensors) and times it too: the whole backward without hooks, and per module by
    timing each autograd node and charging it to the module whose forward created it. Gradients the
    timed backwards leave in `.grad` are put back as they were.
    """
    if steps < 1 or warm_up < 0:
        raise ValueError(f"need steps >= 1 and warm_up >= 0, got steps={steps}, warm_up={warm_up}")
    target = resolve_device(model, device)
    with preserved(model, target) as writes, moved_to(model, target if device is not None else None):
        args, kwargs = on_device((normalize_args(args), dict(kwargs or {})), target)
        static = estimate(model, args, kwargs, method=method, conventions=conventions, rules=rules,
                          leaf_modules=leaf_modules, backward=backward, loss=loss, strict=strict)
        plain, records, host_launch = measure_forward(model, args, kwargs, device=target, warm_up=warm_up, steps=steps,
                                         grad=grad or backward, skip_types=skip_types, watch=writes.watching())
        plain_bwd, bwd_records = measure_backward(model, args, kwargs, device=target, warm_up=warm_up, steps=steps,
                                                  loss=loss, skip_types=skip_types) if backward else ([], [])
    measurements = build_measurements(
        model, target, plain=plain, records=records, warm_up=warm_up, peak_flops=peak_flops,
        batch_size=batch_size_of((args, kwargs)), dtype=compute_dtype(model, target),
    )
    measurements.extra["grad"] = grad or backward
    if host_launch is not None:
        # on a GPU the hooked pass ran with the host queued ahead: its module spans are device time, and
        # what the hooks cost shows on the host, as the time to launch the forward with and without them
        measurements.extra["module_latency"] = "device time, the host queued ahead (fxflops.timing.clocks.QueueAhead)"
        measurements.extra["host_launch_plain"], measurements.extra["host_launch_hooked"] = host_launch
    measurements.world_size, measurements.dp_size, measurements.mp_size = parallel_sizes(mp_size, dp_size)
    if backward:
        measurements.bwd_latency = statistics.fmean(plain_bwd)
        measurements.extra["bwd_latencies"] = list(plain_bwd)
    result = join(static, mean_per_step(records), measurements, mean_backward(bwd_records) if backward else None)
    result.prediction = predicted_on(result, target, compute_dtype(model, target))
    return result


def predicted_on(result: Profile, device: torch.device, dtype: torch.dtype) -> Any:
    """The roofline prediction on a GPU the peaks table knows, which reports set beside the measurement."""
    if device.type != "cuda" or peaks.lookup(device_name(device)) is None:
        return None
    try:
        return result.predict(device_name(device), dtype=dtype)
    except ValueError:  # no rate for this dtype in the table: no prediction rather than a failed profile
        return None


def measure_backward(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    *,
    device: torch.device,
    warm_up: int,
    steps: int,
    loss: Callable[[Any], torch.Tensor] | None = None,
    skip_types: tuple[type, ...] = (),
) -> tuple[list[float], list[dict[str, float]]]:
    """(plain backward latencies, per-module backward seconds), one of each per step, interleaved.

    After `warm_up` untimed forward-backward rounds, each step runs a forward, times its backward
    without hooks, then runs a forward followed by a backward whose autograd nodes are timed.
    `.grad` of parameters and inputs is restored."""
    clock = make_clock(device)
    timer = BackwardTimer(model, clock, skip_types=skip_types)
    saved = cleared_grads([*model.parameters(), *tensors_in((args, kwargs))])

    def roots_and_seeds() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        roots = backward_roots(model(*args, **kwargs), loss)
        if not roots:
            raise ValueError("profile(backward=True): nothing in the output requires grad; unfreeze what trains")
        return roots, ones_like_each(roots)

    plain: list[float] = []
    host_plain: list[float] = []  # seconds the host took to launch each plain backward
    ahead = queue_ahead(device)
    try:
        with torch.enable_grad(), device_context(device):
            for _ in range(warm_up):
                torch.autograd.backward(*roots_and_seeds())
        with torch.enable_grad(), device_context(device), gc_paused():
            for _ in range(steps):
                roots, seeds = roots_and_seeds()
                plain += time_calls(lambda: _launch_timed(lambda: torch.autograd.backward(roots, seeds),  # noqa: B023
                                                          host_plain), 1, clock)
                timer.attach()
                try:
                    roots, seeds = roots_and_seeds()
                finally:
                    timer.detach()
                if ahead is not None:  # as for the forward: the host's launch gaps out of the spans
                    ahead.expect(host_plain[-1])  # the hooks' host cost: up to 3x the plain backward's
                    ahead.fill()
                timer.backward(roots, seeds)
    finally:
        restore_grads(saved)
    return plain, timer.records


def measure_forward(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    *,
    device: torch.device,
    warm_up: int,
    steps: int,
    grad: bool = False,
    skip_types: tuple[type, ...] = (),
    watch: contextlib.AbstractContextManager = contextlib.nullcontext(),
) -> tuple[list[float], list[StepRecord], tuple[float, float] | None]:
    """(plain forward latencies, hooked StepRecords), one of each per step, interleaved, and on a GPU the
    host's median seconds to launch a plain and a hooked forward (None elsewhere).

    Interleaving keeps slow drift (clocks, caches, other load) out of the hooked/plain ratio. The
    hooks are attached only around each hooked forward, so the plain one runs torch's fast path.
    The garbage collector is paused meanwhile, as timeit does.
    """
    clock = make_clock(device)
    timer = ModuleTimer(model, clock, skip_types=skip_types)

    def call() -> Any:
        return model(*args, **kwargs)

    plain: list[float] = []
    host_plain: list[float] = []  # seconds the host took to launch each plain forward
    with torch.set_grad_enabled(grad), device_context(device):
        for _ in range(warm_up):
            with watch:  # what these forwards write into the weights is saved first, and put back after
                call()
        # after the warm-up: the sleep's spin rate is read at the clocks the timed passes run at, not an idle GPU's
        ahead = queue_ahead(device)
        with gc_paused():
            for _ in range(steps):
                plain += time_calls(lambda: _launch_timed(call, host_plain), 1, clock)
                with timer:
                    if ahead is not None:  # the module spans: device time, the host's launch gaps out
                        # the hooks' own host cost is not known before the first hooked pass: 3x the plain
                        ahead.expect(host_plain[-1], timer.records[-1].host_seconds if timer.records else None)
                        ahead.fill()
                    call()
    if not timer.records:
        raise RuntimeError("the timed forward never returned from the root module; nothing was measured")
    host_hooked = [record.host_seconds for record in timer.records]
    host_launch = (statistics.median(host_plain), statistics.median(host_hooked)) if ahead is not None else None
    return plain, timer.records, host_launch


def _launch_timed(call: Callable[[], Any], into: list[float]) -> Any:
    """Call, appending the host's seconds for it (on a GPU: the time to launch, the kernels run on)."""
    began = time.perf_counter()
    out = call()
    into.append(time.perf_counter() - began)
    return out


def build_measurements(
    model: nn.Module,
    device: torch.device,
    *,
    plain: list[float],
    records: list[StepRecord],
    warm_up: int,
    peak_flops: float | None,
    batch_size: int | None,
    dtype: torch.dtype,
) -> Measurements:
    """Measurements from the plain latencies and hooked records of a run. `plain` may be empty
    (a user-driven loop, where nothing runs without hooks): the hooked root latency is then the
    fwd latency, and no hook overhead is claimed."""
    hooked = [r.latency for r in records]
    fwd = plain or hooked
    peak, source = resolve_peak(device, dtype, peak_flops)
    types = {name: type(module).__name__ for name, module in model.named_modules()}
    return Measurements(
        device=str(device),
        device_name=device_name(device),
        timer=make_clock(device).timer,
        warm_up=warm_up,
        steps=len(records),
        fwd_latency=statistics.fmean(fwd),
        fwd_latency_min=min(fwd),
        fwd_latency_median=statistics.median(fwd),
        fwd_latency_max=max(fwd),
        hooked_fwd_latency=statistics.fmean(hooked) if plain else None,
        peak_flops=peak,
        peak_flops_source=source,
        batch_size=batch_size,
        extra={
            "dtype": str(dtype).removeprefix("torch."),
            "fwd_latencies": list(plain),
            "hooked_fwd_latencies": hooked,
            "timeline": timeline_rows(median_record(records), types),
        },
    )



# ------------------------------------------------------------------ estimates from live forward calls


class EstimateCache:
    """Estimates the inputs of live root calls, once per input signature and model state.

    Used as a ModuleTimer's `on_call`: it returns the call's key (the record's tag: its signature,
    whether its backward is counted, and the model's state, `fxflops.timing.model_state`, last), and
    estimates new keys from a private copy of the inputs before the call's clock starts, so a layer
    frozen or a submodule switched to eval between calls is counted as it now is. Signatures that differ
    only in sizes are points of one sweep (`fxflops.sweep.SizeFamilies`, one per model state).
    A failed estimate is kept and raised by `get`, so the user's own loop never breaks on it.
    """

    def __init__(self, model: nn.Module, device: torch.device, backward_when_grad: bool = False,
                 **estimate_options: Any) -> None:
        self.model = model
        self.device = device
        self.options = estimate_options
        # a training loop's forward (grad enabled, something trainable) is estimated with its backward
        self.backward_when_grad = backward_when_grad and estimate_options.get("method", "auto") in ("auto", "eager")
        self.with_backward = True  # False: get() gives the forward alone, even of estimates with a backward
        self.estimates: dict[tuple, Estimate] = {}
        self.errors: dict[tuple, Exception] = {}
        # calls that differ only in sizes (decode steps with a growing cache) share one sweep's capture
        self._families: dict[tuple, Any] = {}  # model state -> its SizeFamilies

    @property
    def captures(self) -> int:
        """Captures made, over every model state seen."""
        return sum(families.captures for families in self._families.values())

    def __call__(self, args: tuple, kwargs: dict) -> tuple:
        backward = self.backward_when_grad and torch.is_grad_enabled() and any(
            p.requires_grad for p in self.model.parameters())
        state = model_state(self.model)
        key = (signature((args, kwargs)), backward, state)
        if key not in self.estimates and key not in self.errors:
            try:
                families = self._families.get(state)
                if families is None:
                    from fxflops.sweeps import SizeFamilies  # sympy's import is paid only where calls are profiled

                    families = self._families[state] = SizeFamilies(self.model, **self.options)
                with preserved(self.model, self.device):
                    # the estimate leaves the inputs as they were (a KV cache is not grown)
                    self.estimates[key] = families.estimate(tuple(args), dict(kwargs), backward)
            except Exception as error:  # noqa: BLE001 - reported by get(), see the class docstring
                self.errors[key] = error
            gc.collect()  # the trace's garbage, collected before this call's clock starts
        return key

    def get(self, key: tuple) -> Estimate:
        if key in self.errors:
            raise RuntimeError(f"estimating the profiled forward failed: {self.errors[key]}") from self.errors[key]
        found = self.estimates[key]
        return found if self.with_backward else forward_only(found)
