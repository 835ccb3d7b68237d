"""What must be equal for a repeated block to run the program its first call ran: the call's arguments
(tensor metadata, plain values), and the block's state (every module's tensors and attributes).

Keys are plain hashable values, computed with torch functions off: a tensor's metadata read under the
recorder's function mode would cost five times more.
"""

from __future__ import annotations

import enum
import functools
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._mode_utils import no_dispatch

from fxflops.capture.attribution import NAME_TAG
from fxflops.capture.block_hooks import LOCAL, hooks_key, local_of, sharded_key
from fxflops.capture.reach import slot_names

# a module's own bookkeeping (parameter/buffer/submodule tables, hook tables): read as structure below
MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__) | {NAME_TAG, "_compiled_call_impl"}
_PLAIN = frozenset({type(None), type(NotImplemented), type(Ellipsis), bool, int, str, bytes, torch.dtype, torch.device, torch.layout,
                    torch.memory_format})
_DEEP_LIMIT = 20_000  # values keyed per block (every layer's config, nested); more: the rest cannot be keyed
_MISSING = object()
_VALUES_LIMIT = 64  # a real tensor's values keyed up to this many
_BY_IDENTITY = (type, types.ModuleType, types.BuiltinFunctionType, types.CodeType, types.MethodWrapperType,
                types.WrapperDescriptorType, types.MethodDescriptorType, types.GetSetDescriptorType,
                torch._ops.OpOverload, torch._ops.OpOverloadPacket)


_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement (not a builtin or C type)
_NOT_HANDED = (torch.nn.Module, type, types.FunctionType, types.MethodType, functools.partial, enum.Enum)


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
    elif not tensor.is_meta:  # a real tensor: its values can be read
        if tensor.numel() > _VALUES_LIMIT:
            raise Unsupported("a real tensor")
        with no_dispatch():
            values = tuple(tensor.detach().flatten().tolist())
        return (kind, tuple(tensor.shape), tensor.dtype, tensor.device, tensor.requires_grad, values)
    if tensor._has_symbolic_sizes_strides:
        layout = (tuple(map(size_key, tensor.shape)), tuple(map(size_key, tensor.stride())),
                  size_key(tensor.storage_offset()))
    else:
        layout = (tuple(tensor.shape), tensor.stride(), tensor.storage_offset())
    # (an inference tensor: autograd refuses to save it, and an in-place op on it outside inference mode fails)
    return (kind, layout, tensor.dtype, tensor.device, tensor.requires_grad, tensor.is_conj(), tensor.is_neg(),
            tensor.is_inference())


class CallKey:
    """A call's arguments as a key, and its tensors in order (the n-th tensor is what input n names)."""

    __slots__ = ("key", "tensors", "handed", "_positions", "_locals")

    def __init__(self, args: tuple, kwargs: dict) -> None:
        self.tensors: list[torch.Tensor] = []
        # id -> an object of a class of Python's handed to the block (a cache), keyed by identity: the block may
        # change it; what it does with it is proven at the reference (capture.block_calls)
        self.handed: dict[int, Any] = {}
        self._positions: dict[int, int] = {}
        self._locals: dict[int, int] = {}  # id(a DTensor argument's local tensor) -> the DTensor's position
        self.key = (self._value(args), self._value(kwargs), torch_state())

    def position(self, tensor: torch.Tensor) -> int | None:
        return self._positions.get(id(tensor))

    def local_position(self, tensor: torch.Tensor) -> int | None:
        """The position of the DTensor argument whose local tensor `tensor` is (what the rank's ops read)."""
        return self._locals.get(id(tensor))

    def _value(self, value: Any) -> Any:
        plain = plain_key(value)
        if plain is not None:
            return plain
        kind = type(value)
        if isinstance(value, torch.Tensor):
            seen = self._positions.get(id(value))
            if seen is not None:  # the same tensor again: an alias the block may rely on
                return ("again", seen)
            position = len(self.tensors)
            # a DTensor's local tensor that is also another argument (or another DTensor's local) is an alias
            # too: keyed by the earlier argument's position, so a call without it does not stand for this one
            local_seen = self._locals.get(id(value))  # a plain tensor some DTensor before it holds
            self._positions[id(value)] = position
            self.tensors.append(value)
            sharded = sharded_key(value, tensor_key, size_key)
            if sharded is not None:  # a DTensor (a sequence-parallel stream): its local tensor is wired by it
                local = id(local_of(value))
                local_seen = self._locals.get(local, self._positions.get(local))
                self._locals.setdefault(local, position)
                key = sharded
            else:
                key = tensor_key(value)
            return key if local_seen is None else ("local alias", local_seen, key)
        if kind is tuple or kind is list:
            return (kind, tuple(self._value(item) for item in value))
        if kind is dict:
            if any(type(key) is not str for key in value):
                raise Unsupported("a dict argument with keys other than strings")
            return (dict, tuple((key, self._value(item)) for key, item in value.items()))
        if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
            return ("sym", value.node.expr)
        if handable(value):
            self.handed[id(value)] = value
            return ("handed", id(value))
        # a model output, an object of a builtin or compiled class: the block may change it or read it as it changes
        raise Unsupported(f"an argument of type {kind.__name__}")


def plain_key(value: Any) -> tuple | None:
    """A plain value's key (floats by their bits: -0.0 is not 0.0), None for any other value."""
    kind = type(value)
    if kind in _PLAIN:
        return (kind, value)
    if kind is float:
        return (float, value.hex())
    return None


def handable(value: Any) -> bool:
    """Whether a value is an object of classes written in Python over `object` alone (a cache), whose every
    method call the trace sees (capture.block_calls): not a module, a class, a function, a container."""
    kind = type(value)
    return type(getattr(value, "__dict__", None)) is dict and all(
        cls is object or cls.__flags__ & _HEAP_TYPE and cls not in _NOT_HANDED for cls in kind.__mro__) \
        and not isinstance(value, _NOT_HANDED)


class BlockState:
    """A block's modules (relative path, module), the key of each one's state, and its tensors by place.

    `entries` maps each module's relative path to (structure, attributes): its class, training flag,
    name, submodules, parameters and buffers by metadata; then each attribute's key (`Keyer`: as deep
    as it goes). Two calls whose entries are equal run on equal state; an attribute may differ where
    the block's code never reads it (`Template.free`).
    """

    __slots__ = ("modules", "entries", "tensors", "keyer")

    def __init__(self, block: torch.nn.Module, name_of: Callable[[torch.nn.Module], str | None], path: str,
                 slots: dict[type, tuple[str, ...]] | None = None) -> None:
        self.modules: list[tuple[str, torch.nn.Module]] = []
        self.entries: dict[str, tuple] = {}
        self.tensors: dict[int, tuple[str, ...]] = {}  # id(tensor) -> (relative path, table, name[, LOCAL])
        seen: dict[int, str] = {}
        aliases: list[tuple[str, str]] = []
        stack = [("", block)]
        while stack:
            relative, module = stack.pop()
            if id(module) in seen:  # registered twice inside the block: the same module both times
                aliases.append((relative, seen[id(module)]))
                continue
            seen[id(module)] = relative
            self.modules.append((relative, module))
            children = module._modules
            if children:
                stack.extend(reversed([(f"{relative}.{key}" if relative else key, child)
                                       for key, child in children.items() if child is not None]))
        self.keyer = Keyer(seen, slots)
        for relative, module in self.modules:
            self.entries[relative] = self._read(relative, module, moved_name(name_of(module), path))
        for relative, original in aliases:
            self.entries[relative] = (("alias", original), ())

    def _read(self, relative: str, module: torch.nn.Module, name: Any) -> tuple:
        state = module.__dict__
        hooks: tuple | str = ()
        if state["_forward_hooks"] or state["_forward_pre_hooks"] or state["_backward_hooks"] \
                or state["_backward_pre_hooks"]:  # a hook runs code of its own around each call: only
            hooks = hooks_key(module, self.keyer.key)  # tensor parallelism's, keyed by what they run
            if isinstance(hooks, str):
                raise Unsupported(hooks)
        tensors = self.tensors
        held = []
        for table in ("_parameters", "_buffers"):
            for key, tensor in state[table].items():
                if tensor is None:
                    held.append((table, key, None))
                    continue
                tensors.setdefault(id(tensor), (relative, table, key))
                sharded = sharded_key(tensor, tensor_key, size_key)
                if sharded is not None:  # a DTensor: the rank's ops read its local tensor
                    tensors.setdefault(id(local_of(tensor)), (relative, table, key, LOCAL))
                held.append((table, key, tensor_key(tensor) if sharded is None else sharded))
        attributes = []
        keyer = self.keyer
        for key, value in state.items():
            if key in MODULE_INTERNALS:
                continue
            if isinstance(value, torch.Tensor):
                tensors.setdefault(id(value), (relative, "__dict__", key))
            kind = type(value)  # (most attributes are plain: keyed here as Keyer.key keys them, without the call)
            attributes.append((key, (kind, value) if kind in _PLAIN else keyer.key(value, module, top=True)))
        structure = (type(module), module.training, name, tuple(module._modules), tuple(held), hooks)
        return structure, tuple(attributes)


def torch_state() -> tuple:
    """torch's global settings a block's code can read or its ops depend on (grad and inference mode,
    autocast per device with its dtype, determinism, the default dtype, attention kernel switches, the
    mode stacks)."""
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
            torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"), torch.is_autocast_cache_enabled(),
            torch.get_default_dtype(),  # (a default device is a function mode: the stack's length below)
            torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.is_anomaly_enabled(), torch.backends.mha.get_fastpath_enabled(),
            torch._C._get_flash_sdp_enabled(), torch._C._get_mem_efficient_sdp_enabled(),
            torch._C._get_math_sdp_enabled(), torch._C._len_torch_dispatch_stack(),
            torch._C._len_torch_function_stack())


class Unkeyable:
    """A value whose influence on a program cannot be keyed (a module outside the block, an object too
    large or opaque): equal to nothing, so what holds it matches only where the block never reads it."""

    __slots__ = ("why",)

    def __init__(self, why: str) -> None:
        self.why = why

    def __eq__(self, other: object) -> bool:
        return False

    __hash__ = object.__hash__


class Keyer:
    """Keys for values, as deep as they go: plain values by value (-0.0 is not 0.0), containers item by
    item, functions by code, defaults and closure, partials by what they hold, objects by identity and
    everything in them; a tensor held directly by a module by metadata (it is wired by place), one
    deeper by identity (it is wired as the same tensor). Every object keyed by identity is held, so no
    other object takes its id while the key lives. Modules of the block are keyed by relative path."""

    __slots__ = ("held", "_memo", "_budget", "_block", "_slots")

    def __init__(self, block: dict[int, str] | None = None, slots: dict[type, tuple[str, ...]] | None = None) -> None:
        self.held: list[Any] = []
        self._memo: dict[int, Any] = {}
        self._budget = _DEEP_LIMIT
        self._block = block if block is not None else {}
        self._slots = slots if slots is not None else {}  # type -> its instances' slot names (kept by Replays)

    @staticmethod
    def by_identity(value: Any) -> bool:
        """Whether a value's key is its identity or its immutable value: the same object, the same key."""
        return type(value) in _PLAIN or type(value) is float or isinstance(value, _BY_IDENTITY)

    def key(self, value: Any, owner: Any = None, top: bool = False) -> Any:
        kind = type(value)
        if kind in _PLAIN:
            return (kind, value)
        if kind is float:
            return (float, value.hex())
        if kind is tuple:  # immutable, and no cycle runs through a tuple alone: no memo needed
            return (tuple, self._items(value, owner))
        if kind is complex:
            return (complex, value.real.hex(), value.imag.hex())
        if isinstance(value, torch.Tensor):
            if top:
                return tensor_key(value)
            self.held.append(value)
            return ("tensor", id(value))
        self._budget -= 1
        if self._budget < 0:
            return Unkeyable("an object too large to compare")
        found = self._memo.get(id(value))
        if found is not None:
            return found
        if isinstance(value, torch.nn.Module):
            relative = self._block.get(id(value))
            return ("module", relative) if relative is not None else Unkeyable("a module outside the block")
        if kind is types.MethodType:
            return ("method", self.key(value.__func__), "own" if value.__self__ is owner else self.key(value.__self__))
        self._memo[id(value)] = ("cycle", id(value))
        self.held.append(value)
        found = self._object(kind, value, owner)
        self._memo[id(value)] = found
        return found

    def _object(self, kind: type, value: Any, owner: Any) -> Any:
        if isinstance(value, tuple | list):
            return (kind, self._items(value, owner), self._attributes(value, owner))
        if isinstance(value, dict):
            return (kind, tuple(zip(self._items(value, None), self._items(value.values(), owner))),
                    self._attributes(value, owner))
        if isinstance(value, set | frozenset):
            return (kind, tuple(sorted((self.key(item, owner) for item in value), key=repr)))
        if kind is types.FunctionType:
            cells = tuple(self._cell(cell) for cell in value.__closure__ or ())
            return ("function", id(value), id(value.__code__), self.key(value.__defaults__),
                    self.key(value.__kwdefaults__), cells, self._attributes(value, owner))
        if kind is functools.partial:
            return ("partial", self.key(value.func), self.key(value.args), self.key(value.keywords))
        if kind is weakref.ref:
            return ("weakref", self.key(value()))
        if isinstance(value, _BY_IDENTITY):  # code: what it does is what the trace reads
            return ("id", id(value))
        if isinstance(value, enum.Enum):
            return (kind, value.name)
        if isinstance(value, int | float | complex | str | bytes):  # a subclass (numpy.float64, a str enum)
            return (kind, repr(value), self._attributes(value, owner))
        state = self._attributes(value, owner)
        if state is None:
            return Unkeyable(f"a {kind.__name__}")
        return ("object", kind, id(value), state)

    def _attributes(self, value: Any, owner: Any) -> Any:
        """An object's own attributes (its __dict__ and __slots__), keyed; None when it has neither."""
        state = getattr(value, "__dict__", None)
        slots = self._slots.get(type(value))
        if slots is None:
            slots = self._slots[type(value)] = tuple(slot_names(value))
        if type(state) is not dict and not slots:
            return () if isinstance(value, tuple | list | dict | types.FunctionType) else None
        found = list(zip(state, self._items(state.values(), owner))) if state else []
        for name in slots:
            found.append((name, self.key(getattr(value, name, _MISSING), owner)))
        return tuple(found)

    def _items(self, values: Any, owner: Any) -> tuple:
        """Each value's key in turn; plain values (most items of a config) keyed here as `key` keys them."""
        key = self.key
        return tuple([(kind, value) if (kind := type(value)) in _PLAIN else key(value, owner) for value in values])

    def _cell(self, cell: types.CellType) -> Any:
        try:
            return self.key(cell.cell_contents)
        except ValueError:  # empty
            return ("empty",)




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
