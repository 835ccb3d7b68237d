"""Routed rows: the meter's mixture-of-experts count from the tokens each expert really received.

A router's picks derive from the weights, so a capture does not know how many rows each expert gets:
the meter's sweep keeps those sizes free (`sweep(value_sizes=True)`: `nonzero` over the picks, or the
experts' own `.tolist()` of the tokens per expert, makes a free symbol per expert, and every cost of that
expert is an expression in it). `routed_modules` says how each free size is read from a real forward:
as a module's input rows (an expert called with the rows routed to it, called once a forward); as one
value of a module's 1-D integer input (grouped experts handed the tokens per expert, torchtitan's
`GroupedExperts(x, num_tokens_per_expert)`: the size's `.item()` is followed back through ops that keep
values to the tensor the module's forward received); as a slice's length computed from those; or, where
a module's input rows are a sum of free sizes (an all-to-all's splits) and every count depends on them
only through that sum (`_grouped_mm` over all the rows), from the rows alone. A module whose own
pre-hooks hand its forward its inputs (torchtitan's expert-parallel dispatch) is read as its forward
received them: the capture records those (`Captured.forward_inputs`) and the meter's hooks, registered
after the dispatch's, see the same. `RowObserver` reads the watched modules' real inputs while the loop's
forwards run (forward pre-hooks, held only inside `FlopsMeter.observe()` and removed on leaving it, also
on an exception), so each micro-batch is counted at the rows its experts received: under expert
parallelism, the rows this rank's experts got from the all-to-all, the rank's local work.
"""

from __future__ import annotations

import math
import operator
import sys
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensor

from fxflops.capture.tensor_walk import tensors_in


class NotObserved(Exception):
    """A micro-batch whose routed rows were not read from its forward; says why."""


NOT_OBSERVED = ("the rows routed to its experts were not read: run the forward inside meter.observe() and count "
                "the micro-batch after it")
FOUND_LATE = ("the rows routed to its experts are read from the next step on: this batch's capture found them, "
              "after its forward ran (an example_batch for the meter counts the first step too)")


@dataclass(frozen=True)
class RoutedSizes:
    """How each free size of a piece is read from a real forward: as a module's input rows, as one value
    of a module's 1-D integer input (the tokens per expert handed to grouped experts, read by the
    experts' own `.tolist()`), or computed from those (a slice whose length the others fix)."""

    rows: dict[str, str] = field(default_factory=dict)  # size -> the module whose input rows it is
    counts: dict[str, tuple[str, int, int]] = field(default_factory=dict)  # size -> (module, element, length)
    derived: tuple[tuple[str, Callable[[dict[str, int]], int]], ...] = ()  # in graph order
    # module -> (constant, sizes) where its input rows are constant + those sizes' sum, and the counts
    # depend on them only through it
    sums: dict[str, tuple[Any, tuple[str, ...]]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.rows or self.counts or self.sums)

    @property
    def paths(self) -> frozenset[str]:
        """The modules the meter watches."""
        return frozenset(self.rows.values()) | {path for path, _, _ in self.counts.values()} | set(self.sums)

    def bind(self, seen: dict[str, Seen], point: Mapping[str, int]) -> tuple[dict[str, int], dict[str, int]]:
        """(every free size's value, the routed rows to report: module -> rows, or module[expert] -> tokens)
        from what the watched modules received in one forward, at the sweep's `point` (its named sizes);
        NotObserved where a value cannot be read."""
        values = {name: seen[path].rows for name, path in self.rows.items()}
        report = {path: seen[path].rows for path in self.rows.values()}
        read: dict[str, list[int]] = {}
        for name, (path, element, length) in self.counts.items():
            if path not in read:
                candidates = [t for t in seen[path].ints if t.numel() == length]
                if len(candidates) != 1:
                    raise NotObserved(f"'{path}' was called with {len(candidates)} 1-D integer tensors of "
                                      f"{length} elements, where its capture read its tokens per expert from one")
                read[path] = [int(v) for v in candidates[0].tolist()]  # (on a GPU: one small copy to the host)
                report.update({f"{path}[{e}]": v for e, v in enumerate(read[path])})
            values[name] = read[path][element]
        for name, compute in self.derived:
            values[name] = compute({**point, **values})
        for path, (constant, names) in self.sums.items():
            values.update({name: 0 for name in names[1:]})
            values[names[0]] = seen[path].rows - int(constant)
            report[path] = seen[path].rows
        return values, report


@dataclass
class Seen:
    """What one watched module received in one real forward."""

    rows: int = 0  # its input's rows, summed over its calls
    ints: tuple[torch.Tensor, ...] = ()  # its first call's 1-D integer tensors (copies: their values)


def routed_modules(piece: Any) -> RoutedSizes:
    """How each free size a FLOP count of this sweep piece depends on (sizes made from tensor values) is
    read from a real forward; a ValueError, in one line, where one cannot be."""
    # only those a FLOP count depends on (a size read only by a shape or a byte count changes no total)
    needed = {symbol.name for cost in piece.costs if isinstance(cost.flops, sympy.Basic)
              for symbol in cost.flops.free_symbols} & set(piece.free)
    if not needed:
        return RoutedSizes()
    calls = piece.captured.module_calls
    inputs = _input_rows(piece)
    rows: dict[str, str] = {}
    for path, size in inputs.items():  # outermost first: a module's input rows are one size at most
        if isinstance(size, sympy.Symbol) and size.name in needed:
            rows.setdefault(size.name, path)
    counts, derived = _values_read(piece, needed - set(rows), calls)
    known = set(rows) | set(counts) | {name for name, _ in derived}
    sums = _sums_read(piece, inputs, needed - known)
    missing = sorted(needed - known - {name for _, (_, names) in sums.items() for name in names})
    if missing:
        where = sorted({cost.module or "(root)" for cost in piece.costs if isinstance(cost.flops, sympy.Basic)
                        and {symbol.name for symbol in cost.flops.free_symbols} & set(missing)})
        raise ValueError(f"the costs of {', '.join(map(repr, where[:3]))}{' and more' if len(where) > 3 else ''} "
                         f"depend on sizes made from tensor values ({', '.join(missing)}: a router's picks, a mask) "
                         "that reach no module as its input's rows (an expert called with the tokens routed to "
                         "it) nor as values of its 1-D integer input (grouped experts given the tokens per "
                         "expert): the meter cannot read them from the batch; count it with estimate(routing=...)")
    return RoutedSizes(rows, counts, tuple(derived), sums)


def _input_rows(piece: Any) -> dict[str, Any]:
    """Module -> its input's rows (elements / last dim) as an expression, for modules called once a
    forward: what its forward received where its own pre-hooks hand it its inputs (an expert-parallel
    dispatch), else what its first op reads."""
    calls, given = piece.captured.module_calls, piece.captured.forward_inputs
    sizes = piece.captured.sizes
    first: dict[str, Any] = {}  # module -> the first forward op run inside it (its own or a submodule's)
    for cost in piece.costs:  # graph order
        if cost.is_backward or not cost.module:
            continue
        parts = cost.module.split(".")
        for depth in range(1, len(parts) + 1):
            first.setdefault(".".join(parts[:depth]), cost)
    found: dict[str, Any] = {}
    for path, cost in sorted(first.items(), key=lambda item: item[0].count(".")):  # outermost first
        if calls.get(path, 0) != 1:
            continue
        if path in given:  # (its first op is its hooks')
            shape = tuple(sizes.expression(size) for size in given[path][0].shape) if given[path] else ()
        else:
            shape = cost.input_shapes[0] if cost.input_shapes else ()
        if shape:
            found[path] = sympy.sympify(math.prod(shape[:-1]) if len(shape) > 1 else shape[0])
    return found


def _sums_read(piece: Any, inputs: dict[str, Any], wanted: set[str]) -> dict[str, tuple[Any, tuple[str, ...]]]:
    """Module -> (its input rows' constant part, the sizes they sum) where a module's input rows are a sum of
    free sizes (tokens an all-to-all delivered from each rank) and every FLOP count depends on those sizes
    only through that sum (grouped matrix products over all the rows): any split of the rows read gives
    the same counts, so the first size takes them all."""
    found: dict[str, tuple[Any, tuple[str, ...]]] = {}
    costs = [cost.flops for cost in piece.costs if isinstance(cost.flops, sympy.Basic)]
    for path, rows in inputs.items():
        names = sorted(symbol.name for symbol in rows.free_symbols if symbol.name in wanted)
        if not names or any(name in taken for _, taken in found.values() for name in names):
            continue
        symbols = {symbol.name: symbol for symbol in rows.free_symbols}
        if {symbol.name for symbol in rows.free_symbols} != set(names) \
                or any(rows.coeff(symbols[name]) != 1 for name in names) \
                or not sympy.expand(rows - sum(symbols[name] for name in names)).is_number:
            continue  # not a plain sum of free sizes plus a constant
        head, total = symbols[names[0]], sympy.Dummy("rows")
        solved = total - (rows - head)
        if all(not ({symbol.name for symbol in sympy.expand(flops.xreplace({head: solved})).free_symbols}
                    & set(names[1:])) for flops in costs):
            found[path] = (sympy.expand(rows - sum(symbols[name] for name in names)), tuple(names))
    return found


# ops that hand a tensor's values on unchanged (the walk from a value read back to where it entered a module)
_SAME_VALUES = frozenset({"_to_copy", "to", "clone", "detach", "alias", "contiguous", "view", "reshape",
                          "_unsafe_view", "lift_fresh_copy", "lift_fresh"})


def _values_read(piece: Any, wanted: set[str], calls: dict[str, int]
                 ) -> tuple[dict[str, tuple[str, int, int]], list[tuple[str, Callable[[dict[str, int]], int]]]]:
    """Sizes read as one value of a module's 1-D integer input (`.item()`/`.tolist()` inside the module on
    a tensor it was given), and sizes a slice's length makes from others, with how to compute them."""
    if not wanted:
        return {}, []
    from torch.fx import Node

    sizes = piece.captured.sizes
    module_of = {cost.name: cost.module for cost in piece.costs}
    nodes = list(piece.captured.graph_module.graph.nodes)

    def symbol(value: Any) -> str | None:
        expr = sizes.expression(value)
        return expr.name if isinstance(expr, sympy.Symbol) else None

    counts: dict[str, tuple[str, int, int]] = {}
    for node in nodes:
        value = node.meta.get("val")
        name = symbol(value) if isinstance(value, torch.SymInt) else None
        if name not in wanted or getattr(node.target, "_opname", None) not in ("item", "_local_scalar_dense"):
            continue
        found = _entered(node.args[0], module_of.get(node.name, ""), module_of, piece.captured.forward_inputs)
        if found is not None and calls.get(found[0], 0) == 1:
            counts[name] = found

    def expression(value: Any) -> Any:
        value = value.meta.get("val") if isinstance(value, Node) else value
        return sympy.sympify(sizes.expression(value))

    derived: list[tuple[str, Callable[[dict[str, int]], int]]] = []
    known = set(counts)
    for node in nodes:  # graph order: a slice's bounds come from sizes defined before it
        value = node.meta.get("val")
        if getattr(node.target, "_opname", None) != "slice" or not isinstance(value, torch.Tensor):
            continue
        source, dim, start, end, step = (*node.args, *(None,) * (5 - len(node.args)))[:5]
        dim = int(dim or 0)
        name = symbol(value.shape[dim]) if dim < value.dim() else None
        if name is None or name in known or not isinstance(source, Node):
            continue
        parts = (expression(source.meta["val"].shape[dim]), expression(0 if start is None else start),
                 expression(sys.maxsize if end is None else end), expression(1 if step is None else step))
        if {s.name for p in parts for s in p.free_symbols} - known - set(sizes.plan.names):
            continue  # made from a size not read either
        derived.append((name, _slice_length(parts)))
        known.add(name)
    return counts, derived


def _slice_length(parts: tuple[Any, ...]) -> Callable[[dict[str, int]], int]:
    """A slice's length from its input's size and its start, end and step, as Python slices clamp them."""
    def length(values: dict[str, int]) -> int:
        size, start, end, step = (int(p.xreplace({s: values[s.name] for s in p.free_symbols})) for p in parts)
        return len(range(size)[start:end:step])
    return length


def _entered(node: Any, inside: str, module_of: dict[str, str],
             forward_inputs: dict[str, tuple[torch.Tensor, ...]]) -> tuple[str, int, int] | None:
    """(module, element, length) where `node` (a 0-d element read inside module `inside`) comes, through ops
    that keep values, from element `element` of a 1-D integer tensor of `length` values the module's
    forward was given (made outside it, or handed to it by the module's own pre-hooks: an expert-parallel
    dispatch); None where it comes from anything else."""
    from torch.fx import Node

    element = None
    given = forward_inputs.get(inside, ())
    while isinstance(node, Node):
        value = node.meta.get("val")
        where = module_of.get(node.name, "")
        if node.op == "placeholder" or not (where == inside or where.startswith(inside + ".")) \
                or element is not None and any(value is tensor for tensor in given):
            if element is None or not isinstance(value, torch.Tensor) or value.dim() != 1 \
                    or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
                return None
            length = int(value.shape[0])
            return (inside, element % length, length) if inside and -length <= element < length else None
        opname = getattr(node.target, "_opname", None)
        if element is None and node.target is operator.getitem and getattr(node.args[0], "target", None) \
                is not None and getattr(node.args[0].target, "_opname", None) == "unbind":
            element, node = int(node.args[1]), node.args[0].args[0]
            continue
        if element is None and opname == "select" and int(node.args[1]) == 0:
            element, node = int(node.args[2]), node.args[0]
            continue
        if opname in _SAME_VALUES and isinstance(node.args[0], Node):
            before = node.args[0].meta.get("val")
            if element is None and isinstance(value, torch.Tensor) and value.dim() == 0 \
                    or element is not None and isinstance(value, torch.Tensor) and isinstance(before, torch.Tensor) \
                    and value.dim() == before.dim() == 1 and value.shape == before.shape:
                node = node.args[0]
                continue
        return None
    return None


class RowObserver:
    """What each watched module received, per real forward of the model not yet counted (first in, first
    out: micro-batches are counted in the order their forwards ran, also all at a step's end)."""

    def __init__(self) -> None:
        self.forwards: deque[dict[str, Seen]] = deque()  # per forward: module -> what it got (absent: not called)
        self.watched: frozenset[str] = frozenset()
        self.open = False  # inside the meter's observe(), with hooks or (no routed modules known yet) without
        self.hook_ids: frozenset[int] = frozenset()  # the hooks held now (not the model's state: they only read)

    def watch(self, model: torch.nn.Module, paths: Iterable[str]) -> list[Any]:
        """Forward pre-hooks on `model` and the modules at `paths` (none where there are no paths); the
        handles, for `unwatch`."""
        paths = frozenset(paths)
        self.open = True
        if not paths:
            return []
        handles = [model.register_forward_pre_hook(self._forward)]
        try:
            for path in sorted(set(paths)):
                handles.append(model.get_submodule(path).register_forward_pre_hook(self._rows_of(path)))
        except BaseException:
            _remove(handles)
            raise
        self.watched, self.hook_ids = paths, frozenset(handle.id for handle in handles)
        return handles

    def unwatch(self, handles: list[Any]) -> None:
        """Remove the hooks `watch` registered; forwards not counted by then are dropped."""
        self.watched, self.hook_ids, self.open = frozenset(), frozenset(), False
        self.forwards.clear()
        _remove(handles)

    def take(self, paths: Iterable[str]) -> dict[str, Seen]:
        """What each of `paths` received in the oldest forward not yet counted (nothing where not called);
        a NotObserved where none was read."""
        paths = list(paths)
        if not set(paths) <= self.watched:
            self.forwards.clear()  # the forwards seen were read without these experts: none lines up
            raise NotObserved(FOUND_LATE if self.open else NOT_OBSERVED)
        if not self.forwards:
            raise NotObserved(NOT_OBSERVED)
        seen = self.forwards.popleft()
        return {path: seen.get(path, Seen()) for path in paths}

    def _forward(self, module: torch.nn.Module, args: tuple) -> None:
        if _real(args):
            self.forwards.append({})

    def _rows_of(self, path: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            tensors = tensors_in(args)
            # a capture's fake run is not the loop's; an expert run again in the backward (activation
            # checkpointing's recomputation) received no more tokens
            if tensors and self.forwards and _real(args) and not _in_backward():
                shape = tensors[0].shape  # rows as routed_modules reads them at capture
                rows = math.prod(shape[:-1]) if len(shape) > 1 else shape[0] if len(shape) else 1
                last = self.forwards[-1]
                seen = last.get(path)
                if seen is None:  # its first call: the tokens per expert it was handed, if any (copied: the
                    # loop may reuse the tensor), read only when the micro-batch is counted
                    seen = last[path] = Seen(0, tuple(t.detach().clone() for t in tensors if t.dim() == 1
                                                      and not (t.is_floating_point() or t.is_complex()
                                                               or t.dtype == torch.bool)))
                seen.rows += int(rows)
        return hook


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread now."""
    return torch._C._current_graph_task_id() != -1


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


def _real(args: Any) -> bool:
    return not any(isinstance(t, FakeTensor) or t.device.type == "meta" for t in tensors_in(args))
