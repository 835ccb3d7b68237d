"""Run by tests/test_parallel_plans.py under `torchrun --nproc_per_node 2` (gloo, CPU, 127.0.0.1): each rank
shards a small Llama tensor-parallel with torch's parallelize_module (the plan fxflops derives), trains one
real step, and counts its own local work with fxflops.estimate inside the real process group; it writes
what it saw to OUT/rank<k>.json.

    torchrun --nproc_per_node 2 tests/distributed_parallel.py OUT"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module

import fxflops
from fxflops.parallel.megatron import megatron_plan
from tests.parallel_models import Llama


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = Llama()
    model = parallelize_module(model, mesh, megatron_plan(model))
    tokens = torch.randint(0, 256, (2, 16))
    with CommDebugMode() as comm:  # one real step: it must not hang, and torch's own collective count
        model(tokens).sum().backward()
    est = fxflops.estimate(model, (tokens,), conventions="torch", backward=True)
    with open(f"{out}/rank{rank}.json", "w") as file:
        json.dump({"fwd": est.fwd_flops, "bwd": est.bwd_flops, "collectives": len(est.collectives),
                   "torch_collectives": comm.get_total_counts(), "wire": est.collective_wire_bytes}, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
