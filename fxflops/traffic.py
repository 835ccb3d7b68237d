"""Bytes moved: what one op reads and writes in memory, from its fake values' shapes and dtypes.

An op reads each distinct input tensor once and writes each output once; this is the traffic of an
unfused kernel, the roofline's denominator. A broadcast input (stride 0 along an axis) is read once
per distinct element. Views and other aliasing results move nothing (the op schema says so), nor do
the zero lists marked `moves_data = false` (views, Python plumbing, metadata queries, allocation).
Results that are not tensors (sizes, scalars) mean the op read no tensor data either. A lookup
(embedding, index_select, gather: a rule's `gathers`) reads only the elements it gathers of its table,
not the whole table.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def node_bytes(target: Any, inputs: Any, out: Any, moves_data: bool, sizes: Any = None,
               gathered: tuple[torch.Tensor, Any] | None = None) -> Any:
    """Bytes read plus bytes written by one op call (an int, or under symbolic sizes an expression).

    `gathered`: a lookup's table and the number of its elements the op reads (instead of all of it)."""
    written = _tensors(out)
    if not moves_data or not written or _aliases_input(target):
        return 0
    read = _tensors(inputs)
    table_bytes = 0
    if gathered is not None:
        table, elements = gathered
        read = [t for t in read if t is not table]
        table_bytes = elements * table.element_size()
    return table_bytes + sum(_bytes(t, sizes, distinct=True) for t in read) + sum(_bytes(t, sizes) for t in written)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The distinct tensors in a value (the same tensor passed twice is read once)."""
    found: dict[int, torch.Tensor] = {}
    _collect(value, found)
    return list(found.values())


def _collect(value: Any, found: dict[int, torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        found.setdefault(id(value), value)
    elif isinstance(value, list | tuple):
        for item in value:
            _collect(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, found)


def _aliases_input(target: Any) -> bool:
    """Whether every result of an aten op is a view of an input (schema alias, not written in place)."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    return all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _bytes(tensor: torch.Tensor, sizes: Any, distinct: bool = False) -> Any:
    if sizes is not None:
        return sizes.expression(tensor.numel()) * tensor.element_size()
    elements = tensor.numel()
    if distinct and tensor.layout == torch.strided:  # an expanded view reads each stored element once
        elements = math.prod(int(n) for n, s in zip(tensor.shape, tensor.stride(), strict=True) if s != 0)
    return int(elements) * tensor.element_size()
