"""The shipped rule files' parse, kept beside them (fxflops/rules/parsed.py): read back exactly, never stale."""

from __future__ import annotations

import json
import stat
import shutil
import tomllib
from pathlib import Path

import pytest

from fxflops.rules.entries import default_rules_dir
from fxflops.rules.files import parse_rule_toml, read_rule_bytes
from fxflops.rules.parsed import CACHE_FILE, parsed_files


def _copy_rules(tmp_path: Path) -> tuple[Path, list[Path]]:
    folder = tmp_path / "rules"
    folder.mkdir()
    for path in sorted(default_rules_dir().glob("*.toml")):
        shutil.copy(path, folder / path.name)
    return folder, sorted(folder.glob("*.toml"))


def _refusing(path: Path, raw: bytes) -> dict:
    raise AssertionError(f"{path.name} was parsed again although its cached parse is current")


def test_cached_parse_equals_tomllib_for_every_shipped_file(tmp_path):
    folder, files = _copy_rules(tmp_path)
    first = parsed_files(folder, files, read_rule_bytes, parse_rule_toml)
    assert (folder / CACHE_FILE).is_file()
    again = parsed_files(folder, files, read_rule_bytes, _refusing)  # every file from the cache now
    for path, data_first, data_again in zip(files, first, again):
        with open(path, "rb") as handle:
            expected = tomllib.load(handle)
        assert data_first == expected, path.name
        assert data_again == expected, path.name  # ints stay ints, floats floats, nesting as it was


def test_an_edited_file_is_parsed_again_and_the_others_are_not(tmp_path):
    folder, files = _copy_rules(tmp_path)
    parsed_files(folder, files, read_rule_bytes, parse_rule_toml)
    edited = folder / "matmul.toml"
    edited.write_text(edited.read_text() + '\n[[zero]]\nops = ["aten.fxflops_test_op"]\n')
    parsed = []

    def parse(path: Path, raw: bytes) -> dict:
        parsed.append(path.name)
        return parse_rule_toml(path, raw)

    data = parsed_files(folder, files, read_rule_bytes, parse)
    assert parsed == ["matmul.toml"]
    assert data[files.index(edited)]["zero"][-1] == {"ops": ["aten.fxflops_test_op"]}
    assert parsed_files(folder, files, read_rule_bytes, _refusing)[files.index(edited)] == data[files.index(edited)]


def _digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("damage", [
    "", "{not json", '{"format": 99, "files": {}}', '[1, 2]',
    '{"format": 1, "files": {"matmul.toml": {"sha256": "0", "data": {}}}}',
    # the right hash, but its data missing or not a table
    '{"format": 1, "files": {"matmul.toml": {"sha256": "HASH"}}}',
    '{"format": 1, "files": {"matmul.toml": {"sha256": "HASH", "data": [1]}}}',
])
def test_a_damaged_or_foreign_cache_is_ignored_and_replaced(tmp_path, damage):
    folder, files = _copy_rules(tmp_path)
    (folder / CACHE_FILE).write_text(damage.replace("HASH", _digest(folder / "matmul.toml")))
    data = parsed_files(folder, files, read_rule_bytes, parse_rule_toml)
    with open(folder / "matmul.toml", "rb") as handle:
        assert data[files.index(folder / "matmul.toml")] == tomllib.load(handle)
    assert json.loads((folder / CACHE_FILE).read_text())["format"] == 1


def test_a_folder_that_refuses_writes_gets_no_cache_and_still_parses(tmp_path, monkeypatch):
    folder, files = _copy_rules(tmp_path)

    def refuse(*args, **kwargs):  # what a read-only install's folder answers (root ignores chmod here)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("fxflops.rules.parsed.tempfile.mkstemp", refuse)
    data = parsed_files(folder, files, read_rule_bytes, parse_rule_toml)
    assert not (folder / CACHE_FILE).exists()
    with open(files[0], "rb") as handle:
        assert data[0] == tomllib.load(handle)


def test_nothing_but_the_cache_file_is_written(tmp_path):
    folder, files = _copy_rules(tmp_path)
    before = sorted(p.name for p in folder.iterdir())
    parsed_files(folder, files, read_rule_bytes, parse_rule_toml)
    assert sorted(p.name for p in folder.iterdir()) == sorted([*before, CACHE_FILE])  # no temporary left behind


def test_the_file_is_hashed_and_parsed_from_one_read(tmp_path):
    """An edit between hashing and parsing cannot file new data under the old bytes' hash."""
    folder, files = _copy_rules(tmp_path)
    edited = folder / "matmul.toml"
    original = edited.read_bytes()

    def parse_after_an_edit(path: Path, raw: bytes) -> dict:
        if path == edited:
            edited.write_bytes(original + b'\n[[zero]]\nops = ["aten.fxflops_late_edit"]\n')
        return parse_rule_toml(path, raw)

    parsed_files(folder, files, read_rule_bytes, parse_after_an_edit)
    stored = json.loads((folder / CACHE_FILE).read_text())["files"]["matmul.toml"]
    assert stored["sha256"] != _digest(edited)  # filed under what was read, so the edit is parsed next time
    edited.write_bytes(original)
    assert stored["data"] == tomllib.loads(original.decode())


def test_the_cache_is_readable_by_everyone_who_reads_the_rules(tmp_path):
    folder, files = _copy_rules(tmp_path)
    parsed_files(folder, files, read_rule_bytes, parse_rule_toml)
    assert stat.S_IMODE((folder / CACHE_FILE).stat().st_mode) == 0o644


def test_the_shipped_table_is_loaded_through_the_cache_beside_the_shipped_rules(monkeypatch, tmp_path):
    from fxflops.rules import table

    folder, _ = _copy_rules(tmp_path)
    monkeypatch.setattr(table, "default_rules_dir", lambda: folder)
    table._shipped_entries.cache_clear()
    try:
        entries = [(type(e).__name__, getattr(e, "name", None), e.ops) for e in table._shipped_entries()]
        assert (folder / CACHE_FILE).is_file()
        assert sorted(p.name for p in folder.iterdir() if not p.name.endswith(".toml")) == [CACHE_FILE]
        table._shipped_entries.cache_clear()
        monkeypatch.setattr(table, "parse_rule_toml", _refusing)  # every file from the cache now
        assert [(type(e).__name__, getattr(e, "name", None), e.ops) for e in table._shipped_entries()] == entries
    finally:
        table._shipped_entries.cache_clear()
