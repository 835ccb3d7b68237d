"""The HTML report's data: the icicle's folded module tree and the metrics that size it.

Numbers are formatted here, by the text report's functions; the page's script only lays them out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fxflops.report import fold as folding
from fxflops.report.formats import (
    bytes_to_string,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
    percent,
    shared_to_string,
)
from fxflops.results import ROOT_LABEL, Estimate, ModuleStats


@dataclass(frozen=True)
class Metric:
    """One way to size the icicle: a per-module value and how to print it."""

    key: str
    label: str
    value: Callable[[Estimate, str], float]
    text: Callable[[float], str]


def _predicted(estimate: Estimate, name: str) -> float:
    predicted = estimate.prediction.modules.get(name)
    return predicted.latency if predicted is not None else 0.0


# MACs and FLOPs are the forward's, as in the text report; with a counted backward it has its own.
_METRICS = (
    Metric("macs", "MACs", lambda e, n: e.modules[n].fwd_macs, macs_to_string),
    Metric("flops", "FLOPs", lambda e, n: e.modules[n].fwd_flops, number_to_string),
    Metric("params", "params", lambda e, n: e.modules[n].params, params_to_string),
    Metric("bwd_macs", "bwd MACs", lambda e, n: e.modules[n].bwd_macs, macs_to_string),
    Metric("bwd_flops", "bwd FLOPs", lambda e, n: e.modules[n].bwd_flops, number_to_string),
    Metric("bytes", "bytes moved", lambda e, n: e.modules[n].bytes, bytes_to_string),
    Metric("latency", "measured latency", lambda e, n: e.modules[n].latency or 0.0, duration_to_string),
    Metric("predicted", "predicted latency", _predicted, duration_to_string),
)


def metrics_of(estimate: Estimate) -> list[Metric]:
    """The metrics this estimate has numbers for, in the order the page offers them."""
    present = {
        "bwd_macs": estimate.backward,
        "bwd_flops": estimate.backward,
        "bytes": estimate.total_bytes > 0,
        "latency": timed(estimate),
        "predicted": estimate.prediction is not None,
    }
    metrics = [metric for metric in _METRICS if present.get(metric.key, True)]
    if estimate.backward:  # say which pass the plain names stand for
        metrics = [dataclasses.replace(m, label=forward_prefix(estimate) + m.label) if m.key in ("macs", "flops")
                   else m for m in metrics]
    return metrics


def timed(estimate: Estimate) -> bool:
    """Whether any module carries a measured latency (a profile)."""
    return any(stats.latency is not None for stats in estimate.modules.values())


def forward_prefix(estimate: Estimate) -> str:
    """MACs and FLOPs are the forward's; with a counted backward the labels say so."""
    return "fwd " if estimate.backward else ""


def unknown_modules(estimate: Estimate) -> dict[str, list[str]]:
    """Module -> the unknown ops it ran itself."""
    found: dict[str, list[str]] = {}
    for unknown in estimate.unknown:
        for module in unknown.modules:
            found.setdefault(estimate.aliases.get(module, module), []).append(unknown.op)
    return found


def icicle_groups(estimate: Estimate, metrics: list[Metric], fold: bool) -> list[dict[str, Any]]:
    """The folded module tree, pre-order, each entry with its children's indices and its values
    summed over the instances it stands for (so a folded run is as wide as all its layers)."""
    unknown = unknown_modules(estimate)
    explained = _explanations(estimate)
    groups: list[dict[str, Any]] = []
    path: list[int] = []  # indices of the entries from the root down to the last one made
    for group, _ in folding.walk(estimate, fold=fold):
        stats = folding.stats_of(estimate, group)
        del path[group.depth:]
        if path:
            groups[path[-1]]["children"].append(len(groups))
        path.append(len(groups))
        groups.append({
            "name": group.name,
            "label": group.label or ROOT_LABEL,
            "type": stats.type,
            "count": group.count,
            "n": len(group.names),
            "v": [_finite(sum(m.value(estimate, name) for name in group.names)) for m in metrics],
            "info": _info(estimate, group, stats, metrics),
            "unknown": sorted({op for name in group.names for op in unknown.get(name, [])}),
            "explain": explained.get(group.names[0], ""),
            "children": [],
        })
    return groups


def _explanations(estimate: Estimate) -> dict[str, str]:
    """Module -> the explanation of its own ops, shown when it is clicked ({} without a capture)."""
    if getattr(estimate, "source", None) is None:
        return {}
    from fxflops.explain import explain_own
    from fxflops.rules import RuleEvaluationError

    try:
        explained = explain_own(estimate)
    except (RuleEvaluationError, ValueError):  # the page shows the numbers; only the explanations are lost
        return {}
    # without source lines: the page is a function of the model, not of where estimate() was called
    return {name: explanation.text(sources=False) for name, explanation in explained.items()}


def _info(estimate: Estimate, group: folding.Group, stats: ModuleStats, metrics: list[Metric]) -> list[list[str]]:
    """What hovering an entry shows: one instance's numbers, and the folded total."""
    rows = [["module", group.name or ROOT_LABEL], ["type", stats.type]]
    if len(group.names) > 1:
        rows.append(["instances", f"{len(group.names)} identical ({_span(group.names)}); numbers are per instance"])
    fwd = forward_prefix(estimate)
    rows += [
        ["params", f"{params_to_string(stats.params)} ({percent(stats.params, estimate.total_params)})"],
        *([["tied params", f"{shared_to_string(stats.shared)} (counted there)"]] if stats.shared else []),
        [f"{fwd}MACs", f"{macs_to_string(stats.fwd_macs)} ({percent(stats.fwd_macs, estimate.fwd_macs)})"],
        [f"{fwd}FLOPs", f"{number_to_string(stats.fwd_flops)} ({percent(stats.fwd_flops, estimate.fwd_flops)})"],
    ]
    if estimate.backward:
        ratio = stats.bwd_fwd_ratio
        rows.append(["bwd MACs", f"{macs_to_string(stats.bwd_macs)} ({percent(stats.bwd_macs, estimate.bwd_macs)})"])
        rows.append(["bwd FLOPs", f"{number_to_string(stats.bwd_flops)} ({percent(stats.bwd_flops, estimate.bwd_flops)})"
                     + ("" if ratio is None else f", {ratio:.2f}x fwd")])
    if stats.bytes:
        rows.append(["bytes moved", bytes_to_string(stats.bytes)])
        rows.append(["FLOPs per byte", f"{stats.intensity:.2f}"])
    latency = folding.mean_latency(estimate, group)
    if latency is not None:
        rows.append(["measured latency", duration_to_string(latency)])
        if latency:
            rows.append(["achieved", flops_to_string(stats.fwd_flops / latency)])
    if estimate.prediction is not None and group.name in estimate.prediction.modules:
        predicted = estimate.prediction.modules[group.name]
        rows.append(["predicted latency", f"{duration_to_string(predicted.latency)}, {predicted.bound}-bound"])
    if stats.calls > 1:
        rows.append(["calls", str(stats.calls)])
    also = sorted(alias for alias, name in estimate.aliases.items() if name in group.names)
    if also:
        rows.append(["also called as", ", ".join(also)])
    if stats.extra_repr:
        rows.append(["config", " ".join(stats.extra_repr.split())])
    if len(group.names) > 1:
        totals = ", ".join(f"{m.text(sum(m.value(estimate, n) for n in group.names))} {m.label}"
                           for m in metrics if m.key in ("macs", "params"))
        rows.append([f"all {len(group.names)}", totals])
    return rows


def _finite(value: float) -> float:
    """JSON has no NaN or infinity, and the page's parser would refuse the whole data for one."""
    return value if math.isfinite(value) else 0


def _span(names: tuple[str, ...]) -> str:
    """`h.0.mlp … h.11.mlp`: the first and last instance."""
    return f"{names[0]} \u2026 {names[-1]}"
