"""Run by tests/test_meter.py under `torchrun --nproc_per_node 2` (gloo, CPU): each rank trains its own
batch shapes, counts them with a FlopsMeter, and writes what it saw to OUT/<kind>-rank<k>.json."""

from __future__ import annotations

import json
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

import fxflops
from fxflops import FlopsMeter


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def main(kinds: list[str], out: str) -> None:
    dist.init_process_group("gloo")
    for kind in kinds:
        train(kind, out)
    dist.destroy_process_group()


def train(kind: str, out: str) -> None:
    rank = dist.get_rank()
    model = build()
    sizes = [3 + rank, 5 + 2 * rank, 2 + rank]  # every rank its own batch sizes
    meter = FlopsMeter(model, torch.randn(2, 8), peak_flops=1e12)  # built before the model is wrapped
    if kind == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        wrapped = fully_shard(model)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    local, logged = [], []
    for step, size in enumerate(sizes):
        x = torch.randn(size, 8)
        meter.start()
        wrapped(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        stats = meter.step(x)
        local.append(stats.flops)
        if rank == 0:  # only rank 0 logs its own figures: no collective in here
            meter.metrics()
            meter.summary()
        if step == 1:  # a logging step: every rank reduces
            logged.append(meter.reduce().flops)
    total = meter.reduce(meter.total())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # of the model's own arithmetic: an unwrapped twin (fully_shard changed the model's class in place)
        estimates = [fxflops.estimate(build(), (torch.randn(size, 8),), backward=True).total_flops for size in sizes]
    with open(f"{out}/{kind}-rank{rank}.json", "w") as file:
        json.dump({"local": local, "estimates": estimates, "logged": logged, "total": total.flops,
                   "world": total.world_size, "captures": meter.captures, "mfu": total.mfu,
                   "time": total.time, "peak": total.peak_flops}, file)


if __name__ == "__main__":
    main(sys.argv[1].split(","), sys.argv[2])
