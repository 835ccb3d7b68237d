"""Records of a parallel job: each collective call a rank makes in a step, and the rank roles of a plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fxflops.results.captured import FORWARD

from fxflops.results.collective_kinds import (  # noqa: F401 - the kinds of collective (Collective.op)
    ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BARRIER, BROADCAST, GATHER, RECV, REDUCE, REDUCE_SCATTER, SCATTER, SEND)


@dataclass(frozen=True)
class Collective:
    """One collective call of the counted rank.

    `bytes` is the payload: the whole buffer the collective works on, per rank (an all-reduce's tensor,
    an all-gather's gathered output, a reduce-scatter's full input, an all-to-all's input, the tensor
    sent or received). `wire_bytes` is what this rank puts on the wire under the usual ring algorithms:
    all-reduce 2(n-1)/n of the buffer, all-gather, reduce-scatter and all-to-all (n-1)/n, broadcast
    and send the buffer once, a receive nothing (its sender counts it)."""

    op: str  # ALL_REDUCE, ALL_GATHER, ... (the kind; `target` is the exact torch op)
    target: str  # e.g. "_c10d_functional.all_reduce.default", "c10d._allgather_base_.default"
    module: str  # qualified name of the module that ran it ("" = the root)
    phase: str  # "forward", "backward" (or "recompute")
    group: str  # the process group's name
    group_desc: str  # its description: a DeviceMesh dimension's group reads "mesh_<dim name>"
    group_size: int
    dtype: str
    bytes: int
    wire_bytes: int
    node: str = ""  # the graph node that recorded it
    # a what-if plan's data-parallel gradient reduction (DDP's all-reduce, FSDP's reduce-scatter, HSDP's
    # all-reduce): once per optimizer step under gradient accumulation (no_sync() / set_requires_gradient_sync
    # (False) until the last micro-batch, as torch.distributed.pipelining's schedules do); every other
    # collective runs once per micro-batch
    per_step: bool = False
    # a point-to-point op (send/recv) of a torch.distributed.pipelining schedule's step: the global rank at the
    # other end, the pipeline stage that issued it and its micro-batch (None where unknown or not a schedule's)
    peer: int | None = None
    stage: int | None = None
    micro_batch: int | None = None

    @property
    def is_backward(self) -> bool:
        return self.phase != FORWARD


@dataclass(frozen=True)
class RankRole:
    """Ranks of a parallel plan that run the same ops, captured once: `estimate` is any one of them."""

    name: str  # e.g. "every rank", "pipeline stage 0"
    ranks: tuple[int, ...]
    estimate: Any  # the Estimate of one of these ranks (Any: results.estimate imports this module)
