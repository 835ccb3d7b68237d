"""Counting presets ("conventions"), defined once in rules/presets.toml.

A rule says what an op costs (its MACs and FLOPs); a preset says what a convention or a tool makes of
that: which op families it counts at all, and how its MACs and FLOPs follow from the rule's. Every rule
belongs to one family (see `fxflops.rules`). A preset's formulas see `macs` and `flops` (the rule's own
counts) and `extra` = flops - 2 * macs (the rule's work besides its multiply-accumulates).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fxflops.rules.formula import Formula, FormulaError
from fxflops.spelling import did_you_mean

PRESETS_FILE = "presets.toml"  # in the rules folder, beside the rule files
ALL_FAMILIES = "*"  # in a preset's `count`: every family it does not list
OTHER = "other"  # the family of a user rule that names none and replaces no rule of ours


class PresetFileError(ValueError):
    """A preset table that cannot be used: names the file, the preset and the problem."""


@dataclass(frozen=True)
class Treatment:
    """How a preset counts the ops of one family: its MACs and FLOPs from the rule's own."""

    macs: Formula
    flops: Formula

    def apply(self, macs: Any, flops: Any, lift: bool = False) -> tuple[Any, Any]:
        if self.macs.source == "macs" and self.flops.source == "flops":
            return macs, flops  # the rule's own counts
        names = {"macs": macs, "flops": flops, "extra": flops - 2 * macs}
        return self.macs.evaluate(names, lift), self.flops.evaluate(names, lift)


@dataclass(frozen=True)
class Preset:
    """One counting convention: the families it counts and how (see rules/presets.toml)."""

    name: str
    doc: str
    tool: str | None
    count: Mapping[str, Treatment]  # family (or ALL_FAMILIES) -> how its ops are counted
    # dotted names of module classes counted as a whole by their rule, as the tool counts them by a
    # module hook and not by the ops they run (exactly these classes: the tool hooks type(module))
    whole_modules: tuple[str, ...] = ()

    def treatment(self, family: str) -> Treatment | None:
        """How this preset counts `family`, or None when it does not count it (0 MACs, 0 FLOPs)."""
        found = self.count.get(family)
        return found if found is not None else self.count.get(ALL_FAMILIES)

    def counts(self, family: str) -> bool:
        return self.treatment(family) is not None

    def apply(self, family: str, macs: Any, flops: Any, lift: bool = False) -> tuple[Any, Any]:
        """This preset's (MACs, FLOPs) for an op of `family` whose rule counts (macs, flops); `lift`: as
        Formula.evaluate's."""
        treatment = self.treatment(family)
        return (0, 0) if treatment is None else treatment.apply(macs, flops, lift)


@dataclass(frozen=True)
class PresetTable:
    """The conventions presets by name, and the op families their treatments refer to."""

    families: Mapping[str, str]  # family -> what it holds
    presets: Mapping[str, Preset]  # in the file's order; the first is not special (the API's default is)

    def get(self, name: str) -> Preset:
        """The preset called `name`, or a ValueError that lists the valid ones."""
        try:
            return self.presets[name]
        except (KeyError, TypeError):
            raise ValueError(f"conventions must be one of {', '.join(self.presets)}; got {name!r}"
                             f"{did_you_mean(name, self.presets)}") from None

    def check_family(self, family: Any, where: str) -> str:
        if not isinstance(family, str) or family not in self.families:
            raise ValueError(f"{where}: unknown family {family!r} (known: {', '.join(self.families)})")
        return family


_PRESET_KEYS = {"doc", "tool", "macs", "flops", "count", "whole_modules"}
_FORMULA_NAMES = frozenset({"macs", "flops", "extra"})


def load_presets(path: str | Path) -> PresetTable:
    """The preset table of a TOML file (as rules/presets.toml)."""
    import tomllib  # (the shipped table's TOML is read back from the shipped parse: fxflops.rules.entries)

    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise PresetFileError(f"preset table {path} does not exist") from None
    except tomllib.TOMLDecodeError as error:
        raise PresetFileError(f"{path}: not valid TOML: {error}") from None
    return presets_from(data, path)


def presets_from(data: Mapping[str, Any], path: Path) -> PresetTable:
    """The preset table of a presets file's parsed TOML `data` (`path` names the file in errors)."""
    unknown = set(data) - {"families", "preset"}
    if unknown:
        raise PresetFileError(f"{path}: unknown top-level keys {sorted(unknown)} (expected [families] and [preset.NAME])")
    families = data.get("families")
    if not isinstance(families, dict) or not families or not all(isinstance(v, str) for v in families.values()):
        raise PresetFileError(f"{path}: [families] must name each family with a description")
    if OTHER not in families:
        raise PresetFileError(f"{path}: [families] must list '{OTHER}' (user rules that name no family)")
    presets = {name: _parse_preset(name, raw, families, path) for name, raw in data.get("preset", {}).items()}
    if not presets:
        raise PresetFileError(f"{path}: no [preset.NAME] tables")
    return PresetTable(families=dict(families), presets=presets)


def _parse_preset(name: str, raw: Any, families: Mapping[str, str], path: Path) -> Preset:
    where = f"{path}: preset '{name}'"
    if not isinstance(raw, dict):
        raise PresetFileError(f"{where}: expected a table")
    unknown = set(raw) - _PRESET_KEYS
    if unknown:
        raise PresetFileError(f"{where}: unknown keys {sorted(unknown)} (allowed: {sorted(_PRESET_KEYS)})")
    if not isinstance(raw.get("doc"), str):
        raise PresetFileError(f"{where}: missing 'doc'")
    count = raw.get("count")
    if not isinstance(count, dict) or not count:
        raise PresetFileError(f"{where}: 'count' must be a table of the families it counts")
    default = {"macs": raw.get("macs", "macs"), "flops": raw.get("flops", "flops")}
    treatments = {}
    for family, own in count.items():
        if family != ALL_FAMILIES and family not in families:
            raise PresetFileError(f"{where}: unknown family '{family}' (known: {', '.join(families)})")
        if not isinstance(own, dict) or set(own) - {"macs", "flops"}:
            raise PresetFileError(f"{where}: family '{family}': expected {{}} or {{ macs = ..., flops = ... }}")
        merged = {**default, **own}
        treatments[family] = Treatment(_formula(merged["macs"], where, family, "macs"),
                                       _formula(merged["flops"], where, family, "flops"))
    whole = raw.get("whole_modules", [])
    if not isinstance(whole, list) or not all(isinstance(n, str) and "." in n for n in whole):
        raise PresetFileError(f"{where}: 'whole_modules' must be a list of dotted class names, "
                              f"e.g. [\"torch.nn.MultiheadAttention\"]")
    return Preset(name=name, doc=" ".join(raw["doc"].split()), tool=raw.get("tool"), count=treatments,
                  whole_modules=tuple(whole))


def _formula(source: Any, where: str, family: str, field_name: str) -> Formula:
    try:
        formula = Formula(source)
    except FormulaError as error:
        raise PresetFileError(f"{where}: family '{family}': '{field_name}': {error}") from None
    strange = set(formula.names) - _FORMULA_NAMES
    if strange:
        raise PresetFileError(f"{where}: family '{family}': '{field_name}' may use only macs, flops and extra, "
                              f"not {', '.join(sorted(strange))}")
    return formula
