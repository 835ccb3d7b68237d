"""One rank of a parallel job: what a rank runs under torch.distributed's own fake process group.

Every number is a hand count of the rank's LOCAL work (the fake group: 8 ranks, no process per rank).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

import fxflops

B, S, H, F, WORLD = 4, 128, 1024, 4096, 8


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(H, F, bias=False)
        self.down = torch.nn.Linear(F, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


@pytest.fixture
def fake_group():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        yield init_device_mesh("cpu", (WORLD,))
    finally:
        dist.destroy_process_group()


def tp_mlp(mesh) -> MLP:
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
