"""Tensors sharded across ranks (torch.distributed's DTensor): a rank runs their local shards.

A capture on one rank counts what that rank executes. DTensor's own dispatch turns each op on
DTensors into the op on their local tensors (plus the collectives a redistribution needs); the
recorder lets it (`sharded_types`), and so sees the local ops. A DTensor parameter's twin is a
DTensor around a fake twin of its local shard, with the same mesh and placements.

torch.distributed.tensor is never imported here: a DTensor exists only once its module is loaded.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

_DTENSOR_MODULE = "torch.distributed.tensor"


def _dtensor_class() -> type | None:
    module = sys.modules.get(_DTENSOR_MODULE)
    return getattr(module, "DTensor", None) if module is not None else None


def is_dtensor(value: Any) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(value, cls)


def sharded_types(types: Any) -> bool:
    """Whether an op's argument types include DTensor (its own dispatch runs the local ops)."""
    cls = _dtensor_class()
    if cls is None:
        return False
    for kind in types:
        if kind is cls or issubclass(kind, cls):
            return True
    return False


def local_numel(tensor: torch.Tensor) -> int:
    """Elements this rank holds: a DTensor's local shard, any other tensor whole."""
    return tensor._local_tensor.numel() if is_dtensor(tensor) else tensor.numel()


def sharded_values(args: tuple, kwargs: dict) -> bool:
    """Whether a call's arguments hold a DTensor, directly or in a list (a function-level call sees no
    DTensor type: DTensor turns __torch_function__ off). Every composite call asks: kept cheap."""
    cls = _dtensor_class()
    if cls is None:
        return False
    for value in (*args, *kwargs.values()):
        if isinstance(value, cls) or (type(value) in (list, tuple) and any(isinstance(v, cls) for v in value)):
            return True
    return False


def dtensor_twin(tensor: torch.Tensor, twin: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A DTensor like `tensor` (mesh, placements, global shape) whose local shard is `twin(local)`."""
    cls = _dtensor_class()
    local = twin(tensor._local_tensor.detach())
    out = cls(local, tensor._spec, requires_grad=tensor.requires_grad)
    if isinstance(tensor, torch.nn.Parameter):
        out._is_param = True
    return out


def propagating_shardings() -> bool:
    """Whether DTensor's sharding propagation is running: it runs each op once more on fake tensors of
    the GLOBAL shapes to learn the output's shape (ShardingPropagator._propagate_tensor_meta_non_cached),
    ops no rank executes. Found on the Python stack (read, never patched)."""
    code = _propagation_code()
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _propagation_code() -> Any:
    propagator = getattr(sys.modules.get("torch.distributed.tensor._sharding_prop"), "ShardingPropagator", None)
    method = getattr(propagator, "_propagate_tensor_meta_non_cached", None)
    return getattr(method, "__code__", None)


def forget_sharding_decisions() -> None:
    """Empty DTensor's caches of sharding decisions, where DTensor is loaded, before a capture.

    torch caches each op's output sharding (a DTensorSpec, holding a DeviceMesh) keyed by its inputs'
    specs, and DeviceMesh objects compare equal when their layout and dimension names do, whatever
    process group and rank they were built for. After one fake world is destroyed and another built with
    the same mesh layout (a what-if plan's next rank role, or the user's fake group of another rank), a
    cached decision hands back the earlier world's mesh: the collectives it issues name that world's
    groups (a group this rank never joined: its size and description unknown) and read its rank's
    coordinates. torch's debug module names this call the way to clear those caches; clearing only costs
    the next ops one propagation each (the cache refills as before), so nothing needs restoring. The
    redistribution planner's own cache (torch.distributed.tensor._redistribute._gen_transform_infos, keyed
    by specs alike) has no such API and is left as it is: it keeps mesh dimensions and placements, and local
    shapes only for uneven shards over two or more mesh dimensions."""
    cls = _dtensor_class()
    if cls is None:
        return
    # what torch.distributed.tensor.debug._clear_sharding_prop_cache() does, called where it is done: that
    # module's import (torch's tools, estimators, FlopCounterMode) costs ~80 ms a first estimate would pay
    python_cache = getattr(getattr(getattr(cls, "_op_dispatcher", None), "sharding_propagator", None),
                           "propagate_op_sharding", None)
    fast_path_cache = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if python_cache is not None and hasattr(python_cache, "cache_clear") and fast_path_cache is not None:
        python_cache.cache_clear()
        fast_path_cache()
        return
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # a torch before the call existed: its caches are left as they are
        return
    _clear_sharding_prop_cache()
