"""What a repeated block under a tensor-parallel plan carries beyond a plain one, keyed so that replay can
prove two calls run the same program: the module hooks torch's tensor parallelism registers
(`parallelize_module`'s styles through `distribute_module`, fxflops.parallel.megatron's `BlockInput`) and
DTensor parameters (`capture.replay`, `capture.block_state`).

A hook is code run around each call, so a block carrying one is replayed only where the hook is known to
do nothing but turn the call's inputs and outputs into (and out of) DTensors: its code, and the code of
every callable it holds, lies in torch's tensor-parallel styles or in fxflops' own Megatron styles, which
change no state outside the tensors they return (FSDP's and DDP's hooks, which move a state machine and
gather parameters, and expert and context parallelism's, which note routed tokens, are not among them:
their blocks run). Such a hook is keyed by its code and what it holds: a parallel style by its class and
attributes (its placements by value), a device mesh by identity, anything else as `Keyer` keys it. Two
blocks whose hooks have equal keys run the same hook code on the same settings. A DTensor parameter is
keyed by its local tensor, global shape and strides, placements and mesh; the ops a rank runs read its
local tensor, which a replay wires by the parameter's place (`local_of`).
"""

from __future__ import annotations

import abc
import functools
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

# the files whose hook code only converts a call's inputs and outputs (see the module's docstring)
_PURE_HOOK_CODE = (os.path.join(os.path.dirname(torch.__file__), "distributed", "tensor", "parallel", "style.py"),
                   os.path.join(os.path.dirname(torch.__file__), "distributed", "tensor", "_api.py"),
                   os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parallel", "megatron.py"))
# a module's hook tables, and the tables of flags keyed by the same handle ids
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks")
_FLAG_TABLES = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
SHARDED = "dtensor"  # a replayed block's output spec for a DTensor made in the block: (SHARDED, local's spec, spec, grad)
_PLAIN_TENSORS = (FakeTensor, torch.Tensor, torch.nn.Parameter)
LOCAL = "local"  # the last item of a DTensor parameter's local tensor's place: (relative, table, name, LOCAL)


def hooks_key(module: torch.nn.Module, key: Callable[[Any], Any]) -> tuple | str:
    """The key of the module's hooks (`key`: the block's Keyer.key, for what is neither a style, a
    placement nor a mesh), or why they cannot stand for another call's."""
    state = module.__dict__
    if state["_backward_hooks"] or state["_backward_pre_hooks"]:
        return f"a backward hook on {type(module).__name__}"
    found = []
    for table in _HOOK_TABLES:
        for handle, hook in state[table].items():
            if not _pure(hook):
                return f"a hook on {type(module).__name__}"
            flags = tuple(handle in state.get(flag, ()) for flag in _FLAG_TABLES)
            found.append((table, flags, _value_key(hook, key)))
    return tuple(found)


def sharded_key(tensor: torch.Tensor, key: Callable[[torch.Tensor], Any], size: Callable[[Any], Any]) -> tuple | None:
    """A DTensor's key (`key`: tensor_key, for its local tensor; `size`: size_key, for a global size or stride,
    symbolic ones by expression as tensor_key keys them): local tensor, global shape, strides, dtype, grad
    flag, placements and mesh; None for any other tensor."""
    if not is_sharded(tensor):
        return None
    spec = tensor._spec
    return ("dtensor", type(tensor), key(tensor._local_tensor), tuple(map(size, tensor.shape)),
            tuple(map(size, tensor.stride())),
            tensor.dtype, tensor.requires_grad, tuple(_placement(p) for p in spec.placements), ("mesh", id(spec.mesh)))


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (what a rank's ops read)."""
    return tensor._local_tensor


def is_sharded(value: Any) -> bool:
    """Whether `value` is a DTensor (never importing torch.distributed.tensor: without it, there is none)."""
    if type(value) in _PLAIN_TENSORS:
        return False
    found = sys.modules.get("torch.distributed.tensor")
    return found is not None and isinstance(value, found.DTensor)


def sharded_like(local: torch.Tensor, spec: Any, requires_grad: bool) -> torch.Tensor:
    """A DTensor around `local` with a reference output's spec (placements, mesh, global shape): no op runs."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, spec, requires_grad=requires_grad)


def _placement(placement: Any) -> tuple:
    # compared by torch's own equality (Shard(1) == Shard(1)), never hashed
    return ("placement", type(placement), placement)


def _pure(value: Any) -> bool:
    """Whether a hook, every callable it holds and the class of every parallel style it holds (whose methods
    it calls) are code from `_PURE_HOOK_CODE`."""
    if isinstance(value, functools.partial):
        return _pure(value.func) and all(_held_pure(item) for item in (*value.args, *value.keywords.values()))
    if isinstance(value, types.MethodType):
        return _pure(value.__func__) and _held_pure(value.__self__)
    if isinstance(value, types.FunctionType):
        return value.__code__.co_filename.startswith(_PURE_HOOK_CODE) \
            and all(_held_pure(_contents(cell)) for cell in value.__closure__ or ())
    return False


def _held_pure(value: Any) -> bool:
    from torch.distributed.tensor.parallel.style import ParallelStyle

    if isinstance(value, types.FunctionType | types.MethodType | functools.partial):
        return _pure(value)
    if isinstance(value, ParallelStyle):
        return all(_class_pure(cls) for cls in type(value).__mro__ if cls not in (object, abc.ABC))
    return True


def _class_pure(cls: type) -> bool:
    """Whether a class's own functions are code from `_PURE_HOOK_CODE`."""
    functions = []
    for item in vars(cls).values():
        if isinstance(item, property):  # (an attribute the hook reads may be computed)
            functions += [item.fget, item.fset, item.fdel]
        else:
            functions.append(getattr(item, "__func__", item))
    return all(item.__code__.co_filename.startswith(_PURE_HOOK_CODE) for item in functions
               if isinstance(item, types.FunctionType))


def _value_key(value: Any, key: Callable[[Any], Any]) -> Any:
    """A hook's (or what it holds') key by value: functions by code, globals, defaults and closure; a
    parallel style by class and attributes; placements by value; a device mesh by identity."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel.style import ParallelStyle
    from torch.distributed.tensor.placement_types import Placement

    if isinstance(value, types.FunctionType):
        return ("function", id(value.__code__), id(value.__globals__), _value_key(value.__defaults__, key),
                _value_key(value.__kwdefaults__, key),
                tuple(_value_key(_contents(cell), key) for cell in value.__closure__ or ()))
    if isinstance(value, types.MethodType):
        return ("method", _value_key(value.__func__, key), _value_key(value.__self__, key))
    if isinstance(value, functools.partial):
        return ("partial", _value_key(value.func, key), _value_key(value.args, key), _value_key(value.keywords, key))
    if isinstance(value, ParallelStyle):
        return ("style", type(value), tuple((name, _value_key(item, key)) for name, item in vars(value).items()))
    if isinstance(value, Placement):
        return _placement(value)
    if isinstance(value, DeviceMesh):
        return ("mesh", id(value))  # (held by the plan's modules for the whole capture)
    if type(value) in (tuple, list):
        return (type(value), tuple(_value_key(item, key) for item in value))
    if type(value) is dict:
        return (dict, tuple((name, _value_key(item, key)) for name, item in value.items()))
    return key(value)


def _contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # empty
        return None
