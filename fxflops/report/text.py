"""The DeepSpeed-style text report: summary, aggregated profile per depth, detailed module tree.

The layout follows DeepSpeed's Flops Profiler so its users read it without relearning. Beyond
it: the summary says what share of graph nodes a rule counted, declared zero or did not know,
lists the unknown ops, shows cost per rule, and identical numbered repeats fold into one entry.
Latency lines and columns appear exactly when the estimate carries measurements.

This module composes the sections and prints, writes or returns the report. The sections are
`text_summary` (with `text_measured` for a profile's measured lines), `text_aggregated` and
`text_detailed`, sharing the layout of `text_layout`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from fxflops.report.collectives import collective_lines
from fxflops.report.formats import ENCODING_ERRORS, encodable, printable
from fxflops.report.tables import op_table
from fxflops.report.text_aggregated import aggregated_lines
from fxflops.report.text_detailed import detailed_lines
from fxflops.report.text_layout import _rule_line
from fxflops.report.text_summary import summary_lines
from fxflops.results import Estimate


def text(
    estimate: Estimate,
    module_depth: int = -1,
    top_modules: int = 1,
    detailed: bool = True,
    output_file: str | Path | None = None,
    as_string: bool = False,
    fold: bool = True,
    by_rule: bool = True,
) -> str | None:
    """Print the report (DeepSpeed's `print_model_profile` options), write it, or return it.

    module_depth: deepest level shown in both profiles (-1 = all); top_modules: entries per
    depth in the aggregated profile; detailed: include the module tree; output_file: write
    there instead of stdout; as_string: return the text; fold: fold identical numbered repeats;
    by_rule: include the cost-per-rule table under the summary.
    """
    report = render(
        estimate,
        module_depth=module_depth,
        top_modules=top_modules,
        detailed=detailed,
        fold=fold,
        by_rule=by_rule,
    )
    if output_file is not None:
        Path(output_file).write_text(report, encoding="utf-8", errors=ENCODING_ERRORS)
    elif not as_string:
        sys.stdout.write(encodable(report, getattr(sys.stdout, "encoding", None)))
    return report if as_string else None


def render(
    estimate: Estimate,
    *,
    module_depth: int = -1,
    top_modules: int = 1,
    detailed: bool = True,
    fold: bool = True,
    by_rule: bool = True,
) -> str:
    """The whole report as one string."""
    lines = summary_lines(estimate) + collective_lines(estimate)
    if by_rule and (estimate.by_rule or estimate.unknown):
        lines += ["", "Cost per rule:", op_table(estimate, "rule", tablefmt="simple")]
    if top_modules > 0:  # top 0 asks for no aggregated profile, not for empty {} per depth
        lines += [""] + aggregated_lines(estimate, module_depth, top_modules)
    if detailed:
        lines += [""] + detailed_lines(estimate, module_depth, fold)
    lines.append(_rule_line(""))
    return printable("\n".join(lines) + "\n")  # names from the model never drive the terminal
