"""Explain: the rule, formula and bound values behind the cost of a module or an op node.

A view of an Estimate's capture, re-bound node by node exactly as `count` bound it: for each op, the
rule that matched, its formulas as written in the rule file, the values their names took, what the
preset made of the rule's counts, and the result. Zero-cost ops are grouped under the list that
declared them; an unknown op comes with a rule stub that counts it once saved and passed back.
The values and stubs are written by `fxflops.rules.stub`, the text by `fxflops.report.explain`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from fxflops.count import node_calls
from fxflops.report.explain import exact, explanation_lines
from fxflops.results import ROOT_LABEL, UNKNOWN, ZERO, Captured, Estimate, NodeCost
from fxflops.tree import owning_module
from fxflops.rules import OpCall, Rule, RuleTable, ZeroList, preset
from fxflops.rules.stub import bound_values, rule_stub

__all__ = ["Explanation", "OpExplanation", "ZeroGroup", "explain", "explain_own", "rule_stub"]


@dataclass(frozen=True)
class OpExplanation:
    """Identical calls of one op under one module (same rule, same bound values), and how they cost."""

    op: str
    status: str  # counted | zero | unknown
    modules: tuple[str, ...]  # the innermost modules that ran these calls ("" = the model), first seen first
    phase: str  # forward | backward | recompute
    calls: int
    nodes: tuple[str, ...]  # the graph nodes grouped here
    rule: str | None = None
    where: str | None = None  # the rule file (or Python callable) that holds the rule
    family: str | None = None
    formulas: dict[str, str] = field(default_factory=dict)  # "when" / "macs" / "flops" as written in the rule
    values: dict[str, str] = field(default_factory=dict)  # each name the formulas read -> its value
    rule_counts: tuple[Any, Any] | None = None  # the rule's own (MACs, FLOPs) per call, before the preset
    preset: str | None = None  # what the preset made of the rule's counts, when not simply kept
    macs: Any = 0  # per call, under the estimate's preset
    flops: Any = 0
    bytes: Any = 0
    source: str | None = None  # the user's line that ran it
    stub: str | None = None  # unknown ops: a rule that counts it, to edit and pass back with rules=
    attention: str | None = None  # attention ops: what the mask keeps, and both readings per call

    @property
    def total_macs(self) -> Any:
        return self.macs * self.calls

    @property
    def total_flops(self) -> Any:
        return self.flops * self.calls


@dataclass(frozen=True)
class ZeroGroup:
    """Zero-cost ops declared by one zero list, with how many calls of each."""

    name: str  # the zero list
    where: str  # its file
    ops: dict[str, int]  # op -> calls


@dataclass(frozen=True)
class Explanation:
    """Why a module (or one op node) costs what it does. `str()` reads as a report; `to_dict()` is JSON-ready."""

    target: str  # the module path or node name asked about
    kind: str  # "module" | "node"
    module_type: str
    conventions: str
    macs: Any
    flops: Any
    bytes: Any
    ops: list[OpExplanation]  # counted and unknown ops, heaviest first
    zero: list[ZeroGroup]
    sizes: tuple[str, ...] = ()  # a sweep's named sizes, when the values and counts are formulas in them
    own: bool = False  # only the ops the module ran itself, not its submodules'

    @property
    def unknown(self) -> list[OpExplanation]:
        return [op for op in self.ops if op.status == UNKNOWN]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for op, raw in zip(self.ops, data["ops"]):
            raw["rule_counts"] = list(map(plain, op.rule_counts)) if op.rule_counts is not None else None
            for key in ("macs", "flops", "bytes"):
                raw[key] = plain(raw[key])
        for key in ("macs", "flops", "bytes"):
            data[key] = plain(data[key])
        return data

    def __str__(self) -> str:
        return self.text()

    def text(self, sources: bool = True) -> str:
        """The explanation as a report; `sources=False` leaves out the user's source lines."""
        return "\n".join(explanation_lines(self, sources))


def explain(estimate: Estimate, name: str) -> Explanation:
    """The explanation of module `name` (qualified name, "" or "(root)" for the model, or a shared
    module's other name; its submodules' ops included) or of the op node called `name`, from the
    estimate's own capture."""
    target, kind, chosen = _select(estimate, name)
    bound = [item for item in _bound(estimate) if chosen(item[0])]
    return _explanation(estimate, target, kind, bound)


def explain_own(estimate: Estimate) -> dict[str, Explanation]:
    """Module name -> the explanation of the ops it ran itself (not its submodules'), every module at
    once from one re-binding of the graph (the HTML report shows one per module)."""
    by_module: dict[str, list[Bound]] = {name: [] for name in estimate.modules}
    for item in _bound(estimate):
        owner = owning_module(item[0].module, estimate.aliases, estimate.modules)
        by_module[owner].append(item)
    return {name: _explanation(estimate, name, "module", items, own=True) for name, items in by_module.items()}


Bound = tuple[NodeCost, "OpCall | None", "Rule | ZeroList | None"]


def _bound(estimate: Estimate) -> list[Bound]:
    source = estimate.source
    if source is None:
        raise ValueError("this Estimate carries no capture to explain (it was read back from JSON or evaluated "
                         "at a sweep point): explain an estimate() result, or use Sweep.explain(name)")
    return list(_calls(source.captured, source.table, {cost.name: cost for cost in estimate.nodes}))


def _explanation(estimate: Estimate, target: str, kind: str, bound: list[Bound], own: bool = False) -> Explanation:
    captured, table = estimate.source.captured, estimate.source.table
    groups: dict[Any, list[Bound]] = {}
    zero: dict[tuple[str, str], dict[str, int]] = {}
    for cost, call, entry in bound:
        if cost.status == ZERO:
            label = (entry.name, entry.source) if isinstance(entry, ZeroList) else (cost.rule or "zero", "")
            zero.setdefault(label, {}).setdefault(cost.op, 0)
            zero[label][cost.op] += 1
            continue
        values = bound_values(entry, call, captured.sizes)
        if getattr(cost, "kept_pairs", None) is not None:  # what the effective formulas read
            values["kept_pairs"] = exact(cost.kept_pairs)
        key = (cost.op, cost.rule, cost.phase, tuple(values.items()), cost.macs, cost.flops)
        groups.setdefault(key, []).append((cost, call, entry))
    ops = [_op_explanation(members, table, estimate.conventions, captured.sizes) for members in groups.values()]
    ops.sort(key=lambda op: (op.status != UNKNOWN, -as_number(op.total_flops), op.modules, op.op))
    costs = [item[0] for item in bound]
    stats = estimate.modules.get(target) if kind == "module" and not own else None
    module_type = estimate.modules[target].type if kind == "module" else (costs[0].module_type if costs else "")
    return Explanation(
        target=target if kind == "node" else (target or ROOT_LABEL), kind=kind, module_type=module_type,
        conventions=estimate.conventions,
        macs=stats.macs if stats is not None else sum(c.macs for c in costs),
        flops=stats.flops if stats is not None else sum(c.flops for c in costs),
        bytes=stats.bytes if stats is not None else sum(c.bytes for c in costs),
        ops=ops, zero=[ZeroGroup(name, where, ops) for (name, where), ops in zero.items()],
        sizes=tuple(captured.sizes.plan.names) if captured.sizes is not None else (),
        own=own,
    )


# --- selecting and re-binding ---------------------------------------------------------------------


def _select(estimate: Estimate, name: str) -> tuple[str, str, Any]:
    """(canonical target, "module" | "node", a predicate over NodeCost) for what `name` names."""
    path = "" if name in ("", ROOT_LABEL) else estimate.aliases.get(name, name)
    if path in estimate.modules:
        prefix = path + "."

        def inside(cost: NodeCost) -> bool:
            module = owning_module(cost.module, estimate.aliases, estimate.modules)
            return not path or module == path or module.startswith(prefix)

        return path, "module", inside
    if any(cost.name == name for cost in estimate.nodes):
        return name, "node", lambda cost: cost.name == name
    raise KeyError(_not_found(estimate, name))


def _not_found(estimate: Estimate, name: str) -> str:
    import difflib

    candidates = [n for n in estimate.modules if n] + list(estimate.aliases)
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return (f"no module or op node named {name!r} in this {estimate.model_type} estimate{hint} "
            f"(module names are qualified, e.g. {next(iter(candidates), 'layer.0')!r}; '' or {ROOT_LABEL!r} is the model)")


def _calls(captured: Captured, table: RuleTable,
           costs: dict[str, NodeCost]) -> Iterator[tuple[NodeCost, OpCall | None, Rule | ZeroList | None]]:
    """Each node's cost with its op call bound again, and the entry that matched it."""
    for name, call in node_calls(captured):
        cost = costs.get(name)
        if cost is None:
            continue
        if cost.rule is not None and cost.rule.startswith("inside:"):
            yield cost, None, None  # counted as part of a module a rule counts whole
            continue
        yield cost, call, (table.match(call) if call is not None else None)


# --- one group ------------------------------------------------------------------------------------


def _op_explanation(members: list[tuple[NodeCost, OpCall | None, Rule | ZeroList | None]], table: RuleTable,
                    conventions: str, sizes: Any) -> OpExplanation:
    cost, call, entry = members[0]
    modules = tuple(dict.fromkeys(member[0].module for member in members))
    common = dict(op=cost.op, status=cost.status, modules=modules, phase=cost.phase, calls=len(members),
                  nodes=tuple(member[0].name for member in members), macs=cost.macs, flops=cost.flops,
                  bytes=cost.bytes, source=cost.source, values=bound_values(entry, call, sizes))
    if cost.status == UNKNOWN:
        return OpExplanation(**common, stub=rule_stub(cost.op, call, cost.module))
    if not isinstance(entry, Rule) or call is None:
        return OpExplanation(**common, rule=cost.rule)
    family = table.family(entry, call)
    formulas = _formulas(entry, conventions)
    if getattr(cost, "attention", None) is not None and getattr(entry, "effective", None) is None:
        # a product of attention written as plain ops: each (query, key) pair costs the same
        formulas["effective_macs"] = "macs * kept_pairs / numel(scores)"
        formulas["effective_flops"] = "flops * kept_pairs / numel(scores)"
    return OpExplanation(**common, rule=entry.name, where=entry.source, family=family,
                         formulas=formulas, rule_counts=_rule_counts(entry, call, sizes),
                         preset=_preset_treatment(entry, conventions, family), attention=_attention(cost))


def _attention(cost: NodeCost) -> str | None:
    """An attention op's two readings, per call: every (query, key) pair, and the pairs its mask keeps."""
    if getattr(cost, "attention", None) is None:
        return None
    effective = ("unknown: the mask is data, so the dense count stands" if cost.effective_macs is None
                 else f"{exact(cost.effective_macs)} MACs, {exact(cost.effective_flops)} FLOPs")
    return (f"attention ({cost.attention}): dense {exact(cost.dense_macs)} MACs, {exact(cost.dense_flops)} FLOPs; "
            f"effective {effective}")


def _formulas(rule: Rule, conventions: str) -> dict[str, str]:
    if rule.function is not None:
        return {"function": rule.source}
    formulas = {"when": rule.when.source} if rule.when is not None else {}
    override = rule.presets.get(conventions)
    if override is not None:
        formulas[f"presets.{conventions}.macs"], formulas[f"presets.{conventions}.flops"] = (
            override[0].source, override[1].source)
    formulas["macs"], formulas["flops"] = rule.macs.source, rule.flops.source
    if getattr(rule, "effective", None) is not None:
        formulas["effective_macs"], formulas["effective_flops"] = rule.effective[0].source, rule.effective[1].source
    return formulas


def _rule_counts(rule: Rule, call: OpCall, sizes: Any) -> tuple[Any, Any] | None:
    """The rule's own (MACs, FLOPs) for this call, as the deepspeed-style formulas give them."""
    if rule.function is not None:
        return None
    names = {**call.names, "out": call.out}
    macs = rule.macs.evaluate(names)
    flops = rule.flops.evaluate({**names, "macs": macs})
    return _count(macs, sizes), _count(flops, sizes)


def _preset_treatment(rule: Rule, conventions: str, family: str) -> str | None:
    """What the preset does with the rule's counts, in words; None when it keeps them as they are."""
    if conventions in rule.presets:
        return f"the {conventions} preset counts this rule by its own formulas (presets.{conventions} above)"
    chosen = preset(conventions)
    treatment = chosen.treatment(family)
    if treatment is None:
        return f"the {conventions} preset does not count the {family} family: 0 MACs, 0 FLOPs"
    if treatment.macs.source == "macs" and treatment.flops.source == "flops":
        return None
    return (f"the {conventions} preset counts the {family} family as macs = {treatment.macs.source}, "
            f"flops = {treatment.flops.source} (of the rule's macs, flops; extra = flops - 2 * macs)")


def _count(value: Any, sizes: Any) -> Any:
    if isinstance(value, torch.SymInt | torch.SymFloat):
        return sizes.expression(value) if sizes is not None else int(value)
    return value


def plain(value: Any) -> Any:
    return value if isinstance(value, int | float) or value is None else str(value)


def as_number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0
