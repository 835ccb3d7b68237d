"""Tables through tabulate: cost per op (or per rule) and per module.

`tablefmt` is any tabulate format ("github", "plain", "simple", "grid", ...). With `raw=True`
the cells hold plain integers and seconds instead of human-formatted text.
"""

from __future__ import annotations

from tabulate import tabulate

from fxflops.report import fold as folding
from fxflops.report.memory_text import memory_to_string
from fxflops.report.formats import (
    printable,
    bytes_to_string,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
    shared_to_string,
    percent,
)
from fxflops.results import ROOT_LABEL, Estimate, OpTotals


def _op_totals(estimate: Estimate, by: str) -> dict[str, OpTotals]:
    if by not in ("op", "rule"):
        raise ValueError(f"op_table: by must be 'op' or 'rule', not {by!r}")
    # both are totals over every node, unknown ones included (under their op, or UNKNOWN_RULE)
    return dict(estimate.by_op if by == "op" else estimate.by_rule)


def op_rows(estimate: Estimate, by: str = "op", raw: bool = False) -> tuple[list[str], list[list]]:
    """(headers, rows) of the per-op (or per-rule) table, heaviest first, with a total row."""
    totals = _op_totals(estimate, by)
    statuses = estimate.statuses(by)
    ordered = sorted(totals.items(), key=lambda item: (-item[1].macs, -item[1].flops, item[0]))
    headers = [by, "status", "count", "MACs", "% MACs", "FLOPs", "% FLOPs"]
    if estimate.backward:  # MACs and FLOPs are forward + backward; these say how much is backward
        headers += ["bwd MACs", "bwd FLOPs"]
    rows = [
        _op_row(key, statuses.get(key, ""), value, estimate, raw) for key, value in ordered
    ]
    count = sum(value.count for value in totals.values())
    total = OpTotals(count=count, macs=estimate.total_macs, flops=estimate.total_flops,
                     bwd_macs=estimate.bwd_macs, bwd_flops=estimate.bwd_flops)
    rows.append(_op_row("total", "", total, estimate, raw))
    return headers, rows


def _op_row(key: str, status: str, value: OpTotals, estimate: Estimate, raw: bool) -> list:
    macs = value.macs if raw else macs_to_string(value.macs)
    flops = value.flops if raw else number_to_string(value.flops)
    row = [
        key,
        status,
        value.count,
        macs,
        percent(value.macs, estimate.total_macs),
        flops,
        percent(value.flops, estimate.total_flops),
    ]
    if estimate.backward:
        row += [value.bwd_macs if raw else macs_to_string(value.bwd_macs),
                value.bwd_flops if raw else number_to_string(value.bwd_flops)]
    return row


def op_table(
    estimate: Estimate, by: str = "op", tablefmt: str = "github", raw: bool = False
) -> str:
    """Cost per op type (`by="op"`) or per rule (`by="rule"`): count, MACs, % MACs, FLOPs."""
    headers, rows = op_rows(estimate, by, raw)
    return tabulate(rows, headers=headers, tablefmt=tablefmt, disable_numparse=True)


def _display_name(parent: str, group: folding.Group) -> str:
    """Qualified name with folded runs shown as `[0-11]`."""
    part = f"[{group.label}]" if group.folded else group.label
    return f"{parent}.{part}" if parent else part


def module_rows(
    estimate: Estimate, module_depth: int = -1, fold: bool = True, raw: bool = False
) -> tuple[list[str], list[list]]:
    """(headers, rows) of the per-module table in tree order; folded runs are one row."""
    measured = any(stats.latency is not None for stats in estimate.modules.values())
    headers = ["module", "type", "count", "params", "% params", "MACs", "% MACs", "FLOPs"]
    headers += ["% FLOPs", "calls"]
    if estimate.backward:  # MACs and FLOPs are forward + backward
        headers += ["bwd MACs", "bwd FLOPs", "bwd/fwd"]
    if measured:
        headers += ["latency", "% latency", "FLOPS"]
    bwd_timed = measured and any(stats.bwd_latency is not None for stats in estimate.modules.values())
    if bwd_timed:
        headers += ["bwd latency", "bwd FLOPS"]
    headers += ["bytes", "flops/byte"]
    if estimate.prediction is not None:
        headers += ["predicted", "bound"] + (["measured/predicted"] if measured else [])
    peaks = estimate.memory.module_peaks if estimate.memory is not None else None
    if peaks is not None:  # with memory=: the highest tensor bytes while it runs (folded: its highest instance)
        headers += ["peak memory"]
    tied = any(stats.shared for stats in estimate.modules.values())
    if tied:  # params count a tied weight once, at its first owner: the others name it here
        headers += ["tied params (counted at)"]
    total_latency = folding.root_latency(estimate)
    display: dict[tuple[str, ...], str] = {}
    rows = []
    for group, children in folding.walk(estimate, fold, module_depth):
        name = display.get(group.names, ROOT_LABEL if group.depth == 0 else group.label)
        for child in children:
            display[child.names] = _display_name("" if group.depth == 0 else name, child)
        row = _module_row(estimate, group, name, measured, total_latency, raw, bwd_timed)
        if peaks is not None:
            peak = max((peaks[member] for member in group.names if member in peaks), default=None)
            row.append(peak if raw or peak is None else memory_to_string(peak))
        if tied:
            row.append(shared_to_string(folding.stats_of(estimate, group).shared))
        rows.append(row)
    return headers, rows


def _module_row(
    estimate: Estimate,
    group: folding.Group,
    name: str,
    measured: bool,
    total_latency: float | None,
    raw: bool,
    bwd_timed: bool = False,
) -> list:
    stats = folding.stats_of(estimate, group)
    row = [
        printable(name, keep=""),  # a newline in a name would make a row of its own (tabulate splits cells)
        printable(stats.type, keep=""),
        group.count,
        stats.params if raw else params_to_string(stats.params),
        percent(stats.params, estimate.total_params),
        stats.macs if raw else macs_to_string(stats.macs),
        percent(stats.macs, estimate.total_macs),
        stats.flops if raw else number_to_string(stats.flops),
        percent(stats.flops, estimate.total_flops),
        stats.calls,
    ]
    if estimate.backward:
        ratio = stats.bwd_fwd_ratio
        row += [stats.bwd_macs if raw else macs_to_string(stats.bwd_macs),
                stats.bwd_flops if raw else number_to_string(stats.bwd_flops),
                ratio if raw or ratio is None else f"{ratio:.2f}"]
    if measured:
        latency = folding.mean_latency(estimate, group)
        rate = stats.fwd_flops / latency if latency else None
        row += [
            latency if raw or latency is None else duration_to_string(latency),
            percent(latency, total_latency),
            rate if raw or rate is None else flops_to_string(rate),
        ]
    if bwd_timed:
        bwd = stats.bwd_latency
        bwd_rate = stats.achieved_bwd_flops
        row += [bwd if raw or bwd is None else duration_to_string(bwd),
                bwd_rate if raw or bwd_rate is None else flops_to_string(bwd_rate)]
    intensity = stats.intensity
    row += [stats.bytes if raw else bytes_to_string(stats.bytes),
            intensity if raw or intensity is None else f"{intensity:.2f}"]
    if estimate.prediction is not None:
        row += _predicted_cells(estimate, group, measured, raw)
    return row


def _predicted_cells(estimate: Estimate, group: folding.Group, measured: bool, raw: bool) -> list:
    predicted = estimate.prediction.modules.get(group.name)
    if predicted is None:
        return [None, None] + ([None] if measured else [])
    cells = [predicted.latency if raw else duration_to_string(predicted.latency), predicted.bound]
    if measured:
        latency = folding.mean_latency(estimate, group)
        ratio = latency / predicted.latency if latency and predicted.latency else None
        cells.append(ratio if raw or ratio is None else f"{ratio:.2f}x")
    return cells


def module_table(
    estimate: Estimate,
    module_depth: int = -1,
    fold: bool = True,
    tablefmt: str = "github",
    raw: bool = False,
) -> str:
    """One row per module (folded runs of identical numbered repeats are one row with a count)."""
    headers, rows = module_rows(estimate, module_depth, fold, raw)
    return tabulate(rows, headers=headers, tablefmt=tablefmt, disable_numparse=True)


def tables(
    estimate: Estimate,
    module_depth: int = -1,
    fold: bool = True,
    tablefmt: str = "github",
    raw: bool = False,
) -> str:
    """The per-rule, per-op and per-module tables, each under a title."""
    sections = [
        ("Cost per rule", op_table(estimate, "rule", tablefmt, raw)),
        ("Cost per op", op_table(estimate, "op", tablefmt, raw)),
        ("Cost per module", module_table(estimate, module_depth, fold, tablefmt, raw)),
    ]
    return printable("\n\n".join(f"{title}\n\n{table}" for title, table in sections) + "\n")
