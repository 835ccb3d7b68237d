"""The roofline picture: each module's arithmetic intensity against the FLOP/s it reaches, under the
device's roofs, as a self-contained SVG (no plotting library; it opens in any browser).

A point is a module with ops of its own: x its FLOPs per byte, y its measured FLOP/s where it was
timed, else the FLOP/s its predicted latency implies; its area follows its share of the time.
The roofs are min(peak, bandwidth x intensity) for ops with MACs and for the others.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any

from fxflops.report.formats import duration_to_string, flops_to_string
from fxflops.results import ROOT_LABEL, Estimate

WIDTH, HEIGHT = 880, 560
LEFT, RIGHT, TOP, BOTTOM = 90, 30, 50, 60


def roofline_svg(estimate: Estimate, prediction: Any) -> str:
    """The SVG document of `estimate`'s modules under `prediction`'s roofs."""
    points = _points(estimate, prediction)
    x_range = _decades([p["intensity"] for p in points] + [prediction.ridge, prediction.vector_flops / prediction.bandwidth])
    y_range = _decades([p["rate"] for p in points] + [prediction.peak_flops, prediction.vector_flops])
    scale = _Scale(x_range, y_range)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="24" text-anchor="middle" font-size="15">'
        f'{escape(estimate.model_type)} on {escape(prediction.device)} ({escape(prediction.dtype)}): roofline, '
        f'predicted {escape(duration_to_string(prediction.latency))}</text>',
        *_axes(scale),
        *_roofs(scale, prediction),
        *(_point(scale, p) for p in sorted(points, key=lambda p: -p["share"])),
        *_legend(),
        "</svg>",
    ]
    return "\n".join(parts) + "\n"


def _points(estimate: Estimate, prediction: Any) -> list[dict[str, Any]]:
    total = prediction.latency or 1.0
    points = []
    for name, stats in estimate.modules.items():
        predicted = prediction.modules.get(name)
        if stats.children or predicted is None or not stats.flops or not stats.bytes or not predicted.latency:
            continue  # leaves only: a parent's point would sit among its children's
        measured = stats.latency is not None and stats.latency > 0
        rate = stats.fwd_flops / stats.latency if measured else predicted.achieved_flops
        if not rate:
            continue
        points.append({"name": name or ROOT_LABEL, "type": stats.type, "intensity": stats.flops / stats.bytes,
                       "rate": rate, "measured": measured, "bound": predicted.bound,
                       "latency": stats.latency if measured else predicted.latency,
                       "share": predicted.latency / total})
    return points


def _decades(values: list[float]) -> tuple[int, int]:
    """Whole powers of ten around the positive values."""
    positive = [v for v in values if v and v > 0]
    low = math.floor(math.log10(min(positive))) if positive else 0
    high = math.ceil(math.log10(max(positive))) if positive else 1
    return low, max(high, low + 1)


class _Scale:
    def __init__(self, x_range: tuple[int, int], y_range: tuple[int, int]) -> None:
        self.x_range, self.y_range = x_range, y_range

    def x(self, value: float) -> float:
        low, high = self.x_range
        return LEFT + (math.log10(value) - low) / (high - low) * (WIDTH - LEFT - RIGHT)

    def y(self, value: float) -> float:
        low, high = self.y_range
        return HEIGHT - BOTTOM - (math.log10(value) - low) / (high - low) * (HEIGHT - TOP - BOTTOM)


def _axes(scale: _Scale) -> list[str]:
    parts = [f'<rect x="{LEFT}" y="{TOP}" width="{WIDTH - LEFT - RIGHT}" height="{HEIGHT - TOP - BOTTOM}" '
             'fill="none" stroke="#444"/>']
    for exponent in range(scale.x_range[0], scale.x_range[1] + 1):
        x = scale.x(10.0 ** exponent)
        parts.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{HEIGHT - BOTTOM}" stroke="#eee"/>')
        parts.append(f'<text x="{x:.1f}" y="{HEIGHT - BOTTOM + 18}" text-anchor="middle">{10.0 ** exponent:g}</text>')
    for exponent in range(scale.y_range[0], scale.y_range[1] + 1):
        y = scale.y(10.0 ** exponent)
        parts.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" stroke="#eee"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
                     f'{escape(flops_to_string(10.0 ** exponent))}</text>')
    parts.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{HEIGHT - 18}" text-anchor="middle">'
                 'arithmetic intensity (FLOPs per byte moved)</text>')
    parts.append(f'<text x="18" y="{(TOP + HEIGHT - BOTTOM) / 2}" text-anchor="middle" '
                 f'transform="rotate(-90 18 {(TOP + HEIGHT - BOTTOM) / 2})">FLOP/s (measured, else predicted)</text>')
    return parts


def _roofs(scale: _Scale, prediction: Any) -> list[str]:
    if prediction.vector_flops == prediction.peak_flops:
        return [_roof(scale, prediction.peak_flops, prediction.bandwidth, "#1f4e79", "all ops")]
    return [_roof(scale, prediction.peak_flops, prediction.bandwidth, "#1f4e79", "ops with MACs"),
            _roof(scale, prediction.vector_flops, prediction.bandwidth, "#7f7f7f", "other ops", dashed=True, below=True)]


def _legend() -> list[str]:
    x, y = LEFT + 12, TOP + 18
    entries = [("#c0392b", "#c0392b", "memory-bound"), ("#2e86c1", "#2e86c1", "compute-bound"),
               ("#444", "white", "hollow: predicted FLOP/s, filled: measured")]
    parts = []
    for index, (stroke, fill, text) in enumerate(entries):
        parts.append(f'<circle cx="{x}" cy="{y + 16 * index - 4}" r="5" fill="{fill}" fill-opacity="0.6" '
                     f'stroke="{stroke}"/><text x="{x + 10}" y="{y + 16 * index}">{escape(text)}</text>')
    return parts


def _roof(scale: _Scale, peak: float, bandwidth: float, color: str, label: str, dashed: bool = False,
          below: bool = False) -> str:
    low, high = (10.0 ** e for e in scale.x_range)
    ridge = min(max(peak / bandwidth, low), high)
    corners = [(low, min(peak, bandwidth * low)), (ridge, min(peak, bandwidth * ridge)), (high, peak)]
    path = " ".join(f"{scale.x(x):.1f},{scale.y(y):.1f}" for x, y in corners)
    dash = ' stroke-dasharray="6 4"' if dashed else ""
    x, y = scale.x(high) - 4, scale.y(peak) + (14 if below else -6)
    return (f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>'
            f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="end" fill="{color}">'
            f'{escape(label)}: {escape(flops_to_string(peak))}</text>')


def _point(scale: _Scale, point: dict[str, Any]) -> str:
    radius = 3 + 12 * math.sqrt(point["share"])
    color = "#c0392b" if point["bound"] == "memory" else "#2e86c1"
    fill = color if point["measured"] else "white"
    title = (f'{point["name"]} ({point["type"]}): {point["intensity"]:.2f} flops/byte, '
             f'{flops_to_string(point["rate"])} {"measured" if point["measured"] else "predicted"}, '
             f'{duration_to_string(point["latency"])}, {point["bound"]}-bound')
    return (f'<circle cx="{scale.x(point["intensity"]):.1f}" cy="{scale.y(point["rate"]):.1f}" r="{radius:.1f}" '
            f'fill="{fill}" fill-opacity="0.6" stroke="{color}"><title>{escape(title)}</title></circle>')
