"""The roofline picture: each module's arithmetic intensity against the FLOP/s it reaches, under the
device's roofs, as a self-contained SVG (no plotting library; it opens in any browser).

A point is a module with ops of its own: x its FLOPs per byte, y its measured FLOP/s where it was
timed, else the FLOP/s its predicted latency implies; its area follows its share of the time.
The roofs are min(peak, bandwidth x intensity) for ops with MACs and for the others.

The points that take the most time are named beside them (a model's 12 identical layers sit on one
spot: `h.*.mlp.c_fc x12`), each label on a leader line, placed off the points, off the other labels,
the legend and the roofs' own labels; every point still names itself on hover.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any

from fxflops.report.formats import duration_to_string, flops_to_string
from fxflops.results import ROOT_LABEL, Estimate

WIDTH, HEIGHT = 880, 560
LEFT, RIGHT, TOP, BOTTOM = 100, 30, 50, 60  # LEFT: tick labels clear of the axis title
LABELED = 8  # spots named beside their points, the most time first
CHAR_WIDTH, LINE_HEIGHT = 6.2, 13  # of the 11 px label text, for keeping labels apart
LEGEND_BOX = (LEFT, TOP, LEFT + 260, TOP + 62)


def roofline_svg(estimate: Estimate, prediction: Any) -> str:
    """The SVG document of `estimate`'s modules under `prediction`'s roofs."""
    points = _points(estimate, prediction)
    measured = any(p["measured"] for p in points)  # the legend and axis speak of measurements only then
    x_range = _decades([p["intensity"] for p in points] + [prediction.ridge, prediction.vector_flops / prediction.bandwidth])
    y_range = _decades([p["rate"] for p in points] + [prediction.peak_flops, prediction.vector_flops])
    scale = _Scale(x_range, y_range)
    circles = [_circle(scale, p) for p in points]
    taken = [LEGEND_BOX]
    roofs = _roofs(scale, prediction, circles, taken)
    lines = _roof_boxes(scale, prediction)  # point labels keep off the roof lines too
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="24" text-anchor="middle" font-size="15">'
        f'{escape(estimate.model_type)} on {escape(prediction.device)} ({escape(prediction.dtype)}): roofline, '
        f'predicted {escape(duration_to_string(prediction.latency))}</text>',
        *_axes(scale, measured),
        *roofs,
        *(_point(scale, p) for p in sorted(points, key=lambda p: -p["share"])),
        *_labels(scale, points, circles, taken, lines),
        *_legend(measured),
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


def _axes(scale: _Scale, measured: bool) -> list[str]:
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
    what = "measured, else predicted" if measured else "predicted"
    parts.append(f'<text x="14" y="{(TOP + HEIGHT - BOTTOM) / 2}" text-anchor="middle" '
                 f'transform="rotate(-90 14 {(TOP + HEIGHT - BOTTOM) / 2})">FLOP/s ({what})</text>')
    return parts


def _roofs(scale: _Scale, prediction: Any, circles: list[Box], taken: list[Box]) -> list[str]:
    if prediction.vector_flops == prediction.peak_flops:
        return [_roof(scale, prediction.peak_flops, prediction.bandwidth, "#1f4e79", "all ops", circles, taken)]
    return [_roof(scale, prediction.peak_flops, prediction.bandwidth, "#1f4e79", "ops with MACs", circles, taken),
            _roof(scale, prediction.vector_flops, prediction.bandwidth, "#7f7f7f", "other ops", circles, taken,
                  dashed=True)]


def _legend(measured: bool) -> list[str]:
    """The legend; it names measured points only where some module was timed."""
    x, y = LEFT + 12, TOP + 18
    entries = [("#c0392b", "#c0392b", "memory-bound"), ("#2e86c1", "#2e86c1", "compute-bound"),
               ("#444", "white", "hollow: predicted FLOP/s, filled: measured" if measured
                else "hollow: predicted FLOP/s (nothing measured)")]
    parts = []
    for index, (stroke, fill, text) in enumerate(entries):
        parts.append(f'<circle cx="{x}" cy="{y + 16 * index - 4}" r="5" fill="{fill}" fill-opacity="0.6" '
                     f'stroke="{stroke}"/><text x="{x + 10}" y="{y + 16 * index}">{escape(text)}</text>')
    return parts


def _roof(scale: _Scale, peak: float, bandwidth: float, color: str, label: str, circles: list[Box],
          taken: list[Box], dashed: bool = False) -> str:
    low, high = (10.0 ** e for e in scale.x_range)
    ridge = min(max(peak / bandwidth, low), high)
    start = min(max(low, 10.0 ** scale.y_range[0] / bandwidth), ridge)  # where the slope enters the plot
    corners = [(start, min(peak, bandwidth * start)), (ridge, min(peak, bandwidth * ridge)), (high, peak)]
    path = " ".join(f"{scale.x(x):.1f},{scale.y(y):.1f}" for x, y in corners)
    dash = ' stroke-dasharray="6 4"' if dashed else ""
    text = f"{label}: {flops_to_string(peak)}"
    width = len(text) * CHAR_WIDTH
    # along the flat roof, right to left, above then below it: the first place clear of the points
    y_roof = scale.y(peak)
    candidates = [(right - width, y_roof + dy) for dy in (-6, 15)
                  for right in _steps(WIDTH - RIGHT - 4, LEFT + width, 24)]
    x, y = _clear_spot(candidates, width, circles + taken)
    taken.append(_text_box(x, y, width))
    return (f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>'
            f'<text x="{x:.1f}" y="{y:.1f}" fill="{color}">{escape(text)}</text>')


def _roof_boxes(scale: _Scale, prediction: Any) -> list[Box]:
    """Small boxes along each roof line, every 8 px, so labels can keep off it."""
    boxes = []
    low, high = scale.x_range
    for peak in {prediction.peak_flops, prediction.vector_flops}:
        for step in range(int((WIDTH - LEFT - RIGHT) / 8) + 1):
            intensity = 10.0 ** (low + (high - low) * step * 8 / (WIDTH - LEFT - RIGHT))
            x, y = scale.x(intensity), scale.y(min(peak, prediction.bandwidth * intensity))
            boxes.append((x - 4, y - 2, x + 4, y + 2))
    return boxes


def _steps(start: float, stop: float, step: float) -> list[float]:
    """start, start - step, ... down to stop (at least start)."""
    values = [start]
    while values[-1] - step >= stop:
        values.append(values[-1] - step)
    return values


Box = tuple[float, float, float, float]  # x0, y0, x1, y1 in pixels


def _circle(scale: _Scale, point: dict[str, Any]) -> Box:
    x, y, r = scale.x(point["intensity"]), scale.y(point["rate"]), _radius(point)
    return x - r, y - r, x + r, y + r


def _text_box(x: float, y: float, width: float) -> Box:
    """The box of a text whose start (left end of its baseline) is (x, y)."""
    return x - 2, y - LINE_HEIGHT + 2, x + width + 2, y + 4


def _overlap(a: Box, b: Box) -> float:
    width = min(a[2], b[2]) - max(a[0], b[0])
    height = min(a[3], b[3]) - max(a[1], b[1])
    return width * height if width > 0 and height > 0 else 0.0


def _inside(box: Box) -> bool:
    return box[0] >= LEFT + 2 and box[2] <= WIDTH - RIGHT - 2 and box[1] >= TOP + 2 and box[3] <= HEIGHT - BOTTOM - 2


def _clear_spot(candidates: list[tuple[float, float]], width: float, boxes: list[Box]) -> tuple[float, float]:
    """The first candidate text start whose box is inside the plot and overlaps nothing, else the least
    overlapping one."""
    best, best_cost = candidates[0], math.inf
    for x, y in candidates:
        box = _text_box(x, y, width)
        cost = sum(_overlap(box, other) for other in boxes) + (0 if _inside(box) else 1e6)
        if cost == 0:
            return x, y
        if cost < best_cost:
            best, best_cost = (x, y), cost
    return best


def _labels(scale: _Scale, points: list[dict[str, Any]], circles: list[Box], taken: list[Box],
            lines: list[Box]) -> list[str]:
    """Names of the spots that take the most time, each on a leader line, clear of points and labels.

    A label on another text (legend, roof label, label), a leader through a text, or a label outside the
    plot is a clash: a spot with no place free of clashes goes unnamed (it still names itself on hover).
    Labels are placed most time first; when one finds no place, placing it first is tried too, and
    whichever order names more spots wins.
    """
    spots = _spots(scale, points)[:LABELED]
    best = _placed(spots, circles, taken, lines)
    for missed in [index for index, part in enumerate(best) if part is None]:
        order = [missed] + [index for index in range(len(spots)) if index != missed]
        tried = _placed([spots[index] for index in order], circles, taken, lines)
        tried = [tried[order.index(index)] for index in range(len(spots))]
        if sum(part is not None for part in tried) > sum(part is not None for part in best):
            best = tried
    return [part for part in best if part is not None]


def _placed(spots: list[dict[str, Any]], circles: list[Box], taken: list[Box], lines: list[Box]) -> list[str | None]:
    """Each spot's label and leader in this order, each clear of those before it (None: no clear place)."""
    taken = list(taken)
    leaders: list[tuple[tuple[float, float], tuple[float, float]]] = []  # placed leaders: later labels keep off
    parts: list[str | None] = []
    for spot in spots:
        x, y, radius = spot["x"], spot["y"], spot["radius"]
        width = len(spot["label"]) * CHAR_WIDTH
        best, best_cost = None, (math.inf, math.inf)
        for distance in _DISTANCES:
            for box, anchor in (found for degrees in _DIRECTIONS
                                for found in _label_boxes(x, y, distance, math.radians(degrees), width)):
                leader = _leader(x, y, radius, box)
                samples = _samples(leader)
                clashes = (sum(_overlap(box, other) > 0 for other in taken)
                           + sum(_hits(samples, other) for other in taken)
                           + sum(_crosses(other, box) for other in leaders)
                           + (0 if _inside(box) else 1))
                if clashes > best_cost[0]:
                    continue
                cost = (clashes, sum(_overlap(box, other) for other in circles)
                        + 400 * sum(_overlap(box, line) > 0 for line in lines)
                        # a leader may leave a point on a roof, not run along it
                        + 100 * max(0, sum(_hits(samples, line) for line in lines) - 2))
                if cost < best_cost:
                    best, best_cost = (box, leader, anchor), cost
                if cost == (0, 0):
                    break
            if best_cost == (0, 0):  # the nearest clean place
                break
        if best_cost[0]:
            parts.append(None)
            continue
        box, leader, anchor = best
        taken.append(box)  # which later labels and leaders must keep off
        leaders.append(leader)
        (x1, y1), (x2, y2) = leader
        # anchored on the side the leader meets, so the line touches the text whatever its real width
        text_x = box[0] + 2 if anchor == "start" else box[2] - 2 if anchor == "end" else (box[0] + box[2]) / 2
        parts.append(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="#666" '
                     f'stroke-width="0.8"/><text x="{text_x:.1f}" y="{box[3] - 4:.1f}" font-size="11" '
                     f'text-anchor="{anchor}" fill="#222">{escape(spot["label"])}</text>')
    return parts


_DISTANCES = (28, 48, 72, 100, 130, 160, 190, 230, 280)  # px from a point to its label
# where a label may go from its point, in order of preference (degrees, y down): below right first,
# the emptiest side of points that sit on a roof
_DIRECTIONS = (45, 90, 135, 22, 67, 112, 157, 0, 180, -22, -45, -67, -90, -112, -135, -157)


def _label_boxes(x: float, y: float, distance: float, angle: float, width: float) -> list[tuple[Box, str]]:
    """Boxes of a label `distance` px from (x, y) at `angle`, on the side facing away from the point,
    each with the text anchor that keeps its near side there: beside the leader's end when it leaves
    sideways; centred on it, or hanging to either side, when it leaves up or down."""
    end_x, end_y = x + distance * math.cos(angle), y + distance * math.sin(angle) * 0.8
    if math.cos(angle) > 0.3:
        starts = [(end_x + 3, "start")]
    elif math.cos(angle) < -0.3:
        starts = [(end_x - width - 3, "end")]
    else:
        starts = [(end_x - width / 2, "middle"), (end_x - 3, "start"), (end_x - width + 3, "end")]
    baseline = end_y + (LINE_HEIGHT - 2 if math.sin(angle) > 0.3 else -2 if math.sin(angle) < -0.3 else 4)
    return [(_text_box(start, baseline, width), anchor) for start, anchor in starts]


def _leader(x: float, y: float, radius: float, box: Box) -> tuple[tuple[float, float], tuple[float, float]]:
    """From the circle's edge to the nearest point of the label's box."""
    end_x, end_y = min(max(x, box[0]), box[2]), min(max(y, box[1]), box[3])
    angle = math.atan2(end_y - y, end_x - x)
    return (x + radius * math.cos(angle), y + radius * math.sin(angle)), (end_x, end_y)


def _crosses(segment: tuple[tuple[float, float], tuple[float, float]], box: Box) -> int:
    """Whether the segment passes through the box (sampled every 3 px)."""
    return _hits(_samples(segment), box)


def _samples(segment: tuple[tuple[float, float], tuple[float, float]]) -> tuple[Box, list[tuple[float, float]]]:
    """The segment's bounds and its points every 3 px, to test against many boxes."""
    (x1, y1), (x2, y2) = segment
    steps = max(1, int(math.hypot(x2 - x1, y2 - y1) / 3))
    points = [(x1 + (x2 - x1) * i / steps, y1 + (y2 - y1) * i / steps) for i in range(steps + 1)]
    return (min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)), points


def _hits(samples: tuple[Box, list[tuple[float, float]]], box: Box) -> int:
    bounds, points = samples
    if bounds[2] <= box[0] or bounds[0] >= box[2] or bounds[3] <= box[1] or bounds[1] >= box[3]:
        return 0
    return int(any(box[0] < x < box[2] and box[1] < y < box[3] for x, y in points))


def _spots(scale: _Scale, points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Points drawn on the same spot (a model's identical layers), one entry each, the most time first."""
    spots: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for point in points:
        key = (round(scale.x(point["intensity"])), round(scale.y(point["rate"])))
        spots.setdefault(key, []).append(point)
    found = []
    for (x, y), members in spots.items():
        found.append({"x": float(x), "y": float(y), "share": sum(p["share"] for p in members),
                      "radius": max(_radius(p) for p in members), "label": _spot_label(members)})
    return sorted(found, key=lambda spot: -spot["share"])


def _spot_label(members: list[dict[str, Any]]) -> str:
    """`lm_head`, or for several modules on one spot their names with the layer numbers as `*` and how
    many: `h.*.mlp.c_fc, h.*.mlp.c_proj x24`."""
    if len(members) == 1:
        return members[0]["name"]
    names = list(dict.fromkeys(".".join("*" if part.isdigit() else part for part in p["name"].split("."))
                               for p in members))
    shown = ", ".join(names[:2]) + (f", +{len(names) - 2} more" if len(names) > 2 else "")
    return f"{shown} x{len(members)}"


def _radius(point: dict[str, Any]) -> float:
    return 3 + 12 * math.sqrt(point["share"])


def _point(scale: _Scale, point: dict[str, Any]) -> str:
    radius = _radius(point)
    color = "#c0392b" if point["bound"] == "memory" else "#2e86c1"
    fill = color if point["measured"] else "white"
    title = (f'{point["name"]} ({point["type"]}): {point["intensity"]:.2f} flops/byte, '
             f'{flops_to_string(point["rate"])} {"measured" if point["measured"] else "predicted"}, '
             f'{duration_to_string(point["latency"])}, {point["bound"]}-bound')
    return (f'<circle cx="{scale.x(point["intensity"]):.1f}" cy="{scale.y(point["rate"]):.1f}" r="{radius:.1f}" '
            f'fill="{fill}" fill-opacity="0.6" stroke="{color}"><title>{escape(title)}</title></circle>')
