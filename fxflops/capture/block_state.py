"""What must be equal for a repeated block to run the program its first call ran: the call's arguments
(tensor metadata, plain values), and the block's state (every module's tensors and attributes).

Keys are plain hashable values, computed with torch functions off: a tensor's metadata read under the
recorder's function mode would cost five times more.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from fxflops.capture.attribution import NAME_TAG

# a module's own bookkeeping (parameter/buffer/submodule tables, hook tables): read as structure below
MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__) | {NAME_TAG, "forward"}
_PLAIN = frozenset({type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
                    torch.memory_format})
_SHALLOW_LIMIT = 512  # attributes of a shared object (a config) read into the key; more: the object is refused


class Unsupported(Exception):
    """A value whose influence on the block's program cannot be keyed: the call runs as it is."""


def size_key(size: Any) -> Any:
    """An int, or a symbolic size by its expression (never compared as a SymInt: that adds a guard)."""
    if type(size) is int:
        return size
    if isinstance(size, torch.SymInt):
        return ("sym", size.node.expr)  # compared as sympy compares: printing it cost more than the capture
    raise Unsupported(f"a size {size!r}")


def tensor_key(tensor: torch.Tensor) -> tuple:
    """Everything of a tensor the ops on it can see, values aside (fake tensors have none)."""
    kind = type(tensor)
    if kind is FakeTensor:
        if tensor.constant is not None:  # a fake tensor that keeps real values (a small literal)
            raise Unsupported("a tensor with values")
    elif kind not in (torch.Tensor, torch.nn.Parameter):
        raise Unsupported(f"a {kind.__name__}")
    if tensor._has_symbolic_sizes_strides:
        layout = (tuple(map(size_key, tensor.shape)), tuple(map(size_key, tensor.stride())),
                  size_key(tensor.storage_offset()))
    else:
        layout = (tuple(tensor.shape), tensor.stride(), tensor.storage_offset())
    return (kind, layout, tensor.dtype, tensor.device, tensor.requires_grad, tensor.is_conj(), tensor.is_neg())


class CallKey:
    """A call's arguments as a key, and its tensors in order (the n-th tensor is what input n names)."""

    __slots__ = ("key", "tensors", "_positions")

    def __init__(self, args: tuple, kwargs: dict) -> None:
        self.tensors: list[torch.Tensor] = []
        self._positions: dict[int, int] = {}
        self.key = (self._value(args), self._value(kwargs), torch.is_grad_enabled(),
                    torch.is_autocast_enabled(), torch.get_default_dtype())

    def position(self, tensor: torch.Tensor) -> int | None:
        return self._positions.get(id(tensor))

    def _value(self, value: Any) -> Any:
        kind = type(value)
        if kind in _PLAIN:
            return (kind, value)
        if isinstance(value, torch.Tensor):
            seen = self._positions.get(id(value))
            if seen is not None:  # the same tensor again: an alias the block may rely on
                return ("again", seen)
            self._positions[id(value)] = len(self.tensors)
            self.tensors.append(value)
            return tensor_key(value)
        if kind is tuple or kind is list:
            return (kind, tuple(self._value(item) for item in value))
        if kind is dict:
            if any(type(key) is not str for key in value):
                raise Unsupported("a dict argument with keys other than strings")
            return (dict, tuple((key, self._value(item)) for key, item in value.items()))
        if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
            return ("sym", value.node.expr)
        # a cache object, a model output, a user's object: the block may change it or read it as it changes
        raise Unsupported(f"an argument of type {kind.__name__}")


class BlockState:
    """A block's modules (relative path, module), the key of each one's state, and its tensors by place.

    `entries` maps each module's relative path to (structure, attributes): its class, training flag,
    name, submodules, parameters and buffers by metadata; then each attribute's key: plain values by
    value, shared objects (a config) by identity and what they hold. Two calls whose entries are equal
    run on equal state; an attribute may differ where the block's code never reads it (`Template.free`).
    """

    __slots__ = ("modules", "entries", "tensors", "_class_of", "_shared")

    def __init__(self, block: torch.nn.Module, name_of: Callable[[torch.nn.Module], str | None], path: str,
                 class_of: Callable[[torch.nn.Module], type] = type) -> None:
        self._class_of = class_of
        self._shared: dict[int, Any] = {}
        self.modules: list[tuple[str, torch.nn.Module]] = []
        self.entries: dict[str, tuple] = {}
        self.tensors: dict[int, tuple[str, str, str]] = {}  # id(tensor) -> (relative path, table, name)
        seen: dict[int, str] = {}
        stack = [("", block)]
        while stack:
            relative, module = stack.pop()
            if id(module) in seen:  # registered twice inside the block: the same module both times
                self.entries[relative] = (("alias", seen[id(module)]), ())
                continue
            seen[id(module)] = relative
            self.modules.append((relative, module))
            self.entries[relative] = self._read(relative, module, moved_name(name_of(module), path))
            children = module._modules
            if children:
                stack.extend(reversed([(f"{relative}.{key}" if relative else key, child)
                                       for key, child in children.items() if child is not None]))

    def _read(self, relative: str, module: torch.nn.Module, name: Any) -> tuple:
        state = module.__dict__
        if state["_forward_hooks"] or state["_forward_pre_hooks"] or state["_backward_hooks"] \
                or state["_backward_pre_hooks"]:  # a hook runs code of its own around each call
            raise Unsupported(f"a hook on {type(module).__name__}")
        tensors = self.tensors
        held = []
        for table in ("_parameters", "_buffers"):
            for key, tensor in state[table].items():
                if tensor is None:
                    held.append((table, key, None))
                    continue
                tensors.setdefault(id(tensor), (relative, table, key))
                held.append((table, key, tensor_key(tensor)))
        attributes = []
        for key, value in state.items():
            if key in MODULE_INTERNALS:
                continue
            if isinstance(value, torch.Tensor):
                tensors.setdefault(id(value), (relative, "__dict__", key))
            attributes.append((key, value_key(value, module, 0, self._shared)))
        wrapped = state.get("forward")
        if wrapped is not None:  # a forward set on the instance (ours wraps it; the original is its state)
            attributes.append(("forward", value_key(getattr(wrapped, "__wrapped__", wrapped), module)))
        structure = (self._class_of(module), module.training, name, tuple(module._modules), tuple(held))
        return structure, tuple(attributes)


def value_key(value: Any, owner: Any = None, depth: int = 0, shared: dict[int, Any] | None = None) -> Any:
    """A key for an attribute's value: plain values by value, tensors by metadata, containers item by
    item, methods by function, other objects by identity plus their own plain attributes (`shared`
    keeps each object's key once per block: every layer's modules hold the same config)."""
    kind = type(value)
    if kind in _PLAIN:
        return (kind, value)
    if isinstance(value, torch.Tensor):
        return tensor_key(value)
    if kind is tuple or kind is list or kind is frozenset or kind is set:
        items = sorted(value, key=repr) if kind in (set, frozenset) else value
        return (kind, tuple(value_key(item, owner, depth, shared) for item in items))
    if kind is dict:
        return (dict, tuple((value_key(key), value_key(item, owner, depth, shared)) for key, item in value.items()))
    if kind is types.MethodType:
        return ("method", id(value.__func__), "own" if value.__self__ is owner else id(value.__self__))
    if isinstance(value, torch.nn.Module):  # a module held outside the module table: its identity
        return ("module", id(value))
    if depth == 0 and not isinstance(value, type | types.FunctionType | types.BuiltinFunctionType):
        found = shared.get(id(value)) if shared is not None else None
        if found is not None:
            return found
        state = getattr(value, "__dict__", None)
        if type(state) is dict:  # a shared object (a config): what it holds now, one level deep
            if len(state) > _SHALLOW_LIMIT:
                raise Unsupported(f"an attribute of type {kind.__name__} holding {len(state)} values")
            found = ("object", id(value), tuple((key, value_key(item, None, 1)) for key, item in state.items()))
            if shared is not None:
                shared[id(value)] = found
            return found
    return ("object", id(value))


def moved_name(name: str | None, path: str) -> Any:
    """A module's tracked name relative to the block's path, or as it is when it lies outside the block."""
    if name is None:
        return None
    if name == path:
        return ("in", "")
    if name.startswith(path + "."):
        return ("in", name[len(path) + 1:])
    return ("out", name)


def structure_ids(modules: list[torch.nn.Module]) -> dict[int, int]:
    """id(module) -> a number shared by the modules of equal structure: class, own tensors' shapes and
    dtypes, and each submodule's name and structure (only where to look for a repeat; BlockState decides).
    `modules` in pre-order, each once."""
    numbers: dict[Any, int] = {}
    ids: dict[int, int] = {}
    for module in reversed(modules):  # children before their parents
        own = []
        for table in (module._parameters, module._buffers):
            for key, tensor in table.items():
                try:
                    own.append((key, None if tensor is None else (tuple(tensor.shape), tensor.dtype)))
                except (RuntimeError, ValueError):  # a lazy parameter: like no other
                    own.append((key, id(tensor)))
        children = tuple((key, ids.get(id(child), ("unique", id(child))))
                         for key, child in module._modules.items() if child is not None)
        ids[id(module)] = numbers.setdefault((type(module), tuple(own), children), len(numbers))
    return ids
