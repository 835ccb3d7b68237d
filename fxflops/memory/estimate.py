"""est.memory: the captured step's timeline, the optimizer's share, the peak and the allowance."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch

from fxflops.capture.model_state import MODEL_STATE
from fxflops.memory.devices import device_capacity
from fxflops.memory.optimizer_state import optimizer_memory
from fxflops.memory.records import (
    ACTIVATIONS,
    BUFFERS,
    GRADIENTS,
    OPTIMIZER,
    PARAMETERS,
    TEMPORARIES,
    Allowance,
    AllowanceBytes,
    MemoryEstimate,
)
from fxflops.capture.sharded import is_dtensor
from fxflops.memory.timeline import build_timeline, live_at, local
from fxflops.results import FORWARD, Captured


@dataclass(frozen=True)
class MemoryOptions:
    """How the step is run. `master_weights`: the optimizer keeps fp32 master weights and moments for
    half-precision parameters (Megatron, DeepSpeed; torch.optim itself keeps moments like the parameter).
    `allowance`: what the device needs beyond tensor bytes (stated apart, never in peak_bytes)."""

    master_weights: bool = False
    allowance: Allowance = field(default_factory=Allowance)
    device: str | None = None  # a device of the peaks table ("H100 SXM"): whether the step fits on it
    device_bytes: int | None = None  # its memory, when the table has none or you know better
    # the gradients exist when the step starts: a micro-batch after the first under gradient accumulation,
    # or zero_grad(set_to_none=False); the backward adds into them
    grads_at_start: bool = False
    # the caller holds the model's output until the step ends (a loop that keeps `out = model(x)` through
    # `loss.backward()`); False: only what autograd saves of it stays (torchtitan deletes its `pred` before the
    # backward, Megatron's GPTModel and Hugging Face's Trainer keep only the loss)
    output_held: bool = True


def estimate_memory(captured: Captured, optimizer: str | torch.optim.Optimizer | None = None,
                    options: MemoryOptions | None = None, nodes: Collection[str] | None = None,
                    holds: Callable[[str], bool] | None = None) -> MemoryEstimate:
    """The tensor bytes one rank holds through the captured step (and the optimizer step, if given).
    A pipeline stage's: `nodes`, the op nodes it runs, and `holds(name)`, whether it holds the parameter
    or buffer of that qualified name (its gradient and optimizer state too)."""
    options = options or MemoryOptions()
    device, capacity = options.device, options.device_bytes
    if device is not None and capacity is None:
        device, capacity = device_capacity(device)  # before the work: an unknown device is one line
    graph_module = captured.graph_module
    state = graph_module.meta.get(MODEL_STATE)
    if state is None:
        raise ValueError(f"memory=True reads the eager capture's record; this model was captured by "
                         f"{captured.method!r}: pass method='eager' (or leave memory off)")
    if captured.sizes is not None:
        raise ValueError("memory needs concrete sizes: estimate the step at one size (no sizes=)")
    if holds is not None:
        state = dataclasses.replace(state, parameters={k: v for k, v in state.parameters.items() if holds(k)},
                                    buffers={k: v for k, v in state.buffers.items() if holds(k)},
                                    grads={k: v for k, v in state.grads.items() if holds(k)})
    notes = []
    optimizer_state = optimizer_step = 0
    label = ""
    if optimizer is not None:
        sharded = any(is_dtensor(p) for p in state.parameters.values())
        if isinstance(optimizer, torch.optim.Optimizer) and not sharded and holds is None:
            params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        else:  # under a parallel plan: the rank's local shards, which its optimizer steps
            params = [local(p) for p in state.parameters.values() if p.requires_grad]
        found = optimizer_memory(optimizer, params, master_weights=options.master_weights)
        optimizer_state, optimizer_step, label = found.state_bytes, found.step_bytes, found.how
        notes.append("a step after the first: the optimizer's state exists from the start; "
                     "zero_grad(set_to_none=True) frees the gradients after the step")
    points, storages = build_timeline(graph_module, optimizer_state=optimizer_state, optimizer_step=optimizer_step,
                                      optimizer_label=label, grads_at_start=options.grads_at_start,
                                      nodes=nodes, state=state, output_held=options.output_held)
    peak = max(points, key=lambda point: point.total)  # the first point at the highest total
    alive = live_at(storages, peak.index)
    by_module: dict[str, int] = {}
    for storage in alive:
        if storage.kind in (ACTIVATIONS, TEMPORARIES):
            by_module[storage.module] = by_module.get(storage.module, 0) + storage.nbytes
    by_module = dict(sorted(by_module.items(), key=lambda item: -item[1]))
    forward_end = max((point.index for point in points if point.phase == FORWARD), default=0)
    saved: dict[str, int] = {}
    saved_by_node: dict[str, int] = {}
    for storage in live_at(storages, forward_end, lambda s: s.kind == ACTIVATIONS):
        saved[storage.module] = saved.get(storage.module, 0) + storage.nbytes
        made_by = points[storage.born].node
        saved_by_node[made_by] = saved_by_node.get(made_by, 0) + storage.nbytes
    start = points[0].by_kind
    model_states = {kind: start[kind] for kind in (PARAMETERS, BUFFERS, OPTIMIZER)}
    model_states[GRADIENTS] = sum(s.nbytes for s in storages.values() if s.kind == GRADIENTS)
    if not options.output_held:
        notes.append("the model's output held only as autograd saves it (the loop keeps the loss, not the output)")
    if options.grads_at_start:
        notes.append("the gradients exist from the start (accumulation, or zero_grad(set_to_none=False))")
    allowance = options.allowance
    sizes = [s.nbytes for s in alive]
    if optimizer_state:  # the optimizer's state rounded as one block (per tensor: at most 511 bytes more each)
        sizes.append(optimizer_state)
    allowance_bytes = AllowanceBytes(allowance.rounding(sizes), allowance.context_bytes, allowance.collective_bytes,
                                     int(allowance.fragmentation * peak.total))
    return MemoryEstimate(peak.total, dict(peak.by_kind), peak, by_module, points, model_states,
                          label or None, allowance, allowance_bytes, notes, saved, device, capacity, saved_by_node)
