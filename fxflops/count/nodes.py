"""Per-node costing: bind a node's call, match it to a rule, cost its MACs, FLOPs and bytes.

A node's values are its fake tensors (meta["val"]); calls with equal shapes and arguments are matched and
evaluated once (a memo keyed by their signature). Whole-counted module calls are costed the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fxflops.capture.backward import DIFFERENTIATES
from fxflops.capture.recorder import SOURCE, source_text
from fxflops.results import COUNTED, FORWARD, PHASE, ROOT_LABEL, UNKNOWN, ZERO, NodeCost, WholeCall
from fxflops.rules import OpCall, Rule, RuleEvaluationError, RuleTable, ZeroList, bind_op_call
from fxflops.traffic import node_bytes


def attribute(graph_module: torch.nn.Module, target: str) -> Any:
    value: Any = graph_module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def value_of(graph_module: torch.fx.GraphModule, arg: Any) -> Any:
    if isinstance(arg, torch.fx.Node):
        if "val" in arg.meta:
            return arg.meta["val"]
        if arg.op == "get_attr":
            return attribute(graph_module, arg.target)
        return None
    if isinstance(arg, list | tuple):
        return type(arg)(value_of(graph_module, a) for a in arg)
    if isinstance(arg, dict):
        return {k: value_of(graph_module, v) for k, v in arg.items()}
    return arg


def call_of(graph_module: torch.fx.GraphModule, node: torch.fx.Node, args: tuple, kwargs: dict, out: Any) -> OpCall:
    if node.op == "call_module":
        return bind_op_call(node.target, "module", args, kwargs, out, graph_module.get_submodule(node.target))
    if node.op == "call_method":
        return bind_op_call(node.target, "method", args, kwargs, out)
    kind = "aten" if isinstance(node.target, torch._ops.OpOverload) else "function"
    return bind_op_call(node.target, kind, args, kwargs, out)


def node_cost(graph_module: torch.fx.GraphModule, node: torch.fx.Node, table: RuleTable, conventions: str,
              memo: dict[Any, tuple[str, Rule | ZeroList | None, int, int]],
              sizes: Any) -> tuple[NodeCost, Rule | ZeroList | None]:
    args = tuple(value_of(graph_module, a) for a in node.args)
    kwargs = {k: value_of(graph_module, v) for k, v in node.kwargs.items()}
    out = node.meta.get("val")
    path, type_name = node.meta.get("fxflops_module", ("", ""))
    key = _memo_key(node, args, kwargs, out)
    key = (key, type_name) if key is not None else None  # a rule may read the module it ran in (`within`)
    found = memo.get(key) if key is not None else None
    if found is None:
        call = dataclasses.replace(call_of(graph_module, node, args, kwargs, out), within=type_name)
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
    return _table_read(entry, call_of(graph_module, node, args, kwargs, out), path, sizes)


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


def covered_cost(node: torch.fx.Node, covering: str, sizes: Any) -> NodeCost:
    path, type_name = node.meta.get("fxflops_module", ("", ""))
    return NodeCost(
        name=node.name, op=_op_name(node), status=ZERO, rule=f"inside:{covering or ROOT_LABEL}", module=path,
        module_type=type_name, input_shapes=(), output_shapes=_shapes(node.meta.get("val"), sizes), macs=0, flops=0,
        source=_source_line(node), phase=node.meta.get(PHASE, FORWARD),
    )



def whole_call_cost(call: WholeCall, name: str, table: RuleTable, conventions: str, sizes: Any) -> NodeCost:
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
    return None if found is None else (found[0], to_count(found[1], sizes))


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
    return to_count(macs, sizes), to_count(flops, sizes)


def to_count(value: Any, sizes: Any) -> Any:
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
