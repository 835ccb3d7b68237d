"""A plan search drawn: predicted step time against predicted memory per rank, one dot per plan, the frontier
(the plans no other plan beats on both) joined by a line, the device's memory as a dashed line.

A self-contained HTML page with one inline SVG (no script, no dependency), as `fxflops plan --html` writes it.
"""

from __future__ import annotations

import html
import math
from typing import Any

GiB = 1 << 30
COLOURS = {"fits": "#4e79a7", "dropped": "#bab0ac", "frontier": "#e15759", "capacity": "#59a14f"}


def frontier_rows(rows: list[Any]) -> list[Any]:
    """The plans no other plan beats on both step time and memory (ties: the first seen), by memory rising."""
    found, best_time = [], math.inf
    for row in sorted(rows, key=lambda r: (r.peak_bytes, r.step_time)):
        if row.step_time < best_time:
            found.append(row)
            best_time = row.step_time
    return found


def describe(row: Any) -> str:
    """One plan in a line: degrees, micro-batch, recomputation, time, memory."""
    p = row.plan
    return (f"tp={p.tp} pp={p.pp} v={p.virtual_stages} dp={p.dp}{' FSDP' if p.fsdp else ''}"
            f"{' SP' if p.sequence_parallel else ''} mb={p.micro_batch} recompute={p.recompute}: "
            f"{row.step_time:.3f} s, {row.peak_bytes / GiB:.1f} GiB")


def frontier_html(search: Any, width: int = 900, height: int = 520) -> str:
    """The search as an HTML page: its summary, then the scatter of every plan evaluated (step time over memory
    per rank), the frontier of the plans that fit, and the device's memory."""
    rows, dropped = list(search.rows), list(search.dropped)
    every = rows + dropped
    left, right, top, bottom = 70, 20, 20, 50
    plot_w, plot_h = width - left - right, height - top - bottom
    mems = [r.peak_bytes / GiB for r in every] + [search.capacity / GiB]
    times = [r.step_time for r in every] or [1.0]
    x_max = max(mems) * 1.05 or 1.0
    y_max = max(times) * 1.05 or 1.0

    def x(gib: float) -> float:
        return left + gib / x_max * plot_w

    def y(seconds: float) -> float:
        return top + plot_h - seconds / y_max * plot_h

    shapes = [f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="black"/>',
              f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="black"/>']
    for i in range(6):  # ticks: five steps on each axis
        gx, sy = x_max * i / 5, y_max * i / 5
        shapes.append(f'<text x="{x(gx):.1f}" y="{top + plot_h + 16}" font-size="11" text-anchor="middle">{gx:.3g}</text>')
        shapes.append(f'<text x="{left - 6}" y="{y(sy) + 4:.1f}" font-size="11" text-anchor="end">{sy:.3g}</text>')
    shapes.append(f'<text x="{left + plot_w / 2}" y="{height - 8}" font-size="12" text-anchor="middle">'
                  "predicted memory of the fullest rank (GiB, allowance included)</text>")
    shapes.append(f'<text x="14" y="{top + plot_h / 2}" font-size="12" text-anchor="middle" '
                  f'transform="rotate(-90 14 {top + plot_h / 2})">predicted step time (s)</text>')
    cap = x(search.capacity / GiB)
    shapes.append(f'<line x1="{cap:.1f}" y1="{top}" x2="{cap:.1f}" y2="{top + plot_h}" stroke="{COLOURS["capacity"]}" '
                  f'stroke-width="2" stroke-dasharray="6 4"><title>{html.escape(search.device)}: '
                  f'{search.capacity / GiB:.0f} GiB</title></line>')
    for kind, group in (("dropped", dropped), ("fits", rows)):
        for row in group:
            shapes.append(f'<circle cx="{x(row.peak_bytes / GiB):.1f}" cy="{y(row.step_time):.1f}" r="3" '
                          f'fill="{COLOURS[kind]}"><title>{html.escape(describe(row))}</title></circle>')
    front = frontier_rows(rows)
    if front:
        points = " ".join(f"{x(r.peak_bytes / GiB):.1f},{y(r.step_time):.1f}" for r in front)
        shapes.append(f'<polyline points="{points}" fill="none" stroke="{COLOURS["frontier"]}" stroke-width="2"/>')
        for row in front:
            shapes.append(f'<circle cx="{x(row.peak_bytes / GiB):.1f}" cy="{y(row.step_time):.1f}" r="5" '
                          f'fill="{COLOURS["frontier"]}"><title>frontier: {html.escape(describe(row))}</title></circle>')
    legend = " ".join(f'<span style="color:{colour}">&#9679;</span> {html.escape(name)}' for name, colour in (
        ("plan that fits", COLOURS["fits"]), ("plan that does not fit", COLOURS["dropped"]),
        ("frontier (fastest for its memory)", COLOURS["frontier"]), ("device memory", COLOURS["capacity"])))
    summary = html.escape(search.render(10)).replace("\n", "<br>")
    table = "".join(f"<li>{html.escape(describe(r))}</li>" for r in front)
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>fxflops plan search</title></head>'
            f'<body style="font-family: sans-serif"><p>{legend}</p>'
            f'<svg width="{width}" height="{height}">{"".join(shapes)}</svg>'
            f'<h3>The frontier</h3><ul style="font-family: monospace; font-size: 12px">{table}</ul>'
            f'<p style="font-family: monospace; font-size: 12px">{summary}</p></body></html>')
