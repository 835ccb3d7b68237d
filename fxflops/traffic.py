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

import functools
import math
from collections.abc import Collection, Iterable
from typing import Any

import torch

from fxflops.rules.polynomial import Poly, UserNames


class TensorBytes:
    """Each tensor's bytes, worked out once per count: a node's value is written by its own node and read
    by every node that uses it. Holds the tensors it measured (their ids key it).

    Under a sweep's named sizes a tensor's bytes are a polynomial in its sizes (fxflops.rules.polynomial:
    no sympy expression per tensor, and no SymInt numel() through torch's symbolic layer); a node's sum
    of them is written as sympy once per distinct sum (`user_names`, the count's)."""

    def __init__(self, sizes: Any = None, user_names: UserNames | None = None) -> None:
        self.sizes = sizes
        self._found: dict[int, tuple[torch.Tensor, Any, Any]] = {}
        self.user_names = user_names if user_names is not None or sizes is None else UserNames(sizes)

    def __call__(self, tensor: torch.Tensor, distinct: bool = False) -> Any:
        """Its bytes written; `distinct`: read (each stored element of an expanded view once)."""
        found = self._found.get(id(tensor))
        if found is None:
            written = _bytes(tensor, self.sizes)
            read = _bytes(tensor, self.sizes, distinct=True) if _expanded(tensor) else written
            found = self._found[id(tensor)] = (tensor, written, read)
        return found[2] if distinct else found[1]


def node_bytes(target: Any, inputs: Any, out: Any, moves_data: bool, sizes: Any = None,
               gathered: tuple[torch.Tensor, Any] | None = None) -> Any:
    """Bytes read plus bytes written by one op call (an int, or under symbolic sizes an expression).

    `gathered`: a lookup's table and the number of its elements the op reads (instead of all of it)."""
    return call_bytes(target, _tensors(inputs), _tensors(out), moves_data, TensorBytes(sizes), gathered)


def call_bytes(target: Any, read: Iterable[torch.Tensor], written: Collection[torch.Tensor], moves_data: bool,
               measure: TensorBytes, gathered: tuple[torch.Tensor, Any] | None = None) -> Any:
    """node_bytes of a call whose distinct input and output tensors are found already; `measure` measures
    each tensor (once per count)."""
    if not moves_data or not written or _aliases_input(target):
        return 0
    table_bytes = 0
    if gathered is not None:
        table, elements = gathered
        read = [t for t in read if t is not table]
        table_bytes = elements * table.element_size()
    terms = [table_bytes, *(measure(t, distinct=True) for t in read), *(measure(t) for t in written)]
    if measure.sizes is not None and any(type(term) is Poly for term in terms):
        # the tensors' polynomials summed, written as sympy once (a lookup's table bytes are sympy already)
        poly = Poly.of(0)
        rest = []
        for term in terms:
            if type(term) is Poly:
                poly = poly + term
            elif type(term) is int:
                poly = poly + Poly.of(term)
            else:
                rest.append(term)
        if not rest:
            return measure.user_names(poly)
        return _total([measure.user_names.written(poly), *rest])
    return _total(terms)


def _total(terms: list[Any]) -> Any:
    """The terms' sum. Under named sizes the terms are sympy expressions: one Add of all of them, not a chain of
    partial sums, each a new expression sympy flattens and deduces assumptions of once (the first capture of a
    process pays for every new expression); the same sum (Add is canonical)."""
    if all(type(term) is int for term in terms):
        return sum(terms)
    import sympy  # symbolic sizes only: the terms are sympy's already

    if not all(type(term) is int or isinstance(term, sympy.Basic) for term in terms):
        return sum(terms)
    return sympy.Add(*terms)


def tensors_of(value: Any) -> list[torch.Tensor]:
    """The distinct tensors in a value (lists, tuples and dicts walked), in order."""
    return _tensors(value)


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
    if isinstance(target, torch._ops.OpOverload):
        return _overload_aliases_input(target)
    return _schema_aliases_input(target)


@functools.cache
def _overload_aliases_input(target: torch._ops.OpOverload) -> bool:
    # an overload's schema never changes; overloads are torch's own long-lived objects
    return _schema_aliases_input(target)


def _schema_aliases_input(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    return all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _bytes(tensor: torch.Tensor, sizes: Any, distinct: bool = False) -> Any:
    if distinct and _expanded(tensor):  # an expanded view reads each stored element once
        kept = [size for size, step in zip(tensor.shape, tensor.stride(), strict=True) if not _zero(step)]
        if sizes is None:
            return math.prod(int(size) for size in kept) * tensor.element_size()
        # under named sizes an axis not expanded must have a stride other than 0 at every point (a product
        # of sizes, which are positive), else its elements are counted as the tensor's numel (as written)
        if all(_positive(sizes.expression(step)) for step in tensor.stride() if not _zero(step)):
            return _product(kept, tensor.element_size())
    if sizes is not None:
        return _product(tensor.shape, tensor.element_size())
    return int(tensor.numel()) * tensor.element_size()


def _product(shape: Iterable[Any], factor: int) -> Poly:
    """factor x the product of sizes (ints or SymInts), as a polynomial in the ShapeEnv's symbols."""
    poly = Poly.of(factor)
    for size in shape:
        poly = poly * Poly.of(size.node.expr if type(size) is torch.SymInt else int(size))
    return poly


def _expanded(tensor: torch.Tensor) -> bool:
    """Whether `_bytes(tensor, sizes, distinct=True)` can differ from its bytes written (a 0 stride)."""
    return tensor.layout == torch.strided and any(_zero(step) for step in tensor.stride())


def _zero(step: Any) -> bool:
    """A stride of 0 (an expanded axis: a plain 0 under named sizes too)."""
    return type(step) is int and step == 0


def _positive(value: Any) -> bool:
    return value > 0 if type(value) is int else bool(getattr(value, "is_positive", False))
