"""DeepSpeed's FlopsProfiler on top of fxflops: profile the forwards a loop runs itself.

The profiler times every forward between start_profile() and stop_profile() with hooks it removes
again, and estimates each new input signature once; `print_profile_report` and `fold_ignored` are
shared with `get_model_profile` (fxflops.integrations.deepspeed).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from fxflops.report.formats import (
    ENCODING_ERRORS,
    duration_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)
from fxflops.results import Profile
from fxflops.timing.backward import PhaseTimer
from fxflops.timing.clocks import make_clock
from fxflops.timing.generate import generation_profile, split_runs
from fxflops.timing.join import join
from fxflops.timing.latency import ModuleTimer, mean_per_step
from fxflops.timing.model_state import state_change
from fxflops.timing.placement import batch_size_of, compute_dtype, model_device, parallel_sizes
from fxflops.timing.profiling import EstimateCache, build_measurements


def print_profile_report(
    result: Profile,
    *,
    profile_step: int = 1,
    module_depth: int = -1,
    top_modules: int = 1,
    detailed: bool = True,
    output_file: str | None = None,
) -> None:
    """The fxflops text report, plus the prefill / decode lines of a generation profile."""
    result.measurements.extra["profile_step"] = profile_step
    text = result.print(module_depth=module_depth, top_modules=top_modules, detailed=detailed, as_string=True)
    if output_file:
        with open(output_file, "w", encoding="utf-8", errors=ENCODING_ERRORS) as out:
            out.write(text)
    else:
        print(text, end="")


def fold_ignored(result: Profile, model: nn.Module, types: tuple[type, ...]) -> None:
    """Move the own cost of modules of the ignored types (and subclasses) to their nearest kept ancestor.

    DeepSpeed hooks no ignored module, so the functionals they call count toward the module
    around them: the parent's inclusive numbers and the totals stay, the ignored module shows
    only what its own submodules did. Works on the Profile's own module copies.
    """
    ignored = {name for name, module in model.named_modules() if name and isinstance(module, types)} if types else set()
    modules = result.modules
    fields = ("macs", "flops", "bwd_macs", "bwd_flops")
    for name in ignored & modules.keys():
        stats = modules[name]
        own = dict(zip(fields, (stats.self_macs, stats.self_flops, stats.self_bwd_macs, stats.self_bwd_flops)))
        stats.self_macs = stats.self_flops = stats.self_bwd_macs = stats.self_bwd_flops = 0
        parent = name
        while parent in ignored:  # the module and its ignored ancestors lose it
            for field in fields:
                setattr(modules[parent], field, getattr(modules[parent], field) - own[field])
            parent = _parent(parent)
        modules[parent].self_macs += own["macs"]
        modules[parent].self_flops += own["flops"]
        modules[parent].self_bwd_macs += own["bwd_macs"]
        modules[parent].self_bwd_flops += own["bwd_flops"]


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


class FlopsProfiler:
    """DeepSpeed's FlopsProfiler: profile the forwards a training (or generation) loop runs itself.

    Between `start_profile()` and `stop_profile()` every forward of `model` is timed per module,
    and its inputs (once per distinct shape) are estimated. A backward pass through a profiled
    forward's output and optimizer steps in that window are timed too, and the summary then adds
    bwd / step / iter latency and samples/second. A forward run with grad enabled is estimated with
    its backward (fxflops.estimate(backward=True)), so bwd FLOPs are counted op by op, not taken as
    2 x fwd as DeepSpeed does; `recompute_fwd_factor` x fwd FLOPs is added on top, as there.
    A window whose forwards differ in shape — `model.generate()` — is reported as one generation
    with its prefill / decode breakdown.

    `ds_engine` (a DeepSpeed engine) or `mp_size`/`dp_size` give the parallel sizes; under
    torch.distributed the world size is read from it. `peak_flops` sets the utilization peak;
    `estimate_options` go to `fxflops.estimate()`.
    """

    def __init__(
        self,
        model: nn.Module,
        ds_engine: Any = None,
        recompute_fwd_factor: float = 0.0,
        *,
        mp_size: int | None = None,
        dp_size: int | None = None,
        peak_flops: float | None = None,
        **estimate_options: Any,
    ) -> None:
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.mp_size = mp_size if mp_size is not None else getattr(ds_engine, "mp_world_size", None)
        self.dp_size = dp_size if dp_size is not None else getattr(ds_engine, "dp_world_size", None)
        self.peak_flops = peak_flops
        self.estimate_options = estimate_options
        self.started = False
        self._ignore: tuple[type, ...] = ()
        self._device: torch.device | None = None
        self._timer: ModuleTimer | None = None
        self._phases: PhaseTimer | None = None
        self._cache: EstimateCache | None = None
        self._batch_size: int | None = None
        self._profile: Profile | None = None
        self._profile_key: tuple | None = None

    # -- the state machine: idle -> started (hooks on) -> stopped (data kept) -> ended (idle)

    def start_profile(self, ignore_list: list[type] | None = None) -> None:
        """Start timing every forward (and the backward / optimizer steps that follow)."""
        self.end_profile()
        self._ignore = tuple(ignore_list or ())
        self._device = model_device(self.model)
        self._cache = EstimateCache(self.model, self._device, backward_when_grad=True, **self.estimate_options)
        self._phases = PhaseTimer(make_clock(self._device))
        self._timer = ModuleTimer(
            self.model, make_clock(self._device), skip_types=self._ignore, on_call=self._on_call,
            on_return=self._phases.watch,
        )
        try:
            self._timer.attach()
            self._phases.attach()
        except BaseException:
            self.end_profile()
            raise
        self.started = True

    def _on_call(self, args: tuple, kwargs: dict) -> tuple:
        if self._batch_size is None:
            self._batch_size = batch_size_of((args, kwargs))
        return self._cache(args, kwargs)

    def stop_profile(self) -> None:
        """Stop timing; hooks are removed, what was measured stays readable."""
        if self._timer is not None:
            self._timer.detach()
        if self._phases is not None:
            self._phases.detach()

    def reset_profile(self) -> None:
        """Forget what was measured so far (hooks stay as they are)."""
        if self._timer is not None:
            self._timer.records.clear()
        if self._phases is not None:
            self._phases.bwd.clear()
            self._phases.step.clear()
        self._profile = None

    def end_profile(self) -> None:
        """Stop and forget everything; the model is exactly as before start_profile()."""
        self.stop_profile()
        self._timer = self._phases = self._cache = self._profile = None
        self._batch_size = None
        self.started = False

    # -- results

    @property
    def profile(self) -> Profile:
        """The Profile of what was measured since start_profile() (built once per new data)."""
        if self._timer is None or not self._timer.records:
            raise RuntimeError("nothing profiled: call start_profile() and run the model's forward first")
        key = (len(self._timer.records), len(self._phases.bwd), len(self._phases.step))
        if self._profile is None or key != self._profile_key:
            self._profile, self._profile_key = self._build(), key
        return self._profile

    def _build(self) -> Profile:
        # the backward is counted only when the window saw one run
        self._cache.with_backward = bool(self._phases.bwd)
        records = self._timer.records
        now = [r for r in records if r.tag[-1] == records[-1].tag[-1]]  # tag: (signature, backward, model state)
        if len(now) < len(records):
            # a layer frozen, a head replaced, a submodule switched to eval inside the window: the forwards
            # before it counted other FLOPs; the profile is of the model as it is now (FLOPs and latency alike)
            warnings.warn(f"fxflops.FlopsProfiler: the model changed inside the profiling window "
                          f"({state_change(records[0].tag[-1], records[-1].tag[-1])}); the profile "
                          f"covers the {len(now)} of {len(records)} forwards since it changed",
                          UserWarning, stacklevel=3)
            records = now
        runs = split_runs(records)
        common = dict(warm_up=0, peak_flops=self.peak_flops, batch_size=self._batch_size)
        if all(len(run) == 1 for run in runs):  # plain forwards, one input signature
            measurements = build_measurements(self.model, self._device, plain=[], records=records,
                                              dtype=compute_dtype(self.model, self._device), **common)
            result = join(self._cache.get(records[0].tag), mean_per_step(records), measurements)
        else:
            result = generation_profile(self.model, self._device, runs, self._cache, plain=[], **common)
        self._add_phases(result)
        fold_ignored(result, self.model, self._ignore)
        return result

    def _add_phases(self, result: Profile) -> None:
        m = result.measurements
        m.world_size, m.dp_size, m.mp_size = parallel_sizes(self.mp_size, self.dp_size)
        if self._phases.bwd:
            m.bwd_latency = sum(self._phases.bwd) / len(self._phases.bwd)
        if self._phases.step:
            m.step_latency = sum(self._phases.step) / len(self._phases.step)
        if m.bwd_latency is not None and m.step_latency is not None:
            m.iter_latency = m.fwd_latency + m.bwd_latency + m.step_latency
        m.extra["recompute_fwd_factor"] = self.recompute_fwd_factor

    # DeepSpeed's older getters took `in_str=` for `as_string=`; its get_total_flops then returned MACs
    # (it counted multiply-accumulates under the name flops), and so does the older call here. A
    # positional get_total_flops(True) is today's call (FLOPs): only the keyword tells them apart.

    def get_total_flops(self, as_string: bool = False, *, in_str: bool | None = None) -> int | str:
        """Forward FLOPs per profiled step (with DeepSpeed's older `in_str=`: MACs, as it returned)."""
        if in_str is not None:
            return self.get_total_macs(as_string=in_str)
        flops = self.profile.fwd_flops
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False, *, in_str: bool | None = None) -> int | str:
        """Forward MACs per profiled step."""
        macs = self.profile.fwd_macs
        return macs_to_string(macs) if _as_string(as_string, in_str) else macs

    def get_total_params(self, as_string: bool = False, *, in_str: bool | None = None) -> int | str:
        """Parameters of the model (with DeepSpeed's older `in_str=`: the trainable ones, as it counted)."""
        params = self.profile.total_params if in_str is None else _trainable(self.model)
        return params_to_string(params) if _as_string(as_string, in_str) else params

    def get_total_duration(self, as_string: bool = False, *, in_str: bool | None = None) -> float | str:
        """Forward latency of the model per profiled step, in seconds (the top module's hooks)."""
        duration = self.profile.root.latency
        return duration_to_string(duration) if _as_string(as_string, in_str) else duration

    def get_total_steps(self) -> int:
        """How many forwards of the model were timed since start_profile() (DeepSpeed's older getter)."""
        return 0 if self._timer is None else len(self._timer.records)  # one record per call of the model

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
    ) -> None:
        """Print the report (DeepSpeed prints nothing before start_profile(); neither do we)."""
        if not self.started:
            return
        print_profile_report(self.profile, profile_step=profile_step, module_depth=module_depth,
                             top_modules=top_modules, detailed=detailed, output_file=output_file)

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        """DeepSpeed's older entry point: the report without the detailed module tree."""
        self.print_model_profile(module_depth=module_depth, top_modules=top_modules, detailed=False)


def _trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _as_string(as_string: bool, in_str: bool | None) -> bool:
    return as_string if in_str is None else in_str
