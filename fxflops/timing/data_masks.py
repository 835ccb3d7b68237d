"""Data masks: the meter's effective attention counted from the real batch's mask.

A padding or document mask that arrives as an input leaves an attention op's kept pairs unknown to
the capture: its effective reading is None and it counts dense. For each such op of a sweep piece,
`DataMasks` keeps the part of the graph that derived the mask (the ops between the model's input
placeholders and the op's mask argument, sizes left symbolic) and, for every batch, replays it on the
batch's real tensors, on their device, then counts the mask's kept pairs there: no second forward, and
O(mask elements) work. The op's effective cost is the rule's own effective formulas, which are linear
in `kept_pairs`: read at capture as a cost at no pair plus a cost per pair, both expressions in the
sizes. A backward kernel reads the mask its forward read. Counts stay 0-d tensors on the device until
read: no host synchronization per step. A derivation that reads anything but inputs and sizes (a
parameter or buffer, a random op, an in-place write) is not replayed: that op stays dense, and says why.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fxflops.capture.backward import DIFFERENTIATES
from fxflops.capture.inputs import INPUT_INDEX
from fxflops.rules import Rule, bind_op_call
from fxflops.rules.kept_pairs import MASK_NAMES, SEQ_FIRST



class NotReplayable(Exception):
    """A mask whose derivation from the inputs cannot be replayed on a real batch; says why."""


@dataclasses.dataclass(frozen=True)
class _Replay:
    """The ops that derive one mask from the model's inputs, in graph order."""

    mask: torch.fx.Node
    nodes: tuple[torch.fx.Node, ...]  # call_function nodes only
    inputs: tuple[tuple[torch.fx.Node, int], ...]  # placeholder, its index among the batch's tensors


@dataclasses.dataclass(frozen=True)
class _Term:
    """One attention op whose mask is data: flops = base + per_pair x the pairs its mask keeps."""

    name: str
    backward: bool
    replay: _Replay
    grid: tuple[Any, ...]  # B, H, Lq, Lk: sizes, or sympy expressions in the named sizes
    base: Any
    per_pair: Any


class DataMasks:
    """The attention ops of one sweep piece whose masks come from data, each with its mask's replay.

    `names` are the nodes counted here (the piece's static total leaves them out); `skipped` says, per
    module, why an op with a data mask stays dense."""

    def __init__(self, piece: Any, table: Any, conventions: str) -> None:
        self.sizes = piece.captured.sizes
        self.terms: list[_Term] = []
        self.skipped: dict[str, str] = {}  # module -> why its mask is not replayed
        self._functions: dict[Any, Callable[[Mapping[str, int]], Any]] = {}
        self._callables: dict[torch.fx.Node, Callable[..., Any]] = {}  # per node: what runs its op on real values
        graph = piece.captured.graph_module.graph
        by_name = {node.name: node for node in graph.nodes}
        replays: dict[str, _Replay | NotReplayable] = {}  # forward node name -> its mask's replay
        unknown = [c for c in piece.costs if c.attention is not None and c.effective_flops is None and c.dense_flops]
        for cost in sorted(unknown, key=lambda c: c.is_backward):  # forwards first: backwards reuse their replay
            node = by_name.get(cost.name)
            try:
                if node is None:
                    raise NotReplayable("its op is not in the captured graph's top level")
                base, per_pair = self._linear_cost(node, cost, table, conventions)
                replay = self._replay_of(node, by_name, replays)
                self.terms.append(_Term(cost.name, cost.is_backward, replay, self._grid(node), base, per_pair))
            except NotReplayable as reason:
                self.skipped.setdefault(cost.module or "the model", str(reason))
        self.names = frozenset(term.name for term in self.terms)

    # ------------------------------------------------------------------------------------- capture

    def _replay_of(self, node: torch.fx.Node, by_name: dict[str, torch.fx.Node],
                   replays: dict[str, _Replay | NotReplayable]) -> _Replay:
        names = bind_op_call(node.target, "aten", node.args, node.kwargs, None).names
        mask = next((names[n] for n in MASK_NAMES if isinstance(names.get(n), torch.fx.Node)), None)
        found: _Replay | NotReplayable
        try:
            if mask is None:
                raise NotReplayable("its mask is not a graph value")
            found = derivation(mask)
        except NotReplayable as reason:
            found = reason
        forward = by_name.get(node.meta.get(DIFFERENTIATES) or "")
        if isinstance(found, NotReplayable) and forward is not None and forward.name in replays:
            found = replays[forward.name]  # a backward kernel's saved mask: the one its forward read
        replays[node.name] = found
        if isinstance(found, NotReplayable):
            raise found
        return found

    def _linear_cost(self, node: torch.fx.Node, cost: Any, table: Any, conventions: str) -> tuple[Any, Any]:
        """The rule's effective FLOPs as base + per_pair x kept_pairs (its formulas are linear in them)."""
        values = _values(node.args), {k: _values(v) for k, v in node.kwargs.items()}
        call = bind_op_call(node.target, "aten", *values, node.meta.get("val"))
        call = dataclasses.replace(call, within=cost.module_type)
        rule = table.match(call)
        if not isinstance(rule, Rule) or rule.effective is None:
            # eager attention's matmuls: the masks on their way are not kept with them to replay
            raise NotReplayable(f"attention written as plain ops ({call.key}) is not counted from the batch's mask")
        at = [self._expression(table.effective_cost(rule, call, conventions, pairs)[1]) for pairs in (0, 1, 2)]
        per_pair = at[1] - at[0]
        if _nonzero(at[2] - at[0] - 2 * per_pair):
            raise NotReplayable(f"its rule's effective_flops are not linear in kept_pairs ({rule.label})")
        return at[0], per_pair

    def _grid(self, node: torch.fx.Node) -> tuple[Any, ...]:
        names = bind_op_call(node.target, "aten", _values(node.args), {k: _values(v) for k, v in node.kwargs.items()},
                             None).names
        query, key = names.get("query"), names.get("key")
        if not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor):
            raise NotReplayable("its query and key are not tensors")
        if str(node.target).startswith(SEQ_FIRST):
            grid = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
        else:
            grid = (*query.shape[:-1], key.shape[-2])
        return tuple(self._expression(size) for size in grid)

    def _expression(self, value: Any) -> Any:
        return self.sizes.expression(value) if self.sizes is not None else _plain(value)

    # --------------------------------------------------------------------------------------- a batch

    def flops(self, tensors: list[torch.Tensor], point: Mapping[str, int]) -> tuple[Any, Any]:
        """(forward, backward) effective FLOPs of these ops on the batch `tensors` at the sizes `point`:
        ints, or 0-d int64 tensors on the mask's device (not yet read)."""
        counted: dict[torch.fx.Node, tuple[torch.Tensor, tuple[int, ...]]] = {}
        totals: list[Any] = [0, 0]
        for term in self.terms:
            if term.replay.mask not in counted:
                mask = self._replayed(term.replay, tensors, point)
                counted[term.replay.mask] = (kept_count(mask), tuple(mask.shape))
            kept, shape = counted[term.replay.mask]
            grid = tuple(self._at(size, point) for size in term.grid)
            pairs = kept * broadcast_repeat(shape, grid)
            totals[term.backward] = totals[term.backward] + self._at(term.base, point) + pairs * self._at(term.per_pair, point)
        return totals[0], totals[1]

    def _replayed(self, replay: _Replay, tensors: list[torch.Tensor], point: Mapping[str, int]) -> torch.Tensor:
        env: dict[torch.fx.Node, Any] = {node: tensors[index] for node, index in replay.inputs}
        device = tensors[replay.inputs[0][1]].device if replay.inputs else (tensors[0].device if tensors else None)

        def value(arg: Any) -> Any:
            if isinstance(arg, torch.fx.Node):
                return env[arg]
            if isinstance(arg, list | tuple):
                return type(arg)(value(item) for item in arg)
            if isinstance(arg, torch.SymInt | torch.SymFloat | torch.SymBool):
                return self._at(self._expression(arg), point, type(arg))
            if isinstance(arg, torch.device) and device is not None:
                return device  # the capture's device: the batch's is where the mask is rebuilt
            return arg

        with torch.no_grad():
            for node in replay.nodes:
                env[node] = self._call(node, value(node.args), {k: value(v) for k, v in node.kwargs.items()})
        return env[replay.mask]

    def _call(self, node: torch.fx.Node, args: tuple, kwargs: dict) -> Any:
        """Run the node's op on real values. A composite recorded whole (x.to(device) as aten.to.device)
        holds the Python call's arguments, which its overload may not take: then the Tensor method or
        torch function of that name, as the model called it (the one that works is kept)."""
        function = self._callables.get(node)
        if function is not None:
            return function(*args, **kwargs)
        candidates = [node.target]
        if isinstance(node.target, torch._ops.OpOverload):
            name = node.target.overloadpacket.__name__
            candidates += [f for f in (getattr(torch.Tensor, name, None), getattr(torch, name, None)) if f is not None]
        for index, function in enumerate(candidates):
            try:
                out = function(*args, **kwargs)
            except (TypeError, RuntimeError):
                if index == len(candidates) - 1:
                    raise
                continue
            self._callables[node] = function
            return out
        raise AssertionError("unreachable")

    def _at(self, expr: Any, point: Mapping[str, int], kind: type = torch.SymInt) -> Any:
        """An expression's value at the point (compiled once per expression)."""
        if isinstance(expr, int | float | bool):
            return expr
        function = self._functions.get((expr, kind))
        if function is None:
            from fxflops.sweeps import compile_expression

            compiled = compile_expression(expr)
            cast = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[kind]
            if compiled is None:
                from fxflops.capture.dynamic import user_symbol

                compiled = lambda p, e=expr: e.xreplace({user_symbol(n): v for n, v in p.items()})  # noqa: E731
            function = self._functions[(expr, kind)] = lambda p, f=compiled, c=cast: c(f(p))
        return function(point)


def derivation(mask: torch.fx.Node) -> _Replay:
    """The ops between the model's inputs and `mask`, replayable on real tensors; NotReplayable says
    what stops it (a parameter or buffer read, a random op, an in-place write, a nested graph)."""
    ancestors: set[torch.fx.Node] = set()
    stack = [mask]
    while stack:
        node = stack.pop()
        if node not in ancestors:
            ancestors.add(node)
            stack.extend(node.all_input_nodes)
    inputs, nodes = [], []
    for node in mask.graph.nodes:  # graph order is an order that runs
        if node not in ancestors:
            continue
        if node.op == "placeholder":
            if INPUT_INDEX not in node.meta:
                raise NotReplayable("its mask reads a parameter, buffer or constant tensor, not only the inputs")
            inputs.append((node, node.meta[INPUT_INDEX]))
        elif node.op != "call_function" or not callable(node.target) or isinstance(
                node.target, torch._ops.HigherOrderOperator):
            raise NotReplayable(f"its mask is built by {node.op} {node.target}, which is not replayed")
        elif isinstance(node.target, torch._ops.OpOverload) and (
                torch.Tag.nondeterministic_seeded in node.target.tags or node.target._schema.is_mutable):
            raise NotReplayable(f"its mask is built with {node.target} (random or in place)")
        else:
            nodes.append(node)
    if _written(ancestors):
        raise NotReplayable("its mask is built with in-place ops")
    return _Replay(mask, tuple(nodes), tuple(inputs))


def _written(nodes: set[torch.fx.Node]) -> bool:
    """Whether an op outside `nodes` writes one of them or a view of one (its value then depends on when
    it is read, which the data flow does not say)."""
    seen, stack = set(nodes), list(nodes)
    while stack:
        for user in stack.pop().users:
            schema = _schema(user)
            if schema is None or user in seen:
                continue
            if schema.is_mutable:
                return True
            if any(ret.alias_info is not None for ret in schema.returns):  # a view shares the storage
                seen.add(user)
                stack.append(user)
    return False


def _schema(node: torch.fx.Node) -> Any:
    return node.target._schema if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) else None


def kept_count(mask: torch.Tensor) -> torch.Tensor:
    """The entries a concrete mask keeps, as `fxflops.rules.kept_pairs.mask_kept_pairs` reads them (True
    of a boolean mask; above the dtype's lowest value of an additive float one; nonzero of an integer
    one), as a 0-d int64 tensor on the mask's device: summed there, not read."""
    if mask.dtype == torch.bool:
        kept = mask
    elif mask.is_floating_point():
        kept = mask > torch.finfo(mask.dtype).min
    else:
        kept = mask != 0
    return kept.sum(dtype=torch.int64)


def broadcast_repeat(shape: tuple[int, ...], grid: tuple[int, ...]) -> int:
    """How many times a mask of `shape` repeats over the attention grid (B, H, Lq, Lk) it broadcasts to."""
    expanded = (1,) * (len(grid) - len(shape)) + tuple(shape)
    if len(expanded) != len(grid) or any(e not in (1, g) for e, g in zip(expanded, grid)):
        raise ValueError(f"a mask of shape {tuple(shape)} does not broadcast to the attention grid {grid}")
    return math.prod(g for e, g in zip(expanded, grid) if e == 1)


def _values(arg: Any) -> Any:
    if isinstance(arg, torch.fx.Node):
        return arg.meta.get("val")
    if isinstance(arg, list | tuple):
        return type(arg)(_values(item) for item in arg)
    return arg


def _plain(value: Any) -> Any:
    return int(value) if isinstance(value, torch.SymInt) else value


def _nonzero(expr: Any) -> bool:
    if isinstance(expr, int):
        return expr != 0
    import sympy

    return sympy.simplify(expr) != 0
