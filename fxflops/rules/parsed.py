"""The shipped rule files' parsed TOML, kept beside them once per installed version.

Parsing the shipped rule files with tomllib costs ~30 ms, paid by every process's first estimate (a
tiny model's whole estimate is ~20 ms more); the same data read back as JSON costs under 1 ms. The
parse is kept in one JSON file inside the shipped rules folder itself — nowhere else: a user's home
and working folder stay untouched — written on first use where that folder is writable (a checkout,
a virtual environment) and never where it is not (a system install parses, as before). Each file's
entry is keyed by the SHA-256 of its bytes, so an edited rule file is parsed again, never read stale;
a missing, unreadable or damaged cache is the same as none.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

CACHE_FILE = "_parsed.json"  # (kept out of git and out of the wheel; see .gitignore)
_FORMAT = 1


def parsed_files(directory: Path, files: Sequence[Path], read: Callable[[Path], bytes],
                 parse: Callable[[Path, bytes], dict[str, Any]]) -> list[dict[str, Any]]:
    """Each file's TOML data, in order: `read(path)` once, then from the cache where those bytes hash as
    cached, else `parse(path, the same bytes)` (then the cache is rewritten, if the folder lets us)."""
    cache_path = directory / CACHE_FILE
    cached = _read_cache(cache_path)
    fresh: dict[str, Any] = {}
    found = []
    for path in files:
        raw = read(path)
        digest = hashlib.sha256(raw).hexdigest()
        entry = cached.get(path.name)
        hit = isinstance(entry, dict) and entry.get("sha256") == digest and isinstance(entry.get("data"), dict)
        data = entry["data"] if hit else parse(path, raw)
        fresh[path.name] = {"sha256": digest, "data": data}
        found.append(data)
    if fresh != cached:
        _write_cache(cache_path, fresh)
    return found


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            stored = json.load(handle)
    except (OSError, ValueError):  # none yet, unreadable, or damaged: parse
        return {}
    if not isinstance(stored, dict) or stored.get("format") != _FORMAT or not isinstance(stored.get("files"), dict):
        return {}
    return stored["files"]


def _write_cache(path: Path, files: dict[str, Any]) -> None:
    """Written whole to a temporary file and renamed over the old one, so a process reading it at the
    same time sees the old cache or the new one, never half of one."""
    try:
        text = json.dumps({"format": _FORMAT, "files": files}, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # data JSON cannot hold exactly (a TOML date, an infinite float): no cache
        return
    try:
        handle, temporary = tempfile.mkstemp(prefix=CACHE_FILE, suffix=".tmp", dir=path.parent)
    except OSError:  # a read-only install: every process parses
        return
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        # mkstemp makes it private (0600); a shared environment's other users read it as they read the
        # rule files beside it (replacing it needs the folder's permission, not the file's)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except OSError:
        try:
            os.unlink(temporary)
        except OSError:
            pass

