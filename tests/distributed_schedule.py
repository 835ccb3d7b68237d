"""Run by tests/test_parallel_schedule.py under `torchrun --nproc_per_node 2` (gloo, CPU, 127.0.0.1): a 2-stage
pipeline (each rank one stage of two linears) trains one real Schedule1F1B step. Each rank logs what it really
did - every point-to-point op torch dispatched (kind, bytes, peer) and FlopCounterMode's FLOPs of the step -
and what fxflops.estimate(schedule, ...) says inside the real process group after the real step (before it,
one clear error: the schedule's first step votes with the other ranks). Then the same two stages split by
torch's tracer (pipeline(..., split_spec=) and build_stage), estimated before their first real step (no vote:
nothing to refuse), and that first real step's point-to-point ops and FLOPs;
it writes them to OUT/rank<k>.json.

    torchrun --nproc_per_node 2 tests/distributed_schedule.py OUT"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, SplitPoint, pipeline
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import fxflops

W, ROWS, M = 16, 8, 4  # as tests/test_parallel_schedule.py


class P2PLog(TorchDispatchMode):
    """Every c10d send/recv the real step dispatches: (kind, bytes, global peer), in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[list] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if func.namespace == "c10d" and name in ("send", "recv_"):
            group = dist.ProcessGroup.unbox(args[1])
            for tensor in args[0]:
                self.ops.append(["send" if name == "send" else "recv", tensor.numel() * tensor.element_size(),
                                 dist.get_global_rank(group, int(args[2]))])
        return func(*args, **(kwargs or {}))


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).square().sum()


def estimated(schedule, args, kwargs) -> dict:
    est = fxflops.estimate(schedule, args, kwargs, conventions="torch")
    return {"fwd": est.fwd_flops, "bwd": est.bwd_flops,
            "p2p": [[c.op, c.phase, c.stage, c.micro_batch, c.peer, c.bytes, c.wire_bytes] for c in est.collectives]}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(W, W, bias=False), torch.nn.Linear(W, W, bias=False))
    example = torch.empty(ROWS // M, W, requires_grad=True)
    stage = PipelineStage(model, rank, 2, torch.device("cpu"), input_args=(example,), output_args=(example,))
    schedule = Schedule1F1B(stage, M, loss_fn=loss)
    args = (torch.randn(ROWS, W),) if rank == 0 else ()
    kwargs = {"target": torch.randn(ROWS, W)} if rank == 1 else {}
    try:  # a schedule that has not stepped yet: its first step votes over the real group
        estimated(schedule, args, kwargs)
        refused = ""
    except ValueError as error:
        refused = str(error)
    log, flops = P2PLog(), FlopCounterMode(display=False)
    with flops, log:
        schedule.step(*args, **kwargs)
    after = estimated(schedule, args, kwargs)  # nothing sent: the other rank need not be estimating too
    torch.manual_seed(0)  # the tracer traces the whole model on each rank
    whole = torch.nn.Sequential(*(torch.nn.Linear(W, W, bias=False) for _ in range(4)))
    traced_stage = pipeline(whole, (example.detach(),), split_spec={"2": SplitPoint.BEGINNING}).build_stage(
        rank, torch.device("cpu"))
    traced = Schedule1F1B(traced_stage, M, loss_fn=loss)
    traced_before = estimated(traced, args, kwargs)  # before any real step
    traced_log, traced_flops = P2PLog(), FlopCounterMode(display=False)
    with traced_flops, traced_log:
        traced.step(*args, **kwargs)
    dist.barrier()
    with open(f"{out}/rank{rank}.json", "w") as file:
        json.dump({"refused": refused, "after": after, "real_p2p": log.ops, "real_flops": flops.get_total_flops(),
                   "traced": traced_before, "traced_real_p2p": traced_log.ops,
                   "traced_real_flops": traced_flops.get_total_flops()}, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
