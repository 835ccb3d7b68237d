"""The report to look at: one self-contained HTML page of an estimate or a profile.

The page holds the summary, an icicle of the module tree (sized by MACs, FLOPs, params, bytes,
measured or predicted latency; click to zoom in and out, hover for numbers), the roofline when a
prediction was asked for, memory over the step (with memory=), the collectives
a parallel rank calls, and sortable tables of modules, ops and rules with unknown ops marked.
Everything is inline — CSS, the data as JSON and hand-written JavaScript — so the file opens
offline in any browser and can be mailed or kept beside the model. Numbers are formatted here, in
Python, by the same functions as the text report, so both read alike; the script only lays out,
sorts and zooms.
"""

from __future__ import annotations

import json
from html import escape
from importlib import resources
from pathlib import Path
from typing import Any

from fxflops.report.formats import ENCODING_ERRORS
from fxflops.report.html_data import icicle_groups, metrics_of
from fxflops.report.html_sections import (
    cards,
    cautions_section,
    compare_section,
    header,
    icicle_section,
    modules_table,
    ops_table,
    roofline_section,
    rules_table,
    unknown_section,
)
from fxflops.report.html_step import collectives_section, memory_section
from fxflops.report.text_summary import summary_lines
from fxflops.results import ROOT_LABEL, Estimate


def to_html(estimate: Estimate, path: str | Path | None = None, fold: bool = True) -> str:
    """The page as text; also written to `path` when given. `fold`: identical numbered repeats are
    one entry of the icicle with a count, as in the text report."""
    metrics = metrics_of(estimate)
    data = {
        "model": estimate.model_type,
        "root": ROOT_LABEL,
        "metrics": [{"key": m.key, "label": m.label} for m in metrics],
        "groups": icicle_groups(estimate, metrics, fold) if "" in estimate.modules else [],
    }
    page = _TEMPLATE.format(
        title=escape(f"fxflops: {estimate.model_type}"),
        style=_asset("report.css"),
        script=_asset("report.js"),
        header=header(estimate),
        cards=cards(estimate),
        icicle=icicle_section(metrics),
        roofline=roofline_section(estimate),
        memory=memory_section(estimate),
        collectives=collectives_section(estimate),
        cautions=cautions_section(estimate),
        summary=escape("\n".join(summary_lines(estimate))),
        modules=modules_table(estimate),
        ops=ops_table(estimate),
        rules=rules_table(estimate),
        unknown=unknown_section(estimate),
        compare=compare_section(estimate),
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
{memory}
{collectives}
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
