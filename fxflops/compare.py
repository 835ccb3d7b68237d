"""Compare: one capture counted under every preset, side by side, every difference named.

The Estimate's capture is counted again under each preset (deepspeed, torch, fvcore, ptflops, ...,
and the user's rules, which every count includes). Per op node the difference from the estimate's
own conventions has exactly one cause: the preset does not count the op's family, counts it by a
treatment of its own (FLOPs = MACs, no bias adds, bias adds as MACs), or counts the op's rule by
formulas of its own. Causes are summed per preset, so they add up to the difference in the totals:
nothing is left unexplained.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fxflops.explain import as_number, plain
from fxflops.count import count_nodes, node_calls
from fxflops.count.attention import DENSE, EFFECTIVE
from fxflops.results import ROOT_LABEL, Estimate, NodeCost
from fxflops.rules import CONVENTIONS, PRESET_TABLE, Rule, RuleTable, preset
from fxflops.tree import build_estimate, owning_module

__all__ = ["Cause", "Comparison", "compare"]


@dataclass(frozen=True)
class Cause:
    """One convention that makes a preset's count differ from the reference's, and by how much."""

    preset: str
    convention: str  # the cause in words
    family: str | None
    macs: Any  # this preset's count minus the reference's (negative: it counts less)
    flops: Any
    ops: tuple[str, ...]  # the ops it concerns
    calls: int


@dataclass
class Comparison:
    """Totals, per-module and per-op counts of one capture under several presets, and the causes of
    each preset's difference from the reference (the estimate's own conventions)."""

    model_type: str
    reference: str
    presets: tuple[str, ...]
    totals: dict[str, tuple[Any, Any]]  # preset -> (MACs, FLOPs)
    modules: dict[str, dict[str, tuple[Any, Any]]]  # module -> preset -> inclusive (MACs, FLOPs)
    ops: dict[str, dict[str, tuple[Any, Any]]]  # op -> preset -> (MACs, FLOPs)
    causes: dict[str, list[Cause]]  # preset -> the causes of its difference from the reference
    tools: list[Any] = field(default_factory=list)  # fxflops.tool_runs.ToolRun: the real tools, when run
    module_types: dict[str, str] = field(default_factory=dict)
    module_ops: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)  # module -> op -> preset -> its own FLOPs
    readings: dict[str, tuple[str, str]] = field(default_factory=dict)  # column -> (preset, attention reading)
    # the forward's share (what the tools count: they run a forward), when the backward was counted too
    forward: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # column -> forward (MACs, FLOPs)
    forward_modules: dict[str, dict[str, Any]] = field(default_factory=dict)  # module -> column -> forward FLOPs

    def run_tools(self, model: Any, args: Any = (), kwargs: dict | None = None, why_not_real: str = "") -> list[Any]:
        """Run the tools the presets reproduce (FlopCounterMode, fvcore, ptflops, DeepSpeed, where
        installed) on `model(*args, **kwargs)` and keep their numbers beside ours (`tools`).
        `why_not_real`: why the model is on the meta device, said by the tools that need real weights."""
        from fxflops.tool_runs import run_tools

        return run_tools(self, model, args if isinstance(args, tuple | list) else (args,), kwargs, why_not_real)

    def residue(self, name: str) -> tuple[Any, Any]:
        """What the causes leave unexplained of preset `name`'s difference: (0, 0) by construction."""
        macs = self.totals[name][0] - self.totals[self.reference][0] - sum(c.macs for c in self.causes[name])
        flops = self.totals[name][1] - self.totals[self.reference][1] - sum(c.flops for c in self.causes[name])
        return macs, flops

    def to_dict(self) -> dict[str, Any]:
        def pair(value: tuple[Any, Any]) -> dict[str, Any]:
            return {"macs": plain(value[0]), "flops": plain(value[1])}

        return {
            "model": self.model_type, "reference": self.reference, "presets": list(self.presets),
            "totals": {name: pair(value) for name, value in self.totals.items()},
            "modules": {name: {p: pair(v) for p, v in values.items()} for name, values in self.modules.items()},
            "ops": {name: {p: pair(v) for p, v in values.items()} for name, values in self.ops.items()},
            "causes": {name: [{"convention": c.convention, "family": c.family, "macs": plain(c.macs),
                               "flops": plain(c.flops), "ops": list(c.ops), "calls": c.calls} for c in causes]
                       for name, causes in self.causes.items()},
            "tools": [run.to_dict() for run in self.tools],
        }

    def __str__(self) -> str:
        from fxflops.report.compare import comparison_text

        return comparison_text(self)


def compare(estimate: Estimate, presets: Iterable[str] | str | None = None) -> Comparison:
    """Count the estimate's capture under each of `presets` (default: every preset) and attribute each
    difference from the estimate's own conventions to the convention that causes it."""
    source = estimate.source
    if source is None:
        raise ValueError("this Estimate carries no capture to count again (read back from JSON, or a sweep "
                         "point): compare an estimate() result")
    reference = estimate.conventions
    reading = estimate.attention
    columns = {name: (name, reading) for name in _preset_names(presets, reference)}
    both = estimate.attention_totals()
    if both is not None and both.differ:  # the other reading of attention, under the reference preset
        other = DENSE if reading == EFFECTIVE else EFFECTIVE
        columns[f"{reference} ({other} attention)"] = (reference, other)
    names = list(columns)
    counted = {reference: estimate.nodes}
    for name, (preset_name, attention) in columns.items():
        if name not in counted:
            counted[name] = count_nodes(source.captured, source.table, preset_name, attention)
    estimates = {name: build_estimate(estimate.model_type, source.captured, costs, columns[name][0])
                 for name, costs in counted.items()}
    families = _families(source, estimate.nodes)
    return Comparison(
        model_type=estimate.model_type, reference=reference, presets=tuple(names),
        totals={name: (estimates[name].total_macs, estimates[name].total_flops) for name in names},
        modules={module: {name: (estimates[name].modules[module].macs, estimates[name].modules[module].flops)
                          for name in names} for module in estimate.modules},
        ops=_by_op(counted, names),
        causes={name: _causes(counted[reference], counted[name], reference, columns[name], families, both)
                for name in names},
        readings=columns,
        forward={name: (estimates[name].fwd_macs, estimates[name].fwd_flops) for name in names},
        forward_modules={module: {name: estimates[name].modules[module].fwd_flops for name in names}
                         for module in estimate.modules},
        module_types={module: stats.type for module, stats in estimate.modules.items()},
        module_ops=_own_ops(counted, names, source.captured),
    )


def _own_ops(counted: dict[str, list[NodeCost]], names: Sequence[str], captured: Any) -> dict[str, dict[str, dict[str, Any]]]:
    """Module -> op -> preset -> FLOPs of the ops the module ran itself (not its submodules)."""
    found: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for name in names:
        for cost in counted[name]:
            owner = owning_module(cost.module, captured.aliases, captured.modules)
            slot = found[owner].setdefault(cost.op, dict.fromkeys(names, 0))
            slot[name] += cost.flops
    return dict(found)


def _preset_names(presets: Iterable[str] | str | None, reference: str) -> list[str]:
    if presets is None:
        names = list(CONVENTIONS)
    else:
        names = [presets] if isinstance(presets, str) else list(presets)
        for name in names:
            preset(name)  # a ValueError naming the valid presets
    return [reference, *[name for name in names if name != reference]]


def _families(source: Any, costs: Sequence[NodeCost]) -> dict[str, tuple[str | None, Rule | None]]:
    """Node name -> (family, rule) of each counted node, as the rule table resolves them for its call."""
    table: RuleTable = source.table
    counted = {cost.name for cost in costs if cost.rule is not None and not cost.rule.startswith("inside:")}
    found: dict[str, tuple[str | None, Rule | None]] = {}
    for name, call in node_calls(source.captured):
        if name not in counted or call is None:
            continue
        entry = table.match(call)
        if isinstance(entry, Rule):
            found[name] = (table.family(entry, call), entry)
    return found


def _by_op(counted: dict[str, list[NodeCost]], names: Sequence[str]) -> dict[str, dict[str, tuple[Any, Any]]]:
    ops: dict[str, dict[str, list[Any]]] = defaultdict(lambda: {name: [0, 0] for name in names})
    for name in names:
        for cost in counted[name]:
            ops[cost.op][name][0] += cost.macs
            ops[cost.op][name][1] += cost.flops
    return {op: {name: (v[0], v[1]) for name, v in values.items()} for op, values in ops.items()}


def _causes(reference_costs: Sequence[NodeCost], costs: Sequence[NodeCost], reference: str,
            column: tuple[str, str], families: dict[str, tuple[str | None, Rule | None]], both: Any) -> list[Cause]:
    name, attention = column
    if costs is reference_costs:
        return []
    # the other reading of attention under the same preset: only attention ops differ, by their masks
    note = _attention_note(attention, both) if name == reference else None
    grouped: dict[tuple[str, str | None], dict[str, Any]] = {}
    for before, after in zip(reference_costs, costs, strict=True):
        macs, flops = after.macs - before.macs, after.flops - before.flops
        if macs == 0 and flops == 0:
            continue
        family, rule = families.get(after.name, (None, None))
        key = (note or convention(rule, family, reference, name), family)
        slot = grouped.setdefault(key, {"macs": 0, "flops": 0, "ops": {}, "calls": 0})
        slot["macs"] += macs
        slot["flops"] += flops
        slot["ops"][after.op] = None
        slot["calls"] += 1
    causes = [Cause(name if note is None else f"{name} ({attention} attention)", text, family, slot["macs"], slot["flops"], tuple(slot["ops"]), slot["calls"])
              for (text, family), slot in grouped.items()]
    return sorted(causes, key=lambda c: -abs(as_number(c.flops)) - abs(as_number(c.macs)))


def _attention_note(attention: str, both: Any) -> str:
    kept = ", ".join(both.patterns) if both is not None else "masks"
    if attention == EFFECTIVE:
        return (f"attention counted effective: only the (query, key) pairs each mask keeps ({kept}), as fused "
                "kernels skip the rest, instead of every pair")
    return f"attention counted dense: every (query, key) pair, instead of only those the masks keep ({kept})"


def convention(rule: Rule | None, family: str | None, reference: str, name: str) -> str:
    """Why preset `name` counts an op of `family` (matched by `rule`) differently from `reference`."""
    if rule is None or family is None:
        return f"{name} and {reference} count this op differently"
    return "; ".join(part for part in (_treatment_text(rule, family, name), _treatment_text(rule, family, reference))
                     if part) or f"{name} and {reference} count the {family} family differently"


def _treatment_text(rule: Rule, family: str, name: str) -> str:
    """How preset `name` departs from the rule's own counts for this family ('' when it keeps them)."""
    if name in rule.presets:
        macs, flops = rule.presets[name]
        return f"{name} counts rule '{rule.name}' by its own formulas (macs = {macs.source}, flops = {flops.source})"
    treatment = preset(name).treatment(family)
    if treatment is None:
        return f"{name} does not count {family} ({PRESET_TABLE.families.get(family, family)})"
    macs, flops = treatment.macs.source, treatment.flops.source
    if (macs, flops) == ("macs", "flops"):
        return ""
    return f"{name}: {family} {_treatment_words(macs, flops)}"


def _treatment_words(macs: str, flops: str) -> str:
    """A preset's treatment of a family as the convention people know it by."""
    words = {
        ("macs", "2 * macs"): "FLOPs = 2 x MACs, the rule's other work (bias adds, addmm's add) not counted",
        ("macs", "macs"): "one FLOP per multiply-accumulate (FMA = 1 FLOP), no bias adds",
        ("macs + extra", "2 * (macs + extra)"): "bias (and addmm) adds counted as one more MAC each, FLOPs = 2 x MACs",
        ("macs", "flops"): "",
    }
    known = words.get((macs, flops))
    return known if known is not None else f"counted as macs = {macs}, flops = {flops}"


def module_label(name: str) -> str:
    return name or ROOT_LABEL
