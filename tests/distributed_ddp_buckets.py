"""Run by tests/test_parallel_buckets.py under `torchrun --nproc_per_node 2` (gloo, CPU, 127.0.0.1): a small
Llama wrapped in torch's DistributedDataParallel with bucket_cap_mb=CAP trains three real steps (DDP rebuilds
its buckets after the first, from the order the gradients became ready); rank 0 writes the bytes of each
rebuilt bucket, in the order they are all-reduced, to OUT/buckets.json.

    torchrun --nproc_per_node 2 tests/distributed_ddp_buckets.py OUT CAP"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from tests.parallel_models import Llama


def main(out: str, cap_mb: float) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(Llama(256, 64, 2, 8, 128), bucket_cap_mb=cap_mb)
    for _ in range(3):
        ddp(torch.zeros(1, 8, dtype=torch.long)).sum().backward()
    logged = ddp._get_ddp_logging_data()
    if dist.get_rank() == 0:
        with open(f"{out}/buckets.json", "w") as file:
            json.dump({"rebuilt": logged.get("has_rebuilt_buckets"),
                       "sizes": [int(size) for size in str(logged.get("rebuilt_bucket_sizes", "")).split(",")]}, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
