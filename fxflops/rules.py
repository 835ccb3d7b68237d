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
import functools
import importlib
import inspect
import operator
import sys
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fxflops.formula import Formula, FormulaError
from fxflops.presets import OTHER, PRESETS_FILE, Preset, PresetTable, load_presets

RuleSpec = str | Path | Mapping[Any, Callable[["OpCall"], tuple[int, int]]]


class RuleFileError(ValueError):
    """A rule file that cannot be used: names the file, the rule and the problem."""


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


@dataclass(frozen=True, eq=False)
class Rule:
    name: str
    ops: tuple[str, ...]
    source: str
    macs: Formula | None = None
    flops: Formula | None = None
    when: Formula | None = None
    presets: Mapping[str, tuple[Formula, Formula]] = field(default_factory=dict)  # preset -> its own formulas
    function: Callable[[OpCall], tuple[int, int]] | None = None
    family: str | None = None  # None: a user rule's, resolved per call by RuleTable.family

    def applies(self, call: OpCall) -> bool:
        return self.when is None or bool(self.when.evaluate(_formula_names(call)))

    def cost(self, call: OpCall, preset: Preset, family: str) -> tuple[Any, Any]:
        """(MACs, FLOPs) of this call under `preset`, for an op of `family`.

        The rule's own `presets.NAME` formulas, where it has them, are its count under that preset;
        otherwise the preset keeps or drops the rule's counts by family and derives its MACs and FLOPs
        from them. A callable gives the rule's counts (it may read call.conventions)."""
        override = self.presets.get(preset.name)
        if override is not None:
            return _evaluate(override, call)
        if not preset.counts(family):
            return 0, 0
        if self.function is not None:
            macs, flops = self.function(dataclasses.replace(call, conventions=preset.name))
        else:
            macs, flops = _evaluate((self.macs, self.flops), call)
        return preset.apply(family, macs, flops)


def _evaluate(formulas: tuple[Formula, Formula], call: OpCall) -> tuple[Any, Any]:
    macs_formula, flops_formula = formulas
    names = dict(_formula_names(call))
    macs = macs_formula.evaluate(names)
    names["macs"] = macs
    return macs, flops_formula.evaluate(names)


@dataclass(frozen=True)
class ZeroList:
    """Ops known to do no arithmetic worth counting (views, casts, indexing, ...)."""

    name: str
    ops: tuple[str, ...]
    source: str
    moves_data: bool = True  # False: views and plumbing, which read and write no tensor memory


Entry = Rule | ZeroList


class RuleTable:
    """Rules indexed by what they match. Later tables take precedence over earlier ones.

    Spellings of Python objects (torch.nn.Linear, transformers.X) are resolved to the objects only
    once their top-level package has been imported: until then no such object can be in a graph, and
    resolving them would import it (transformers costs a second).
    """

    def __init__(self, entries: Iterable[Entry]) -> None:
        self._by_key: dict[Any, list[tuple[int, Entry]]] = {}
        self._pending: list[tuple[int, str, Entry]] = []  # object spellings not resolved yet
        self._modules_seen = 0
        for order, entry in enumerate(entries):
            for op in entry.ops:
                for key in _match_keys_for_spelling(op):
                    self._by_key.setdefault(key, []).insert(0, (order, entry))  # the latest rule first
                if _names_an_object(op):
                    self._pending.append((order, op, entry))

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

    def match(self, call: OpCall) -> Entry | None:
        """The first entry whose ops include this call's op and whose `when` holds."""
        if call.kind in ("function", "module"):
            self._resolve_pending()
        for key in _match_keys_for_call(call):
            for _, entry in self._by_key.get(key, ()):
                if isinstance(entry, ZeroList) or entry.applies(call):
                    return entry
        return None

    def family(self, rule: Rule, call: OpCall) -> str:
        """The rule's family; for a user rule that names none, the family of the rule it replaces for
        this call (the next that would have counted it), else "other"."""
        if rule.family is not None:
            return rule.family
        below = False
        for key in _match_keys_for_call(call):
            for _, entry in self._by_key.get(key, ()):
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

    def knows_module(self, module: torch.nn.Module) -> bool:
        """Whether some rule counts this module class as a whole (so tracing keeps it a leaf)."""
        self._resolve_pending()
        return any(("object", cls) in self._by_key for cls in type(module).__mro__)


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
    return RuleTable([*_shipped_entries(), *load_user_entries(extra)])


def load_user_entries(extra: Iterable[RuleSpec] | RuleSpec | None) -> list[Entry]:
    """The entries of the user's rule specs alone, in the order given."""
    if extra is None:
        return []
    if isinstance(extra, str | Path | Mapping):
        extra = [extra]
    return [entry for spec in extra for entry in _load_spec(spec)]


@functools.cache
def _shipped_entries() -> tuple[Entry, ...]:
    # parsed once per process: the shipped files do not change while it runs, and entries are frozen
    return tuple(load_rule_dir(default_rules_dir(), skip=PRESETS_FILE))


def load_rule_dir(directory: Path, skip: str | None = None) -> list[Entry]:
    files = sorted(path for path in directory.glob("*.toml") if path.name != skip)
    if not files:
        raise RuleFileError(f"no rule files (*.toml) found in {directory}")
    return [entry for path in files for entry in load_rule_file(path)]


def load_rule_file(path: str | Path) -> list[Entry]:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise RuleFileError(f"rule file {path} does not exist") from None
    except tomllib.TOMLDecodeError as error:
        raise RuleFileError(f"{path}: not valid TOML: {error}") from None
    unknown_sections = set(data) - {"rule", "zero", "family"}
    if unknown_sections:
        raise RuleFileError(f"{path}: unknown top-level keys {sorted(unknown_sections)} "
                            "(expected [[rule]], [[zero]] and a default family = \"...\")")
    family = _family(data["family"], f"{path}: top-level 'family'") if "family" in data else None
    entries: list[Entry] = [_parse_rule(raw, path, i, family) for i, raw in enumerate(data.get("rule", []))]
    entries += [_parse_zero(raw, path, i) for i, raw in enumerate(data.get("zero", []))]
    return entries


def _load_spec(spec: RuleSpec) -> list[Entry]:
    if isinstance(spec, Mapping):
        return [_callable_rule(op, function) for op, function in spec.items()]
    path = Path(spec)
    return load_rule_dir(path) if path.is_dir() else load_rule_file(path)


def _callable_rule(op: Any, function: Callable[[OpCall], tuple[int, int]]) -> Rule:
    if not callable(function):
        raise RuleFileError(f"the rule given for {op!r} is not callable: {function!r}")
    spelling = op if isinstance(op, str) else _object_spelling(op)
    name = getattr(function, "__name__", "user rule")
    family = getattr(function, "family", None)
    if family is not None:
        family = _family(family, f"the rule given for {op!r}: its 'family' attribute")
    return Rule(name=f"user:{name}", ops=(spelling,), source="<python>", function=function, family=family)


def _family(family: Any, where: str) -> str:
    try:
        return PRESET_TABLE.check_family(family, where)
    except ValueError as error:
        raise RuleFileError(str(error)) from None


_RULE_KEYS = {"name", "ops", "macs", "flops", "when", "presets", "doc", "family"}


def _parse_rule(raw: Any, path: Path, index: int, family: str | None = None) -> Rule:
    where = f"{path}: rule #{index + 1}"
    if not isinstance(raw, dict):
        raise RuleFileError(f"{where}: expected a table, got {raw!r}")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise RuleFileError(f"{where}: missing 'name'")
    where = f"{path}: rule '{name}'"
    unknown = set(raw) - _RULE_KEYS
    if unknown:
        raise RuleFileError(f"{where}: unknown keys {sorted(unknown)} (allowed: {sorted(_RULE_KEYS)})")
    if "family" in raw:
        family = _family(raw["family"], where)
    ops = _parse_ops(raw.get("ops"), where)
    for key in ("macs", "flops"):
        if key not in raw:
            raise RuleFileError(f"{where}: missing '{key}' formula")
    presets = {}
    for preset, formulas in raw.get("presets", {}).items():
        if preset not in CONVENTIONS:
            raise RuleFileError(f"{where}: unknown preset '{preset}' (known: {', '.join(CONVENTIONS)})")
        merged = {"macs": raw["macs"], "flops": raw["flops"], **formulas}
        presets[preset] = (_formula(merged["macs"], where, "macs"), _formula(merged["flops"], where, "flops"))
    when = raw.get("when")
    return Rule(
        name=name,
        ops=ops,
        source=str(path),
        macs=_formula(raw["macs"], where, "macs"),
        flops=_formula(raw["flops"], where, "flops"),
        when=_formula(when, where, "when") if when is not None else None,
        presets=presets,
        family=family,
    )


def _parse_zero(raw: Any, path: Path, index: int) -> ZeroList:
    where = f"{path}: zero list #{index + 1}"
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise RuleFileError(f"{where}: expected a table with a 'name' and 'ops'")
    unknown = set(raw) - {"name", "ops", "doc", "moves_data"}
    if unknown:
        raise RuleFileError(f"{where}: unknown keys {sorted(unknown)}")
    moves_data = raw.get("moves_data", True)
    if not isinstance(moves_data, bool):
        raise RuleFileError(f"{where}: 'moves_data' must be true or false, got {moves_data!r}")
    return ZeroList(name=raw["name"], ops=_parse_ops(raw.get("ops"), where), source=str(path), moves_data=moves_data)


def _parse_ops(ops: Any, where: str) -> tuple[str, ...]:
    if not isinstance(ops, list) or not ops or not all(isinstance(op, str) and op for op in ops):
        raise RuleFileError(f"{where}: 'ops' must be a non-empty list of op names")
    for op in ops:
        if "." not in op:
            raise RuleFileError(
                f"{where}: op '{op}' is not a qualified name "
                "(write aten.NAME, Tensor.NAME, operator.NAME, torch.nn.functional.NAME or module.Class)"
            )
    return tuple(ops)


def _formula(source: Any, where: str, field_name: str) -> Formula:
    try:
        return Formula(source)
    except FormulaError as error:
        raise RuleFileError(f"{where}: '{field_name}': {error}") from None


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
    function = getattr(torch, name, None)
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
    return {**call.names, "out": call.out}
