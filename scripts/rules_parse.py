"""Write rules/_parsed.json and _parsed_presets.json, the shipped rule files' and presets table's parse
(fxflops/rules/parsed.py), after editing one.

Usage: python scripts/rules_parse.py [RULES_FOLDER]       (default: the checkout's rules/)
tests/test_rule_parse_cache.py fails while the shipped parse is not the parse of the rule files beside it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from fxflops.rules.files import parse_rule_toml, read_rule_bytes, rule_files
from fxflops.rules.parsed import PARSE_FILE, PRESETS_PARSE_FILE, build_parse, parse_text
from fxflops.rules.presets import PRESETS_FILE

RULES = Path(__file__).resolve().parent.parent / "rules"


def main(argv: list[str]) -> int:
    directory = Path(argv[0]) if argv else RULES
    files = rule_files(directory, skip=PRESETS_FILE)
    for name, parsed in ((PARSE_FILE, files), (PRESETS_PARSE_FILE, [directory / PRESETS_FILE])):
        target = directory / name
        target.write_text(parse_text(build_parse(parsed, read_rule_bytes, parse_rule_toml)), encoding="utf-8")
        print(f"wrote {target} ({len(parsed)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
