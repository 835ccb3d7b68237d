"""The text report's aggregated profile: the top-k module types at every depth of the module tree.

Ranked by params, MACs (fwd and bwd when the backward is counted) and, when timed, forward latency,
each summed over the modules of that type at that depth, as DeepSpeed's aggregated profile shows them.
"""

from __future__ import annotations

from fxflops.report.formats import (
    duration_to_string,
    macs_to_string,
    params_to_string,
)
from fxflops.report.text_layout import _is_measured, _per, _rule_line
from fxflops.results import Estimate


def aggregate_by_type(estimate: Estimate) -> dict[int, dict[str, dict[str, float]]]:
    """depth -> module type -> summed params, macs and latency of the modules of that type."""
    table: dict[int, dict[str, dict[str, float]]] = {}
    for stats in estimate.modules.values():
        entry = table.setdefault(stats.depth, {}).setdefault(
            stats.type, {"params": 0, "macs": 0, "bwd_macs": 0, "latency": 0.0, "timed": 0}
        )
        entry["params"] += stats.params
        entry["macs"] += stats.fwd_macs
        entry["bwd_macs"] += stats.bwd_macs
        if stats.latency is not None:
            entry["latency"] += stats.latency
            entry["timed"] += 1
    return table


def _top(entries: dict[str, dict[str, float]], key: str, k: int, fmt) -> str:
    ranked = sorted(entries.items(), key=lambda item: item[1][key], reverse=True)[:k]
    return repr({name: fmt(values[key]) for name, values in ranked})


def aggregated_lines(estimate: Estimate, module_depth: int = -1, top_modules: int = 1) -> list[str]:
    """Top-k module types by params, MACs (and fwd latency when timed) at every depth."""
    per = _per(estimate.measurements)
    by_depth = aggregate_by_type(estimate)
    deepest = max(by_depth) if by_depth else 0
    if module_depth >= 0:
        deepest = min(deepest, module_depth)
    measured = _is_measured(estimate)
    what = "params, MACs or fwd latency" if measured else "params or MACs"
    if estimate.backward:
        what = "params, fwd MACs, bwd MACs or fwd latency" if measured else "params, fwd MACs or bwd MACs"
    lines = [
        _rule_line(f" Aggregated Profile{per} ", 86),
        f"Top {top_modules} modules in terms of {what} at different model depths:",
    ]
    for depth in range(deepest + 1):
        entries = by_depth.get(depth, {})
        lines.append(f"depth {depth}:")
        lines.append(f"    params      - {_top(entries, 'params', top_modules, params_to_string)}")
        label = "fwd MACs" if estimate.backward else "MACs"
        lines.append(f"    {label:<11} - {_top(entries, 'macs', top_modules, macs_to_string)}")
        if estimate.backward:
            lines.append(f"    bwd MACs    - {_top(entries, 'bwd_macs', top_modules, macs_to_string)}")
        if measured:
            timed = {name: values for name, values in entries.items() if values["timed"]}
            lines.append(
                f"    fwd latency - {_top(timed, 'latency', top_modules, duration_to_string)}"
            )
    return lines
