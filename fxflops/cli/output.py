"""What the command writes: the report in the chosen format, the listing of examples, and its warnings.

`render` gives one estimate's text, table, JSON, CSV or HTML report; `render_sweep` a sweep's text,
or a writer that streams its JSON / CSV one point at a time. A stream wrapper escapes what the
terminal's encoding cannot hold. Cautions, and a count that ran the model on made-up inputs, are
said on stderr as `fxflops: warning: ...` lines.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Callable
from typing import TextIO

from fxflops.capture.methods import runs_model
from fxflops.cli import examples
from fxflops.cli.hf_specs import known_checkpoints


def examples_listing() -> str:
    width = max(len(name) for name in examples.EXAMPLES)
    lines = ["Built-in examples (fxflops NAME [--batch N] [--seq-len N] [--set key=value]):"]
    lines += [f"  {name:<{width}}  {example.description}" for name, example in examples.EXAMPLES.items()]
    lines += ["", "Checkpoints hf:NAME builds from their published configs (nothing is downloaded):"]
    lines += textwrap.wrap(", ".join(known_checkpoints()), width=100, initial_indent="  ", subsequent_indent="  ",
                           break_on_hyphens=False)
    return "\n".join(lines) + "\n"


def render(estimate, args: argparse.Namespace) -> str:
    """The report in the requested format."""
    from fxflops.report.machine import to_csv, to_json
    from fxflops.report.tables import tables
    from fxflops.report.text import render as render_text

    if args.format == "json":
        return to_json(estimate, include_nodes=args.nodes)
    if args.format == "csv":
        return to_csv(estimate)
    if args.format == "html":
        from fxflops.report.html import to_html

        return to_html(estimate, fold=args.fold)
    if args.format == "table":
        return tables(estimate, module_depth=args.depth, fold=args.fold, tablefmt=args.tablefmt)
    return render_text(estimate, module_depth=args.depth, top_modules=args.top,
                       detailed=args.detailed, fold=args.fold)


def render_sweep(swept, sweeps: list, args: argparse.Namespace) -> str | Callable[[TextIO], None]:
    """The text report, or a writer that streams the JSON / CSV one point at a time."""
    from fxflops.report import sweep as report

    grid = {name: values for name, _, values in sweeps}
    depth = args.depth if args.depth > 0 else 1
    if args.format == "json":
        return lambda stream: report.write_json(swept, grid, stream, depth=depth, top=args.top)
    if args.format == "csv":
        return lambda stream: report.write_csv(swept, grid, stream)
    return report.render_text(swept.result(grid, depth=depth, top=args.top),
                              tablefmt=args.tablefmt if args.format == "table" else "github")


class _Encodable:
    """A stream whose write() escapes what its encoding cannot hold (a lone surrogate in a module name) and
    control characters (`fxflops.report.formats.printable`)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        from fxflops.report.formats import encodable, printable

        # a terminal shows the report; names from the model never drive it (escape sequences)
        return self._stream.write(encodable(printable(text, keep="\n\t"), getattr(self._stream, "encoding", None)))


def _write_report(report: str | Callable[[TextIO], None], stream: TextIO) -> None:
    if callable(report):
        report(stream)
    else:
        stream.write(report)


def say(message: str) -> None:
    """One `fxflops: ...` line on stderr; what it quotes from the model (names, paths) cannot drive the terminal."""
    from fxflops.report.formats import printable

    sys.stderr.write(f"fxflops: {printable(message)}\n")


def _say_cautions(cautions: list[str], args: argparse.Namespace, shown: str = "") -> None:
    """Each caution as a warning on stderr, but one the report `shown` on the same terminal states already
    (a sweep's "caution:" line, the summary's): the terminal shows it once."""
    from fxflops.report.formats import printable

    if not args.debug:  # with --debug, the CautionWarning itself is shown
        for caution in cautions:
            if printable(caution) not in shown:
                say(f"warning: {caution}")


def on_terminal(report: object, args: argparse.Namespace) -> str:
    """The report's text when it goes to the terminal stderr goes to (no --output), else ""."""
    both = all(getattr(stream, "isatty", lambda: False)() for stream in (sys.stdout, sys.stderr))
    return report if isinstance(report, str) and args.output is None and both else ""


def _say_what_ran_on(result, loaded) -> None:
    """A count that ran the model on inputs fxflops made up is a count for those values: say so."""
    if loaded.made_up is None or not runs_model(result.method):
        return
    result.input_values = loaded.made_up
    if result.attempts:  # the static methods failed: the forward most likely reads tensor values
        how = (f"could only be counted by running it ({result.method}), on {loaded.made_up}; its control flow "
               "or sizes likely depend on tensor values, so the count holds for those values only")
    else:
        how = (f"was counted by running it ({result.method}), on {loaded.made_up}; if its control flow "
               "depends on tensor values, the count holds for those values only")
    say(f"warning: {result.model_type} {how}. For real inputs, return (model, inputs) from the factory.")
