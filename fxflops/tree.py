"""Tree: attribute per-node costs to the module hierarchy and build the Estimate.

Each node's cost goes to the innermost module that ran it (its exclusive cost) and, summed up the
tree, to every ancestor (inclusive). Parameters are counted per module once, shared ones once.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from fxflops.results import FORWARD, UNKNOWN, Captured, Estimate, ModuleInfo, ModuleStats, NodeCost, OpTotals, UnknownOp
from fxflops.results.estimate import module_tree  # noqa: F401 - where the rest of fxflops finds it


def build_estimate(model_type: str, captured: Captured, costs: list[NodeCost], conventions: str,
                   attention: str = "dense") -> Estimate:
    modules = module_stats(captured.modules, captured.aliases, costs, captured.module_calls, root_type=model_type)
    root = modules[""]
    return Estimate(
        model_type=model_type,
        method=captured.method,
        conventions=conventions,
        attention=attention,
        total_macs=root.macs,
        total_flops=root.flops,
        backward=captured.backward,
        bwd_macs=root.bwd_macs,
        bwd_flops=root.bwd_flops,
        total_params=root.params,
        modules=modules,
        nodes=costs,
        by_op=totals_by(costs, lambda cost: cost.op),
        by_rule=totals_by(costs, lambda cost: cost.rule_key),
        unknown=unknown_ops(costs),
        input_shapes=captured.input_shapes,
        attempts=[(attempt.method, attempt.reason) for attempt in captured.attempts],
        dtype=captured.dtype,
        training=captured.training,
        cautions=list(captured.cautions),
        aliases=dict(captured.aliases),
    )


def module_stats(named: dict[str, ModuleInfo], aliases: dict[str, str], costs: list[NodeCost],
                 calls: dict[str, int], root_type: str) -> dict[str, ModuleStats]:
    """Per-module stats in pre-order, with inclusive and exclusive MACs/FLOPs."""
    self_macs: dict[str, int] = defaultdict(int)
    self_flops: dict[str, int] = defaultdict(int)
    bwd_macs: dict[str, int] = defaultdict(int)
    bwd_flops: dict[str, int] = defaultdict(int)
    self_bytes: dict[str, int] = defaultdict(int)
    owners = _Owners(aliases, named)
    for cost in costs:
        owner = owners(cost.module)
        self_macs[owner] += cost.macs
        self_flops[owner] += cost.flops
        self_bytes[owner] += cost.bytes
        if cost.is_backward:
            bwd_macs[owner] += cost.macs
            bwd_flops[owner] += cost.flops
    stats = {
        name: ModuleStats(
            name=name,
            type=root_type if name == "" else info.type,
            depth=0 if name == "" else name.count(".") + 1,
            params=info.params,
            macs=self_macs[name],
            flops=self_flops[name],
            self_macs=self_macs[name],
            self_flops=self_flops[name],
            calls=calls.get(name, 0),
            extra_repr=info.extra_repr,
            children=list(info.children),
            bwd_macs=bwd_macs[name],
            bwd_flops=bwd_flops[name],
            self_bwd_macs=bwd_macs[name],
            self_bwd_flops=bwd_flops[name],
            bytes=self_bytes[name],
            self_bytes=self_bytes[name],
            shared=dict(info.shared),
        )
        for name, info in named.items()
    }
    for name in reversed(list(stats)):  # children come after their parent in pre-order
        parent = _parent(name)
        if parent is not None and parent in stats:
            stats[parent].macs += stats[name].macs
            stats[parent].flops += stats[name].flops
            stats[parent].bwd_macs += stats[name].bwd_macs
            stats[parent].bwd_flops += stats[name].bwd_flops
            stats[parent].bytes += stats[name].bytes  # (what module_sums sums, in the same pass)
    stats[""].calls = max(stats[""].calls, 1)
    return stats


def module_sums(costs: Iterable[NodeCost], value: Callable[[NodeCost], float], aliases: dict[str, str],
                modules: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """(own, inclusive) sums of value(node) per module of `modules` (pre-order), nodes attributed as the
    module stats attribute them."""
    own: dict[str, float] = dict.fromkeys(modules, 0)
    owners = _Owners(aliases, modules)
    for cost in costs:
        own[owners(cost.module)] += value(cost)
    inclusive = dict(own)
    for name in reversed(list(modules)):  # children come after their parent in pre-order
        parent = _parent(name)
        if parent is not None and parent in inclusive:
            inclusive[parent] += inclusive[name]
    return own, inclusive


def totals_by(costs: Iterable[NodeCost], key) -> dict[str, OpTotals]:
    counts: dict[str, list[Any]] = {}  # name -> [count, macs, flops, bwd macs, bwd flops, statuses]
    for cost in costs:  # (a 70B's 5,000 nodes: the loop kept lean)
        name = key(cost)
        entry = counts.get(name)
        if entry is None:
            entry = counts[name] = [0, 0, 0, 0, 0, set()]
        entry[5].add(cost.status)
        entry[0] += 1
        entry[1] += cost.macs
        entry[2] += cost.flops
        if cost.phase != FORWARD:  # (NodeCost.is_backward)
            entry[3] += cost.macs
            entry[4] += cost.flops
    ordered = sorted(counts.items(), key=lambda item: (-item[1][1], -item[1][2], item[0]))
    return {name: OpTotals(*values[:5], statuses=tuple(sorted(values[5]))) for name, values in ordered}


def unknown_ops(costs: Iterable[NodeCost]) -> list[UnknownOp]:
    found: dict[str, list] = {}
    for cost in costs:
        if cost.status == UNKNOWN:
            count, modules = found.setdefault(cost.op, [0, []])
            found[cost.op][0] = count + 1
            if cost.module not in modules:
                modules.append(cost.module)
    return [UnknownOp(op, count, tuple(modules)) for op, (count, modules) in sorted(found.items())]


def owning_module(path: str, aliases: dict[str, str], named: dict[str, ModuleInfo]) -> str:
    """The module a node's cost is attributed to: its module by its first name, or the nearest known parent."""
    return _nearest_known(_canonical(path, aliases), named)


class _Owners:
    """owning_module of each path, worked out once per path (a model's nodes share a few hundred paths)."""

    def __init__(self, aliases: dict[str, str], named: Mapping[str, Any]) -> None:
        self._aliases, self._named = aliases, named
        self._found: dict[str, str] = {}

    def __call__(self, path: str) -> str:
        found = self._found.get(path)
        if found is None:
            found = self._found[path] = owning_module(path, self._aliases, self._named)
        return found


def parent_name(name: str) -> str | None:
    """A qualified name's parent ("" for a top-level child, None for the root)."""
    return _parent(name)


def _canonical(path: str, aliases: dict[str, str]) -> str:
    """The path with its longest aliased prefix replaced by the module's first name."""
    if not aliases:
        return path
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in aliases:
            return ".".join([aliases[prefix], *parts[end:]])
    return path


def _nearest_known(path: str, named: dict[str, ModuleInfo]) -> str:
    while path and path not in named:
        path = _parent(path) or ""
    return path


def _parent(name: str) -> str | None:
    if name == "":
        return None
    return name.rsplit(".", 1)[0] if "." in name else ""


def forward_only(estimate: Estimate) -> Estimate:
    """The estimate's forward alone: what estimate(backward=False) gives (a copy; `estimate` is kept)."""
    if not estimate.backward:
        return estimate
    modules = {
        name: dataclasses.replace(
            stats, children=list(stats.children), macs=stats.fwd_macs, flops=stats.fwd_flops,
            self_macs=stats.self_macs - stats.self_bwd_macs, self_flops=stats.self_flops - stats.self_bwd_flops,
            bwd_macs=0, bwd_flops=0, self_bwd_macs=0, self_bwd_flops=0, bwd_latency=None)
        for name, stats in estimate.modules.items()
    }
    nodes = [node for node in estimate.nodes if not node.is_backward]
    own_bytes, bytes_ = module_sums(nodes, lambda cost: cost.bytes, estimate.aliases, modules)
    for name, stats in modules.items():
        stats.self_bytes, stats.bytes = own_bytes[name], bytes_[name]
    return dataclasses.replace(
        estimate, total_macs=estimate.fwd_macs, total_flops=estimate.fwd_flops, modules=modules, nodes=nodes,
        by_op=totals_by(nodes, lambda cost: cost.op), by_rule=totals_by(nodes, lambda cost: cost.rule_key),
        unknown=unknown_ops(nodes), tree=None, backward=False, bwd_macs=0, bwd_flops=0,
    )
