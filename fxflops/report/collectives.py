"""The text report's collectives section: what the counted rank sends per step, by phase, kind and group."""

from __future__ import annotations

from tabulate import tabulate

from fxflops.report.formats import bytes_to_string
from fxflops.report.text_layout import _row
from fxflops.results import ROOT_LABEL, Estimate


def collective_lines(estimate: Estimate) -> list[str]:
    """Totals, then one row per (phase, collective, process group): calls, payload and wire bytes,
    and the modules that call it. Nothing without collectives."""
    if not estimate.collectives:
        return []
    lines = ["", "Collectives of this rank per step (payload = the buffer per rank; wire = bytes sent, ring algorithms):",
             _row("collective calls:", f"{len(estimate.collectives):,}"),
             _row("payload bytes:", f"{bytes_to_string(estimate.collective_bytes)} ({estimate.collective_bytes:,} B)"),
             _row("wire bytes:", f"{bytes_to_string(estimate.collective_wire_bytes)} "
                                 f"({estimate.collective_wire_bytes:,} B)")]
    modules: dict[tuple, list[str]] = {}
    for c in estimate.collectives:
        names = modules.setdefault((c.phase, c.op, c.group_desc or c.group, c.group_size), [])
        if (c.module or ROOT_LABEL) not in names:
            names.append(c.module or ROOT_LABEL)
    totals = estimate.collective_totals(("phase", "op", "group_desc", "group_size"))
    rows = []
    for key, total in totals.items():
        names = modules.get(key, [])
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} modules)" if len(names) > 3 else "")
        rows.append([key[0], key[1], key[2], key[3], total["count"], bytes_to_string(total["bytes"]),
                     bytes_to_string(total["wire_bytes"]), shown])
    lines.append(tabulate(rows, headers=["phase", "collective", "group", "ranks", "calls", "payload", "wire", "modules"],
                          tablefmt="simple"))
    return lines
