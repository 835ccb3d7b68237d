"""Rule files: reading a TOML rule file within its limits, parsing its [[rule]] and [[zero]] tables into
entries, and checking them: formula names against the names their ops give (RuleFileError), op
spellings that name nothing in this torch (RuleFileWarning, with a "did you mean")."""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import inspect
import os
import stat
import sys
import tomllib
import types
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from fxflops.rules.binding import _method_function, _object_spelling, _signatures
from fxflops.rules.entries import (
    CALL_NAMES,
    CONVENTIONS,
    KEPT_PAIRS,
    MAX_FILE_BYTES,
    MAX_NAME,
    PRESET_TABLE,
    Entry,
    Gather,
    OpCall,
    Rule,
    RuleFileError,
    RuleFileWarning,
    RuleSpec,
    ZeroList,
)
from fxflops.rules.formula import Formula, FormulaError, clip


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


_NOT_FILES = {stat.S_ISDIR: "a folder", stat.S_ISFIFO: "a named pipe (FIFO)", stat.S_ISCHR: "a character device",
              stat.S_ISBLK: "a block device", stat.S_ISSOCK: "a socket"}


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        # checked before opening: opening a FIFO waits for a writer, and /dev/zero never ends
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _NOT_FILES.items() if test(mode)), "a special file")
            raise RuleFileError(f"rule file {path} is {kind}, not a file: give a .toml file, or a folder of them")
        with open(path, "rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)  # never more: a huge file is refused, not read
    except FileNotFoundError:
        raise RuleFileError(f"rule file {path} does not exist") from None
    except OSError as error:
        raise RuleFileError(f"rule file {path} cannot be read: {error.strerror or error}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise RuleFileError(
            f"{path}: larger than {MAX_FILE_BYTES // 1024} KiB, the limit for a rule file "
            "(split it, or check it is the file you meant)"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise RuleFileError(
            f"{path}: not UTF-8 text (byte {raw[error.start]:#04x} at offset {error.start}); TOML files are UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise RuleFileError(f"{path}: not valid TOML: arrays or tables nested too deeply") from None
    except ValueError as error:  # TOMLDecodeError, or an integer too long to convert
        raise RuleFileError(f"{path}: not valid TOML: {clip(str(error))}") from None


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


def _quoted(text: str) -> str:
    return clip(repr(text), 60)


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


# --- load-time checks of op spellings and formula names -----------------------------------------
#
# Only what can be looked up cheaply and without importing anything: aten ops (torch.ops.aten), Tensor
# methods, and objects under torch, operator and builtins that are already loaded. Other packages'
# spellings (transformers.X, a user's own module) resolve lazily when their package is imported (see
# RuleTable._resolve_pending), and are not looked at here. The names a module class gives (its
# attributes, set in __init__) are not knowable before an instance exists, so module rules are not
# name-checked.

MAX_SPELLING_WARNINGS = 10  # per file; past it, one warning counts the rest
MAX_SUGGESTIONS = 20  # "did you mean" lookups per file (each compares with ~2,500 names)


def _check_entries(entries: list[Entry], where: Path | str) -> None:
    """RuleFileError for a formula name no op of its rule gives; a RuleFileWarning per entry with op
    spellings that name nothing (so it could never match). `where`: the file, or what gave the entries."""
    unresolved = []
    for entry in entries:
        if isinstance(entry, Rule) and entry.function is None:
            _check_names(entry)
        missing = [op for op in entry.ops if _lookup(op)[0] is False]
        if missing:
            unresolved.append((entry, missing))
    suggestions = MAX_SUGGESTIONS
    for number, (entry, missing) in enumerate(unresolved):
        if number == MAX_SPELLING_WARNINGS:
            warnings.warn(f"{where}: {len(unresolved) - number} more rules or zero lists name ops that do not exist",
                          RuleFileWarning, stacklevel=2)
            break
        shown = []
        for op in missing[:5]:
            shown.append(_did_you_mean(op) if suggestions > 0 else _quoted(op))
            suggestions -= 1
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        kind = "rule" if isinstance(entry, Rule) else "zero list"
        ops = f"op {shown[0]} names" if len(missing) == 1 else f"ops {', '.join(shown)}{more} name"
        warnings.warn(
            f"{entry.label}: {ops} nothing in this torch, so the {kind} never matches "
            f"{'it' if len(missing) == 1 else 'them'}",
            RuleFileWarning, stacklevel=2,
        )


def _check_names(rule: Rule) -> None:
    given = [(op, names) for op in rule.ops if (names := _lookup(op)[1]) is not None]
    if not given:
        return
    fields: list[tuple[str, Formula | None, frozenset[str]]] = [
        ("when", rule.when, CALL_NAMES), ("macs", rule.macs, CALL_NAMES), ("flops", rule.flops, CALL_NAMES | {"macs"}),
    ]
    for preset, (macs, flops) in rule.presets.items():
        fields += [(f"presets.{preset}.macs", macs, CALL_NAMES), (f"presets.{preset}.flops", flops, CALL_NAMES | {"macs"})]
    if rule.effective is not None:
        fields += [("effective_macs", rule.effective[0], CALL_NAMES | {KEPT_PAIRS}),
                   ("effective_flops", rule.effective[1], CALL_NAMES | {KEPT_PAIRS, "macs"})]
    for field_name, formula, extra in fields:
        if formula is None:
            continue
        for name in sorted(formula.names - extra):
            lacking = [(op, names) for op, names in given if name not in names]
            if not lacking:
                continue
            op, names = lacking[0]
            where = f"{rule.label}: '{field_name}'"
            if name == "macs":
                raise RuleFileError(f"{where}: 'macs' is defined only inside 'flops' (it is the rule's MACs)")
            known = sorted(names | extra)
            close = difflib.get_close_matches(name, known, n=1)
            others = f" (nor by {len(lacking) - 1} more of its ops)" if len(lacking) > 1 else ""
            listed = ", ".join(known[:25]) + (", ..." if len(known) > 25 else "")
            raise RuleFileError(
                f"{where}: name '{name}' is not given by {op}{others}; its names are {listed}"
                + (f"; did you mean '{close[0]}'?" if close else "")
            )


@functools.lru_cache(maxsize=4096)
def _lookup(op: str) -> tuple[bool | None, frozenset[str] | None]:
    """(whether the spelling names something, the names a formula gets for it); None where not knowable."""
    head, _, rest = op.partition(".")
    if head == "aten":
        name, _, overload = rest.partition(".")
        packet = _aten_packet(name)
        if packet is None or "." in overload or (overload and overload not in packet.overloads()):
            return False, None
        return True, _schema_names(getattr(packet, overload) if overload else packet)
    if head == "Tensor":
        if "." in rest or not hasattr(torch.Tensor, rest):
            return False, None
        function = _method_function(rest)
        names = _parameter_names(function) if function is not None else frozenset()
        return True, names | {"self", "input"} if names is not None else None
    if head not in ("torch", "operator", "builtins") or op.startswith("torch.ops."):
        return None, None
    found, obj = _find_loaded(op)
    if not found:
        return found, None
    if isinstance(obj, type) and issubclass(obj, torch.nn.Module):
        return True, None  # its attributes exist only once an instance does
    if isinstance(obj, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return True, _schema_names(obj)
    return True, _parameter_names(obj) if callable(obj) else None


def _aten_packet(name: str) -> Any:
    try:
        packet = getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None
    return packet if isinstance(packet, torch._ops.OpOverloadPacket) else None


def _schema_names(op: Any) -> frozenset[str]:
    overloads = [op] if isinstance(op, torch._ops.OpOverload) else [getattr(op, name) for name in op.overloads()]
    return frozenset(argument.name for overload in overloads for argument in overload._schema.arguments)


def _parameter_names(function: Any) -> frozenset[str] | None:
    """Every name some signature of `function` binds (as _bind_function does); None if not knowable."""
    signatures = _signatures(function)
    if not signatures:
        return None
    names = set()
    for signature in signatures:
        for parameter in signature.parameters.values():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                return None  # its keywords are flattened into names: any name may come
            names.add(parameter.name)
    return frozenset(names)


def _find_loaded(spelling: str) -> tuple[bool | None, Any]:
    """(True, the object) for a dotted name found among loaded modules without importing anything;
    (False, None) where it names nothing; (None, None) where only an import could tell."""
    parts = spelling.split(".")
    obj: Any = sys.modules.get(parts[0])
    if obj is None:
        return None, None
    for index in range(1, len(parts)):
        prefix = ".".join(parts[: index + 1])
        if prefix in sys.modules:
            obj = sys.modules[prefix]
        elif isinstance(obj, types.ModuleType):
            if parts[index] in vars(obj):
                obj = vars(obj)[parts[index]]
                continue
            if hasattr(obj, "__path__"):  # a package: the name may be a submodule not imported yet
                try:
                    if importlib.util.find_spec(prefix) is not None:
                        return None, None
                except (ImportError, ValueError):
                    pass
            return False, None
        else:
            try:
                obj = getattr(obj, parts[index])
            except Exception:
                return False, None
    return True, obj


def _did_you_mean(op: str) -> str:
    head, _, rest = op.partition(".")
    if head == "aten":
        prefix, word, candidates = "aten.", rest.partition(".")[0], _aten_names()
    elif head == "Tensor":
        prefix, word, candidates = "Tensor.", rest, [name for name in dir(torch.Tensor) if not name.startswith("__")]
    else:
        parent, _, word = op.rpartition(".")
        found, obj = _find_loaded(parent)
        if not found:
            return _quoted(op)
        prefix, candidates = parent + ".", [name for name in dir(obj) if not name.startswith("_")]
    close = difflib.get_close_matches(word, candidates, n=1)
    return f"{_quoted(op)} (did you mean '{prefix}{close[0]}'?)" if close else _quoted(op)


@functools.cache
def _aten_names() -> tuple[str, ...]:
    names = {name.partition("::")[2].partition(".")[0] for name in torch._C._dispatch_get_all_op_names()
             if name.startswith("aten::")}
    return tuple(sorted(names))
