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


def routed_modules(piece: Any) -> dict[str, str]:
    """Free size name -> the module whose input rows (elements / last dim) the size is, for a sweep piece
    whose costs depend on sizes made from tensor values; a ValueError, in one line, where none is."""
    if not piece.free:
        return {}
    calls = piece.captured.module_calls
    found: dict[str, str] = {}
    for cost in piece.costs:  # graph order: an expert's first layer before its later ones
        if cost.is_backward or not cost.input_shapes or not cost.module or calls.get(cost.module, 0) != 1:
            continue
        shape = cost.input_shapes[0]
        if len(shape) < 1:
            continue
        rows = sympy.sympify(math.prod(shape[:-1]) if len(shape) > 1 else shape[0])
        if isinstance(rows, sympy.Symbol) and rows.name in piece.free:
            found.setdefault(rows.name, cost.module)
    missing = [name for name in piece.free if name not in found]
    if missing:
        raise ValueError(f"sizes made from tensor values ({', '.join(missing)}) reach no module as its input's rows "
                         "(an expert called once per forward with the tokens routed to it): the meter cannot read "
                         "them from the batch; count this model with estimate(routing=...)")
    if len(set(found.values())) != len(found):
        raise ValueError(f"one module receives the rows of several value-made sizes ({found}): the meter cannot "
                         "tell them apart")
    return found


class RowObserver:
    """Rows each watched module received in the real forwards since the last `take()`."""

    def __init__(self) -> None:
        self.rows: dict[str, int] = {}
        self.forwards = 0  # the model's own forwards seen: a module not called in one received no rows
        self.hook_ids: frozenset[int] = frozenset()  # the hooks held now (not the model's state: they only read)

    def watch(self, model: torch.nn.Module, paths: Iterable[str]) -> list[Any]:
        """Forward pre-hooks on `model` and the modules at `paths`; the handles, for the caller to remove."""
        handles = [model.register_forward_pre_hook(self._forward)]
        try:
            for path in sorted(set(paths)):
                handles.append(model.get_submodule(path).register_forward_pre_hook(self._rows_of(path)))
        except BaseException:
            _remove(handles)
            raise
        self.hook_ids = frozenset(handle.id for handle in handles)
        return handles

    def unwatch(self, handles: list[Any]) -> None:
        """Remove the hooks `watch` registered."""
        self.hook_ids = frozenset()
        _remove(handles)

    def take(self, paths: Iterable[str]) -> dict[str, int]:
        """The rows each of `paths` received since the last take (0 where not called), and start again; a
        NotObserved where no forward of the model ran meanwhile."""
        if not self.forwards:
            raise NotObserved(NOT_OBSERVED)
        rows = {path: self.rows.get(path, 0) for path in paths}
        self.rows, self.forwards = {}, 0
        return rows

    def _forward(self, module: torch.nn.Module, args: tuple) -> None:
        if _real(args):
            self.forwards += 1

    def _rows_of(self, path: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            tensors = tensors_in(args)
            if tensors and _real(args):  # a capture's fake run is not the loop's
                shape = tensors[0].shape  # rows as routed_modules reads them at capture
                rows = math.prod(shape[:-1]) if len(shape) > 1 else shape[0] if len(shape) else 1
                self.rows[path] = self.rows.get(path, 0) + int(rows)
        return hook


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


def _real(args: Any) -> bool:
    return not any(isinstance(t, FakeTensor) or t.device.type == "meta" for t in tensors_in(args))
