"""Rule files: reading a TOML rule file within its limits and parsing its [[rule]] and [[zero]] tables into
entries (and a user's {op: callable} map into rules), each field checked as it is read.

The entries read are then checked by `fxflops.rules.checks`: formula names against the names their ops
give, op spellings that name nothing in this torch."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from fxflops.rules.binding import _object_spelling
from fxflops.rules.checks import _check_entries, _quoted
from fxflops.rules.entries import (
    CONVENTIONS,
    MAX_NAME,
    PRESET_TABLE,
    Entry,
    Gather,
    OpCall,
    Rule,
    RuleFileError,
    RuleSpec,
    ZeroList,
)
from fxflops.rules.formula import Formula, FormulaError, clip
from fxflops.rules.reading import parse_rule_toml, read_rule_bytes


def load_rule_dir(directory: Path, check_ops: bool = True, skip: str | None = None) -> list[Entry]:
    return [entry for path in rule_files(directory, skip) for entry in load_rule_file(path, check_ops)]


def rule_files(directory: Path, skip: str | None = None) -> list[Path]:
    """A folder's rule files (*.toml, less `skip`), in name order; a RuleFileError when there are none."""
    files = sorted(path for path in directory.glob("*.toml") if path.name != skip)
    if not files:
        raise RuleFileError(f"no rule files (*.toml) found in {directory}")
    return files


def load_rule_file(path: str | Path, check_ops: bool = True) -> list[Entry]:
    """A rule file's entries. With `check_ops`, each op spelling is looked up (one that names no op is a
    RuleFileWarning) and each formula's names are checked against the names its ops give (RuleFileError)."""
    path = Path(path)
    return rule_file_entries(_read_toml(path), path, check_ops)


def rule_file_entries(data: dict[str, Any], path: Path, check_ops: bool = True) -> list[Entry]:
    """The entries of a rule file's parsed TOML `data` (see load_rule_file)."""
    unknown_sections = set(data) - {"rule", "zero", "family"}
    if unknown_sections:
        raise RuleFileError(
            f"{path}: unknown top-level keys {_listed(unknown_sections)} "
            "(expected [[rule]], [[zero]] and a default family = \"...\")"
        )
    for section in ("rule", "zero"):
        if not isinstance(data.get(section, []), list):
            raise RuleFileError(f"{path}: '{section}' must be an array of tables, written [[{section}]]")
    family = _family(data["family"], f"{path}: top-level 'family'") if "family" in data else None
    # unchecked (our own files) formulas parse on first use: most ops of a model need few of them
    entries: list[Entry] = [_parse_rule(raw, path, i, family, lazy=not check_ops)
                            for i, raw in enumerate(data.get("rule", []))]
    entries += [_parse_zero(raw, path, i) for i, raw in enumerate(data.get("zero", []))]
    if check_ops:
        _check_entries(entries, path)
    return entries


def _read_toml(path: Path) -> dict[str, Any]:
    return parse_rule_toml(path, read_rule_bytes(path))


def _load_spec(spec: RuleSpec) -> list[Entry]:
    if isinstance(spec, Rule | ZeroList):
        return [spec]  # loaded and checked already
    if isinstance(spec, Mapping):
        rules = [_callable_rule(op, function) for op, function in spec.items()]
        _check_entries(rules, "Python rules")  # their spellings only: a callable has no formula names
        return rules
    if not isinstance(spec, str | Path):
        raise RuleFileError(
            "a rule spec must be a path to a TOML file or folder, an {op: callable} map or a loaded rule; "
            f"got {clip(repr(spec), 60)}"
        )
    path = Path(spec)
    return load_rule_dir(path) if path.is_dir() else load_rule_file(path)


def _callable_rule(op: Any, function: Callable[[OpCall], tuple[int, int]]) -> Rule:
    if not callable(function):
        raise RuleFileError(f"the rule given for {clip(repr(op), 60)} is not callable: {clip(repr(function), 60)}")
    spelling = _parse_ops([op if isinstance(op, str) else _spelling_of(op)], "Python rules")[0]
    name = getattr(function, "__name__", type(function).__name__)
    qualname = getattr(function, "__qualname__", type(function).__qualname__)
    source = f"{getattr(function, '__module__', None) or type(function).__module__}.{qualname}"
    family = getattr(function, "family", None)
    if family is not None:
        family = _family(family, f"the rule given for {clip(repr(op), 60)}: its 'family' attribute")
    return Rule(name=f"user:{name}", ops=(spelling,), source=source, function=function, family=family)


def _spelling_of(op: Any) -> str:
    """A Python rule's key (an op overload, a function, a module class) as a rule file spells it."""
    try:
        return _object_spelling(op)
    except AttributeError:
        raise RuleFileError(
            f"Python rules: a key must be an op name (\"aten.linear\"), an aten op, a function or a module class; "
            f"got {clip(repr(op), 60)}"
        ) from None


def _family(family: Any, where: str) -> str:
    try:
        return PRESET_TABLE.check_family(family, where)
    except ValueError as error:
        raise RuleFileError(str(error)) from None


_ZERO_KEYS = frozenset({"name", "ops", "doc", "moves_data", "gathers"})
_GATHER_KEYS = frozenset({"from", "elements"})
_PRESET_KEYS = frozenset({"macs", "flops"})


_RULE_KEYS = frozenset({"name", "ops", "macs", "flops", "when", "presets", "doc", "family", "gathers",
                        "effective_macs", "effective_flops"})


def _parse_rule(raw: Any, path: Path, index: int, family: str | None = None, lazy: bool = False) -> Rule:
    where = f"{path}: rule #{index + 1}"
    if not isinstance(raw, dict):
        raise RuleFileError(f"{where}: expected a table, got {clip(repr(raw), 60)}")
    name = _parse_name(raw, where)
    where = f"{path}: rule '{name}'"
    _refuse_unknown_keys(raw, _RULE_KEYS, where)
    if "family" in raw:
        family = _family(raw["family"], where)
    ops = _parse_ops(raw.get("ops"), where)
    for key in ("macs", "flops"):
        if key not in raw:
            raise RuleFileError(f"{where}: missing '{key}' formula")
    if not isinstance(raw.get("doc", ""), str):
        raise RuleFileError(f"{where}: 'doc' must be a string")
    macs, flops = _formula(raw["macs"], where, "macs", lazy), _formula(raw["flops"], where, "flops", lazy)
    when = raw.get("when")
    return Rule(
        name=name,
        ops=ops,
        source=str(path),
        macs=macs,
        flops=flops,
        when=_formula(when, where, "when", lazy) if when is not None else None,
        presets=_parse_presets(raw.get("presets", {}), where, {"macs": macs, "flops": flops}, lazy),
        family=family,
        effective=_parse_effective(raw, where, lazy),
        gathers=_parse_gathers(raw.get("gathers"), where, lazy),
    )


def _parse_effective(raw: dict, where: str, lazy: bool = False) -> tuple[Formula, Formula] | None:
    """The rule's effective (macs, flops), both or neither."""
    given = [key for key in ("effective_macs", "effective_flops") if key in raw]
    if not given:
        return None
    if len(given) == 1:
        missing = "effective_flops" if given == ["effective_macs"] else "effective_macs"
        raise RuleFileError(f"{where}: '{given[0]}' without '{missing}': give both or neither")
    return (_formula(raw["effective_macs"], where, "effective_macs", lazy),
            _formula(raw["effective_flops"], where, "effective_flops", lazy))


def _parse_gathers(raw: Any, where: str, lazy: bool = False) -> Gather | None:
    """`gathers = { from = "weight", elements = "numel(out)" }`: the argument a lookup reads rows of, and
    how many of its elements it reads (default: one per output element)."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("from"), str):
        raise RuleFileError(f"{where}: 'gathers' must be a table naming the argument read, "
                            f"e.g. {{ from = \"weight\", elements = \"numel(out)\" }}")
    _refuse_unknown_keys(raw, _GATHER_KEYS, f"{where}: 'gathers'")
    return Gather(source=raw["from"], elements=_formula(raw.get("elements", "numel(out)"), where, "gathers.elements", lazy))


def _parse_presets(presets: Any, where: str, own: Mapping[str, Formula],
                   lazy: bool = False) -> dict[str, tuple[Formula, Formula]]:
    """Each preset's (macs, flops): its own formula where it gives one, else the rule's (the same object)."""
    if not isinstance(presets, dict):
        raise RuleFileError(f"{where}: 'presets' must be a table of presets, e.g. presets.torch = {{ flops = \"0\" }}")
    parsed = {}
    for preset, formulas in presets.items():
        if preset not in CONVENTIONS:
            raise RuleFileError(f"{where}: unknown preset {_quoted(preset)} (known: {', '.join(CONVENTIONS)})")
        field_name = f"presets.{preset}"
        if not isinstance(formulas, dict):
            raise RuleFileError(f"{where}: '{field_name}' must be a table of formulas, e.g. {{ flops = \"0\" }}")
        _refuse_unknown_keys(formulas, _PRESET_KEYS, f"{where}: '{field_name}'")
        merged = {key: _formula(formulas[key], where, f"{field_name}.{key}", lazy) if key in formulas else own[key]
                  for key in ("macs", "flops")}
        parsed[preset] = (merged["macs"], merged["flops"])
    return parsed


def _parse_zero(raw: Any, path: Path, index: int) -> ZeroList:
    where = f"{path}: zero list #{index + 1}"
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise RuleFileError(f"{where}: expected a table with a 'name' and 'ops'")
    where = f"{path}: zero list '{_parse_name(raw, where)}'"
    _refuse_unknown_keys(raw, _ZERO_KEYS, where)
    moves_data = raw.get("moves_data", True)
    if not isinstance(moves_data, bool):
        raise RuleFileError(f"{where}: 'moves_data' must be true or false, got {clip(repr(moves_data), 60)}")
    return ZeroList(name=raw["name"], ops=_parse_ops(raw.get("ops"), where), source=str(path), moves_data=moves_data,
                    gathers=_parse_gathers(raw.get("gathers"), where))


def _parse_name(raw: dict, where: str) -> str:
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise RuleFileError(f"{where}: missing 'name'")
    if len(name) > MAX_NAME or not name.isprintable():
        raise RuleFileError(f"{where}: 'name' must be printable and at most {MAX_NAME} characters, got {clip(repr(name), 60)}")
    return name


def _refuse_unknown_keys(table: dict, allowed: frozenset[str], where: str) -> None:
    unknown = set(table) - allowed
    if unknown:
        guesses = [f"'{close[0]}' for {_quoted(key)}" for key in sorted(unknown)[:5]
                   if (close := difflib.get_close_matches(key, allowed, n=1))]
        hint = f"; did you mean {', '.join(guesses)}?" if guesses else ""
        raise RuleFileError(f"{where}: unknown keys {_listed(unknown)} (allowed: {', '.join(sorted(allowed))}){hint}")


def _listed(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    return "[" + ", ".join(_quoted(key) for key in keys[:5]) + (f", ... {len(keys) - 5} more" if len(keys) > 5 else "") + "]"


def _parse_ops(ops: Any, where: str) -> tuple[str, ...]:
    if not isinstance(ops, list) or not ops or not all(isinstance(op, str) and op for op in ops):
        raise RuleFileError(f"{where}: 'ops' must be a non-empty list of op names")
    for op in ops:
        if len(op) > MAX_NAME or not op.isprintable():
            raise RuleFileError(f"{where}: op {_quoted(op)} is not an op name (printable, at most {MAX_NAME} characters)")
        if "." not in op:
            raise RuleFileError(
                f"{where}: op {_quoted(op)} is not a qualified name "
                "(write aten.NAME, Tensor.NAME, operator.NAME, torch.nn.functional.NAME or module.Class)"
            )
    return tuple(ops)


def _formula(source: Any, where: str, field_name: str, lazy: bool = False) -> Formula:
    try:
        return Formula(source, lazy=lazy)
    except FormulaError as error:
        raise RuleFileError(f"{where}: '{field_name}': {error}") from None
