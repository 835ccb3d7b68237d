"""Example inputs: from shapes, flattened out of any container, rebuilt with their tensors replaced.

A user's inputs are never copied: the walks here are iterative (a linked input thousands deep is fine),
skip large runs of plain scalars at C speed, and rebuild only the containers on a path to a tensor.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import types
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.nn.parameter import UninitializedTensorMixin
from torch.utils import _pytree as pytree
from torch.utils._pytree import tree_map


def inputs_from_shape(model: torch.nn.Module, input_shape: Any) -> tuple[torch.Tensor, ...]:
    """Meta tensors for DeepSpeed's `input_shape=` convenience: one shape, or a list of shapes."""
    if not isinstance(input_shape, tuple | list | torch.Size) or not input_shape:
        raise ValueError(f"input_shape must be a tuple of ints such as (1, 3, 224, 224), or a list of them "
                         f"(one per input), got {input_shape!r}")
    shapes = [input_shape] if isinstance(input_shape[0], int) else list(input_shape)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())
    for shape in shapes:
        if not isinstance(shape, tuple | list | torch.Size) or not all(
                isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in shape):
            raise ValueError(f"input_shape must be a tuple of non-negative ints (or a list of them), got {shape!r}")
    return tuple(_meta_tensor(tuple(shape), dtype) for shape in shapes)


def _meta_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    try:
        return torch.empty(shape, dtype=dtype, device="meta")
    except RuntimeError:  # "Storage size calculation overflowed": torch sizes its storage even on meta
        raise ValueError(f"input_shape {shape} is too large for a tensor, even a fake one: "
                         f"{math.prod(shape):.3g} elements of {dtype} exceed torch's 2**63 - 1 bytes") from None


def refuse_lazy_output(output: Any) -> Any:
    """The forward's output, unless it is a generator: its ops run only as it is iterated, after the
    forward returns, so there would be nothing to count (and an empty count is not an answer)."""
    if isinstance(output, types.GeneratorType | types.AsyncGeneratorType):
        raise TypeError("the forward returned a generator, whose ops run only as it is iterated: there is "
                        "nothing to count. Return a list or tuple, or wrap the model in a module whose "
                        "forward returns list(model(...))")
    return output


# node.meta key of a captured graph's placeholder that is a model input: its index in tensors_in(inputs)
INPUT_INDEX = "fxflops_input"


def mark_inputs(graph_module: torch.fx.GraphModule, inputs: Any) -> None:
    """Tag the placeholders holding `inputs`' tensors (by identity) with INPUT_INDEX, so a later
    stage can replay what the graph derived from an input on the real one (the meter's data masks)."""
    index: dict[int, int] = {}
    for position, tensor in enumerate(tensors_in(inputs)):
        index.setdefault(id(tensor), position)
    for node in graph_module.graph.find_nodes(op="placeholder"):
        position = index.get(id(node.meta.get("val")))
        if position is not None:
            node.meta[INPUT_INDEX] = position


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
        elif not isinstance(value, _SCALARS) and value is not None and id(value) not in seen:
            seen[id(value)] = value
            stack.extend(reversed(_not_scalars(_items(value))))


# values that hold no tensor; a container of nothing else is skipped without a Python-level loop
_SCALARS = (str, bytes, int, float, bool, torch.dtype, torch.device)
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
    return [] if _only_scalars(items) else list(items)


def _only_scalars(items: Iterable[Any]) -> bool:
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


def signature(value: Any) -> tuple:
    """A hashable key for the input shapes of a call: equal keys give equal estimates.

    Tensors contribute shape, dtype and device type; opaque objects such as a KV cache the shapes
    of the tensors inside them; plain scalars (`use_cache=True`, `logits_to_keep=1`) their value.
    """
    leaves, spec = pytree.tree_flatten(value)
    return str(spec), tuple(_leaf_signature(leaf) for leaf in leaves)


def _leaf_signature(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return tuple(leaf.shape), leaf.dtype, leaf.device.type
    if leaf is None or isinstance(leaf, bool | int | float | str | torch.dtype | torch.device):
        return leaf
    return type(leaf).__qualname__, tuple((tuple(t.shape), t.dtype) for t in tensors_in(leaf))


def is_plain(value: Any) -> bool:
    """Whether a value is tensors and builtin containers of them (what torch.export takes as input)."""
    if value is None or isinstance(value, torch.Tensor | int | float | bool | str | torch.dtype | torch.device):
        return True
    if isinstance(value, list | tuple):
        return all(is_plain(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and is_plain(item) for key, item in value.items())
    return False


def with_twins(value: Any, twin: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """The value with every tensor replaced by `twin(tensor)` (one twin per tensor).

    Nothing of the user's is copied: only the containers and objects on a path to a tensor are rebuilt
    (lists, tuples, dicts, sets, dataclasses, objects' attributes, without calling their class's copy or
    pickle methods); everything else, and any object that cannot be rebuilt, is the caller's own.
    """
    return Reach(value).with_twins(twin)


class Reach:
    """What a value reaches: every container and object on the way to its tensors, found without recursion."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self._nodes: dict[int, tuple[Any, list[tuple[Any, Any]]]] = {}  # id -> (object, [(key, child)])
        self._holders: list[int] = []  # ids of the nodes that hold a tensor themselves
        stack = [value]
        while stack:
            node = stack.pop()
            if isinstance(node, torch.Tensor) or node is None or isinstance(node, _SCALARS) or id(node) in self._nodes:
                continue
            children = _children(node)
            self._nodes[id(node)] = (node, children)
            if any(isinstance(child, torch.Tensor) for _, child in children):
                self._holders.append(id(node))
            stack.extend(child for _, child in reversed(children))

    def objects(self) -> list[Any]:
        """Every container and object reached (not tensors): what a forward given the value could change."""
        return [node for node, _ in self._nodes.values()]

    def with_twins(self, twin: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        """See `with_twins`."""
        if isinstance(self.value, torch.Tensor):
            return twin(self.value)
        on_path = self._on_path()
        if not on_path:
            return self.value
        twins: dict[int, torch.Tensor] = {}
        rebuilt: dict[int, Any] = {}

        def new(child: Any) -> Any:
            if isinstance(child, torch.Tensor):
                found = twins.get(id(child))
                if found is None:
                    found = twins[id(child)] = twin(child)
                return found
            return rebuilt.get(id(child), child)

        for key in on_path:  # mutable shells first: a cycle through them closes on the shell
            shell = _shell(self._nodes[key][0])
            if shell is not None:
                rebuilt[key] = shell
        for key in self._immutables_in_order(on_path):
            node, children = self._nodes[key]
            made = _rebuilt_immutable(node, [(where, new(child)) for where, child in children])
            if made is not None:
                rebuilt[key] = made
        for key in on_path:
            node, children = self._nodes[key]
            if key in rebuilt and not isinstance(node, tuple | frozenset):
                _fill(rebuilt[key], node, [(where, new(child)) for where, child in children])
        return new(self.value)

    def _on_path(self) -> list[int]:
        """Ids of the nodes from which a tensor can be reached, in discovery order."""
        parents: dict[int, list[int]] = {}
        for key, (_, children) in self._nodes.items():
            for _, child in children:
                if id(child) in self._nodes:
                    parents.setdefault(id(child), []).append(key)
        marked = set(self._holders)
        stack = list(self._holders)
        while stack:
            for parent in parents.get(stack.pop(), ()):
                if parent not in marked:
                    marked.add(parent)
                    stack.append(parent)
        return [key for key in self._nodes if key in marked]

    def _immutables_in_order(self, on_path: list[int]) -> list[int]:
        """Tuples and frozensets on a path, each after the tuples and frozensets inside it."""
        marked = set(on_path)
        order: list[int] = []
        done: set[int] = set()
        for root in on_path:
            stack = [(root, False)]
            while stack:
                key, expanded = stack.pop()
                node = self._nodes[key][0]
                if key in done or not isinstance(node, tuple | frozenset):
                    continue
                if expanded:
                    done.add(key)
                    order.append(key)
                    continue
                stack.append((key, True))
                stack.extend((id(child), False) for _, child in self._nodes[key][1] if id(child) in marked)
        return order


def _children(node: Any) -> list[tuple[Any, Any]]:
    """(where, child) for what a node holds that may lead to a tensor; plain scalars are left out."""
    if isinstance(node, list | tuple):
        return [] if _only_scalars(node) else [(i, item) for i, item in enumerate(node) if not _is_scalar(item)]
    if isinstance(node, set | frozenset):
        return [] if _only_scalars(node) else [(None, item) for item in node if not _is_scalar(item)]
    found: list[tuple[Any, Any]] = []
    if isinstance(node, dict) and not _only_scalars(dict.values(node)):
        found += [(("item", key), item) for key, item in _dict_items(node) if not _is_scalar(item)]
    state = own_attribute(node, "__dict__", None)
    if isinstance(state, dict) and not isinstance(node, type) and not _only_scalars(state.values()):
        found += [(("attr", key), item) for key, item in state.items() if not _is_scalar(item)]
    for name in slot_names(node):
        item = own_attribute(node, name, _ABSENT)
        if item is not _ABSENT and not _is_scalar(item):
            found.append((("slot", name), item))
    return found


_ABSENT = object()


def _dict_items(node: dict) -> Any:
    """A dict's own items, read past any override of items() in its class."""
    return (OrderedDict if isinstance(node, OrderedDict) else dict).items(node)


def own_attribute(obj: Any, name: str, default: Any) -> Any:
    """An attribute as the object stores it, past any __getattr__ / __getattribute__ of its class."""
    try:
        return object.__getattribute__(obj, name)
    except Exception:  # noqa: BLE001 - a slot never set, or an object with no such attribute
        return default


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, _SCALARS)


def slot_names(node: Any) -> list[str]:
    """The names of the __slots__ the node's classes declare (read, not cached on the class as copyreg does)."""
    cls = type(node)
    if cls in (list, tuple, dict, set, frozenset) or isinstance(node, type):
        return []
    names: list[str] = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in [slots] if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):  # a private slot is stored mangled
                name = f"_{klass.__name__.lstrip('_')}{name}"
            names.append(name)
    return names


def _shell(node: Any) -> Any:
    """An empty object of the node's mutable class, made without calling its __init__ (None: cannot)."""
    cls = type(node)
    if isinstance(node, tuple | frozenset):
        return None
    if cls is list or cls is dict or cls is set:
        return cls()
    if isinstance(node, type) or not (isinstance(node, list | dict | set)
                                      or own_attribute(node, "__dict__", None) is not None or slot_names(node)):
        return None
    try:
        shell = cls.__new__(cls)
    except Exception:  # noqa: BLE001 - an object that cannot be rebuilt is passed on as it is
        return None
    if isinstance(node, defaultdict):
        shell.default_factory = node.default_factory
    return shell


def _fill(shell: Any, node: Any, children: list[tuple[Any, Any]]) -> None:
    """Give a rebuilt shell the node's contents, with `children` (where, new value) in place of its own."""
    if isinstance(node, list):
        items = list(node)
        for index, item in children:
            items[index] = item
        list.extend(shell, items)
    elif isinstance(node, set):
        set.update(shell, {item for item in node if _is_scalar(item)}, (item for _, item in children))
    if isinstance(node, dict):
        # OrderedDict keeps its order beside the dict: its own __setitem__, never the class's override
        setitem = OrderedDict.__setitem__ if isinstance(node, OrderedDict) else dict.__setitem__
        new_items = {where[1]: item for where, item in children if isinstance(where, tuple) and where[0] == "item"}
        for key, item in _dict_items(node):
            setitem(shell, key, new_items.get(key, item))
    state = own_attribute(node, "__dict__", None)
    if isinstance(state, dict):
        shell.__dict__.update(state)
    for name in slot_names(node):
        item = own_attribute(node, name, _ABSENT)
        if item is not _ABSENT:
            object.__setattr__(shell, name, item)
    for where, item in children:
        if isinstance(where, tuple) and where[0] == "attr":
            shell.__dict__[where[1]] = item
        elif isinstance(where, tuple) and where[0] == "slot":
            object.__setattr__(shell, where[1], item)


def _rebuilt_immutable(node: Any, children: list[tuple[Any, Any]]) -> Any:
    """The tuple or frozenset with its children (where, new value) in place (None: cannot be rebuilt)."""
    cls = type(node)
    if isinstance(node, frozenset):
        values = [item for item in node if _is_scalar(item)] + [item for _, item in children]
        return frozenset(values) if cls is frozenset else _try(lambda: cls(values))
    values = list(node)
    for index, item in children:
        values[index] = item
    if cls is tuple:
        return tuple(values)
    if hasattr(cls, "_make"):  # a namedtuple
        return _try(lambda: cls._make(values))
    return _try(lambda: cls(values))  # torch.return_types and other struct sequences


def _try(make: Callable[[], Any]) -> Any:
    try:
        return make()
    except Exception:  # noqa: BLE001 - an object that cannot be rebuilt is passed on as it is
        return None


def to_meta(value: Any) -> Any:
    """The same pytree with every tensor replaced by a meta tensor of the same shape and dtype."""
    return with_twins(value, meta_twin)


def meta_twin(tensor: torch.Tensor) -> torch.Tensor:
    twin = tensor.detach().to("meta")
    return torch.nn.Parameter(twin, tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) else twin


def shapes_of(value: Any) -> Any:
    """The value with every tensor replaced by its shape (for reports)."""
    return tree_map(lambda v: tuple(v.shape) if isinstance(v, torch.Tensor) else v, value)


def floating_dtype(model: torch.nn.Module, args: Any = (), kwargs: Any = None) -> str:
    """The model's floating dtype: its first floating parameter or buffer's, else its inputs', else torch's default."""
    for tensor in itertools.chain(model.parameters(), model.buffers(), iter_tensors((args, kwargs or {}))):
        if not isinstance(tensor, UninitializedTensorMixin) and tensor.is_floating_point():
            return str(tensor.dtype).removeprefix("torch.")
    return str(torch.get_default_dtype()).removeprefix("torch.")


def nothing_to_run(model: torch.nn.Module, args: Any = (), kwargs: Any = None) -> str | None:
    """Why the model cannot really run (its weights or its inputs are meta tensors), or None if it can."""
    weights = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    inputs = any(t.is_meta for t in tensors_in((args, kwargs or {})))
    if weights and inputs:
        return "its weights and inputs are on the meta device (or the inputs given as shapes)"
    if weights:
        return "its weights are on the meta device"
    if inputs:
        return "its inputs are given as shapes (input_shape=) or meta tensors, which hold no values"
    return None


def values_from_tensor_meta(graph_module: torch.fx.GraphModule) -> list[str]:
    """Give every node that has only ShapeProp's `tensor_meta` a `meta["val"]` (a meta tensor of that
    shape, dtype and stride), which is what the count stage reads; return the op nodes left without
    any value (a graph whose shapes were never propagated)."""
    missing = []
    for node in graph_module.graph.nodes:
        if "val" in node.meta:
            continue
        if "tensor_meta" in node.meta:
            node.meta["val"] = _meta_value(node.meta["tensor_meta"])
        elif node.op in ("call_function", "call_method", "call_module"):
            missing.append(node.name)
    return missing


def _meta_value(tensor_meta: Any) -> Any:
    # TensorMetadata is a namedtuple with .shape; a multi-output node holds a tuple of them
    if hasattr(tensor_meta, "shape") and hasattr(tensor_meta, "dtype"):
        return torch.empty_strided(tuple(tensor_meta.shape), tuple(tensor_meta.stride), dtype=tensor_meta.dtype,
                                   device="meta")
    if isinstance(tensor_meta, list | tuple):
        return type(tensor_meta)(_meta_value(item) for item in tensor_meta)
    if isinstance(tensor_meta, dict):
        return {key: _meta_value(item) for key, item in tensor_meta.items()}
    return tensor_meta
