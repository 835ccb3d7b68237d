"""Measured latencies joined onto an Estimate by qualified module name: a Profile.

`join` copies the estimate (never mutating it), fills each module's forward (and backward) latency,
gives containers that never run themselves (ModuleList) their children's sum, and lists the modules
that ran but are not in the graph and the graph modules that got no latency.
"""

from __future__ import annotations

import dataclasses

from fxflops.results import Estimate, Measurements, ModuleStats, Profile


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
