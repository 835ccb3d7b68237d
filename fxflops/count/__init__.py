"""Count: match every op node of a captured graph against the rule table and cost it.

Each node ends up counted by a rule, declared zero by a zero list, or unknown. Unknown nodes cost 0
but are kept, so the estimate can report them by op, count and module.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fxflops.capture.backward import DIFFERENTIATES
from fxflops.count.attention import DENSE, check_attention, with_eager_effective, with_effective
from fxflops.count.branches import larger_branches, op_nodes
from fxflops.count.nodes import NodeValues, ReplayedCosts, call_of, covered_cost, node_cost, value_of, whole_call_cost
from fxflops.eager_attention import attention_of, find_eager_attention
from fxflops.results import BACKWARD, FORWARD, PHASE, ROOT_LABEL, Captured, NodeCost, WholeCall
from fxflops.rules import OpCall, Rule, RuleEvaluationError, RuleTable, ZeroList, bind_op_call
from fxflops.rules.kept_pairs import KeptPairs

__all__ = ["RuleEvaluationError", "count_nodes"]


def count_nodes(captured: Captured, table: RuleTable, conventions: str, attention: str = DENSE,
                lazy: bool = False) -> list[NodeCost]:
    """Cost every op node, then replace what runs inside whole-counted modules by one cost per call.

    Attention ops carry both readings; `attention` says which one their macs/flops are. `lazy` (a sweep's
    Piece): under symbolic sizes a count may be a `fxflops.rules.polynomial.PolyCount`, written as sympy
    only when read so (every other caller gets ints and sympy expressions)."""
    check_attention(attention)
    whole_paths = captured.whole_paths
    sizes = captured.sizes
    costs = []
    memo: dict[Any, tuple[Any, ...]] = {}
    values = NodeValues(sizes, lazy)
    kept_memo: dict[Any, KeptPairs] = {}
    effective_memo: dict[Any, tuple[Any, Any]] = {}
    eager = find_eager_attention((node for _, node, _ in op_nodes(captured.graph_module)), kept_memo,
                                 symbolic=sizes is not None)
    branches = []
    copyable = ReplayedCosts(values)
    for graph_module, node, in_branches in op_nodes(captured.graph_module):
        branches.append(in_branches)
        path, _ = node.meta.get("fxflops_module", ("", ""))
        # a module rule counts its forward (run or recomputed); the backward's ops count one by one
        covering = _covering(path, whole_paths) if whole_paths and node.meta.get(PHASE) != BACKWARD else None
        if covering is not None and not (node.op == "call_module" and node.target == covering):
            costs.append(covered_cost(node, covering, sizes))
            continue
        copied = copyable.cost_of(node, path) \
            if not in_branches and not (eager and attention_of(node, eager, None)) else None
        if copied is not None:
            costs.append(copied)
            continue
        cost, rule, key = node_cost(graph_module, node, table, conventions, memo, sizes, values)
        plain = not in_branches
        if isinstance(rule, Rule) and rule.effective is not None:
            cost = with_effective(cost, graph_module, node, rule, table, conventions, sizes, kept_memo, attention,
                                  (effective_memo, key), eager)
            plain = False
        elif isinstance(rule, Rule) and eager:
            found = attention_of(node, eager, node.meta.get(DIFFERENTIATES))
            if found is not None:
                cost = with_eager_effective(cost, found, sizes, attention)
                plain = False
        if plain and (rule is None or rule.gathers is None):
            copyable.add(node, cost)
        costs.append(cost)
    if any(branches):
        costs = larger_branches(costs, branches)
    costs += [whole_call_cost(call, name, table, conventions, sizes)
              for call, name in zip(captured.whole_calls, whole_call_names(captured.whole_calls))]
    return costs


def _covering(path: str, whole_paths: frozenset[str]) -> str | None:
    """The outermost whole-counted module that contains `path`, if any."""
    if not whole_paths:
        return None
    parts = path.split(".") if path else []
    for end in range(0, len(parts) + 1):
        candidate = ".".join(parts[:end])
        if candidate in whole_paths:
            return candidate
    return None


def whole_call_names(calls: list[WholeCall]) -> list[str]:
    """A name per call of a module counted whole: "lin:call", then "lin:call#2", ... for its later calls."""
    seen: dict[str, int] = {}
    names = []
    for call in calls:
        base = f"{call.module or ROOT_LABEL}:{'call' if call.phase == FORWARD else 'recompute'}"
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}#{seen[base]}")
    return names


def node_calls(captured: Captured) -> Iterator[tuple[str, OpCall | None]]:
    """Each op node's name with its op call bound as count_nodes binds it (None for a node inside a
    module a rule counts whole), then each whole-counted module call: what `explain` re-reads."""
    whole_paths = captured.whole_paths
    for graph_module, node, _ in op_nodes(captured.graph_module):
        path, _ = node.meta.get("fxflops_module", ("", ""))
        covering = _covering(path, whole_paths) if node.meta.get(PHASE) != BACKWARD else None
        if covering is not None and not (node.op == "call_module" and node.target == covering):
            yield node.name, None
            continue
        args = tuple(value_of(graph_module, a) for a in node.args)
        kwargs = {k: value_of(graph_module, v) for k, v in node.kwargs.items()}
        yield node.name, call_of(graph_module, node, args, kwargs, node.meta.get("val"))
    for call, name in zip(captured.whole_calls, whole_call_names(captured.whole_calls)):
        yield name, bind_op_call(call.module, "module", call.args, call.kwargs, call.out, call.target)
