"""The text of a Comparison: totals per preset, each difference's causes, per-module and per-op tables,
and the real tools' own numbers beside ours when they were run."""

from __future__ import annotations

from typing import Any

from tabulate import tabulate

from fxflops.report.formats import macs_to_string, number_to_string, printable
from fxflops.results import ROOT_LABEL

MODULE_DEPTH = 2  # modules this deep or shallower get a row; `Comparison.modules` holds them all
MODULE_ROWS = 40


def comparison_text(comparison: Any, module_depth: int = MODULE_DEPTH, tables: bool = True) -> str:
    from fxflops.rules import preset

    ref = comparison.reference
    lines = [f"{comparison.model_type}: one capture counted under {len(comparison.presets)} presets "
             f"(differences against {ref}, the estimate's own)", ""]
    rows = []
    for name in comparison.presets:
        macs, flops = comparison.totals[name]
        preset_name = comparison.readings.get(name, (name, ""))[0]
        tool = (preset(preset_name).tool or "").split(":")[0].split(" (")[0] if preset_name == name else ""
        rows.append([name, f"{_exact(macs)} ({macs_to_string(_num(macs))})", f"{_exact(flops)} ({number_to_string(_num(flops))})",
                     _delta(flops - comparison.totals[ref][1]) if name != ref else "", tool])
    lines += tabulate(rows, headers=["preset", "MACs", "FLOPs", "FLOPs vs " + ref, "reproduces"],
                      tablefmt="simple", disable_numparse=True).splitlines()
    lines += ["", "Why each differs (every difference attributed; nothing left over):"]
    for name in comparison.presets:
        if name == ref:
            continue
        causes = comparison.causes[name]
        if not causes:
            lines.append(f"  {name}: the same count as {ref}")
            continue
        lines.append(f"  {name}:")
        for cause in causes:
            ops = ", ".join(cause.ops[:4]) + (f" (+{len(cause.ops) - 4})" if len(cause.ops) > 4 else "")
            lines.append(f"    {_delta(cause.macs)} MACs, {_delta(cause.flops)} FLOPs over {cause.calls} op calls: "
                         f"{cause.convention} [{ops}]")
        macs, flops = comparison.residue(name)
        if macs or flops:
            lines.append(f"    unexplained: {_delta(macs)} MACs, {_delta(flops)} FLOPs")
    if not tables:
        return printable("\n".join(lines))
    lines += ["", f"FLOPs per module (depth <= {module_depth}):"]
    lines += _table(_module_rows(comparison, module_depth), comparison.presets, "module")
    lines += ["", "FLOPs per op:"]
    op_rows = [(op, values) for op, values in comparison.ops.items() if any(v[1] for v in values.values())]
    op_rows.sort(key=lambda item: -_num(item[1][ref][1]))
    lines += _table(op_rows, comparison.presets, "op")
    if comparison.tools:
        lines += ["", "The tools themselves, run on the model:"]
        lines += tool_lines(comparison.tools)
    return printable("\n".join(lines))


def tool_lines(runs: list[Any]) -> list[str]:
    rows, notes = [], []
    for run in runs:
        if run.total is None:
            rows.append([run.tool, run.preset, "", "", run.status])
            continue
        predicted = run.predicted
        verdict = "equal" if predicted == run.total else f"differs by {_delta(run.total - predicted)}"
        rows.append([run.tool, run.preset, f"{run.total:,} {run.unit}", f"{_exact(predicted)}", verdict])
        alike: dict[tuple, list[str]] = {}  # the same miss in identical layers is one line
        for spot in run.blind_spots:
            alike.setdefault((spot.ops, spot.tool_flops, spot.convention_flops), []).append(spot.module or ROOT_LABEL)
        for (ops, theirs, ours), modules in alike.items():
            where = modules[0] + (f" and {len(modules) - 1} more like it" if len(modules) > 1 else "")
            notes.append(f"  {run.tool} counts {where} as {theirs:,} FLOPs where the {run.preset} convention "
                         f"gives {_exact(ours)}: a blind spot of the tool (ops there: {', '.join(ops) or 'none of its own'})")
    lines = tabulate(rows, headers=["tool", "preset", "its number", "our preset's", ""], tablefmt="simple",
                     disable_numparse=True).splitlines()
    return lines + notes


def _module_rows(comparison: Any, depth: int) -> list[tuple[str, dict]]:
    rows = []
    for name, values in comparison.modules.items():
        level = 0 if not name else name.count(".") + 1
        if level <= depth:
            label = f"{name or ROOT_LABEL} ({comparison.module_types.get(name, '')})"
            rows.append((label, values))
    return rows[:MODULE_ROWS]


def _table(rows: list[tuple[str, dict]], presets: tuple[str, ...], first: str) -> list[str]:
    body = [[label, *(number_to_string(_num(values[name][1])) for name in presets)] for label, values in rows]
    return tabulate(body, headers=[first, *presets], tablefmt="simple", disable_numparse=True).splitlines()


def _delta(value: Any) -> str:
    number = _num(value)
    sign = "+" if number > 0 else "-" if number < 0 else "±"
    return f"{sign}{abs(number):,.0f}" if isinstance(value, int) else f"{value}"


def _exact(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) else str(value)


def _num(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0
