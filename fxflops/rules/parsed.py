"""The shipped rule files' parse, built with the package and read back instead of parsing them again.

Parsing the shipped rule files with tomllib costs ~30 ms, paid by every process's first estimate (a
tiny model's whole estimate is ~20 ms more); the same data read back as JSON costs a few ms. The parse
ships beside the rule files as rules/_parsed.json, and presets.toml's as rules/_parsed_presets.json
(package data, like them), built by
`python scripts/rules_parse.py` and held current by tests/test_rule_parse_cache.py. Nothing is written
at run time: not into the installed package, not into the user's home or working folder.

Each file's entry is keyed by the SHA-256 of the rule file's bytes, so a rule file edited after the
build is parsed (its bytes no longer match), and sealed by the SHA-256 of that key and the entry's data
as canonical JSON, so an entry edited by hand is parsed from its rule file too (the seal no longer
matches), never trusted. The JSON is read with the rule reader's guards (`read_rule_bytes`): a regular
file only (a FIFO or a device named _parsed.json is not opened), no more than PARSE_LIMIT bytes, nesting
within Python's recursion limit. A parse that fails any of them is no parse: every file is parsed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fxflops.rules.reading import RuleFileError

PARSE_FILE = "_parsed.json"
PRESETS_PARSE_FILE = "_parsed_presets.json"  # presets.toml's alone: read at import, it need not load all rules'
PARSE_LIMIT = 4 * 1024 * 1024  # bytes: the shipped parse is ~110 KiB; read no further
_FORMAT = 2


def parsed_files(directory: Path, files: Sequence[Path], read: Callable[..., bytes],
                 parse: Callable[[Path, bytes], dict[str, Any]], parse_file: str = PARSE_FILE) -> list[dict[str, Any]]:
    """Each file's TOML data, in order: `read(path)` once (`read(path, limit)` reads the parse), then the shipped parse's data where the entry
    for those bytes is intact, else `parse(path, the same bytes)`."""
    shipped = _read_parse(directory / parse_file, read)
    found = []
    for path in files:
        raw = read(path)
        entry = shipped.get(path.name)
        found.append(entry["data"] if _intact(entry, _digest(raw)) else parse(path, raw))
    return found


def build_parse(files: Sequence[Path], read: Callable[[Path], bytes],
                parse: Callable[[Path, bytes], dict[str, Any]]) -> dict[str, Any]:
    """The parse to ship for these rule files (what `python scripts/rules_parse.py` writes)."""
    entries = {}
    for path in files:
        raw = read(path)
        data = parse(path, raw)
        digest = _digest(raw)
        entries[path.name] = {"sha256": digest, "seal": _seal(digest, data), "data": data}
    return {"format": _FORMAT, "files": entries}


def parse_text(parse: dict[str, Any]) -> str:
    """The shipped file's text: sorted keys, one entry per line, so a rebuilt parse diffs by file."""
    # (the data as tomllib ordered it: the seal alone is taken over sorted keys)
    lines = [json.dumps(name, ensure_ascii=False) + ": " + json.dumps(entry, ensure_ascii=False)
             for name, entry in sorted(parse["files"].items())]
    return '{"format": %d, "files": {\n%s\n}}\n' % (parse["format"], ",\n".join(lines))


def _digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def _seal(digest: str, data: Any) -> str:
    canonical = json.dumps([digest, data], sort_keys=True, ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _intact(entry: Any, digest: str) -> bool:
    """Whether a stored entry is the parse of bytes with this digest, unedited since it was built."""
    if not isinstance(entry, dict) or entry.get("sha256") != digest or not isinstance(entry.get("data"), dict):
        return False
    try:
        return entry.get("seal") == _seal(digest, entry["data"])
    except (TypeError, ValueError, RecursionError):  # data JSON cannot hold as it was stored
        return False


def _read_parse(path: Path, read: Callable[[Path, int], bytes]) -> dict[str, Any]:
    """The stored entries by file name; {} for a parse that is missing, no regular file, too large,
    not JSON, nested too deeply or of another format."""
    try:
        raw = read(path, PARSE_LIMIT)
    except RuleFileError:  # none (a checkout before its first build), a FIFO, a device, unreadable
        return {}
    if len(raw) > PARSE_LIMIT:
        return {}
    try:
        stored = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested past the recursion limit
        return {}
    if not isinstance(stored, dict) or stored.get("format") != _FORMAT or not isinstance(stored.get("files"), dict):
        return {}
    return stored["files"]
