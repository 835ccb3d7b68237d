"""The shipped rule files' parse (fxflops/rules/parsed.py): built with the package, held current here, read
back exactly, never written at run time, and never trusted when it is not the parse of the bytes beside it."""

from __future__ import annotations

import json
import os
import shutil
import threading
import tomllib
from pathlib import Path

import pytest
import torch

from fxflops.rules.entries import default_rules_dir
from fxflops.rules.files import parse_rule_toml, read_rule_bytes, rule_files
from fxflops.rules.parsed import PARSE_FILE, PRESETS_PARSE_FILE, build_parse, parse_text, parsed_files
from fxflops.rules.presets import PRESETS_FILE

ROOT = Path(__file__).resolve().parent.parent


def _copy_rules(tmp_path: Path) -> tuple[Path, list[Path]]:
    folder = tmp_path / "rules"
    folder.mkdir()
    for path in sorted(default_rules_dir().glob("*.toml")):
        shutil.copy(path, folder / path.name)
    shutil.copy(default_rules_dir() / PARSE_FILE, folder / PARSE_FILE)
    return folder, rule_files(folder, skip=PRESETS_FILE)


def _refusing(path: Path, raw: bytes) -> dict:
    raise AssertionError(f"{path.name} was parsed again although the shipped parse is current")


def _recording(parsed: list[str]):
    def parse(path: Path, raw: bytes) -> dict:
        parsed.append(path.name)
        return parse_rule_toml(path, raw)
    return parse


@pytest.mark.parametrize("parse_file", [PARSE_FILE, PRESETS_PARSE_FILE])
def test_the_shipped_parse_is_the_parse_of_the_shipped_rule_files(parse_file):
    directory = default_rules_dir()
    files = [directory / PRESETS_FILE] if parse_file == PRESETS_PARSE_FILE else rule_files(directory, skip=PRESETS_FILE)
    expected = parse_text(build_parse(files, read_rule_bytes, parse_rule_toml))
    assert (directory / parse_file).read_text(encoding="utf-8") == expected, (
        f"rules/{parse_file} is not the parse of the files beside it: run `python scripts/rules_parse.py`")


def test_the_shipped_parse_is_read_back_exactly_and_nothing_is_parsed():
    directory = default_rules_dir()
    files = rule_files(directory, skip=PRESETS_FILE)
    found = parsed_files(directory, files, read_rule_bytes, _refusing)
    files.append(directory / PRESETS_FILE)
    found += parsed_files(directory, files[-1:], read_rule_bytes, _refusing, PRESETS_PARSE_FILE)
    for path, data in zip(files, found, strict=True):
        with open(path, "rb") as handle:
            expected = tomllib.load(handle)
        assert data == expected and list(data) == list(expected), path.name  # ints stay ints, order as in the file


def test_the_wheel_ships_the_parse():
    with open(ROOT / "pyproject.toml", "rb") as handle:
        package_data = tomllib.load(handle)["tool"]["setuptools"]["package-data"]["fxflops._rules"]
    assert PARSE_FILE in package_data and PRESETS_PARSE_FILE in package_data


def test_an_edited_rule_file_is_parsed_again_and_the_others_are_not(tmp_path):
    folder, files = _copy_rules(tmp_path)
    edited = folder / "matmul.toml"
    edited.write_text(edited.read_text() + '\n[[zero]]\nname = "t"\nops = ["aten.fxflops_test_op"]\n')
    parsed: list[str] = []
    data = parsed_files(folder, files, read_rule_bytes, _recording(parsed))
    assert parsed == ["matmul.toml"]
    assert data[files.index(edited)]["zero"][-1] == {"name": "t", "ops": ["aten.fxflops_test_op"]}


def _zero_linear(folder: Path) -> None:
    """The issue's edit: the matmul entry's linear rule made to count 0, its key (the file's hash) kept."""
    stored = json.loads((folder / PARSE_FILE).read_text())
    for rule in stored["files"]["matmul.toml"]["data"]["rule"]:
        if "aten.linear" in rule["ops"]:
            rule["macs"] = rule["flops"] = "0"
    (folder / PARSE_FILE).write_text(json.dumps(stored))


def test_an_entry_edited_by_hand_is_not_trusted(tmp_path):
    folder, files = _copy_rules(tmp_path)
    _zero_linear(folder)
    parsed: list[str] = []
    data = parsed_files(folder, files, read_rule_bytes, _recording(parsed))
    assert parsed == ["matmul.toml"]
    with open(folder / "matmul.toml", "rb") as handle:
        assert data[files.index(folder / "matmul.toml")] == tomllib.load(handle)


def test_an_edited_entry_does_not_change_a_count(tmp_path, monkeypatch):
    import fxflops
    from fxflops.rules import table

    folder, _ = _copy_rules(tmp_path)
    _zero_linear(folder)
    monkeypatch.setattr(table, "default_rules_dir", lambda: folder)
    table._shipped_entries.cache_clear()
    try:
        assert fxflops.estimate(torch.nn.Linear(4, 5), input_shape=(2, 4)).total_macs == 2 * 4 * 5
    finally:
        table._shipped_entries.cache_clear()


def _parse_with(folder: Path, files: list[Path]) -> list[dict]:
    """parsed_files in a thread: a reader that blocks (a FIFO) fails the test instead of hanging it."""
    result: list = []
    worker = threading.Thread(target=lambda: result.append(parsed_files(folder, files, read_rule_bytes,
                                                                          parse_rule_toml)), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "reading the parse blocked"
    return result[0]


def _assert_all_parsed(folder: Path, files: list[Path], data: list[dict]) -> None:
    for path, found in zip(files, data):
        with open(path, "rb") as handle:
            assert found == tomllib.load(handle), path.name


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "folder", "deep_json", "huge", "not_utf8"])
def test_a_parse_that_is_no_file_or_too_much_is_ignored_and_every_file_parsed(tmp_path, kind):
    folder, files = _copy_rules(tmp_path)
    target = folder / PARSE_FILE
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "dev_zero":
        target.symlink_to("/dev/zero")
    elif kind == "folder":
        target.mkdir()
    elif kind == "deep_json":
        target.write_text("[" * 200_000 + "]" * 200_000)
    elif kind == "huge":
        target.write_text('{"format": 2, "files": {}, "pad": "' + "x" * (5 * 1024 * 1024) + '"}')
    else:
        target.write_bytes(b'{"format": 2, "files": {"\xff": 1}}')
    _assert_all_parsed(folder, files, _parse_with(folder, files))


@pytest.mark.parametrize("damage", [
    "", "{not json", '{"format": 99, "files": {}}', '[1, 2]', '{"format": 1, "files": {}}',
    '{"format": 2, "files": {"matmul.toml": {"sha256": "0", "seal": "0", "data": {}}}}',
    # the right hash, but the data missing, not a table, or no seal
    '{"format": 2, "files": {"matmul.toml": {"sha256": "HASH"}}}',
    '{"format": 2, "files": {"matmul.toml": {"sha256": "HASH", "data": [1]}}}',
    '{"format": 2, "files": {"matmul.toml": {"sha256": "HASH", "data": {}}}}',
])
def test_a_damaged_or_foreign_parse_is_ignored(tmp_path, damage):
    import hashlib

    folder, files = _copy_rules(tmp_path)
    digest = hashlib.sha256((folder / "matmul.toml").read_bytes()).hexdigest()
    (folder / PARSE_FILE).write_text(damage.replace("HASH", digest))
    _assert_all_parsed(folder, files, _parse_with(folder, files))


def test_nothing_is_written_at_run_time(tmp_path, monkeypatch):
    from fxflops.rules import table

    folder, _ = _copy_rules(tmp_path)
    (folder / PARSE_FILE).unlink()  # even with no parse to read (a checkout before its build)
    before = sorted(p.name for p in folder.iterdir())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr(table, "default_rules_dir", lambda: folder)
    table._shipped_entries.cache_clear()
    try:
        assert table._shipped_entries()
    finally:
        table._shipped_entries.cache_clear()
    assert sorted(p.name for p in folder.iterdir()) == before
    assert not (tmp_path / "cache").exists() and not (tmp_path / "home").exists()


def test_the_shipped_presets_are_the_presets_toml_parsed():
    from fxflops.rules.entries import PRESET_TABLE
    from fxflops.rules.presets import load_presets

    parsed = load_presets(default_rules_dir() / PRESETS_FILE)  # tomllib on the file itself
    assert list(PRESET_TABLE.families.items()) == list(parsed.families.items())
    assert list(PRESET_TABLE.presets) == list(parsed.presets)
    for name, preset in parsed.presets.items():
        shipped = PRESET_TABLE.presets[name]
        assert (shipped.name, shipped.doc, shipped.tool, shipped.whole_modules) == (
            preset.name, preset.doc, preset.tool, preset.whole_modules), name
        assert {f: (t.macs.source, t.flops.source) for f, t in shipped.count.items()} == {
            f: (t.macs.source, t.flops.source) for f, t in preset.count.items()}, name
