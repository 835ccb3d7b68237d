"""The rule table: load rule files, match an op call to a rule, bind its arguments to names.

A rule names the ops it counts and gives MAC and FLOP formulas (see `fxflops.formula`). Ops are
spelled as aten ops (`aten.convolution`), torch functions (`torch.nn.functional.conv2d`), tensor
methods (`Tensor.matmul`), operators (`operator.matmul`) or module classes (`torch.nn.Conv2d`).
Zero lists declare ops that are known to cost nothing, so they are never reported as unknown.

Every rule belongs to an op family (its own `family`, else its file's top-level `family`); the
counting presets of rules/presets.toml (`fxflops.presets`) say which families each counts and how
its MACs and FLOPs follow from the rule's. A user rule that names no family takes the family of the
rule it replaces for that call, or "other".
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import importlib.util
import inspect
import operator
import os
import stat
import sys
import tomllib
import types
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fxflops.formula import Formula, FormulaError, clip
from fxflops.presets import OTHER, PRESETS_FILE, Preset, PresetTable, load_presets


MAX_FILE_BYTES = 256 * 1024  # a rule file (the shipped ones are under 25 KiB; one at the limit loads in ~0.3 s); read no further
MAX_NAME = 200  # characters of a rule's name or of an op's spelling (they are quoted in messages)

# names a formula has besides the op's own: the output, the positional and keyword arguments as given
# `within`: the class name of the innermost module the call ran in ("" at the top), for conventions
# that count a module's hook and a function it calls separately (ptflops' pytorch backend)
CALL_NAMES = frozenset({"out", "args", "kwargs", "within"})
KEPT_PAIRS = "kept_pairs"  # the name effective_* formulas read: (query, key) pairs the mask keeps


class RuleFileError(ValueError):
    """A rule file that cannot be used: names the file, the rule and the problem."""


class RuleFileWarning(UserWarning):
    """A rule file that loads but looks mistaken: an op spelling that names no op, so it never matches."""


class RuleEvaluationError(RuntimeError):
    """A rule failed on an actual op call: names the rule (file and rule, or the Python callable), the
    field (macs, flops, when, presets.torch.flops, ...), the op and the module."""

    def __init__(self, rule: str, field: str | None, op: str, problem: str, module: str | None = None) -> None:
        self.rule, self.field, self.op, self.problem, self.module = rule, field, op, problem, module
        where = f"{rule}: '{field}'" if field else rule
        in_module = f" in module '{module}'" if module is not None else ""
        super().__init__(
            f"{where} failed on {op}{in_module}: {problem}. "
            "Fix the rule, or override it with a rule of your own for this op."
        )

    def in_module(self, module: str) -> RuleEvaluationError:
        """The same error, naming the module whose op call it failed on."""
        return RuleEvaluationError(self.rule, self.field, self.op, self.problem, module)


@dataclass(frozen=True)
class OpCall:
    """One call of an op as a rule sees it: the op, its bound arguments and its output."""

    key: str  # canonical op name, e.g. "aten.linear.default"
    kind: str  # "aten" | "function" | "method" | "module"
    target: Any
    names: Mapping[str, Any]  # argument (or module attribute) name -> value
    out: Any
    module: torch.nn.Module | None = None
    conventions: str = "deepspeed"  # the preset counting this call (what a callable rule reads)
    within: str = ""  # the class name of the innermost module the call ran in (a module call: its own)


@dataclass(frozen=True)
class Gather:
    """A lookup's reads of its table: `elements` (a formula) of the argument named `source`, not all of it.

    An embedding of 128 tokens reads 128 rows of its table; the bytes it moves count those rows."""

    source: str
    elements: Formula

    def read(self, call: OpCall, label: str) -> tuple[Any, Any] | None:
        """(the table's value, the elements read from it), or None when the argument is not a tensor."""
        table = call.names.get(self.source)
        if not isinstance(table, torch.Tensor):
            return None
        try:
            return table, check_count(self.elements.evaluate(_formula_names(call)))
        except (FormulaError, ValueError, TypeError) as error:
            raise RuleEvaluationError(label, "gathers.elements", call.key, str(error)) from None


@dataclass(frozen=True, eq=False)
class Rule:
    name: str
    ops: tuple[str, ...]
    source: str  # the rule file, or for a Python callable its module.qualname
    macs: Formula | None = None
    flops: Formula | None = None
    when: Formula | None = None
    presets: Mapping[str, tuple[Formula, Formula]] = field(default_factory=dict)  # preset -> its own formulas
    function: Callable[[OpCall], tuple[int, int]] | None = None
    family: str | None = None  # None: a user rule's, resolved per call by RuleTable.family
    # attention's effective reading: (macs, flops) over the (query, key) pairs a mask keeps, which the
    # formulas read as `kept_pairs` (fxflops.kept_pairs); None: the rule has one reading
    effective: tuple[Formula, Formula] | None = None
    gathers: Gather | None = None  # a lookup: it reads only some rows of one argument

    @property
    def label(self) -> str:
        """Where the rule is, as error messages name it."""
        return f"Python rule {self.source}" if self.function is not None else f"{self.source}: rule '{self.name}'"

    def applies(self, call: OpCall) -> bool:
        if self.when is None:
            return True
        return self._evaluate(self.when, "when", _formula_names(call), call, _truth)

    def cost(self, call: OpCall, preset: Preset, family: str) -> tuple[Any, Any]:
        """(MACs, FLOPs) of this call under `preset`, for an op of `family`: non-negative ints, or
        symbolic sizes.

        The rule's own `presets.NAME` formulas, where it has them, are its count under that preset;
        otherwise the preset keeps or drops the rule's counts by family and derives its MACs and FLOPs
        from them. A callable gives the rule's counts (it may read call.conventions). Raises
        RuleEvaluationError naming the rule, the field and the op when a formula fails or gives
        something that is not a count."""
        override = self.presets.get(preset.name)
        if override is not None:
            return self._counts(override, call, preset.name)
        if not preset.counts(family):
            return 0, 0
        if self.function is not None:
            macs, flops = self._call_function(dataclasses.replace(call, conventions=preset.name))
        else:
            macs, flops = self._counts((self.macs, self.flops), call, preset.name)
        return self._preset_counts(preset, family, macs, flops, call)

    def effective_cost(self, call: OpCall, preset: Preset, family: str, kept_pairs: Any) -> tuple[Any, Any]:
        """(MACs, FLOPs) of this call counting only the `kept_pairs` (query, key) pairs its mask keeps,
        under `preset` as `cost` counts the dense reading (the rule's `effective_*` formulas)."""
        if self.effective is None:
            raise ValueError(f"{self.label} has no effective formulas")
        if not preset.counts(family):
            return 0, 0
        call = dataclasses.replace(call, names={**call.names, KEPT_PAIRS: kept_pairs})
        macs, flops = self._counts(self.effective, call, preset.name)
        return self._preset_counts(preset, family, macs, flops, call)

    def _preset_counts(self, preset: Preset, family: str, macs: Any, flops: Any, call: OpCall) -> tuple[Any, Any]:
        """The preset's counts from the rule's, checked like the rule's own (ptflops' macs + extra goes
        negative for a rule whose FLOPs are fewer than its MACs)."""
        counts = preset.apply(family, macs, flops)
        for field_name, value in zip(("macs", "flops"), counts):
            try:
                check_count(value)
            except (ValueError, TypeError) as error:
                raise RuleEvaluationError(self.label, f"{field_name} under preset {preset.name} (family {family})",
                                          call.key, f"the preset's formula gave {error}") from None
        return counts

    def _counts(self, formulas: tuple[Formula, Formula], call: OpCall, conventions: str) -> tuple[Any, Any]:
        macs_formula, flops_formula = formulas
        names = dict(_formula_names(call))
        macs = self._evaluate(macs_formula, self._field("macs", macs_formula, conventions), names, call, check_count)
        names["macs"] = macs
        flops = self._evaluate(flops_formula, self._field("flops", flops_formula, conventions), names, call, check_count)
        return macs, flops

    def _field(self, key: str, formula: Formula, conventions: str) -> str:
        # a preset's formula is the rule's own unless the preset gives its own
        if self.effective is not None and formula is self.effective[key == "flops"]:
            return f"effective_{key}"
        return key if formula is getattr(self, key) else f"presets.{conventions}.{key}"

    def _evaluate(self, formula: Formula, field_name: str, names: Mapping[str, Any], call: OpCall,
                  check: Callable[[Any], Any]) -> Any:
        try:
            value = formula.evaluate(names)
            try:
                return check(value)
            except Exception as error:  # noqa: BLE001 - whatever the check met, said as the formula's result
                raise FormulaError(f"formula {clip(repr(formula.source))} gave {error}") from None
        except FormulaError as error:
            raise RuleEvaluationError(self.label, field_name, call.key, str(error)) from None

    def _call_function(self, call: OpCall) -> tuple[Any, Any]:
        try:
            result = self.function(call)  # type: ignore[misc]
        except Exception as error:  # the user's code: keep its traceback as the cause
            raise RuleEvaluationError(self.label, None, call.key, f"{type(error).__name__}: {clip(str(error))}") from error
        if not isinstance(result, tuple | list) or len(result) != 2:
            raise RuleEvaluationError(self.label, None, call.key,
                                      f"it returned {clip(repr(result), 60)}, not a (macs, flops) pair")
        counts = []
        for field_name, value in zip(("macs", "flops"), result):
            try:
                counts.append(check_count(value))
            except (ValueError, TypeError) as error:
                raise RuleEvaluationError(self.label, field_name, call.key, f"it returned {error}") from None
        return counts[0], counts[1]


def _truth(value: Any) -> bool:
    try:
        return bool(value)
    except Exception as error:  # noqa: BLE001 - a tensor's or an undecidable size's truth
        raise ValueError(f"{clip(repr(value), 60)}, which is neither true nor false ({type(error).__name__})") from None


def check_count(value: Any) -> Any:
    """A MAC or FLOP count as an int, if `value` is one: a non-negative integer (or a float holding
    one), or a symbolic size, whose sign cannot be known here. Raises ValueError saying what it is."""
    if isinstance(value, torch.SymInt | torch.SymFloat):
        return value
    if isinstance(value, float) and value.is_integer():  # finite: inf and nan are not integers
        value = int(value)
    if isinstance(value, bool) or not hasattr(type(value), "__index__") or isinstance(value, torch.Tensor):
        hint = " (use // or int() for a division)" if isinstance(value, float) else ""
        raise ValueError(f"{clip(repr(value), 60)} (a {type(value).__name__}), not a count: "
                         f"MACs and FLOPs must be non-negative integers{hint}")
    count = operator.index(value)
    if count < 0:
        raise ValueError(f"{count}, a negative count: MACs and FLOPs must be non-negative integers")
    return count


@dataclass(frozen=True)
class ZeroList:
    """Ops known to do no arithmetic worth counting (views, casts, indexing, ...)."""

    name: str
    ops: tuple[str, ...]
    source: str
    moves_data: bool = True  # False: views and plumbing, which read and write no tensor memory
    gathers: Gather | None = None  # a lookup: it reads only some rows of one argument

    @property
    def label(self) -> str:
        return f"{self.source}: zero list '{self.name}'"


Entry = Rule | ZeroList
# a rule file or folder, an {op: callable} map, or an entry already loaded (load_rule_file's)
RuleSpec = str | Path | Mapping[Any, Callable[[OpCall], tuple[int, int]]] | Rule | ZeroList


class RuleTable:
    """Rules indexed by what they match. The user's entries (from `user_from` on) come before ours, the
    latest first; within ours, an exact overload's entry before its packet's, then the latest file's.

    Spellings of Python objects (torch.nn.Linear, transformers.X) are resolved to the objects only
    once their top-level package has been imported: until then no such object can be in a graph, and
    resolving them would import it (transformers costs a second).
    """

    def __init__(self, entries: Iterable[Entry], user_from: int | None = None) -> None:
        self._user_from = user_from  # the order of the first user entry (None: no tier split)
        self._modules_seen = 0
        entries = list(entries)
        shipped = _shipped_entries()
        # the shipped entries' index is built once per process (1,500 spellings: ~10 ms per estimate)
        start = len(shipped) if entries[: len(shipped)] == list(shipped) else 0
        by_key, pending = _shipped_index() if start else ({}, ())
        self._by_key: dict[Any, list[tuple[int, Entry]]] = {key: list(found) for key, found in by_key.items()}
        self._pending: list[tuple[int, str, Entry]] = list(pending)  # object spellings not resolved yet
        _index_into(self._by_key, self._pending, entries[start:], start)

    def _add(self, key: Any, order: int, entry: Entry) -> None:
        entries = self._by_key.setdefault(key, [])
        entries.append((order, entry))
        entries.sort(key=lambda item: -item[0])  # the latest rule first

    def _resolve_pending(self) -> None:
        if len(sys.modules) == self._modules_seen:
            return
        self._modules_seen = len(sys.modules)
        still = []
        for order, op, entry in self._pending:
            if op.partition(".")[0] not in sys.modules:
                still.append((order, op, entry))
                continue
            resolved = _resolve(op)
            if resolved is not None:
                self._add(("object", resolved), order, entry)
        self._pending = still

    def _candidates(self, call: OpCall) -> list[Entry]:
        """The entries naming this call's op, in the order they are tried: a user's rule for the packet
        (aten.index_put) overrides our rule for one overload (aten.index_put.default)."""
        if call.kind in ("function", "module"):
            self._resolve_pending()
        ranked: dict[int, tuple[bool, int, int, Entry]] = {}
        for rank, key in enumerate(_match_keys_for_call(call)):
            for order, entry in self._by_key.get(key, ()):
                user = self._user_from is not None and order >= self._user_from
                ranked.setdefault(id(entry), (not user, rank, -order, entry))
        return [item[3] for item in sorted(ranked.values(), key=lambda item: item[:3])]

    def match(self, call: OpCall) -> Entry | None:
        """The first entry whose ops include this call's op and whose `when` holds."""
        for entry in self._candidates(call):
            if isinstance(entry, ZeroList) or entry.applies(call):
                return entry
        return None

    def family(self, rule: Rule, call: OpCall) -> str:
        """The rule's family; for a user rule that names none, the family of the rule it replaces for
        this call (the next that would have counted it), else "other"."""
        if rule.family is not None:
            return rule.family
        below = False
        for entry in self._candidates(call):
            if entry is rule:
                below = True
            elif below and isinstance(entry, ZeroList):
                return OTHER
            elif below and entry.family is not None and entry.applies(call):
                return entry.family
        return OTHER

    def cost(self, rule: Rule, call: OpCall, conventions: str) -> tuple[Any, Any]:
        """(MACs, FLOPs) of a call `rule` matched, under the preset named `conventions`."""
        return rule.cost(call, preset(conventions), self.family(rule, call))

    def effective_cost(self, rule: Rule, call: OpCall, conventions: str, kept_pairs: Any) -> tuple[Any, Any]:
        """(MACs, FLOPs) of an attention call over the `kept_pairs` pairs its mask keeps (see Rule.effective_cost)."""
        return rule.effective_cost(call, preset(conventions), self.family(rule, call), kept_pairs)

    def knows_op(self, op: Any, function: Any = None) -> bool:
        """Whether some rule or zero list names this aten op (an OpOverload), by overload or packet, or
        the Python builtin that called it (`function`: torch.linalg.multi_dot, Tensor.inner)."""
        key = aten_key(op)
        if ("aten", key) in self._by_key or ("aten", key.rsplit(".", 1)[0]) in self._by_key:
            return True
        if function is None:
            return False
        self._resolve_pending()
        return (("object", function) in self._by_key or ("name", function_key(function)) in self._by_key
                or ("method", getattr(function, "__name__", "")) in self._by_key)

    def knows_module(self, module: torch.nn.Module) -> bool:
        """Whether some rule counts this module class as a whole (so tracing keeps it a leaf)."""
        self._resolve_pending()
        return any(("object", cls) in self._by_key for cls in type(module).__mro__)


def _index_into(by_key: dict[Any, list[tuple[int, Entry]]], pending: list[tuple[int, str, Entry]],
                entries: Iterable[Entry], start: int) -> None:
    for order, entry in enumerate(entries, start):
        for op in entry.ops:
            for key in _match_keys_for_spelling(op):
                by_key.setdefault(key, []).insert(0, (order, entry))  # the latest rule first
            if _names_an_object(op):
                pending.append((order, op, entry))


@functools.cache
def _shipped_index() -> tuple[Mapping[Any, tuple[tuple[int, Entry], ...]], tuple[tuple[int, str, Entry], ...]]:
    """The shipped entries indexed as RuleTable indexes them, frozen (each table copies it)."""
    by_key: dict[Any, list[tuple[int, Entry]]] = {}
    pending: list[tuple[int, str, Entry]] = []
    _index_into(by_key, pending, _shipped_entries(), 0)
    return types.MappingProxyType({key: tuple(found) for key, found in by_key.items()}), tuple(pending)


def default_rules_dir() -> Path:
    """The shipped rules/: inside the installed wheel (fxflops/_rules), or at the top of a checkout."""
    here = Path(__file__).resolve().parent
    installed = here / "_rules"
    return installed if any(installed.glob("*.toml")) else here.parent / "rules"


PRESET_TABLE: PresetTable = load_presets(default_rules_dir() / PRESETS_FILE)
CONVENTIONS: tuple[str, ...] = tuple(PRESET_TABLE.presets)  # the preset names, as rules/presets.toml lists them
FAMILIES: tuple[str, ...] = tuple(PRESET_TABLE.families)


def preset(conventions: str) -> Preset:
    """The preset called `conventions`; a ValueError listing the valid ones for any other name."""
    return PRESET_TABLE.get(conventions)


def load_table(extra: Iterable[RuleSpec] | RuleSpec | None = None) -> RuleTable:
    """Our rules plus the user's (TOML files, folders of them, or {op: callable} maps)."""
    return table_with(load_user_entries(extra))


def table_with(user_entries: Iterable[Entry]) -> RuleTable:
    """Our rules plus entries already loaded (so each user file is read once per call)."""
    shipped = _shipped_entries()
    return RuleTable([*shipped, *user_entries], user_from=len(shipped))


def load_user_entries(extra: Iterable[RuleSpec] | RuleSpec | None) -> list[Entry]:
    """The entries of the user's rule specs alone, in the order given, each file read once and checked:
    structure and formulas (RuleFileError), op spellings that name nothing (RuleFileWarning)."""
    if extra is None:
        return []
    if isinstance(extra, str | Path | Mapping):
        extra = [extra]
    return [entry for spec in extra for entry in _load_spec(spec)]


@functools.cache
def _shipped_entries() -> tuple[Entry, ...]:
    # parsed once per process: the shipped files do not change while it runs, and entries are frozen.
    # Their op spellings and formula names are checked by the test suite (check_ops=True), not here:
    # that costs ~100 ms of signature lookups at every start, and could only warn users about our files.
    return tuple(load_rule_dir(default_rules_dir(), check_ops=False, skip=PRESETS_FILE))


def load_rule_dir(directory: Path, check_ops: bool = True, skip: str | None = None) -> list[Entry]:
    files = sorted(path for path in directory.glob("*.toml") if path.name != skip)
    if not files:
        raise RuleFileError(f"no rule files (*.toml) found in {directory}")
    return [entry for path in files for entry in load_rule_file(path, check_ops)]


def load_rule_file(path: str | Path, check_ops: bool = True) -> list[Entry]:
    """A rule file's entries. With `check_ops`, each op spelling is looked up (one that names no op is a
    RuleFileWarning) and each formula's names are checked against the names its ops give (RuleFileError)."""
    path = Path(path)
    data = _read_toml(path)
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


# --- matching -------------------------------------------------------------------------------


def _match_keys_for_spelling(op: str) -> list[Any]:
    head, _, rest = op.partition(".")
    if head == "Tensor":
        return [("method", rest)]
    # any other spelling may name an op of torch.ops (aten, prims or a library's custom namespace),
    # and unless it is aten or prims also a Python object (see RuleTable._resolve_pending)
    return [("aten", op), ("name", op)]


def _names_an_object(op: str) -> bool:
    return op.partition(".")[0] not in ("Tensor", "aten", "prims", "prim")


@functools.lru_cache(maxsize=4096)
def _resolve(spelling: str) -> Any:
    """The Python object a dotted name refers to, or None when it cannot be imported.

    Called once its top-level package is imported, after which the answer does not change."""
    parts = spelling.split(".")
    loaded = _resolve_loaded(parts)
    if loaded is not None:
        return loaded
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for attr in parts[split:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def _resolve_loaded(parts: list[str]) -> Any:
    """The object a dotted name refers to through its longest loaded module, without importing (a failed
    import of "torch.nn.functional.conv2d" as a module costs a search of the import path; ~360 spellings)."""
    for split in range(len(parts), 0, -1):
        module = sys.modules.get(".".join(parts[:split]))
        if module is None:
            continue
        obj: Any = module
        for attr in parts[split:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return None
        return obj
    return None


def _object_spelling(obj: Any) -> str:
    if isinstance(obj, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return aten_key(obj)
    return f"{obj.__module__}.{obj.__qualname__}"


def _match_keys_for_call(call: OpCall) -> list[Any]:
    if call.kind == "aten":
        packet = call.key.rsplit(".", 1)[0]
        return [("aten", call.key), ("aten", packet)]
    if call.kind == "method":
        return [("method", call.key.split(".", 1)[1])]
    if call.kind == "module":
        keys: list[Any] = []
        for cls in type(call.module).__mro__:
            keys += [("object", cls), ("name", f"{cls.__module__}.{cls.__qualname__}")]
        return keys
    return [("object", call.target), ("name", call.key)]


def aten_key(op: Any) -> str:
    """'aten.linear.default' for an OpOverload, 'aten.linear' for a packet."""
    if isinstance(op, torch._ops.OpOverload):
        namespace, name = op._schema.name.split("::")
        return f"{namespace}.{name}.{op._overloadname}"
    return str(op).replace("::", ".")


# --- binding --------------------------------------------------------------------------------


def bind_op_call(target: Any, kind: str, args: tuple, kwargs: Mapping[str, Any], out: Any,
                 module: torch.nn.Module | None = None) -> OpCall:
    """Name an op call's arguments the way its schema, signature or module does."""
    if kind == "aten":
        key, names = aten_key(target), _bind_schema(target, args, kwargs)
    elif kind == "method":
        key, names = f"Tensor.{target}", _bind_method(target, args, kwargs)
    elif kind == "module":
        cls = type(module)
        key, names = f"{cls.__module__}.{cls.__qualname__}", _bind_module(module, args, kwargs)
    else:
        key, names = function_key(target), _bind_function(target, args, kwargs)
    names = {**names, "args": tuple(args), "kwargs": dict(kwargs)}
    return OpCall(key=key, kind=kind, target=target, names=names, out=out, module=module)


def function_key(target: Any) -> str:
    if getattr(target, "__module__", None) == "_operator" or target in vars(operator).values():
        return f"operator.{target.__name__}"
    module = getattr(target, "__module__", None) or ""
    if module.startswith("torch._C") or module == "torch.functional":
        module = "torch"
    return f"{module}.{getattr(target, '__qualname__', getattr(target, '__name__', repr(target)))}"


def _bind_schema(op: Any, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    names: dict[str, Any] = {}
    schema_args = op._schema.arguments
    for position, argument in enumerate(schema_args):
        if position < len(args) and not argument.kwarg_only:
            names[argument.name] = args[position]
        elif argument.name in kwargs:
            names[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            names[argument.name] = argument.default_value
        else:
            names[argument.name] = None
    return names


def _bind_function(target: Any, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    for signature in _signatures(target):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            continue
        bound.apply_defaults()
        return _flatten_varargs(bound, signature)
    return {}


def _bind_method(name: str, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    function = _method_function(name)
    names = _bind_function(function, args, kwargs) if function is not None else {}
    if args:
        names.setdefault("self", args[0])
        names.setdefault("input", args[0])
    return names


def _bind_module(module: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    names = {key: value for key, value in vars(module).items() if not key.startswith("_")}
    names.update(module._parameters)
    names.update(module._buffers)
    names["training"] = module.training
    signature = _find_signatures(module.forward)  # not cached: the cache would keep the module alive
    if signature:
        try:
            bound = signature[0].bind(*args, **kwargs)
            bound.apply_defaults()
            names.update(_flatten_varargs(bound, signature[0]))
        except TypeError:
            pass
    if args:
        names.setdefault("input", args[0])
    return names


def _method_function(name: str) -> Any:
    """The torch function whose signature names a Tensor method's arguments: torch.NAME, or for an
    in-place method with no torch function of its own (index_add_, scatter_add_) the out-of-place one."""
    function = getattr(torch, name, None)
    if function is None and name.endswith("_") and not name.endswith("__"):
        function = getattr(torch, name[:-1], None)
    return function


def _flatten_varargs(bound: inspect.BoundArguments, signature: inspect.Signature) -> dict[str, Any]:
    names = dict(bound.arguments)
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            names.update(names.pop(parameter.name, {}))
    return names


def _signatures(target: Any) -> tuple[inspect.Signature, ...]:
    try:
        return _cached_signatures(target)
    except TypeError:  # an unhashable callable
        return _find_signatures(target)


@functools.lru_cache(maxsize=1024)
def _cached_signatures(target: Any) -> tuple[inspect.Signature, ...]:
    # a builtin's signature is parsed from its text each time: hundreds of microseconds per node
    return _find_signatures(target)


def _find_signatures(target: Any) -> tuple[inspect.Signature, ...]:
    try:
        return (inspect.signature(target),)
    except (ValueError, TypeError):
        pass
    from torch.fx.operator_schemas import get_signature_for_torch_op

    return tuple(get_signature_for_torch_op(target) or ())


def _formula_names(call: OpCall) -> Mapping[str, Any]:
    return {**call.names, "out": call.out, "within": call.within}
