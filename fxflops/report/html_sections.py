"""The HTML report's sections: header, cards, icicle controls, roofline, cautions, tables.

Each function returns a piece of markup for the page template of fxflops.report.html; every text in it
is escaped here.
"""

from __future__ import annotations

import re
from html import escape
from typing import Any

from fxflops.report.formats import (
    bytes_to_string,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
    shared_to_string,
)
from fxflops.report.memory_text import memory_to_string
from fxflops.report.html_data import Metric, forward_prefix, timed, unknown_modules
from fxflops.report.text_summary import attention_text, inputs_text
from fxflops.results import ROOT_LABEL, UNKNOWN_RULE, Estimate


def header(estimate: Estimate) -> str:
    what = "profile (measured)" if estimate.measurements is not None else "estimate"
    shapes = escape(inputs_text(estimate.input_shapes))
    # the training flag (dropout, batch statistics) and the passes counted are two things: say both
    mode = "" if estimate.training is None else f" · model in {'train' if estimate.training else 'eval'} mode"
    passes = "forward + backward" if estimate.backward else "forward"
    return (f"<h1>{escape(estimate.model_type)}</h1>"
            f'<p class="sub">fxflops {what} · counts the {passes} · method {escape(estimate.method)} · conventions '
            f"{escape(estimate.conventions)} · dtype {escape(str(estimate.dtype))}{mode} · inputs {shapes}</p>")


def cards(estimate: Estimate) -> str:
    fwd = forward_prefix(estimate)
    cards = [
        (f"{fwd}MACs", macs_to_string(estimate.fwd_macs)),
        (f"{fwd}FLOPs", number_to_string(estimate.fwd_flops)),
        ("params", params_to_string(estimate.total_params)),
    ]
    if estimate.backward:
        cards += [("bwd MACs", macs_to_string(estimate.bwd_macs)), ("bwd FLOPs", number_to_string(estimate.bwd_flops))]
    totals = estimate.attention_totals()
    if totals is not None and totals.differ:
        cards.append((f"attention FLOPs{_both_passes(estimate)}, dense / effective ({', '.join(totals.patterns)})",
                       f"{number_to_string(totals.dense_flops)} / {number_to_string(totals.effective_flops)}"))
    if estimate.total_bytes:
        cards.append(("bytes moved", bytes_to_string(estimate.total_bytes)))
    if estimate.measurements is not None:
        cards.append(("measured fwd latency", duration_to_string(estimate.measurements.fwd_latency)))
    if estimate.prediction is not None:
        cards.append((f"predicted on {estimate.prediction.device}", duration_to_string(estimate.prediction.latency)))
    unknown = sum(u.count for u in estimate.unknown)
    cards.append(("unknown ops", str(unknown)))
    return "".join(
        f'<div class="card{" bad" if label == "unknown ops" and unknown else ""}">'
        f'<div class="value">{escape(value)}</div><div class="label">{escape(label)}</div></div>'
        for label, value in cards)


def _both_passes(estimate: Estimate) -> str:
    """Attention totals hold both passes when the backward was counted, beside cards of the forward's."""
    return " (fwd + bwd)" if estimate.backward else ""


def icicle_section(metrics: list[Metric]) -> str:
    buttons = "".join(
        f'<button type="button" role="radio" data-metric="{i}" aria-checked="{"true" if i == 0 else "false"}">'
        f"{escape(m.label)}</button>" for i, m in enumerate(metrics))
    return (f'<div class="metrics" role="radiogroup" aria-label="size by">size by {buttons}</div>'
            '<div id="crumbs" class="crumbs"></div><div id="icicle" class="icicle"></div>'
            '<p class="hint">Click a module to zoom in (and see below why its own ops cost what they do), its '
            'bar at the top (or Escape) to zoom out. '
            "Empty space under a module is its own work (and submodules too thin to draw). Red marks unknown "
            "ops; a module that ran one is kept visible even where it counts nothing.</p>")


def roofline_section(estimate: Estimate) -> str:
    if estimate.prediction is None:
        return ""
    from fxflops.report.roofline import roofline_svg

    svg = roofline_svg(estimate, estimate.prediction)
    svg = re.sub(r'\s+xmlns="[^"]*"', "", svg, count=1)  # inline SVG needs no namespace reference
    return f'<section id="roofline"><h2>Roofline</h2><div class="roofline">{svg}</div></section>'


def cautions_section(estimate: Estimate) -> str:
    notes = list(estimate.cautions)
    attention = attention_text(estimate)
    if attention is not None:
        notes.append(f"attention FLOPs{_both_passes(estimate)}: {attention}")
    if estimate.input_values:
        notes.insert(0, f"the model ran once, on {estimate.input_values}")
    if not notes:
        return ""
    items = "".join(f"<li>{escape(note)}</li>" for note in notes)
    return f'<section class="cautions"><h2>Cautions</h2><ul>{items}</ul></section>'


def _cell(text: str, value: float | str | None = None, cls: str = "") -> str:
    sort = "" if value is None else f' data-v="{escape(str(value))}"'
    klass = f' class="{cls}"' if cls else ""
    return f"<td{sort}{klass}>{escape(text)}</td>"


def _table(table_id: str, headers: list[tuple[str, bool]], rows: list[str]) -> str:
    heads = "".join(f'<th scope="col" class="{"num" if numeric else "text"}" aria-sort="none">{escape(label)}</th>'
                    for label, numeric in headers)
    return (f'<table id="{table_id}" class="sortable"><thead><tr>{heads}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table>")


def modules_table(estimate: Estimate) -> str:
    measured = timed(estimate)
    prediction = estimate.prediction
    fwd = forward_prefix(estimate)
    headers = [("module", False), ("type", False), ("depth", True), ("calls", True), ("params", True),
               (f"{fwd}MACs", True), (f"{fwd}FLOPs", True), (f"own {fwd}MACs", True), (f"own {fwd}FLOPs", True)]
    if estimate.backward:
        headers += [("bwd MACs", True), ("bwd FLOPs", True), ("bwd/fwd", True)]
    moved = estimate.total_bytes > 0
    headers += [("bytes", True), ("FLOPs/byte", True)] if moved else []
    if measured:
        headers += [("latency", True), ("achieved", True)]
    if prediction is not None:
        headers += [("predicted", True), ("bound", False)]
    peaks = estimate.memory.module_peaks if estimate.memory is not None else None
    if peaks is not None:  # the highest tensor bytes while the module runs
        headers += [("peak memory", True)]
    tied = any(stats.shared for stats in estimate.modules.values())
    if tied:  # params count a tied weight once, at its first owner: the others name it here
        headers += [("tied params (counted at)", False)]
    unknown = unknown_modules(estimate)
    rows = []
    for name, stats in estimate.modules.items():
        cells = [
            _cell(name or ROOT_LABEL, None, "name"), _cell(stats.type), _cell(str(stats.depth), stats.depth),
            _cell(str(stats.calls), stats.calls), _cell(params_to_string(stats.params), stats.params),
            _cell(macs_to_string(stats.fwd_macs), stats.fwd_macs),
            _cell(number_to_string(stats.fwd_flops), stats.fwd_flops),
            _cell(macs_to_string(stats.self_macs - stats.self_bwd_macs), stats.self_macs - stats.self_bwd_macs),
            _cell(number_to_string(stats.self_flops - stats.self_bwd_flops), stats.self_flops - stats.self_bwd_flops),
        ]
        if estimate.backward:
            ratio = stats.bwd_fwd_ratio
            cells += [_cell(macs_to_string(stats.bwd_macs), stats.bwd_macs),
                      _cell(number_to_string(stats.bwd_flops), stats.bwd_flops),
                      _cell("" if ratio is None else f"{ratio:.2f}", -1 if ratio is None else ratio)]
        intensity = stats.intensity
        if moved:
            cells += [_cell(bytes_to_string(stats.bytes), stats.bytes),
                      _cell("" if intensity is None else f"{intensity:.2f}", -1 if intensity is None else intensity)]
        if measured:
            rate = stats.achieved_flops
            cells += [_cell("" if stats.latency is None else duration_to_string(stats.latency),
                            -1 if stats.latency is None else stats.latency),
                      _cell("" if rate is None else flops_to_string(rate), -1 if rate is None else rate)]
        if prediction is not None:
            predicted = prediction.modules.get(name)
            cells += [_cell("" if predicted is None else duration_to_string(predicted.latency),
                            -1 if predicted is None else predicted.latency),
                      _cell("" if predicted is None else predicted.bound)]
        if peaks is not None:
            peak = peaks.get(name)
            cells.append(_cell("" if peak is None else memory_to_string(peak), -1 if peak is None else peak))
        if tied:
            cells.append(_cell(shared_to_string(stats.shared)))
        cls = ' class="unknown"' if name in unknown else ""
        rows.append(f"<tr{cls}>{''.join(cells)}</tr>")
    return _table("modules", headers, rows)


def _totals_rows(totals: dict[str, Any], unknown: set[str], backward: bool) -> list[str]:
    rows = []
    for key, t in sorted(totals.items(), key=lambda item: (-item[1].flops, item[0])):
        cells = [_cell(key, None, "name"), _cell(str(t.count), t.count), _cell(macs_to_string(t.macs), t.macs),
                 _cell(number_to_string(t.flops), t.flops)]
        if backward:
            cells.append(_cell(number_to_string(t.bwd_flops), t.bwd_flops))
        cls = ' class="unknown"' if key in unknown else ""
        rows.append(f"<tr{cls}>{''.join(cells)}</tr>")
    return rows


def _totals_headers(estimate: Estimate) -> list[tuple[str, bool]]:
    if estimate.backward:  # an op's totals hold both passes; the backward's share beside them
        return [("fwd+bwd MACs", True), ("fwd+bwd FLOPs", True), ("bwd FLOPs", True)]
    return [("MACs", True), ("FLOPs", True)]


def ops_table(estimate: Estimate) -> str:
    headers = [("op", False), ("nodes", True), *_totals_headers(estimate)]
    unknown = {u.op for u in estimate.unknown}
    return _table("ops", headers, _totals_rows(estimate.by_op, unknown, estimate.backward))


def rules_table(estimate: Estimate) -> str:
    headers = [("rule", False), ("nodes", True), *_totals_headers(estimate)]
    return _table("rules", headers, _totals_rows(estimate.by_rule, {UNKNOWN_RULE}, estimate.backward))


def unknown_section(estimate: Estimate) -> str:
    if not estimate.unknown:
        return '<p class="ok">Every op was counted by a rule or declared zero: no unknown ops.</p>'
    rows = [f'<tr class="unknown">{_cell(u.op, None, "name")}{_cell(str(u.count), u.count)}'
            f"{_cell(', '.join(m or ROOT_LABEL for m in u.modules))}</tr>" for u in estimate.unknown]
    return ('<p class="bad">These ops match no rule: their MACs and FLOPs are not in the totals. '
            "Add a rule (see the manual's Writing rules, docs/guide/rules.md) or report them.</p>"
            + _table("unknown", [("op", False), ("nodes", True), ("modules", False)], rows))


def compare_section(estimate: Estimate) -> str:
    """The same capture under every preset, each difference named (empty without a capture)."""
    if getattr(estimate, "source", None) is None:
        return ""
    from fxflops.report.compare import comparison_text
    from fxflops.rules import RuleEvaluationError

    try:
        text = comparison_text(estimate.compare(), tables=False)
    except (RuleEvaluationError, ValueError) as error:  # e.g. a user rule that only holds under its own preset
        text = f"The other presets could not count this capture: {error}"
    return (f'<section id="compare"><h2>The same count under other conventions</h2>'
            f'<pre>{escape(text)}</pre></section>')
