"""A model already split with torch.distributed.pipelining: one PipelineStage counted as the rank runs it.

estimate(stage, inputs) counts the stage's own module (`stage.submod`) on one micro-batch of its inputs —
for a stage other than the first, the activations it receives, which need a gradient (the stage makes
its received activations require one when it runs a backward) — and adds what the stage sends and
receives per micro-batch: the inputs received forward and their gradients sent back (not on the first
stage), the outputs sent forward and their gradients received back (not on the last). The backward of a
stage other than the last starts from its outputs' gradients (the capture's default: ones, not recorded);
the last stage's is the loss's (`loss=`). The send/recv records are derived from the stage, not recorded
from its schedule (a schedule's step() is not run).
"""

from __future__ import annotations

from typing import Any

import torch

from fxflops.capture.tensor_walk import tensors_in
from fxflops.parallel.collectives import wire_bytes
from fxflops.results import BACKWARD, FORWARD, Estimate
from fxflops.results.parallel import RECV, SEND, Collective


def stage_inputs(stage: Any, args: tuple, backward: bool) -> tuple:
    """The micro-batch as the stage runs it: a received floating activation requires a gradient when the
    backward is counted (detached copies; the caller's tensors are left as they are)."""
    if stage.is_first or not backward:
        return args
    return tuple(arg.detach().requires_grad_(True) if isinstance(arg, torch.Tensor) and arg.is_floating_point()
                 else arg for arg in args)


def stage_records(stage: Any, args: tuple, estimate: Estimate) -> list[Collective]:
    """The stage's send/recv per micro-batch: inputs received (and their gradients sent back) unless it is
    the first stage; outputs sent (and their gradients received) unless it is the last."""
    group = stage.group
    if group is None:
        import torch.distributed as dist

        group = dist.distributed_c10d._get_default_group()
    size = stage.group_size
    name, desc = group.group_name, getattr(group, "group_desc", "") or ""

    def record(kind: str, phase: str, tensor: torch.Tensor) -> Collective:
        payload = tensor.numel() * tensor.element_size()
        return Collective(op=kind, target="c10d.send.default" if kind == SEND else "c10d.recv_.default", module="",
                          phase=phase, group=name, group_desc=desc, group_size=size,
                          dtype=str(tensor.dtype).removeprefix("torch."), bytes=payload,
                          wire_bytes=wire_bytes(kind, payload, size), node="")

    backward = estimate.backward
    before, after, back_in, back_out = [], [], [], []
    if not stage.is_first:
        for tensor in tensors_in(args):
            before.append(record(RECV, FORWARD, tensor))
            if backward and tensor.requires_grad:
                back_out.append(record(SEND, BACKWARD, tensor))
    if not stage.is_last:
        for tensor in _outputs(estimate):
            after.append(record(SEND, FORWARD, tensor))
            if backward and tensor.requires_grad:
                back_in.append(record(RECV, BACKWARD, tensor))
    forward = [c for c in estimate.collectives if not c.is_backward]
    behind = [c for c in estimate.collectives if c.is_backward]
    return before + forward + after + back_in + behind + back_out


def _outputs(estimate: Estimate) -> list[torch.Tensor]:
    graph = estimate.source.captured.graph_module.graph
    found = []
    for node in graph.find_nodes(op="output"):
        for value in node.all_input_nodes:
            found += [t for t in tensors_in(value.meta.get("val")) if t.is_floating_point()]
    return found
