"""MkDocs hook: fill the manual's generated parts at build time, so they never drift from the code.

A page marks a generated part with an HTML comment on a line of its own:
  <!-- generate: cli-help -->          the `fxflops --help` text, from the argument parser
  <!-- generate: rules-table -->       the rule table, from rules/*.toml (scripts/rules_table.py)
  <!-- generate: presets-table -->     the presets, from rules/presets.toml
  <!-- generate: peaks-table -->       the devices predict()/--device know, from fxflops/device/peaks.py
  <!-- generate: docstring MODULE -->  a module's docstring (e.g. a JSON schema), as text
  <!-- generate: package-layout -->    every module of fxflops/ with the first line of its docstring
  <!-- generate: benchmark NAME -->    benchmarks/results/NAME.md
"""

from __future__ import annotations

import ast
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


def _package_layout() -> str:
    """A table of fxflops' modules, read with ast (nothing imported), so it follows the code's layout."""
    rows = ["| module | what it does |", "|---|---|"]
    package = ROOT / "fxflops"
    for path in sorted(package.rglob("*.py"), key=lambda path: (path.parent != package, str(path))):
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        first = " ".join(docstring.split("\n\n", 1)[0].split()).replace("|", "\\|")
        rows.append(f"| `{path.relative_to(ROOT).as_posix()}` | {first} |")
    return "\n".join(rows)


def _peaks_table() -> str:
    sys.path.insert(0, str(ROOT))
    from fxflops.device.peaks import GPU_PEAKS

    keys = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8")
    rows = ["| device | " + " | ".join(f"{key} TFLOP/s" for key in keys)
            + " | vector rates where they differ (elementwise ops) | bandwidth TB/s | source |",
            "|---|" + "---:|" * len(keys) + "---|---:|---|"]
    for device in GPU_PEAKS:
        rates = " | ".join(f"{device.flops[key] / 1e12:g}" if key in device.flops else "—" for key in keys)
        vector = ", ".join(f"{key} {rate / 1e12:g}" for key, rate in getattr(device, "vector", {}).items()) or "—"
        rows.append(f"| {device.label} | {rates} | {vector} | {device.bandwidth / 1e12:g} | {device.source} |")
    return "\n".join(rows)


def generated(kind: str, argument: str | None) -> str:
    if kind == "cli-help":
        sys.path.insert(0, str(ROOT))
        from fxflops.cli.parser import build_parser

        parser = build_parser()
        parser.prog = "fxflops"
        return "```text\n" + parser.format_help() + "```"
    if kind == "rules-table":
        return _rules_table().table()
    if kind == "presets-table":
        return _rules_table().presets_table()
    if kind == "docstring":
        sys.path.insert(0, str(ROOT))
        return "```text\n" + importlib.import_module(argument).__doc__.strip() + "\n```"
    if kind == "package-layout":
        return _package_layout()
    if kind == "peaks-table":
        return _peaks_table()
    if kind == "benchmark":
        text = (ROOT / "benchmarks" / "results" / f"{argument}.md").read_text(encoding="utf-8")
        # a results file's own headings sit under the page's section heading: two levels down
        return re.sub(r"^(#+) ", lambda match: "#" * min(len(match.group(1)) + 2, 6) + " ", text, flags=re.M)
    raise ValueError(f"unknown generated part {kind!r}")


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 - MkDocs' hook signature
    return MARK.sub(lambda match: generated(match.group(1), match.group(2)), markdown)
