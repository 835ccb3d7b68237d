"""Chrome / Perfetto trace (JSON trace-event format) of one step: measured, or counted.

A profile's trace: each forward call of a module becomes a complete ("X") event; nesting comes from
the times, so chrome://tracing and ui.perfetto.dev draw the module hierarchy as stacked bars. The
timeline is the median step of the hooked pass (`Measurements.extra["timeline"]`); the collectives a
module calls are instant events at its first call's start, on a track of their own.

An estimate's trace (nothing measured) is the counted step in op order — one microsecond per op, an
order, not a time: each run of ops of a module (forward, backward, recompute) is an "X" event with
its FLOPs and MACs, each collective an event on its own track with its group and bytes, and with
memory= the tensor bytes alive, by kind, as a counter track.
"""

from __future__ import annotations

import json
import os
from typing import Any

from fxflops.report.formats import ENCODING_ERRORS
from fxflops.results import ROOT_LABEL, Estimate, Profile


def trace_events(profile: Profile) -> dict[str, Any]:
    """The trace as a dict: {"traceEvents": [...], "displayTimeUnit": ..., "otherData": {...}}; measured when
    the result was profiled, else the counted step (`counted_trace`)."""
    measurements = profile.measurements
    if measurements is None or "timeline" not in measurements.extra:
        if profile.nodes:
            return counted_trace(profile)
        raise ValueError("this result has no measured timeline and no counted ops; make it with fxflops.profile() "
                         "or fxflops.estimate()")
    track = f"{profile.model_type} on {measurements.device} ({measurements.device_name})"
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": track}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": f"forward ({measurements.timer})"}},
    ]
    for row in measurements.extra["timeline"]:
        stats = profile.modules.get(row["module"])
        args: dict[str, Any] = {"module": row["module"] or ROOT_LABEL, "depth": row["depth"]}
        if stats is not None and stats.latency_calls:
            # The estimate is per module, not per call: an equal share per call is what we know.
            args["flops (per call)"] = stats.flops // stats.latency_calls
            args["macs (per call)"] = stats.macs // stats.latency_calls
        events.append({
            "name": f"{row['module'] or ROOT_LABEL} ({row['type']})",
            "cat": "module",
            "ph": "X",
            "ts": row["start"] * 1e6,  # trace-event times are microseconds
            "dur": row["duration"] * 1e6,
            "pid": 0,
            "tid": 0,
            "args": args,
        })
    starts: dict[str, float] = {}
    for row in measurements.extra["timeline"]:
        starts.setdefault(row["module"], row["start"])
    if profile.collectives:
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "collectives"}})
    for c in profile.collectives:  # at the start of the module's first (forward) call: what is timed
        name = c.module
        while name not in starts and name:
            name = name.rpartition(".")[0]
        events.append({"name": f"{c.op} ({c.phase})", "cat": "collective", "ph": "i", "s": "t",
                       "ts": starts.get(name, 0.0) * 1e6, "pid": 0, "tid": 1, "args": _collective_args(c)})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"model": profile.model_type, "device": measurements.device_name, "timer": measurements.timer},
    }


def _collective_args(c: Any) -> dict[str, Any]:
    return {"module": c.module or ROOT_LABEL, "phase": c.phase, "group": c.group_desc or c.group,
            "ranks": c.group_size, "dtype": c.dtype, "payload bytes": c.bytes, "wire bytes": c.wire_bytes}


def counted_trace(estimate: Estimate) -> dict[str, Any]:
    """The counted step in op order (1 µs per op): module runs with their FLOPs, collectives, memory."""
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
         "args": {"name": f"{estimate.model_type}: counted step, 1 us per op (order, not time)"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "modules"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "collectives"}},
    ]
    nodes = estimate.nodes
    open_runs: list[dict[str, Any]] = []  # the runs of the modules the current op is in, outermost first

    def close(keep: int, at: int) -> None:
        while len(open_runs) > keep:
            run = open_runs.pop()
            run["dur"] = at - run["ts"]
            events.append(run)

    for index, node in enumerate(nodes):
        path = _ancestry(node.module)
        keep = 0
        while keep < len(open_runs) and keep < len(path) and open_runs[keep]["args"]["module"] == (path[keep] or ROOT_LABEL) \
                and open_runs[keep]["args"]["phase"] == node.phase:
            keep += 1
        close(keep, index)
        for name in path[keep:]:
            stats = estimate.modules.get(name)
            open_runs.append({"name": f"{name or ROOT_LABEL} ({stats.type if stats else '?'}, {node.phase})",
                              "cat": node.phase, "ph": "X", "ts": index, "pid": 0, "tid": 0,
                              "args": {"module": name or ROOT_LABEL, "phase": node.phase, "flops": 0, "macs": 0, "ops": 0}})
        for run in open_runs:
            run["args"]["flops"] += node.flops
            run["args"]["macs"] += node.macs
            run["args"]["ops"] += 1
    close(0, len(nodes))
    position = {node.name: index for index, node in enumerate(nodes)}
    for c in estimate.collectives:
        events.append({"name": c.op, "cat": "collective", "ph": "X", "ts": position.get(c.node, 0), "dur": 1,
                       "pid": 0, "tid": 1, "args": _collective_args(c)})
    if estimate.memory is not None:
        last = None
        for point in estimate.memory.timeline:  # at its op (the start before the first, the optimizer step after)
            values = dict(point.by_kind)
            if values != last:
                at = position.get(point.node, 0 if point.index == 0 else len(nodes))
                events.append({"name": "memory (tensor bytes)", "ph": "C", "ts": at, "pid": 0, "args": values})
                last = values
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"model": estimate.model_type, "counted": "one microsecond per op: an order, not a time"}}


def _ancestry(module: str) -> list[str]:
    """"" and each prefix of `module`, outermost first: the modules an op of `module` runs in."""
    path = [""]
    if module:
        parts = module.split(".")
        path += [".".join(parts[:end]) for end in range(1, len(parts) + 1)]
    return path


def write_chrome_trace(profile: Profile, path: str | os.PathLike[str]) -> None:
    """Write the trace to `path` (open it in chrome://tracing or ui.perfetto.dev)."""
    with open(path, "w", encoding="utf-8", errors=ENCODING_ERRORS) as out:
        json.dump(trace_events(profile), out)
