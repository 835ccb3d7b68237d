"""The HTML report's sections on the step as one rank runs it: memory over time (with memory=) and the
collectives it calls (in a parallel job). Each returns markup for fxflops.report.html's template, every
text in it escaped here; none when the estimate has nothing to show."""

from __future__ import annotations

import re
from html import escape

from fxflops.report.formats import bytes_to_string
from fxflops.report.html_sections import _cell, _table
from fxflops.report.memory_text import memory_to_string
from fxflops.results import ROOT_LABEL, Estimate


def memory_section(estimate: Estimate) -> str:
    """The memory-over-time plot and the model states (none without memory=)."""
    memory = estimate.memory
    if memory is None:
        return ""
    from fxflops.report.memory_plot import memory_svg

    svg = memory_svg(estimate.model_type, memory)
    svg = re.sub(r'\s+xmlns="[^"]*"', "", svg, count=1)  # inline SVG needs no namespace reference
    states = ", ".join(f"{kind} {memory_to_string(size)}" for kind, size in memory.model_states.items() if size)
    fits = ""
    if memory.capacity is not None:
        fits = (f"; fits on {memory.device}, {memory_to_string(memory.headroom)} headroom" if memory.fits else
                f"; does not fit on {memory.device}: {memory_to_string(-memory.headroom)} over")
    note = (f"Tensor bytes of this rank (allowance apart: +{memory_to_string(memory.allowance_bytes.total)}"
            f"{fits}). Model states: {states or 'none'}.")
    return (f'<section id="memory"><h2>Memory over the step</h2><p class="hint">{escape(note)}</p>'
            f'<div class="roofline">{svg}</div></section>')


def collectives_section(estimate: Estimate) -> str:
    """One row per (phase, collective, process group) of this rank's step (none without collectives)."""
    if not estimate.collectives:
        return ""
    totals = estimate.collective_totals(("phase", "op", "group_desc", "group_size"))
    modules: dict[tuple, list[str]] = {}
    for c in estimate.collectives:
        names = modules.setdefault((c.phase, c.op, c.group_desc or c.group, c.group_size), [])
        if (c.module or ROOT_LABEL) not in names:
            names.append(c.module or ROOT_LABEL)
    rows = []
    for key, total in totals.items():
        names = modules.get(key, [])
        rows.append("<tr>" + "".join([
            _cell(key[0]), _cell(key[1]), _cell(str(key[2])), _cell(str(key[3]), key[3]),
            _cell(str(total["count"]), total["count"]), _cell(bytes_to_string(total["bytes"]), total["bytes"]),
            _cell(bytes_to_string(total["wire_bytes"]), total["wire_bytes"]),
            _cell(", ".join(names[:4]) + (f", ... ({len(names)} modules)" if len(names) > 4 else ""))]) + "</tr>")
    headers = [("phase", False), ("collective", False), ("group", False), ("ranks", True), ("calls", True),
               ("payload", True), ("wire", True), ("modules", False)]
    note = (f"{len(estimate.collectives):,} calls of this rank per step: payload "
            f"{bytes_to_string(estimate.collective_bytes)}, wire {bytes_to_string(estimate.collective_wire_bytes)} "
            "(bytes sent, ring algorithms).")
    return (f'<section id="collectives"><h2>Collectives</h2><p class="hint">{escape(note)}</p>'
            f'<div class="scroll">{_table("collective-table", headers, rows)}</div></section>')
