"""A predicted step drawn: each pipeline rank's passes and transfers, as a Chrome trace and as an HTML page,
with the critical path (the chain of passes that sets the step time) marked."""

from __future__ import annotations

import html
from typing import Any

from fxflops.predict.schedule import BACKWARD, COMPUTE, FORWARD

COLOURS = {FORWARD: "#4e79a7", BACKWARD: "#f28e2b", "send forward": "#9c9c9c", "send backward": "#9c9c9c",
           "comm": "#59a14f"}


def chrome_trace(prediction: Any) -> dict[str, Any]:
    """Chrome trace events (chrome://tracing, Perfetto): one process per pipeline rank, a thread per stream; the
    passes on the critical path carry args.critical = true and are repeated on a "critical path" thread."""
    timeline = prediction.timeline
    events = []
    critical = set(timeline.critical_path()) if timeline is not None else set()
    for e in (timeline.events if timeline is not None else []):
        record = {"name": f"{e.kind} mb{e.microbatch} chunk{e.chunk}", "ph": "X", "pid": e.rank, "tid": e.stream,
                  "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6, "cat": e.kind,
                  "args": {"critical": e in critical}}
        events.append(record)
        if e in critical:
            events.append({**record, "tid": "critical path"})
    for rank, name, start, end in prediction.comm_events:
        events.append({"name": name, "ph": "X", "pid": rank, "tid": "dp comm", "ts": start * 1e6,
                       "dur": (end - start) * 1e6, "cat": "communication"})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"prediction": prediction.as_dict(), "note": prediction.error}}


def html_timeline(prediction: Any, width: int = 1200) -> str:
    """A self-contained HTML page: the step's summary, then one lane per pipeline rank (compute passes, the
    transfers and data-parallel reductions below them), the critical path outlined in black."""
    timeline = prediction.timeline
    step = prediction.step_time or 1.0
    scale = (width - 110) / step
    lane, gap = 26, 12
    ranks = timeline.stages if timeline is not None else 1
    height = ranks * (lane + gap) + 30
    critical = set(timeline.critical_path()) if timeline is not None else set()
    shapes = []
    for rank in range(ranks):
        y = 10 + rank * (lane + gap)
        role = prediction.ranks[rank].role if rank < len(prediction.ranks) else f"rank {rank}"
        memory = prediction.memory[rank] if rank < len(getattr(prediction, "memory", [])) else None
        # the rank's predicted peak memory, on hovering its name
        held = f"<title>{html.escape(role)} memory {memory.total / (1 << 30):,.2f} GiB predicted</title>" \
            if memory else ""
        shapes.append(f'<text x="0" y="{y + 17}" font-size="12">{held}{html.escape(role)}</text>')
        for e in (timeline.rank_events(rank) if timeline is not None else []):
            top, tall = (y, lane - 8) if e.stream == COMPUTE else (y + lane - 7, 6)
            outline = ' stroke="black" stroke-width="1.5"' if e in critical else ""
            shapes.append(f'<rect x="{100 + e.start * scale:.2f}" y="{top}" width="{max((e.end - e.start) * scale, 0.5):.2f}" '
                          f'height="{tall}" fill="{COLOURS.get(e.kind, "#bbb")}"{outline}><title>{html.escape(e.kind)} '
                          f'micro-batch {e.microbatch} chunk {e.chunk}: {e.start * 1e3:,.2f}-{e.end * 1e3:,.2f} ms'
                          f'</title></rect>')
        for comm_rank, name, start, end in prediction.comm_events:
            if comm_rank == rank:
                shapes.append(f'<rect x="{100 + start * scale:.2f}" y="{y + lane - 7}" '
                              f'width="{max((end - start) * scale, 0.5):.2f}" height="6" fill="{COLOURS["comm"]}">'
                              f'<title>{html.escape(name)}: {start * 1e3:,.2f}-{end * 1e3:,.2f} ms</title></rect>')
    summary = html.escape(str(prediction)).replace("\n", "<br>")
    legend = " ".join(f'<span style="color:{colour}">&#9632;</span> {html.escape(name)}'
                      for name, colour in (("forward", COLOURS[FORWARD]), ("backward", COLOURS[BACKWARD]),
                                           ("p2p transfer", COLOURS["send forward"]), ("dp reduction", COLOURS["comm"])))
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>fxflops predicted step</title></head>'
            f'<body style="font-family: sans-serif"><p style="font-family: monospace; font-size: 12px">{summary}</p>'
            f'<p>{legend}; black outline: the critical path. Time runs left to right over '
            f'{step * 1e3:,.1f} ms.</p><svg width="{width}" height="{height}">{"".join(shapes)}</svg></body></html>')
