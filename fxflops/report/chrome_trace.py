"""Chrome / Perfetto trace (JSON trace-event format) of one profiled step's module timeline.

Each forward call of a module becomes a complete ("X") event; nesting comes from the times, so
chrome://tracing and ui.perfetto.dev draw the module hierarchy as stacked bars. The timeline is
the median step of the hooked pass (`Measurements.extra["timeline"]`).
"""

from __future__ import annotations

import json
import os
from typing import Any

from fxflops.report.formats import ENCODING_ERRORS
from fxflops.results import ROOT_LABEL, Profile


def trace_events(profile: Profile) -> dict[str, Any]:
    """The trace as a dict: {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}."""
    measurements = profile.measurements
    if measurements is None or "timeline" not in measurements.extra:
        raise ValueError("this result has no measured timeline; make it with fxflops.profile()")
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
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"model": profile.model_type, "device": measurements.device_name, "timer": measurements.timer},
    }


def write_chrome_trace(profile: Profile, path: str | os.PathLike[str]) -> None:
    """Write the trace to `path` (open it in chrome://tracing or ui.perfetto.dev)."""
    with open(path, "w", encoding="utf-8", errors=ENCODING_ERRORS) as out:
        json.dump(trace_events(profile), out)
