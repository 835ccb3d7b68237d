"""Per-node costing: bind a node's call, match it to a rule, cost its MACs, FLOPs and bytes.

A node's values are its fake tensors (meta["val"]); calls with equal shapes and arguments are matched and
evaluated once (a memo keyed by their signature). Whole-counted module calls are costed the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxflops.capture.backward import DIFFERENTIATES
from fxflops.capture.recorder import FUSED_CALL, SOURCE, source_text
from fxflops.capture.replay import REPLAY_OF
from fxflops.results import COUNTED, FORWARD, PHASE, ROOT_LABEL, UNKNOWN, ZERO, NodeCost, WholeCall
from fxflops.rules import OpCall, Rule, RuleEvaluationError, RuleTable, ZeroList, bind_op_call
from fxflops.rules.polynomial import SizeValue, UserNames
from fxflops.traffic import TensorBytes, call_bytes, node_bytes, tensors_of


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


class NodeValues:
    """One count's reading of the graph's values, each node's worked out once (a value is read as its own
    node's output and again as an argument of every node that uses it): its signature (what a rule can
    read of it) and its distinct tensors; each tensor's bytes are measured once too."""

    def __init__(self, sizes: Any, lazy: bool = False) -> None:
        self.sizes = sizes
        # a sweep's polynomials (counts and bytes) written as sympy, each distinct one once (`lazy`: kept as
        # polynomials, PolyCount, for a sweep's Piece, which compiles them as they are)
        self.user_names = UserNames(sizes, lazy) if sizes is not None else None
        self.measure = TensorBytes(sizes, self.user_names)
        self._nodes: dict[torch.fx.Node, tuple[Any, dict[int, torch.Tensor]]] = {}
        self._sources: dict[Any, str | None] = {}

    def of_node(self, graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[Any, dict[int, torch.Tensor]]:
        """(_signature(value_of(graph_module, node)), its distinct tensors by id)."""
        found = self._nodes.get(node)
        if found is None:
            value = value_of(graph_module, node)
            if isinstance(value, torch.Tensor):  # (most values: one tensor)
                tensors = {id(value): value}
            else:
                tensors = {}
                _collect(value, tensors)
            found = self._nodes[node] = (_signature(value), tensors)
        return found

    def source(self, node: torch.fx.Node) -> str | None:
        """_source_line(node), each recorded location's once (the layers of a model share their lines)."""
        location = node.meta.get(SOURCE)
        if location is None:
            return _source_line(node)
        found = self._sources.get(location, _NONE)
        if found is _NONE:
            found = self._sources[location] = source_text(location)
        return found

    def read(self, graph_module: torch.fx.GraphModule, arg: Any, tensors: dict[int, torch.Tensor]) -> Any:
        """_signature(value_of(graph_module, arg)); the distinct tensors in that value go into `tensors`."""
        kind = type(arg)
        if kind in _PLAIN:
            return (kind, arg)
        if kind is tuple or kind is list:  # (a node's args: read for every node, its items mostly nodes and ints)
            items = []
            nodes = self._nodes
            for item in arg:
                item_kind = type(item)
                if item_kind in _PLAIN:
                    items.append((item_kind, item))
                elif item_kind is torch.fx.Node:
                    found = nodes.get(item)
                    if found is None:
                        found = self.of_node(graph_module, item)
                    tensors.update(found[1])
                    items.append(found[0])
                else:
                    items.append(self.read(graph_module, item, tensors))
            return (kind, tuple(items))
        if isinstance(arg, torch.fx.Node):
            signature, found = self.of_node(graph_module, arg)
            tensors.update(found)
            return signature
        if isinstance(arg, list | tuple):
            return (kind, tuple([(type(item), item) if type(item) in _PLAIN else self.read(graph_module, item, tensors)
                                 for item in arg]))
        if isinstance(arg, dict):
            return tuple((key, self.read(graph_module, item, tensors)) for key, item in arg.items())
        if isinstance(arg, torch.Tensor):
            tensors.setdefault(id(arg), arg)
        return _signature(arg)


class ReplayedCosts:
    """The costs a count may hand on to copies of a repeated block's nodes (capture.replay).

    A copy (meta[REPLAY_OF] names the node it copies) runs the op its reference ran, on values of equal
    shapes, dtypes, strides and plain arguments: replay proved the block's program and arguments equal
    before copying it. What a rule reads of a call is just that, so the copy costs what its reference
    costs: the reference's cost record is handed on, with the copy's name, module, source line and, in a
    backward, the forward op it differentiates (a replayed backward's copies name the first copy's node). Only
    plain costs are (`add`): no attention reading, which reads where the mask came from, no lookup. A
    copy whose distinct inputs are fewer than its reference's (two tensors one there, one here: its
    bytes differ) is costed as any node."""

    __slots__ = ("_values", "_references")

    def __init__(self, values: NodeValues) -> None:
        self._values = values
        self._references: dict[str, tuple[torch.fx.Node, NodeCost]] = {}

    def add(self, node: torch.fx.Node, cost: NodeCost) -> None:
        """`node`'s plain cost, for the copies of it that follow."""
        if node.op == "call_function":
            self._references[node.name] = (node, cost)

    def cost_of(self, node: torch.fx.Node, path: str) -> NodeCost | None:
        """A copy's cost, its reference's handed on; None where it must be costed on its own."""
        reference = node.meta.get(REPLAY_OF)
        if reference is None:
            return None
        found = self._references.get(reference)
        if found is None:
            return None
        original, cost = found
        meta = node.meta
        # (`_input_nodes`: the distinct input nodes FX keeps; `all_input_nodes` copies them into a list)
        if node.target is not original.target or len(node._input_nodes) != len(original._input_nodes) \
                or meta.get("fxflops_module", ("", ""))[1] != cost.module_type \
                or meta.get(PHASE, FORWARD) != cost.phase:
            return None
        made = object.__new__(NodeCost)
        state = made.__dict__
        state.update(cost.__dict__)
        state["name"], state["module"], state["source"] = node.name, path, self._values.source(node)
        state["differentiates"] = meta.get(DIFFERENTIATES)  # (a backward copy's: its own block's forward op)
        return made


_NONE = object()

# types whose values _signature keys as (type, value): keyed here without its isinstance tests
_PLAIN = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})


def _collect(value: Any, found: dict[int, torch.Tensor]) -> None:
    """The distinct tensors in a value, as fxflops.traffic finds them."""
    found.update((id(tensor), tensor) for tensor in tensors_of(value))


def node_cost(graph_module: torch.fx.GraphModule, node: torch.fx.Node, table: RuleTable, conventions: str,
              memo: dict[Any, tuple[Any, ...]], sizes: Any,
              values: NodeValues | None = None) -> tuple[NodeCost, Rule | ZeroList | None, Any]:
    """The node's cost, the rule or zero list that gave it, and its memo key (None: not keyed). `memo` (per
    count): what calls with equal keys share (the match, MACs, FLOPs and shapes); `values`: the count's
    NodeValues."""
    values = values if values is not None else NodeValues(sizes)
    path, type_name = node.meta.get("fxflops_module", ("", ""))
    read: dict[int, torch.Tensor] = {}
    # what a rule can read of the call: the op, and its values' shapes, dtypes and plain arguments. Calls
    # with equal keys cost the same (the 80 identical layers of a decoder), so each key is matched and
    # evaluated once. Module calls (rules read module attributes) are not keyed; symbolic sizes are keyed
    # by their expressions; a rule may read the module it ran in (`within`).
    kwargs = node.kwargs
    key: Any = (node.op, node.target, values.read(graph_module, node.args, read),
                values.read(graph_module, kwargs, read) if kwargs else (), values.of_node(graph_module, node)[0],
                type_name)
    found = None
    if node.op == "call_module":
        key = None
    else:
        try:
            found = memo.get(key)
        except TypeError:  # an argument no key can hold: matched and evaluated for this call alone
            key = None
    call_values = None
    if found is None:
        call_values = _call_values(graph_module, node)
        args, kwargs, out = call_values
        call = dataclasses.replace(call_of(graph_module, node, args, kwargs, out), within=type_name)
        entry = _match(table, call, path)
        # the shapes follow from the key (it holds every tensor's shape), so calls that share it share them
        found = (call.key, entry, *_apply(entry, call, table, conventions, path, sizes, values.user_names),
                 _shapes(args, sizes) + _shapes(tuple(kwargs.values()), sizes), _shapes(out, sizes))
        if key is not None:
            memo[key] = found
    op, entry, macs, flops, input_shapes, output_shapes = found
    gathered = None
    if entry is not None and entry.gathers is not None:
        gathered = _gathered(entry, graph_module, node, *(call_values or _call_values(graph_module, node)), path, sizes)
    return _node_cost(
        name=node.name,
        op=op,
        status=_status(entry),
        rule=entry.name if entry is not None else None,
        module=path,
        module_type=type_name,
        input_shapes=input_shapes,
        output_shapes=output_shapes,
        macs=macs,
        flops=flops,
        source=values.source(node),
        phase=node.meta.get(PHASE, FORWARD),
        differentiates=node.meta.get(DIFFERENTIATES),
        fused_call=node.meta.get(FUSED_CALL),
        channels_last=_channels_last(node),
        strided_inputs=_strided_inputs(node),
        bytes=call_bytes(node.target, read.values(), values.of_node(graph_module, node)[1].values(), _moves_data(entry),
                         values.measure, gathered),
    ), entry, key


_LAYOUT_OPS = ("batch_norm", "convolution", "conv1d", "conv2d", "conv3d")


def _channels_last(node: torch.fx.Node) -> bool:
    """A batch norm's or convolution's activation (its first 4-D/5-D tensor argument) is channels-last in memory:
    strides[1] == 1 with more than one channel, what torch's CUDA batch norm (batch_norm_choose_impl) and cuDNN's
    memory-format choice read. Other ops: False, unchecked (this runs for every node). Under a sweep's named sizes
    only what is known without a guard counts (a layout question must not narrow the sweep's validity)."""
    if node.op != "call_function":
        return False
    name = getattr(node.target, "__name__", "")
    if not any(part in name for part in _LAYOUT_OPS):
        return False
    for arg in node.args[:3]:
        value = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
        if isinstance(value, torch.Tensor) and value.dim() in (4, 5):
            try:
                return bool(_known_above_one(value.shape[1]) and _known_equal(value.stride(1), 1)
                            and not _known_equal(value.stride(-1), 1))
            except (RuntimeError, TypeError):  # strides a tensor cannot give: read as the default layout
                return False
    return False


def _strided_inputs(node: torch.fx.Node) -> tuple[int, ...]:
    """The positions of a layer norm's tensor arguments (forward: the input; backward: the output's gradient, the
    input) that are not contiguous in memory, which torch's CUDA layer norm copies to contiguous tensors before its
    kernels (cuda_kernels.layer_norm_launches). Other ops: (), unchecked (this runs for every node). Under a sweep's
    named sizes only what is known without a guard counts: a stride that may or may not be the contiguous one is read
    as contiguous (a layout question must not narrow the sweep's validity)."""
    if node.op != "call_function" or "native_layer_norm" not in getattr(node.target, "__name__", ""):
        return ()
    strided = []
    for position, arg in enumerate(node.args[:2]):
        value = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
        if isinstance(value, torch.Tensor) and _known_strided(value):
            strided.append(position)
    return tuple(strided)


def _known_strided(value: torch.Tensor) -> bool:
    """Whether a tensor is known, without a guard, not to be contiguous: from its last dim inward, a dim of more than
    one element whose stride is known to differ from the product of the sizes after it (size-1 dims are skipped, as
    is_contiguous skips them)."""
    try:
        if any(_known_equal(size, 0) for size in value.shape):  # no elements: contiguous, as torch says
            return False
        expected: Any = 1
        for size, stride in reversed(list(zip(value.shape, value.stride()))):
            if _known_equal(size, 1):
                continue
            if _known_equal(stride, expected):
                expected = expected * size
                continue
            return _known_unequal(stride, expected)
    except (RuntimeError, TypeError):  # strides a tensor cannot give: read as contiguous
        return False
    return False


def _as_int(size: Any) -> int | None:
    """A size as a Python int where it is one (a SymInt whose expression is a number included); else None."""
    return size if isinstance(size, int) else size.node.maybe_as_int()


def _known_equal(a: Any, b: Any) -> bool:
    """statically_known_true(a == b) for sizes and strides, without building a symbolic comparison where the answer is
    plain: two numbers compare; an expression in named sizes equals a number for no sweep (sympy would have reduced a
    constant expression to it); the same expression is equal. Only two different expressions ask the ShapeEnv."""
    ia, ib = _as_int(a), _as_int(b)
    if ia is not None or ib is not None:
        return ia == ib
    return a.node.expr == b.node.expr or statically_known_true(a == b)


def _known_unequal(a: Any, b: Any) -> bool:
    """statically_known_true(a != b), with _known_equal's plain cases answered without the ShapeEnv."""
    ia, ib = _as_int(a), _as_int(b)
    if ia is not None and ib is not None:
        return ia != ib
    if ia is None and ib is None and a.node.expr == b.node.expr:
        return False
    return statically_known_true(a != b)


def _known_above_one(size: Any) -> bool:
    """statically_known_true(size > 1): a number compares; an expression asks the ShapeEnv (a symbolic channel count)."""
    known = _as_int(size)
    return known > 1 if known is not None else statically_known_true(size > 1)


def _fields_set_directly(cls: type) -> dict[str, Any] | None:
    """A frozen dataclass' field defaults, where an instance can be made by filling its __dict__ (plain
    defaults, no __post_init__, no slots); else None."""
    fields = dataclasses.fields(cls)
    if hasattr(cls, "__post_init__") or "__slots__" in vars(cls) \
            or any(field.default_factory is not dataclasses.MISSING or not field.init for field in fields):
        return None
    return {field.name: field.default for field in fields if field.default is not dataclasses.MISSING}


_NODE_COST_DEFAULTS = _fields_set_directly(NodeCost)


def _node_cost(**fields: Any) -> NodeCost:
    """NodeCost(**fields), made without the frozen dataclass' __init__, which sets each of its 22 fields
    through object.__setattr__: 2.2 us a node against 0.5 us, and a 70B's count costs 5,000 nodes. The
    same instance: equal, hashing alike, every field set (a required one missing is a TypeError too)."""
    if _NODE_COST_DEFAULTS is None:
        return NodeCost(**fields)
    made = object.__new__(NodeCost)
    state = made.__dict__
    state.update(_NODE_COST_DEFAULTS)
    state.update(fields)
    if len(state) != len(_NODE_COST_FIELDS):
        raise TypeError(f"NodeCost fields missing or unknown: {sorted(set(state) ^ _NODE_COST_FIELDS)}")
    return made


_NODE_COST_FIELDS = frozenset(field.name for field in dataclasses.fields(NodeCost))


def _call_values(graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[tuple, dict, Any]:
    """(args, kwargs, out): the node's call on its values."""
    args = tuple(value_of(graph_module, a) for a in node.args)
    kwargs = {k: value_of(graph_module, v) for k, v in node.kwargs.items()}
    return args, kwargs, node.meta.get("val")


def _gathered(entry: Rule | ZeroList | None, graph_module: torch.fx.GraphModule, node: torch.fx.Node, args: tuple,
              kwargs: dict, out: Any, path: str, sizes: Any) -> tuple[torch.Tensor, Any] | None:
    """A lookup's table and the elements it reads of it (bound per node: the table is this node's value)."""
    if entry is None or entry.gathers is None:
        return None
    return _table_read(entry, call_of(graph_module, node, args, kwargs, out), path, sizes)


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
           sizes: Any, user_names: UserNames | None = None) -> tuple[Any, Any]:
    if not isinstance(entry, Rule):
        return 0, 0
    try:
        # checked: non-negative ints, or symbolic sizes (under a sweep's, as polynomials while the formulas add
        # and multiply them: fxflops.rules.polynomial)
        macs, flops = table.cost(entry, call, conventions, lift=sizes is not None)
    except RuleEvaluationError as error:
        raise error.in_module(path or ROOT_LABEL) from error.__cause__
    return to_count(macs, sizes, user_names), to_count(flops, sizes, user_names)


def to_count(value: Any, sizes: Any, user_names: UserNames | None = None) -> Any:
    """An int, or under symbolic sizes an int-valued sympy expression (a float one rounded as int() rounds).
    `user_names`: the count's (writes each distinct polynomial once)."""
    if type(value) is SizeValue:  # a formula's polynomial: written as sympy once, in the user's names
        if sizes is None:
            return int(value.sym())
        return (user_names or UserNames(sizes))(value.poly)
    if isinstance(value, torch.SymInt | torch.SymFloat):
        if sizes is None:  # symbolic without a sweep's sizes: its value at the example's sizes
            return int(value)
        if isinstance(value, torch.SymInt):
            return sizes.expression(value)
        # int() rounds toward zero; torch.sym_int does so symbolically. The float itself is kept: at a point
        # where it is not an integer estimate() refuses the count, and so must a sweep (fxflops.sweeps.piece)
        rounded = sizes.expression(torch.sym_int(value))
        if hasattr(sizes, "rounded"):
            sizes.rounded[rounded] = sizes.expression(value)
        return rounded
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
