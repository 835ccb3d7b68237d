"""The shipped rule files' parse, kept beside them (fxflops/rules/parsed.py): read back exactly, never stale."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest

from fxflops.rules.entries import default_rules_dir
from fxflops.rules.files import _read_toml
from fxflops.rules.parsed import CACHE_FILE, parsed_files


def _copy_rules(tmp_path: Path) -> tuple[Path, list[Path]]:
    folder = tmp_path / "rules"
    folder.mkdir()
    for path in sorted(default_rules_dir().glob("*.toml")):
        shutil.copy(path, folder / path.name)
    return folder, sorted(folder.glob("*.toml"))


def _refusing(path: Path) -> dict:
    raise AssertionError(f"{path.name} was parsed again although its cached parse is current")


def test_cached_parse_equals_tomllib_for_every_shipped_file(tmp_path):
    folder, files = _copy_rules(tmp_path)
    first = parsed_files(folder, files, _read_toml)
    assert (folder / CACHE_FILE).is_file()
    again = parsed_files(folder, files, _refusing)  # every file from the cache now
    for path, data_first, data_again in zip(files, first, again):
        with open(path, "rb") as handle:
            expected = tomllib.load(handle)
        assert data_first == expected, path.name
        assert data_again == expected, path.name  # ints stay ints, floats floats, nesting as it was


def test_an_edited_file_is_parsed_again_and_the_others_are_not(tmp_path):
    folder, files = _copy_rules(tmp_path)
    parsed_files(folder, files, _read_toml)
    edited = folder / "matmul.toml"
    edited.write_text(edited.read_text() + '\n[[zero]]\nops = ["aten.fxflops_test_op"]\n')
    parsed = []

    def parse(path: Path) -> dict:
        parsed.append(path.name)
        return _read_toml(path)

    data = parsed_files(folder, files, parse)
    assert parsed == ["matmul.toml"]
    assert data[files.index(edited)]["zero"][-1] == {"ops": ["aten.fxflops_test_op"]}
    assert parsed_files(folder, files, _refusing)[files.index(edited)] == data[files.index(edited)]


@pytest.mark.parametrize("damage", ["", "{not json", '{"format": 99, "files": {}}', '[1, 2]',
                                    '{"format": 1, "files": {"matmul.toml": {"sha256": "0", "data": {}}}}'])
def test_a_damaged_or_foreign_cache_is_ignored_and_replaced(tmp_path, damage):
    folder, files = _copy_rules(tmp_path)
    (folder / CACHE_FILE).write_text(damage)
    data = parsed_files(folder, files, _read_toml)
    with open(folder / "matmul.toml", "rb") as handle:
        assert data[files.index(folder / "matmul.toml")] == tomllib.load(handle)
    assert json.loads((folder / CACHE_FILE).read_text())["format"] == 1


def test_a_folder_that_refuses_writes_gets_no_cache_and_still_parses(tmp_path, monkeypatch):
    folder, files = _copy_rules(tmp_path)

    def refuse(*args, **kwargs):  # what a read-only install's folder answers (root ignores chmod here)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("fxflops.rules.parsed.tempfile.mkstemp", refuse)
    data = parsed_files(folder, files, _read_toml)
    assert not (folder / CACHE_FILE).exists()
    with open(files[0], "rb") as handle:
        assert data[0] == tomllib.load(handle)


def test_nothing_but_the_cache_file_is_written(tmp_path):
    folder, files = _copy_rules(tmp_path)
    before = sorted(p.name for p in folder.iterdir())
    parsed_files(folder, files, _read_toml)
    assert sorted(p.name for p in folder.iterdir()) == sorted([*before, CACHE_FILE])  # no temporary left behind
