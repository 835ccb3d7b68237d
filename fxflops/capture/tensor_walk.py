"""Find the tensors in any value: tuples, dicts, dataclasses, cache objects, without recursion.

Runs of plain scalars are skipped at C speed (a list of 10^8 ints takes seconds, not minutes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor reachable from a value: tuples, dicts, dataclasses, cache objects (depth-first, in order)."""
    return list(iter_tensors(value))


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors of `tensors_in`, one at a time: what wants the first one walks no further."""
    seen: dict[int, Any] = {}  # id -> object, held so that an id is not reused while walking
    stack = [value]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            yield value
        elif not isinstance(value, SCALARS) and value is not None and id(value) not in seen:
            seen[id(value)] = value
            stack.extend(reversed(_not_scalars(_items(value))))


# values that hold no tensor; a container of nothing else is skipped without a Python-level loop
SCALARS = (str, bytes, int, float, bool, torch.dtype, torch.device)
_SCALAR_TYPES = frozenset({str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device})


def _items(value: Any) -> Iterable[Any]:
    if isinstance(value, Mapping):
        return value.values()
    if isinstance(value, list | tuple | set | frozenset):
        return value
    if dataclasses.is_dataclass(value):
        return [getattr(value, f.name) for f in dataclasses.fields(value)]
    if hasattr(value, "__dict__"):
        return vars(value).values()
    return ()


def _not_scalars(items: Iterable[Any]) -> list[Any]:
    """The items, or none if all are plain scalars."""
    return [] if only_scalars(items) else list(items)


def only_scalars(items: Iterable[Any]) -> bool:
    """Whether a container holds plain scalars only, checked in C: a list of 10^8 ints takes seconds, not minutes."""
    return set(map(type, items)) <= _SCALAR_TYPES


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`value` with fn applied to each tensor in it (aten arguments nest only lists and tuples)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    kind = type(value)
    if kind is tuple or kind is list:
        return kind(map_tensors(item, fn) for item in value)
    if kind is dict:
        return {key: map_tensors(item, fn) for key, item in value.items()}
    return value
