"""Profiling text generation: every forward call `model.generate()` makes, estimated and timed.

Generation is a sequence of root forward calls: the prefill (the whole prompt) and one decode
step per new token, each with a longer cache. The timer records each call with its input
signature; each distinct signature is estimated once (from a private copy of the live inputs,
so the cache generation keeps using is never touched). The Profile sums all calls of one
generation; `extra["generate"]` splits prefill from decode, per step and summed.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import torch
from torch import nn

from fxflops.timing.clocks import make_clock
from fxflops.timing.join import join
from fxflops.timing.latency import Interval, ModuleTimer, StepRecord, mean_per_step
from fxflops.timing.placement import (
    batch_size_of,
    compute_dtype,
    device_context,
    gc_paused,
    normalize_args,
    on_device,
    parallel_sizes,
    resolve_device,
)
from fxflops.timing.preserving import moved_to, preserved
from fxflops.timing.profiling import EstimateCache, build_measurements
from fxflops.results import Estimate, OpTotals, Profile, UnknownOp
from fxflops.tree import module_tree


def profile_generate(
    model: nn.Module,
    args: Any = (),
    kwargs: dict[str, Any] | None = None,
    *,
    warm_up: int = 1,
    steps: int = 1,
    device: str | torch.device | None = None,
    peak_flops: float | None = None,
    mp_size: int | None = None,
    dp_size: int | None = None,
    skip_types: tuple[type, ...] = (),
    **estimate_options: Any,
) -> Profile:
    """Profile `model.generate(*args, **kwargs)` (a transformers model) like `profile()` does a forward.

    After `warm_up` untimed generations, each of `steps` rounds runs one generation timed at the
    root forward only (the plain latency) and one with per-module hooks. Totals are per
    generation; `measurements.extra["generate"]` has the prefill / decode breakdown.
    `estimate_options` go to `estimate()` (method, conventions, rules, leaf_modules).
    """
    if steps < 1 or warm_up < 0:
        raise ValueError(f"need steps >= 1 and warm_up >= 0, got steps={steps}, warm_up={warm_up}")
    target = resolve_device(model, device)
    with preserved(model, target) as writes, moved_to(model, target if device is not None else None):
        args, kwargs = on_device((normalize_args(args), dict(kwargs or {})), target)
        cache = EstimateCache(model, target, **estimate_options)
        clock = make_clock(target)
        plain = ModuleTimer(model, clock, skip_types=(nn.Module,))  # the root alone: no module hooks
        hooked = ModuleTimer(model, clock, skip_types=skip_types, on_call=cache)
        plain_runs, runs = [], []
        with torch.no_grad(), device_context(target):
            for _ in range(warm_up):
                with writes.watching():
                    model.generate(*args, **kwargs)
            with gc_paused():
                for _ in range(steps):
                    plain_runs.append(_run(plain, lambda: model.generate(*args, **kwargs)))
                    runs.append(_run(hooked, lambda: model.generate(*args, **kwargs)))
    result = generation_profile(
        model, target, runs, cache, plain=[sum(r.latency for r in run) for run in plain_runs],
        warm_up=warm_up, peak_flops=peak_flops, batch_size=batch_size_of((args, kwargs)),
    )
    result.measurements.world_size, result.measurements.dp_size, result.measurements.mp_size = \
        parallel_sizes(mp_size, dp_size)
    return result


def _run(timer: ModuleTimer, generate: Any) -> list[StepRecord]:
    """The records one generation added to the timer."""
    start = len(timer.records)
    with timer:
        generate()
    return timer.records[start:]


def split_runs(records: list[StepRecord]) -> list[list[StepRecord]]:
    """Cut a stream of forward records into generations: one starts wherever the first call's
    input signature (the prefill's) comes again. Same-shaped forwards become one run each."""
    runs: list[list[StepRecord]] = []
    for record in records:
        if not runs or record.tag == records[0].tag:
            runs.append([])
        runs[-1].append(record)
    return runs


def generation_profile(
    model: nn.Module,
    device: torch.device,
    runs: list[list[StepRecord]],
    cache: EstimateCache,
    *,
    plain: list[float],
    warm_up: int,
    peak_flops: float | None,
    batch_size: int | None,
) -> Profile:
    """A Profile of one generation from `runs` (each a list of forward records) and their estimates.

    Runs whose call sequence differs from the first one's (an early end of sequence) are left out
    and counted in `extra["generate"]["runs_left_out"]`.
    """
    tags = [r.tag for r in runs[0]]
    kept = [run for run in runs if [r.tag for r in run] == tags]
    calls = [cache.get(tag) for tag in tags]
    merged = [merge(run) for run in kept]
    measurements = build_measurements(
        model, device, plain=plain, records=merged, warm_up=warm_up, peak_flops=peak_flops,
        batch_size=batch_size, dtype=compute_dtype(model, device),
    )
    measurements.extra["generate"] = breakdown(calls, kept)
    measurements.extra["generate"]["runs_left_out"] = len(runs) - len(kept)
    measurements.extra["generate"]["estimated_signatures"] = len(cache.estimates)
    measurements.extra["generate"]["captures"] = cache.captures
    return join(combine(calls), mean_per_step(merged), measurements)


def merge(run: list[StepRecord]) -> StepRecord:
    """One record for a whole generation: module times and calls summed, timelines laid end to end."""
    modules: dict[str, list] = {}
    timeline: list[Interval] = []
    offset = 0.0
    for record in run:
        for name, (seconds, calls) in record.modules.items():
            acc = modules.setdefault(name, [0.0, 0])
            acc[0] += seconds
            acc[1] += calls
        timeline += [dataclasses.replace(iv, start=iv.start + offset, end=iv.end + offset) for iv in record.timeline]
        offset += record.latency
    return StepRecord(offset, {n: (s, c) for n, (s, c) in modules.items()}, timeline)


def combine(estimates: list[Estimate]) -> Estimate:
    """One Estimate for a sequence of forward calls: per-module and total costs summed.

    All calls are of the same model, so they share the module set; parameters are not summed.
    """
    first = estimates[0]
    modules = {}
    for name, stats in first.modules.items():
        parts = [e.modules[name] for e in estimates if name in e.modules]
        modules[name] = dataclasses.replace(
            stats,
            children=list(stats.children),
            macs=sum(p.macs for p in parts),
            flops=sum(p.flops for p in parts),
            self_macs=sum(p.self_macs for p in parts),
            self_flops=sum(p.self_flops for p in parts),
            calls=sum(p.calls for p in parts),
            bwd_macs=sum(p.bwd_macs for p in parts),
            bwd_flops=sum(p.bwd_flops for p in parts),
            self_bwd_macs=sum(p.self_bwd_macs for p in parts),
            self_bwd_flops=sum(p.self_bwd_flops for p in parts),
            bytes=sum(p.bytes for p in parts),
            self_bytes=sum(p.self_bytes for p in parts),
        )
    methods = sorted({e.method for e in estimates})
    return Estimate(
        model_type=first.model_type,
        method="+".join(methods),
        conventions=first.conventions,
        total_macs=sum(e.total_macs for e in estimates),
        total_flops=sum(e.total_flops for e in estimates),
        total_params=first.total_params,
        modules=modules,
        nodes=[node for e in estimates for node in e.nodes],
        by_op=_summed_totals([e.by_op for e in estimates]),
        by_rule=_summed_totals([e.by_rule for e in estimates]),
        unknown=_merged_unknown([u for e in estimates for u in e.unknown]),
        tree=module_tree(modules),
        input_shapes=first.input_shapes,
        attempts=list(first.attempts),
        dtype=first.dtype,
        training=first.training,
        backward=any(e.backward for e in estimates),
        bwd_macs=sum(e.bwd_macs for e in estimates),
        bwd_flops=sum(e.bwd_flops for e in estimates),
        cautions=list(dict.fromkeys(c for e in estimates for c in e.cautions)),
        aliases=dict(first.aliases),
    )


def _summed_totals(tables: list[dict[str, OpTotals]]) -> dict[str, OpTotals]:
    sums: dict[str, list[int]] = {}
    statuses: dict[str, set[str]] = {}
    for table in tables:
        for key, t in table.items():
            statuses.setdefault(key, set()).update(t.statuses)
            acc = sums.setdefault(key, [0, 0, 0, 0, 0])
            acc[0] += t.count
            acc[1] += t.macs
            acc[2] += t.flops
            acc[3] += t.bwd_macs
            acc[4] += t.bwd_flops
    ordered = sorted(sums.items(), key=lambda item: (-item[1][1], -item[1][2], item[0]))
    return {key: OpTotals(*values, statuses=tuple(sorted(statuses[key]))) for key, values in ordered}


def _merged_unknown(unknown: list[UnknownOp]) -> list[UnknownOp]:
    merged: dict[str, tuple[int, tuple[str, ...]]] = {}
    for u in unknown:
        count, modules = merged.get(u.op, (0, ()))
        merged[u.op] = count + u.count, modules + tuple(m for m in u.modules if m not in modules)
    return [UnknownOp(op, count, modules) for op, (count, modules) in sorted(merged.items())]


def breakdown(calls: list[Estimate], runs: list[list[StepRecord]]) -> dict[str, Any]:
    """Prefill (the first call) and decode (the rest): MACs, FLOPs and mean latency, per step and summed."""
    latencies = [statistics.fmean(run[i].latency for run in runs) for i in range(len(calls))]
    rows = [
        {"index": i, "phase": "prefill" if i == 0 else "decode", "input_shapes": e.input_shapes,
         "macs": e.total_macs, "flops": e.total_flops, "latency": latencies[i]}
        for i, e in enumerate(calls)
    ]
    return {"calls": len(calls), "prefill": _phase(rows[:1]), "decode": _phase(rows[1:]), "steps": rows}


def _phase(rows: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(rows)
    summed = {key: sum(r[key] for r in rows) for key in ("macs", "flops", "latency")}
    per_step = {f"{key}_per_step": (value / n if n else 0) for key, value in summed.items()}
    return {"calls": n, **summed, **per_step}
