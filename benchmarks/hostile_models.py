"""Hostile but legal custom models for replay (issue 36), generated: each a few layers of one class whose
calls differ only through one channel a replay key could miss (a value read past attribute access, a
shared object changed between calls, a global, torch's global settings, object identities, a counter
kept outside the block ...), under several per-layer value patterns and depths.

`cases()` names every model; `build(name)` gives (model, args, reset), `reset()` putting back whatever
state the model keeps outside itself (counters), so that every capture starts from the same state.
replay_architectures.py --hostile compares replay=True, replay=False and FXFLOPS_VERIFY_REPLAY=1.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import math
import operator
import os
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

PATTERNS = {"0011": [0, 0, 1, 1], "0101": [0, 1, 0, 1], "1100": [1, 1, 0, 0], "0001": [0, 0, 0, 1],
            "1111": [1, 1, 1, 1], "0221": [0, 2, 2, 1], "0110": [0, 1, 1, 0]}
DEPTHS = (4, 5)
ENV = "FXFLOPS_HOSTILE_LEVEL"

G_INT = 0
G_DICT: dict[str, int] = {"v": 0}
G_OBJ = types.SimpleNamespace(v=0)
G_BY_ID: dict[int, int] = {}
G_BY_SELF: dict[Any, int] = {}
G_COUNT = {"n": 0}
G_CALLS = 0
G_TICKS = itertools.count()


class Helper:
    def __init__(self) -> None:
        self.state = 0

    def level(self) -> int:
        return self.state


G_HELPER = Helper()


class Layer(nn.Module):
    """A Linear, then `extra(x)` more Linear applications; what `extra` reads is the channel."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def extra(self, x: torch.Tensor) -> int:
        return 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x).float()
        for _ in range(self.extra(x)):
            x = self.proj(x)
        return x


class Host(nn.Module):
    """Calls its layers in turn; `before(host, i)` changes what layer i will read, `context(i)` wraps its call."""

    def __init__(self, layers: list[nn.Module], before: Callable[[Any, int], None] | None = None,
                 context: Callable[[int], Any] | None = None, direct: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.before = before
        self.context = context
        self.direct = direct

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        deterministic = torch.are_deterministic_algorithms_enabled()
        try:
            for index, layer in enumerate(self.layers):
                if self.before is not None:
                    self.before(self, index)
                if self.context is not None:
                    with self.context(index):
                        x = layer(x).float().clone()
                else:
                    x = layer.forward(x) if index in self.direct else layer(x)
        finally:
            torch.use_deterministic_algorithms(deterministic)
        return x


# --- the channels: each a Layer subclass (what it reads) and how the per-layer values reach it ----------


class Attr(Layer):
    def extra(self, x):
        return self.v


class InDict(Layer):
    def extra(self, x):
        return self.__dict__["v"]


class ByVars(Layer):
    def extra(self, x):
        return vars(self)["v"]


class Static(Layer):
    def extra(self, x):
        return inspect.getattr_static(self, "v")


class ComputedName(Layer):
    def extra(self, x):
        name = "".join(["v"])
        return getattr(self, name)


class AttrGetter(Layer):
    def extra(self, x):
        return operator.attrgetter("v")(self)


class DeepConfig(Layer):
    def extra(self, x):
        return self.cfg.a.b.v


class CallsFn(Layer):
    def extra(self, x):
        return self.fn()


class Shape(Layer):
    def extra(self, x):
        return self.shape[0]


class NestedTuple(Layer):
    def extra(self, x):
        return self.t[0][0]


class GlobalInt(Layer):
    def extra(self, x):
        return G_INT


class GlobalDict(Layer):
    def extra(self, x):
        return G_DICT["v"]


class GlobalObject(Layer):
    def extra(self, x):
        return G_OBJ.v


class ClassAttr(Layer):
    level = 0

    def extra(self, x):
        return self.level


class ById(Layer):
    def extra(self, x):
        return G_BY_ID.get(id(self), 0)


class BySelf(Layer):
    def extra(self, x):
        return G_BY_SELF.get(self, 0)


class WeakParent(Layer):
    def extra(self, x):
        return self.parent().step


class Unregistered(Layer):
    def extra(self, x):
        return self.owner.step


class Environ(Layer):
    def extra(self, x):
        return int(os.environ.get(ENV, "0"))


class InferenceMode(Layer):
    def extra(self, x):
        return int(torch.is_inference_mode_enabled())


class Autocast(Layer):
    def extra(self, x):
        return int(self.proj(x).dtype == torch.bfloat16)


class Deterministic(Layer):
    def extra(self, x):
        return int(torch.are_deterministic_algorithms_enabled())


class RealTable(Layer):
    def extra(self, x):
        return int(self.table[0])


class SignOfZero(Layer):
    def extra(self, x):
        return int(math.copysign(1.0, self.eps) < 0)


class NotANumber(Layer):
    def extra(self, x):
        return int(math.isnan(self.eps))


class SeesItsType(Layer):
    def extra(self, x):
        return int(type(self) is SeesItsType) + int(self.__class__ == SeesItsType) \
            + int("forward" in self.__dict__) + {SeesItsType: 0}.get(type(self), 5) + self.v - 2


class CountsGlobal(Layer):
    def extra(self, x):
        global G_CALLS
        G_CALLS += 1
        return G_CALLS % 2


class CountsInDict(Layer):
    def extra(self, x):
        G_COUNT["n"] += 1
        return G_COUNT["n"] % 2


class Ticks(Layer):
    def extra(self, x):
        return next(G_TICKS) % 2


class HelperMethod(Layer):
    def extra(self, x):
        return self.helper.level()


class GlobalHelper(Layer):
    def extra(self, x):
        return G_HELPER.level()


class Direct(Layer):
    def forward(self, x):
        return super().forward(x) * 2


def _nonlocal_counter() -> Callable[[], int]:
    count = 0

    def tick() -> int:
        nonlocal count
        count += 1
        return count % 2
    return tick


def _leveled() -> tuple[Callable[[int], None], Callable]:
    level = 0

    def set_level(value: int) -> None:
        nonlocal level
        level = value

    def decorate(extra: Callable) -> Callable:
        @functools.wraps(extra)
        def wrapper(self: Any, x: torch.Tensor) -> int:
            return extra(self, x) + level
        return wrapper
    return set_level, decorate


SET_LEVEL, LEVELED = _leveled()


class Decorated(Layer):
    @LEVELED
    def extra(self, x):
        return 0


class Nonlocal(Layer):
    def extra(self, x):
        return self.tick()


def _mutable_default(acc: list = []) -> int:  # noqa: B006 - the hostile part
    acc.append(1)
    return len(acc) % 2


class MutableDefault(Layer):
    def extra(self, x):
        return _mutable_default()


def _each(name: str, make: Callable[[int], Any]) -> Callable[[list[nn.Module], list[int]], dict]:
    """Each layer holds its own value (an attribute), set once."""
    def install(layers: list[nn.Module], values: list[int]) -> dict:
        for layer, value in zip(layers, values):
            layer.__dict__[name] = make(value)
        return {}
    return install


def _before(set_value: Callable[[Any, nn.Module, int], None], setup: Callable[[list[nn.Module]], None] | None = None):
    """The host sets the value before each layer's call."""
    def install(layers: list[nn.Module], values: list[int]) -> dict:
        if setup is not None:
            setup(layers)
        return {"before": lambda host, index: set_value(host, host.layers[index], values[index])}
    return install


def _context(make: Callable[[int], Any]):
    def install(layers: list[nn.Module], values: list[int]) -> dict:
        return {"context": lambda index: make(values[index])}
    return install


def _global(name: str):
    def set_value(host, layer, value):
        globals()[name] = value
    return set_value


def _shared(attribute: str, shared: Any, change: Callable[[Any, int], None]):
    def setup(layers):
        for layer in layers:
            layer.__dict__[attribute] = shared
    return _before(lambda host, layer, value: change(shared, value), setup)


def _class_level(host, layer, value):
    type(layer).level = value


def _step(host, layer, value):
    host.__dict__["step"] = value


def _refer(attribute: str, weak: bool):
    def install(layers, values):
        def before(host, index):
            for layer in host.layers:
                layer.__dict__[attribute] = weakref.ref(host) if weak else host
            host.__dict__["step"] = values[index]
        return {"before": before}
    return install


def _registry(by_id: bool):
    def install(layers, values):
        table = G_BY_ID if by_id else G_BY_SELF
        table.clear()
        table.update({(id(layer) if by_id else layer): value for layer, value in zip(layers, values)})
        return {}
    return install


def _fresh_lambda(host, layer, value):
    layer.fn = lambda: value  # the previous one dies: its id is free for the next


def _deterministic(host, layer, value):
    torch.use_deterministic_algorithms(bool(value))


CHANNELS: dict[str, tuple[type, Callable[[list[nn.Module], list[int]], dict]]] = {
    "attr": (Attr, _each("v", int)),
    "dict": (InDict, _each("v", int)),
    "vars": (ByVars, _each("v", int)),
    "getattr_static": (Static, _each("v", int)),
    "computed_name": (ComputedName, _each("v", int)),
    "attrgetter": (AttrGetter, _each("v", int)),
    "deep_config_shared": (DeepConfig, _shared("cfg", types.SimpleNamespace(a=types.SimpleNamespace(b=types.SimpleNamespace(v=0))), lambda c, v: setattr(c.a.b, "v", v))),
    "deep_config_own": (DeepConfig, _each("cfg", lambda v: types.SimpleNamespace(a=types.SimpleNamespace(b=types.SimpleNamespace(v=v))))),
    "partial_keywords": (CallsFn, _shared("fn", functools.partial(lambda v: v, v=0),
                                          lambda p, v: p.keywords.__setitem__("v", v))),
    "partial_own": (CallsFn, _each("fn", lambda v: functools.partial(int, v))),
    "lambda_fresh": (CallsFn, _before(_fresh_lambda)),
    "closure_cell": (CallsFn, _shared("fn", (lambda box: lambda: box[0])([0]), lambda f, v: f.__closure__[0]
                                      .cell_contents.__setitem__(0, v))),
    "torch_size": (Shape, _each("shape", lambda v: torch.Size([v]))),
    "nested_tuple": (NestedTuple, _each("t", lambda v: ((v,),))),
    "global_int": (GlobalInt, _before(_global("G_INT"))),
    "global_dict": (GlobalDict, _before(lambda host, layer, v: G_DICT.__setitem__("v", v))),
    "global_object": (GlobalObject, _before(lambda host, layer, v: setattr(G_OBJ, "v", v))),
    "class_attribute": (ClassAttr, _before(_class_level)),
    "registry_by_id": (ById, _registry(True)),
    "registry_by_self": (BySelf, _registry(False)),
    "weakref_parent": (WeakParent, _refer("parent", True)),
    "unregistered_module": (Unregistered, _refer("owner", False)),
    "environ": (Environ, _before(lambda host, layer, v: os.environ.__setitem__(ENV, str(v)))),
    "inference_mode": (InferenceMode, _context(lambda v: torch.inference_mode() if v else contextlib.nullcontext())),
    "cpu_autocast": (Autocast, _context(lambda v: torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(v)))),
    "deterministic": (Deterministic, _before(_deterministic)),
    "real_tensor_table": (RealTable, _each("table", lambda v: [torch.tensor(v)])),
    "negative_zero": (SignOfZero, _each("eps", lambda v: -0.0 if v else 0.0)),
    "nan": (NotANumber, _each("eps", lambda v: math.nan if v else 1.0)),
    "sees_its_type": (SeesItsType, _each("v", int)),
    "global_counter": (CountsGlobal, _each("v", int)),
    "dict_counter": (CountsInDict, _each("v", int)),
    "itertools_count": (Ticks, _each("v", int)),
    "nonlocal_counter": (Nonlocal, _shared("tick", None, lambda t, v: None)),
    "mutable_default": (MutableDefault, _each("v", int)),
    "helper_method": (HelperMethod, _shared("helper", Helper(), lambda h, v: setattr(h, "state", v))),
    "global_helper": (GlobalHelper, _before(lambda host, layer, v: setattr(G_HELPER, "state", v))),
    "forward_called_directly": (Direct, _each("v", int)),
    "decorator_closure": (Decorated, _before(lambda host, layer, v: SET_LEVEL(v))),
}


def cases() -> list[str]:
    return [f"{channel}/{pattern}/{depth}" for channel in CHANNELS for pattern in PATTERNS for depth in DEPTHS]


def build(name: str) -> tuple[nn.Module, tuple, Callable[[], None]]:
    channel, pattern, depth = name.split("/")
    cls, install = CHANNELS[channel]
    values = (PATTERNS[pattern] * 2)[: int(depth)]
    if cls is ClassAttr:  # a class of its own per model: its attribute is changed
        cls = type("ClassAttr", (ClassAttr,), {})
    layers = [cls() for _ in values]
    options = install(layers, values)
    if channel == "nonlocal_counter":
        shared = _nonlocal_counter()
        for layer in layers:
            layer.__dict__["tick"] = shared
    if channel == "forward_called_directly":
        options["direct"] = tuple(index for index, value in enumerate(values) if value)
    model = Host(layers, **options).eval()

    def reset() -> None:
        global G_INT, G_CALLS, G_TICKS
        G_INT, G_CALLS, G_TICKS = 0, 0, itertools.count()
        G_DICT["v"], G_OBJ.v, G_COUNT["n"], G_HELPER.state = 0, 0, 0, 0
        SET_LEVEL(0)
        os.environ.pop(ENV, None)
        _mutable_default.__defaults__[0].clear()
        if channel == "nonlocal_counter":
            fresh = _nonlocal_counter()
            for layer in layers:
                layer.__dict__["tick"] = fresh
        if cls.__name__ == "ClassAttr":
            cls.level = 0
    return model, (torch.zeros(3, 8),), reset
