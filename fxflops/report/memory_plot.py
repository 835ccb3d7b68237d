"""The memory-over-time picture: tensor bytes one rank holds at each op of the step (forward, backward,
optimizer step), stacked by kind, the phases marked along the top and the peak marked, as a
self-contained SVG (no plotting library), as the roofline is drawn.

The x axis is the step's ops in the order they run (not time: fxflops counts, it does not time). A long
step is drawn at most `COLUMNS` columns wide; each column shows its highest point, so the peak is
always drawn as it is.
"""

from __future__ import annotations

from html import escape
from typing import Any

from fxflops.memory.records import KINDS, OPTIMIZER_STEP, START, MemoryEstimate, Point
from fxflops.report.memory_text import memory_to_string

WIDTH, HEIGHT = 880, 380
LEFT, RIGHT, TOP, BOTTOM = 90, 160, 62, 46  # RIGHT: the legend
COLUMNS = 800
WIDE = 0.06  # of the plot's width, for the step's start and for the optimizer step
COLORS = {"parameters": "#4e79a7", "gathered": "#a0cbe8", "buffers": "#9c755f", "gradients": "#f28e2b",
          "optimizer": "#e15759", "inputs": "#bab0ac", "activations": "#59a14f", "temporaries": "#edc948"}
PHASE_COLORS = {"start": "#eef1f4", "forward": "#dbe9f6", "backward": "#fbe3d6", "recompute": "#e9e0f3",
                "optimizer step": "#f6dcdc"}


def memory_svg(title: str, memory: MemoryEstimate) -> str:
    """The SVG document of `memory`'s timeline."""
    timeline = memory.timeline
    kinds = [kind for kind in KINDS if any(point.by_kind.get(kind, 0) for point in timeline)]
    top = memory.peak_bytes
    if memory.capacity is not None and memory.capacity < 2 * top:  # the device's line, when it is in sight
        top = max(top, memory.capacity)
    top = top * 1.08 or 1
    plot_width, plot_height = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    # a point is one op wide; the step's start and the optimizer step (one point each) are drawn wider
    wide = max(1.0, WIDE * len(timeline))
    edges = [0.0]
    for point in timeline:
        edges.append(edges[-1] + (wide if point.phase in (START, OPTIMIZER_STEP) else 1.0))

    def x(edge: float) -> float:
        return LEFT + plot_width * edge / edges[-1]

    def y(size: float) -> float:
        return TOP + plot_height * (1 - size / top)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" '
             f'font-family="sans-serif" font-size="12" role="img" aria-label="memory over the step">',
             f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
             f'<text x="{LEFT + plot_width / 2}" y="20" text-anchor="middle" font-size="15">{escape(title)}: tensor bytes '
             f'through the step, peak {escape(memory_to_string(memory.peak_bytes))}</text>']
    parts += _phases(timeline, edges, x, TOP, plot_height)
    parts += _axes(top, y, len(timeline), plot_width)
    columns = _columns(timeline)
    below = [0.0] * len(columns)
    for kind in kinds:
        above = [base + point.by_kind.get(kind, 0) for base, (_, _, point) in zip(below, columns)]
        outline = [f"{x(edges[edge]):.1f},{y(v):.1f}" for (first, last, _), v in zip(columns, above)
                   for edge in (first, last + 1)]
        outline += [f"{x(edges[edge]):.1f},{y(v):.1f}" for (first, last, _), v in zip(reversed(columns), reversed(below))
                    for edge in (last + 1, first)]
        parts.append(f'<polygon class="kind" data-kind="{escape(kind)}" points="{" ".join(outline)}" '
                     f'fill="{COLORS.get(kind, "#999")}" stroke="none"><title>{escape(kind)}</title></polygon>')
        below = above
    if memory.capacity is not None and memory.capacity <= top:
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + plot_width}" y1="{y(memory.capacity):.1f}" '
                     f'y2="{y(memory.capacity):.1f}" stroke="#c62828" stroke-dasharray="6 3"/>'
                     f'<text x="{LEFT + plot_width - 4}" y="{y(memory.capacity) - 4:.1f}" text-anchor="end" '
                     f'fill="#c62828">{escape(memory.device or "device")} {escape(memory_to_string(memory.capacity))}</text>')
    at = memory.peak_at.index
    parts += _peak(memory, x((edges[at] + edges[at + 1]) / 2), y)
    parts += _legend(kinds, memory)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _columns(timeline: list[Point]) -> list[tuple[int, int, Point]]:
    """(first, last, highest point) of at most COLUMNS runs of points (the peak is always kept); the step's
    start and optimizer step keep columns of their own."""
    size = max(len(timeline) / COLUMNS, 1.0)
    columns: list[tuple[int, int, Point]] = []
    first = 0
    while first < len(timeline):
        last = min(max(int((len(columns) + 1) * size), first + 1), len(timeline)) - 1
        phases = [point.phase in (START, OPTIMIZER_STEP) for point in timeline[first:last + 1]]
        if any(phases) and last > first:  # a wide point alone
            last = first if phases[0] else first + phases.index(True) - 1
        run = timeline[first:last + 1]
        columns.append((first, last, max(run, key=lambda point: point.total)))
        first = last + 1
    return columns


def _phases(timeline: list[Point], edges: list[float], x: Any, top: float, height: float) -> list[str]:
    """A band per run of one phase, named along the top where it is wide enough."""
    parts = []
    runs: list[list[Any]] = []
    for index, point in enumerate(timeline):
        if runs and runs[-1][0] == point.phase:
            runs[-1][2] = index
        else:
            runs.append([point.phase, index, index])
    for phase, first, last in runs:
        left, right = x(edges[first]), x(edges[last + 1])
        parts.append(f'<rect class="phase" data-phase="{escape(phase)}" x="{left:.1f}" y="{top}" '
                     f'width="{max(right - left, 1):.1f}" height="{height}" fill="{PHASE_COLORS.get(phase, "#eee")}">'
                     f'<title>{escape(phase)}</title></rect>')
        label = phase if right - left > 6.5 * len(phase) else "optim." if phase == OPTIMIZER_STEP else ""
        if label and phase != START:
            parts.append(f'<text x="{(left + right) / 2:.1f}" y="{top - 6}" text-anchor="middle" '
                         f'fill="#5d6b78">{escape(label)}</text>')
    return parts


def _axes(top: float, y: Any, count: int, plot_width: float) -> list[str]:
    parts = [f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{y(0):.1f}" stroke="#333"/>',
             f'<line x1="{LEFT}" x2="{LEFT + plot_width}" y1="{y(0):.1f}" y2="{y(0):.1f}" stroke="#333"/>',
             f'<text x="{LEFT + plot_width / 2}" y="{HEIGHT - 10}" text-anchor="middle">'
             f'the step\'s ops in the order they run ({count:,} points; not time)</text>']
    step = _tick_step(top)
    value = 0
    while value <= top:
        parts.append(f'<line x1="{LEFT - 4}" x2="{LEFT}" y1="{y(value):.1f}" y2="{y(value):.1f}" stroke="#333"/>'
                     f'<text x="{LEFT - 7}" y="{y(value) + 4:.1f}" text-anchor="end">{escape(memory_to_string(value))}</text>')
        value += step
    return parts


def _tick_step(top: float) -> int:
    """A round binary step giving 3 to 8 ticks up to `top`."""
    step = 1
    while top / step > 8:
        step *= 2
    return step


def _peak(memory: MemoryEstimate, px: float, y: Any) -> list[str]:
    at = memory.peak_at
    where = at.phase + (f", {at.module}" if at.module else "")
    py = y(memory.peak_bytes)
    anchor = "end" if px > LEFT + (WIDTH - LEFT - RIGHT) / 2 else "start"
    shift = -8 if anchor == "end" else 8
    return [f'<line id="memory-peak" x1="{px:.1f}" x2="{px:.1f}" y1="{TOP}" y2="{y(0):.1f}" stroke="#1d2329" '
            f'stroke-dasharray="4 3"/>',
            f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="#1d2329"><title>peak: {memory.peak_bytes:,} bytes at '
            f'{escape(where)} ({escape(at.op)})</title></circle>',
            f'<text x="{px + shift:.1f}" y="{py - 8:.1f}" text-anchor="{anchor}" font-weight="600">peak '
            f'{escape(memory_to_string(memory.peak_bytes))} ({escape(where)})</text>']


def _legend(kinds: list[str], memory: MemoryEstimate) -> list[str]:
    left = WIDTH - RIGHT + 14
    parts = [f'<text x="{left}" y="{TOP + 4}" font-weight="600">at the peak</text>']
    for row, kind in enumerate(reversed(kinds)):  # top of the stack first, as drawn
        top = TOP + 16 + 18 * row
        parts.append(f'<rect x="{left}" y="{top}" width="12" height="12" fill="{COLORS.get(kind, "#999")}"/>'
                     f'<text x="{left + 18}" y="{top + 10}">{escape(kind)} '
                     f'{escape(memory_to_string(memory.by_kind.get(kind, 0)))}</text>')
    return parts
