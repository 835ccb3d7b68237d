"""The manual's rule and preset tables are generated from rules/ when it is built (scripts/mkdocs_hooks.py):
the reference page asks for them, and what the build puts there is scripts/rules_table.py's output."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("marker, generate", [("rules-table", "table"), ("presets-table", "presets_table")])
def test_the_manual_shows_the_tables_generated_from_the_rule_files(marker, generate):
    page = (ROOT / "docs" / "reference" / "rules.md").read_text()
    assert f"<!-- generate: {marker} -->" in page
    hooks = _module(ROOT / "scripts" / "mkdocs_hooks.py", "mkdocs_hooks")
    rendered = hooks.on_page_markdown(page, None, None, None)
    expected = getattr(_module(ROOT / "scripts" / "rules_table.py", "rules_table"), generate)().strip()
    assert expected in rendered and f"<!-- generate: {marker} -->" not in rendered


def test_the_readme_holds_no_stale_copy_of_the_tables():
    readme = (ROOT / "README.md").read_text()
    assert "rules-table:start" not in readme and "presets-table:start" not in readme


def test_the_readme_speed_table_is_the_measured_one():
    """Every row of the README's first-call table, and its geometric means, are benchmarks/results/first_call.md's."""
    readme = (ROOT / "README.md").read_text()
    measured = (ROOT / "benchmarks" / "results" / "first_call.md").read_text().splitlines()
    section = readme.split("## Speed", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|") or line.startswith("Geometric mean")]
    assert rows and all(row in measured for row in rows)
    assert sum(line.startswith("| ") for line in measured) == sum(row.startswith("| ") for row in rows)
