"""Rule table entries: a rule (Rule: op spellings, MAC/FLOP formulas, presets, family) and a zero list
(ZeroList), the errors they raise, and the counting presets of rules/presets.toml (PRESET_TABLE,
CONVENTIONS, preset) read from the shipped rules/ folder (default_rules_dir)."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fxflops.rules.binding import OpCall, _formula_names
from fxflops.rules.formula import Formula, FormulaError, clip
from fxflops.rules.parsed import PRESETS_PARSE_FILE, parsed_files
from fxflops.rules.polynomial import SizeValue
from fxflops.rules.presets import PRESETS_FILE, Preset, PresetTable, presets_from
from fxflops.rules.reading import MAX_FILE_BYTES, RuleFileError, parse_rule_toml, read_rule_bytes  # (RuleFileError and the limit: this module's names too)


MAX_NAME = 200  # characters of a rule's name or of an op's spelling (they are quoted in messages)

# names a formula has besides the op's own: the output, the positional and keyword arguments as given
# `within`: the class name of the innermost module the call ran in ("" at the top), for conventions
# that count a module's hook and a function it calls separately (ptflops' pytorch backend)
CALL_NAMES = frozenset({"out", "args", "kwargs", "within"})
KEPT_PAIRS = "kept_pairs"  # the name effective_* formulas read: (query, key) pairs the mask keeps


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
    """A counting rule: the ops it matches, its MAC and FLOP formulas, and where it was read from."""

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
    # formulas read as `kept_pairs` (fxflops.rules.kept_pairs); None: the rule has one reading
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

    def cost(self, call: OpCall, preset: Preset, family: str, lift: bool = False) -> tuple[Any, Any]:
        """(MACs, FLOPs) of this call under `preset`, for an op of `family`: non-negative ints, or
        symbolic sizes.

        The rule's own `presets.NAME` formulas, where it has them, are its count under that preset;
        otherwise the preset keeps or drops the rule's counts by family and derives its MACs and FLOPs
        from them. A callable gives the rule's counts (it may read call.conventions). Raises
        RuleEvaluationError naming the rule, the field and the op when a formula fails or gives
        something that is not a count. `lift`: a count may be a SizeValue (see Formula.evaluate)."""
        override = self.presets.get(preset.name)
        if override is not None:
            return self._counts(override, call, preset.name, lift)
        if not preset.counts(family):
            return 0, 0
        if self.function is not None:
            macs, flops = self._call_function(dataclasses.replace(call, conventions=preset.name))
        else:
            macs, flops = self._counts((self.macs, self.flops), call, preset.name, lift)
        return self._preset_counts(preset, family, macs, flops, call, lift)

    def effective_cost(self, call: OpCall, preset: Preset, family: str, kept_pairs: Any,
                       lift: bool = False) -> tuple[Any, Any]:
        """(MACs, FLOPs) of this call counting only the `kept_pairs` (query, key) pairs its mask keeps,
        under `preset` as `cost` counts the dense reading (the rule's `effective_*` formulas)."""
        if self.effective is None:
            raise ValueError(f"{self.label} has no effective formulas")
        override = self.presets.get(preset.name)
        if override is not None:  # a tool's own count (ptflops' MultiheadAttention hook): every pair, as it counts
            return self._counts(override, call, preset.name, lift)
        if not preset.counts(family):
            return 0, 0
        call = dataclasses.replace(call, names={**call.names, KEPT_PAIRS: kept_pairs})
        macs, flops = self._counts(self.effective, call, preset.name, lift)
        return self._preset_counts(preset, family, macs, flops, call, lift)

    def _preset_counts(self, preset: Preset, family: str, macs: Any, flops: Any, call: OpCall,
                       lift: bool = False) -> tuple[Any, Any]:
        """The preset's counts from the rule's, checked like the rule's own (ptflops' macs + extra goes
        negative for a rule whose FLOPs are fewer than its MACs)."""
        counts = preset.apply(family, macs, flops, lift)
        for field_name, value in zip(("macs", "flops"), counts):
            try:
                check_count(value)
            except (ValueError, TypeError) as error:
                raise RuleEvaluationError(self.label, f"{field_name} under preset {preset.name} (family {family})",
                                          call.key, f"the preset's formula gave {error}") from None
        return counts

    def _counts(self, formulas: tuple[Formula, Formula], call: OpCall, conventions: str,
                lift: bool = False) -> tuple[Any, Any]:
        macs_formula, flops_formula = formulas
        names = dict(_formula_names(call))
        macs = self._evaluate(macs_formula, self._field("macs", macs_formula, conventions), names, call, check_count,
                              lift)
        names["macs"] = macs
        flops = self._evaluate(flops_formula, self._field("flops", flops_formula, conventions), names, call, check_count,
                               lift)
        return macs, flops

    def _field(self, key: str, formula: Formula, conventions: str) -> str:
        # a preset's formula is the rule's own unless the preset gives its own
        if self.effective is not None and formula is self.effective[key == "flops"]:
            return f"effective_{key}"
        return key if formula is getattr(self, key) else f"presets.{conventions}.{key}"

    def _evaluate(self, formula: Formula, field_name: str, names: Mapping[str, Any], call: OpCall,
                  check: Callable[[Any], Any], lift: bool = False) -> Any:
        try:
            value = formula.evaluate(names, lift)
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
    if isinstance(value, torch.SymInt | torch.SymFloat | SizeValue):
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


def default_rules_dir() -> Path:
    """The shipped rules/: inside the installed wheel (fxflops/_rules), or at the top of a checkout."""
    package = Path(__file__).resolve().parent.parent  # fxflops/ (this file is fxflops/rules/entries.py)
    installed = package / "_rules"
    return installed if any(installed.glob("*.toml")) else package.parent / "rules"


def _shipped_presets(directory: Path) -> PresetTable:
    """rules/presets.toml's table, its TOML read back from the shipped parse while that is current
    (`fxflops.rules.parsed`): parsing it, and importing tomllib to, was ~4 ms of every first estimate."""
    path = directory / PRESETS_FILE
    return presets_from(parsed_files(directory, [path], read_rule_bytes, parse_rule_toml, PRESETS_PARSE_FILE)[0], path)


PRESET_TABLE: PresetTable = _shipped_presets(default_rules_dir())
CONVENTIONS: tuple[str, ...] = tuple(PRESET_TABLE.presets)  # the preset names, as rules/presets.toml lists them
FAMILIES: tuple[str, ...] = tuple(PRESET_TABLE.families)


def preset(conventions: str) -> Preset:
    """The preset called `conventions`; a ValueError listing the valid ones for any other name."""
    return PRESET_TABLE.get(conventions)
