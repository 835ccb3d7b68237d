"""Print the rule table and preset table (markdown) from rules/*.toml, so they never drift.

Usage: python scripts/rules_table.py            the rule table
       python scripts/rules_table.py presets    the preset table
(the manual shows them, generated at build time: scripts/mkdocs_hooks.py; tests/test_readme.py)
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

RULES = Path(__file__).resolve().parent.parent / "rules"
PRESETS = RULES / "presets.toml"


def _code(text: str) -> str:
    return "`" + " ".join(text.split()).replace("|", "\\|") + "`"


def _own_presets(rule: dict) -> str:
    own = rule.get("presets", {})
    parts = []
    for preset, formulas in own.items():
        shown = "; ".join(f"{'MACs' if key == 'macs' else 'FLOPs'} {_code(formulas[key])}"
                          for key in ("macs", "flops") if key in formulas)
        parts.append(f"{preset}: {shown}")
    if "effective_macs" in rule:  # attention's effective reading (estimate(attention="effective"))
        parts.append(f"effective: MACs {_code(rule['effective_macs'])}; FLOPs {_code(rule['effective_flops'])}")
    return "; ".join(parts)


def rows() -> list[str]:
    lines = []
    for path in sorted(RULES.glob("*.toml")):
        if path == PRESETS:
            continue
        data = tomllib.loads(path.read_text())
        for rule in data.get("rule", []):
            ops = rule["ops"]
            shown = ", ".join(f"`{op}`" for op in ops[:3]) + (f" (+{len(ops) - 3})" if len(ops) > 3 else "")
            when = f" when {_code(rule['when'])}" if "when" in rule else ""
            family = rule.get("family", data.get("family", ""))
            lines.append(
                f"| `{rule['name']}`{when} | {path.name} | {family} | {shown} | {_code(rule['macs'])} | "
                f"{_code(rule['flops'])} | {_own_presets(rule)} |"
            )
    return lines


def table() -> str:
    header = [
        "| rule | file | family | matches (first ops) | MACs | FLOPs (deepspeed) | own formulas under a preset, effective attention |",
        "|---|---|---|---|---|---|---|",
    ]
    return "\n".join(header + rows())


def _column(groups: dict[tuple[str, str], list[str]], index: int) -> str:
    """One formula column: the formula, or where families differ each with the families it applies to."""
    formulas: dict[str, list[str]] = {}
    for treatment, families in groups.items():
        formulas.setdefault(treatment[index], []).extend(families)
    if len(formulas) == 1:
        return _code(next(iter(formulas)))
    return "; ".join(f"{_code(formula)} ({', '.join(families)})" for formula, families in formulas.items())


def presets_table() -> str:
    data = tomllib.loads(PRESETS.read_text())
    lines = [
        "| preset | counts (families) | MACs | FLOPs | reproduces |",
        "|---|---|---|---|---|",
    ]
    for name, preset in data["preset"].items():
        groups: dict[tuple[str, str], list[str]] = {}  # (MACs, FLOPs) formulas -> the families counted so
        for family, own in preset["count"].items():
            treatment = (own.get("macs", preset.get("macs", "macs")), own.get("flops", preset.get("flops", "flops")))
            groups.setdefault(treatment, []).append("every family" if family == "*" else family)
        families = ", ".join(family for group in groups.values() for family in group)
        lines.append(f"| `{name}` | {families} | {_column(groups, 0)} | {_column(groups, 1)} | {preset.get('tool', '')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write((presets_table() if sys.argv[1:] == ["presets"] else table()) + "\n")
