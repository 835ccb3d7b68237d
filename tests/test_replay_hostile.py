"""Replay against hostile but legal custom models (issue 36): each a few layers whose calls differ in a way
the call's key could miss. Every one must give, node by node and module by module, what a capture that
runs every call gives (`assert_same_as_full`), and its total must equal FlopCounterMode's. The models of
each cause come from benchmarks/hostile_models.py (the generated set the architecture sweep runs), one
per channel here; the examples it cannot express are built below."""

from __future__ import annotations

import functools
import os
import string
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fxflops
from benchmarks.hostile_models import Host, Layer, build
from tests.oracle import oracle_flops
from tests.test_replay import _replayed_modules, _Stack, assert_same_as_full

X = (torch.zeros(3, 8),)


def agrees(model: nn.Module, args: tuple = X, reset: Any = lambda: None) -> None:
    """The same nodes, costs and module calls with and without replay (each from the same outside state),
    and FlopCounterMode's total."""
    reset()
    rows = _costs(model, args, True)
    reset()
    assert rows == _costs(model, args, False)
    reset()
    estimate = fxflops.estimate(model, args, conventions="torch", method="eager")
    reset()
    assert estimate.total_flops == oracle_flops(model, args)


def _costs(model: nn.Module, args: tuple, replay: bool) -> tuple:
    from tests.test_replay import _costs as costs

    rows, calls, cautions, _ = costs(model, args, {}, replay)
    return rows, calls, cautions


# each cause of the issue, by the channels that carry it (benchmarks/hostile_models.py's CHANNELS)
CAUSES = {
    "1 real tensors' values": ["real_tensor_table"],
    "2 reads past attribute access": ["dict", "vars", "getattr_static", "computed_name", "attrgetter"],
    "3 the reference's class": ["sees_its_type"],
    "4 shared objects, deep": ["deep_config_shared", "deep_config_own", "partial_keywords", "partial_own",
                               "lambda_fresh", "closure_cell", "torch_size", "nested_tuple", "negative_zero",
                               "nan", "helper_method", "decorator_closure"],
    "5 CPU autocast": ["cpu_autocast"],
    "6 forward called directly": ["forward_called_directly"],
    "7 state outside the block": ["global_int", "global_dict", "global_object", "class_attribute",
                                  "registry_by_id", "registry_by_self", "weakref_parent", "unregistered_module",
                                  "environ", "inference_mode", "deterministic", "global_counter", "dict_counter",
                                  "itertools_count", "nonlocal_counter", "mutable_default", "global_helper"],
}


@pytest.mark.parametrize("channel", [channel for channels in CAUSES.values() for channel in channels])
@pytest.mark.parametrize("pattern", ["0011", "0221"])
def test_each_cause_gives_what_a_full_capture_gives(channel, pattern):
    model, args, reset = build(f"{channel}/{pattern}/4")
    agrees(model, args, reset)


class ReadsADict(Layer):
    def extra(self, x):
        return int(self.sizes["n"])


def test_real_tensor_values_in_a_dict_are_keyed():
    agrees(blocks(ReadsADict, sizes=[{"n": torch.tensor(i % 2)} for i in range(4)]))


def blocks(cls: type, count: int = 4, **each: Any) -> _Stack:
    made = []
    for index in range(count):
        block = cls()
        for key, values in each.items():
            setattr(block, key, values[index])
        made.append(block)
    return _Stack(made)


# --- 3. the reference is not observably different --------------------------------------------------------


REGISTRY: list[type] = []


class Registered(nn.Module):
    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        REGISTRY.append(cls)


class SeesItsType(Registered, Layer):
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

    model = Host([MaskedByContext(context) for _ in range(4)], before=lambda host, index: before(None, index))
    assert_same_as_full(model, X)
    counting = fxflops.api.Counting.prepare("deepspeed", None, None)
    captured = counting.capture(model, X, {}, "eager")
    read = [node.args[1].meta["val"] for node in captured.graph_module.graph.nodes
            if node.op == "call_function" and "mul" in str(node.target)]
    assert len({id(tensor) for tensor in read}) == 4  # each layer's own mask


# --- 5. CPU autocast ------------------------------------------------------------------------------------


class BranchesOnDtype(Layer):
    def forward(self, x):
        y = self.proj(x)
        return self.proj(y.float()) if y.dtype == torch.bfloat16 else y.float()


class HalfAutocast(_Stack):
    def forward(self, x):
        for index, block in enumerate(self.blocks):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=index >= 2):
                x = block(x)
        return x


def test_cpu_autocast_is_in_the_key():
    agrees(HalfAutocast([BranchesOnDtype() for _ in range(4)]))


# --- 6. forward called directly ----------------------------------------------------------------------------


class SomeDirect(_Stack):
    def forward(self, x):
        for index, block in enumerate(self.blocks):
            x = block.forward(x) if index == 2 else block(x)
        return x


class OwnOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def test_a_forward_called_directly_keeps_its_ops_where_they_ran():
    # block 2's op belongs to the stack (its forward ran without a module call), as in a full capture
    for make in (lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU()), OwnOp):
        model = SomeDirect([make() for _ in range(4)])
        assert_same_as_full(model, X)


def test_an_estimate_leaves_no_trace():
    model = blocks(SeesItsType, n=[0, 0, 1, 1])
    modules = dict(sys.modules)
    classes = [(type(m), dict(m.__dict__)) for m in model.modules()]
    registry, trace = list(REGISTRY), sys.gettrace()
    fxflops.estimate(model, X)
    assert [(type(m), dict(m.__dict__)) for m in model.modules()] == classes
    assert REGISTRY == registry and sys.gettrace() is trace
    assert set(sys.modules) - set(modules) <= {name for name in sys.modules if name.startswith("fxflops")}



def test_each_file_is_classified_once(monkeypatch):
    """The tracer sorts each file's code once (its realpath walk is ~50 us), code traced only where traced
    code calls it (the standard library, sympy) included: a file asked twice is work done twice."""
    from fxflops.capture import block_reads

    asked: list[str] = []
    kind = block_reads._kind
    monkeypatch.setattr(block_reads, "_kind", lambda filename, *rest: asked.append(filename) or kind(filename, *rest))
    tracer = block_reads.Tracer()
    tracer.start()
    try:
        for _ in range(3):
            string.capwords("a b")  # the standard library, called from this (traced) file
    finally:
        tracer.stop()
    assert string.__file__ in asked and len(asked) == len(set(asked))


# --- the switch and the self-check --------------------------------------------------------------------------


LEVEL = 0


class ReadsLevel(Layer):
    def extra(self, x):
        return LEVEL


class SetsLevel(_Stack):
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
    with pytest.warns(ReplayMismatch, match=r"blocks\.[23]: replaying blocks\.0 would differ"):
        verified = count()
    assert verified.total_flops == full.total_flops


def test_the_cli_switch():
    from fxflops.cli.parser import build_parser

    assert build_parser().parse_args(["lenet5", "--no-replay"]).replay is False
    assert build_parser().parse_args(["lenet5"]).replay is True
