"""The README's rule table is generated from rules/: keep them equal."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_rule_table_matches_the_rule_files():
    spec = importlib.util.spec_from_file_location("rules_table", ROOT / "scripts" / "rules_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    readme = (ROOT / "README.md").read_text()
    start = readme.index("<!-- rules-table:start -->") + len("<!-- rules-table:start -->")
    end = readme.index("<!-- rules-table:end -->")
    assert readme[start:end].strip() == module.table().strip(), "run scripts/rules_table.py and paste its output"


def test_readme_preset_table_matches_the_preset_file():
    spec = importlib.util.spec_from_file_location("rules_table", ROOT / "scripts" / "rules_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    readme = (ROOT / "README.md").read_text()
    start = readme.index("<!-- presets-table:start -->") + len("<!-- presets-table:start -->")
    end = readme.index("<!-- presets-table:end -->")
    assert readme[start:end].strip() == module.presets_table().strip(), "run scripts/rules_table.py presets"
