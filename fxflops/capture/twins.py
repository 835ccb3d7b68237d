"""Swap a model's tensors for twins in place, and make meta twins of tensors and inputs.

A lazy module's uninitialized parameter gets a stand-in that puts a twin in its place when the
module materializes it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter, UninitializedTensorMixin

from fxflops.capture.reach import with_twins


Twin = Callable[[torch.Tensor], torch.Tensor]


def swap_tensors(modules: list[tuple[str, torch.nn.Module]], twin: Twin) -> None:
    """Replace every parameter, buffer and tensor attribute of the modules by its twin, in place.

    Call inside `isolated()`, which puts the originals back. A tensor reachable under several names
    (tied weights) gets one twin, so it stays shared. A lazy module's uninitialized parameter gets a
    stand-in that, when the module materializes it, puts a twin of the materialized shape in its place.
    """
    twins: dict[int, torch.Tensor] = {}

    def twin_of(tensor: torch.Tensor) -> torch.Tensor:
        found = twins.get(id(tensor))
        if found is None:
            found = twins[id(tensor)] = twin(tensor)
        return found

    for _, module in modules:
        for table in (module._parameters, module._buffers):
            for key, tensor in table.items():
                if isinstance(tensor, UninitializedTensorMixin):
                    table[key] = _lazy_stand_in(tensor, table, key, twin)
                elif tensor is not None:
                    table[key] = twin_of(tensor)
        state = module.__dict__
        for key, value in list(state.items()):
            if type(value) not in _NOT_TENSORS and isinstance(value, torch.Tensor) \
                    and not isinstance(value, UninitializedTensorMixin):
                state[key] = twin_of(value)


# the types of most of a module's attributes (flags, sizes, hook dicts): no tensor, known without
# isinstance(value, torch.Tensor), which costs 0.17 us through torch's metaclass (x 30 attributes x modules)
_NOT_TENSORS = frozenset({bool, int, float, str, type(None), dict, collections.OrderedDict, set, list, tuple})


class _LazyParameter(UninitializedParameter):
    def materialize(self, shape: Any, device: Any = None, dtype: Any = None) -> None:
        _materialize_twin(self, shape, dtype)


class _LazyBuffer(UninitializedBuffer):
    def materialize(self, shape: Any, device: Any = None, dtype: Any = None) -> None:
        _materialize_twin(self, shape, dtype)


def _lazy_stand_in(tensor: torch.Tensor, table: dict, key: str, twin: Twin) -> torch.Tensor:
    if isinstance(tensor, torch.nn.Parameter):
        stand_in: torch.Tensor = _LazyParameter(requires_grad=tensor.requires_grad, device="meta", dtype=tensor.dtype)
    else:
        stand_in = _LazyBuffer(requires_grad=tensor.requires_grad, device="meta", dtype=tensor.dtype)
    stand_in.fxflops_slot = (table, key, twin)
    return stand_in


def _materialize_twin(stand_in: torch.Tensor, shape: Any, dtype: Any) -> None:
    table, key, twin = stand_in.fxflops_slot
    with unset_fake_temporarily():  # materialized while a fake forward runs: a plain meta tensor first
        meta = torch.empty(shape, dtype=dtype or stand_in.dtype, device="meta")
        if isinstance(stand_in, torch.nn.Parameter):
            meta = torch.nn.Parameter(meta, requires_grad=stand_in.requires_grad)
    table[key] = twin(meta)


def to_meta(value: Any) -> Any:
    """The same pytree with every tensor replaced by a meta tensor of the same shape and dtype."""
    return with_twins(value, meta_twin)


def meta_twin(tensor: torch.Tensor) -> torch.Tensor:
    twin = tensor.detach().to("meta")
    return torch.nn.Parameter(twin, tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) else twin
