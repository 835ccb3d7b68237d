"""The README's rule and preset tables are generated from rules/: keep them equal."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("rules_table", ROOT / "scripts" / "rules_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _section(marker: str) -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index(f"<!-- {marker}:start -->") + len(f"<!-- {marker}:start -->")
    return readme[start:readme.index(f"<!-- {marker}:end -->")].strip()


@pytest.mark.parametrize("marker, generate, command", [
    ("rules-table", "table", "scripts/rules_table.py"),
    ("presets-table", "presets_table", "scripts/rules_table.py presets"),
])
def test_readme_tables_match_the_rule_files(marker, generate, command):
    assert _section(marker) == getattr(_generator(), generate)().strip(), f"run {command} and paste its output"
