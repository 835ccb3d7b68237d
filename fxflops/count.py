"""Count: match every op node of a captured graph against the rule table and cost it.

Each node ends up counted by a rule, declared zero by a zero list, or unknown. Unknown nodes cost 0
but are kept, so the estimate can report them by op, count and module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from fxflops.capture.backward import DIFFERENTIATES
from fxflops.capture.flex import FLEX_HOPS
from fxflops.capture.recorder import COND_BRANCH, SOURCE, source_text
from fxflops.eager_attention import EagerAttention, attention_of, effective_count, find_eager_attention
from fxflops.rules.flex import attention_kept_pairs
from fxflops.rules.kept_pairs import FULL, KeptPairs
from fxflops.results import (
    BACKWARD, COUNTED, FORWARD, PHASE, ROOT_LABEL, UNKNOWN, ZERO, Captured, NodeCost, WholeCall,
)
from fxflops.rules import OpCall, Rule, RuleEvaluationError, RuleTable, ZeroList, bind_op_call
from fxflops.traffic import node_bytes

__all__ = ["RuleEvaluationError", "count_nodes"]


DENSE = "dense"
EFFECTIVE = "effective"
ATTENTION_READINGS = (DENSE, EFFECTIVE)  # how attention ops count: every pair, or the pairs the mask keeps


def count_nodes(captured: Captured, table: RuleTable, conventions: str, attention: str = DENSE) -> list[NodeCost]:
    """Cost every op node, then replace what runs inside whole-counted modules by one cost per call.

    Attention ops carry both readings; `attention` says which one their macs/flops are."""
    check_attention(attention)
    whole_paths = captured.whole_paths
    sizes = captured.sizes
    costs = []
    memo: dict[Any, tuple[str, Rule | ZeroList | None, int, int]] = {}
    kept_memo: dict[Any, KeptPairs] = {}
    eager = find_eager_attention((node for _, node, _ in _op_nodes(captured.graph_module)), kept_memo,
                                 symbolic=sizes is not None)
    branches = []
    for graph_module, node, in_branches in _op_nodes(captured.graph_module):
        branches.append(in_branches)
        path, _ = node.meta.get("fxflops_module", ("", ""))
        # a module rule counts its forward (run or recomputed); the backward's ops count one by one
        covering = _covering(path, whole_paths) if node.meta.get(PHASE) != BACKWARD else None
        if covering is not None and not (node.op == "call_module" and node.target == covering):
            costs.append(_covered_cost(node, covering, sizes))
        else:
            cost, rule = _node_cost(graph_module, node, table, conventions, memo, sizes)
            if isinstance(rule, Rule) and rule.effective is not None:
                cost = _with_effective(cost, graph_module, node, rule, table, conventions, sizes, kept_memo, attention)
            elif isinstance(rule, Rule) and eager:
                found = attention_of(node, eager, node.meta.get(DIFFERENTIATES))
                if found is not None:
                    cost = _with_eager_effective(cost, found, sizes, attention)
            costs.append(cost)
    if any(branches):
        costs = _larger_branches(costs, branches)
    costs += [_whole_call_cost(call, name, table, conventions, sizes)
              for call, name in zip(captured.whole_calls, whole_call_names(captured.whole_calls))]
    return costs


def check_attention(attention: str) -> None:
    """A ValueError naming the readings for anything but "dense" or "effective"."""
    if attention not in ATTENTION_READINGS:
        raise ValueError(f"attention={attention!r}: say 'dense' (every (query, key) pair, as FlopCounterMode "
                         "counts) or 'effective' (only the pairs the mask keeps)")


def _with_effective(cost: NodeCost, graph_module: torch.fx.GraphModule, node: torch.fx.Node, rule: Rule,
                    table: RuleTable, conventions: str, sizes: Any, kept_memo: dict[Any, KeptPairs],
                    attention: str) -> NodeCost:
    """The node's cost with both readings of its attention: effective over the pairs its mask keeps."""
    args = tuple(_value(graph_module, a) for a in node.args)
    kwargs = {k: _value(graph_module, v) for k, v in node.kwargs.items()}
    call = _call_of(graph_module, node, args, kwargs, node.meta.get("val"))
    given = _call_of(graph_module, node, node.args, node.kwargs, None).names  # the same names, bound to nodes
    kept = attention_kept_pairs(call.key, call.names, given, kept_memo, symbolic=sizes is not None)
    forward = node.meta.get(DIFFERENTIATES)
    if kept is not None and kept.pairs is None and ("node", forward) in kept_memo:
        # a backward kernel reads the mask the autograd graph saved; the forward it differentiates read it
        # as the model built it (same query and key sizes: the same pairs)
        kept = kept_memo[("node", forward)]
    kept_memo[("node", node.name)] = kept
    if kept is None:  # no mask: every pair is kept
        kept, macs, flops = KeptPairs(None, FULL), cost.macs, cost.flops
    elif kept.pairs is None:
        macs = flops = None
    else:
        try:
            macs, flops = table.effective_cost(rule, call, conventions, kept.pairs)
        except RuleEvaluationError as error:
            raise error.in_module(cost.module or ROOT_LABEL) from error.__cause__
        macs, flops = _to_count(macs, sizes), _to_count(flops, sizes)
    use = attention == EFFECTIVE and macs is not None
    return dataclasses.replace(
        cost, macs=macs if use else cost.macs, flops=flops if use else cost.flops, attention=kept.pattern,
        dense_macs=cost.macs, dense_flops=cost.flops, effective_macs=macs, effective_flops=flops,
        kept_pairs=_to_count(kept.pairs, sizes) if kept.pairs is not None else None,
    )


def _with_eager_effective(cost: NodeCost, found: EagerAttention, sizes: Any, attention: str) -> NodeCost:
    """A product of attention written as plain ops, read both ways: effective = dense x kept / all pairs."""
    kept = found.kept
    if kept.pairs is None and kept.pattern == FULL:
        macs, flops = cost.macs, cost.flops
    elif kept.pairs is None:
        macs = flops = None
    else:
        macs, flops = (effective_count(dense, kept.pairs, found.grid, sizes) for dense in (cost.macs, cost.flops))
    use = attention == EFFECTIVE and macs is not None
    return dataclasses.replace(
        cost, macs=macs if use else cost.macs, flops=flops if use else cost.flops, attention=kept.pattern,
        dense_macs=cost.macs, dense_flops=cost.flops, effective_macs=macs, effective_flops=flops,
    )


def _op_nodes(graph_module: torch.fx.GraphModule, branches: tuple = ()
              ) -> Iterator[tuple[torch.fx.GraphModule, torch.fx.Node, tuple]]:
    """Op nodes in order with the torch.cond branches they run in (outermost first), descending into
    the subgraphs of higher-order ops (e.g. no_grad regions; a cond's branches)."""
    cond = getattr(getattr(torch.ops, "higher_order", None), "cond", None)
    for node in graph_module.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        # (a flex_attention call is one op: its score_mod and mask_mod subgraphs run inside the kernel)
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator) \
                and node.target not in FLEX_HOPS:
            subgraphs = [arg for arg in node.args if isinstance(arg, torch.fx.Node) and arg.op == "get_attr"]
            for index, arg in enumerate(subgraphs):
                sub = _attr(graph_module, arg.target)
                if isinstance(sub, torch.fx.GraphModule):
                    inner = (*branches, (node, index)) if node.target is cond else branches
                    yield from _op_nodes(sub, inner)
            continue
        yield graph_module, node, branches + node.meta.get(COND_BRANCH, ())


def _larger_branches(costs: list[NodeCost], branches: list[tuple]) -> list[NodeCost]:
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


def _attr(graph_module: torch.nn.Module, target: str) -> Any:
    value: Any = graph_module
    for part in target.split("."):
        value = getattr(value, part)
    return value


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


def _value(graph_module: torch.fx.GraphModule, arg: Any) -> Any:
    if isinstance(arg, torch.fx.Node):
        if "val" in arg.meta:
            return arg.meta["val"]
        if arg.op == "get_attr":
            return _attr(graph_module, arg.target)
        return None
    if isinstance(arg, list | tuple):
        return type(arg)(_value(graph_module, a) for a in arg)
    if isinstance(arg, dict):
        return {k: _value(graph_module, v) for k, v in arg.items()}
    return arg


def _call_of(graph_module: torch.fx.GraphModule, node: torch.fx.Node, args: tuple, kwargs: dict, out: Any) -> OpCall:
    if node.op == "call_module":
        return bind_op_call(node.target, "module", args, kwargs, out, graph_module.get_submodule(node.target))
    if node.op == "call_method":
        return bind_op_call(node.target, "method", args, kwargs, out)
    kind = "aten" if isinstance(node.target, torch._ops.OpOverload) else "function"
    return bind_op_call(node.target, kind, args, kwargs, out)


def _node_cost(graph_module: torch.fx.GraphModule, node: torch.fx.Node, table: RuleTable, conventions: str,
               memo: dict[Any, tuple[str, Rule | ZeroList | None, int, int]],
               sizes: Any) -> tuple[NodeCost, Rule | ZeroList | None]:
    args = tuple(_value(graph_module, a) for a in node.args)
    kwargs = {k: _value(graph_module, v) for k, v in node.kwargs.items()}
    out = node.meta.get("val")
    path, type_name = node.meta.get("fxflops_module", ("", ""))
    key = _memo_key(node, args, kwargs, out)
    key = (key, type_name) if key is not None else None  # a rule may read the module it ran in (`within`)
    found = memo.get(key) if key is not None else None
    if found is None:
        call = dataclasses.replace(_call_of(graph_module, node, args, kwargs, out), within=type_name)
        entry = _match(table, call, path)
        found = (call.key, entry, *_apply(entry, call, table, conventions, path, sizes))
        if key is not None:
            memo[key] = found
    op, entry, macs, flops = found
    return NodeCost(
        name=node.name,
        op=op,
        status=_status(entry),
        rule=entry.name if entry is not None else None,
        module=path,
        module_type=type_name,
        input_shapes=_shapes(args, sizes) + _shapes(tuple(kwargs.values()), sizes),
        output_shapes=_shapes(out, sizes),
        macs=macs,
        flops=flops,
        source=_source_line(node),
        phase=node.meta.get(PHASE, FORWARD),
        differentiates=node.meta.get(DIFFERENTIATES),
        bytes=node_bytes(node.target, (args, kwargs), out, _moves_data(entry), sizes,
                         _gathered(entry, graph_module, node, args, kwargs, out, path, sizes)),
    ), entry


def _gathered(entry: Rule | ZeroList | None, graph_module: torch.fx.GraphModule, node: torch.fx.Node, args: tuple,
              kwargs: dict, out: Any, path: str, sizes: Any) -> tuple[torch.Tensor, Any] | None:
    """A lookup's table and the elements it reads of it (bound per node: the table is this node's value)."""
    if entry is None or entry.gathers is None:
        return None
    return _table_read(entry, _call_of(graph_module, node, args, kwargs, out), path, sizes)


def _memo_key(node: torch.fx.Node, args: tuple, kwargs: dict, out: Any) -> Any:
    """What a rule can read of a call: the op, and its values' shapes, dtypes and plain arguments.

    Calls with equal keys cost the same (the 80 identical layers of a decoder), so each key is matched
    and evaluated once. Module calls (rules read module attributes) are not keyed; symbolic sizes are
    keyed by their expressions."""
    if node.op == "call_module":
        return None
    key = (node.op, node.target, _signature(args), _signature(kwargs), _signature(out))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        shape = tuple(value.shape)
        if torch.SymInt in map(type, shape):  # (the test runs in C: this is per argument of every node)
            shape = tuple(_signature(size) for size in shape)
        return (shape, value.dtype)
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return (type(value), value.node.expr)
    if isinstance(value, list | tuple):
        return (type(value), tuple(_signature(item) for item in value))
    if isinstance(value, dict):
        return tuple((key, _signature(item)) for key, item in value.items())
    return (type(value), value)


def _covered_cost(node: torch.fx.Node, covering: str, sizes: Any) -> NodeCost:
    path, type_name = node.meta.get("fxflops_module", ("", ""))
    return NodeCost(
        name=node.name, op=_op_name(node), status=ZERO, rule=f"inside:{covering or ROOT_LABEL}", module=path,
        module_type=type_name, input_shapes=(), output_shapes=_shapes(node.meta.get("val"), sizes), macs=0, flops=0,
        source=_source_line(node), phase=node.meta.get(PHASE, FORWARD),
    )


def whole_call_names(calls: list[WholeCall]) -> list[str]:
    """A name per call of a module counted whole: "lin:call", then "lin:call#2", ... for its later calls."""
    seen: dict[str, int] = {}
    names = []
    for call in calls:
        base = f"{call.module or ROOT_LABEL}:{'call' if call.phase == FORWARD else 'recompute'}"
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}#{seen[base]}")
    return names


def _whole_call_cost(call: WholeCall, name: str, table: RuleTable, conventions: str, sizes: Any) -> NodeCost:
    module = call.target
    op_call = bind_op_call(call.module, "module", call.args, call.kwargs, call.out, module)
    entry = _match(table, op_call, call.module)
    macs, flops = _apply(entry, op_call, table, conventions, call.module, sizes)
    return NodeCost(
        name=name, op=op_call.key, status=_status(entry),
        rule=entry.name if entry is not None else None, module=call.module, module_type=type(module).__name__,
        input_shapes=_shapes(call.args, sizes), output_shapes=_shapes(call.out, sizes), macs=macs, flops=flops,
        phase=call.phase, bytes=node_bytes(None, (call.args, call.kwargs), call.out, _moves_data(entry), sizes,
                                           _table_read(entry, op_call, call.module, sizes)),
    )


def _table_read(entry: Rule | ZeroList | None, op_call: OpCall, path: str, sizes: Any) -> Any:
    """(table, elements read of it) for an entry that gathers, else None."""
    if entry is None or entry.gathers is None:
        return None
    try:
        found = entry.gathers.read(op_call, entry.label)
    except RuleEvaluationError as error:
        raise error.in_module(path or ROOT_LABEL) from None
    return None if found is None else (found[0], _to_count(found[1], sizes))


def _match(table: RuleTable, call: OpCall, path: str) -> Rule | ZeroList | None:
    try:
        return table.match(call)  # evaluates rules' `when`
    except RuleEvaluationError as error:
        raise error.in_module(path or ROOT_LABEL) from error.__cause__


def _apply(entry: Rule | ZeroList | None, call: OpCall, table: RuleTable, conventions: str, path: str,
           sizes: Any) -> tuple[Any, Any]:
    if not isinstance(entry, Rule):
        return 0, 0
    try:
        macs, flops = table.cost(entry, call, conventions)  # checked: non-negative ints, or symbolic sizes
    except RuleEvaluationError as error:
        raise error.in_module(path or ROOT_LABEL) from error.__cause__
    return _to_count(macs, sizes), _to_count(flops, sizes)


def _to_count(value: Any, sizes: Any) -> Any:
    """An int, or under symbolic sizes an int-valued sympy expression (a float one rounded as int() rounds)."""
    if isinstance(value, torch.SymInt | torch.SymFloat):
        if sizes is None:  # symbolic without a sweep's sizes: its value at the example's sizes
            return int(value)
        # int() rounds toward zero; torch.sym_int does so symbolically
        return sizes.expression(value if isinstance(value, torch.SymInt) else torch.sym_int(value))
    return value


def _moves_data(entry: Rule | ZeroList | None) -> bool:
    return not isinstance(entry, ZeroList) or entry.moves_data


def _status(entry: Rule | ZeroList | None) -> str:
    if entry is None:
        return UNKNOWN
    return ZERO if isinstance(entry, ZeroList) else COUNTED


def _op_name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    return str(node.target)


def _shapes(value: Any, sizes: Any = None) -> tuple[tuple[Any, ...], ...]:
    """Shapes of the tensors in `value`: ints, or under symbolic sizes expressions where they vary."""
    if isinstance(value, torch.Tensor):
        if sizes is not None:
            return (tuple(sizes.expression(s) for s in value.shape),)
        shape = tuple(value.shape)
        return (shape if torch.SymInt not in map(type, shape) else tuple(int(s) for s in shape),)
    if isinstance(value, list | tuple):
        return tuple(shape for item in value for shape in _shapes(item, sizes))
    return ()


def _source_line(node: torch.fx.Node) -> str | None:
    """The user's line that ran the op: recorded at dispatch, or the innermost of a tracer's stack."""
    if SOURCE in node.meta:
        return source_text(node.meta[SOURCE])
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    lines = [line.strip() for line in trace.strip().splitlines()]
    for index in range(len(lines) - 1, -1, -1):
        if lines[index].startswith("File "):
            code = lines[index + 1] if index + 1 < len(lines) else ""
            return f"{lines[index]}: {code}"
    return None


def node_calls(captured: Captured) -> Iterator[tuple[str, OpCall | None]]:
    """Each op node's name with its op call bound as count_nodes binds it (None for a node inside a
    module a rule counts whole), then each whole-counted module call: what `explain` re-reads."""
    whole_paths = captured.whole_paths
    for graph_module, node, _ in _op_nodes(captured.graph_module):
        path, _ = node.meta.get("fxflops_module", ("", ""))
        covering = _covering(path, whole_paths) if node.meta.get(PHASE) != BACKWARD else None
        if covering is not None and not (node.op == "call_module" and node.target == covering):
            yield node.name, None
            continue
        args = tuple(_value(graph_module, a) for a in node.args)
        kwargs = {k: _value(graph_module, v) for k, v in node.kwargs.items()}
        yield node.name, _call_of(graph_module, node, args, kwargs, node.meta.get("val"))
    for call, name in zip(captured.whole_calls, whole_call_names(captured.whole_calls)):
        yield name, bind_op_call(call.module, "module", call.args, call.kwargs, call.out, call.target)
