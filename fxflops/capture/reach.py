"""What a value reaches, and the value rebuilt with twins in place of its tensors.

A user's inputs are never copied: the walk is iterative (a linked input thousands deep is fine) and
only the containers and objects on a path to a tensor are rebuilt.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Callable
from typing import Any

import torch

from fxflops.capture.tensor_walk import SCALARS, only_scalars


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
            if isinstance(node, torch.Tensor) or node is None or isinstance(node, SCALARS) or id(node) in self._nodes:
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


def reaches(value: Any, found: Callable[[Any], bool], limit: int) -> bool:
    """Whether `found(x)` holds for an object the value reaches through containers and attributes (not past
    such an object, a tensor or a class); past `limit` objects it is taken to."""
    stack, seen = [value], set()
    while stack:
        node = stack.pop()
        if id(node) in seen or _is_scalar(node) or isinstance(node, torch.Tensor | type):
            continue
        if found(node):
            return True
        seen.add(id(node))
        if len(seen) > limit:
            return True
        stack.extend(child for _, child in _children(node))
    return False


def _children(node: Any) -> list[tuple[Any, Any]]:
    """(where, child) for what a node holds that may lead to a tensor; plain scalars are left out."""
    if isinstance(node, list | tuple):
        return [] if only_scalars(node) else [(i, item) for i, item in enumerate(node) if not _is_scalar(item)]
    if isinstance(node, set | frozenset):
        return [] if only_scalars(node) else [(None, item) for item in node if not _is_scalar(item)]
    found: list[tuple[Any, Any]] = []
    if isinstance(node, dict) and not only_scalars(dict.values(node)):
        found += [(("item", key), item) for key, item in _dict_items(node) if not _is_scalar(item)]
    state = own_attribute(node, "__dict__", None)
    if isinstance(state, dict) and not isinstance(node, type) and not only_scalars(state.values()):
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
    return value is None or isinstance(value, SCALARS)


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
