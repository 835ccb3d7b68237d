"""Print the README's rule table (markdown) from rules/*.toml, so the two never drift apart.

Usage: python scripts/rules_table.py   (tests/test_readme.py checks the README holds its output)
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

RULES = Path(__file__).resolve().parent.parent / "rules"


def _code(text: str) -> str:
    return "`" + " ".join(text.split()).replace("|", "\\|") + "`"


def _torch_column(rule: dict) -> str:
    override = rule.get("presets", {}).get("torch", {})
    if not override:
        return "same"
    parts = [f"{key} {_code(override[key])}" for key in ("macs", "flops") if key in override]
    return "; ".join(parts).replace("macs ", "MACs ").replace("flops ", "FLOPs ")


def rows() -> list[str]:
    lines = []
    for path in sorted(RULES.glob("*.toml")):
        for rule in tomllib.loads(path.read_text()).get("rule", []):
            ops = rule["ops"]
            shown = ", ".join(f"`{op}`" for op in ops[:3]) + (f" (+{len(ops) - 3})" if len(ops) > 3 else "")
            when = f" when {_code(rule['when'])}" if "when" in rule else ""
            lines.append(
                f"| `{rule['name']}`{when} | {path.name} | {shown} | {_code(rule['macs'])} | "
                f"{_code(rule['flops'])} | {_torch_column(rule)} |"
            )
    return lines


def table() -> str:
    header = [
        "| rule | file | matches (first ops) | MACs | FLOPs (deepspeed) | torch preset |",
        "|---|---|---|---|---|---|",
    ]
    return "\n".join(header + rows())


if __name__ == "__main__":
    sys.stdout.write(table() + "\n")
