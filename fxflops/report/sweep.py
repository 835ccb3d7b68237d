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

The points come before the formulas and captures, one a line: a grid is written as its points are
counted (`write_json`, `write_csv`), so its size costs no memory.

CSV: one row per point: the sizes, then macs, flops, params, and bwd_macs, bwd_flops with a backward.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TextIO

from tabulate import tabulate

from fxflops.report.formats import csv_cell, macs_to_string, number_to_string, params_to_string, printable
from fxflops.results import Estimate, ModuleStats, SweepFormula, SweepPoint, SweepResult

SCHEMA = "fxflops.sweep"
SCHEMA_VERSION = 1

Grid = Mapping[str, Iterable[int]] | Iterable[Mapping[str, int]]


def top_modules(estimate: Estimate, depth: int, top: int) -> list[ModuleStats]:
    """The `top` modules at `depth` (the deepest there is, if the model is shallower) by MACs."""
    deepest = max(stats.depth for stats in estimate.modules.values())
    level = min(max(depth, 1), deepest) if deepest else 0
    found = [stats for stats in estimate.modules.values() if stats.depth == level]
    return sorted(found, key=lambda stats: (-stats.macs, stats.name))[:max(top, 0)]


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def render_text(result: SweepResult, tablefmt: str = "github") -> str:
    """The points as a table (with their top modules, at the depth `Sweep.result` was given), then the formulas."""
    shown = any(point.top_modules for point in result.points)
    headers = [*result.names, "MACs", "FLOPs", "params"] + (["bwd FLOPs"] if result.backward else [])
    headers += [f"top modules (depth {result.depth})"] if shown else []
    rows = []
    for point in result.points:
        row = [point.sizes[name] for name in result.names]
        row += [macs_to_string(point.macs), number_to_string(point.flops), params_to_string(point.params)]
        row += [number_to_string(point.bwd_flops)] if result.backward else []
        if shown:
            row.append(", ".join(f"{m.name} {_share(m.macs, point.macs):.0%}" for m in point.top_modules))
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
    return printable("\n".join(lines) + "\n")


def to_dict(result: SweepResult) -> dict[str, Any]:
    return {**_head(result.model_type, result.names, result.example),
            "points": [point_record(point) for point in result.points],
            **_tail(result.formulas, result.captures)}


def point_record(point: SweepPoint) -> dict[str, Any]:
    """One point as the JSON report writes it."""
    return {
        "sizes": dict(point.sizes),
        "macs": point.macs,
        "flops": point.flops,
        "params": point.params,
        "bwd_macs": point.bwd_macs,
        "bwd_flops": point.bwd_flops,
        "cautions": list(point.cautions),
        "top_modules": [{"name": m.name, "type": m.type, "macs": m.macs, "flops": m.flops,
                         "share": _share(m.macs, point.macs)} for m in point.top_modules],
    }


def _head(model_type: str, names: Iterable[str], example: Mapping[str, int]) -> dict[str, Any]:
    import torch

    import fxflops

    return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "fxflops_version": fxflops.__version__,
            "torch_version": torch.__version__, "model_type": model_type, "sizes": list(names),
            "example": dict(example)}


def _tail(formulas: list[SweepFormula], captures: int) -> dict[str, Any]:
    return {"formulas": [{**entry.formulas, "holds_for": list(entry.holds_for),
                          "conditions": list(entry.conditions)} for entry in formulas],
            "captures": captures}


def _json_stream(stream: TextIO, head: dict[str, Any], points: Iterable[SweepPoint],
                 tail: Callable[[], dict[str, Any]]) -> None:
    """One JSON object: `head`'s entries, the points one a line as they come, then `tail()`'s entries
    (called after the last point: a point may add a capture)."""
    stream.write("{\n")
    for key, value in head.items():
        stream.write(f"  {json.dumps(key)}: {json.dumps(value)},\n")
    stream.write('  "points": [')
    for index, point in enumerate(points):
        stream.write(("," if index else "") + "\n    " + json.dumps(point_record(point)))
    stream.write("\n  ]")
    for key, value in tail().items():
        stream.write(f",\n  {json.dumps(key)}: {json.dumps(value)}")
    stream.write("\n}\n")


def to_json(result: SweepResult) -> str:
    buffer = io.StringIO()
    _json_stream(buffer, _head(result.model_type, result.names, result.example), result.points,
                 lambda: _tail(result.formulas, result.captures))
    return buffer.getvalue()


def write_json(swept: Any, grid: Grid, stream: TextIO, depth: int = 1, top: int = 3) -> None:
    """`to_json(swept.result(grid, depth, top))`, each point written as it is counted (`swept`: a Sweep)."""
    _json_stream(stream, _head(swept.model_type, swept.names, swept.example), swept.points(grid, depth, top),
                 lambda: _tail(swept.merged_formulas(), len(swept.pieces)))


def _csv_stream(stream: TextIO, names: Iterable[str], backward: bool, points: Iterable[SweepPoint]) -> None:
    names = list(names)
    writer = csv.writer(stream, lineterminator="\n")
    writer.writerow([csv_cell(name) for name in names] + ["macs", "flops", "params"]
                    + (["bwd_macs", "bwd_flops"] if backward else []))
    for point in points:
        writer.writerow([*(point.sizes[name] for name in names), point.macs, point.flops, point.params]
                        + ([point.bwd_macs, point.bwd_flops] if backward else []))


def to_csv(result: SweepResult) -> str:
    buffer = io.StringIO()
    _csv_stream(buffer, result.names, result.backward, result.points)
    return buffer.getvalue()


def write_csv(swept: Any, grid: Grid, stream: TextIO) -> None:
    """`to_csv(swept.result(grid))`, each row written as its point is counted (`swept`: a Sweep)."""
    _csv_stream(stream, swept.names, swept.backward, swept.points(grid, top=0))
