"""Lookups a real forward could not do: an embedding indexed past its rows by positions from arange.

Fake tensors carry no values, so `nn.Embedding(1024, d)` looked up at positions 0..4095 captures
without complaint, where the same forward on real weights fails with an index error (a GPT-2 asked
for a sequence longer than its 1024 positions). Positions are the one index whose values are known
without data: they come from `arange`, through ops that keep or shift values. Those are followed
into embedding lookups and `weight[positions]`; anything else (data, slicing, cumsum) is left alone,
so a caution is never a guess.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

aten = torch.ops.aten

# ops whose output holds exactly the values of their first input (same set, maybe reshaped or repeated)
_SAME_VALUES = {
    aten.detach.default, aten.alias.default, aten.clone.default, aten.contiguous.default,
    aten.lift_fresh_copy.default, aten._to_copy.default, aten.view.default, aten._unsafe_view.default,
    aten.reshape.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
    aten.expand.default, aten.permute.default, aten.transpose.int, aten.t.default, aten.flatten.using_ints,
    aten.repeat.default, torch.unsqueeze, torch.reshape, torch.flatten, torch.squeeze,
}
# the same, as tensor methods in a symbolically traced graph
_LOOKUPS = (aten.embedding.default, F.embedding, aten.index.Tensor)  # the functions _lookup reads
_SAME_VALUES_METHODS = {"detach", "clone", "contiguous", "view", "reshape", "unsqueeze", "squeeze", "expand",
                        "expand_as", "flatten", "repeat", "long", "int", "to", "type_as", "permute", "transpose"}
_ARANGE = {aten.arange.default, aten.arange.start, aten.arange.start_step, torch.arange}
_SHIFTS = {aten.add.Tensor: 1, aten.add.Scalar: 1, aten.sub.Tensor: -1, aten.sub.Scalar: -1,
           operator.add: 1, operator.sub: -1}


@dataclass(frozen=True)
class PositionLookup:
    """A lookup of `rows` rows at arange positions low..high (ints, or SymInts under symbolic sizes)."""

    where: str  # "module 'wpe' (Embedding)"
    rows: int
    low: Any
    high: Any
    wraps: bool  # weight[positions]: negative positions count from the end

    @property
    def least(self) -> int:
        """The lowest position the table takes."""
        return -self.rows if self.wraps else 0

    def caution(self, low: Any, high: Any, region: str = "") -> str:
        """The sentence for positions low..high (numbers, or expressions with `region` saying where)."""
        where = f", where {region}" if region else ""
        return (f"{self.where} looks up rows {low}..{high} of a table of {self.rows} rows (positions from "
                f"arange){where}: the inputs are longer than the model's positions, so on real weights this "
                "forward fails with an index error; the count is for a sequence the model cannot take")


def out_of_range_lookups(graph_module: torch.fx.GraphModule) -> list[str]:
    """One sentence per table lookup whose arange positions fall outside the table's rows."""
    return [found.caution(found.low, found.high) for found in position_lookups(graph_module)
            if _is_int(found.low) and _is_int(found.high)
            and not (found.least <= found.low and found.high < found.rows)]


def position_lookups(graph_module: torch.fx.GraphModule) -> list[PositionLookup]:
    """Every table lookup at positions from arange, with the positions' range (symbolic under a sweep's
    symbolic sizes: a sweep checks it at each of its points)."""
    found = []
    for node in graph_module.graph.nodes:
        lookup = _lookup(graph_module, node)
        if lookup is None:
            continue
        rows, index, wraps = lookup
        span = _value_range(index)
        if rows is None or span is None:
            continue
        path, type_name = node.meta.get("fxflops_module", ("", ""))
        where = f"module '{path}' ({type_name})" if path else f"the model ({type_name})"
        found.append(PositionLookup(where, rows, span[0], span[1], wraps))
    return found


def _lookup(graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[int | None, Any, bool] | None:
    """(table rows, index node, whether negative indices wrap) of an embedding lookup or a
    weight[positions] gather, else None."""
    if node.op == "call_function" and node.target not in _LOOKUPS:  # (most nodes: one test)
        return None
    args = node.args
    if node.op == "call_function" and node.target is aten.embedding.default and len(args) >= 2:
        return _rows(args[0]), args[1], False
    if node.op == "call_function" and node.target is F.embedding and len(args) >= 2:
        return _rows(args[1]), args[0], False
    if node.op == "call_function" and node.target is aten.index.Tensor and len(args) == 2 \
            and isinstance(args[1], list | tuple) and args[1] and isinstance(args[1][0], torch.fx.Node):
        return _rows(args[0], dims=None), args[1][0], True
    if node.op == "call_module" and args:
        module = graph_module.get_submodule(node.target)
        if isinstance(module, torch.nn.Embedding):
            return module.num_embeddings, args[0], False
    return None


def _rows(weight: Any, dims: int | None = 2) -> int | None:
    value = weight.meta.get("val") if isinstance(weight, torch.fx.Node) else None
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and (dims is None or value.dim() == dims) \
            and isinstance(value.shape[0], int):
        return value.shape[0]
    return None


def _value_range(index: Any, depth: int = 0) -> tuple[int, int] | None:
    """(min, max) of an index tensor's values when they come from arange, else None."""
    if not isinstance(index, torch.fx.Node) or depth > 32 or not index.args:
        return None
    target, args = index.target, index.args
    keeps = (index.op == "call_function" and target in _SAME_VALUES) or \
        (index.op == "call_method" and target in _SAME_VALUES_METHODS)
    if keeps:
        return _value_range(args[0], depth + 1)
    if index.op == "call_function" and target in _SHIFTS and len(args) == 2:
        sign = _SHIFTS[target] * index.kwargs.get("alpha", 1)
        return _shifted(_value_range(args[0], depth + 1), args[1], sign)
    if index.op == "call_function" and target in _ARANGE:
        return _arange_range(args)
    return None


def _shifted(span: tuple[Any, Any] | None, other: Any, sign: Any) -> tuple[Any, Any] | None:
    other = _concrete(other)
    if span is None or not _is_size(other) or not _is_int(sign):
        return None
    shift = _as_size(other) * int(sign)
    return span[0] + shift, span[1] + shift


def _arange_range(args: tuple) -> tuple[Any, Any] | None:
    args = tuple(_concrete(arg) for arg in args)
    start, end, step = (0, args[0], 1) if len(args) == 1 else (args[0], args[1], args[2] if len(args) > 2 else 1)
    if not _is_size(start) or not _is_size(end) or not _is_int(step) or step == 0:
        return None
    start, end, step = _as_size(start), _as_size(end), int(step)
    if not (_is_int(start) and _is_int(end)):
        # symbolic (a sweep): arithmetic only, no comparison, which would add a guard to the capture
        last = start + ((end - start + step - (1 if step > 0 else -1)) // step - 1) * step
        return (start, last) if step > 0 else (last, start)
    count = max(0, -(-(end - start) // step))
    if count == 0:
        return None
    last = start + (count - 1) * step
    return min(start, last), max(start, last)


def _is_size(value: Any) -> bool:
    """An integer, or a symbolic size (a sweep's SymInt)."""
    return _is_int(value) or isinstance(value, torch.SymInt)


def _as_size(value: Any) -> Any:
    return value if isinstance(value, torch.SymInt) else int(value)


def _concrete(value: Any) -> Any:
    """A size computed in the graph (x.shape[1] * 3 in a traced graph) by its recorded value."""
    if isinstance(value, torch.fx.Node):
        return value.meta.get("val", value)
    return value


def _is_int(value: Any) -> bool:
    """A plain integer, or a float holding one (arange(0., n)); never a symbolic size."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
