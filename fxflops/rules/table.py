"""The rule table: our rules plus the user's, indexed by the op spellings they name, matched to an op call.

A rule names the ops it counts and gives MAC and FLOP formulas (see `fxflops.rules.formula`). Ops are
spelled as aten ops (`aten.convolution`), torch functions (`torch.nn.functional.conv2d`), tensor
methods (`Tensor.matmul`), operators (`operator.matmul`) or module classes (`torch.nn.Conv2d`).
Zero lists declare ops that are known to cost nothing, so they are never reported as unknown.

Every rule belongs to an op family (its own `family`, else its file's top-level `family`); the
counting presets of rules/presets.toml (`fxflops.rules.presets`) say which families each counts and how
its MACs and FLOPs follow from the rule's. A user rule that names no family takes the family of the
rule it replaces for that call, or "other".
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import types
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fxflops.rules.binding import OpCall, aten_key, function_key
from fxflops.rules.entries import Entry, Rule, RuleSpec, ZeroList, default_rules_dir, preset
from fxflops.rules.files import _load_spec, parse_rule_toml, read_rule_bytes, rule_file_entries, rule_files
from fxflops.rules.parsed import parsed_files
from fxflops.rules.presets import OTHER, PRESETS_FILE


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
        # the shipped entries' index is built once per process (1,500 spellings: ~10 ms per estimate) and
        # shared: this table keeps only the spellings its own entries add to, and the resolved objects
        start = len(shipped) if entries[: len(shipped)] == list(shipped) else 0
        self._shipped, pending = _shipped_index() if start else ({}, ())
        self._spellings: dict[str, list[tuple[int, Entry]]] = {}
        self._objects: dict[Any, list[tuple[int, Entry]]] = {}
        self._pending: list[tuple[int, str, Entry]] = list(pending)  # object spellings not resolved yet
        for order, entry in enumerate(entries[start:], start):
            for op in entry.ops:
                self._add(self._spellings, op, self._shipped.get(op, ()), order, entry)
                if _names_an_object(op):
                    self._pending.append((order, op, entry))

    def _entries(self, key: Any) -> Sequence[tuple[int, Entry]]:
        """The (order, entry) pairs naming a match key (_match_keys_for_call's), the latest first."""
        kind, name = key
        if kind == "object":
            return self._objects.get(name, ())
        spelling = _key_spelling(kind, name)
        if spelling is None:
            return ()
        found = self._spellings.get(spelling)
        return found if found is not None else self._shipped.get(spelling, ())

    @staticmethod
    def _add(index: dict[Any, list[tuple[int, Entry]]], key: Any, shipped: Sequence[tuple[int, Entry]],
             order: int, entry: Entry) -> None:
        entries = index.get(key)
        if entries is None:
            entries = index[key] = list(shipped)
        entries.append((order, entry))
        if len(entries) > 1:  # (most resolved objects have one entry)
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
                self._add(self._objects, resolved, (), order, entry)
        self._pending = still

    def _candidates(self, call: OpCall) -> list[Entry]:
        """The entries naming this call's op, in the order they are tried: a user's rule for the packet
        (aten.index_put) overrides our rule for one overload (aten.index_put.default)."""
        if call.kind in ("function", "module"):
            self._resolve_pending()
        ranked: dict[int, tuple[bool, int, int, Entry]] = {}
        for rank, key in enumerate(_match_keys_for_call(call)):
            for order, entry in self._entries(key):
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

    def cost(self, rule: Rule, call: OpCall, conventions: str, lift: bool = False) -> tuple[Any, Any]:
        """(MACs, FLOPs) of a call `rule` matched, under the preset named `conventions` (`lift`: see Rule.cost)."""
        return rule.cost(call, preset(conventions), self.family(rule, call), lift)

    def effective_cost(self, rule: Rule, call: OpCall, conventions: str, kept_pairs: Any,
                       lift: bool = False) -> tuple[Any, Any]:
        """(MACs, FLOPs) of an attention call over the `kept_pairs` pairs its mask keeps (see Rule.effective_cost)."""
        return rule.effective_cost(call, preset(conventions), self.family(rule, call), kept_pairs, lift)

    def knows_op(self, op: Any, function: Any = None) -> bool:
        """Whether some rule or zero list names this aten op (an OpOverload), by overload or packet, or
        the Python builtin that called it (`function`: torch.linalg.multi_dot, Tensor.inner)."""
        key = aten_key(op)
        if self._entries(("aten", key)) or self._entries(("aten", key.rsplit(".", 1)[0])):
            return True
        if function is None:
            return False
        self._resolve_pending()
        return bool(self._entries(("object", function)) or self._entries(("name", function_key(function)))
                    or self._entries(("method", getattr(function, "__name__", ""))))

    def knows_module(self, module: torch.nn.Module) -> bool:
        """Whether some rule counts this module class as a whole (so tracing keeps it a leaf)."""
        self._resolve_pending()
        return any(self._entries(("object", cls)) for cls in type(module).__mro__)


@functools.cache
def _shipped_index() -> tuple[Mapping[str, tuple[tuple[int, Entry], ...]], tuple[tuple[int, str, Entry], ...]]:
    """The shipped entries by the op spellings they name (each spelling's the latest first), frozen, and
    the spellings that name Python objects."""
    by_spelling: dict[str, list[tuple[int, Entry]]] = {}
    pending: list[tuple[int, str, Entry]] = []
    for order, entry in enumerate(_shipped_entries()):
        item = (order, entry)
        for op in entry.ops:
            found = by_spelling.get(op)
            if found is None:
                by_spelling[op] = [item]
            else:
                found.append(item)
            if _names_an_object(op):
                pending.append((order, op, entry))
    return types.MappingProxyType({op: tuple(reversed(found)) for op, found in by_spelling.items()}), tuple(pending)


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
    # Their parse ships beside them (rules/parsed.py): tomllib is most of a tiny model's first estimate.
    directory = default_rules_dir()
    files = rule_files(directory, skip=PRESETS_FILE)
    return tuple(entry for path, data in zip(files, parsed_files(directory, files, read_rule_bytes, parse_rule_toml))
                 for entry in rule_file_entries(data, path, check_ops=False))


# --- matching -------------------------------------------------------------------------------


def _key_spelling(kind: str, name: str) -> str | None:
    """The op spelling a match key names: ("method", NAME) is Tensor.NAME; ("aten" | "name", X) is X, for
    any spelling but a Tensor method's (it may name an op of torch.ops: aten, prims or a library's custom
    namespace, and unless it is aten or prims also a Python object, see RuleTable._resolve_pending)."""
    if kind == "method":
        return "Tensor." + name
    return None if name.startswith("Tensor.") else name


def _names_an_object(op: str) -> bool:
    return op.partition(".")[0] not in ("Tensor", "aten", "prims", "prim")


def resolve_name(spelling: str) -> Any:
    """The Python object a dotted name ("torch.nn.MultiheadAttention") refers to, or None."""
    return _resolve(spelling)


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
