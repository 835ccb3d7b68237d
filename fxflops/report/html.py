"""The report to look at: one self-contained HTML page of an estimate or a profile.

The page holds the summary, an icicle of the module tree (sized by MACs, FLOPs, params, bytes,
measured or predicted latency; click to zoom in and out, hover for numbers), the roofline when a
prediction was asked for, and sortable tables of modules, ops and rules with unknown ops marked.
Everything is inline — CSS, the data as JSON and hand-written JavaScript — so the file opens
offline in any browser and can be mailed or kept beside the model. Numbers are formatted here, in
Python, by the same functions as the text report, so both read alike; the script only lays out,
sorts and zooms.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from html import escape
from importlib import resources
from pathlib import Path
from typing import Any

from fxflops.report import fold as folding
from fxflops.report.formats import (
    ENCODING_ERRORS,
    bytes_to_string,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
    percent,
)
from fxflops.report.text_summary import attention_text, inputs_text, summary_lines
from fxflops.results import ROOT_LABEL, UNKNOWN_RULE, Estimate, ModuleStats


@dataclass(frozen=True)
class Metric:
    """One way to size the icicle: a per-module value and how to print it."""

    key: str
    label: str
    value: Callable[[Estimate, str], float]
    text: Callable[[float], str]


def _predicted(estimate: Estimate, name: str) -> float:
    predicted = estimate.prediction.modules.get(name)
    return predicted.latency if predicted is not None else 0.0


# MACs and FLOPs are the forward's, as in the text report; with a counted backward it has its own.
_METRICS = (
    Metric("macs", "MACs", lambda e, n: e.modules[n].fwd_macs, macs_to_string),
    Metric("flops", "FLOPs", lambda e, n: e.modules[n].fwd_flops, number_to_string),
    Metric("params", "params", lambda e, n: e.modules[n].params, params_to_string),
    Metric("bwd_macs", "bwd MACs", lambda e, n: e.modules[n].bwd_macs, macs_to_string),
    Metric("bwd_flops", "bwd FLOPs", lambda e, n: e.modules[n].bwd_flops, number_to_string),
    Metric("bytes", "bytes moved", lambda e, n: e.modules[n].bytes, bytes_to_string),
    Metric("latency", "measured latency", lambda e, n: e.modules[n].latency or 0.0, duration_to_string),
    Metric("predicted", "predicted latency", _predicted, duration_to_string),
)


def metrics_of(estimate: Estimate) -> list[Metric]:
    """The metrics this estimate has numbers for, in the order the page offers them."""
    present = {
        "bwd_macs": estimate.backward,
        "bwd_flops": estimate.backward,
        "bytes": estimate.total_bytes > 0,
        "latency": _timed(estimate),
        "predicted": estimate.prediction is not None,
    }
    metrics = [metric for metric in _METRICS if present.get(metric.key, True)]
    if estimate.backward:  # say which pass the plain names stand for
        metrics = [dataclasses.replace(m, label=_forward_prefix(estimate) + m.label) if m.key in ("macs", "flops")
                   else m for m in metrics]
    return metrics


def _timed(estimate: Estimate) -> bool:
    """Whether any module carries a measured latency (a profile)."""
    return any(stats.latency is not None for stats in estimate.modules.values())


def _forward_prefix(estimate: Estimate) -> str:
    """MACs and FLOPs are the forward's; with a counted backward the labels say so."""
    return "fwd " if estimate.backward else ""


def to_html(estimate: Estimate, path: str | Path | None = None, fold: bool = True) -> str:
    """The page as text; also written to `path` when given. `fold`: identical numbered repeats are
    one entry of the icicle with a count, as in the text report."""
    metrics = metrics_of(estimate)
    data = {
        "model": estimate.model_type,
        "root": ROOT_LABEL,
        "metrics": [{"key": m.key, "label": m.label} for m in metrics],
        "groups": _groups(estimate, metrics, fold) if "" in estimate.modules else [],
    }
    page = _TEMPLATE.format(
        title=escape(f"fxflops: {estimate.model_type}"),
        style=_asset("report.css"),
        script=_asset("report.js"),
        header=_header(estimate),
        cards=_cards(estimate),
        icicle=_icicle_section(metrics),
        roofline=_roofline_section(estimate),
        cautions=_cautions_section(estimate),
        summary=escape("\n".join(summary_lines(estimate))),
        modules=_modules_table(estimate),
        ops=_ops_table(estimate),
        rules=_rules_table(estimate),
        unknown=_unknown_section(estimate),
        compare=_compare_section(estimate),
        data=_script_json(data),
    )
    if path is not None:
        Path(path).write_text(page, encoding="utf-8", errors=ENCODING_ERRORS)
    return page


def _asset(name: str) -> str:
    return resources.files("fxflops.report").joinpath("assets", name).read_text(encoding="utf-8")


def _script_json(data: Any) -> str:
    """JSON that cannot end the <script> element it sits in, whatever a module or type is called."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026") \
        .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


# --- the icicle's data ---------------------------------------------------------------------------


def _unknown_modules(estimate: Estimate) -> dict[str, list[str]]:
    """Module -> the unknown ops it ran itself."""
    found: dict[str, list[str]] = {}
    for unknown in estimate.unknown:
        for module in unknown.modules:
            found.setdefault(estimate.aliases.get(module, module), []).append(unknown.op)
    return found


def _groups(estimate: Estimate, metrics: list[Metric], fold: bool) -> list[dict[str, Any]]:
    """The folded module tree, pre-order, each entry with its children's indices and its values
    summed over the instances it stands for (so a folded run is as wide as all its layers)."""
    unknown = _unknown_modules(estimate)
    explained = _explanations(estimate)
    groups: list[dict[str, Any]] = []
    path: list[int] = []  # indices of the entries from the root down to the last one made
    for group, _ in folding.walk(estimate, fold=fold):
        stats = folding.stats_of(estimate, group)
        del path[group.depth:]
        if path:
            groups[path[-1]]["children"].append(len(groups))
        path.append(len(groups))
        groups.append({
            "name": group.name,
            "label": group.label or ROOT_LABEL,
            "type": stats.type,
            "count": group.count,
            "n": len(group.names),
            "v": [_finite(sum(m.value(estimate, name) for name in group.names)) for m in metrics],
            "info": _info(estimate, group, stats, metrics),
            "unknown": sorted({op for name in group.names for op in unknown.get(name, [])}),
            "explain": explained.get(group.names[0], ""),
            "children": [],
        })
    return groups


def _compare_section(estimate: Estimate) -> str:
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


def _explanations(estimate: Estimate) -> dict[str, str]:
    """Module -> the explanation of its own ops, shown when it is clicked ({} without a capture)."""
    if getattr(estimate, "source", None) is None:
        return {}
    from fxflops.explain import explain_own
    from fxflops.rules import RuleEvaluationError

    try:
        explained = explain_own(estimate)
    except (RuleEvaluationError, ValueError):  # the page shows the numbers; only the explanations are lost
        return {}
    # without source lines: the page is a function of the model, not of where estimate() was called
    return {name: explanation.text(sources=False) for name, explanation in explained.items()}


def _info(estimate: Estimate, group: folding.Group, stats: ModuleStats, metrics: list[Metric]) -> list[list[str]]:
    """What hovering an entry shows: one instance's numbers, and the folded total."""
    rows = [["module", group.name or ROOT_LABEL], ["type", stats.type]]
    if len(group.names) > 1:
        rows.append(["instances", f"{len(group.names)} identical ({_span(group.names)}); numbers are per instance"])
    fwd = _forward_prefix(estimate)
    rows += [
        ["params", f"{params_to_string(stats.params)} ({percent(stats.params, estimate.total_params)})"],
        [f"{fwd}MACs", f"{macs_to_string(stats.fwd_macs)} ({percent(stats.fwd_macs, estimate.fwd_macs)})"],
        [f"{fwd}FLOPs", f"{number_to_string(stats.fwd_flops)} ({percent(stats.fwd_flops, estimate.fwd_flops)})"],
    ]
    if estimate.backward:
        ratio = stats.bwd_fwd_ratio
        rows.append(["bwd MACs", f"{macs_to_string(stats.bwd_macs)} ({percent(stats.bwd_macs, estimate.bwd_macs)})"])
        rows.append(["bwd FLOPs", f"{number_to_string(stats.bwd_flops)} ({percent(stats.bwd_flops, estimate.bwd_flops)})"
                     + ("" if ratio is None else f", {ratio:.2f}x fwd")])
    if stats.bytes:
        rows.append(["bytes moved", bytes_to_string(stats.bytes)])
        rows.append(["FLOPs per byte", f"{stats.intensity:.2f}"])
    latency = folding.mean_latency(estimate, group)
    if latency is not None:
        rows.append(["measured latency", duration_to_string(latency)])
        if latency:
            rows.append(["achieved", flops_to_string(stats.fwd_flops / latency)])
    if estimate.prediction is not None and group.name in estimate.prediction.modules:
        predicted = estimate.prediction.modules[group.name]
        rows.append(["predicted latency", f"{duration_to_string(predicted.latency)}, {predicted.bound}-bound"])
    if stats.calls > 1:
        rows.append(["calls", str(stats.calls)])
    also = sorted(alias for alias, name in estimate.aliases.items() if name in group.names)
    if also:
        rows.append(["also called as", ", ".join(also)])
    if stats.extra_repr:
        rows.append(["config", " ".join(stats.extra_repr.split())])
    if len(group.names) > 1:
        totals = ", ".join(f"{m.text(sum(m.value(estimate, n) for n in group.names))} {m.label}"
                           for m in metrics if m.key in ("macs", "params"))
        rows.append([f"all {len(group.names)}", totals])
    return rows


def _finite(value: float) -> float:
    """JSON has no NaN or infinity, and the page's parser would refuse the whole data for one."""
    return value if math.isfinite(value) else 0


def _span(names: tuple[str, ...]) -> str:
    """`h.0.mlp … h.11.mlp`: the first and last instance."""
    return f"{names[0]} \u2026 {names[-1]}"


# --- the static parts of the page ----------------------------------------------------------------


def _header(estimate: Estimate) -> str:
    what = "profile (measured)" if estimate.measurements is not None else "estimate"
    shapes = escape(inputs_text(estimate.input_shapes))
    mode = "" if estimate.training is None else f" · mode {'train' if estimate.training else 'eval'}"
    return (f"<h1>{escape(estimate.model_type)}</h1>"
            f'<p class="sub">fxflops {what} · method {escape(estimate.method)} · conventions '
            f"{escape(estimate.conventions)} · dtype {escape(str(estimate.dtype))}{mode} · inputs {shapes}</p>")


def _cards(estimate: Estimate) -> str:
    fwd = _forward_prefix(estimate)
    cards = [
        (f"{fwd}MACs", macs_to_string(estimate.fwd_macs)),
        (f"{fwd}FLOPs", number_to_string(estimate.fwd_flops)),
        ("params", params_to_string(estimate.total_params)),
    ]
    if estimate.backward:
        cards += [("bwd MACs", macs_to_string(estimate.bwd_macs)), ("bwd FLOPs", number_to_string(estimate.bwd_flops))]
    totals = estimate.attention_totals()
    if totals is not None and totals.differ:
        cards.append((f"attention FLOPs, dense / effective ({', '.join(totals.patterns)})",
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


def _icicle_section(metrics: list[Metric]) -> str:
    buttons = "".join(
        f'<button type="button" role="radio" data-metric="{i}" aria-checked="{"true" if i == 0 else "false"}">'
        f"{escape(m.label)}</button>" for i, m in enumerate(metrics))
    return (f'<div class="metrics" role="radiogroup" aria-label="size by">size by {buttons}</div>'
            '<div id="crumbs" class="crumbs"></div><div id="icicle" class="icicle"></div>'
            '<p class="hint">Click a module to zoom in (and see below why its own ops cost what they do), its '
            'bar at the top (or Escape) to zoom out. '
            "Empty space under a module is its own work (and submodules too thin to draw). Red marks unknown "
            "ops; a module that ran one is kept visible even where it counts nothing.</p>")


def _roofline_section(estimate: Estimate) -> str:
    if estimate.prediction is None:
        return ""
    from fxflops.report.roofline import roofline_svg

    svg = roofline_svg(estimate, estimate.prediction)
    svg = re.sub(r'\s+xmlns="[^"]*"', "", svg, count=1)  # inline SVG needs no namespace reference
    return f'<section id="roofline"><h2>Roofline</h2><div class="roofline">{svg}</div></section>'


def _cautions_section(estimate: Estimate) -> str:
    notes = list(estimate.cautions)
    attention = attention_text(estimate)
    if attention is not None:
        notes.append(f"attention FLOPs: {attention}")
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


def _modules_table(estimate: Estimate) -> str:
    measured = _timed(estimate)
    prediction = estimate.prediction
    fwd = _forward_prefix(estimate)
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
    unknown = _unknown_modules(estimate)
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


def _ops_table(estimate: Estimate) -> str:
    headers = [("op", False), ("nodes", True), *_totals_headers(estimate)]
    unknown = {u.op for u in estimate.unknown}
    return _table("ops", headers, _totals_rows(estimate.by_op, unknown, estimate.backward))


def _rules_table(estimate: Estimate) -> str:
    headers = [("rule", False), ("nodes", True), *_totals_headers(estimate)]
    return _table("rules", headers, _totals_rows(estimate.by_rule, {UNKNOWN_RULE}, estimate.backward))


def _unknown_section(estimate: Estimate) -> str:
    if not estimate.unknown:
        return '<p class="ok">Every op was counted by a rule or declared zero: no unknown ops.</p>'
    rows = [f'<tr class="unknown">{_cell(u.op, None, "name")}{_cell(str(u.count), u.count)}'
            f"{_cell(', '.join(m or ROOT_LABEL for m in u.modules))}</tr>" for u in estimate.unknown]
    return ('<p class="bad">These ops match no rule: their MACs and FLOPs are not in the totals. '
            "Add a rule (see the manual's Writing rules, docs/guide/rules.md) or report them.</p>"
            + _table("unknown", [("op", False), ("nodes", True), ("modules", False)], rows))


_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="fxflops">
<title>{title}</title>
<style>
{style}
</style>
</head>
<body>
<header>{header}</header>
<div class="cards">{cards}</div>
{cautions}
<section id="hierarchy"><h2>Where the compute goes</h2>{icicle}<div id="tooltip" class="tooltip" hidden></div>
<details id="explain-box" open><summary>Why it costs what it does</summary><pre id="explain"></pre></details></section>
{roofline}
<section id="module-table"><h2>Modules</h2>
<input id="filter" type="search" placeholder="filter modules by name or type" aria-label="filter modules">
<div class="scroll">{modules}</div></section>
<section id="op-table"><h2>Ops</h2><div class="scroll">{ops}</div></section>
<section id="rule-table"><h2>Rules</h2><div class="scroll">{rules}</div></section>
<section id="unknown-ops"><h2>Unknown ops</h2>{unknown}</section>
{compare}
<section id="summary"><h2>Summary</h2><pre>{summary}</pre></section>
<script type="application/json" id="fxflops-data">{data}</script>
<script>
{script}
</script>
</body>
</html>
"""
