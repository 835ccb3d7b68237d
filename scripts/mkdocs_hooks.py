"""MkDocs hook: fill the manual's generated parts at build time, so they never drift from the code.

A page marks a generated part with an HTML comment on a line of its own:
  <!-- generate: cli-help -->          the `fxflops --help` text, from the argument parser
  <!-- generate: rules-table -->       the rule table, from rules/*.toml (scripts/rules_table.py)
  <!-- generate: presets-table -->     the presets, from rules/presets.toml
  <!-- generate: benchmark NAME -->    benchmarks/results/NAME.md
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = re.compile(r"^<!-- generate: ([\w-]+)(?: ([\w.-]+))? -->$", re.M)


def _rules_table():
    spec = importlib.util.spec_from_file_location("rules_table", ROOT / "scripts" / "rules_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def generated(kind: str, argument: str | None) -> str:
    if kind == "cli-help":
        sys.path.insert(0, str(ROOT))
        from fxflops.cli import build_parser

        parser = build_parser()
        parser.prog = "fxflops"
        return "```text\n" + parser.format_help() + "```"
    if kind == "rules-table":
        return _rules_table().table()
    if kind == "presets-table":
        return _rules_table().presets_table()
    if kind == "benchmark":
        return (ROOT / "benchmarks" / "results" / f"{argument}.md").read_text(encoding="utf-8")
    raise ValueError(f"unknown generated part {kind!r}")


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 - MkDocs' hook signature
    return MARK.sub(lambda match: generated(match.group(1), match.group(2)), markdown)
