"""Routed rows: the meter's mixture-of-experts count from the tokens each expert really received.

A router's picks derive from the weights, so a capture does not know how many rows each expert gets:
the meter's sweep keeps those sizes free (`sweep(value_sizes=True)`: `nonzero` over the picks makes a
free symbol per expert, and every cost of that expert is an expression in it). `routed_modules` names,
for each free size, the module whose input has that many rows (the expert's first layer, called once a
forward). `RowObserver` reads those modules' real inputs while the loop's forwards run (forward
pre-hooks, held only inside `FlopsMeter.observe()` and removed on leaving it, also on an exception), so
each micro-batch is counted at the rows its experts received: under expert parallelism, the rows this
rank's experts got from the all-to-all, the rank's local work.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
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


def routed_modules(piece: Any) -> dict[str, str]:
    """Free size name -> the module whose input rows (elements / last dim) the size is, for a sweep piece
    whose costs depend on sizes made from tensor values; a ValueError, in one line, where none is."""
    # only those a FLOP count depends on (a size read only by a shape or a byte count changes no total)
    needed = {symbol.name for cost in piece.costs if isinstance(cost.flops, sympy.Basic)
              for symbol in cost.flops.free_symbols} & set(piece.free)
    if not needed:
        return {}
    calls = piece.captured.module_calls
    first: dict[str, Any] = {}  # module -> the first forward op run inside it (its own or a submodule's)
    for cost in piece.costs:  # graph order
        if cost.is_backward or not cost.module:
            continue
        parts = cost.module.split(".")
        for depth in range(1, len(parts) + 1):
            first.setdefault(".".join(parts[:depth]), cost)
    found: dict[str, str] = {}
    for path, cost in sorted(first.items(), key=lambda item: item[0].count(".")):  # outermost first
        if calls.get(path, 0) != 1 or not cost.input_shapes or not cost.input_shapes[0]:
            continue
        shape = cost.input_shapes[0]  # the module's input, as its first op reads it
        rows = sympy.sympify(math.prod(shape[:-1]) if len(shape) > 1 else shape[0])
        if isinstance(rows, sympy.Symbol) and rows.name in needed:
            found.setdefault(rows.name, path)
    missing = sorted(needed - set(found))
    if missing:
        where = sorted({cost.module or "(root)" for cost in piece.costs if isinstance(cost.flops, sympy.Basic)
                        and {symbol.name for symbol in cost.flops.free_symbols} & set(missing)})
        raise ValueError(f"the costs of {', '.join(map(repr, where[:3]))}{' and more' if len(where) > 3 else ''} "
                         f"depend on sizes made from tensor values ({', '.join(missing)}: a router's picks, a mask) "
                         "that reach no module as its input's rows, as an expert called with the tokens routed to "
                         "it does: the meter cannot read them from the batch; count it with estimate(routing=...)")
    return found  # one module per size: a module's input rows are one symbol at most


class RowObserver:
    """Rows each watched module received, per real forward of the model not yet counted (first in, first
    out: micro-batches are counted in the order their forwards ran, also all at a step's end)."""

    def __init__(self) -> None:
        self.forwards: deque[dict[str, int]] = deque()  # per forward: module -> rows (absent: not called, 0)
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

    def take(self, paths: Iterable[str]) -> dict[str, int]:
        """The rows each of `paths` received in the oldest forward not yet counted (0 where not called); a
        NotObserved where none was read."""
        paths = list(paths)
        if not set(paths) <= self.watched:
            self.forwards.clear()  # the forwards seen were read without these experts: none lines up
            raise NotObserved(FOUND_LATE if self.open else NOT_OBSERVED)
        if not self.forwards:
            raise NotObserved(NOT_OBSERVED)
        rows = self.forwards.popleft()
        return {path: rows.get(path, 0) for path in paths}

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
                last[path] = last.get(path, 0) + int(rows)
        return hook


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread now."""
    return torch._C._current_graph_task_id() != -1


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


def _real(args: Any) -> bool:
    return not any(isinstance(t, FakeTensor) or t.device.type == "meta" for t in tensors_in(args))
