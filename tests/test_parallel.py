"""One rank of a parallel job: what a rank runs under torch.distributed's own fake process group.

Every number is a hand count of the rank's LOCAL work (the fake group: 8 ranks, no process per rank).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

import fxflops
from tests.parallel_models import UpDownMLP

B, S, H, F, WORLD = 4, 128, 1024, 4096, 8


def MLP() -> UpDownMLP:  # noqa: N802 - read as the class it builds
    return UpDownMLP(H, F)


@pytest.fixture
def fake_group():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        yield init_device_mesh("cpu", (WORLD,))
    finally:
        dist.destroy_process_group()


def tp_mlp(mesh) -> UpDownMLP:
    with torch.device("meta"):
        model = MLP()
    return parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def test_one_rank_counts_its_local_shards_forward(fake_group):
    est = fxflops.estimate(tp_mlp(fake_group), (torch.randn(B, S, H, device="meta"),), conventions="torch")
    # each rank: x (B*S, H) @ W_up shard (H, F/8), then (B*S, F/8) @ W_down shard (F/8, H)
    local = 2 * (2 * B * S * H * F // WORLD)
    assert local == 1_073_741_824
    assert est.total_flops == local
    assert est.modules["up"].flops == est.modules["down"].flops == local // 2
    assert est.total_params == 2 * H * F // WORLD  # the rank's shards of both weights


def test_one_rank_counts_its_local_shards_backward(fake_group):
    x = torch.randn(B, S, H, device="meta", requires_grad=True)
    est = fxflops.estimate(tp_mlp(fake_group), (x,), conventions="torch", backward=True)
    assert est.fwd_flops == 1_073_741_824
    # grad input and grad weight of both local matmuls: twice the forward
    assert est.bwd_flops == 2 * 1_073_741_824


def test_the_model_keeps_its_dtensor_parameters(fake_group):
    model = tp_mlp(fake_group)
    weight = model.up.weight
    fxflops.estimate(model, (torch.randn(B, S, H, device="meta"),), backward=True)
    assert model.up.weight is weight and weight.grad is None
    assert type(weight).__name__ == "DTensor" and weight.to_local().shape == (F // WORLD, H)


# --- collectives ------------------------------------------------------------------------------------


def test_the_issue_mlp_reports_one_all_reduce_each_way(fake_group):
    x = torch.randn(B, S, H, device="meta", requires_grad=True)
    est = fxflops.estimate(tp_mlp(fake_group), (x,), conventions="torch", backward=True)
    payload = B * S * H * 4  # float32 activations (b, s, h): RowwiseParallel's output, and grad of x
    wire = 2 * (WORLD - 1) * payload // WORLD
    got = [(c.op, c.phase, c.module, c.group_size, c.dtype, c.bytes, c.wire_bytes) for c in est.collectives]
    assert got == [("all_reduce", "forward", "down", WORLD, "float32", payload, wire),
                   ("all_reduce", "backward", "up", WORLD, "float32", payload, wire)]
    assert est.collective_bytes == 2 * payload == 2 * 2_097_152
    assert est.collective_wire_bytes == 2 * 3_670_016
    assert not est.unknown  # collectives and their waits are known ops of zero FLOPs


def _inclusive_counts(est) -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = {}
    for c in est.collectives:
        parts = c.module.split(".") if c.module else []
        for depth in range(len(parts) + 1):
            key = (".".join(parts[:depth]), c.phase)
            counts[key] = counts.get(key, 0) + 1
    return counts


def comm_debug_counts(comm) -> dict[tuple[str, str], int]:
    """CommDebugMode's collective calls per (module path, phase), inclusive of submodules as it counts them."""
    counts = {}
    for name, phases in comm.comm_module_counts.items():
        if name == "Global":
            continue
        module = name.split(".", 1)[1] if "." in name else ""
        for phase, ops in phases.items():
            if sum(ops.values()):
                counts[(module, phase)] = sum(ops.values())
    return counts


def test_collective_counts_per_module_equal_comm_debug_mode(fake_group):
    from torch.distributed.tensor.debug import CommDebugMode

    model = parallelize_module(MLP(), fake_group, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.randn(2, 8, H, requires_grad=True)
    with CommDebugMode() as comm:
        model(x).sum().backward()
    expected = comm_debug_counts(comm)
    for parameter in model.parameters():
        parameter.grad = None
    est = fxflops.estimate(model, (x,), backward=True)
    assert _inclusive_counts(est) == expected == {("", "forward"): 1, ("down", "forward"): 1,
                                                  ("", "backward"): 1, ("up", "backward"): 1}


class PlainCalls(torch.nn.Module):
    """torch.distributed's own calls in a forward, as user code makes them."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        dist.all_reduce(y)
        gathered = torch.empty(WORLD * y.shape[0], 16)
        dist.all_gather_into_tensor(gathered, y)
        dist.broadcast(gathered, 0)
        return gathered


def test_plain_torch_distributed_calls_are_collectives(fake_group):
    with warnings.catch_warnings():  # (torch 2.14 deprecates all_gather_into_tensor with a FutureWarning, 2.11 not)
        warnings.simplefilter("ignore", FutureWarning)
        est = fxflops.estimate(PlainCalls(), (torch.randn(8, 16),))
    small, large = 8 * 16 * 4, WORLD * 8 * 16 * 4
    assert [(c.op, c.bytes, c.wire_bytes, c.group_size, c.module) for c in est.collectives] == [
        ("all_reduce", small, 2 * (WORLD - 1) * small // WORLD, WORLD, ""),
        ("all_gather", large, (WORLD - 1) * large // WORLD, WORLD, ""),
        ("broadcast", large, large, WORLD, ""),
    ]
    assert not est.unknown


def test_collectives_in_the_text_report_and_json(fake_group):
    from fxflops.report.machine import from_dict

    est = fxflops.estimate(tp_mlp(fake_group), (torch.randn(1, 4, H, device="meta"),))
    text = est.print(as_string=True, detailed=False)
    assert "Collectives of this rank per step" in text and "all_reduce" in text
    record = est.to_dict()
    assert record["collective_bytes"] == {"bytes": 4 * H * 4, "wire_bytes": 2 * 7 * 4 * H * 4 // 8}
    assert from_dict(record).collectives == est.collectives


def test_no_collectives_without_a_process_group():
    est = fxflops.estimate(MLP(), (torch.randn(1, 2, H),))
    assert est.collectives == [] and est.collective_bytes == 0
    assert "Collectives" not in est.print(as_string=True, detailed=False)


def test_a_users_fsdp2_model_counts_its_gathers_and_reduce_scatters(fake_group):
    from torch.distributed.fsdp import fully_shard

    from tests.parallel_models import Llama

    model = Llama()  # real weights, sharded for real over the 8 fake ranks
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    tokens = torch.zeros(2, 16, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # FSDP2 reads a FakeTensor's data pointer, and says so
        est = fxflops.estimate(model, (tokens,), conventions="torch", backward=True)
    block = 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64
    params = 256 * 64 * 2 + 64 + 2 * block
    totals = {key: (v["count"], v["bytes"]) for key, v in est.collective_totals(("phase", "op")).items()}
    # fully_shard's default: the root keeps its parameters gathered from the forward into the backward
    assert totals == {("forward", "all_gather"): (3, params * 4), ("backward", "all_gather"): (2, 2 * block * 4),
                      ("backward", "reduce_scatter"): (3, params * 4)}
    assert est.total_params == params // WORLD
    model(tokens).sum().backward()  # and the model still trains
