"""The user's objects and threads: inputs and attributes are never copied, opaque values pass through
the real-weights method, and captures refuse to share the model with another thread.

Expected MACs are worked out by hand (a Linear(i, o) on n rows: n * i * o).
"""

from __future__ import annotations

import collections
import dataclasses
import tempfile
import typing
import threading
import tracemalloc
import warnings

import pytest
import torch
from torch import nn

import fxflops
from fxflops.capture.containers import SAVED_WHOLE
from fxflops.capture.reach import with_twins
from fxflops.capture.twins import meta_twin


class NeverCopy:
    """Stands for a payload no one should copy: copying or pickling it fails the test."""

    def __deepcopy__(self, memo):
        raise AssertionError("the input was copied")

    def __copy__(self):
        raise AssertionError("the input was copied")

    def __reduce_ex__(self, protocol):
        raise AssertionError("the input was pickled")


class Batch:
    """An input object holding a tensor beside what cannot be copied: a lock, a generator, an open file."""

    def __init__(self, x: torch.Tensor, file) -> None:
        self.x = x
        self.lock = threading.Lock()
        self.stream = (i for i in range(3))
        self.file = file
        self.payload = NeverCopy()
        self.seen: list[str] = []


class TakesBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, batch: Batch) -> torch.Tensor:
        with batch.lock:
            return self.proj(batch.x)


@pytest.mark.parametrize("method", ["eager", "export", "trace"])
def test_inputs_holding_what_cannot_be_copied_are_estimated_without_a_copy(method):
    with tempfile.TemporaryFile() as file:
        batch = Batch(torch.randn(3, 8), file)
        x, payload = batch.x, batch.payload
        result = fxflops.estimate(TakesBatch(), (batch,), method=method)
        assert result.total_macs == 3 * 8 * 4
        assert next(batch.stream) == 0 and not batch.lock.locked() and not file.closed
        assert batch.x is x and batch.payload is payload


class Meddling(nn.Module):
    """A forward that changes the objects it is given: what the capture must put back."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, batch: Batch, extra: dict) -> torch.Tensor:
        assert batch.payload is PAYLOAD and extra["payload"] is PAYLOAD  # the user's objects, not copies
        batch.seen.append("forward")  # a list the input holds
        batch.x = batch.x * 2  # a tensor attribute replaced
        batch.note = "added"  # an attribute added
        extra["step"] = 1  # an item set
        del extra["payload"]
        return self.proj(batch.x)


PAYLOAD = NeverCopy()


@pytest.mark.parametrize("method", ["eager", "trace"])
def test_a_forward_that_changes_its_input_objects_leaves_them_as_they_were(method):
    batch = Batch(torch.randn(3, 8), None)
    batch.payload = PAYLOAD
    extra = {"payload": PAYLOAD}
    x = batch.x
    result = fxflops.estimate(Meddling(), (batch,), {"extra": extra}, method=method)
    assert result.total_macs == 3 * 8 * 4
    assert batch.x is x and batch.seen == [] and not hasattr(batch, "note")
    assert extra == {"payload": PAYLOAD}


class Link:
    def __init__(self, rest: Link | None, x: torch.Tensor | None = None) -> None:
        self.rest = rest
        self.x = x


class FollowsLinks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, link: Link) -> torch.Tensor:
        while link.x is None:
            link = link.rest
        return self.proj(link.x)


def test_a_2000_deep_linked_input_is_estimated():
    chain = Link(None, torch.randn(5, 8))
    for _ in range(2000):
        chain = Link(chain)
    result = fxflops.estimate(FollowsLinks(), (chain,))
    assert result.total_macs == 5 * 8 * 4


def _peak_bytes(run) -> int:
    """The most Python memory allocated while `run()` runs, beyond what was allocated before."""
    tracemalloc.start()
    try:
        run()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        run()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_a_large_list_in_an_input_is_not_copied():
    items = 4_000_000  # 32 MB of pointers: a copy of the list would show
    batch = Batch(torch.randn(3, 8), None)
    batch.payload = [0] * items
    peak = _peak_bytes(lambda: fxflops.estimate(TakesBatch(), (batch,)))
    assert peak < items * 8 // 4, f"{peak:,} bytes allocated"


class Holder(nn.Module):
    """Holds large plain containers as attributes; its forward appends to them."""

    def __init__(self, size: int, grow: bool = False, replace: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)
        self.table = [0] * size
        self.index = dict.fromkeys(range(size), 0)
        self.members = set(range(size))
        self.grow, self.replace = grow, replace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.grow:
            self.table.append(x)
            self.index["new"] = x
        if self.replace:
            self.table[len(self.table) // 2] = "changed"
        return self.proj(x)


def test_large_container_attributes_are_not_copied():
    size = 2_000_000  # 16 MB of pointers in the list alone; a dict and a set of as many
    model = Holder(size)
    peak = _peak_bytes(lambda: fxflops.estimate(model, (torch.randn(3, 8),)))
    assert peak < size * 8 // 4, f"{peak:,} bytes allocated"


@pytest.mark.parametrize("size", [100, SAVED_WHOLE + 1], ids=["saved whole", "saved by a sample"])
def test_appends_to_container_attributes_are_undone(size):
    model = Holder(size, grow=True)
    table, index = model.table, model.index
    result = fxflops.estimate(model, (torch.randn(3, 8),))
    assert result.total_macs == 3 * 8 * 4
    assert model.table is table and len(table) == size and all(item == 0 for item in table)
    assert model.index is index and list(index) == list(range(size))


def test_a_change_to_a_large_container_that_cannot_be_undone_is_reported():
    model = Holder(SAVED_WHOLE + 1, replace=True)
    with pytest.warns(RuntimeWarning, match="changed attribute 'table' of Holder in place"):
        fxflops.estimate(model, (torch.randn(3, 8),))


class RecordsFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.profiler.record_function("block"):  # an op whose output is a ScriptObject
            return self.proj(x)


def test_trace_passes_opaque_values_through():
    x = torch.randn(3, 8)
    assert fxflops.estimate(RecordsFunction(), (x,), method="trace").total_macs == 3 * 8 * 4
    # DataParallel's forward records functions too (on the CPU it calls its module)
    assert fxflops.estimate(nn.DataParallel(nn.Linear(8, 4)), (x,), method="trace").total_macs == 3 * 8 * 4


def test_trace_with_an_optimizer_step_in_a_gradient_hook():
    model = nn.Linear(8, 4)
    weight = model.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # its step records functions

    def step(parameter: torch.Tensor) -> None:
        optimizer.step()
        optimizer.zero_grad()

    handles = [p.register_post_accumulate_grad_hook(step) for p in model.parameters()]
    try:
        result = fxflops.estimate(model, (torch.randn(3, 8),), method="trace", backward=True)
    finally:
        for handle in handles:
            handle.remove()
    # forward, and the weight's gradient (the input needs none): 3 * 8 * 4 MACs each
    assert result.total_macs == 2 * 3 * 8 * 4
    assert torch.equal(model.weight, weight)  # the optimizer's step on the real weights was undone


class Pauses(nn.Module):
    """Stops mid-forward until the test's other thread has tried to run the model."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)
        self.paused = threading.Event()
        self.resume = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if threading.current_thread() is threading.main_thread():
            self.paused.set()
            self.resume.wait(timeout=30)
        return self.proj(x)


def test_a_forward_on_another_thread_during_a_capture_is_refused():
    model, x = Pauses(), torch.randn(3, 8)
    seen: list[object] = []

    def other_thread() -> None:
        model.paused.wait(timeout=30)
        try:
            seen.append(model.proj(x))
        except RuntimeError as error:
            seen.append(error)
        finally:
            model.resume.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    result = fxflops.estimate(model, (x,))
    thread.join()
    assert result.total_macs == 3 * 8 * 4
    assert isinstance(seen[0], RuntimeError), seen
    assert "while fxflops is estimating the model on another thread" in str(seen[0])
    assert torch.equal(model.proj(x), nn.functional.linear(x, model.proj.weight, model.proj.bias))  # after: real


def _global_tables() -> dict[str, dict]:
    module = torch.nn.modules.module
    return {name: dict(value) for name, value in vars(module).items()
            if name.startswith("_global_") and isinstance(value, dict)}


def test_concurrent_estimates_take_turns():
    shared, other = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), nn.Linear(8, 2)
    expected = {id(shared): 3 * 8 * 16 + 3 * 16 * 4, id(other): 3 * 8 * 2}
    tables = _global_tables()
    results: list[object] = []

    def estimates(model: nn.Module) -> None:
        for _ in range(4):
            try:
                results.append((id(model), fxflops.estimate(model, (torch.randn(3, 8),)).total_macs))
            except Exception as error:  # noqa: BLE001 - a failure is what the test looks for
                results.append(error)

    threads = [threading.Thread(target=estimates, args=(model,)) for model in (shared, shared, shared, other)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(results) == 16
    assert all(isinstance(r, tuple) and r[1] == expected[r[0]] for r in results), results
    assert _global_tables() == tables
    assert all(not isinstance(p, torch._subclasses.FakeTensor) for p in shared.parameters())


class Pair(typing.NamedTuple):
    first: torch.Tensor
    second: int


@dataclasses.dataclass(frozen=True, slots=True)
class Frozen:
    x: torch.Tensor
    tag: str


def test_with_twins_rebuilds_only_the_way_to_each_tensor():
    from transformers.modeling_outputs import BaseModelOutput

    t, u = torch.randn(2), torch.randn(3)
    payload, untouched = NeverCopy(), [1, "a", NeverCopy()]
    cycle: dict = {"t": t}
    cycle["self"] = cycle
    value = {
        "pair": Pair(t, 1), "frozen": Frozen(u, "tag"), "out": BaseModelOutput(last_hidden_state=t),
        "max": torch.randn(2, 3).max(dim=1), "dd": collections.defaultdict(list, {"k": [u]}),
        "set": frozenset({t, 1}), "cycle": cycle, "payload": payload, "untouched": untouched,
    }
    new = with_twins(value, meta_twin)
    assert new is not value and new["payload"] is payload and new["untouched"] is untouched
    assert type(new["pair"]) is Pair and new["pair"].first.is_meta and new["pair"].second == 1
    assert type(new["frozen"]) is Frozen and new["frozen"].x.is_meta and value["frozen"].x is u
    out = new["out"]
    assert type(out) is BaseModelOutput and out.last_hidden_state.is_meta and out["last_hidden_state"] is out[0]
    assert type(new["max"]) is type(value["max"]) and new["max"].values.is_meta
    assert new["dd"].default_factory is list and new["dd"]["k"][0].is_meta and value["dd"]["k"][0] is u
    assert {x.is_meta for x in new["set"] if isinstance(x, torch.Tensor)} == {True} and 1 in new["set"]
    assert new["cycle"]["self"] is new["cycle"] and new["cycle"]["t"] is new["pair"].first  # one twin per tensor
    assert value["cycle"]["t"] is t and not t.is_meta
