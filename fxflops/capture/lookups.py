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
_SAME_VALUES_METHODS = {"detach", "clone", "contiguous", "view", "reshape", "unsqueeze", "squeeze", "expand",
                        "expand_as", "flatten", "repeat", "long", "int", "to", "type_as", "permute", "transpose"}
_ARANGE = {aten.arange.default, aten.arange.start, aten.arange.start_step, torch.arange}
_SHIFTS = {aten.add.Tensor: 1, aten.add.Scalar: 1, aten.sub.Tensor: -1, aten.sub.Scalar: -1,
           operator.add: 1, operator.sub: -1}


def out_of_range_lookups(graph_module: torch.fx.GraphModule) -> list[str]:
    """One sentence per table lookup whose arange positions fall outside the table's rows."""
    cautions = []
    for node in graph_module.graph.nodes:
        found = _lookup(graph_module, node)
        if found is None:
            continue
        rows, index, wraps = found
        span = _value_range(index)
        if rows is None or span is None or ((-rows if wraps else 0) <= span[0] and span[1] < rows):
            continue
        path, type_name = node.meta.get("fxflops_module", ("", ""))
        where = f"module '{path}' ({type_name})" if path else f"the model ({type_name})"
        cautions.append(
            f"{where} looks up rows {span[0]}..{span[1]} of a table of {rows} rows (positions from arange): "
            "the inputs are longer than the model's positions, so on real weights this forward fails with an "
            "index error; the count is for a sequence the model cannot take"
        )
    return cautions


def _lookup(graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> tuple[int | None, Any, bool] | None:
    """(table rows, index node, whether negative indices wrap) of an embedding lookup or a
    weight[positions] gather, else None."""
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


def _shifted(span: tuple[int, int] | None, other: Any, sign: Any) -> tuple[int, int] | None:
    other = _concrete(other)
    if span is None or not _is_int(other) or not _is_int(sign):
        return None
    return span[0] + sign * int(other), span[1] + sign * int(other)


def _arange_range(args: tuple) -> tuple[int, int] | None:
    args = tuple(_concrete(arg) for arg in args)
    start, end, step = (0, args[0], 1) if len(args) == 1 else (args[0], args[1], args[2] if len(args) > 2 else 1)
    if not all(_is_int(v) for v in (start, end, step)) or step == 0:
        return None
    start, end, step = int(start), int(end), int(step)
    count = max(0, -(-(end - start) // step))
    if count == 0:
        return None
    last = start + (count - 1) * step
    return min(start, last), max(start, last)


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
