"""torch.cond branches: walk op nodes into subgraphs, count each op in one branch.

As FlopCounterMode counts a cond, an op counts in the branch where it costs the most; its nodes in the
other branches count 0 (fxflops.capture.branches records which branch a node ran in).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from fxflops.capture.flex import FLEX_HOPS
from fxflops.capture.recorder import COND_BRANCH
from fxflops.count.nodes import attribute
from fxflops.results import NodeCost


def op_nodes(graph_module: torch.fx.GraphModule, branches: tuple = ()
             ) -> Iterator[tuple[torch.fx.GraphModule, torch.fx.Node, tuple]]:
    """Op nodes in order with the torch.cond branches they run in (outermost first), descending into
    the subgraphs of higher-order ops (e.g. no_grad regions; a cond's branches)."""
    cond = getattr(getattr(torch.ops, "higher_order", None), "cond", None)
    for node in graph_module.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        # (a flex_attention call is one op: its score_mod and mask_mod subgraphs run inside the kernel.
        # An aten op is told apart by its type first: HigherOrderOperator is an ABC, its isinstance slow)
        if node.op == "call_function" and type(node.target) is not torch._ops.OpOverload \
                and isinstance(node.target, torch._ops.HigherOrderOperator) and node.target not in FLEX_HOPS:
            subgraphs = [arg for arg in node.args if isinstance(arg, torch.fx.Node) and arg.op == "get_attr"]
            for index, arg in enumerate(subgraphs):
                sub = attribute(graph_module, arg.target)
                if isinstance(sub, torch.fx.GraphModule):
                    inner = (*branches, (node, index)) if node.target is cond else branches
                    yield from op_nodes(sub, inner)
            continue
        yield graph_module, node, branches + node.meta.get(COND_BRANCH, ())


def larger_branches(costs: list[NodeCost], branches: list[tuple]) -> list[NodeCost]:
    """Each torch.cond, innermost first: an op (an overload packet, as FlopCounterMode keys it) counts
    in the branch where it costs the most FLOPs (then MACs; the first on a tie); its nodes in the other
    branches count 0. FlopCounterMode's rule, so the torch preset matches it. Symbolic costs (a sweep)
    cannot be compared: such a cond keeps both branches."""
    depth: dict[Any, int] = {}
    for tags in branches:
        for level, (cond, _) in enumerate(tags):
            depth[cond] = level
    costs = list(costs)
    for cond in sorted(depth, key=lambda c: -depth[c]):
        inside = [(index, dict(tags)[cond]) for index, tags in enumerate(branches) if cond in dict(tags)]
        if not all(isinstance(costs[i].macs, int) and isinstance(costs[i].flops, int) for i, _ in inside):
            continue
        totals: dict[tuple[str, int], list[int]] = {}
        for index, branch in inside:
            total = totals.setdefault((_packet(costs[index].op), branch), [0, 0])
            total[0] += costs[index].flops
            total[1] += costs[index].macs
        winner: dict[str, int] = {}
        for (packet, branch), total in sorted(totals.items(), key=lambda item: item[0][1]):
            if packet not in winner or total > totals[(packet, winner[packet])]:
                winner[packet] = branch
        for index, branch in inside:
            if winner[_packet(costs[index].op)] != branch:
                costs[index] = _not_counted(costs[index])
    return costs


def _packet(op: str) -> str:
    """aten.mm.default -> aten.mm: FlopCounterMode keys its counts by overload packet."""
    return op.rsplit(".", 1)[0] if op.startswith("aten.") and op.count(".") >= 2 else op


def _not_counted(cost: NodeCost) -> NodeCost:
    def zero(value: Any) -> Any:
        return None if value is None else 0

    return dataclasses.replace(cost, macs=0, flops=0, dense_macs=zero(cost.dense_macs),
                               dense_flops=zero(cost.dense_flops), effective_macs=zero(cost.effective_macs),
                               effective_flops=zero(cost.effective_flops))

