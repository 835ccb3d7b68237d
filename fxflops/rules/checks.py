"""Load-time checks of rule entries: formula names against the names their ops give (RuleFileError), op
spellings that name nothing in this torch (RuleFileWarning, with a "did you mean").

Only what can be looked up cheaply and without importing anything: aten ops (torch.ops.aten), Tensor
methods, and objects under torch, operator and builtins that are already loaded. Other packages'
spellings (transformers.X, a user's own module) resolve lazily when their package is imported (see
RuleTable._resolve_pending), and are not looked at here. The names a module class gives (its
attributes, set in __init__) are not knowable before an instance exists, so module rules are not
name-checked.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import inspect
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import torch

from fxflops.rules.binding import _method_function, _signatures
from fxflops.rules.entries import CALL_NAMES, KEPT_PAIRS, Entry, Rule, RuleFileError, RuleFileWarning
from fxflops.rules.formula import Formula, clip

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


def _quoted(text: str) -> str:
    return clip(repr(text), 60)
