"""Lookups a real forward could not do: an embedding indexed past its rows by positions from arange.

Fake tensors carry no values, so `nn.Embedding(1024, d)` looked up at positions 0..4095 captures
without complaint, where the same forward on real weights fails with an index error (a GPT-2 asked
for a sequence longer than its 1024 positions). Positions are the one index whose values are known
without data: they come from `arange`, through ops that keep or shift values. Those are followed;
anything else (data, slicing, gathers) is left alone, so a caution is never a guess.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten

# ops whose output holds exactly the values of their first input (same set, maybe reshaped or repeated)
_SAME_VALUES = {
    aten.detach.default, aten.alias.default, aten.clone.default, aten.contiguous.default,
    aten.lift_fresh_copy.default, aten._to_copy.default, aten.view.default, aten._unsafe_view.default,
    aten.reshape.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
    aten.expand.default, aten.permute.default, aten.transpose.int, aten.t.default, aten.flatten.using_ints,
    aten.repeat.default,
}


def out_of_range_lookups(graph_module: torch.fx.GraphModule) -> list[str]:
    """One sentence per embedding lookup whose arange positions run past the table's rows."""
    cautions = []
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or node.target is not aten.embedding.default or len(node.args) < 2:
            continue
        rows = _rows(node.args[0])
        span = _value_range(node.args[1])
        if rows is None or span is None or span[1] < rows:
            continue
        path, type_name = node.meta.get("fxflops_module", ("", ""))
        cautions.append(
            f"module '{path}' ({type_name} of {rows} rows) is looked up at positions up to {span[1]}: the "
            f"inputs are longer than the model's {rows} positions, so on real weights this forward fails "
            "with an index error; the count is for a sequence the model cannot take"
        )
    return cautions


def _rows(weight: Any) -> int | None:
    value = weight.meta.get("val") if isinstance(weight, torch.fx.Node) else None
    if isinstance(value, torch.Tensor) and value.dim() == 2 and isinstance(value.shape[0], int):
        return value.shape[0]
    return None


def _value_range(index: Any, depth: int = 0) -> tuple[int, int] | None:
    """(min, max) of an index tensor's values when they come from arange, else None."""
    if not isinstance(index, torch.fx.Node) or index.op != "call_function" or depth > 32:
        return None
    target, args = index.target, index.args
    if target in _SAME_VALUES and args:
        return _value_range(args[0], depth + 1)
    if target in (aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar) and len(args) == 2:
        return _shifted(_value_range(args[0], depth + 1), args[1], target, index.kwargs.get("alpha", 1))
    if target in (aten.arange.default, aten.arange.start, aten.arange.start_step):
        return _arange_range(args)
    return None


def _shifted(span: tuple[int, int] | None, other: Any, target: Any, alpha: Any) -> tuple[int, int] | None:
    if span is None or not isinstance(other, int) or isinstance(other, bool) or not isinstance(alpha, int):
        return None
    shift = other * alpha * (-1 if target in (aten.sub.Tensor, aten.sub.Scalar) else 1)
    return span[0] + shift, span[1] + shift


def _arange_range(args: tuple) -> tuple[int, int] | None:
    start, end, step = (0, args[0], 1) if len(args) == 1 else (args[0], args[1], args[2] if len(args) > 2 else 1)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end, step)) or step <= 0:
        return None
    count = -(-(end - start) // step)
    if count <= 0:
        return None
    return start, start + (count - 1) * step
