"""Data masks: the meter's effective attention counted from the real batch's mask.

A padding or document mask that arrives as an input leaves an attention op's kept pairs unknown to
the capture: its effective reading is None and it counts dense. For each such op of a sweep piece,
`DataMasks` keeps the part of the graph that derived the mask (the ops between the model's input
placeholders and the op's mask argument, sizes left symbolic) and, for every batch, replays it on the
batch's real tensors, on their device, then counts the mask's kept pairs there: no second forward, and
O(mask elements) work. The op's effective cost is the rule's own effective formulas, which are linear
in `kept_pairs`: read at capture as a cost at no pair plus a cost per pair, both expressions in the
sizes. Attention written as plain ops (`fxflops.eager_attention`) has its products counted as the
static reading counts them, dense x kept / every pair, over the masks its scores meet (all replayed,
and'ed). A backward kernel or product reads the masks its forward read. Counts stay 0-d tensors on
the device until read: no host synchronization per step. A derivation that reads anything but inputs and sizes (a
parameter or buffer, a random op, uninitialized memory, an in-place write) is not replayed: that op stays dense,
and says why. The derivation, its refusals and the run on real tensors are capture.input_values' (`derivation`),
which owns values computed from real inputs: the capture's own reads of input values follow the same rules.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fxflops.capture.backward import DIFFERENTIATES
from fxflops.capture.input_values import Derivation, NotReplayable, derivation
from fxflops.eager_attention import EagerAttention, attention_of, find_eager_attention
from fxflops.rules import Rule, bind_op_call
from fxflops.rules.flex import evaluated_block_pairs, is_noop, mask_mod_reads_data
from fxflops.rules.kept_pairs import KEEP, MASK_NAMES, attention_grid, kept_entries



@dataclasses.dataclass(frozen=True)
class _Replay:
    """An attention's masks, (KEEP | DROP | ADDITIVE, node) each (all of them hold), and the ops that derive
    them from the model's inputs (capture.input_values, which owns values computed from real inputs)."""

    masks: tuple[tuple[str, torch.fx.Node], ...]
    derivation: Derivation


def _mask_replay(*masks: tuple[str, torch.fx.Node]) -> _Replay:
    return _Replay(tuple(masks), derivation(*(node for _, node in masks), what="its mask"))


@dataclasses.dataclass(frozen=True)
class _FlexMask:
    """A flex_attention BlockMask whose kept blocks depend on the sizes only: evaluated at each point."""

    mask_mod: Callable[..., Any]
    sizes: tuple[Any, ...]  # the mask's B, H, Lq, Lk and its block sizes: ints or expressions in the named sizes


@dataclasses.dataclass(frozen=True)
class _Term:
    """One attention op (or product of attention written as plain ops) whose kept pairs a capture at
    symbolic sizes cannot know: flops = base + per_pair x the pairs its masks keep (a data mask's,
    replayed on each batch; a flex BlockMask's, evaluated at each point's sizes)."""

    name: str
    backward: bool
    replay: _Replay | _FlexMask
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
        self._eager: dict[str, EagerAttention] | None = None  # attention written as plain ops, found when needed
        self._flex_memo: dict[Any, Any] = {}  # (mask_mod, sizes) -> a flex BlockMask's evaluated pairs per head
        self._grids: dict[str, tuple[Any, ...]] = {}  # attention op (a rule's) -> its (B, H, Lq, Lk), as captured
        by_name = {node.name: node for node in piece.captured.graph_module.graph.nodes}
        replays: dict[Any, _Replay | NotReplayable] = {}  # forward node name (or eager masks) -> the replay
        unknown = [c for c in piece.costs if c.attention is not None and c.effective_flops is None and c.dense_flops]
        for cost in sorted(unknown, key=lambda c: c.is_backward):  # forwards first: backwards reuse their replay
            try:
                self.terms.append(self._term(cost, by_name, replays, table, conventions))
            except NotReplayable as reason:
                self.skipped.setdefault(cost.module or "the model", str(reason))
            except Exception as error:  # noqa: BLE001 - one op not followed must not cost the step's count
                self.skipped.setdefault(cost.module or "the model",
                                        f"its mask could not be followed ({type(error).__name__}: {error})")
        self.names = frozenset(term.name for term in self.terms)

    # ------------------------------------------------------------------------------------- capture

    def _term(self, cost: Any, by_name: dict[str, torch.fx.Node], replays: dict[Any, _Replay | NotReplayable],
              table: Any, conventions: str) -> _Term:
        """The op's cost as base + per_pair x kept pairs, and its masks' replay."""
        node = by_name.get(cost.name)
        if node is None:
            raise NotReplayable("its op is not in the captured graph's top level")
        values = _values(node.args), {k: _values(v) for k, v in node.kwargs.items()}
        call = dataclasses.replace(_bound(node, *values, node.meta.get("val")), within=cost.module_type)
        rule = table.match(call)
        if isinstance(rule, Rule) and rule.effective is not None:
            base, per_pair = self._linear_cost(rule, call, table, conventions)
            block_mask = call.names.get("block_mask")
            if isinstance(block_mask, tuple):  # flex_attention: its BlockMask, at each point's sizes
                replay, grid = self._flex_mask(block_mask), self._grid(call.names, call.key)
            else:
                replay, grid = self._replay_of(node, by_name, replays), self._grid(call.names, call.key)
            if node.name in replays:
                self._grids[node.name] = attention_grid(call.key, call.names)
        elif node.meta.get(DIFFERENTIATES) in self._grids:
            # a product of a backward run as plain ops (SDPA's math backward, under dropout): over the pairs
            # its forward's mask keeps, dense x kept / every pair, as the static count reads it
            forward = node.meta[DIFFERENTIATES]
            shape = self._grids[forward]
            base, per_pair = 0, self._per_pair(cost.dense_flops, math.prod(shape), call.key)
            replay, grid = replays[forward], tuple(map(self._expression, shape))
            if isinstance(replay, NotReplayable):
                raise replay
        else:  # a product of attention written as plain ops: dense x kept / every pair
            found = self._eager_attention(node, call.key)
            base, per_pair = 0, self._per_pair(cost.dense_flops, found.grid, call.key)
            replay, grid = self._eager_replay(found, replays), tuple(map(self._expression, found.shape))
        return _Term(cost.name, cost.is_backward, replay, grid, base, per_pair)

    def _flex_mask(self, block_mask: tuple) -> _FlexMask:
        """A BlockMask (as_tuple()) whose kept blocks the capture's symbolic sizes left unknown."""
        mask_mod, kv_num_blocks = block_mask[-1], block_mask[2]
        if not callable(mask_mod) or not isinstance(kv_num_blocks, torch.Tensor):
            raise NotReplayable("its BlockMask's layout is not one this torch version is known to use")
        if is_noop(mask_mod):
            raise NotReplayable("its BlockMask is given as block counts without a mask_mod")
        if mask_mod_reads_data(mask_mod):
            raise NotReplayable("its BlockMask's mask_mod reads the batch (document ids, padding): not replayed")
        sizes = (*kv_num_blocks.shape[:2], block_mask[0], block_mask[1], block_mask[-3], block_mask[-2])
        return _FlexMask(mask_mod, tuple(self._expression(size) for size in sizes))

    def _replay_of(self, node: torch.fx.Node, by_name: dict[str, torch.fx.Node],
                   replays: dict[Any, _Replay | NotReplayable]) -> _Replay:
        names = _bound(node, node.args, node.kwargs, None).names
        mask = next((names[n] for n in MASK_NAMES if isinstance(names.get(n), torch.fx.Node)), None)
        found: _Replay | NotReplayable
        try:
            if mask is None:
                raise NotReplayable("its mask is not a graph value")
            found = _mask_replay((KEEP, mask))
        except NotReplayable as reason:
            found = reason
        forward = by_name.get(node.meta.get(DIFFERENTIATES) or "")
        if isinstance(found, NotReplayable) and forward is not None and forward.name in replays:
            found = replays[forward.name]  # a backward kernel's saved mask: the one its forward read
        replays[node.name] = found
        if isinstance(found, NotReplayable):
            raise found
        return found

    def _eager_attention(self, node: torch.fx.Node, key: str) -> EagerAttention:
        if self._eager is None:
            self._eager = find_eager_attention(node.graph.nodes, {}, symbolic=self.sizes is not None)
        found = attention_of(node, self._eager, node.meta.get(DIFFERENTIATES))
        if found is None:
            raise NotReplayable(f"attention written as plain ops ({key}) is not found as one in this capture")
        return found

    def _eager_replay(self, found: EagerAttention, replays: dict[Any, _Replay | NotReplayable]) -> _Replay:
        """The replay of the masks an eager attention applies to its scores (shared by its products)."""
        if found.masks not in replays:
            try:
                if not found.masks:
                    raise NotReplayable(f"its masks are not read ({found.kept.pattern})")
                replays[found.masks] = _mask_replay(*found.masks)
            except NotReplayable as reason:
                replays[found.masks] = reason
        replay = replays[found.masks]
        if isinstance(replay, NotReplayable):
            raise replay
        return replay

    def _per_pair(self, dense: Any, grid: Any, key: str) -> Any:
        """A product's dense FLOPs per (query, key) pair: an integer, or a polynomial in the named sizes."""
        if self.sizes is None:
            dense, grid = int(dense), int(grid)
            if dense % grid:
                raise NotReplayable(f"its dense count ({key}) is not a whole cost per pair")
            return dense // grid
        import sympy

        per_pair = sympy.cancel(sympy.sympify(dense) / sympy.sympify(self._expression(grid)))
        if not (per_pair.is_polynomial() and sympy.fraction(sympy.together(per_pair))[1] == 1):
            raise NotReplayable(f"its dense count ({key}) is not a whole cost per pair")
        return per_pair

    def _linear_cost(self, rule: Rule, call: Any, table: Any, conventions: str) -> tuple[Any, Any]:
        """The rule's effective FLOPs as base + per_pair x kept_pairs (its formulas are linear in them)."""
        at = [self._expression(table.effective_cost(rule, call, conventions, pairs)[1]) for pairs in (0, 1, 2)]
        per_pair = at[1] - at[0]
        if _nonzero(at[2] - at[0] - 2 * per_pair):
            raise NotReplayable(f"its rule's effective_flops are not linear in kept_pairs ({rule.label})")
        return at[0], per_pair

    def _grid(self, names: Mapping[str, Any], op: str = "") -> tuple[Any, ...]:
        grid = attention_grid(op, names)
        if grid is None:
            raise NotReplayable("its query and key are not tensors")
        return tuple(self._expression(size) for size in grid)

    def _expression(self, value: Any) -> Any:
        return self.sizes.expression(value) if self.sizes is not None else _plain(value)

    # --------------------------------------------------------------------------------------- a batch

    def flops(self, tensors: list[torch.Tensor], point: Mapping[str, int]) -> tuple[Any, Any]:
        """(forward, backward) effective FLOPs of these ops on the batch `tensors` at the sizes `point`:
        ints, or 0-d int64 tensors on the mask's device (not yet read)."""
        counted: dict[Any, tuple[torch.Tensor, tuple[int, ...]]] = {}
        totals: list[Any] = [0, 0]
        for term in self.terms:
            grid = tuple(self._at(size, point) for size in term.grid)
            if isinstance(term.replay, _FlexMask):
                pairs = self._flex_pairs(term.replay, grid, point)
                totals[term.backward] = totals[term.backward] + self._at(term.base, point) + pairs * self._at(
                    term.per_pair, point)
                continue
            if term.replay.masks not in counted:
                mask = self._replayed(term.replay, tensors, point)
                counted[term.replay.masks] = (mask.sum(dtype=torch.int64), tuple(mask.shape))
            kept, shape = counted[term.replay.masks]
            pairs = kept * broadcast_repeat(shape, grid)
            totals[term.backward] = totals[term.backward] + self._at(term.base, point) + pairs * self._at(term.per_pair, point)
        return totals[0], totals[1]

    def _flex_pairs(self, mask: _FlexMask, grid: tuple[int, ...], point: Mapping[str, int]) -> int:
        """The pairs a flex BlockMask keeps at the point's sizes, as the static count evaluates them (once
        per mask_mod and sizes); where it cannot be (too large), NotReplayable: the batch counts dense."""
        sizes = tuple(self._at(size, point) for size in mask.sizes)
        found = evaluated_block_pairs(mask.mask_mod, sizes, grid, self._flex_memo)
        if found.pairs is None:
            raise NotReplayable(f"its BlockMask at these sizes: {found.pattern}")
        return found.pairs

    def _replayed(self, replay: _Replay, tensors: list[torch.Tensor], point: Mapping[str, int]) -> torch.Tensor:
        """The pairs the replay's masks keep together (True kept), broadcast among themselves only."""
        inputs = replay.derivation.inputs
        device = tensors[inputs[0][1]].device if inputs else (tensors[0].device if tensors else None)

        def value(arg: Any) -> Any:
            if isinstance(arg, torch.SymInt | torch.SymFloat | torch.SymBool):
                return self._at(self._expression(arg), point, type(arg))
            if isinstance(arg, torch.device) and device is not None:
                return device  # the capture's device: the batch's is where the mask is rebuilt
            return arg

        masks = replay.derivation.run(tensors, value, self._callables)
        kept = None
        for (how, _), mask in zip(replay.masks, masks):
            entries = kept_entries(how, mask)
            kept = entries if kept is None else kept & entries
        return kept

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


def kept_count(mask: torch.Tensor) -> torch.Tensor:
    """The entries a concrete mask keeps, as `fxflops.rules.kept_pairs.mask_kept_pairs` reads them (True
    of a boolean mask; above the dtype's lowest value of an additive float one; nonzero of an integer
    one), as a 0-d int64 tensor on the mask's device: summed there, not read."""
    return kept_entries(KEEP, mask).sum(dtype=torch.int64)


def broadcast_repeat(shape: tuple[int, ...], grid: tuple[int, ...]) -> int:
    """How many times a mask of `shape` repeats over the attention grid (B, H, Lq, Lk) it broadcasts to."""
    expanded = (1,) * (len(grid) - len(shape)) + tuple(shape)
    if len(expanded) != len(grid) or any(e not in (1, g) for e, g in zip(expanded, grid)):
        raise ValueError(f"a mask of shape {tuple(shape)} does not broadcast to the attention grid {grid}")
    return math.prod(g for e, g in zip(expanded, grid) if e == 1)


def _bound(node: torch.fx.Node, args: Any, kwargs: Any, out: Any) -> Any:
    """The node's op call, bound as the count stage binds it (an aten overload by its schema; a
    higher-order operator such as flex_attention by its Python signature)."""
    kind = "aten" if isinstance(node.target, torch._ops.OpOverload) else "function"
    return bind_op_call(node.target, kind, args, kwargs, out)


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
