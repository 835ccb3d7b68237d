"""Replay against hostile but legal custom models (issue 36): each a few layers whose calls differ in a way
the call's key could miss. Every one must give, node by node and module by module, what a capture that
runs every call gives (`assert_same_as_full`), and its total must equal FlopCounterMode's."""

from __future__ import annotations

import functools
import inspect
import math
import os
import sys
import types
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fxflops
from tests.oracle import oracle_flops
from tests.test_replay import _replayed_modules, assert_same_as_full

X = (torch.zeros(3, 8),)


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Block(nn.Module):
    """A Linear, then as many extra Linear applications as `extra(self)` says."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def extra(self, x: torch.Tensor) -> int:
        return 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for _ in range(self.extra(x)):
            x = self.proj(x)
        return x


def agrees(model: nn.Module, args: tuple = X) -> None:
    """The same nodes, costs and module calls with and without replay, and FlopCounterMode's total."""
    assert_same_as_full(model, args)
    estimate = fxflops.estimate(model, args, conventions="torch", method="eager")
    assert estimate.total_flops == oracle_flops(model, args)


def blocks(cls: type, count: int = 4, **each: Any) -> Stack:
    made = []
    for index in range(count):
        block = cls()
        for key, values in each.items():
            setattr(block, key, values[index])
        made.append(block)
    return Stack(made)


# --- 1. values of real tensors in plain containers ------------------------------------------------------


class ReadsATable(Block):
    def extra(self, x):
        return int(self.table[0])


class ReadsADict(Block):
    def extra(self, x):
        return int(self.sizes["n"])


def test_real_tensor_values_in_a_list_or_dict_are_keyed():
    agrees(blocks(ReadsATable, table=[[torch.tensor(i % 3)] for i in range(4)]))
    agrees(blocks(ReadsADict, sizes=[{"n": torch.tensor(i % 2)} for i in range(4)]))


# --- 2. reads past attribute access ----------------------------------------------------------------------


class ReadsDict(Block):
    def extra(self, x):
        return self.__dict__["n"]


class ReadsVars(Block):
    def extra(self, x):
        return vars(self)["n"]


class ReadsStatic(Block):
    def extra(self, x):
        return inspect.getattr_static(self, "n")


class ReadsByComputedName(Block):
    def extra(self, x):
        name = "n"
        return getattr(self, name)


@pytest.mark.parametrize("cls", [ReadsDict, ReadsVars, ReadsStatic, ReadsByComputedName])
def test_reads_that_skip_attribute_access_are_seen(cls):
    agrees(blocks(cls, n=[0, 1, 1, 2]))
    agrees(blocks(cls, n=[2, 1, 1, 0]))


# --- 3. the reference is not observably different --------------------------------------------------------


REGISTRY: list[type] = []


class Registered(nn.Module):
    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        REGISTRY.append(cls)


class SeesItsType(Registered, Block):
    def extra(self, x):
        return (type(self) is SeesItsType) + (self.__class__ == SeesItsType) + ("forward" in self.__dict__) \
            + {SeesItsType: 1}.get(type(self), 0) + self.n


def test_the_reference_keeps_its_class_and_no_registry_grows():
    before = list(REGISTRY)
    subclasses = type.__subclasses__(SeesItsType)
    model = blocks(SeesItsType, n=[0, 0, 0, 0])
    agrees(model)
    assert REGISTRY == before and type.__subclasses__(SeesItsType) == subclasses
    assert {"blocks.2", "blocks.3"} <= {name.rsplit(".", 1)[0] for name in _replayed_modules(model, X)}


# --- 4. shared objects compared deeply ---------------------------------------------------------------------


class ReadsDeepConfig(Block):
    def extra(self, x):
        return self.config.inner.n


class Parent(nn.Module):
    """Changes a shared object before each block's call, as a scheduler of per-layer settings would."""

    def __init__(self, blocks: list[nn.Module], before: Any) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.before = before

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            self.before(block, index)
            x = block(x)
        return x


def _inner(n):
    return types.SimpleNamespace(inner=types.SimpleNamespace(n=n))


class CallsAPartial(Block):
    def extra(self, x):
        return self.fn()


class CallsAShape(Block):
    def extra(self, x):
        return self.shape[0]


def _set_lambda(block, index):
    block.fn = lambda: index % 2  # the previous one dies: its id is free again


def test_shared_objects_are_compared_deeply():
    config = _inner(0)
    agrees(Parent([ReadsDeepConfig() for _ in range(4)], lambda b, i: setattr(b, "config", config)
                  or setattr(config.inner, "n", i % 2)))
    partial = functools.partial(lambda n: n, n=0)
    agrees(Parent([CallsAPartial() for _ in range(4)], lambda b, i: setattr(b, "fn", partial)
                  or partial.keywords.__setitem__("n", i % 3)))
    agrees(Parent([CallsAPartial() for _ in range(4)], _set_lambda))
    agrees(Parent([CallsAShape() for _ in range(4)], lambda b, i: setattr(b, "shape", torch.Size([i % 2]))))


class SignOfZero(Block):
    def extra(self, x):
        return int(math.copysign(1.0, self.eps) < 0)


def test_negative_zero_is_not_zero():
    agrees(blocks(SignOfZero, eps=[0.0, 0.0, -0.0, -0.0]))


class MaskedByContext(nn.Module):
    def __init__(self, context: Any) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.context = context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.context.mask


def test_a_shared_context_objects_tensor_is_this_calls():
    context = types.SimpleNamespace(mask=None)
    masks = [torch.zeros(3, 8) for _ in range(4)]

    def before(block, index):
        context.mask = masks[index]

    model = Parent([MaskedByContext(context) for _ in range(4)], before)
    assert_same_as_full(model, X)
    counting = fxflops.api.Counting.prepare("deepspeed", None, None)
    captured = counting.capture(model, X, {}, "eager")
    read = [node.args[1].meta["val"] for node in captured.graph_module.graph.nodes
            if node.op == "call_function" and "mul" in str(node.target)]
    assert len({id(tensor) for tensor in read}) == 4  # each layer's own mask


# --- 5. CPU autocast ------------------------------------------------------------------------------------


class BranchesOnDtype(Block):
    def forward(self, x):
        y = self.proj(x)
        return self.proj(y.float()) if y.dtype == torch.bfloat16 else y.float()


class HalfAutocast(Stack):
    def forward(self, x):
        for index, block in enumerate(self.blocks):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=index >= 2):
                x = block(x)
        return x


def test_cpu_autocast_is_in_the_key():
    agrees(HalfAutocast([BranchesOnDtype() for _ in range(4)]))


# --- 6. forward called directly ----------------------------------------------------------------------------


class SomeDirect(Stack):
    def forward(self, x):
        for index, block in enumerate(self.blocks):
            x = block.forward(x) if index == 2 else block(x)
        return x


def test_a_forward_called_directly_keeps_its_ops_where_they_ran():
    model = SomeDirect([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4)])
    assert_same_as_full(model, X)


# --- 7. state outside the block ---------------------------------------------------------------------------


COUNTER = {"calls": 0}
CALLS = 0
BY_ID: dict[int, int] = {}
MASKS: dict[str, torch.Tensor] = {}


class CountsGlobally(Block):
    def extra(self, x):
        global CALLS
        CALLS += 1
        return CALLS % 2


class CountsInADict(Block):
    def extra(self, x):
        COUNTER["calls"] += 1
        return COUNTER["calls"] % 2


def _appends(acc: list = []) -> int:  # noqa: B006 - the hostile part
    acc.append(1)
    return len(acc) % 2


class MutableDefault(Block):
    def extra(self, x):
        return _appends()


class ById(Block):
    def extra(self, x):
        return BY_ID.get(id(self), 0)


class ByInferenceMode(Block):
    def extra(self, x):
        return int(torch.is_inference_mode_enabled())


class ByDeterminism(Block):
    def extra(self, x):
        return int(torch.are_deterministic_algorithms_enabled())


class ByParentRef(Block):
    def extra(self, x):
        return self.parent().step % 2


class ByUnregistered(Block):
    def extra(self, x):
        return self.__dict__["owner"].step % 2


class ByGlobalMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        x = self.proj(x)
        for _ in range(MASKS["current"].shape[0]):
            x = self.proj(x)
        return x


class Stepping(Stack):
    def forward(self, x):
        for index, block in enumerate(self.blocks):
            self.step = index
            if index == 2:
                with torch.inference_mode():
                    x = block(x).clone()
            else:
                x = block(x)
        return x


class Deterministic(Stack):
    def forward(self, x):
        previous = torch.are_deterministic_algorithms_enabled()
        for index, block in enumerate(self.blocks):
            torch.use_deterministic_algorithms(index % 2 == 1)
            x = block(x)
        torch.use_deterministic_algorithms(previous)
        return x


class GlobalMasks(Stack):
    def forward(self, x):
        for index, block in enumerate(self.blocks):
            MASKS["current"] = torch.zeros(index % 3)
            x = block(x)
        return x


def test_state_outside_the_block_is_detected():
    global CALLS
    CALLS = 0
    agrees(blocks(CountsGlobally))  # four calls a run: each run starts at an even count
    COUNTER["calls"] = 0
    agrees(blocks(CountsInADict))
    _appends.__defaults__[0].clear()
    agrees(blocks(MutableDefault))  # four calls a run: the list's length is even at each run's start
    model = blocks(ById)
    BY_ID.update({id(model.blocks[2]): 1, id(model.blocks[3]): 2})
    agrees(model)
    agrees(Stepping([ByInferenceMode() for _ in range(4)]))
    agrees(Deterministic([ByDeterminism() for _ in range(4)]))
    for cls in (ByParentRef, ByUnregistered):
        model = Stepping([cls() for _ in range(4)])
        for block in model.blocks:
            block.__dict__["owner"] = model
            block.__dict__["parent"] = weakref.ref(model)
        assert_same_as_full(model, X)
    assert_same_as_full(GlobalMasks([ByGlobalMask() for _ in range(4)]), X)


def _leveled():
    level = 0

    def set_level(value):
        nonlocal level
        level = value

    def decorate(forward):
        @functools.wraps(forward)
        def wrapper(self, x):
            x = forward(self, x)
            for _ in range(level):
                x = self.proj(x)
            return x
        return wrapper
    return set_level, decorate


SET_LEVEL, LEVELED = _leveled()


class Leveled(Block):
    @LEVELED
    def forward(self, x):
        return self.proj(x)


class SetsClosureLevel(Stack):
    def forward(self, x):
        for index, block in enumerate(self.blocks):
            SET_LEVEL(index // 2)
            x = block(x)
        return x


def test_a_closure_changed_between_calls_is_keyed():
    # the decorator's wrapper reads `level` from its closure, which a function outside the block rebinds
    agrees(SetsClosureLevel([Leveled() for _ in range(4)]))


def test_an_estimate_leaves_no_trace():
    model = blocks(SeesItsType, n=[0, 0, 1, 1])
    modules = dict(sys.modules)
    classes = [(type(m), dict(m.__dict__)) for m in model.modules()]
    registry, trace = list(REGISTRY), sys.gettrace()
    fxflops.estimate(model, X)
    assert [(type(m), dict(m.__dict__)) for m in model.modules()] == classes
    assert REGISTRY == registry and sys.gettrace() is trace
    assert set(sys.modules) - set(modules) <= {name for name in sys.modules if name.startswith("fxflops")}


# --- the switch and the self-check --------------------------------------------------------------------------


LEVEL = 0


class ReadsLevel(Block):
    def extra(self, x):
        return LEVEL


class SetsLevel(Stack):
    def forward(self, x):
        global LEVEL
        for index, block in enumerate(self.blocks):
            LEVEL = index // 2
            x = block(x)
        return x


def test_verification_runs_what_would_be_replayed_and_reports_a_difference(monkeypatch):
    from fxflops.capture import block_reads
    from fxflops.capture.replay import ReplayMismatch

    model = SetsLevel([ReadsLevel() for _ in range(4)])
    count = functools.partial(fxflops.estimate, model, X, conventions="torch")
    full = count(replay=False)
    assert full.total_flops == oracle_flops(model, X) == count().total_flops
    # a tracer blind to this file misses the global read: replay is then wrong, and verification says so
    monkeypatch.setattr(block_reads, "_UNTRACED", (*block_reads._UNTRACED, str(Path(__file__).parent) + os.sep))
    assert count().total_flops != full.total_flops
    monkeypatch.setenv("FXFLOPS_VERIFY_REPLAY", "1")
    with pytest.warns(ReplayMismatch, match=r"blocks\.[23]: replaying blocks\.1 would differ"):
        verified = count()
    assert verified.total_flops == full.total_flops


def test_the_cli_switch():
    from fxflops.cli.parser import build_parser

    assert build_parser().parse_args(["lenet5", "--no-replay"]).replay is False
    assert build_parser().parse_args(["lenet5"]).replay is True
