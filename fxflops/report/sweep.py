"""Rendering of sweeps: a table of the points with their top modules, the formulas; JSON and CSV.

JSON schema `fxflops.sweep`, version 1 — top-level object:

    schema, schema_version, fxflops_version, torch_version
    model_type        str
    sizes             [str]       the named sizes
    example           {name: int} the example inputs' sizes
    formulas          [{"macs": str, "flops": str, "params": str (, "bwd_macs", "bwd_flops"),
                        "holds_for": [str], "conditions": [[str]]}]: sympy syntax in the sizes' names
                      (floor(), ceiling(), Mod() for integer division), one entry per distinct
                      formula, with where it holds: one line per capture, and per capture every
                      condition of its path (all hold); the first holds at the example's sizes
    captures          int         captures made (more than one where a size changes the path)
    points            [{"sizes": {name: int}, "macs", "flops", "params", "bwd_macs", "bwd_flops",
                        "cautions": [str] (what a real forward would do differently there),
                        "top_modules": [{"name", "type", "macs", "flops", "share"}]}]

CSV: one row per point: the sizes, then macs, flops, params, bwd_macs, bwd_flops.
"""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from tabulate import tabulate

from fxflops.report.formats import macs_to_string, number_to_string, params_to_string
from fxflops.results import Estimate, ModuleStats, SweepResult

SCHEMA = "fxflops.sweep"
SCHEMA_VERSION = 1


def top_modules(estimate: Estimate, depth: int, top: int) -> list[ModuleStats]:
    """The `top` modules at `depth` (the deepest there is, if the model is shallower) by MACs."""
    deepest = max(stats.depth for stats in estimate.modules.values())
    level = min(max(depth, 1), deepest) if deepest else 0
    found = [stats for stats in estimate.modules.values() if stats.depth == level]
    return sorted(found, key=lambda stats: (-stats.macs, stats.name))[:max(top, 0)]


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def render_text(result: SweepResult, depth: int = 1, top: int = 3, tablefmt: str = "github") -> str:
    backward = any(estimate.backward for _, estimate in result.points)
    headers = [*result.names, "MACs", "FLOPs", "params"] + (["bwd FLOPs"] if backward else [])
    headers += [f"top modules (depth {depth})"] if top > 0 else []
    rows = []
    for sizes, estimate in result.points:
        row = [sizes[name] for name in result.names]
        row += [macs_to_string(estimate.total_macs), number_to_string(estimate.total_flops),
                params_to_string(estimate.total_params)]
        row += [number_to_string(estimate.bwd_flops)] if backward else []
        if top > 0:
            row.append(", ".join(f"{m.name} {_share(m.macs, estimate.total_macs):.0%}"
                                 for m in top_modules(estimate, depth, top)))
        rows.append(row)
    lines = [f"fxflops sweep: {result.model_type} over {', '.join(result.names)} "
             f"({len(result.points)} point{'s' if len(result.points) != 1 else ''}, "
             f"{result.captures} capture{'s' if result.captures != 1 else ''})", ""]
    lines.append(tabulate(rows, headers=headers, tablefmt=tablefmt, disable_numparse=True))
    lines += ["", *(f"caution: {caution}" for caution in result.cautions)] if result.cautions else []
    for entry in result.formulas:
        # pieces merged for one formula often state their regions alike: say each once
        lines += ["", f"formulas, where {' or '.join(dict.fromkeys(entry.holds_for))}:"]
        width = max(len(name) for name in entry.formulas)
        lines += [f"  {name:<{width}} = {formula}" for name, formula in entry.formulas.items()]
    return "\n".join(lines) + "\n"


def to_dict(result: SweepResult, depth: int = 1, top: int = 3) -> dict[str, Any]:
    import torch

    import fxflops

    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "fxflops_version": fxflops.__version__,
        "torch_version": torch.__version__,
        "model_type": result.model_type,
        "sizes": list(result.names),
        "example": dict(result.example),
        "formulas": [{**entry.formulas, "holds_for": list(entry.holds_for), "conditions": list(entry.conditions)}
                     for entry in result.formulas],
        "captures": result.captures,
        "points": [_point(sizes, estimate, depth, top) for sizes, estimate in result.points],
    }


def _point(sizes: dict[str, int], estimate: Estimate, depth: int, top: int) -> dict[str, Any]:
    return {
        "sizes": dict(sizes),
        "macs": estimate.total_macs,
        "flops": estimate.total_flops,
        "params": estimate.total_params,
        "bwd_macs": estimate.bwd_macs,
        "bwd_flops": estimate.bwd_flops,
        "cautions": list(estimate.cautions),
        "top_modules": [
            {"name": m.name, "type": m.type, "macs": m.macs, "flops": m.flops,
             "share": _share(m.macs, estimate.total_macs)}
            for m in top_modules(estimate, depth, top)
        ],
    }


def to_json(result: SweepResult, depth: int = 1, top: int = 3) -> str:
    return json.dumps(to_dict(result, depth, top), indent=2) + "\n"


def to_csv(result: SweepResult) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([*result.names, "macs", "flops", "params", "bwd_macs", "bwd_flops"])
    for sizes, estimate in result.points:
        writer.writerow([*(sizes[name] for name in result.names), estimate.total_macs, estimate.total_flops,
                         estimate.total_params, estimate.bwd_macs, estimate.bwd_flops])
    return buffer.getvalue()
